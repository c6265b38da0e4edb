"""Encode an outcome: the response body of an attention or analysis request.

Tensors go out in the encoding the request asked for (service.wire.codec); statistics that are
not finite (a fully masked row's lse) are written as null, since JSON has no infinity.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Final

from sdpa_core import (
    PER_HEAD_FIELDS,
    PER_ROW_FIELDS,
    Diagnostics,
    ScalingReport,
    StrategyResult,
)
from service.runtime.jobs import AnalyzeOutcome, AttentionOutcome
from service.serving.meta import summary_numbers
from service.wire.codec import (
    EncodingName,
    dumps,
    encode_tensor,
    finite_or_none,
    to_numpy,
)

# Every number of a strategy's entry (divisor, score_variance, entropy, ...), in field order.
STRATEGY_STATISTICS: Final = tuple(f.name for f in fields(StrategyResult) if f.name != "name")


def diagnostics_json(diagnostics: Diagnostics | None) -> dict[str, Any] | None:
    """Diagnostics as JSON: summary scalars, per-head and per-row numpy arrays (nested lists)."""
    if diagnostics is None:
        return None
    summary = summary_numbers(diagnostics)
    per_head = {name: to_numpy(t) for name, t in diagnostics.per_head.as_dict().items()}
    per_row = (
        None
        if diagnostics.per_row is None
        else {name: to_numpy(t) for name, t in diagnostics.per_row.as_dict().items()}
    )
    return {"summary": summary, "per_head": per_head, "per_row": per_row}


def attention_numbers(outcome: AttentionOutcome, *, return_output: bool) -> tuple[int, int]:
    """How many numbers the response carries: (in the output and weights, in the diagnostics).
    The tensors go out in the request's encoding, the diagnostics always as JSON lists; the
    output only with `return_output`."""
    result = outcome.result
    tensors = (result.output.numel() if return_output else 0) + (
        0 if result.weights is None else result.weights.numel()
    )
    statistics = 0
    diagnostics = result.diagnostics
    if diagnostics is not None:
        # One number per (sequence, head) for each per-head field: with many heads of few rows
        # (a million heads fit the element limit) they dominate the response.
        statistics += len(PER_HEAD_FIELDS) * diagnostics.per_head.masked_rows.numel()
        if diagnostics.per_row is not None:
            # "full" adds the per-row tensors [..., H, N_q]; at long N_q they dominate.
            statistics += len(PER_ROW_FIELDS) * diagnostics.per_row.entropy.numel()
    return tensors, statistics


def encode_attention(
    outcome: AttentionOutcome,
    *,
    encoding: EncodingName,
    meta: dict[str, Any],
    return_output: bool = True,
) -> bytes:
    """The /v1/attention response body; its output is null without `return_output`."""
    result = outcome.result
    payload = {
        "output": encode_tensor(result.output, encoding=encoding) if return_output else None,
        "weights": None
        if result.weights is None
        else encode_tensor(result.weights, encoding=encoding),
        "diagnostics": diagnostics_json(result.diagnostics),
        "meta": {"path": result.path, "backend": result.backend, **meta},
    }
    return dumps(payload)


def report_json(report: ScalingReport) -> dict[str, Any]:
    """A scaling report as JSON (non-finite numbers as null)."""
    return {
        "d_k": int(report.d_k),
        "raw_score_variance": finite_or_none(float(report.raw_score_variance)),
        "recommended_divisor": finite_or_none(float(report.recommended_divisor)),
        "strategies": [
            {
                "name": strategy.name,
                **{
                    name: finite_or_none(float(getattr(strategy, name)))
                    for name in STRATEGY_STATISTICS
                },
            }
            for strategy in report.strategies
        ],
    }


def encode_analyze(outcome: AnalyzeOutcome, *, meta: dict[str, Any]) -> bytes:
    """The /v1/analyze response body."""
    return dumps({**report_json(outcome.report), "meta": meta})


def server_timing(**phases_ms: float) -> str:
    """Server-Timing header value: decode;dur=0.41, queue;dur=0.02, ..."""
    return ", ".join(f"{name};dur={ms:.3f}" for name, ms in phases_ms.items())
