"""One v2 infer request from body bytes to response parts: prepare, submit, encode, time.

The same steps as v1's (service.serving.pipeline, whose helpers it uses): the job goes through
the same queue, limits, deadlines, in-flight accounting and health observation; only the
decoding (service.serving.prepare_v2) and encoding (service.serving.encode_v2) differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from service.runtime.jobs import AttentionOutcome
from service.serving.encode_v2 import InferAnswer, encode_infer, json_output_numbers
from service.serving.offload import decode_inline, encode_inline, off_loop_if, run_decoding
from service.serving.pipeline import Call, answered, counting_nonfinite, run_prepared
from service.serving.prepare_v2 import prepare_infer
from service.wire.json_arrays import PIECES
from service.wire.lengths import parse_length


@dataclass(frozen=True, slots=True)
class InferReply:
    """A 200's body parts, its Server-Timing header, and the batch it ran in."""

    answer: InferAnswer
    server_timing: str
    batch_size: int


async def infer(body: bytes, header_length: str | None, call: Call) -> InferReply:
    """POST /v2/models/attention/infer: body (and its Inference-Header-Content-Length) ->
    the named outputs and the response parameters, with their timing."""
    # The binary data after the JSON header costs a copy: the estimate counts the header's
    # JSON (an invalid length is refused while decoding; the whole body counts until then).
    json_bytes = None if header_length is None else parse_length(header_length)
    inline = decode_inline(
        body, json_bytes=json_bytes if json_bytes is not None and json_bytes <= len(body) else None
    )
    prepared = await counting_nonfinite(
        call,
        run_decoding(
            inline,
            prepare_infer,
            body,
            header_length,
            call.settings,
            call.cost_model,
            pieces=None if inline else PIECES,  # as v1's (service.serving.pipeline)
        ),
    )
    request = prepared.request
    decoded = time.monotonic()
    outcome, batch, meta = await run_prepared(request, call, AttentionOutcome)
    computed = time.monotonic()
    answer = await off_loop_if(
        not encode_inline(json_numbers=json_output_numbers(outcome, prepared)),
        encode_infer,
        outcome,
        prepared,
        meta=meta,
    )
    timing = answered(request, call, outcome, batch, answer.size, decoded, computed)
    return InferReply(answer=answer, server_timing=timing, batch_size=batch.batch_size)
