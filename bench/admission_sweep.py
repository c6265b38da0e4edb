"""Random workloads on the fake clock (tests/service/runtime/test_admission.py) by the hundred:
how many break a promise (an admitted item answered after its deadline, or refused after
admission), sdpa_broken_admissions_total summed, and the long items admitted and refused.
Every fourth workload has one tenant, the others two or three with weights 1 to 4.

    .venv/bin/python bench/admission_sweep.py 200
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.errors import DeadlineUnreachable, TenantQueueFull
from tests.service.runtime.test_admission import broken, play


def main(count: int) -> None:
    bad = admitted = refused = 0
    broken_total = 0.0
    for seed in range(count):
        rng = random.Random(1000 + seed)
        tenants = "ABC"[: rng.choice([2, 3])] if seed % 4 else "A"
        weights = {t: float(rng.randint(1, 4)) for t in tenants} if len(tenants) > 1 else None
        workload, metrics = play(seed + 5000, tenants, weights)
        wrong = workload.wrong()
        broken_total += broken(metrics)
        if wrong:
            bad += 1
            print(seed, tenants, wrong[:2], flush=True)
        for item, task in workload.tasks.items():
            if item.startswith("L"):
                if isinstance(task.exception(), DeadlineUnreachable | TenantQueueFull):
                    refused += 1
                else:
                    admitted += 1
    print(
        f"workloads {count}, with a broken promise {bad}, broken admissions {broken_total:g}, "
        f"long admitted {admitted}, refused {refused}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
