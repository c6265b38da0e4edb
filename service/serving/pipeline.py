"""One compute request, whichever door it came by: prepare, submit, encode, time.

A door (v1's JSON, v2 REST's, v2 gRPC's) only decodes its request and encodes its answer: it
hands run() a `Door` and the request's Exchange (service.serving.exchange: its tenant, id,
in-flight holding and deadline, made by the edge; run fills in the deadline, priority and
phases, and calls nothing above it). The Door says how its bytes become a PreparedRequest
(validated once, within every limit) and how an outcome becomes its answer. Everything between
is here, the same for every door: the count of inputs refused for NaN/Inf, the in-flight bytes
reserved before compute and shrunk to the answer after, the deadline and priority, the queue,
the health monitor, and the phases' timing (Server-Timing over HTTP, child spans in a trace).
sdpa_core's errors and a device out of memory leave as ServiceErrors, so a door words client
errors from one tree.

Bodies whose decoding, and results whose encoding, would take more than a few milliseconds run
on a worker thread (service.serving.offload says which), a body's decoding there with the
cyclic collector paused (service.serving.gc_pause).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from sdpa_core import NonFiniteError, SdpaError
from service.errors import DeviceOutOfMemory, InvalidInput
from service.runtime.batcher import BatchResult
from service.runtime.jobs import AttentionOutcome, Outcome
from service.runtime.policy import CostModel
from service.serving.exchange import ClientDisconnected, Exchange
from service.serving.meta import response_meta
from service.serving.offload import off_loop_if, run_decoding
from service.serving.prepare import PreparedRequest
from service.serving.state import AppState
from service.settings import Settings
from service.wire.json_arrays import PIECES, Pieces

logger = logging.getLogger("sdpa.serving")

D = TypeVar("D")  # a door's decoded request
O = TypeVar("O", bound=Outcome)  # noqa: E741  # the outcome its jobs produce
A = TypeVar("A")  # its answer


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


def _deadline(request: PreparedRequest, exchange: Exchange, settings: Settings) -> float:
    """time.monotonic() instant by which the request must have left the queue: the earlier of
    its `timeout` (or SDPA_REQUEST_TIMEOUT_MS) from its start and the door's own deadline."""
    ms = settings.request_timeout_ms if request.timeout_ms is None else request.timeout_ms
    deadline = exchange.started + ms / 1000.0
    return deadline if exchange.deadline is None else min(deadline, exchange.deadline)


def invalid_input(exc: SdpaError) -> InvalidInput:
    """sdpa_core's refusal as a client error, its advice worded for each door (service.errors)."""
    return InvalidInput.from_core(exc)


async def _decode(door: Door[D, O, A], state: AppState, tenant: str) -> D:
    """The door's request decoded (off the loop unless cheap); NaN/Inf refusals counted for
    `tenant`."""
    inline = door.decode_inline()
    try:
        # Off the loop, big lists of numbers are parsed in pieces: the parser and numpy hold
        # the GIL, and so the loop, only a piece at a time.
        return await run_decoding(
            inline, door.decode, state.settings, state.cost_model, pieces=None if inline else PIECES
        )
    except NonFiniteError as exc:
        if state.health is not None:
            state.health.count_nonfinite(tenant)
        raise invalid_input(exc) from exc
    except SdpaError as exc:
        raise invalid_input(exc) from exc


async def _computed(
    request: PreparedRequest, exchange: Exchange, state: AppState, kind: type[O]
) -> tuple[O, BatchResult[Outcome]]:
    """Queue the prepared job and wait for its outcome and the batch it ran in."""
    holding = exchange.holding
    if holding is not None and request.working_bytes:
        holding.reserve_answer(request.working_bytes)
    exchange.deadline = _deadline(request, exchange, state.settings)
    exchange.priority = request.priority or state.settings.default_priority
    batcher = state.running_batcher()
    if exchange.client_gone:  # it left while its body was decoded: nothing to queue
        raise ClientDisconnected("the client disconnected before its request was queued")
    exchange.queued()  # from here on the batcher's drain answers it
    exchange.waiting = True  # a client that leaves now takes its job out of the queue
    try:
        batch = await batcher.submit(
            request.prepared,
            deadline=exchange.deadline,
            tenant=exchange.tenant,
            priority=exchange.priority,
        )
    except SdpaError as exc:  # refused on the device (a budget known only there)
        raise invalid_input(exc) from exc
    except torch.OutOfMemoryError as exc:
        # Memory on the device is shared by whatever runs at the moment: a retry may well fit.
        logger.warning("device out of memory: %s", exc)
        raise DeviceOutOfMemory(
            "the device ran out of memory; retry later, or send a smaller request",
            retry_after_s=1.0,
        ) from exc
    finally:
        exchange.waiting = False
    outcome = batch.value
    if not isinstance(outcome, kind):  # the engine answered another job kind: our bug, a 500
        raise TypeError(f"engine returned {type(outcome).__name__} for a {kind.__name__} job")
    return outcome, batch


async def run(door: Door[D, O, A], exchange: Exchange, state: AppState) -> Served[A]:
    """Serve one request through `door`: decode, queue, compute, encode -> its answer, timed.
    Its deadline, priority and phases go into `exchange`; the answer's in-flight bytes are
    reserved on its holding."""
    decoded_request = await _decode(door, state, exchange.tenant)
    request = door.prepared(decoded_request)
    decoded = time.monotonic()
    outcome, batch = await _computed(request, exchange, state, door.outcome_type)
    computed = time.monotonic()
    meta = response_meta(
        batch,
        device=outcome.device,
        dtype=request.prepared.spec.dtype,
        compute_ms=outcome.compute_ms,
        request_id=exchange.request_id,
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
        if exchange.holding is not None and request.working_bytes:
            # The inputs, results and encoder's copy are gone: the answer is what is left.
            exchange.holding.reserve_answer(door.answer_bytes(answer))
        if state.health is not None:
            state.health.after_answer(
                request.prepared,
                tag=request.tag,
                diagnostics=outcome.result.diagnostics,
                cost=state.cost_model,
                tenant=exchange.tenant,
            )
    received = exchange.received if exchange.received is not None else exchange.started
    phases = Phases(
        started=exchange.started,
        received=received,
        decoded=decoded,
        computed=computed,
        encoded=time.monotonic(),
        queue_ms=batch.queue_ms,
        compute_ms=outcome.compute_ms,
        batch_size=batch.batch_size,
        path=path,
        backend=backend,
    )
    exchange.phases = phases
    return Served(answer=answer, phases=phases)
