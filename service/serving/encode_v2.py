"""Encode a v2 infer outcome: the response's JSON header and its binary data.

The outputs are those the request named (service.serving.prepare_v2), each as binary data or a
JSON list. The per-row and per-head statistics travel in the accumulation dtype (FP32, or FP64
for FP64 inputs), their counts as INT64. Response parameters carry the meta fields (path,
device, batch_size, queue_ms, compute_ms, ...) and, with diagnostics "summary" or "full", the
summary statistics under their v1 names (non-finite values as null, since JSON has no
infinity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sdpa_core import AttentionResult
from service.runtime.jobs import AttentionOutcome
from service.serving.meta import summary_numbers
from service.serving.prepare_v2 import PER_HEAD_OUTPUTS, PreparedInfer
from service.wire.codec import dumps
from service.wire.v2_codec import EncodedOutput, encode_output
from service.wire.v2_models import MODEL_NAME, MODEL_VERSION


@dataclass(frozen=True, slots=True)
class InferAnswer:
    """A v2 response body: the JSON header, then the binary data of the binary outputs."""

    header: bytes
    buffers: tuple[memoryview, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(buffer.nbytes for buffer in self.buffers)


def output_tensor(result: AttentionResult, name: str, *, stat_dtype: torch.dtype) -> torch.Tensor:
    """The result tensor of output `name`; `stat_dtype`: the per-head statistics' float dtype."""
    if name == "output":
        return result.output
    if name == "weights":
        if result.weights is None:  # prepare_v2 asked for them: our bug, a 500
            raise RuntimeError("the weights were requested but not computed")
        return result.weights
    if name in PER_HEAD_OUTPUTS:
        if result.diagnostics is None:
            raise RuntimeError(f"the per-head statistic {name!r} was requested but not computed")
        per_head: torch.Tensor = getattr(result.diagnostics.per_head, PER_HEAD_OUTPUTS[name])
        # sdpa_core pools them in float64 ([..., H]); they travel as the per-row ones do.
        return per_head.to(stat_dtype) if per_head.is_floating_point() else per_head
    if result.diagnostics is None or result.diagnostics.per_row is None:
        raise RuntimeError(f"the per-row statistic {name!r} was requested but not computed")
    tensor: torch.Tensor = getattr(result.diagnostics.per_row, name)
    return tensor


def json_output_numbers(outcome: AttentionOutcome, prepared: PreparedInfer) -> int:
    """How many numbers the response writes as JSON lists (binary outputs cost no encoding:
    they are sent from the result tensors)."""
    result = outcome.result
    return sum(
        output_tensor(result, name, stat_dtype=torch.float64).numel()
        for name, binary in prepared.outputs
        if not binary
    )


def infer_parameters(
    result: AttentionResult, *, summary: bool, meta: dict[str, Any], finite_only: bool = True
) -> dict[str, Any]:
    """The response's parameters: meta fields, and the summary statistics when asked for
    (`finite_only`: non-finite ones as None, for JSON; see service.serving.meta)."""
    params: dict[str, Any] = {"path": result.path}
    if result.backend is not None:
        params["backend"] = result.backend
    params.update(meta)
    if summary and result.diagnostics is not None:
        params.update(summary_numbers(result.diagnostics, finite_only=finite_only))
    return params


def encode_infer(
    outcome: AttentionOutcome, prepared: PreparedInfer, *, meta: dict[str, Any]
) -> InferAnswer:
    """The response to a v2 infer request."""
    result = outcome.result
    stat_dtype = prepared.request.prepared.spec.accum_dtype
    outputs: list[EncodedOutput] = [
        encode_output(name, output_tensor(result, name, stat_dtype=stat_dtype), binary=binary)
        for name, binary in prepared.outputs
    ]
    response: dict[str, Any] = {"model_name": MODEL_NAME, "model_version": MODEL_VERSION}
    if prepared.id is not None:
        response["id"] = prepared.id
    response["parameters"] = infer_parameters(result, summary=prepared.summary, meta=meta)
    response["outputs"] = [out.entry for out in outputs]
    buffers = tuple(out.data for out in outputs if out.data is not None)
    return InferAnswer(header=dumps(response), buffers=buffers)
