"""sdpa_core: scaled dot-product attention with every mask, four paths and diagnostics.

Pure compute (torch, numpy, stdlib): importing it never loads fastapi, pydantic, httpx or the
service package. Besides attention() and analyze_scaling() (and AttentionRun and AnalysisRun,
the same computed tile by tile for a scheduler, which take the mask options as one Masks
value and attention()'s other options as one AttentionOptions), it exports the one owner of each
rule a caller might otherwise re-derive: the default scale, causal normalization, the
accumulation dtype, key padding, the diagnostics levels and the diagnostic field lists.
"""

from __future__ import annotations

from sdpa_core.analysis import (
    STANDARD_STRATEGIES,
    AnalysisRun,
    ScalingReport,
    StrategyResult,
    analysis_passes,
    analyze_scaling,
    make_synthetic_qk,
)
from sdpa_core.attention import (
    PATHS,
    AttentionOptions,
    AttentionResult,
    AttentionRun,
    attention,
    choose_path,
    flash_unavailable,
    weights_nbytes,
)
from sdpa_core.chunked import DEFAULT_BLOCK_SIZE
from sdpa_core.diagnostics import (
    DEFAULT_SINK_TOKENS,
    DIAGNOSTICS_LEVELS,
    PER_HEAD_FIELDS,
    PER_ROW_FIELDS,
    ROW_STATS_FIELDS,
    SUMMARY_FIELDS,
    Diagnostics,
    DiagnosticsSummary,
    PerHeadStats,
    PerRowStats,
    RowStats,
    check_diagnostics_level,
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
from sdpa_core.fused import DEFAULT_FUSED_TILE_BYTES
from sdpa_core.kernels import FlashKernelState, compile_kernels, flash_kernels
from sdpa_core.masks import (
    Masks,
    attn_mask_4d,
    key_lengths_by_head,
    key_padding,
    key_padding_from_lengths,
)
from sdpa_core.shapes import (
    SUPPORTED_DTYPES,
    InputSpec,
    accumulation_dtype,
    default_scale,
    normalize_causal,
    resolve_scale,
    score_matrix_nbytes,
    validate_inputs,
)
from sdpa_core.stats_kernel import KernelStats, kernel_mode, kernel_stats

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_FUSED_TILE_BYTES",
    "DEFAULT_SINK_TOKENS",
    "DIAGNOSTICS_LEVELS",
    "PATHS",
    "PER_HEAD_FIELDS",
    "PER_ROW_FIELDS",
    "ROW_STATS_FIELDS",
    "STANDARD_STRATEGIES",
    "SUMMARY_FIELDS",
    "SUPPORTED_DTYPES",
    "AnalysisRun",
    "AttentionOptions",
    "AttentionResult",
    "AttentionRun",
    "DTypeError",
    "Diagnostics",
    "DiagnosticsSummary",
    "FlashKernelState",
    "InputSpec",
    "KernelStats",
    "LimitError",
    "MaskError",
    "Masks",
    "NonFiniteError",
    "PerHeadStats",
    "PerRowStats",
    "RowStats",
    "ScalingReport",
    "SdpaError",
    "ShapeError",
    "StrategyResult",
    "accumulation_dtype",
    "analysis_passes",
    "analyze_scaling",
    "attention",
    "attn_mask_4d",
    "check_diagnostics_level",
    "choose_path",
    "compile_kernels",
    "default_scale",
    "flash_kernels",
    "flash_unavailable",
    "kernel_mode",
    "kernel_stats",
    "key_lengths_by_head",
    "key_padding",
    "key_padding_from_lengths",
    "make_synthetic_qk",
    "normalize_causal",
    "resolve_scale",
    "score_matrix_nbytes",
    "summarize",
    "validate_inputs",
    "weights_nbytes",
]
