"""Row statistics of the attention weights and their summaries.

Every path (dense, chunked) produces one RowStats: a handful of [..., H, N_q] tensors from
which every diagnostic is derived by summarize(). Summaries are built from RowStats alone, so a
caller that slices a batch's RowStats (the service's batching engine) gets exactly the numbers
a solo call would give for the same rows. Pooled score moments are Chan merges of per-row
(count, mean, M2), never recomputed from a flattened matrix.

Definitions (rows with at least one visible key are "active"; every mean is over them):
- entropy H = -sum p log p (nats); normalized_entropy = H / log(visible keys), 0 for one key;
  effective_keys = exp(H); max_weight = max p; saturated_fraction = share of rows with
  max_weight >= 0.99; grad_health = row mean over visible keys of p(1 - p);
  jacobian_fro = ||diag(p) - p p^T||_F.
- score_*_raw pool every visible raw score q.k (variance with ddof=0);
  score_variance_scaled = scale^2 * raw variance; score_abs_max_scaled = |scale| * max |q.k|.
  A float attn_mask's bias is not part of the score moments (its effect shows in entropy).
- A fully masked row has entropy, max_weight, effective_keys, grad_health and jacobian_fro 0,
  lse -inf, and counts in masked_rows. A summary over zero active rows reports 0.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, TypeAlias

import torch

from sdpa_core.errors import SdpaError

DiagnosticsLevel: TypeAlias = Literal["none", "summary", "full"]
SATURATION_THRESHOLD = 0.99


@dataclass(frozen=True, slots=True)
class RowStats:
    """Per-row raw material for summaries; every field is a tensor [..., H, N_q].

    visible_keys is int64; the float fields use the accumulation dtype (float32, or float64
    for float64 inputs). score_m2_raw is the sum of squared deviations from score_mean_raw
    over the row's visible keys (Welford's M2).
    """

    visible_keys: torch.Tensor
    entropy: torch.Tensor
    max_weight: torch.Tensor
    lse: torch.Tensor
    grad_health: torch.Tensor
    jacobian_fro: torch.Tensor
    score_mean_raw: torch.Tensor
    score_m2_raw: torch.Tensor
    score_abs_max_raw: torch.Tensor

    def index(self, idx: object) -> RowStats:
        """Apply the same tensor index to every field, e.g. (b, slice(None), slice(0, n))."""
        return RowStats(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def reshape(self, shape: tuple[int, ...]) -> RowStats:
        """Reshape every field (used to give results q's own leading dims)."""
        return RowStats(**{f.name: getattr(self, f.name).reshape(shape) for f in fields(self)})

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Field name -> tensor, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class DiagnosticsSummary:
    """Scalars over a whole request (row statistics: mean over active rows)."""

    entropy: float
    normalized_entropy: float
    effective_keys: float
    max_weight: float
    saturated_fraction: float
    score_mean_raw: float
    score_variance_raw: float
    score_variance_scaled: float
    score_abs_max_scaled: float
    grad_health: float
    jacobian_fro: float
    masked_rows: int

    def as_dict(self) -> dict[str, float | int]:
        """Field name -> value, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class PerHeadStats:
    """The summary's statistics per head: each a tensor [..., H] (float64; masked_rows int64)."""

    entropy: torch.Tensor
    normalized_entropy: torch.Tensor
    effective_keys: torch.Tensor
    max_weight: torch.Tensor
    saturated_fraction: torch.Tensor
    score_mean_raw: torch.Tensor
    score_variance_raw: torch.Tensor
    score_variance_scaled: torch.Tensor
    score_abs_max_scaled: torch.Tensor
    grad_health: torch.Tensor
    jacobian_fro: torch.Tensor
    masked_rows: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Field name -> tensor, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class PerRowStats:
    """Per-row tensors [..., H, N_q]; a fully masked row has 0s and lse -inf."""

    entropy: torch.Tensor
    normalized_entropy: torch.Tensor
    max_weight: torch.Tensor
    effective_keys: torch.Tensor
    lse: torch.Tensor
    visible_keys: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Field name -> tensor, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Diagnostics:
    """summary (scalars), per_head ([..., H] tensors) and per_row (only for level "full")."""

    summary: DiagnosticsSummary
    per_head: PerHeadStats
    per_row: PerRowStats | None

    def as_dict(self) -> dict[str, object]:
        """{"summary": {...}, "per_head": {...}, "per_row": {...} | None}."""
        return {
            "summary": self.summary.as_dict(),
            "per_head": self.per_head.as_dict(),
            "per_row": None if self.per_row is None else self.per_row.as_dict(),
        }


def _row_derived(rs: RowStats) -> dict[str, torch.Tensor]:
    """Per-row quantities derived from RowStats (float64), 0 on fully masked rows."""
    vis = rs.visible_keys
    active = vis > 0
    ent = rs.entropy.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=ent.device)
    log_n = torch.log(vis.clamp(min=2).to(torch.float64))  # clamp keeps log(1) = 0 out of a divide
    return {
        "active": active,
        "entropy": torch.where(active, ent, zero),
        "normalized_entropy": torch.where(vis > 1, ent / log_n, zero),
        "effective_keys": torch.where(active, torch.exp(ent), zero),
        "max_weight": torch.where(active, rs.max_weight.to(torch.float64), zero),
        "saturated": (active & (rs.max_weight >= SATURATION_THRESHOLD)).to(torch.float64),
        "grad_health": torch.where(active, rs.grad_health.to(torch.float64), zero),
        "jacobian_fro": torch.where(active, rs.jacobian_fro.to(torch.float64), zero),
    }


_ROW_MEAN_FIELDS = (
    "entropy",
    "normalized_entropy",
    "effective_keys",
    "max_weight",
    "grad_health",
    "jacobian_fro",
)


def _reduce(
    rs: RowStats, derived: dict[str, torch.Tensor], dim: int | None
) -> dict[str, torch.Tensor]:
    """Pool rows over `dim` (-1: per head) or over everything (None), in float64."""

    def total(x: torch.Tensor) -> torch.Tensor:
        return x.sum() if dim is None else x.sum(dim)

    active = derived["active"]
    n_active = total(active.to(torch.float64))
    denom = n_active.clamp(min=1.0)
    out: dict[str, torch.Tensor] = {}
    for name in _ROW_MEAN_FIELDS:
        out[name] = total(derived[name]) / denom
    out["saturated_fraction"] = total(derived["saturated"]) / denom

    # Chan's parallel merge of per-row (n_i, mean_i, M2_i), written in closed form:
    # n = sum n_i, mean = sum n_i mean_i / n, M2 = sum M2_i + sum n_i (mean_i - mean)^2.
    n_i = rs.visible_keys.to(torch.float64)
    mean_i = torch.where(active, rs.score_mean_raw.to(torch.float64), 0.0)
    m2_i = torch.where(active, rs.score_m2_raw.to(torch.float64), 0.0)
    n = total(n_i)
    n_safe = n.clamp(min=1.0)
    mean = total(n_i * mean_i) / n_safe
    mean_b = mean if dim is None else mean.unsqueeze(-1)
    m2 = total(m2_i) + total(n_i * (mean_i - mean_b) ** 2)
    out["score_mean_raw"] = mean
    out["score_variance_raw"] = m2 / n_safe
    absmax = torch.where(active, rs.score_abs_max_raw.to(torch.float64), 0.0)
    out["score_abs_max_raw"] = absmax.amax() if dim is None else absmax.amax(dim)
    out["masked_rows"] = total((~active).to(torch.int64))
    return out


def _canonical(rs: RowStats) -> RowStats:
    """Contiguous copies so that equal rows reduce in the same order whatever their origin."""
    return RowStats(**{f.name: getattr(rs, f.name).contiguous() for f in fields(rs)})


def summarize(
    row_stats: RowStats, *, scale: float, level: Literal["summary", "full"] = "summary"
) -> Diagnostics:
    """Diagnostics (summary, per head, and per row for "full") from RowStats alone.

    `scale` is the softmax scale the rows were computed with (it converts raw score moments to
    scaled ones). The result depends only on the rows given, so summarize(rs.index(i)) of a
    batch equals the diagnostics of a solo call on those rows.
    """
    if level not in ("summary", "full"):
        raise SdpaError(
            "unknown diagnostics level",
            param="diagnostics",
            expected='"summary" or "full"',
            got=repr(level),
        )
    rs = _canonical(row_stats)
    derived = _row_derived(rs)
    scale_sq = scale * scale
    abs_scale = abs(scale)

    pooled = _reduce(rs, derived, None)
    # One host transfer for every scalar (one sync on CUDA).
    names = [
        *_ROW_MEAN_FIELDS,
        "saturated_fraction",
        "score_mean_raw",
        "score_variance_raw",
        "score_abs_max_raw",
    ]
    values = torch.stack([pooled[n] for n in names]).tolist()
    scalars = dict(zip(names, values, strict=True))
    masked_rows = int(pooled["masked_rows"])
    summary = DiagnosticsSummary(
        entropy=scalars["entropy"],
        normalized_entropy=scalars["normalized_entropy"],
        effective_keys=scalars["effective_keys"],
        max_weight=scalars["max_weight"],
        saturated_fraction=scalars["saturated_fraction"],
        score_mean_raw=scalars["score_mean_raw"],
        score_variance_raw=scalars["score_variance_raw"],
        score_variance_scaled=scale_sq * scalars["score_variance_raw"],
        score_abs_max_scaled=abs_scale * scalars["score_abs_max_raw"],
        grad_health=scalars["grad_health"],
        jacobian_fro=scalars["jacobian_fro"],
        masked_rows=masked_rows,
    )

    head = _reduce(rs, derived, -1)
    per_head = PerHeadStats(
        entropy=head["entropy"],
        normalized_entropy=head["normalized_entropy"],
        effective_keys=head["effective_keys"],
        max_weight=head["max_weight"],
        saturated_fraction=head["saturated_fraction"],
        score_mean_raw=head["score_mean_raw"],
        score_variance_raw=head["score_variance_raw"],
        score_variance_scaled=scale_sq * head["score_variance_raw"],
        score_abs_max_scaled=abs_scale * head["score_abs_max_raw"],
        grad_health=head["grad_health"],
        jacobian_fro=head["jacobian_fro"],
        masked_rows=head["masked_rows"],
    )

    per_row = None
    if level == "full":
        lse = torch.where(derived["active"], rs.lse, -math.inf)
        per_row = PerRowStats(
            entropy=derived["entropy"].to(rs.entropy.dtype),
            normalized_entropy=derived["normalized_entropy"].to(rs.entropy.dtype),
            max_weight=derived["max_weight"].to(rs.entropy.dtype),
            effective_keys=derived["effective_keys"].to(rs.entropy.dtype),
            lse=lse,
            visible_keys=rs.visible_keys,
        )
    return Diagnostics(summary=summary, per_head=per_head, per_row=per_row)


def empty_row_stats(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> RowStats:
    """RowStats of rows that see no key (every statistic 0, lse -inf)."""
    zeros = torch.zeros(shape, dtype=dtype, device=device)
    return RowStats(
        visible_keys=torch.zeros(shape, dtype=torch.int64, device=device),
        entropy=zeros,
        max_weight=zeros.clone(),
        lse=torch.full(shape, -math.inf, dtype=dtype, device=device),
        grad_health=zeros.clone(),
        jacobian_fro=zeros.clone(),
        score_mean_raw=zeros.clone(),
        score_m2_raw=zeros.clone(),
        score_abs_max_raw=zeros.clone(),
    )
