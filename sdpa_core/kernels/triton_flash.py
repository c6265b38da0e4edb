"""The Triton flash kernel: a tile's attention output and every RowStats field in one launch.

The kernel contract (sdpa_core/kernels/__init__.py): available() and flash_tile(). The device
code is _triton_flash_kernel.py (its docstring has the accumulators); this module chooses the
launch and is importable without Triton: Triton is imported on the first flash_tile().

- Grid (query blocks, B*H): one program per BLOCK_M query rows of one (batch, head), walking
  the key blocks up to the last key its rows may see (the causal limit and the key length
  cut the loop; a bool mask or a bias cannot, and a block they hide entirely only costs its
  loads: the safe max keeps it exact).
- CUDA tensors run the compiled kernel. Under Triton's interpreter (TRITON_INTERPRET=1 when
  Triton is first imported: Triton reads it once per process) the kernel runs on CPU tensors
  (about 500x slower than torch: tests and CI only), and on CUDA tensors through copies to
  the host: a process that interprets for its CPU tests does not also compile for a GPU.
- Precision: q.k and p @ v accumulate in float32. fp32 inputs use input_precision="ieee"
  (exact fp32 products: TF32's 10-bit mantissa would put ~5e-4 relative errors in every
  score, beyond the fp32 tolerances the float64 reference is held to); fp16/bf16 inputs feed
  tensor cores directly, with p rounded to their dtype before p @ v, as FlashAttention does.
- Under the interpreter every tl.dot operand is upcast to fp32 (its bf16 dot multiplies the
  raw bits: triton #11584), p is rounded to fp16 for fp16 inputs as on a GPU but kept in fp32
  for bf16 (the interpreter's fp32 -> bf16 cast truncates where a GPU rounds to nearest), and
  the output is written in fp32 and rounded by torch, for the same reason.
- Block sizes are powers of two and >= 16 (tl.dot's smallest tile on a GPU); head dims are
  padded to the next power of two >= 16 with masked loads (launch_config says which and why).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from types import ModuleType
from typing import Final

import torch

_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)
_MAX_GRID_Y: Final = 65535  # CUDA's limit on a grid's second axis (B*H)


def available() -> tuple[bool, str]:
    """(True, "") when this kernel can run in this process (Triton importable and either a
    CUDA device or TRITON_INTERPRET=1), else (False, why). A process with neither, which has
    not imported Triton, does not import it to say so."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    cuda = torch.cuda.is_available()
    if not (cuda or interpret or "triton.language" in sys.modules):
        return False, "no CUDA device (and TRITON_INTERPRET is not 1)"
    try:
        code = _device_code()
    except ImportError as exc:
        return False, f"triton is not importable: {exc}"[:300]
    if code.INTERPRETED or cuda:
        return True, ""
    if interpret:
        return False, (
            "TRITON_INTERPRET=1 was set after Triton was imported (Triton reads it once, "
            "at import), and there is no CUDA device"
        )
    return False, "no CUDA device (and TRITON_INTERPRET is not 1)"


@functools.cache
def _device_code() -> ModuleType:
    """The kernel module, imported once (it imports Triton)."""
    from sdpa_core.kernels import _triton_flash_kernel

    return _triton_flash_kernel


def _pad(d: int) -> int:
    """A head dim's padded width: the next power of two, at least 16."""
    return max(16, 1 << max(0, d - 1).bit_length())


def launch_config(
    dtype: torch.dtype, d: int, d_v: int, tq: int, *, interpreted: bool
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a tile. The interpreter: 16 x 16 (the smallest tiles a
    GPU's tl.dot takes, so the tests run the GPU's shapes; its cost is per block). CUDA: what
    ptxas (Triton 3.9, sm_90; unit strides, pointers and strides divisible by 16, as the JIT
    specializes contiguous inputs of such sizes) compiled with the fewest register spills,
    registers / spilled bytes with every mask on, then with none:
    half, D <= 64: 64 x 64, 8 warps: 222 / 0, 207 / 0;
    half, D = 128: 64 x 32, 8 warps: 255 / 168, 186 / 0 (32 x 32 spills nothing, 231 / 0,
    but reads every key block twice as often);
    half, D = 256: 32 x 32, 8 warps: 243 / 0;
    fp32 (ieee dots on the FMA units): 32 x 32, 8 warps: 182 / 0 at D 64, 190 / 0 at D 128.
    (4 warps spilled 80-2,064 bytes in each configuration tried; without the divisibility,
    e.g. odd head dims, every mask on spills up to 2,016 bytes.) Their speed is not measured
    (no GPU was at hand): bench/gpu.py on a lent GPU should settle them;
    `python -m tests.core.triton_flash_figures registers` re-takes these counts."""
    if interpreted:
        return 16, 16, 4
    width = _pad(max(d, d_v))
    if dtype == torch.float32 or width > 128:
        return 32, 32, 8
    block_m = min(64, max(16, 1 << (tq - 1).bit_length()))
    return block_m, (64 if width <= 64 else 32), 8


def _strides4(x: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if x is None else (x.stride(0), x.stride(1), x.stride(2), x.stride(3))


def flash_tile(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_start: int,
    causal_shift: int | None,
    key_lengths: torch.Tensor | None,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    sink_tokens: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(output [B, H, tq, D_v] in q.dtype, stats: every RowStats field [B, H, tq]) of one
    tile, in one kernel launch (the contract in sdpa_core/kernels/__init__.py).

    q [B, H, tq, D], k [B, H_kv, N_kv, D], v [B, H_kv, N_kv, D_v], any strides, one dtype
    (float32, float16 or bfloat16); query head h reads kv head h // (H // H_kv). Query i
    (absolute: q_start + its row) sees key j when j <= i + causal_shift (no limit for None),
    j < key_lengths[b, h], visible[b, h, i, j] and j < N_kv; its score is
    scale * q.k + bias[b, h, i, j]. key_lengths, visible and bias are read through their
    strides (an expand()ed view costs nothing). A row with no visible key: output 0, every
    statistic 0 and lse -inf.
    """
    b, h, tq, d = q.shape
    h_kv, n_kv, d_v = k.shape[1], k.shape[2], v.shape[-1]
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"flash_tile takes q, k, v of one dtype among float32, float16, bfloat16; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if h_kv == 0 or h % h_kv or k.shape[-1] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"flash_tile: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "do not fit [B, H, tq, D], [B, H_kv, N_kv, D], [B, H_kv, N_kv, D_v] with H_kv | H"
        )
    dev = q.device
    code = _device_code()
    interpreted: bool = code.INTERPRETED
    if not interpreted and dev.type != "cuda":
        raise RuntimeError(
            f"the Triton flash kernel takes {dev.type} tensors only under Triton's interpreter "
            "(TRITON_INTERPRET=1 before Triton is first imported)"
        )
    # The interpreter writes fp32 and torch rounds (its own fp32 -> bf16 cast truncates).
    out_dtype = torch.float32 if interpreted else q.dtype
    out = torch.empty(b, h, tq, d_v, dtype=out_dtype, device=dev)
    stats = torch.empty(len(code.STAT_FIELDS), b, h, tq, dtype=torch.float32, device=dev)
    counts = torch.empty(b, h, tq, dtype=torch.int64, device=dev)

    bh = b * h
    if n_kv == 0:  # no key for any row (and k, v may have no storage to point a kernel at)
        out.zero_()
        stats.zero_()
        stats[code.STAT_FIELDS.index("lse")] = -math.inf
        counts.zero_()
    elif bh and tq:
        lengths = None if key_lengths is None else key_lengths.expand(b, h)
        vis = None if visible is None else visible.expand(b, h, tq, n_kv).view(torch.uint8)
        add = None if bias is None else bias.expand(b, h, tq, n_kv)
        block_m, block_n, warps = launch_config(q.dtype, d, d_v, tq, interpreted=interpreted)
        kernel = code.flash_fwd
        half = q.dtype != torch.float32
        for bh0 in range(0, bh, _MAX_GRID_Y):
            grid = (-(-tq // block_m), min(_MAX_GRID_Y, bh - bh0))
            kernel[grid](
                q,
                k,
                v,
                out,
                stats,
                counts,
                lengths if lengths is not None else counts,  # unused pointers: any tensor
                vis if vis is not None else counts,
                add if add is not None else counts,
                *q.stride(),
                *k.stride(),
                *v.stride(),
                *((0, 0) if lengths is None else lengths.stride()),
                *_strides4(vis),
                *_strides4(add),
                h,
                h // h_kv,
                tq,
                n_kv,
                d,
                d_v,
                bh0,
                float(scale),
                int(q_start),
                0 if causal_shift is None else int(causal_shift),
                int(sink_tokens),
                bh * tq,
                HAS_CAUSAL=causal_shift is not None,
                HAS_LEN=lengths is not None,
                HAS_VIS=vis is not None,
                HAS_BIAS=add is not None,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                D_PAD=_pad(d),
                DV_PAD=_pad(d_v),
                IEEE=interpreted or not half,
                UPCAST=interpreted,
                P_HALF=half and not (interpreted and q.dtype == torch.bfloat16),
                num_warps=warps,
                num_stages=2,
            )
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    rows = dict(zip(code.STAT_FIELDS, stats.unbind(0), strict=True))
    return out, {"visible_keys": counts, **rows}
