"""What the runtime runs: jobs, the one way to validate them, and their outcomes.

A job holds a request's CPU tensors and options as decoded. The runtime accepts only a
PreparedJob, and only prepare() can make one: it runs sdpa_core.validate_inputs (shapes, masks,
dtypes and the NaN/Inf scan) exactly once, so the engine can trust the InputSpec it carries and
skip every second check. Validation before queueing also means a bad request gets its 422
without waiting for the device, and never joins a batch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from sdpa_core import (
    AttentionResult,
    InputSpec,
    Masks,
    ScalingReport,
    check_diagnostics_level,
    validate_inputs,
)
from sdpa_core.masks import NO_MASKS

# A custom strategy of /v1/analyze: (name, divisor).
Strategy = str | tuple[str, float]


@dataclass(frozen=True, slots=True)
class AttentionJob:
    """One attention request: CPU tensors as decoded, in the request's own shape."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    # causal (False/True/"top_left"/"bottom_right"), key_lengths (int64), key_padding_mask
    # (bool, True = padding), attn_mask (bool, True = attend, or float, additive)
    masks: Masks = NO_MASKS
    scale: float | None = None
    return_weights: bool = False
    diagnostics: str = "none"  # "none" | "summary" | "full"


@dataclass(frozen=True, slots=True)
class AnalyzeJob:
    """One scaling analysis: runs alone (a group of one)."""

    q: torch.Tensor
    k: torch.Tensor
    strategies: tuple[Strategy, ...] | None = None
    masks: Masks = NO_MASKS  # as AttentionJob's


Job = AttentionJob | AnalyzeJob

# Set only while prepare() builds a PreparedJob (per thread: requests are prepared on worker
# threads too). A PreparedJob built anywhere else, dataclasses.replace() included, fails.
_minting = threading.local()


@dataclass(frozen=True, slots=True)
class PreparedJob:
    """A job that passed validation once, with what validation learned (its InputSpec)."""

    job: Job
    spec: InputSpec

    def __post_init__(self) -> None:
        if not getattr(_minting, "active", False):
            raise TypeError("a PreparedJob is made by service.runtime.jobs.prepare() only")


def prepare(job: Job) -> PreparedJob:
    """Validate `job` once (with the NaN/Inf scan) -> a PreparedJob the runtime trusts.

    Raises:
        SdpaError: the job's own error (a 422 for the client), naming the parameter.
    """
    if isinstance(job, AnalyzeJob):
        # The analysis needs no values: k stands in for v, and passes every check v must.
        v, scale = job.k, None
    else:
        check_diagnostics_level(job.diagnostics)
        v, scale = job.v, job.scale
    spec = validate_inputs(job.q, job.k, v, job.masks, scale=scale)
    _minting.active = True
    try:
        return PreparedJob(job=job, spec=spec)
    finally:
        _minting.active = False


@dataclass(frozen=True, slots=True)
class AttentionOutcome:
    """A request's result (CPU tensors, shaped as the solo call's) and how its batch ran."""

    result: AttentionResult
    compute_ms: float
    device: str


@dataclass(frozen=True, slots=True)
class AnalyzeOutcome:
    """A scaling report and how long it took on the device."""

    report: ScalingReport
    compute_ms: float
    device: str


Outcome = AttentionOutcome | AnalyzeOutcome
