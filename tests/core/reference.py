"""An independent float64 reference for attention and its diagnostics (test helper).

Written from the definitions, sharing no code with sdpa_core: GQA by explicit
repeat_interleave, the visibility matrix built element by element, softmax over the visible
entries only, diagnostics from the weight matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Reference:
    out: torch.Tensor  # [B, H, N_q, D_v] float64
    weights: torch.Tensor  # [B, H, N_q, N_kv] float64
    visible: torch.Tensor  # [B, H, N_q, N_kv] bool
    raw: torch.Tensor  # [B, H, N_q, N_kv] float64 q.k


def _as4(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[None]
    return x.reshape(-1, *x.shape[-3:])


def visibility(
    *,
    b: int,
    h: int,
    n_q: int,
    n_kv: int,
    causal: str,
    key_lengths: list[int] | list[list[int]] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, H, N_q, N_kv] bool, element by element. key_lengths: [B] or [B][H] lists;
    key_padding_mask: [B, N_kv] or [B, H, N_kv] (True = pad); attn_mask: 4-D broadcastable
    (bool: True = attend; float: -inf = not visible)."""
    vis = torch.ones(b, h, n_q, n_kv, dtype=torch.bool)
    am = None
    if attn_mask is not None:
        am = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        am = am.expand(b, h, n_q, n_kv)
    for bi in range(b):
        for hi in range(h):
            for i in range(n_q):
                for j in range(n_kv):
                    ok = True
                    if causal == "top_left":
                        ok &= j <= i
                    elif causal == "bottom_right":
                        ok &= j <= i + n_kv - n_q
                    if key_lengths is not None:
                        row = key_lengths[bi]
                        length = row[hi] if isinstance(row, list) else row
                        ok &= j < length
                    if key_padding_mask is not None:
                        pad = (
                            key_padding_mask[bi, j]
                            if key_padding_mask.dim() == 2
                            else key_padding_mask[bi, hi, j]
                        )
                        ok &= not bool(pad)
                    if am is not None:
                        val = am[bi, hi, i, j]
                        ok &= bool(val) if am.dtype == torch.bool else float(val) != -math.inf
                    vis[bi, hi, i, j] = ok
    return vis


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> Reference:
    """float64 attention over the visible entries of the 4-D-normalized inputs."""
    q4, k4, v4 = (_as4(x).to(torch.float64) for x in (q, k, v))
    group = q4.shape[1] // k4.shape[1]
    k4 = k4.repeat_interleave(group, dim=1)
    v4 = v4.repeat_interleave(group, dim=1)
    c = 1.0 / math.sqrt(q4.shape[-1]) if scale is None else scale
    raw = q4 @ k4.transpose(-1, -2)
    s = raw * c
    if bias is not None:
        bb = bias.to(torch.float64)
        bb = bb.reshape((1,) * (4 - bb.dim()) + tuple(bb.shape))
        s = s + torch.where(torch.isinf(bb), 0.0, bb)
    s = s.masked_fill(~visible, -math.inf)
    # softmax over the visible entries of each row; a row with none keeps weights 0
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), 0.0, row_max)
    e = torch.where(visible, torch.exp(s - row_max), 0.0)
    total = e.sum(-1, keepdim=True)
    weights = e / torch.where(total > 0, total, 1.0)
    out = weights @ v4
    return Reference(out=out, weights=weights, visible=visible, raw=raw)


def lowp_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same formula in q's dtype (softmax in float32 as torch's math backend does):
    the error budget of §4.4 is F x this reference's error against the float64 one."""
    dt = q.dtype
    q4, k4, v4 = _as4(q), _as4(k), _as4(v)
    group = q4.shape[1] // k4.shape[1]
    k4 = k4.repeat_interleave(group, dim=1)
    v4 = v4.repeat_interleave(group, dim=1)
    c = 1.0 / math.sqrt(q4.shape[-1]) if scale is None else scale
    s = (q4 @ k4.transpose(-1, -2)) * c
    if bias is not None:
        bb = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        s = s + torch.where(torch.isinf(bb), 0.0, bb).to(dt)
    s = s.float().masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    p = (e / torch.where(den > 0, den, 1.0)).to(dt)
    return p @ v4


@dataclass(frozen=True)
class RefRows:
    """Per-row float64 diagnostics [B, H, N_q] and pooled score statistics."""

    visible_keys: np.ndarray
    entropy: np.ndarray
    normalized_entropy: np.ndarray
    max_weight: np.ndarray
    effective_keys: np.ndarray
    lse: np.ndarray
    grad_health: np.ndarray
    jacobian_fro: np.ndarray
    pooled_mean_raw: float
    pooled_var_raw: float
    abs_max_raw: float
    masked_rows: int


def reference_rows(ref: Reference, *, scale: float, bias: torch.Tensor | None = None) -> RefRows:
    """Diagnostics straight from the definitions (weight matrix, explicit Jacobian)."""
    w = ref.weights.numpy()
    vis = ref.visible.numpy()
    raw = ref.raw.numpy()
    s = raw * scale
    if bias is not None:
        bb = bias.to(torch.float64)
        bias_np = bb.reshape((1,) * (4 - bb.dim()) + tuple(bb.shape)).expand(*vis.shape).numpy()
        s = s + np.where(np.isinf(bias_np), 0.0, bias_np)
    shape = vis.shape[:-1]
    out = {
        name: np.zeros(shape)
        for name in (
            "entropy",
            "normalized_entropy",
            "max_weight",
            "effective_keys",
            "grad_health",
            "jacobian_fro",
        )
    }
    lse = np.full(shape, -np.inf)
    counts = vis.sum(-1)
    visible_raw = []
    for idx in np.ndindex(*shape):
        sel = vis[idx]
        n = int(sel.sum())
        if n == 0:
            continue
        p = w[idx][sel]
        visible_raw.append(raw[idx][sel])
        pos = p[p > 0]
        ent = float(-(pos * np.log(pos)).sum())
        out["entropy"][idx] = ent
        out["normalized_entropy"][idx] = ent / math.log(n) if n > 1 else 0.0
        out["max_weight"][idx] = p.max()
        out["effective_keys"][idx] = math.exp(ent)
        out["grad_health"][idx] = float((p * (1 - p)).mean())
        jac = np.diag(p) - np.outer(p, p)
        out["jacobian_fro"][idx] = float(np.sqrt((jac * jac).sum()))
        row_s = s[idx][sel]
        mx = row_s.max()
        lse[idx] = mx + math.log(np.exp(row_s - mx).sum())
    allraw = np.concatenate(visible_raw) if visible_raw else np.zeros(0)
    return RefRows(
        visible_keys=counts,
        lse=lse,
        pooled_mean_raw=float(allraw.mean()) if allraw.size else 0.0,
        pooled_var_raw=float(allraw.var()) if allraw.size else 0.0,
        abs_max_raw=float(np.abs(allraw).max()) if allraw.size else 0.0,
        masked_rows=int((counts == 0).sum()),
        **out,
    )


# Per-dtype floors (torch test_transformers.py default_atol / default_rtol, kernel-anchors §4.2).
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float32: 1e-5, torch.float64: 1e-7}
RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6, torch.float64: 1e-7}


def assert_matches_golden(
    test: torch.Tensor,
    golden: torch.Tensor,
    lowp: torch.Tensor | None,
    *,
    fudge: float = 5.0,
    what: str = "output",
) -> None:
    """kernel-anchors §4.4: max|test - golden| <= max(floor, fudge * max|lowp - golden|),
    with floor = atol + rtol * max|golden| of the test dtype (the §4.2 tables)."""
    dt = test.dtype
    t64 = test.to(torch.float64).reshape(golden.shape)
    assert not torch.isnan(t64).any(), f"{what}: NaN"
    err = float((t64 - golden).abs().max())
    floor = ATOL[dt] + RTOL[dt] * float(golden.abs().max())
    ref_err = (
        0.0
        if lowp is None
        else float((lowp.to(torch.float64).reshape(golden.shape) - golden).abs().max())
    )
    bound = max(floor, fudge * ref_err)
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} ({dt})"
