"""Batching policy: which prepared jobs may share one device call, and how much one call holds.

Group keys
----------
Two jobs share a batch only when everything that changes the math is equal (device, dtype,
head dims, head counts, causal alignment, scale, mask kind, outputs asked for) and their N_q and
N_kv fall in the same length bucket (see length_bucket). A job whose padded scores would take
more than half a call's budget runs alone: nothing of its size fits beside it.

Cost
----
A job's cost is an upper bound of its share of the batch's padded score matrix
[B, H, N_q, N_kv] in the accumulation dtype, computed with the bucket lengths, so the costs of a
batch's members add up to at least its padded score bytes. The batcher cuts batches at
max_batch_cost, and split_by_memory cuts a group at the real padded size.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from sdpa_core import InputSpec, analysis_passes, choose_path, score_matrix_nbytes
from service.runtime.jobs import AnalyzeJob, AttentionJob, PreparedJob

# A batch grows only while its padded score matrix [B, H, N_q, N_kv] (accumulation dtype) fits
# this budget; a single request always runs. On a GPU the budget bounds memory: batching pays
# for itself through fewer kernel launches and fuller occupancy. On a CPU one call costs only
# ~0.1 ms of overhead, and batching pays only while the batch's working set stays in the core's
# L2 cache (about 1 MiB here): measured on a 2-core EPYC (torch 2.13, one intra-op thread),
# [4, 64, 64] requests ran 1.4-1.6x faster per item in batches of 4-16 (64 KiB of scores
# each), while [8, 256, 256] requests with weights ran 0.5-0.9x as fast in any batch (2 MiB of
# scores each: every batch spills to L3/DRAM). So CPU batches are sized to ~L2.
MAX_BATCH_SCORE_BYTES: Final = {"cpu": 1024 * 1024, "cuda": 256 * 1024 * 1024}

# Unique keys for jobs that must run alone (analysis, requests too large to share a call).
_ALONE = itertools.count()


def length_bucket(n: int) -> int:
    """The length bucket of a sequence length: n rounded up to three significant bits.

    Buckets: 1, 2, ..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, ...
    (four per doubling). Requests share a batch only within a bucket of N_q and of N_kv, and
    are padded to the group's maximum, so in every bucket max/min < 1.25: a request is padded
    by under 25% per length and its N_q * N_kv work by under 1.25^2 = 1.56x in the worst
    case (typically far less, since the group maximum is usually close to most members).

    Why geometric: attention's cost grows as N_q * N_kv, so what must stay bounded is the
    *relative* padding, at every scale. Fixed multiples (ceil to 64) pad a 10-token request
    6x and are needlessly fine for 8k-token ones; powers of two bound the waste only by 4x.
    Four buckets per doubling keep the count small (about 40 between 16 and 16k), so traffic
    of similar lengths still meets in one batch. Lengths up to 8 are exact: decode-style
    requests (N_q = 1) would otherwise be padded many times over.
    """
    if n <= 0:
        return n
    step = 1 << max(0, (n - 1).bit_length() - 3)
    return -(-n // step) * step


def padded_score_bytes(*, rows: int, spec: InputSpec, n_q: int, n_kv: int) -> int:
    """Bytes of a [rows, H, n_q, n_kv] score matrix for inputs like `spec`'s."""
    return score_matrix_nbytes(batch=rows, heads=spec.heads, n_q=n_q, n_kv=n_kv, dtype=spec.dtype)


@dataclass(frozen=True, slots=True)
class Member:
    """A prepared attention job and where its rows sit in a batch."""

    index: int  # position in run_batch's input
    job: AttentionJob
    spec: InputSpec
    offset: int = 0  # first row of the batch dim


class BatchPolicy:
    """Group keys and costs for the batcher, sub-batches for the engine (one device's budget)."""

    def __init__(self, max_batch_score_bytes: int) -> None:
        self.max_batch_score_bytes = max_batch_score_bytes

    @property
    def max_batch_cost(self) -> float:
        """The budget batch_cost() sums to: padded score bytes per device call."""
        return float(self.max_batch_score_bytes)

    def batch_cost(self, prepared: PreparedJob) -> float:
        """An upper bound of the job's share of a batch's padded score matrix, in bytes."""
        if isinstance(prepared.job, AnalyzeJob):
            return 0.0
        spec = prepared.spec
        return float(
            padded_score_bytes(
                rows=spec.batch,
                spec=spec,
                n_q=length_bucket(spec.n_q),
                n_kv=length_bucket(spec.n_kv),
            )
        )

    def group_key(self, prepared: PreparedJob) -> Hashable:
        """Jobs with equal keys may run as one batch (see the module docstring)."""
        job, spec = prepared.job, prepared.spec
        if isinstance(job, AnalyzeJob):
            return ("analyze", next(_ALONE))
        if self.batch_cost(prepared) > self.max_batch_cost / 2:
            # No other request of its size fits beside it in one call: it runs alone, and the
            # batcher never holds it back to wait for (or behind) same-group requests.
            return ("alone", next(_ALONE))
        mask = job.masks.attn_mask
        return (
            "attention",
            str(job.q.device),
            str(spec.dtype),
            spec.d,
            spec.d_v,
            spec.heads,
            spec.kv_heads,
            spec.causal,
            job.scale,
            bool(job.return_weights),
            job.diagnostics,
            # The mask kind changes the math (bias vs visibility) and the kernel.
            "none" if mask is None else str(mask.dtype),
            length_bucket(spec.n_q),
            length_bucket(spec.n_kv),
        )

    def split_by_memory(self, members: Sequence[Member]) -> list[list[Member]]:
        """Consecutive sub-batches whose padded score matrix fits the batch budget."""
        batches: list[list[Member]] = []
        current: list[Member] = []
        rows = n_q = n_kv = 0
        for member in members:
            spec = member.spec
            grown = padded_score_bytes(
                rows=rows + spec.batch, spec=spec, n_q=max(n_q, spec.n_q), n_kv=max(n_kv, spec.n_kv)
            )
            if current and grown > self.max_batch_score_bytes:
                batches.append(current)
                current, rows, n_q, n_kv = [], 0, 0, 0
            current.append(member)
            rows += spec.batch
            n_q, n_kv = max(n_q, spec.n_q), max(n_kv, spec.n_kv)
        if current:
            batches.append(current)
        return batches


# ---- the cost model ------------------------------------------------------------------------

# Paths of sdpa_core.attention, plus the scaling analysis (its own kind of job).
COST_PATHS: Final = ("fused", "dense", "chunked", "analyze")
# Element-wise operations per score and strategy in the scaling analysis (divide, softmax,
# entropy, max, p(1 - p), variance terms): what its cost grows with besides q.k.
ANALYZE_OPS_PER_SCORE: Final = 16
# Before calibration (and if it fails): about a third of what a 2-core CPU measured (torch
# 2.13), so that the limits err on the side of refusing.
UNCALIBRATED: Final = {
    "fused": (1 / 50e9, 32, 1e-4),
    "dense": (1 / 10e9, 128, 3e-3),
    "chunked": (1 / 10e9, 128, 3e-3),
    "analyze": (1 / 3e9, 128, 1e-2),
}


@dataclass(frozen=True, slots=True)
class WorkShape:
    """What a request's cost grows with: its score matrix and head dims (and, for the scaling
    analysis, how many strategies it evaluates)."""

    batch: int
    heads: int
    n_q: int
    n_kv: int
    d: int
    d_v: int
    strategies: int = 0

    @property
    def scores(self) -> int:
        return self.batch * self.heads * self.n_q * self.n_kv


@dataclass(frozen=True, slots=True)
class PathCost:
    """One path on one device: seconds per FLOP, the head dim below which a smaller one is no
    cheaper (the per-score work, softmax and statistics, dominates there), and the fixed
    seconds of one call (launches, allocations; what a tiny request costs)."""

    seconds_per_flop: float
    d_floor: int
    overhead_s: float = 0.0


def path_flops(shape: WorkShape, path: str, d_floor: int) -> float:
    """FLOPs with every head dim raised to d_floor (D_eff = max(D, floor)): attention is q.k
    and p.v, 2·S·(D_eff + D_v_eff) for S scores; the analysis is q.k once, 2·S·D_eff, then
    every strategy's softmax statistics, ANALYZE_OPS_PER_SCORE per score."""
    d = max(shape.d, d_floor)
    if path == "analyze":
        return float(shape.scores) * (2.0 * d + ANALYZE_OPS_PER_SCORE * shape.strategies)
    return 2.0 * shape.scores * (d + max(shape.d_v, d_floor))


def job_work(prepared: PreparedJob) -> tuple[WorkShape, str]:
    """A prepared job in the cost model's terms: its work shape and the path it runs on (the
    work limit and the backlog read it here)."""
    job, spec = prepared.job, prepared.spec
    if isinstance(job, AnalyzeJob):
        passes = analysis_passes(job.strategies, spec.d)
        return WorkShape(spec.batch, spec.heads, spec.n_q, spec.n_kv, spec.d, spec.d, passes), (
            "analyze"
        )
    path = choose_path(
        spec,
        return_weights=job.return_weights,
        diagnostics=job.diagnostics,
        memory_budget_bytes=None,
        path=None,
    )
    return WorkShape(spec.batch, spec.heads, spec.n_q, spec.n_kv, spec.d, spec.d_v), path


@dataclass(frozen=True, slots=True)
class CostModel:
    """Each path's cost on one device, measured at warm-up (service.runtime.engine).

    A request's work is counted in fused-equivalent FLOPs: its estimated device seconds over
    the fused path's seconds per FLOP. So one limit (SDPA_MAX_REQUEST_FLOPS) bounds the device
    time of every path alike: weights and diagnostics cost more per FLOP than the fused kernel.
    """

    paths: Mapping[str, PathCost]
    calibrated: bool

    @classmethod
    def uncalibrated(cls) -> CostModel:
        costs = {path: PathCost(*figures) for path, figures in UNCALIBRATED.items()}
        return cls(costs, calibrated=False)

    def seconds(self, shape: WorkShape, path: str) -> float:
        """Estimated device seconds of `shape` on `path`."""
        cost = self.paths[path]
        return cost.overhead_s + path_flops(shape, path, cost.d_floor) * cost.seconds_per_flop

    def work(self, shape: WorkShape, path: str) -> float:
        """`shape` on `path` in fused-equivalent FLOPs: its FLOPs at the path's cost per FLOP
        relative to the fused path's. The fixed cost of a call is left out: it bounds nothing,
        and a limit set in FLOPs must not refuse a tiny request for it."""
        cost = self.paths[path]
        flops = path_flops(shape, path, cost.d_floor)
        return flops * cost.seconds_per_flop / self.paths["fused"].seconds_per_flop

    def work_limit(self, max_request_flops: float | str, max_compute_s: float) -> float:
        """The work one request may cost: the configured FLOPs, or max_compute_s of device time
        on the fused path ("auto")."""
        if isinstance(max_request_flops, int | float):
            return float(max_request_flops)
        return max_compute_s / self.paths["fused"].seconds_per_flop

    def as_json(self) -> dict[str, object]:
        """For /v1/info: what the model knows about this device."""
        return {
            "calibrated": self.calibrated,
            "paths": {
                path: {
                    "gflops_per_second": round(1e-9 / cost.seconds_per_flop, 3),
                    "d_floor": cost.d_floor,
                    "overhead_ms": round(cost.overhead_s * 1e3, 4),
                }
                for path, cost in self.paths.items()
            },
        }
