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


# Summary fields that are plain means over the active rows of a per-row quantity.
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
# RowStats fields summarize() reads as float64, copied in this order (one conversion).
_COPIED = (
    "entropy",
    "max_weight",
    "sink_share",
    "grad_health",
    "jacobian_fro",
    "score_mean_raw",
    "score_m2_raw",
    "score_abs_max_raw",
)
# The rows of _Rows.table, every one summed over rows: the active-row indicator, the
# _ROW_MEAN_FIELDS, then the score moments n_i, n_i * mean_i and M2_i of Chan's merge.
_TABLE = ("active", *_ROW_MEAN_FIELDS, "score_n", "score_n_mean", "score_m2")
_ACTIVE, _N, _N_MEAN, _M2 = (
    _TABLE.index(n) for n in ("active", "score_n", "score_n_mean", "score_m2")
)
_MEANS = slice(_TABLE.index(_ROW_MEAN_FIELDS[0]), _TABLE.index(_ROW_MEAN_FIELDS[-1]) + 1)


@dataclass(frozen=True, slots=True)
class _Rows:
    """RowStats as summarize() needs them: float64, 0 on fully masked rows."""

    active: torch.Tensor  # float64 [..., H, N_q]: 1.0 on active rows, 0.0 on fully masked ones
    table: torch.Tensor  # the _TABLE quantities per row, float64 [len(_TABLE), ..., H, N_q]
    count: torch.Tensor  # visible keys (score_n), [..., H, N_q]
    score_mean: torch.Tensor  # [..., H, N_q]
    score_abs_max: torch.Tensor  # [..., H, N_q]


def _rows(rs: RowStats) -> _Rows:
    """Every per-row quantity the summary sums, in one table.

    Each torch call costs microseconds of dispatch, which dominate small requests: the fields
    are converted to float64 at once, every summed quantity is stacked so that one reduction
    pools them all, and every row of the table is float64 before the stack (a stack that
    converts, even one bool row, costs three times as much). The copies are contiguous, so
    equal rows reduce in the same order whatever their origin (a slice of a batch's RowStats,
    or a solo call's).
    """
    vis = rs.visible_keys
    count = vis.to(torch.float64)
    active = count.clamp(max=1.0)  # 1.0 on active rows, 0.0 on fully masked ones
    raw = torch.stack([getattr(rs, name) for name in _COPIED]).to(torch.float64)
    # [8, ..., H, N_q], 0 on fully masked rows (a where, not a product: they may hold NaN)
    raw = torch.where(vis > 0, raw, 0.0)
    ent, mw, sink, grad, jac, score_mean, score_m2, score_abs_max = raw.unbind(0)
    # H <= log n exactly; fp32 rounding can put a uniform row a few ulps above 1, which would
    # leave [0, 1] (and a histogram's le="1.0" bucket). One visible key (log 1 = 0) has
    # normalized entropy 0, as a fully masked row: the where drops their 0/0 and 0/-inf.
    normalized = torch.where(vis > 1, ent / count.log(), 0.0).clamp(max=1.0)
    table = torch.stack(
        [
            active,
            ent,
            normalized,
            ent.exp().mul_(active),  # effective keys; ent is 0 on masked rows: exp(0) * 0
            mw,
            # saturated, 0 on masked rows (mw is 0 there): converted before the stack
            (mw >= SATURATION_THRESHOLD).to(torch.float64),
            sink,
            grad,
            jac,
            count,  # score_n
            count * score_mean,  # score_n_mean
            score_m2,
        ]
    )  # [len(_TABLE), ..., H, N_q]
    return _Rows(
        active=active,
        table=table,
        count=count,
        score_mean=score_mean,
        score_abs_max=score_abs_max,
    )


# The rows of a head table after the _TABLE sums: Chan's spread sum n_i (mean_i - mean)^2,
# the head's score mean and its max |raw score|.
_SPREAD, _MEAN, _ABS_MAX = len(_TABLE), len(_TABLE) + 1, len(_TABLE) + 2
HEAD_TABLE_ROWS = len(_TABLE) + 3
HEAD_TABLE_FIELDS = _COPIED
"""The RowStats fields a native head table reads, in this order (the C++ function's)."""

HeadTable: TypeAlias = Callable[[RowStats], "torch.Tensor | None"]
"""A native head table: RowStats -> what _head_table computes (float64 [HEAD_TABLE_ROWS,
heads], heads in row-major order of the leading dims) in one call, or None for rows it does
not take (another device or dtype)."""

_native: list[HeadTable] = []


def set_native_head_table(head_table: HeadTable | None) -> None:
    """Install (None: remove) a native head table, which summarize() then asks first. The CPU
    flash kernel installs its own when it is built (kernels/cpu_flash.py): a summary is then
    one C++ call and a dozen small torch calls, whatever the number of rows and fields."""
    _native[:] = [] if head_table is None else [head_table]


def _head_table(rows: _Rows) -> torch.Tensor:
    """Per head: the _TABLE sums over its rows, its spread, mean and max |raw score|
    (float64 [HEAD_TABLE_ROWS, ..., H]), in a fixed handful of torch calls."""
    sums = rows.table.sum(-1)  # [len(_TABLE), ..., H]
    # Chan's parallel merge of per-row (n_i, mean_i, M2_i), written in closed form:
    # n = sum n_i, mean = sum n_i mean_i / n, M2 = sum M2_i + sum n_i (mean_i - mean)^2.
    mean = sums[_N_MEAN] / sums[_N].clamp(min=1.0)
    spread = torch.linalg.vecdot((rows.score_mean - mean.unsqueeze(-1)).square(), rows.count)
    return torch.cat([sums, torch.stack([spread, mean, rows.score_abs_max.amax(-1)])])


def _summarized(
    heads_t: torch.Tensor, *, n_rows: int, scale: float
) -> tuple[DiagnosticsSummary, PerHeadStats]:
    """The summary's scalars and its statistics per head from the head table ([HEAD_TABLE_ROWS,
    ..., H]; n_rows: the query rows of each head).

    The summary pools the heads (Chan's merge again, now of the heads' (n, mean, M2)), so its
    cost is a fixed handful of torch calls whatever the number of fields, and every number
    reaches the host in one transfer (one sync on CUDA). What follows that transfer is done on
    Python floats (IEEE float64 arithmetic, as torch's)."""
    per = heads_t.unbind(0)  # one view per row of the table, in one call
    heads = heads_t.reshape(HEAD_TABLE_ROWS, -1).tolist()  # [rows, heads], even for 2-D q
    totals, (spread_h, mean_h, abs_max_h) = heads[:_SPREAD], heads[_SPREAD:]
    n_h = totals[_N]
    sum_of = [sum(row) for row in totals]  # [len(_TABLE)]: pooled over every head
    active = sum_of[_ACTIVE]  # an exact count: a sum of 0s and 1s in float64
    denom = max(active, 1.0)
    n_total = max(sum_of[_N], 1.0)
    mean_v = sum_of[_N_MEAN] / n_total
    spread_v = sum(n * (m - mean_v) ** 2 for n, m in zip(n_h, mean_h, strict=True))
    variance_v = (sum_of[_M2] + sum(spread_h) + spread_v) / n_total
    summary = DiagnosticsSummary(
        **{
            name: total / denom
            for name, total in zip(_ROW_MEAN_FIELDS, sum_of[_MEANS], strict=True)
        },
        score_mean_raw=mean_v,
        score_variance_raw=variance_v,
        score_variance_scaled=(scale * scale) * variance_v,
        score_abs_max_scaled=abs(scale) * max(abs_max_h, default=0.0),
        masked_rows=n_rows * len(n_h) - int(active),
    )
    variance = (per[_M2] + per[_SPREAD]) / per[_N].clamp(min=1.0)
    active_h = per[_ACTIVE]
    means = (heads_t[_MEANS] / active_h.clamp(min=1.0)).unbind(0)  # over active rows
    per_head = PerHeadStats(
        **dict(zip(_ROW_MEAN_FIELDS, means, strict=True)),
        score_mean_raw=per[_MEAN],
        score_variance_raw=variance,
        score_variance_scaled=(scale * scale) * variance,
        score_abs_max_scaled=abs(scale) * per[_ABS_MAX],
        masked_rows=(n_rows - active_h).to(torch.int64),  # an exact count in float64
    )
    return summary, per_head


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
    native = _native[:]  # (a copy: set_native_head_table may empty it meanwhile)
    heads_t = native[0](row_stats) if native else None
    rows = None
    if heads_t is None or level == "full":  # the per-row table: no native one, or per_row
        rows = _rows(row_stats)
        if heads_t is None:
            heads_t = _head_table(rows)
    n_rows = row_stats.visible_keys.shape[-1]
    summary, per_head = _summarized(heads_t, n_rows=n_rows, scale=scale)

    per_row = None
    if level == "full":
        assert rows is not None
        accum = row_stats.entropy.dtype
        # [8, ..., H, N_q]: the _ROW_MEAN_FIELDS per row
        means = dict(zip(_ROW_MEAN_FIELDS, rows.table[_MEANS].to(accum).unbind(0), strict=True))
        per_row = PerRowStats(
            entropy=means["entropy"],
            normalized_entropy=means["normalized_entropy"],
            max_weight=means["max_weight"],
            effective_keys=means["effective_keys"],
            sink_share=means["sink_share"],
            lse=torch.where(row_stats.visible_keys > 0, row_stats.lse, -math.inf),
            visible_keys=row_stats.visible_keys,
        )
    return Diagnostics(summary=summary, per_head=per_head, per_row=per_row)
