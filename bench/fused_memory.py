"""Peak memory of one fused-path call whose mask torch cannot take as is_causal.

    .venv/bin/python bench/fused_memory.py      # ~30 s on 2 cores

Bottom-right causal attention with key_lengths=[16000], N_q = 8192, N_kv = 16384, D = 8 (inputs
of a few MB), three ways: one head on torch's flash kernel, and 4 or 8 heads with D_v = 16, which
torch runs on its math kernel. Each case runs in a fresh interpreter and reports how much its
peak RSS grew during the call (after a warm-up call), and which kernel ran. Before the fused path
ran in tiles of query rows, the whole N_q x N_kv mask (and, on the math kernel, the scores) were
materialized: run this on an older checkout to compare.

Writes bench/results/fused_memory.json and bench/results/fused_memory.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
CASES = ((1, 8), (4, 16), (8, 16))  # (heads, D_v)

MEASURE = textwrap.dedent(
    """
    import json, resource, sys, torch
    from sdpa_core import attention
    heads, d_v = int(sys.argv[1]), int(sys.argv[2])
    q = torch.randn(1, heads, 8192, 8)
    k, v = torch.randn(1, heads, 16384, 8), torch.randn(1, heads, 16384, d_v)
    attention(q[:, :, :64], k[:, :, :128], v[:, :, :128], causal="bottom_right")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = attention(q, k, v, causal="bottom_right", key_lengths=[16000])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    print(json.dumps({"peak_growth_mb": (after - before) // 1024, "backend": res.backend,
                      "path": res.path, "inputs_mb": round(inputs / 2**20, 1)}))
    """
)


def measure(heads: int, d_v: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(heads), str(d_v)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return {"heads": heads, "d_v": d_v, **json.loads(done.stdout)}


def main() -> int:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.strip()
    rows = [measure(heads, d_v) for heads, d_v in CASES]
    report = {
        "benchmark": "fused_memory",
        "command": ".venv/bin/python bench/fused_memory.py",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "cases": rows,
    }
    lines = [
        "# Peak memory of one fused call (bottom-right causal, key_lengths, N_q 8192, N_kv 16384)",
        "",
        f"`{report['command']}` — {report['when']}, commit {commit}.",
        "",
        "| heads | D_v | kernel | inputs MB | peak RSS growth MB |",
        "|---:|---:|---|---:|---:|",
        *(
            f"| {r['heads']} | {r['d_v']} | {r['backend']} | {r['inputs_mb']} | "
            f"{r['peak_growth_mb']} |"
            for r in rows
        ),
        "",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fused_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "fused_memory.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
