"""The names of the statistics the server reports: each list written once, here.

The result types read their fields from these tuples. The server computes the statistics in its
compute library, which this package cannot import (it would pull in torch); the project's tests
assert that these sets equal the server's own lists.
"""

from __future__ import annotations

from typing import Final

SUMMARY_STAT_NAMES: Final[tuple[str, ...]] = (
    "entropy", "normalized_entropy", "effective_keys", "max_weight", "saturated_fraction",
    "sink_share", "score_mean_raw", "score_variance_raw", "score_variance_scaled",
    "score_abs_max_scaled", "grad_health", "jacobian_fro", "masked_rows",
)  # fmt: skip
"""diagnostics.summary: scalars pooled over the request."""

PER_HEAD_STAT_NAMES: Final[tuple[str, ...]] = SUMMARY_STAT_NAMES
"""diagnostics.per_head: the summary's statistics, as arrays [..., H]."""

PER_ROW_STAT_NAMES: Final[tuple[str, ...]] = (
    "entropy", "normalized_entropy", "max_weight", "effective_keys", "sink_share", "lse",
    "visible_keys",
)  # fmt: skip
"""diagnostics.per_row (level "full"): arrays [..., H, N_q]."""

STRATEGY_STAT_NAMES: Final[tuple[str, ...]] = (
    "score_variance", "entropy", "normalized_entropy", "max_weight", "saturated_fraction",
    "grad_health",
)  # fmt: skip
"""Each strategy of /v1/analyze: the softmax's statistics under that strategy's divisor."""

COUNT_STATS: Final[frozenset[str]] = frozenset({"masked_rows", "visible_keys"})
"""Statistics that count rows or keys: integers."""
