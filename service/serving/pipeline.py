"""One compute request from body bytes to response bytes: prepare, submit, encode, time.

The api layer reads the body and answers; this module does everything in between, without
knowing about HTTP frameworks: it receives a `Call` (settings, the request id, when reading
started and ended, and how to submit a job to the runtime's queue) and returns a `Reply`.
Bodies whose decoding, and results whose encoding, would take more than a few milliseconds
run on a worker thread (service.serving.offload says which), a body's decoding there with the
cyclic collector paused (service.serving.gc_pause).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sdpa_core import NonFiniteError
from service.runtime.batcher import BatchResult
from service.runtime.jobs import AnalyzeOutcome, AttentionOutcome, Outcome, PreparedJob
from service.runtime.policy import CostModel
from service.serving.encode import (
    attention_numbers,
    encode_analyze,
    encode_attention,
    response_meta,
    server_timing,
)
from service.serving.health import HealthMonitor
from service.serving.offload import decode_inline, encode_inline, off_loop_if, run_decoding
from service.serving.prepare import PreparedRequest, prepare_analyze, prepare_attention
from service.settings import Settings
from service.wire.json_arrays import PIECES

T = TypeVar("T")
OutcomeT = TypeVar("OutcomeT", AttentionOutcome, AnalyzeOutcome)

# Queue a prepared job with its deadline (time.monotonic()) and its priority level (1 the
# highest) -> its answer. The api layer binds it to the batcher, to the request's tenant and to
# the client's connection (a disconnect cancels the wait).
Submit = Callable[[PreparedJob, float, int], Awaitable[BatchResult[Outcome]]]


@dataclass(frozen=True, slots=True)
class Call:
    """What the pipeline needs from the request it serves."""

    settings: Settings
    cost_model: CostModel  # the device's, for the work limit
    submit: Submit
    request_id: str
    started: float  # time.monotonic() before the body was read
    received: float  # time.monotonic() after it was read
    # reserve_answer(n): from now on the request holds n bytes besides its body (the in-flight
    # limit). Growing the reservation raises a 503 ServiceError when it does not fit; it is
    # called with the working set before compute and shrunk to the answer once encoded. None
    # where nothing counts them.
    reserve_answer: Callable[[int], None] | None = None
    # Attention health (service.serving.health): observes diagnostics, samples the rest.
    health: HealthMonitor | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """A 200's body, its Server-Timing header, and the batch it ran in (for the access log)."""

    content: bytes
    server_timing: str
    batch_size: int


def _deadline(request: PreparedRequest, call: Call) -> float:
    """time.monotonic() instant by which the request must have left the queue."""
    ms = call.settings.request_timeout_ms if request.timeout_ms is None else request.timeout_ms
    return call.started + ms / 1000.0


async def run_prepared(
    request: PreparedRequest, call: Call, kind: type[OutcomeT]
) -> tuple[OutcomeT, BatchResult[Outcome], dict[str, Any]]:
    """Queue the prepared job and wait for its outcome -> (outcome, its batch, the meta fields)."""
    if call.reserve_answer is not None and request.working_bytes:
        call.reserve_answer(request.working_bytes)
    priority = request.priority or call.settings.default_priority
    batch = await call.submit(request.prepared, _deadline(request, call), priority)
    outcome = batch.value
    if not isinstance(outcome, kind):  # the engine answered another job kind: our bug, a 500
        raise TypeError(f"engine returned {type(outcome).__name__} for a {kind.__name__} job")
    meta = response_meta(
        batch,
        device=outcome.device,
        dtype=request.prepared.spec.dtype,
        compute_ms=outcome.compute_ms,
        request_id=call.request_id,
    )
    return outcome, batch, meta


async def counting_nonfinite(call: Call, preparing: Awaitable[T]) -> T:
    """The prepared request; one refused for NaN/Inf in an input is counted in the metrics."""
    try:
        return await preparing
    except NonFiniteError:
        if call.health is not None:
            call.health.count_nonfinite()
        raise


def ms_between(start: float, end: float) -> float:
    return (end - start) * 1000.0


def answered(
    request: PreparedRequest,
    call: Call,
    outcome: AttentionOutcome,
    batch: BatchResult[Outcome],
    answer_bytes: int,
    decoded: float,
    computed: float,
) -> str:
    """Once an attention answer is encoded (either door): shrink the in-flight reservation to
    the answer, hand the diagnostics to the health monitor -> the Server-Timing value."""
    if call.reserve_answer is not None and request.working_bytes:
        call.reserve_answer(answer_bytes)  # the inputs, results and encoder's copy are gone
    if call.health is not None:
        call.health.after_answer(
            request.prepared,
            tag=request.tag,
            diagnostics=outcome.result.diagnostics,
            cost=call.cost_model,
        )
    return server_timing(
        read=ms_between(call.started, call.received),
        decode=ms_between(call.received, decoded),
        queue=batch.queue_ms,
        compute=outcome.compute_ms,
        # What the wait held besides queue and compute: the device thread hop, batching.
        dispatch=max(0.0, ms_between(decoded, computed) - batch.queue_ms - outcome.compute_ms),
        encode=ms_between(computed, time.monotonic()),
    )


async def attention(body: bytes, call: Call) -> Reply:
    """POST /v1/attention: body -> output, weights and diagnostics, with their timing."""
    inline = decode_inline(body)
    request = await counting_nonfinite(
        call,
        run_decoding(
            inline,
            prepare_attention,
            body,
            call.settings,
            call.cost_model,
            # Off the loop, big lists of numbers are parsed in pieces: the parser and numpy
            # hold the GIL, and so the loop, only a piece at a time.
            pieces=None if inline else PIECES,
        ),
    )
    decoded = time.monotonic()
    outcome, batch, meta = await run_prepared(request, call, AttentionOutcome)
    computed = time.monotonic()
    tensors, statistics = attention_numbers(outcome, return_output=request.return_output)
    as_json = request.encoding == "json"
    content = await off_loop_if(
        not encode_inline(
            json_numbers=statistics + (tensors if as_json else 0),
            base64_numbers=0 if as_json else tensors,
        ),
        encode_attention,
        outcome,
        encoding=request.encoding,
        meta=meta,
        return_output=request.return_output,
    )
    timing = answered(request, call, outcome, batch, len(content), decoded, computed)
    return Reply(content=content, server_timing=timing, batch_size=batch.batch_size)


async def analyze(body: bytes, call: Call) -> Reply:
    """POST /v1/analyze: body -> the scaling report, with its timing."""
    # Always off the loop: synthetic inputs are generated here, and analysis is not a hot path.
    request = await counting_nonfinite(
        call,
        run_decoding(
            False,
            prepare_analyze,
            body,
            call.settings,
            call.cost_model,
            pieces=None if decode_inline(body) else PIECES,
        ),
    )
    decoded = time.monotonic()
    outcome, batch, meta = await run_prepared(request, call, AnalyzeOutcome)
    computed = time.monotonic()
    content = encode_analyze(outcome, meta=meta)
    timing = server_timing(
        read=ms_between(call.started, call.received),
        decode=ms_between(call.received, decoded),
        queue=batch.queue_ms,
        compute=outcome.compute_ms,
        encode=ms_between(computed, time.monotonic()),
    )
    return Reply(content=content, server_timing=timing, batch_size=batch.batch_size)
