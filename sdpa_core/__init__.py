"""sdpa_core: scaled dot-product attention with every mask, three paths and diagnostics.

Pure compute (torch, numpy, stdlib): importing it never loads fastapi, pydantic, httpx or the
service package.
"""

from __future__ import annotations

from sdpa_core.analysis import (
    STANDARD_STRATEGIES,
    ScalingReport,
    StrategyResult,
    analyze_scaling,
    make_synthetic_qk,
)
from sdpa_core.attention import AttentionResult, attention, choose_path, weights_nbytes
from sdpa_core.chunked import DEFAULT_BLOCK_SIZE
from sdpa_core.diagnostics import (
    Diagnostics,
    DiagnosticsSummary,
    PerHeadStats,
    PerRowStats,
    RowStats,
    summarize,
)
from sdpa_core.errors import (
    DTypeError,
    LimitError,
    MaskError,
    NonFiniteError,
    SdpaError,
    ShapeError,
)
from sdpa_core.shapes import SUPPORTED_DTYPES, InputSpec, validate_inputs

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "STANDARD_STRATEGIES",
    "SUPPORTED_DTYPES",
    "AttentionResult",
    "DTypeError",
    "Diagnostics",
    "DiagnosticsSummary",
    "InputSpec",
    "LimitError",
    "MaskError",
    "NonFiniteError",
    "PerHeadStats",
    "PerRowStats",
    "RowStats",
    "ScalingReport",
    "SdpaError",
    "ShapeError",
    "StrategyResult",
    "analyze_scaling",
    "attention",
    "choose_path",
    "make_synthetic_qk",
    "summarize",
    "validate_inputs",
    "weights_nbytes",
]
