"""The settings table in docs/operations/settings.md is the one place the defaults are written
down: every setting has a row, and each row's default is what Settings() holds."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from service.settings import Settings

PAGE = Path(__file__).resolve().parents[1] / "docs" / "operations" / "settings.md"
ROW = re.compile(r"^\| `((?:SDPA|OTEL)_[A-Z_]+)` \| ([^|]*) \|", flags=re.MULTILINE)
# Variables that are not SDPA_<field name>: the standard OpenTelemetry one.
ALIASES = {"OTEL_TRACES_EXPORTER": "otel_traces_exporter"}


def table() -> dict[str, str]:
    """Field name -> the table's default cell."""
    rows: dict[str, str] = {}
    for variable, cell in ROW.findall(PAGE.read_text(encoding="utf-8")):
        name = ALIASES.get(variable, variable.removeprefix("SDPA_").lower())
        assert name not in rows, f"{variable} has two rows"
        rows[name] = cell.strip()
    return rows


@pytest.fixture
def defaults(monkeypatch: pytest.MonkeyPatch) -> Settings:
    for variable in list(os.environ):
        if variable.startswith("SDPA_") or variable in ALIASES:
            monkeypatch.delenv(variable)
    return Settings()


def test_every_setting_has_one_row() -> None:
    assert set(table()) == set(Settings.model_fields)


def test_each_default_is_the_code_default(defaults: Settings) -> None:
    for name, cell in table().items():
        value = getattr(defaults, name)
        code = re.match(r"`([^`]*)`", cell)
        if value is None or value == () or value == {}:
            # Unset, empty or computed at start-up: the cell says so in words, with no literal.
            assert code is None, f"{name}: the default is {value!r}, the table says {cell!r}"
            continue
        assert code is not None, f"{name}: the table gives no literal default ({cell!r})"
        written = code.group(1)
        if isinstance(value, bool):
            assert written == str(value).lower(), name
        elif isinstance(value, int | float):
            assert float(written) == float(value), f"{name}: {written} != {value}"
        else:
            assert written == str(value), f"{name}: {written!r} != {value!r}"
