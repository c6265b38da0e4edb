"""The fused path: torch.nn.functional.scaled_dot_product_attention, in tiles of query rows.

On 4-D inputs with dropout 0 the flash / memory-efficient / cuDNN kernels are eligible (flash
on the CPU). This path returns the output only: neither weights nor row statistics. Fully
masked rows are 0 on every backend, and the backend torch picked is reported by name.

Memory: what one SDPA call may hold beyond its inputs and output is bounded by a tile budget
(tile_bytes, DEFAULT_FUSED_TILE_BYTES unless given). Two things can grow with N_q x N_kv:
- a mask the kernels cannot take as is_causal (bottom-right causal, causal with padding, a
  per-query attn_mask) is materialized: building it (the causal part, each AND), torch turning
  the bool mask into a float one and some CUDA kernels padding it cost about 3 + 2 x itemsize
  bytes per element of its broadcast shape. Whole, it made a request of 1.3 MB cost 642 MB
  (bottom-right causal with key_lengths, N_q = 8192, N_kv = 16384; measured);
- when torch falls back to its math kernel (on the CPU for instance D_v != D, or GQA with some
  masks), the scores are materialized: about three [B, H, rows, N_kv] tensors (scores,
  scores + mask, softmax) in float32 at least (9.9 GB for D_v = 16, H = 8 in the case above,
  inputs of 14 MB; measured).
Past the budget the queries run in tiles of rows (each query row is independent).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.nn.functional import scaled_dot_product_attention

from sdpa_core.masks import MaskPlan
from sdpa_core.shapes import accumulation_dtype

# The signature of torch.nn.functional.scaled_dot_product_attention, as this path calls it.
SdpaFunction = Callable[..., torch.Tensor]

DEFAULT_FUSED_TILE_BYTES = 64 << 20
"""What one SDPA call may hold in materialized mask and (math kernel) scores: 64 MiB."""

_MATH_SCORE_COPIES = 3  # scores, scores + mask, softmax: what torch's math kernel holds

_BACKEND_NAMES = {
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "efficient",
    "CUDNN_ATTENTION": "cudnn",
    "MATH": "math",
    "OVERRIDEABLE": "overrideable",
}
_BACKEND_BY_INDEX: dict[int, str] = {}


def backend_name(choice: int) -> str:
    """The short name ("flash", "efficient", "cudnn", "math", ...) of an SDPBackend value."""
    if not _BACKEND_BY_INDEX:
        from torch.nn.attention import SDPBackend

        # a pybind11 enum (not iterable); __members__ maps names to members (torch 2.13)
        for name, member in SDPBackend.__members__.items():
            _BACKEND_BY_INDEX[int(member.value)] = _BACKEND_NAMES.get(name, name.lower())
    return _BACKEND_BY_INDEX.get(choice, str(choice))


def sdpa_backend(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
) -> str | None:
    """The backend torch's SDPA dispatcher picks for these arguments.

    aten::_fused_sdp_choice is the very function scaled_dot_product_attention consults
    (checked on torch 2.13); it is private, so any failure yields None rather than a guess.
    """
    try:
        choice = torch._fused_sdp_choice(
            q4, k4, v4, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
        )
        return backend_name(int(choice))
    except Exception:  # a private API: never let it break attention
        return None


def _mask_bytes_per_row(plan: MaskPlan, itemsize: int) -> int:
    """Bytes per query row of the mask fused_attention materializes (0 when it has no query
    dimension, e.g. padding alone: [B, 1|H, 1, N_kv], or when there is none)."""
    pieces = [*plan.parts, *(() if plan.bias is None else (plan.bias,))]
    causal = plan.causal != "none"
    if not causal and not any(p.shape[2] != 1 for p in pieces):
        return 0
    batch = max((p.shape[0] for p in pieces), default=1)
    heads = max((p.shape[1] for p in pieces), default=1)
    keys = plan.n_kv if causal or any(p.shape[3] != 1 for p in pieces) else 1
    return batch * heads * keys * (3 + 2 * itemsize)


def fused_rows_per_call(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    tile_bytes: int = DEFAULT_FUSED_TILE_BYTES,
) -> int:
    """Query rows one SDPA call may take so that its mask and, should torch fall back to the
    math kernel, its scores stay within tile_bytes (N_q: one call for everything)."""
    b, h, n_q, _ = q4.shape
    mask_row = _mask_bytes_per_row(plan, q4.element_size())
    score_item = accumulation_dtype(q4.dtype).itemsize  # the math kernel upcasts half types
    scores_row = b * h * plan.n_kv * score_item * _MATH_SCORE_COPIES
    if n_q * (mask_row + scores_row) <= tile_bytes:
        return n_q  # fits whatever kernel runs: no need to ask torch
    enable_gqa = q4.shape[1] != k4.shape[1]
    if plan.is_empty or plan.causal_only_top_left():
        # One call with is_causal (or no mask at all) materializes no mask: only torch's math
        # kernel would grow. Tiles would need explicit rows of the causal mask.
        backend = sdpa_backend(
            q4, k4, v4, None, is_causal=not plan.is_empty, scale=scale, enable_gqa=enable_gqa
        )
        row = 0 if backend not in (None, "math") else mask_row + scores_row
    else:
        # Ask torch which kernel one row with its mask would get (None: it cannot tell).
        vis = plan.block(0, 1, 0, plan.n_kv)
        probe = plan.bias_block(0, 1, 0, plan.n_kv) if vis is None else vis
        backend = sdpa_backend(
            q4[:, :, :1], k4, v4, probe, is_causal=False, scale=scale, enable_gqa=enable_gqa
        )
        row = mask_row + (scores_row if backend in (None, "math") else 0)
    return n_q if row == 0 else max(1, tile_bytes // row)


def _masked_sdpa(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    vis: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    scale: float,
    enable_gqa: bool,
    want_backend: bool,
    sdpa: SdpaFunction,
) -> tuple[torch.Tensor, str | None]:
    """SDPA of some query rows under their mask rows; fully masked rows are 0.

    -> (output rows, the backend torch picks for them when want_backend, else None)"""
    if bias is None:
        mask = vis
    elif vis is None:
        mask = bias
    else:
        mask = torch.where(vis, bias, -math.inf)  # bias where visible, -inf elsewhere
    out = sdpa(q4, k4, v4, attn_mask=mask, dropout_p=0.0, scale=scale, enable_gqa=enable_gqa)
    if vis is not None:
        # torch >= 2.5 already returns 0 here on math / flash / efficient (its _safe_softmax);
        # its own test of fully masked rows leaves cuDNN out, so make it a guarantee of ours.
        # Unconditional: checking first would cost a host sync per call on a GPU.
        out = out.masked_fill(~vis.any(-1, keepdim=True), 0.0)  # [B|1, H|1, rows|1, 1]
    if not want_backend:
        return out, None
    return out, sdpa_backend(q4, k4, v4, mask, is_causal=False, scale=scale, enable_gqa=enable_gqa)


def fused_attention(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    tile_bytes: int = DEFAULT_FUSED_TILE_BYTES,
    sdpa: SdpaFunction = scaled_dot_product_attention,
) -> tuple[torch.Tensor, str | None]:
    """torch SDPA on [B, H, N, D] inputs; fully masked rows forced to 0 on every backend.

    Runs in tiles of query rows when one call could hold more than tile_bytes of mask and
    (math kernel) scores. sdpa is the kernel to call (torch's, unless a test counts calls).
    -> (output [B, H, N_q, D_v] in the input dtype, the backend name or None).
    """
    if scale < 0:
        # torch 2.13.0's CPU flash kernel (is_causal, D == D_v) returns NaN for a negative
        # scale. q·k·scale == (-q)·k·|scale| exactly (negation is exact), so no kernel ever
        # sees a negative scale; the cost is one copy of q.
        q4, scale = -q4, -scale
    enable_gqa = q4.shape[1] != k4.shape[1]
    n_q, n_kv = plan.n_q, plan.n_kv
    rows = fused_rows_per_call(q4, k4, v4, plan, scale=scale, tile_bytes=tile_bytes)
    if rows >= n_q and (plan.is_empty or plan.causal_only_top_left()):
        # is_causal is torch's top-left alignment; it never empties a row, and lets the
        # kernels skip masked blocks. It is never combined with attn_mask (torch rejects it).
        is_causal = not plan.is_empty
        out = sdpa(
            q4, k4, v4, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )  # [B, H, N_q, D_v]
        return out, sdpa_backend(
            q4, k4, v4, None, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if rows >= n_q:
        return _masked_sdpa(
            q4, k4, v4, plan.full(), plan.bias_block(0, n_q, 0, n_kv),
            scale=scale, enable_gqa=enable_gqa, want_backend=True, sdpa=sdpa,
        )  # fmt: skip
    # Tiles: each with its own rows of the mask (a tile cannot use is_causal, which torch
    # aligns to the tile's own first row).
    b, h, _, _ = q4.shape
    out = torch.empty(b, h, n_q, v4.shape[-1], dtype=q4.dtype, device=q4.device)
    backend: str | None = None
    for q0 in range(0, n_q, rows):
        q1 = min(q0 + rows, n_q)
        out[:, :, q0:q1], tile_backend = _masked_sdpa(
            q4[:, :, q0:q1], k4, v4, plan.block(q0, q1, 0, n_kv),
            plan.bias_block(q0, q1, 0, n_kv), scale=scale, enable_gqa=enable_gqa,
            want_backend=q0 == 0, sdpa=sdpa,
        )  # fmt: skip
        if q0 == 0:  # every tile has the same kind of mask: the first one tells the backend
            backend = tile_backend
    return out, backend
