"""The Triton flash kernel's tests that need processes of their own (and no interpreter here).

- The interpreter's tests (test_triton_flash.py) in a child pytest with TRITON_INTERPRET=1:
  Triton reads it once per process, at import, and a pytest session must not carry it (every
  later test and every server it starts would take it).
- sdpa_core imports the kernel's module without Triton; available() says why not.
- The kernel compiles for a CUDA target without a GPU (Triton ships ptxas): what the
  interpreter never checks.
- The large-shape reference of test_triton_flash_gpu.py against the definitional one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.core.flash_tiles import Tile, expected, expected_by_formula, tile_inputs

ROOT = Path(__file__).resolve().parents[2]


def _without_interpreter() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.mark.slow
def test_interpreter_cases_in_a_child_pytest() -> None:
    """test_triton_flash.py under Triton's interpreter, in a child pytest."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA, test_triton_flash.py runs the compiled kernel in this process")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("this process interprets: test_triton_flash.py runs in it")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         "tests/core/test_triton_flash.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    tail = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout, tail
    assert " skipped" not in done.stdout, tail


@pytest.mark.slow  # a fresh interpreter
def test_imports_without_triton_and_says_why() -> None:
    """sdpa_core.kernels.triton_flash imports without Triton (and without importing it);
    available() then says why not, and so does a process without CUDA or the interpreter."""
    code = (
        "import os, sys, torch\n"
        "sys.modules['triton'] = None\n"  # `import triton` raises ImportError
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from sdpa_core.kernels import triton_flash\n"
        "ok, why = triton_flash.available()\n"
        "assert not ok and 'triton is not importable' in why, why\n"
        "del sys.modules['triton'], os.environ['TRITON_INTERPRET']\n"
        "triton_flash._device_code.cache_clear()\n"
        "ok, why = triton_flash.available()\n"
        "assert ok == torch.cuda.is_available(), why\n"
        "if not ok:\n"
        "    assert 'no CUDA device' in why, why\n"
        "    assert 'triton' not in sys.modules\n"  # not imported to say so
        "    import triton.language\n"
        "    os.environ['TRITON_INTERPRET'] = '1'\n"  # too late: Triton is imported
        "    ok, why = triton_flash.available()\n"
        "    assert not ok and 'after Triton was imported' in why, why\n"
    )
    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=_without_interpreter(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


# What only a GPU compiler checks (annotations resolved as globals, tl.dot's shapes and
# dtypes, shared memory), checked without a GPU: Triton ships ptxas, so the kernel compiles to
# a cubin for sm_90 in a process that does not interpret. One configuration per code path
# (half: tensor-core dots, p in half; fp32: ieee dots), with every mask on.
_COMPILE_FOR_SM90 = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sdpa_core.kernels import _triton_flash_kernel as kernel
from sdpa_core.kernels.triton_flash import launch_config

dtype, d = sys.argv[1], int(sys.argv[2])
torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
block_m, block_n, warps = launch_config(torch_dtype, d, d, 1024, interpreted=False)
fn = kernel.flash_fwd
pointers = {"Q": dtype, "K": dtype, "V": dtype, "Out": dtype, "Stats": "fp32",
            "Counts": "i64", "KeyLen": "i64", "Vis": "u8", "Bias": "fp32"}
constexprs = {"HAS_CAUSAL": True, "HAS_LEN": True, "HAS_VIS": True, "HAS_BIAS": True,
              "BLOCK_M": block_m, "BLOCK_N": block_n, "D_PAD": d, "DV_PAD": d,
              "IEEE": dtype == "fp32", "UPCAST": False, "P_HALF": dtype != "fp32",
              # what the JIT specializes on contiguous inputs: unit strides
              "sqd": 1, "skd": 1, "svd": 1, "sin": 1, "sbn": 1}
signature = {}
for name in fn.arg_names:
    if name in pointers:
        signature[name] = "*" + pointers[name]
    elif name in constexprs:
        signature[name] = "constexpr"
    else:
        signature[name] = "fp32" if name == "scale" else "i32"
compiled = triton.compile(
    ASTSource(fn, signature, constexprs=constexprs),
    target=GPUTarget("cuda", 90, 32),
    options={"num_warps": warps, "num_stages": 2},
)
print(json.dumps({"cubin": len(compiled.asm["cubin"]), "shared": compiled.metadata.shared}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "d"), [("fp16", 64), ("fp32", 128)])
def test_compiles_for_a_cuda_target(dtype: str, d: int, tmp_path: Path) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = _without_interpreter()
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile, not a cached cubin
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90, dtype, str(d)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cubin"] > 0
    assert result["shared"] <= 99 * 1024  # fits every GPU since sm_86 (99 KiB a block)


def test_the_large_shape_reference_agrees_with_the_definitions() -> None:
    """expected_by_formula and the index-built visibility, which the GPU tests use at
    N = 1024, against the element-by-element reference on a small tile with every mask."""
    case = Tile(
        h=4,
        h_kv=2,
        causal="bottom_right",
        n_q=18,
        n_kv=34,
        lengths=[[34, 30, 12, 0], [20, 34, 34, 7]],
        pad=[[True, True] + [False] * 32, [False] * 33 + [True]],
        mask=True,
        bias=True,
        rows=(3, 17),
    )
    by_loop, by_index = tile_inputs(case), tile_inputs(case, by_index=True)
    assert torch.equal(by_loop.visible, by_index.visible)
    out, stats = expected(by_loop)
    out_f, stats_f = expected_by_formula(by_index)
    torch.testing.assert_close(out_f, out, rtol=1e-12, atol=1e-12)
    for name, value in stats.items():
        torch.testing.assert_close(stats_f[name], value, rtol=1e-10, atol=1e-12, msg=name)
