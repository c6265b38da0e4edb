"""Each xdist worker runs torch on its share of the CPUs (a pytest plugin; tests/conftest.py
loads it).

torch gives every process one intra-op (OpenMP) thread per CPU. `pytest -n 2` on 2 CPUs thus
runs 4 OpenMP threads on 2 CPUs, and the tests' tensors are tiny: a torch call's parallel
region then waits for a thread the other worker holds, and libgomp spins while it waits. On
this project's 2-CPU machine, test_sink_share_matches_float64_reference_with_every_mask ran
8 to 14 times slower (wall and CPU alike) with 2 threads a worker than with 1. So each worker
takes CPUs // workers threads (at least 1), the count `serve` would see on that many CPUs.

Set after collection, not at start: skip marks read torch.get_num_threads() at import
(tests/service/api/test_intra_op_threads.py probes the service's thread handling in fresh
interpreters, which keep torch's own count). A run without xdist (-n 0) is left alone.
"""

from __future__ import annotations

import os

import pytest


def _share_of_the_cpus(workers: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // workers)


def pytest_collection_finish(session: pytest.Session) -> None:
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is None:  # no xdist, or its controller (which runs no test)
        return
    import torch  # here, not at the top: xdist's controller runs no test and needs no torch

    threads = _share_of_the_cpus(int(workerinput["workercount"]))
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)
