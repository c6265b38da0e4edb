"""docs/concepts.md defines every diagnostic: each field of sdpa_core's one list (summary,
per-head and per-row fields) has its own entry in the page's definitions."""

from __future__ import annotations

import re
from pathlib import Path

from sdpa_core.diagnostics import PER_HEAD_FIELDS, PER_ROW_FIELDS, SUMMARY_FIELDS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"


def defined() -> set[str]:
    """The names the definitions table opens a row with: | `name` | ..."""
    return set(re.findall(r"^\| `([a-z_]+)` \|", PAGE.read_text(encoding="utf-8"), re.MULTILINE))


def test_every_diagnostic_field_is_defined() -> None:
    fields = {*SUMMARY_FIELDS, *PER_HEAD_FIELDS, *PER_ROW_FIELDS}
    assert fields <= defined(), sorted(fields - defined())


def test_nothing_defined_that_the_code_does_not_have() -> None:
    assert defined() <= {*SUMMARY_FIELDS, *PER_HEAD_FIELDS, *PER_ROW_FIELDS}
