"""Test helper: one flash kernel tile (the kernel contract of sdpa_core/kernels) against the
float64 reference (reference.py), field by field.

A Tile names a problem the way attention() takes it (causal alignment, key lengths, key
padding, a bool and a float mask, the tile's query rows); tile_inputs() turns it into the
contract's arguments (causal by index, key padding and the bool mask folded into one
`visible`, a float mask's -inf entries turned into visible=False) and expected() computes
the output and every RowStats field from the definitions in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.core.reference import (
    assert_matches_golden,
    lowp_reference,
    reference_attention,
    reference_rows,
    visibility,
)

FlashTileFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

# (atol, rtol) per float field: the statistics accumulate in float32 whatever the input dtype
# (the inputs are exact in float64), so one budget serves fp32, fp16 and bf16. The raw score
# moments are relative to the scores' own size (q.k of a few units here).
STAT_TOLERANCE: dict[str, tuple[float, float]] = {
    "entropy": (2e-5, 1e-4),
    "max_weight": (1e-5, 1e-4),
    "sink_share": (1e-5, 1e-4),
    "lse": (2e-5, 2e-5),
    "grad_health": (1e-6, 1e-4),
    "jacobian_fro": (1e-5, 1e-4),
    "score_mean_raw": (2e-5, 1e-4),
    "score_m2_raw": (1e-4, 1e-4),
    "score_abs_max_raw": (1e-5, 1e-5),
}


@dataclass(frozen=True)
class Tile:
    """One problem: shapes, masks, scale, dtype and the tile's query rows [q0, q1)."""

    b: int = 2
    h: int = 2
    h_kv: int = 2
    n_q: int = 20
    n_kv: int = 40
    d: int = 24
    d_v: int = 24
    causal: str = "none"  # "none" | "top_left" | "bottom_right"
    lengths: list[int] | list[list[int]] | None = None  # [B] or [B][H]
    pad: list[list[bool]] | None = None  # [B][N_kv], True = padding
    mask: bool = False  # a random bool attn_mask [N_q, N_kv]
    bias: bool = False  # a random float attn_mask [H, N_q, N_kv] (-inf where `mask` says)
    scale: float | None = None  # None: 1 / sqrt(D)
    dtype: torch.dtype = torch.float32
    rows: tuple[int, int] | None = None  # the tile's query rows (default: all)
    sink_tokens: int = 4
    std: float = 1.0  # q and k ~ N(0, std^2)
    seed: int = 0
    strided: bool = field(default=True)  # q, k, v as [B, N, H, D] memory (non-contiguous)

    @property
    def scale_value(self) -> float:
        return 1.0 / math.sqrt(self.d) if self.scale is None else self.scale


@dataclass(frozen=True)
class TileInputs:
    q: torch.Tensor  # the tile's rows [B, H, tq, D]
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict[str, Any]  # the contract's keyword arguments
    visible: torch.Tensor  # [B, H, tq, N_kv] bool: the reference's visibility
    bias: torch.Tensor | None  # the reference's bias (as the caller gave it)


def _randn(gen: torch.Generator, shape: tuple[int, int, int, int], strided: bool) -> torch.Tensor:
    b, h, n, d = shape
    if strided:  # [B, N, H, D] memory, seen as [B, H, N, D]
        return torch.randn(b, n, h, d, generator=gen).transpose(1, 2)
    return torch.randn(b, h, n, d, generator=gen)


def _visibility_by_index(
    t: Tile, pad: torch.Tensor | None, mask: torch.Tensor | None
) -> torch.Tensor:
    """visibility()'s matrix from index arithmetic, for shapes its element loop is too slow
    for (the GPU tests' N = 1024): [B, H, N_q, N_kv] bool."""
    i = torch.arange(t.n_q)[:, None]
    j = torch.arange(t.n_kv)[None, :]
    vis = torch.ones(t.b, t.h, t.n_q, t.n_kv, dtype=torch.bool)
    if t.causal != "none":
        vis &= j <= i + (0 if t.causal == "top_left" else t.n_kv - t.n_q)
    if t.lengths is not None:
        lengths = torch.tensor(t.lengths)
        lengths = lengths[:, None] if lengths.dim() == 1 else lengths  # [B, 1] | [B, H]
        vis &= j < lengths[:, :, None, None]
    if pad is not None:
        vis &= ~pad[:, None, None, :]
    if mask is not None:
        vis &= mask if mask.dtype == torch.bool else mask != -math.inf
    return vis


def tile_inputs(
    t: Tile, device: torch.device | str = "cpu", *, by_index: bool = False
) -> TileInputs:
    """The contract's arguments for tile t; by_index: the reference's visibility from index
    arithmetic rather than reference.visibility()'s element loop (large shapes)."""
    gen = torch.Generator().manual_seed(t.seed)
    q = _randn(gen, (t.b, t.h, t.n_q, t.d), t.strided) * t.std
    k = _randn(gen, (t.b, t.h_kv, t.n_kv, t.d), t.strided) * t.std
    v = _randn(gen, (t.b, t.h_kv, t.n_kv, t.d_v), t.strided)
    q, k, v = (x.to(t.dtype) for x in (q, k, v))
    q0, q1 = t.rows or (0, t.n_q)
    tq = q1 - q0

    bool_mask = torch.rand(t.n_q, t.n_kv, generator=gen) < 0.7 if t.mask else None
    bias = None
    if t.bias:
        bias = torch.randn(t.h, t.n_q, t.n_kv, generator=gen) * 2.0
        if bool_mask is not None:  # the float mask carries the hidden entries as -inf
            bias = bias.masked_fill(~bool_mask, -math.inf)
            bool_mask = None
    pad = None if t.pad is None else torch.tensor(t.pad)
    vis_full = (
        _visibility_by_index(t, pad, bool_mask if bias is None else bias)
        if by_index
        else visibility(
            b=t.b,
            h=t.h,
            n_q=t.n_q,
            n_kv=t.n_kv,
            causal=t.causal,
            key_lengths=t.lengths,
            key_padding_mask=pad,
            attn_mask=bool_mask if bias is None else bias,
        )
    )

    # The contract's arguments: causal by index, the rest folded into visible and bias.
    lengths = None
    if t.lengths is not None:
        lengths = torch.tensor(t.lengths, dtype=torch.int64)
        lengths = lengths.unsqueeze(-1) if lengths.dim() == 1 else lengths  # [B, 1] | [B, H]
    parts = []
    if pad is not None:
        parts.append((~pad)[:, None, None, :])  # [B, 1, 1, N_kv]
    if bool_mask is not None:
        parts.append(bool_mask[q0:q1])  # [tq, N_kv]
    if bias is not None:
        parts.append(bias[:, q0:q1] != -math.inf)  # [H, tq, N_kv]
    visible = None
    for part in parts:
        visible = part if visible is None else visible & part
    shape = (t.b, t.h, tq, t.n_kv)
    kwargs: dict[str, Any] = {
        "scale": t.scale_value,
        "q_start": q0,
        "causal_shift": {"none": None, "top_left": 0, "bottom_right": t.n_kv - t.n_q}[t.causal],
        "key_lengths": None if lengths is None else lengths.to(device),
        "visible": None if visible is None else visible.to(device).expand(shape),
        "bias": None if bias is None else bias[:, q0:q1].to(device).expand(shape),
        "sink_tokens": t.sink_tokens,
    }
    return TileInputs(
        q=q[:, :, q0:q1].to(device),
        k=k.to(device),
        v=v.to(device),
        kwargs=kwargs,
        visible=vis_full[:, :, q0:q1],
        bias=None if bias is None else bias[:, q0:q1],
    )


def expected(inp: TileInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The float64 output [B, H, tq, D_v] and every RowStats field [B, H, tq], from the
    definitions (reference.py's weights, plus the sink and the raw moments per row)."""
    q, k, v = (x.cpu() for x in (inp.q, inp.k, inp.v))
    scale = inp.kwargs["scale"]
    ref = reference_attention(q, k, v, inp.visible, scale=scale, bias=inp.bias)
    rows = reference_rows(ref, scale=scale, bias=inp.bias)
    vis = ref.visible
    cnt = vis.sum(-1)
    raw = torch.where(vis, ref.raw, 0.0)
    mean = raw.sum(-1) / cnt.clamp(min=1)
    dev = torch.where(vis, ref.raw - mean.unsqueeze(-1), 0.0)
    sink = inp.kwargs["sink_tokens"]
    stats = {
        "visible_keys": cnt,
        "entropy": torch.from_numpy(rows.entropy),
        "max_weight": torch.from_numpy(rows.max_weight),
        "sink_share": ref.weights[..., : max(sink, 0)].sum(-1),
        "lse": torch.from_numpy(rows.lse),
        "grad_health": torch.from_numpy(rows.grad_health),
        "jacobian_fro": torch.from_numpy(rows.jacobian_fro),
        "score_mean_raw": mean,
        "score_m2_raw": (dev * dev).sum(-1),
        "score_abs_max_raw": raw.abs().amax(-1) if raw.shape[-1] else torch.zeros(cnt.shape),
    }
    return ref.out, stats


def expected_by_formula(inp: TileInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """expected() vectorized in float64 on the inputs' device, for shapes whose per-row
    Jacobian matrices would take the definitional reference minutes: the same quantities
    through their closed forms (||J||_F^2 = S2 - 2 S3 + S2^2, lse by logsumexp), which
    float64 computes to ~1e-12 on rows that are not near one-hot."""
    dev = inp.q.device
    q, k, v = (x.double() for x in (inp.q, inp.k, inp.v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    vis = inp.visible.to(dev)
    raw = q @ k.transpose(-1, -2)
    s = raw * inp.kwargs["scale"]
    if inp.bias is not None:
        bias = inp.bias.to(dev).double()
        s = s + torch.where(torch.isinf(bias), 0.0, bias)
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    active = vis.any(-1)
    p = torch.where(vis, torch.exp(s - torch.where(active, lse, 0.0).unsqueeze(-1)), 0.0)
    cnt = vis.sum(-1)
    s2, s3 = (p * p).sum(-1), (p * p * p).sum(-1)
    plogp = torch.where(p > 0, p * torch.log(p), 0.0)
    rawv = torch.where(vis, raw, 0.0)
    mean = rawv.sum(-1) / cnt.clamp(min=1)
    dev_ = torch.where(vis, raw - mean.unsqueeze(-1), 0.0)
    sink = inp.kwargs["sink_tokens"]
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    stats = {
        "visible_keys": cnt,
        "entropy": -plogp.sum(-1),
        "max_weight": p.amax(-1),
        "sink_share": p[..., : max(sink, 0)].sum(-1),
        "lse": torch.where(active, lse, -math.inf),
        "grad_health": torch.where(active, (p * (1 - p)).sum(-1) / cnt.clamp(min=1), zero),
        "jacobian_fro": (s2 - 2 * s3 + s2 * s2).clamp(min=0).sqrt(),
        "score_mean_raw": mean,
        "score_m2_raw": (dev_ * dev_).sum(-1),
        "score_abs_max_raw": rawv.abs().amax(-1),
    }
    return (p @ v).cpu(), {name: x.cpu() for name, x in stats.items()}


def stat_errors(
    stats: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, tuple[float, float]]:
    """(max abs error, max relative error) per float field, over the finite entries."""
    errors = {}
    for name in STAT_TOLERANCE:
        got, ref = stats[name].cpu().double(), want[name].double()
        fin = torch.isfinite(ref)
        diff = (got[fin] - ref[fin]).abs()
        rel = diff / ref[fin].abs().clamp(min=1e-30)
        errors[name] = (
            float(diff.max()) if diff.numel() else 0.0,
            float(rel.max()) if rel.numel() else 0.0,
        )
    return errors


def check_tile(
    fn: FlashTileFn,
    t: Tile,
    device: torch.device | str = "cpu",
    tolerance: dict[str, tuple[float, float]] | None = None,
    *,
    large: bool = False,
) -> dict[str, torch.Tensor]:
    """Run one tile through `fn` and hold it to the float64 reference: the output by the
    house rule (assert_matches_golden against the low-precision reference's own error),
    visible_keys exactly, every float field within (atol + rtol |ref|), lse -inf exactly
    where no key is visible, and no NaN anywhere. Returns the kernel's stats. large: the
    reference by index arithmetic and closed forms (expected_by_formula), for large shapes."""
    inp = tile_inputs(t, device, by_index=large)
    out, stats = fn(inp.q, inp.k, inp.v, **inp.kwargs)
    b, h, tq = inp.q.shape[:3]
    assert out.shape == (b, h, tq, t.d_v)
    assert out.dtype == t.dtype
    assert out.device == inp.q.device
    want_out, want = expected_by_formula(inp) if large else expected(inp)
    lowp = lowp_reference(
        inp.q.cpu(), inp.k.cpu(), inp.v.cpu(), inp.visible, scale=t.scale_value, bias=inp.bias
    )
    assert_matches_golden(out.cpu(), want_out, lowp)

    assert set(stats) == set(want)
    assert stats["visible_keys"].dtype == torch.int64
    assert torch.equal(stats["visible_keys"].cpu(), want["visible_keys"])
    tol = {**STAT_TOLERANCE, **(tolerance or {})}
    for name, (atol, rtol) in tol.items():
        got, ref = stats[name].cpu().double(), want[name].double()
        assert stats[name].dtype == torch.float32, name
        assert got.shape == (b, h, tq), name
        assert not torch.isnan(got).any(), f"{name}: NaN"
        if name == "lse":
            assert torch.equal(got == -math.inf, ref == -math.inf), "lse: -inf rows differ"
            got, ref = got.nan_to_num(neginf=0.0), ref.nan_to_num(neginf=0.0)
        err = (got - ref).abs()
        bound = atol + rtol * ref.abs()
        worst = int(torch.argmax(err - bound))
        assert bool((err <= bound).all()), (
            f"{name}: error {float(err.flatten()[worst]):.3g} > "
            f"{float(bound.flatten()[worst]):.3g} (got {float(got.flatten()[worst]):.8g}, "
            f"reference {float(ref.flatten()[worst]):.8g})"
        )
    empty = want["visible_keys"] == 0
    assert bool((out.cpu()[empty] == 0).all()), "a row with no visible key must output 0"
    for name in STAT_TOLERANCE:
        if name != "lse":
            assert bool((stats[name].cpu()[empty] == 0).all()), f"{name} of an empty row"
    return stats
