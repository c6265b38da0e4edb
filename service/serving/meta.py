"""What every door's answer carries, whichever protocol words it: the meta fields of a
computed request and the summary statistics as plain numbers (non-finite ones as None, since
JSON has no infinity)."""

from __future__ import annotations

from typing import Any

import torch

from sdpa_core import Diagnostics
from service.runtime.batcher import BatchResult
from service.runtime.jobs import Outcome
from service.wire.codec import finite_or_none, wire_dtype_name


def response_meta(
    batch: BatchResult[Outcome],
    *,
    device: str,
    dtype: torch.dtype,
    compute_ms: float,
    request_id: str,
) -> dict[str, Any]:
    """The meta fields every computed response carries."""
    return {
        "device": device,
        "dtype": wire_dtype_name(dtype),
        "batch_size": batch.batch_size,
        "queue_ms": round(batch.queue_ms, 3),
        "compute_ms": round(compute_ms, 3),
        "request_id": request_id,
    }


def summary_numbers(
    diagnostics: Diagnostics, *, finite_only: bool = True
) -> dict[str, int | float | None]:
    """The summary statistics by their v1 names: counts as int, the rest float. With
    `finite_only` (JSON, which has no infinity) a non-finite one is None; without it (a
    protobuf double carries it) it stays as it is."""
    return {
        name: value
        if isinstance(value, int)
        else (finite_or_none(float(value)) if finite_only else float(value))
        for name, value in diagnostics.summary.as_dict().items()
    }
