"""One v2 infer request from body bytes to response parts: prepare, submit, encode, time.

The same steps as v1's (service.serving.pipeline, whose helpers it uses): the job goes through
the same queue, limits, deadlines, in-flight accounting and health observation; only the
decoding (service.serving.prepare_v2) and encoding (service.serving.encode_v2) differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from service.runtime.jobs import AttentionOutcome
from service.serving.encode import attention_elements
from service.serving.encode_v2 import InferAnswer, encode_infer
from service.serving.pipeline import (
    OFFLOAD_BYTES,
    Call,
    answered,
    counting_nonfinite,
    off_loop_if,
    run_prepared,
)
from service.serving.prepare_v2 import prepare_infer


@dataclass(frozen=True, slots=True)
class InferReply:
    """A 200's body parts, its Server-Timing header, and the batch it ran in."""

    answer: InferAnswer
    server_timing: str
    batch_size: int


async def infer(body: bytes, header_length: str | None, call: Call) -> InferReply:
    """POST /v2/models/attention/infer: body (and its Inference-Header-Content-Length) ->
    the named outputs and the response parameters, with their timing."""
    prepared = await counting_nonfinite(
        call,
        off_loop_if(
            len(body) > OFFLOAD_BYTES,
            prepare_infer,
            body,
            header_length,
            call.settings,
            call.cost_model,
        ),
    )
    request = prepared.request
    decoded = time.monotonic()
    outcome, batch, meta = await run_prepared(request, call, AttentionOutcome)
    computed = time.monotonic()
    # Binary outputs are views of the result tensors: only JSON lists cost encoding time.
    json_outputs = not all(binary for _, binary in prepared.outputs)
    answer = await off_loop_if(
        json_outputs and attention_elements(outcome) * 4 > OFFLOAD_BYTES,
        lambda: encode_infer(outcome, prepared, meta=meta),
    )
    timing = answered(request, call, outcome, batch, answer.size, decoded, computed)
    return InferReply(answer=answer, server_timing=timing, batch_size=batch.batch_size)
