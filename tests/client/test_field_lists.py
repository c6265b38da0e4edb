"""The client's lists of statistic names equal the server's (sdpa_core owns the list).

sdpa_client cannot import sdpa_core (torch), so it keeps its own tuples in sdpa_client.fields;
these tests tie them to the dataclasses and field tuples that sdpa_core computes.
"""

from __future__ import annotations

import dataclasses

import sdpa_core
from sdpa_client import fields
from sdpa_core import analysis, diagnostics


def core_names(tuple_name: str, cls: type) -> set[str]:
    """sdpa_core's own tuple when it has one, else the fields of its dataclass."""
    names = getattr(sdpa_core, tuple_name, None) or getattr(diagnostics, tuple_name, None)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
    return set(names)


def test_summary_statistics() -> None:
    expected = core_names("SUMMARY_FIELDS", diagnostics.DiagnosticsSummary)
    assert set(fields.SUMMARY_STAT_NAMES) == expected


def test_per_head_statistics() -> None:
    expected = core_names("PER_HEAD_FIELDS", diagnostics.PerHeadStats)
    assert set(fields.PER_HEAD_STAT_NAMES) == expected


def test_per_row_statistics() -> None:
    expected = core_names("PER_ROW_FIELDS", diagnostics.PerRowStats)
    assert set(fields.PER_ROW_STAT_NAMES) == expected


def test_strategy_statistics() -> None:
    expected = {f.name for f in dataclasses.fields(analysis.StrategyResult)} - {"name", "divisor"}
    assert set(fields.STRATEGY_STAT_NAMES) == expected


def test_counts_are_statistics_the_server_reports() -> None:
    every = set(fields.SUMMARY_STAT_NAMES) | set(fields.PER_ROW_STAT_NAMES)
    assert every >= fields.COUNT_STATS
