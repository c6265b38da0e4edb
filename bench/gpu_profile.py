"""Where the fused path's time goes on CUDA against torch's SDPA: torch.profiler over 10 calls
of each at [8, 16, 1024, 64] fp16 (a benchmark, never a test; needs a CUDA device).

    python3 -m bench.gpu_profile
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention
from torch.profiler import ProfilerActivity, profile

from sdpa_core import attention


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/gpu_profile.py: no CUDA device here")
        return 2
    q, k, v = (torch.randn(8, 16, 1024, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    for _ in range(5):  # warm both
        attention(q, k, v)
        scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    calls = {
        "fused": lambda: attention(q, k, v),
        "sdpa": lambda: scaled_dot_product_attention(q, k, v),
    }
    for name, call in calls.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        print(f"=== {name} (10 calls)")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
