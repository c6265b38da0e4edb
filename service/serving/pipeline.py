"""One compute request, whichever door it came by: prepare, submit, encode, time.

A door (v1's JSON, v2 REST's, v2 gRPC's) only decodes its request and encodes its answer: it
hands run() a `Door`, which says how its bytes become a PreparedRequest (validated once, within
every limit) and how an outcome becomes its answer. Everything between is here, the same for
every door: the count of inputs refused for NaN/Inf, the in-flight bytes reserved before compute
and shrunk to the answer after, the deadline and priority, the queue, the health monitor, and the
phases' timing (Server-Timing over HTTP, child spans in a trace). sdpa_core's errors and a
device out of memory leave as ServiceErrors, so a door words client errors from one tree.

Bodies whose decoding, and results whose encoding, would take more than a few milliseconds run
on a worker thread (service.serving.offload says which), a body's decoding there with the
cyclic collector paused (service.serving.gc_pause).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from sdpa_core import NonFiniteError, SdpaError
from service.errors import DeviceOutOfMemory, InvalidInput
from service.runtime.batcher import BatchResult
from service.runtime.jobs import AttentionOutcome, Outcome, PreparedJob
from service.runtime.policy import CostModel
from service.serving.health import TenantHealth
from service.serving.meta import response_meta
from service.serving.offload import off_loop_if, run_decoding
from service.serving.prepare import PreparedRequest
from service.settings import Settings
from service.wire.json_arrays import PIECES, Pieces

logger = logging.getLogger("sdpa.serving")

D = TypeVar("D")  # a door's decoded request
O = TypeVar("O", bound=Outcome)  # noqa: E741  # the outcome its jobs produce
A = TypeVar("A")  # its answer

# Queue a prepared job with its deadline (time.monotonic()) and its priority level (1 the
# highest) -> its answer. The door binds it to the batcher, to the request's tenant and to
# the client (a client that leaves cancels the wait): service.serving.frame.bind_call.
Submit = Callable[[PreparedJob, float, int], Awaitable[BatchResult[Outcome]]]


@dataclass(frozen=True, slots=True)
class Call:
    """What the pipeline needs from the request it serves."""

    settings: Settings
    cost_model: CostModel  # the device's, for the work limit
    submit: Submit
    request_id: str
    started: float  # time.monotonic() when the request began (before its body was read)
    received: float  # time.monotonic() once its body was read
    # reserve_answer(n): from now on the request holds n bytes besides its body (the in-flight
    # limit). Growing the reservation raises a 503 ServiceError when it does not fit; it is
    # called with the working set before compute and shrunk to the answer once encoded. None
    # where nothing counts them.
    reserve_answer: Callable[[int], None] | None = None
    # Attention health (service.serving.health): observes diagnostics, samples the rest.
    health: TenantHealth | None = None


@dataclass(frozen=True, slots=True)
class Phases:
    """Where one request's time went: the instants (time.monotonic() seconds) between its
    phases, and the queue's and device's share of the wait. Server-Timing reports them over
    HTTP, service.tracing as child spans of the request's span."""

    started: float  # the request began: reading its body
    received: float  # its body read: decoding
    decoded: float  # prepared: handed to the queue
    computed: float  # its outcome back from the device thread: encoding
    encoded: float  # its answer encoded
    queue_ms: float  # of the wait from `decoded` to `computed`: in the queue
    compute_ms: float  # of that wait: on the device
    batch_size: int  # the batch it ran in
    path: str | None  # the kernel path (fused, dense, chunked; None for an analysis)
    backend: str | None  # torch SDPA's backend, when the path says one

    @property
    def dispatch_ms(self) -> float:
        """What the wait held besides queue and compute: the device thread hop, batching."""
        wait_ms = (self.computed - self.decoded) * 1000.0
        return max(0.0, wait_ms - self.queue_ms - self.compute_ms)

    def server_timing(self) -> str:
        """The Server-Timing header's value: read;dur=0.120, decode;dur=0.410, ..."""
        phases_ms = {
            "read": (self.received - self.started) * 1000.0,
            "decode": (self.decoded - self.received) * 1000.0,
            "queue": self.queue_ms,
            "compute": self.compute_ms,
            "dispatch": self.dispatch_ms,
            "encode": (self.encoded - self.computed) * 1000.0,
        }
        return ", ".join(f"{name};dur={ms:.3f}" for name, ms in phases_ms.items())


@dataclass(frozen=True, slots=True)
class Served(Generic[A]):
    """A door's answer and where its time went."""

    answer: A
    phases: Phases


class Door(Protocol[D, O, A]):
    """One protocol's words around the common steps."""

    @property
    def outcome_type(self) -> type[O]:
        """The outcome its jobs produce (AttentionOutcome or AnalyzeOutcome)."""
        ...

    def decode_inline(self) -> bool:
        """Whether decoding is cheap enough to run on the event loop."""
        ...

    def decode(self, settings: Settings, cost: CostModel, *, pieces: Pieces | None) -> D:
        """The request, validated and within every limit. Raises ServiceError or SdpaError.
        With `pieces`, big JSON lists of numbers are parsed in pieces (off the loop only)."""
        ...

    def prepared(self, decoded: D) -> PreparedRequest:
        """The serving layer's request inside the door's decoded one."""
        ...

    def encode_inline(self, outcome: O, decoded: D) -> bool:
        """Whether encoding is cheap enough to run on the event loop."""
        ...

    def encode(self, outcome: O, decoded: D, *, meta: dict[str, Any]) -> A:
        """The answer, in the door's words."""
        ...

    def answer_bytes(self, answer: A) -> int:
        """The answer's size (the in-flight bytes it holds until sent)."""
        ...


def _deadline(request: PreparedRequest, call: Call) -> float:
    """time.monotonic() instant by which the request must have left the queue."""
    ms = call.settings.request_timeout_ms if request.timeout_ms is None else request.timeout_ms
    return call.started + ms / 1000.0


def invalid_input(exc: SdpaError) -> InvalidInput:
    """sdpa_core's refusal as a client error, its advice worded for each door (service.errors)."""
    return InvalidInput.from_core(exc)


async def _decode(door: Door[D, O, A], call: Call) -> D:
    """The door's request decoded (off the loop unless cheap); NaN/Inf refusals counted."""
    inline = door.decode_inline()
    try:
        # Off the loop, big lists of numbers are parsed in pieces: the parser and numpy hold
        # the GIL, and so the loop, only a piece at a time.
        return await run_decoding(
            inline, door.decode, call.settings, call.cost_model, pieces=None if inline else PIECES
        )
    except NonFiniteError as exc:
        if call.health is not None:
            call.health.count_nonfinite()
        raise invalid_input(exc) from exc
    except SdpaError as exc:
        raise invalid_input(exc) from exc


async def _computed(
    request: PreparedRequest, call: Call, kind: type[O]
) -> tuple[O, BatchResult[Outcome]]:
    """Queue the prepared job and wait for its outcome and the batch it ran in."""
    if call.reserve_answer is not None and request.working_bytes:
        call.reserve_answer(request.working_bytes)
    priority = request.priority or call.settings.default_priority
    try:
        batch = await call.submit(request.prepared, _deadline(request, call), priority)
    except SdpaError as exc:  # refused on the device (a budget known only there)
        raise invalid_input(exc) from exc
    except torch.OutOfMemoryError as exc:
        # Memory on the device is shared by whatever runs at the moment: a retry may well fit.
        logger.warning("device out of memory: %s", exc)
        raise DeviceOutOfMemory(
            "the device ran out of memory; retry later, or send a smaller request",
            retry_after_s=1.0,
        ) from exc
    outcome = batch.value
    if not isinstance(outcome, kind):  # the engine answered another job kind: our bug, a 500
        raise TypeError(f"engine returned {type(outcome).__name__} for a {kind.__name__} job")
    return outcome, batch


async def run(door: Door[D, O, A], call: Call) -> Served[A]:
    """Serve one request through `door`: decode, queue, compute, encode -> its answer, timed."""
    decoded_request = await _decode(door, call)
    request = door.prepared(decoded_request)
    decoded = time.monotonic()
    outcome, batch = await _computed(request, call, door.outcome_type)
    computed = time.monotonic()
    meta = response_meta(
        batch,
        device=outcome.device,
        dtype=request.prepared.spec.dtype,
        compute_ms=outcome.compute_ms,
        request_id=call.request_id,
    )
    answer = await off_loop_if(
        not door.encode_inline(outcome, decoded_request),
        door.encode,
        outcome,
        decoded_request,
        meta=meta,
    )
    path = backend = None
    if isinstance(outcome, AttentionOutcome):
        path, backend = outcome.result.path, outcome.result.backend
        if call.reserve_answer is not None and request.working_bytes:
            # The inputs, results and encoder's copy are gone: the answer is what is left.
            call.reserve_answer(door.answer_bytes(answer))
        if call.health is not None:
            call.health.after_answer(
                request.prepared,
                tag=request.tag,
                diagnostics=outcome.result.diagnostics,
                cost=call.cost_model,
            )
    phases = Phases(
        started=call.started,
        received=call.received,
        decoded=decoded,
        computed=computed,
        encoded=time.monotonic(),
        queue_ms=batch.queue_ms,
        compute_ms=outcome.compute_ms,
        batch_size=batch.batch_size,
        path=path,
        backend=backend,
    )
    return Served(answer=answer, phases=phases)
