"""attention(): validate, choose a path (fused | dense | chunked), run it, shape the result.

Paths
- fused: torch.nn.functional.scaled_dot_product_attention on 4-D inputs (dropout 0), so that
  flash / memory-efficient / cuDNN kernels are eligible. Used when neither weights nor
  diagnostics are needed.
- dense: explicit scores and softmax; the only path that can return the weights.
- chunked: key-block online softmax over query tiles, O(N) memory; diagnostics without the
  N_q x N_kv matrix.

dtypes: softmax and statistics accumulate in float32 (float64 for float64 inputs); float16 and
bfloat16 inputs are upcast for the dense and chunked math. The output and the returned weights
have the input dtype; RowStats and per-row tensors have the accumulation dtype.

Non-finite inputs (allow_nonfinite=True): a NaN or Inf only reaches the rows that can see it.
Values at positions a row cannot see (masked keys, padding) never leak into that row (torch
itself would give 0 * NaN = NaN there, pytorch#101967). A row whose own query, or one of whose
visible keys or values, is non-finite gets NaN output, NaN weights and NaN statistics. A fully
masked row is 0 whatever its query holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch.nn.functional import scaled_dot_product_attention

from sdpa_core.chunked import DEFAULT_BLOCK_SIZE, chunked_attention
from sdpa_core.dense import dense_attention
from sdpa_core.diagnostics import Diagnostics, DiagnosticsLevel, RowStats, summarize
from sdpa_core.errors import LimitError, NonFiniteError, SdpaError
from sdpa_core.masks import MaskPlan, build_mask_plan
from sdpa_core.shapes import CausalArg, InputSpec, all_finite, to_4d, validate_inputs

PathName: TypeAlias = Literal["fused", "dense", "chunked"]
_PATHS = ("fused", "dense", "chunked")
_LEVELS = ("none", "summary", "full")


@dataclass(frozen=True, slots=True)
class AttentionResult:
    """What attention() returns.

    output: [..., H, N_q, D_v] in the input dtype. weights: [..., H, N_q, N_kv] in the input
    dtype, or None. diagnostics: None unless asked. row_stats: present whenever diagnostics
    is not "none" ([..., H, N_q], accumulation dtype). path: which path ran. backend: the
    torch SDPA backend on the fused path ("flash", "efficient", "cudnn", "math", ...), None
    on the others or when torch does not tell.
    """

    output: torch.Tensor
    weights: torch.Tensor | None
    diagnostics: Diagnostics | None
    row_stats: RowStats | None
    path: PathName
    backend: str | None


def weights_nbytes(spec: InputSpec) -> int:
    """Bytes of the B*H*N_q*N_kv weight matrix in the accumulation dtype."""
    itemsize = spec.accum_dtype.itemsize
    return spec.batch * spec.heads * spec.n_q * spec.n_kv * itemsize


def choose_path(
    spec: InputSpec,
    *,
    return_weights: bool,
    diagnostics: str,
    memory_budget_bytes: int | None,
    path: str | None,
) -> PathName:
    """The path attention() runs, or an SdpaError when the request cannot be served."""
    need_stats = diagnostics != "none"
    nbytes = weights_nbytes(spec)
    over_budget = memory_budget_bytes is not None and nbytes > memory_budget_bytes

    def limit(what: str) -> LimitError:
        return LimitError(
            f"{what} needs the {spec.batch}x{spec.heads}x{spec.n_q}x{spec.n_kv} weight matrix",
            param="return_weights" if return_weights else "path",
            expected=f"<= {memory_budget_bytes} bytes",
            got=f"{nbytes} bytes",
        )

    if path is None:
        if return_weights:
            if over_budget:
                raise limit("returning the weights")
            return "dense"
        return "chunked" if need_stats else "fused"

    if path not in _PATHS:
        raise SdpaError("unknown path", param="path", expected=" | ".join(_PATHS), got=repr(path))
    if path == "fused" and (return_weights or need_stats):
        raise SdpaError(
            "the fused path returns neither weights nor diagnostics",
            param="path",
            expected='"dense" or "chunked" (or null) when weights or diagnostics are asked',
            got='"fused"',
        )
    if path == "chunked" and return_weights:
        raise SdpaError(
            "the chunked path never materializes the weights",
            param="path",
            expected='"dense" (or null) when return_weights is true',
            got='"chunked"',
        )
    if path == "dense" and over_budget:
        raise limit("the dense path")
    return path  # type: ignore[return-value]


_BACKEND_NAMES = {
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "efficient",
    "CUDNN_ATTENTION": "cudnn",
    "MATH": "math",
    "OVERRIDEABLE": "overrideable",
}


_BACKEND_BY_INDEX: dict[int, str] = {}


def _backend_name(choice: int) -> str:
    if not _BACKEND_BY_INDEX:
        from torch.nn.attention import SDPBackend

        # a pybind11 enum (not iterable); __members__ maps names to members (torch 2.13)
        for name, member in SDPBackend.__members__.items():
            _BACKEND_BY_INDEX[int(member.value)] = _BACKEND_NAMES.get(name, name.lower())
    return _BACKEND_BY_INDEX.get(choice, str(choice))


def _sdpa_backend(
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
        return _backend_name(int(choice))
    except Exception:  # a private API: never let it break attention
        return None


# What one fused call may hold beyond its inputs and output. Two things can grow with
# N_q x N_kv there:
# - a mask the kernels cannot take as is_causal (bottom-right causal, causal with padding, a
#   per-query attn_mask) is materialized: building it (the causal part, each AND), torch turning
#   the bool mask into a float one and some CUDA kernels padding it cost about 3 + 2 x itemsize
#   bytes per element of its broadcast shape. Whole, it made a request of 1.3 MB cost 642 MB
#   (bottom-right causal with key_lengths, N_q = 8192, N_kv = 16384; measured);
# - when torch falls back to its math kernel (on CPU for instance D_v != D, or GQA with some
#   masks), the scores are materialized: about three [B, H, rows, N_kv] tensors (scores,
#   scores + mask, softmax) in float32 at least (9.9 GB for D_v = 16, H = 8 in the case above,
#   inputs of 14 MB; measured).
# Past this many bytes the queries run in tiles of rows (each query row is independent).
FUSED_TILE_BYTES = 64 << 20
_MATH_SCORE_COPIES = 3


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


def _fused_rows_per_call(
    q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, plan: MaskPlan, *, scale: float
) -> int:
    """Query rows one SDPA call may take so that its mask and, should torch fall back to the
    math kernel, its scores stay within FUSED_TILE_BYTES (N_q: one call for everything)."""
    b, h, n_q, _ = q4.shape
    mask_row = _mask_bytes_per_row(plan, q4.element_size())
    scores_row = b * h * plan.n_kv * max(q4.element_size(), 4) * _MATH_SCORE_COPIES
    if n_q * (mask_row + scores_row) <= FUSED_TILE_BYTES:
        return n_q  # fits whatever kernel runs: no need to ask torch
    enable_gqa = q4.shape[1] != k4.shape[1]
    if plan.is_empty or plan.causal_only_top_left():
        # One call with is_causal (or no mask at all) materializes no mask: only torch's math
        # kernel would grow. Tiles would need explicit rows of the causal mask.
        backend = _sdpa_backend(
            q4, k4, v4, None, is_causal=not plan.is_empty, scale=scale, enable_gqa=enable_gqa
        )
        row = 0 if backend not in (None, "math") else mask_row + scores_row
    else:
        # Ask torch which kernel one row with its mask would get (None: it cannot tell).
        vis = plan.block(0, 1, 0, plan.n_kv)
        probe = plan.bias_block(0, 1, 0, plan.n_kv) if vis is None else vis
        backend = _sdpa_backend(
            q4[:, :, :1], k4, v4, probe, is_causal=False, scale=scale, enable_gqa=enable_gqa
        )
        row = mask_row + (scores_row if backend in (None, "math") else 0)
    return n_q if row == 0 else max(1, FUSED_TILE_BYTES // row)


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
) -> tuple[torch.Tensor, str | None]:
    """SDPA of some query rows under their mask rows; fully masked rows are 0.

    -> (output rows, the backend torch picks for them when want_backend, else None)"""
    if bias is None:
        mask = vis
    elif vis is None:
        mask = bias
    else:
        mask = torch.where(vis, bias, -math.inf)  # bias where visible, -inf elsewhere
    out = scaled_dot_product_attention(
        q4, k4, v4, attn_mask=mask, dropout_p=0.0, scale=scale, enable_gqa=enable_gqa
    )
    if vis is not None:
        # torch >= 2.5 already returns 0 here on math / flash / efficient; cuDNN is not
        # covered upstream (kernel-anchors 1.3), so make it a guarantee of ours. Unconditional:
        # checking first would cost a host sync per call on a GPU.
        out = out.masked_fill(~vis.any(-1, keepdim=True), 0.0)  # [B|1, H|1, rows|1, 1]
    if not want_backend:
        return out, None
    return out, _sdpa_backend(q4, k4, v4, mask, is_causal=False, scale=scale, enable_gqa=enable_gqa)


def fused_attention(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
) -> tuple[torch.Tensor, str | None]:
    """torch SDPA on [B, H, N, D] inputs; fully masked rows forced to 0 on every backend.

    Runs in tiles of query rows when one call could hold more than FUSED_TILE_BYTES."""
    enable_gqa = q4.shape[1] != k4.shape[1]
    n_q, n_kv = plan.n_q, plan.n_kv
    rows = _fused_rows_per_call(q4, k4, v4, plan, scale=scale)
    if rows >= n_q and (plan.is_empty or plan.causal_only_top_left()):
        # is_causal is torch's top-left alignment; it never empties a row, and lets the
        # kernels skip masked blocks. It is never combined with attn_mask (torch rejects it).
        is_causal = not plan.is_empty
        out = scaled_dot_product_attention(
            q4, k4, v4, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )  # [B, H, N_q, D_v]
        return out, _sdpa_backend(
            q4, k4, v4, None, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if rows >= n_q:
        return _masked_sdpa(
            q4, k4, v4, plan.full(), plan.bias_block(0, n_q, 0, n_kv),
            scale=scale, enable_gqa=enable_gqa, want_backend=True,
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
            want_backend=q0 == 0,
        )  # fmt: skip
        if q0 == 0:  # every tile has the same kind of mask: the first one tells the backend
            backend = tile_backend
    return out, backend


def _nonfinite_rows(
    q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, plan: MaskPlan, *, tile: int = 1024
) -> torch.Tensor:
    """Rows [B, H, N_q] whose query, or a visible key or value, is non-finite."""
    b, h, n_q, _ = q4.shape
    h_kv = k4.shape[1]
    bad_q = ~torch.isfinite(q4).all(-1)  # [B, H, N_q]
    bad_kv = ~(torch.isfinite(k4).all(-1) & torch.isfinite(v4).all(-1))  # [B, H_kv, N_kv]
    bad_kv = bad_kv.repeat_interleave(h // h_kv, dim=1).unsqueeze(2)  # [B, H, 1, N_kv]
    rows = torch.zeros(b, h, n_q, dtype=torch.bool, device=q4.device)
    for q0 in range(0, n_q, tile):
        q1 = min(q0 + tile, n_q)
        vis = plan.block(q0, q1, 0, plan.n_kv)  # [.., tq, N_kv] or None
        seen = bad_kv if vis is None else bad_kv & vis
        rows[:, :, q0:q1] = seen.any(-1).expand(b, h, q1 - q0)
        if vis is not None:
            rows[:, :, q0:q1] |= bad_q[:, :, q0:q1] & vis.any(-1).expand(b, h, q1 - q0)
        else:
            rows[:, :, q0:q1] |= bad_q[:, :, q0:q1]
    return rows


def _sanitize(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


def _poison(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """NaN in every position of the given rows; x is [B, H, N_q, ...] or [B, H, N_q]."""
    m = rows if x.dim() == rows.dim() else rows.unsqueeze(-1)
    return x.masked_fill(m, math.nan)


def _check_no_overflow(
    output: torch.Tensor, row_stats: RowStats | None, *, scale: float, accum_dtype: torch.dtype
) -> None:
    """Finite inputs can still overflow: q·k·scale beyond the accumulation dtype's range makes
    softmax NaN (e.g. q = k = [1e20, 1e20], or scale = 1e38). Refuse the result rather than
    return NaN; the check is one sum per tensor, like the input check."""
    checked = [output]
    if row_stats is not None:
        checked += [row_stats.entropy, row_stats.max_weight]
    if all(all_finite(*checked)):
        return
    raise NonFiniteError(
        f"the scaled scores q·k·scale overflow {accum_dtype} although every input is finite; "
        "reduce the magnitude of q, k or scale",
        param="scale",
        expected=f"|q·k·scale| within the range of {accum_dtype}",
        got=scale,
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: CausalArg = False,
    key_lengths: torch.Tensor | list[int] | tuple[int, ...] | int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
    diagnostics: DiagnosticsLevel | str = "none",
    memory_budget_bytes: int | None = None,
    allow_nonfinite: bool = False,
    path: PathName | str | None = None,
    block_size: int | None = None,
    check_finite: bool = True,
) -> AttentionResult:
    """softmax(q k^T * scale + mask) v with optional weights and diagnostics.

    q [..., H, N_q, D], k [..., H_kv, N_kv, D], v [..., H_kv, N_kv, D_v]; see DESIGN.md for
    the mask options. memory_budget_bytes bounds the B*H*N_q*N_kv weight matrix (in the
    accumulation dtype): weights beyond it raise LimitError. path forces a path; block_size
    is the chunked path's key block (default 512). check_finite=False skips the input scan for
    NaN/Inf when the caller has already checked these tensors (see validate_inputs); a result
    that overflows is still refused.
    """
    spec = validate_inputs(
        q,
        k,
        v,
        causal=causal,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        scale=scale,
        allow_nonfinite=allow_nonfinite,
        check_finite=check_finite,
    )
    if diagnostics not in _LEVELS:
        raise SdpaError(
            "unknown diagnostics level",
            param="diagnostics",
            expected=" | ".join(_LEVELS),
            got=repr(diagnostics),
        )
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
    ):
        raise SdpaError(
            "block_size must be a positive integer",
            param="block_size",
            expected="int >= 1",
            got=repr(block_size),
        )
    if memory_budget_bytes is not None and (
        isinstance(memory_budget_bytes, bool)
        or not isinstance(memory_budget_bytes, int)
        or memory_budget_bytes < 0
    ):
        raise SdpaError(
            "memory_budget_bytes must be a non-negative integer",
            param="memory_budget_bytes",
            expected="int >= 0 or null",
            got=repr(memory_budget_bytes),
        )
    chosen = choose_path(
        spec,
        return_weights=return_weights,
        diagnostics=diagnostics,
        memory_budget_bytes=memory_budget_bytes,
        path=path,
    )
    scale_f = 1.0 / math.sqrt(spec.d) if scale is None else float(scale)
    need_stats = diagnostics != "none"

    q4, k4, v4 = to_4d(q), to_4d(k), to_4d(v)  # [B, H, N, D]
    plan = build_mask_plan(
        spec,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        device=q.device,
    )

    poisoned: torch.Tensor | None = None
    if allow_nonfinite and not all(all_finite(q4, k4, v4)):
        poisoned = _nonfinite_rows(q4, k4, v4, plan)  # [B, H, N_q]
        q4, k4, v4 = _sanitize(q4), _sanitize(k4), _sanitize(v4)

    backend: str | None = None
    weights4: torch.Tensor | None = None
    rows4: RowStats | None = None
    if chosen == "fused":
        out4, backend = fused_attention(q4, k4, v4, plan, scale=scale_f)
    elif chosen == "dense":
        out4, weights4, rows4 = dense_attention(
            q4,
            k4,
            v4,
            plan,
            scale=scale_f,
            accum_dtype=spec.accum_dtype,
            need_weights=return_weights,
            need_stats=need_stats,
        )
    else:
        out4, rows4 = chunked_attention(
            q4,
            k4,
            v4,
            plan,
            scale=scale_f,
            accum_dtype=spec.accum_dtype,
            need_stats=need_stats,
            block_size=block_size or DEFAULT_BLOCK_SIZE,
        )

    if poisoned is not None and bool(poisoned.any()):
        out4 = _poison(out4, poisoned)
        if weights4 is not None:
            weights4 = _poison(weights4, poisoned)
        if rows4 is not None:
            rows4 = RowStats(
                **{
                    name: t if name == "visible_keys" else _poison(t, poisoned)
                    for name, t in rows4.as_dict().items()
                }
            )

    output = out4.to(spec.dtype).reshape(*spec.row_shape, spec.d_v)
    weights = None
    if weights4 is not None:
        weights = weights4.to(spec.dtype).reshape(*spec.row_shape, spec.n_kv)
    row_stats = None if rows4 is None else rows4.reshape(spec.row_shape)
    if not allow_nonfinite:
        _check_no_overflow(output, row_stats, scale=scale_f, accum_dtype=spec.accum_dtype)
    diag = None
    if row_stats is not None and diagnostics != "none":
        diag = summarize(
            row_stats, scale=scale_f, level="full" if diagnostics == "full" else "summary"
        )
    return AttentionResult(
        output=output,
        weights=weights,
        diagnostics=diag,
        row_stats=row_stats,
        path=chosen,
        backend=backend,
    )
