"""sdpa_core is pure compute: importing it loads no web stack and no service code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import sdpa_core


@pytest.mark.slow  # a fresh interpreter
def test_import_loads_no_web_stack() -> None:
    code = (
        "import json, sys; import sdpa_core; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in {'fastapi', 'pydantic', 'httpx', 'service', 'starlette', "
        "'uvicorn', 'pydantic_settings'})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_public_names() -> None:
    for name in (
        "attention",
        "analyze_scaling",
        "validate_inputs",
        "make_synthetic_qk",
        "AttentionResult",
        "Diagnostics",
        "DiagnosticsSummary",
        "RowStats",
        "ScalingReport",
        "StrategyResult",
        "InputSpec",
        "summarize",
        "SdpaError",
        "ShapeError",
        "MaskError",
        "DTypeError",
        "LimitError",
        "NonFiniteError",
        "PerHeadStats",
        "PerRowStats",
        # the one owner of each rule callers must not re-derive
        "default_scale",
        "resolve_scale",
        "normalize_causal",
        "accumulation_dtype",
        "score_matrix_nbytes",
        "key_padding",
        "key_padding_from_lengths",
        "key_lengths_by_head",
        "attn_mask_4d",
        "DIAGNOSTICS_LEVELS",
        "check_diagnostics_level",
        "PATHS",
        "SUMMARY_FIELDS",
        "PER_HEAD_FIELDS",
        "PER_ROW_FIELDS",
        "ROW_STATS_FIELDS",
        "DEFAULT_FUSED_TILE_BYTES",
    ):
        assert name in sdpa_core.__all__
        assert hasattr(sdpa_core, name)


def test_every_exported_name_exists() -> None:
    assert sorted(set(sdpa_core.__all__)) == sorted(sdpa_core.__all__)
    for name in sdpa_core.__all__:
        assert hasattr(sdpa_core, name), name


def test_ships_type_information() -> None:
    """PEP 561: py.typed beside __init__.py tells type checkers to read the inline hints."""
    assert (Path(sdpa_core.__file__).parent / "py.typed").is_file()
