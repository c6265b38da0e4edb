"""sdpa_core is pure compute: importing it loads no web stack and no service code."""

from __future__ import annotations

import json
import subprocess
import sys

import sdpa_core


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
    ):
        assert name in sdpa_core.__all__
        assert hasattr(sdpa_core, name)
