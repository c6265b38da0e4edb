"""The dense path: explicit scores and softmax, the only path that returns the weights.

It is the tiled routine of the chunked path (attend_tiles_steps) run with one key block (the whole
row), writing the normalized exponentials straight into the weight matrix, so dense and
chunked share every formula and read their visibility from the same MaskPlan. Query tiles
bound the score scratch (TILE_ELEMENTS: a few MiB).
"""

from __future__ import annotations

import torch

from sdpa_core.chunked import TILE_ELEMENTS, attend_tiles_steps
from sdpa_core.diagnostics import DEFAULT_SINK_TOKENS, RowStats
from sdpa_core.masks import MaskPlan
from sdpa_core.tiles import finish


def dense_tile_q(q4: torch.Tensor, k4: torch.Tensor) -> int:
    """Query rows per tile: the score tile stays within TILE_ELEMENTS while the weights (the only
    N_q x N_kv allocation) are filled in place."""
    b, h, n_q, _ = q4.shape
    return min(n_q, max(16, TILE_ELEMENTS // (b * h * k4.shape[2])))


def dense_attention(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    accum_dtype: torch.dtype,
    need_weights: bool,
    need_stats: bool,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    sink_cols: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, RowStats | None]:
    """Output [B, H, N_q, D_v], weights [B, H, N_q, N_kv] (when asked) and RowStats
    [B, H, N_q] (when asked; sink_share over sink_cols, or the first sink_tokens keys), all
    in accum_dtype."""
    return finish(
        attend_tiles_steps(
            q4,
            k4,
            v4,
            plan,
            scale=scale,
            accum_dtype=accum_dtype,
            need_stats=need_stats,
            block_size=k4.shape[2],  # one key block: the whole row
            tile_q=dense_tile_q(q4, k4),
            keep_weights=need_weights,
            sink_tokens=sink_tokens,
            sink_cols=sink_cols,
        )
    )
