"""The Triton flash kernel's figures (not a test: the numbers its tests bound, printed).

TRITON_INTERPRET=1 python -m tests.core.triton_flash_figures accuracy
    max abs / rel error per field against float64 over test_triton_flash.py's mask and
    shape cases in fp32, fp16 and bf16, and the interpreter's time per flash_tile call;
TRITON_INTERPRET=1 python -m tests.core.triton_flash_figures gaps
    one-hot rows (one key `gap` above 39 others) against 80-digit decimals;
python -m tests.core.triton_flash_figures registers
    registers and spilled bytes per launch configuration, compiled for sm_90 by Triton's
    bundled ptxas (no GPU needed; minutes per configuration).
"""

from __future__ import annotations

import decimal
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch


def accuracy() -> None:
    from sdpa_core.kernels import triton_flash
    from tests.core.flash_tiles import expected, stat_errors, tile_inputs
    from tests.core.test_triton_flash import MASK_CASES, SHAPE_CASES

    cases = {**MASK_CASES, **SHAPE_CASES}
    times = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        worst: dict[str, tuple[float, float]] = {}
        out_err = 0.0
        for case in cases.values():
            inp = tile_inputs(replace(case, dtype=dtype))
            triton_flash.flash_tile(inp.q, inp.k, inp.v, **inp.kwargs)  # the first call rewrites
            t0 = time.perf_counter()
            out, stats = triton_flash.flash_tile(inp.q, inp.k, inp.v, **inp.kwargs)
            times.append(time.perf_counter() - t0)
            want_out, want = expected(inp)
            out_err = max(out_err, float((out.double() - want_out).abs().max()))
            for name, (a, r) in stat_errors(stats, want).items():
                wa, wr = worst.get(name, (0.0, 0.0))
                worst[name] = (max(wa, a), max(wr, r))
        print(f"{dtype}: output max abs {out_err:.3g}")
        for name, (a, r) in worst.items():
            print(f"  {name:18s} max abs {a:.3g}  max rel {r:.3g}")
    times.sort()
    print(
        f"flash_tile under the interpreter, {len(times)} calls: median "
        f"{times[len(times) // 2] * 1e3:.0f} ms, {times[0] * 1e3:.0f}-{times[-1] * 1e3:.0f} ms"
    )


def gaps() -> None:
    from sdpa_core.kernels import triton_flash

    n_kv, d = 40, 16
    for gap in (20, 40, 48, 52, 60, 70, 80, 90):
        q = torch.zeros(1, 1, 1, d)
        k = torch.zeros(1, 1, n_kv, d)
        q[0, 0, 0, 0] = k[0, 0, 17, 0] = 1.0
        _, stats = triton_flash.flash_tile(
            q,
            k,
            torch.randn(1, 1, n_kv, d),
            scale=float(gap),
            q_start=0,
            causal_shift=None,
            key_lengths=None,
            visible=None,
            bias=None,
            sink_tokens=4,
        )
        with decimal.localcontext(prec=80):
            exps = [decimal.Decimal(gap).exp()] + [decimal.Decimal(1)] * (n_kv - 1)
            total = sum(exps, decimal.Decimal(0))
            p = [e / total for e in exps]
            want = {
                "entropy": -sum((x * x.ln() for x in p), decimal.Decimal(0)),
                "grad_health": sum((x * (1 - x) for x in p), decimal.Decimal(0)) / n_kv,
                "jacobian_fro": sum(
                    (
                        ((p[i] if i == j else 0) - p[i] * p[j]) ** 2
                        for i in range(n_kv)
                        for j in range(n_kv)
                    ),
                    decimal.Decimal(0),
                ).sqrt(),
            }
        cells = []
        for name, value in want.items():
            got, ref = float(stats[name].flatten()[0]), float(value)
            cells.append(f"{name} {got:.4g} vs {ref:.4g} (rel {abs(got - ref) / ref:.1e})")
        print(f"gap {gap}: " + "; ".join(cells))


_CONFIGS = [  # (dtype, D, BLOCK_M, BLOCK_N, warps, every mask on)
    ("fp16", 64, 64, 64, 8, True),
    ("fp16", 64, 64, 64, 8, False),
    ("fp16", 128, 64, 32, 8, True),
    ("fp16", 128, 64, 32, 8, False),
    ("fp16", 128, 32, 32, 8, True),
    ("fp16", 256, 32, 32, 8, True),
    ("fp32", 64, 32, 32, 8, True),
    ("fp32", 128, 32, 32, 8, True),
]


def registers() -> None:
    import triton  # type: ignore[import-untyped]
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource  # type: ignore[import-untyped]

    from sdpa_core.kernels import _triton_flash_kernel as kernel

    fn = kernel.flash_fwd
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    unit = ("sqd", "skd", "svd", "sin", "sbn")  # what the JIT specializes contiguous inputs on
    for dtype, d, block_m, block_n, warps, masks in _CONFIGS:
        pointers = {
            "Q": dtype,
            "K": dtype,
            "V": dtype,
            "Out": dtype,
            "Stats": "fp32",
            "Counts": "i64",
            "KeyLen": "i64",
            "Vis": "u8",
            "Bias": "fp32",
        }
        constexprs: dict[str, object] = dict.fromkeys(unit, 1)
        constexprs.update(
            HAS_CAUSAL=masks,
            HAS_LEN=masks,
            HAS_VIS=masks,
            HAS_BIAS=masks,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            D_PAD=d,
            DV_PAD=d,
            IEEE=dtype == "fp32",
            UPCAST=False,
            P_HALF=dtype != "fp32",
        )
        signature = {
            name: "*" + pointers[name]
            if name in pointers
            else "constexpr"
            if name in constexprs
            else "fp32"
            if name == "scale"
            else "i32"
            for name in fn.arg_names
        }
        # and the divisibility by 16 it specializes on (aligned pointers, strides of 16s)
        aligned = [*pointers, "sqb", "sqh", "sqm", "skb", "skh", "skn", "svb", "svh", "svn"]
        aligned += ["sim", "sbm"]
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": 2},
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run(
                [cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True
            ).stdout
        line = next(x for x in usage.splitlines() if "REG" in x).split()
        print(
            f"{dtype} D={d} {block_m}x{block_n} {warps} warps, masks {'on' if masks else 'off'}: "
            f"{line[0]} {line[1]} shared={compiled.metadata.shared}",
            flush=True,
        )


if __name__ == "__main__":
    {"accuracy": accuracy, "gaps": gaps, "registers": registers}[sys.argv[1]]()
