"""Per-head statistics of attention weights, in float64 from the definitions (test helper).

The tap's reports are checked against these: the weights come from an independent source (a
transformers model's eager implementation, or a float64 softmax written here), never from the
service or sdpa_core.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

F64 = npt.NDArray[np.float64]


def softmax_weights(
    q: torch.Tensor, k: torch.Tensor, *, scale: float, causal: bool = False
) -> torch.Tensor:
    """softmax(q kᵀ · scale) in float64, top-left causal when asked: [B, H, N_q, N_kv]."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n_q, n_kv = scores.shape[-2:]
        future = torch.ones(n_q, n_kv, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.softmax(scores, dim=-1)


def per_head_stats(weights: npt.NDArray[np.floating], visible: npt.NDArray[np.bool_], *,
                   sink_tokens: int) -> dict[str, F64]:  # fmt: skip
    """Each head's mean over its rows (every row here sees at least one key) of: entropy,
    normalized entropy (H / log(visible keys); 0 with one visible key), max weight and sink
    share (the weight on the first `sink_tokens` key positions). Returns arrays [B, H].

    weights: [B, H, N_q, N_kv]; visible: broadcastable to it.
    """
    p = np.asarray(weights, dtype=np.float64)
    vis = np.broadcast_to(visible, p.shape)
    p = np.where(vis, p, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    entropy = -plogp.sum(-1)  # [B, H, N_q]
    count = vis.sum(-1)
    log_count = np.log(np.maximum(count, 1))
    normalized = np.where(count > 1, entropy / np.where(count > 1, log_count, 1.0), 0.0)
    rows = {
        "entropy": entropy,
        "normalized_entropy": normalized,
        "max_weight": p.max(-1),
        "sink_share": p[..., :sink_tokens].sum(-1),
    }
    return {name: value.mean(-1) for name, value in rows.items()}
