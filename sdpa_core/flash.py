"""The flash path: one kernel call per tile for the output and every RowStats field.

A flash kernel (sdpa_core/kernels: Triton on CUDA, the compiled CPU kernel) walks the keys
once per query row with an online softmax and the statistics' accumulators beside it, so the
diagnostics cost about what the output does and memory stays O(N): no score tile outlives a
key block, inside the kernel. This module turns a tile's MaskPlan into the kernel contract's
arguments and the kernel's answer into RowStats:

- causality is an index rule (q_start, causal_shift), never a tensor;
- every other part of the plan (key padding, a bool attn_mask, a float mask's -inf entries)
  is one bool `visible`, the AND of the parts in their smallest broadcast shape, passed as an
  expand()ed view; a float attn_mask is `bias`, likewise;
- sink_share: the kernel counts keys j < sink_tokens. When a key_padding_mask may hide some
  of them (the sink is then each sequence's first real keys, sink_cols), the kernel is told
  there is no sink and the share is computed here from the kernel's lse over those few keys
  (sink_tokens of them per row: O(N_q x sink_tokens x D)).

float64 never reaches a kernel (the chunked path serves it).
"""

from __future__ import annotations

import math
from typing import Final

import torch

from sdpa_core.diagnostics import RowStats
from sdpa_core.kernels import FlashTile
from sdpa_core.masks import MaskPlan

FLASH_TILE_ROWS: Final = 64
"""The query rows a tile is cut at multiples of (AttentionRun's row quantum on this path):
a kernel's cost is proportional to its rows, so a tile costs its share and no more."""

FLASH_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)


def flash_attention(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    plan: MaskPlan,
    *,
    kernel: FlashTile,
    scale: float,
    sink_tokens: int,
    sink_cols: torch.Tensor | None,
) -> tuple[torch.Tensor, RowStats]:
    """One kernel call over [B, H, tq, D] queries (a tile, with its own rows of the plan):
    -> (output [B, H, tq, D_v] in q's dtype, RowStats [B, H, tq] in float32)."""
    b, h, tq, _ = q4.shape
    n_kv = plan.n_kv
    full = (b, h, tq, n_kv)
    vis = plan.parts_block(0, tq, 0, n_kv)
    bias = plan.bias_block(0, tq, 0, n_kv)
    causal_shift = None if plan.causal == "none" else plan.causal_offset - plan.row_offset
    out, stats = kernel(
        q4,
        k4,
        v4,
        scale=scale,
        q_start=plan.row_offset,
        causal_shift=causal_shift,
        key_lengths=None,
        visible=None if vis is None else vis.expand(full),
        bias=None if bias is None else bias.expand(full),
        sink_tokens=sink_tokens if sink_cols is None else 0,
    )
    rows = RowStats(**stats)
    if sink_cols is not None:
        share = _sink_share(q4, k4, plan, scale=scale, lse=rows.lse, sink_cols=sink_cols)
        rows = RowStats(**{**stats, "sink_share": share})
    return out, rows


def _sink_share(
    q4: torch.Tensor,
    k4: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    lse: torch.Tensor,
    sink_cols: torch.Tensor,
) -> torch.Tensor:
    """Each row's weight on its sink keys (sink_cols: bool [B|1, H|1, N_kv], the first
    sink_tokens keys that are not padding): exp(s - lse) summed over the visible ones, from
    the sink keys' scores alone. float32 [B, H, tq]; 0 on a row with no visible key."""
    b, h, tq, _ = q4.shape
    n_kv, group = plan.n_kv, h // k4.shape[1]
    width = min(n_kv, int(sink_cols.sum(-1).max()))
    if width == 0:
        return torch.zeros(b, h, tq, dtype=torch.float32, device=q4.device)
    # The sink keys' positions first, in key order (stable sort of "not a sink key").
    order = torch.sort((~sink_cols).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
    is_sink = torch.gather(sink_cols, -1, order).expand(b, h, width)  # [B, H, S]
    cols = order.expand(b, h, width)  # [B, H, S]
    batch = torch.arange(b, device=q4.device).view(b, 1, 1)
    kv_head = (torch.arange(h, device=q4.device) // group).view(1, h, 1)
    keys = k4[batch, kv_head, cols].to(torch.float32)  # [B, H, S, D]
    s = scale * torch.einsum("bhqd,bhsd->bhqs", q4.to(torch.float32), keys)  # [B, H, tq, S]
    at = cols.unsqueeze(2).expand(b, h, tq, width)  # the sink keys' columns, per row
    bias = plan.bias_block(0, tq, 0, n_kv)
    if bias is not None:
        s = s + torch.gather(bias.expand(b, h, tq, n_kv), -1, at).to(torch.float32)
    keep = is_sink.unsqueeze(2).expand(b, h, tq, width)
    vis = plan.parts_block(0, tq, 0, n_kv)
    if vis is not None:
        keep = keep & torch.gather(vis.expand(b, h, tq, n_kv), -1, at)
    if plan.causal != "none":
        rows = torch.arange(tq, device=q4.device).view(1, 1, tq, 1)
        keep = keep & (at <= rows + plan.causal_offset)
    active = (lse > -math.inf).unsqueeze(-1)
    p = torch.exp(s - torch.where(active, lse.unsqueeze(-1), 0.0))
    share = torch.where(keep & active, p, 0.0).sum(-1)
    return share.clamp(max=1.0)
