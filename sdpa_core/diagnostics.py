"""Row statistics of the attention weights and their summaries.

Every path (dense, chunked) produces one RowStats: a handful of [..., H, N_q] tensors from
which every diagnostic is derived by summarize(). Summaries are built from RowStats alone, so a
caller that slices a batch's RowStats (the service's batching engine) gets exactly the numbers
a solo call would give for the same rows. Pooled score moments are Chan merges of per-row
(count, mean, M2), never recomputed from a flattened matrix.

Definitions (rows with at least one visible key are "active"; every mean is over them):
- entropy H = -sum p log p (nats); normalized_entropy = H / log(visible keys), 0 for one key;
  effective_keys = exp(H); max_weight = max p; saturated_fraction = share of rows with
  max_weight >= 0.99; sink_share = sum of p over the row's first `sink_tokens` keys (the
  attention sink of StreamingLLM; the count is the caller's parameter, DEFAULT_SINK_TOKENS by
  default). Keys a key_padding_mask marks as padding are not among them: a left-padded
  sequence's sink is its first real tokens (sink_keys). grad_health = row mean over visible
  keys of p(1 - p); jacobian_fro = ||diag(p) - p p^T||_F.
- score_*_raw pool every visible raw score q.k (variance with ddof=0);
  score_variance_scaled = scale^2 * raw variance; score_abs_max_scaled = |scale| * max |q.k|.
  A float attn_mask's bias is not part of the score moments (its effect shows in entropy).
- A fully masked row has entropy, max_weight, sink_share, effective_keys, grad_health and
  jacobian_fro 0,
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
# Key positions whose share of each row's attention is sink_share, unless the caller says
# otherwise (StreamingLLM keeps 4 initial tokens; the service passes SDPA_HEALTH_SINK_TOKENS).
DEFAULT_SINK_TOKENS = 4


def sink_keys(key_padding: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """The keys sink_share covers when some may be padding: bool [..., N_kv], True for the
    first `sink_tokens` keys that are not padding (key_padding: bool [..., N_kv], True =
    padding). Without padding they are simply the positions [0, sink_tokens)."""
    kept = ~key_padding
    rank = kept.to(torch.int64).cumsum(-1)  # 1 for the first kept key, 2 for the next, ...
    return kept & (rank <= sink_tokens)


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
    sink_share: torch.Tensor
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
        if tuple(self.entropy.shape) == tuple(shape):
            return self  # already shaped (4-D inputs): no torch call per field
        return self.apply(lambda _, t: t.reshape(shape))

    def to(self, device: torch.device | str) -> RowStats:
        """Every field moved to device (e.g. "cpu" after a GPU call)."""
        return self.apply(lambda _, t: t.to(device))

    @staticmethod
    def cat(parts: Sequence[RowStats], dim: int = 0) -> RowStats:
        """Row statistics of consecutive chunks concatenated along dim: 0 for batch chunks,
        -1 for tiles of query rows (one part: itself, no copy)."""
        if len(parts) == 1:
            return parts[0]
        return parts[0].apply(lambda name, _: torch.cat([getattr(p, name) for p in parts], dim=dim))

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
    sink_share: float
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
    sink_share: torch.Tensor
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
    sink_share: torch.Tensor
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


# Summary fields that are plain means over the active rows of a per-row quantity, in the
# order of the stacked tensor _row_means() builds.
_ROW_MEAN_FIELDS = (
    "entropy",
    "normalized_entropy",
    "effective_keys",
    "max_weight",
    "saturated_fraction",
    "sink_share",
    "grad_health",
    "jacobian_fro",
)
# RowStats fields summarize() reads as float64, stacked in this order (one conversion).
_STACKED = (
    "entropy",
    "max_weight",
    "sink_share",
    "grad_health",
    "jacobian_fro",
    "score_mean_raw",
    "score_m2_raw",
    "score_abs_max_raw",
)


@dataclass(frozen=True, slots=True)
class _Rows:
    """RowStats as summarize() needs them: float64, 0 on fully masked rows."""

    active: torch.Tensor  # bool [..., H, N_q]
    count: torch.Tensor  # visible keys, float64 [..., H, N_q]
    means: torch.Tensor  # the _ROW_MEAN_FIELDS per row, float64 [F, ..., H, N_q]
    score_mean: torch.Tensor  # [..., H, N_q]
    score_m2: torch.Tensor
    score_abs_max: torch.Tensor


def _rows(rs: RowStats) -> _Rows:
    """The per-row quantities of every summary statistic, in a few stacked operations (each
    torch call costs microseconds of overhead, which dominate small requests)."""
    vis = rs.visible_keys
    active = vis > 0
    # One float64 copy of every field (contiguous, so equal rows reduce in the same order
    # whatever their origin), zeroed on fully masked rows.
    raw = torch.stack([getattr(rs, name) for name in _STACKED]).to(torch.float64)
    raw = torch.where(active, raw, 0.0)  # [8, ..., H, N_q]
    ent, mw = raw[0], raw[1]
    count = vis.to(torch.float64)
    # H <= log n exactly; fp32 rounding can put a uniform row a few ulps above 1, which
    # would leave [0, 1] (and a histogram's le="1.0" bucket). clamp(min=2) keeps log(1) = 0
    # out of the divide; one visible key has normalized entropy 0.
    normalized = torch.where(vis > 1, (ent / count.clamp(min=2.0).log()).clamp(max=1.0), 0.0)
    means = torch.stack(
        [
            ent,
            normalized,
            torch.where(active, ent.exp(), 0.0),  # effective keys
            mw,
            (mw >= SATURATION_THRESHOLD).to(torch.float64),  # 0 on masked rows: mw is 0 there
            raw[2],  # sink share
            raw[3],  # grad health
            raw[4],  # jacobian
        ]
    )
    return _Rows(
        active=active,
        count=count,
        means=means,
        score_mean=raw[5],
        score_m2=raw[6],
        score_abs_max=raw[7],
    )


def _pool(rows: _Rows, dim: int | None, *, scale: float) -> dict[str, torch.Tensor]:
    """The summary's statistics, keyed and ordered as SUMMARY_FIELDS, pooled over `dim`
    (-1: per head, [..., H]) or over every row (None: 0-d), in float64 (masked_rows int64)."""

    def total(x: torch.Tensor, *, lead: int = 0) -> torch.Tensor:
        if dim is not None:
            return x.sum(dim)
        return x.reshape((*x.shape[:lead], -1)).sum(-1) if lead else x.sum()

    active = rows.active
    denom = total(active.to(torch.float64)).clamp(min=1.0)  # active rows
    pooled_means = total(rows.means, lead=1) / denom  # [F, ...]
    stats = dict(zip(_ROW_MEAN_FIELDS, pooled_means.unbind(0), strict=True))

    # Chan's parallel merge of per-row (n_i, mean_i, M2_i), written in closed form:
    # n = sum n_i, mean = sum n_i mean_i / n, M2 = sum M2_i + sum n_i (mean_i - mean)^2.
    n_i, mean_i = rows.count, rows.score_mean
    n_safe = total(n_i).clamp(min=1.0)
    mean = total(n_i * mean_i) / n_safe
    mean_b = mean if dim is None else mean.unsqueeze(-1)
    variance = (total(rows.score_m2) + total(n_i * (mean_i - mean_b).square())) / n_safe
    absmax = rows.score_abs_max.amax() if dim is None else rows.score_abs_max.amax(dim)
    stats["score_mean_raw"] = mean
    stats["score_variance_raw"] = variance
    stats["score_variance_scaled"] = (scale * scale) * variance
    stats["score_abs_max_scaled"] = abs(scale) * absmax
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
    rows = _rows(row_stats)
    pooled = _pool(rows, None, scale=scale)
    # One host transfer for every scalar (one sync on CUDA); masked_rows is exact in float64.
    # Every field but masked_rows is a float64 0-d tensor already.
    masked = pooled["masked_rows"].to(torch.float64)
    values = torch.stack([masked if n == "masked_rows" else pooled[n] for n in SUMMARY_FIELDS])
    scalars: dict[str, Any] = dict(zip(SUMMARY_FIELDS, values.tolist(), strict=True))
    scalars["masked_rows"] = int(scalars["masked_rows"])
    summary = DiagnosticsSummary(**scalars)
    per_head = PerHeadStats(**_pool(rows, -1, scale=scale))

    per_row = None
    if level == "full":
        accum = row_stats.entropy.dtype
        means = dict(zip(_ROW_MEAN_FIELDS, rows.means.to(accum).unbind(0), strict=True))
        per_row = PerRowStats(
            entropy=means["entropy"],
            normalized_entropy=means["normalized_entropy"],
            max_weight=means["max_weight"],
            effective_keys=means["effective_keys"],
            sink_share=means["sink_share"],
            lse=torch.where(rows.active, row_stats.lse, -math.inf),
            visible_keys=row_stats.visible_keys,
        )
    return Diagnostics(summary=summary, per_head=per_head, per_row=per_row)
