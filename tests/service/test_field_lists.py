"""The diagnostic field list has one owner, sdpa_core: the wire models and the explorer page
follow it, so adding a statistic there and forgetting one of them fails here."""

from __future__ import annotations

import dataclasses
import re
import typing

from sdpa_core import DIAGNOSTICS_LEVELS, PATHS, PER_ROW_FIELDS, SUMMARY_FIELDS, StrategyResult
from service.api.ui import STATIC_DIR
from service.serving.encode import STRATEGY_STATISTICS
from service.wire.codec import FLOAT_DTYPE_NAMES
from service.wire.models import (
    AttentionMeta,
    AttentionRequest,
    DiagnosticsOut,
    StrategyOut,
    SummaryOut,
    TensorOut,
)


def test_the_wire_summary_is_the_core_summary() -> None:
    assert tuple(SummaryOut.model_fields) == SUMMARY_FIELDS


def test_the_wire_per_row_description_names_every_per_row_statistic() -> None:
    description = DiagnosticsOut.model_fields["per_row"].description or ""
    named = re.findall(r"[a-z_]+", description.split(":", 1)[1].split(" as ")[0])
    assert tuple(named) == PER_ROW_FIELDS


def test_the_wire_strategy_entry_is_the_core_strategy_result() -> None:
    core = tuple(f.name for f in dataclasses.fields(StrategyResult))
    assert tuple(StrategyOut.model_fields) == core
    assert ("name", *STRATEGY_STATISTICS) == core


def test_the_wire_paths_are_the_core_paths() -> None:
    path = AttentionMeta.model_fields["path"].annotation
    assert typing.get_args(path) == PATHS


def test_the_wire_diagnostics_levels_are_the_core_levels() -> None:
    level = AttentionRequest.model_fields["diagnostics"].annotation
    assert typing.get_args(level) == DIAGNOSTICS_LEVELS


def test_the_wire_dtypes_are_the_core_dtypes() -> None:
    dtype = TensorOut.model_fields["dtype"].annotation
    assert typing.get_args(dtype) == FLOAT_DTYPE_NAMES


def explorer_block(opening: str, closing: str) -> str:
    """The text of app.js from `opening` to the next `closing`."""
    source = (STATIC_DIR / "app.js").read_text(encoding="utf-8")
    start = source.index(opening)
    return source[start : source.index(closing, start)]


def test_the_explorer_shows_every_summary_statistic_in_order() -> None:
    block = explorer_block("const SUMMARY_FIELDS = [", "];")
    names = re.findall(r'^\s*\["([a-z_]+)"', block, flags=re.MULTILINE)
    assert tuple(names) == SUMMARY_FIELDS


def test_the_explorer_row_metrics_are_per_row_statistics() -> None:
    block = explorer_block("const ROW_METRICS = {", "};")
    names = re.findall(r"^\s*([a-z_]+): \{", block, flags=re.MULTILINE)
    assert names
    assert set(names) <= set(PER_ROW_FIELDS)
