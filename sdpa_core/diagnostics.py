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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeAlias

import torch

from sdpa_core.errors import SdpaError

DiagnosticsLevel: TypeAlias = Literal["none", "summary", "full"]
DIAGNOSTICS_LEVELS: tuple[DiagnosticsLevel, ...] = ("none", "summary", "full")
SATURATION_THRESHOLD = 0.99


def check_diagnostics_level(level: object) -> DiagnosticsLevel:
    """level when it is one of DIAGNOSTICS_LEVELS, else an SdpaError (param "diagnostics")."""
    if level not in DIAGNOSTICS_LEVELS:
        raise SdpaError(
            "unknown diagnostics level",
            param="diagnostics",
            expected=" | ".join(DIAGNOSTICS_LEVELS),
            got=repr(level),
        )
    return level


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

    def apply(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> RowStats:
        """A RowStats whose every field is fn(field name, tensor)."""
        return RowStats(**{f.name: fn(f.name, getattr(self, f.name)) for f in fields(self)})

    def index(self, idx: Any) -> RowStats:
        """Apply the same tensor index to every field, e.g. (b, slice(None), slice(0, n))."""
        return self.apply(lambda _, t: t[idx])

    def reshape(self, shape: tuple[int, ...]) -> RowStats:
        """Reshape every field (used to give results q's own leading dims)."""
        return self.apply(lambda _, t: t.reshape(shape))

    def to(self, device: torch.device | str) -> RowStats:
        """Every field moved to device (e.g. "cpu" after a GPU call)."""
        return self.apply(lambda _, t: t.to(device))

    @staticmethod
    def cat(parts: Sequence[RowStats]) -> RowStats:
        """Row statistics of consecutive batch chunks concatenated along dim 0 (one part:
        itself, no copy)."""
        if len(parts) == 1:
            return parts[0]
        return parts[0].apply(lambda name, _: torch.cat([getattr(p, name) for p in parts]))

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


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


# The one list of diagnostic fields, read off the dataclasses themselves so that the two cannot
# disagree. Wire models, clients and the explorer are checked against these tuples.
SUMMARY_FIELDS: tuple[str, ...] = _field_names(DiagnosticsSummary)
"""The summary's scalars, in order (PerHeadStats has the same fields, per head)."""
PER_HEAD_FIELDS: tuple[str, ...] = _field_names(PerHeadStats)
"""The per-head statistics ([..., H] tensors): the summary's fields, per head."""
PER_ROW_FIELDS: tuple[str, ...] = _field_names(PerRowStats)
"""The per-row tensors [..., H, N_q] of level "full", in order."""
ROW_STATS_FIELDS: tuple[str, ...] = _field_names(RowStats)
"""The fields of RowStats, the per-row raw material every path produces."""


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
        "saturated_fraction": (active & (rs.max_weight >= SATURATION_THRESHOLD)).to(torch.float64),
        "grad_health": torch.where(active, rs.grad_health.to(torch.float64), zero),
        "jacobian_fro": torch.where(active, rs.jacobian_fro.to(torch.float64), zero),
    }


# Summary fields that are plain means over the active rows of a per-row quantity.
_ROW_MEAN_FIELDS = (
    "entropy",
    "normalized_entropy",
    "effective_keys",
    "max_weight",
    "saturated_fraction",
    "grad_health",
    "jacobian_fro",
)


def _pool(
    rs: RowStats, derived: dict[str, torch.Tensor], dim: int | None, *, scale: float
) -> dict[str, torch.Tensor]:
    """The summary's statistics, keyed and ordered as SUMMARY_FIELDS, pooled over `dim`
    (-1: per head, [..., H]) or over every row (None: 0-d), in float64 (masked_rows int64)."""

    def total(x: torch.Tensor) -> torch.Tensor:
        return x.sum() if dim is None else x.sum(dim)

    active = derived["active"]
    denom = total(active.to(torch.float64)).clamp(min=1.0)  # active rows
    stats = {name: total(derived[name]) / denom for name in _ROW_MEAN_FIELDS}

    # Chan's parallel merge of per-row (n_i, mean_i, M2_i), written in closed form:
    # n = sum n_i, mean = sum n_i mean_i / n, M2 = sum M2_i + sum n_i (mean_i - mean)^2.
    n_i = rs.visible_keys.to(torch.float64)
    mean_i = torch.where(active, rs.score_mean_raw.to(torch.float64), 0.0)
    m2_i = torch.where(active, rs.score_m2_raw.to(torch.float64), 0.0)
    n_safe = total(n_i).clamp(min=1.0)
    mean = total(n_i * mean_i) / n_safe
    mean_b = mean if dim is None else mean.unsqueeze(-1)
    variance = (total(m2_i) + total(n_i * (mean_i - mean_b) ** 2)) / n_safe
    absmax = torch.where(active, rs.score_abs_max_raw.to(torch.float64), 0.0)
    stats["score_mean_raw"] = mean
    stats["score_variance_raw"] = variance
    stats["score_variance_scaled"] = (scale * scale) * variance
    stats["score_abs_max_scaled"] = abs(scale) * (
        absmax.amax() if dim is None else absmax.amax(dim)
    )
    stats["masked_rows"] = total((~active).to(torch.int64))
    return {name: stats[name] for name in SUMMARY_FIELDS}


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
    # Contiguous copies so that equal rows reduce in the same order whatever their origin.
    rs = row_stats.apply(lambda _, t: t.contiguous())
    derived = _row_derived(rs)

    pooled = _pool(rs, derived, None, scale=scale)
    # One host transfer for every scalar (one sync on CUDA); masked_rows is exact in float64.
    values = torch.stack([pooled[n].to(torch.float64) for n in SUMMARY_FIELDS]).tolist()
    scalars: dict[str, Any] = dict(zip(SUMMARY_FIELDS, values, strict=True))
    scalars["masked_rows"] = int(scalars["masked_rows"])
    summary = DiagnosticsSummary(**scalars)
    per_head = PerHeadStats(**_pool(rs, derived, -1, scale=scale))

    per_row = None
    if level == "full":
        accum = rs.entropy.dtype
        per_row = PerRowStats(
            entropy=derived["entropy"].to(accum),
            normalized_entropy=derived["normalized_entropy"].to(accum),
            max_weight=derived["max_weight"].to(accum),
            effective_keys=derived["effective_keys"].to(accum),
            lse=torch.where(derived["active"], rs.lse, -math.inf),
            visible_keys=rs.visible_keys,
        )
    return Diagnostics(summary=summary, per_head=per_head, per_row=per_row)
