"""Input validation and normalization to 4-D ``[B, H, N, D]``.

Every check here is vectorized (one reduction per tensor at most) so that the fused path's
wrapper overhead stays negligible next to the attention itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch

from sdpa_core.errors import DTypeError, MaskError, NonFiniteError, SdpaError, ShapeError
from sdpa_core.masks import NO_MASKS, Masks
from sdpa_core.nonfinite import check_finite_bias, check_finite_inputs

CausalMode: TypeAlias = Literal["none", "top_left", "bottom_right"]
CausalArg: TypeAlias = bool | str | None

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax and statistics accumulate in: float64 for float64 inputs, else float32.

    float16 and bfloat16 inputs are upcast: their exponentials and row sums would lose the
    digits the diagnostics need. The weight matrix of the dense path is held in this dtype too.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(d: int) -> float:
    """The softmax scale when none is given: 1 / sqrt(d) for head dim d (torch SDPA's default)."""
    return 1.0 / math.sqrt(d)


def resolve_scale(scale: float | None, d: int) -> float:
    """The scale attention() uses: the one given, or default_scale(d) when it is None."""
    return default_scale(d) if scale is None else float(scale)


def score_matrix_nbytes(*, batch: int, heads: int, n_q: int, n_kv: int, dtype: torch.dtype) -> int:
    """Bytes of a [batch, heads, n_q, n_kv] score or weight matrix for inputs of `dtype`
    (held in accumulation_dtype(dtype))."""
    return batch * heads * n_q * n_kv * accumulation_dtype(dtype).itemsize


@dataclass(frozen=True, slots=True)
class InputSpec:
    """What validate_inputs learned about a (q, k, v) triple.

    batch_shape are q's leading dims before [H, N_q, D] (empty for 2-D and 3-D inputs).
    A 2-D q is one head of one sequence (heads = 1).
    """

    batch_shape: tuple[int, ...]
    heads: int
    kv_heads: int
    n_q: int
    n_kv: int
    d: int
    d_v: int
    dtype: torch.dtype
    causal: CausalMode
    # Needed to shape results like the input: a 2-D q ([N_q, D]) has no head dim, unlike a
    # 3-D [1, N_q, D] q that also has heads == 1.
    two_d: bool = False

    @property
    def batch(self) -> int:
        """Product of batch_shape: the B of the normalized [B, H, N, D] view."""
        return math.prod(self.batch_shape)

    @property
    def group(self) -> int:
        """Query heads per kv head (1 without GQA)."""
        return self.heads // self.kv_heads

    @property
    def head_shape(self) -> tuple[int, ...]:
        """q.shape[:-2]: the shape of per-head results ([..., H])."""
        return () if self.two_d else (*self.batch_shape, self.heads)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """q.shape[:-1]: the shape of per-row results ([..., H, N_q])."""
        return (*self.head_shape, self.n_q)

    @property
    def accum_dtype(self) -> torch.dtype:
        """Softmax and statistics accumulate in float32, or float64 for float64 inputs."""
        return accumulation_dtype(self.dtype)


def check_int_option(value: object, *, param: str, minimum: int, what: str, expected: str) -> None:
    """An integer option (never a bool) of at least `minimum`, or an SdpaError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SdpaError(f"{param} must be {what}", param=param, expected=expected, got=repr(value))


def normalize_causal(causal: CausalArg) -> CausalMode:
    """False/None/"none" -> "none"; True/"top_left" -> "top_left"; "bottom_right"."""
    if causal is None or causal is False:
        return "none"
    if causal is True:
        return "top_left"
    if isinstance(causal, str) and causal in ("none", "top_left", "bottom_right"):
        return causal  # type: ignore[return-value]
    raise MaskError(
        "unknown causal option",
        param="causal",
        expected='false, true, "top_left" or "bottom_right"',
        got=repr(causal),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(
            "must be a torch.Tensor", param=name, expected="torch.Tensor", got=type(x).__name__
        )
    return x


def _check_no_empty(x: torch.Tensor, name: str, dim_names: tuple[str, ...]) -> None:
    if x.numel() == 0:
        names = (("batch",) * (x.dim() - len(dim_names)) + dim_names)[-x.dim() :]
        empty = [f"{n}[{i}]" for i, (n, s) in enumerate(zip(names, x.shape, strict=True)) if s == 0]
        raise ShapeError(
            "empty dimension",
            param=name,
            expected="every dimension >= 1",
            got=f"shape {tuple(x.shape)} (empty: {', '.join(empty)})",
        )


def _per_sequence_or_head(
    spec_q_shape: tuple[int, ...], extra: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The two accepted shapes for key_lengths / key_padding_mask: per sequence, per head."""
    return (*spec_q_shape[:-3], *extra), (*spec_q_shape[:-2], *extra)


def validate_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: Masks = NO_MASKS,
    *,
    scale: float | None = None,
    allow_nonfinite: bool = False,
    check_finite: bool = True,
) -> InputSpec:
    """Check q, k, v and every mask option; raise an SdpaError subclass on the first problem.

    Shapes: q [..., H, N_q, D], k [..., H_kv, N_kv, D], v [..., H_kv, N_kv, D_v] with the same
    leading dims; a 2-D q is [N_q, D] (one head). H must be a multiple of H_kv (GQA/MQA).
    masks: the mask options (masks.Masks), each checked against q's shape and device.
    check_finite=False skips the scan of q, k, v and a float attn_mask for NaN/Inf (one read
    of every element), for a caller that has already checked these very tensors (as
    scipy.linalg's check_finite); the shapes and masks are still checked.
    """
    q = _check_tensor(q, "q")
    k = _check_tensor(k, "k")
    v = _check_tensor(v, "v")
    causal_mode = normalize_causal(masks.causal)
    key_lengths, key_padding_mask, attn_mask = (
        masks.key_lengths,
        masks.key_padding_mask,
        masks.attn_mask,
    )

    # dtypes first: a wrong dtype explains more than a wrong shape would.
    if q.dtype not in SUPPORTED_DTYPES:
        raise DTypeError(
            "unsupported dtype",
            param="q",
            expected=" | ".join(_DTYPE_NAMES),
            got=_dtype_name(q.dtype),
        )
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise DTypeError(
                f"{name} must have q's dtype",
                param=name,
                expected=_dtype_name(q.dtype),
                got=_dtype_name(x.dtype),
            )
        if x.device != q.device:
            raise SdpaError(
                f"{name} must be on q's device",
                param=name,
                expected=str(q.device),
                got=str(x.device),
            )

    if q.dim() < 2:
        raise ShapeError(
            "q needs at least 2 dims",
            param="q",
            expected="[..., H, N_q, D] or [N_q, D]",
            got=f"shape {tuple(q.shape)}",
        )
    for name, x in (("k", k), ("v", v)):
        if x.dim() != q.dim():
            raise ShapeError(
                f"{name} must have q's rank",
                param=name,
                expected=f"{q.dim()} dims",
                got=f"{x.dim()} dims {tuple(x.shape)}",
            )
    qdims = ("H", "N_q", "D")
    _check_no_empty(q, "q", qdims)
    _check_no_empty(k, "k", ("H_kv", "N_kv", "D"))
    _check_no_empty(v, "v", ("H_kv", "N_kv", "D_v"))

    nd = q.dim()
    lead = q.shape[:-3] if nd >= 3 else ()
    if nd >= 4:
        for name, x in (("k", k), ("v", v)):
            if x.shape[:-3] != lead:
                raise ShapeError(
                    f"{name}'s batch dims must equal q's",
                    param=name,
                    expected=f"batch dims {tuple(lead)}",
                    got=f"{tuple(x.shape[:-3])}",
                )
    heads = q.shape[-3] if nd >= 3 else 1
    kv_heads = k.shape[-3] if nd >= 3 else 1
    # (param, what must match, its name, expected, got); v's heads only exist from 3-D on.
    agreements = [
        ("k", "k's head dim must equal q's", "D", q.shape[-1], k.shape[-1]),
        ("v", "v must have as many keys as k", "N_kv", k.shape[-2], v.shape[-2]),
        ("v", "v must have as many heads as k", "H_kv", kv_heads, v.shape[-3] if nd >= 3 else 1),
    ]
    for param, message, dim, want, got in agreements:
        if got != want:
            raise ShapeError(message, param=param, expected=f"{dim} = {want}", got=f"{dim} = {got}")
    if heads % kv_heads != 0:
        raise ShapeError(
            "query heads must be a multiple of kv heads (GQA)",
            param="k",
            expected=f"H_kv dividing H = {heads}",
            got=f"H_kv = {kv_heads}",
        )

    n_q, d = q.shape[-2], q.shape[-1]
    n_kv, d_v = k.shape[-2], v.shape[-1]
    q_shape = tuple(q.shape)

    if key_lengths is not None:
        _validate_key_lengths(key_lengths, q_shape, n_kv, q.device)
    if key_padding_mask is not None:
        _validate_key_padding_mask(key_padding_mask, q_shape, n_kv, q.device)
    if attn_mask is not None:
        _validate_attn_mask(
            attn_mask, q_shape, n_kv, q.dtype, q.device, allow_nonfinite or not check_finite
        )

    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise SdpaError(
                "scale must be a real number or None",
                param="scale",
                expected="float or null",
                got=repr(scale),
            )
        accum = accumulation_dtype(q.dtype)
        # The kernels take the scale in the accumulation dtype: -1e308 is -inf in float32, which
        # would make every score -inf, so that the fused path answered zeros as if every key
        # were masked while the chunked path refused it.
        if not math.isfinite(scale) or abs(scale) > torch.finfo(accum).max:
            raise NonFiniteError(
                f"scale must be finite in the accumulation dtype ({_dtype_name(accum)})",
                param="scale",
                expected=f"|scale| <= {torch.finfo(accum).max:.6g}",
                got=repr(scale),
            )

    if check_finite and not allow_nonfinite:
        check_finite_inputs(q=q, k=k, v=v)

    return InputSpec(
        batch_shape=tuple(lead),
        heads=heads,
        kv_heads=kv_heads,
        n_q=n_q,
        n_kv=n_kv,
        d=d,
        d_v=d_v,
        dtype=q.dtype,
        causal=causal_mode,
        two_d=nd == 2,
    )


def _validate_key_lengths(
    key_lengths: object, q_shape: tuple[int, ...], n_kv: int, device: torch.device
) -> None:
    expected = "an integer tensor" if isinstance(key_lengths, torch.Tensor) else "integers"
    try:
        kl = key_lengths if isinstance(key_lengths, torch.Tensor) else torch.as_tensor(key_lengths)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise MaskError(
            "key_lengths must be integers",
            param="key_lengths",
            expected=expected,
            got=type(key_lengths).__name__,
        ) from exc
    if kl.dtype == torch.bool or kl.is_floating_point() or kl.is_complex():
        raise MaskError(
            "key_lengths must be integers",
            param="key_lengths",
            expected=expected,
            got=_dtype_name(kl.dtype),
        )
    per_seq, per_head = _per_sequence_or_head(q_shape, ())
    shape = tuple(kl.shape)
    if shape not in (per_seq, per_head, ()):  # a scalar applies to every sequence
        raise MaskError(
            "key_lengths has the wrong count",
            param="key_lengths",
            expected=f"shape {list(per_seq)} (per sequence) or {list(per_head)} (per head)",
            got=f"shape {list(shape)}",
        )
    lo, hi = int(kl.min()), int(kl.max())
    if lo < 0 or hi > n_kv:
        raise MaskError(
            "key length out of range",
            param="key_lengths",
            expected=f"0 <= length <= N_kv = {n_kv}",
            got=f"min {lo}, max {hi}",
        )


def _mask_tensor(mask: object, param: str, kind: str) -> torch.Tensor:
    """mask itself when it is a tensor, else a MaskError naming param."""
    if not isinstance(mask, torch.Tensor):
        raise MaskError(
            f"{param} must be a tensor", param=param, expected=kind, got=type(mask).__name__
        )
    return mask


def _check_on_device(mask: torch.Tensor, param: str, device: torch.device) -> None:
    if mask.device != device:
        raise MaskError(
            f"{param} must be on q's device",
            param=param,
            expected=str(device),
            got=str(mask.device),
        )


def _validate_key_padding_mask(
    mask: object, q_shape: tuple[int, ...], n_kv: int, device: torch.device
) -> None:
    mask = _mask_tensor(mask, "key_padding_mask", "bool tensor")
    if mask.dtype != torch.bool:
        raise DTypeError(
            "key_padding_mask must be boolean (True = padding)",
            param="key_padding_mask",
            expected="bool",
            got=_dtype_name(mask.dtype),
        )
    _check_on_device(mask, "key_padding_mask", device)
    per_seq, per_head = _per_sequence_or_head(q_shape, (n_kv,))
    if tuple(mask.shape) not in (per_seq, per_head):
        raise MaskError(
            "key_padding_mask has the wrong shape",
            param="key_padding_mask",
            expected=f"shape {list(per_seq)} (per sequence) or {list(per_head)} (per head)",
            got=f"shape {list(mask.shape)}",
        )


def _validate_attn_mask(
    mask: object,
    q_shape: tuple[int, ...],
    n_kv: int,
    dtype: torch.dtype,
    device: torch.device,
    allow_nonfinite: bool,
) -> None:
    mask = _mask_tensor(mask, "attn_mask", "bool or float tensor")
    if mask.dtype != torch.bool and mask.dtype not in (torch.float32, dtype):
        raise DTypeError(
            "attn_mask must be bool (True = attend) or float (additive bias)",
            param="attn_mask",
            expected="bool or float32"
            if dtype == torch.float32
            else f"bool, float32 or {_dtype_name(dtype)}",
            got=_dtype_name(mask.dtype),
        )
    _check_on_device(mask, "attn_mask", device)
    target = (*q_shape[:-1], n_kv)
    ok = mask.dim() <= len(target) and all(
        m in (1, t) for m, t in zip(reversed(mask.shape), reversed(target), strict=False)
    )
    if not ok:
        raise MaskError(
            "attn_mask does not broadcast to the scores",
            param="attn_mask",
            expected=f"broadcastable to {list(target)}",
            got=f"shape {list(mask.shape)}",
        )
    if mask.dtype != torch.bool and not allow_nonfinite:
        check_finite_bias(mask)


def to_4d(x: torch.Tensor) -> torch.Tensor:
    """View a [..., H, N, D] (or [N, D]) tensor as [B, H, N, D] without copying when possible."""
    if x.dim() == 2:
        return x.unsqueeze(0).unsqueeze(0)  # [1, 1, N, D]
    if x.dim() == 3:
        return x.unsqueeze(0)  # [1, H, N, D]
    if x.dim() == 4:
        return x
    return x.reshape(-1, *x.shape[-3:])  # [B, H, N, D]
