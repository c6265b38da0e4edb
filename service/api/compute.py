"""What the compute routes share: read the body, bind a serving Call to this request, run the
serving pipeline, answer.

Once the drain has ended (AppState.stopping) the batcher takes no more work: a request still
reading or decoding its body then can never be computed, and is answered 503 (ShuttingDown,
Retry-After) at once rather than left to the exit, whose cancellation was a 500. Requests are
registered from their start until they hand their job to the batcher (_BeforeTheQueue); from
there on the batcher's drain answers them.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

from fastapi import Request
from starlette.responses import Response

from service.api.deps import AppState, request_id, running_batcher
from service.api.disconnect import ClientDisconnected, cancel_on_disconnect
from service.api.errors import CLIENT_CLOSED
from service.errors import ShuttingDown
from service.middleware.inflight import RESERVE_ANSWER
from service.runtime.batcher import BatchResult
from service.runtime.jobs import Outcome, PreparedJob
from service.serving.pipeline import Call, Reply
from service.tenants import ANONYMOUS

# A serving pipeline: body bytes and a Call -> a Reply (service.serving.pipeline).
Pipeline = Callable[[bytes, Call], Awaitable[Reply]]

# The drain has ended when these are answered: the replica is on its way out, and a retry goes
# to another one (or to this one once it is back).
_STOPPING_RETRY_AFTER_S: Final = 1.0


class _BeforeTheQueue:
    """The requests of one lifespan that have not handed their job to the batcher yet (reading
    or decoding their body). When its `stopping` event is set, each is cancelled; serve_with
    answers it 503. A worker thread still decoding one is left to finish, its result dropped
    (service.serving.offload abandons it)."""

    def __init__(self, stopping: asyncio.Event) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.cancelled: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        self._watcher = asyncio.get_running_loop().create_task(self._cancel_all_when(stopping))

    async def _cancel_all_when(self, stopping: asyncio.Event) -> None:
        await stopping.wait()
        _guards.pop(stopping, None)
        # Every task here is suspended at an await (this one runs): each gets its
        # CancelledError there, before it reaches the batcher.
        for task in self.tasks:
            self.cancelled.add(task)
            task.cancel()
        self.tasks.clear()


# One per lifespan (AppState.stopping is a fresh event each time), made by its first request.
_guards: weakref.WeakKeyDictionary[asyncio.Event, _BeforeTheQueue] = weakref.WeakKeyDictionary()


def _shutting_down(state: AppState) -> ShuttingDown:
    state.metrics.rejected_total.labels(reason="shutting_down").inc()
    return ShuttingDown(
        "the service is shutting down: its drain has ended, and this request was not computed",
        retry_after_s=_STOPPING_RETRY_AFTER_S,
    )


@asynccontextmanager
async def _until_queued(state: AppState) -> AsyncIterator[Callable[[], None]]:
    """Registers the current request until it reaches the batcher (the callable it yields says
    so): if the drain ends before, the request is cancelled here and answered 503."""
    if state.stopping.is_set():
        raise _shutting_down(state)
    task = asyncio.current_task()
    if task is None:  # not in a task: nothing can cancel it
        yield lambda: None
        return
    guard = _guards.get(state.stopping)
    if guard is None:
        guard = _guards[state.stopping] = _BeforeTheQueue(state.stopping)
    guard.tasks.add(task)
    try:
        yield lambda: guard.tasks.discard(task)
    except asyncio.CancelledError:
        # uncancel() == 0: the only cancellation pending was the guard's.
        if task in guard.cancelled and task.uncancel() == 0:
            raise _shutting_down(state) from None
        raise
    finally:
        guard.tasks.discard(task)


async def read_call(
    request: Request, state: AppState, *, queued: Callable[[], None] = lambda: None
) -> tuple[bytes, Call]:
    """Read the body and bind a serving Call to this request, its batcher and its client.
    `queued` is called when the job is handed to the batcher."""
    started = time.monotonic()
    body = await request.body()
    received = time.monotonic()
    batcher = running_batcher(state)

    # The tenant the auth middleware named (service.tenants); without keys, "anonymous".
    tenant = getattr(request.state, "tenant", ANONYMOUS)

    async def submit(job: PreparedJob, deadline: float, priority: int) -> BatchResult[Outcome]:
        queued()
        # A client that disconnects while its job waits takes the job out of the queue.
        queueing = batcher.submit(job, deadline=deadline, tenant=tenant, priority=priority)
        return await cancel_on_disconnect(request, queueing)

    call = Call(
        settings=state.settings,
        cost_model=state.cost_model,
        submit=submit,
        request_id=request_id(request),
        started=started,
        received=received,
        reserve_answer=getattr(request.state, RESERVE_ANSWER, None),
        health=state.health,
    )
    return body, call


async def serve(request: Request, state: AppState, pipeline: Pipeline) -> Response:
    """Read the request, run `pipeline` on it, answer (499 in the log if the client left)."""

    async def answer(body: bytes, call: Call) -> Response:
        return reply_response(request, await pipeline(body, call))

    return await serve_with(request, state, answer)


async def serve_with(
    request: Request, state: AppState, answer: Callable[[bytes, Call], Awaitable[Response]]
) -> Response:
    """The frame of every compute route, v1's and v2's: read the request, bind its Call, let
    `answer` run a serving pipeline and build the response (499 in the log if the client
    left)."""
    with state.metrics.requests_in_flight.track_inprogress():
        async with _until_queued(state) as queued:
            body, call = await read_call(request, state, queued=queued)
            try:
                return await answer(body, call)
            except ClientDisconnected:
                return client_closed()


def reply_response(request: Request, reply: Reply) -> Response:
    """A 200 with the reply's body and Server-Timing; the batch size goes to the access log."""
    request.state.batch_size = reply.batch_size
    return Response(
        content=reply.content,
        media_type="application/json",
        headers={"Server-Timing": reply.server_timing},
    )


def client_closed() -> Response:
    # Nobody reads this; it exists so the access log records what happened.
    return Response(status_code=CLIENT_CLOSED)
