"""What every door does around the pipeline, whatever its protocol: admit a request (counted
in flight, refused once the drain has ended).

Once the drain has ended (AppState.stopping) the batcher takes no more work: a request still
reading or decoding its body then can never be computed, and is answered 503 (ShuttingDown,
Retry-After; UNAVAILABLE on gRPC) at once rather than left to the exit, whose cancellation was a
500. Requests are registered from their start until they hand their job to the batcher
(_BeforeTheQueue); from there on the batcher's drain answers them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

from service.errors import ShuttingDown
from service.serving.exchange import Exchange
from service.serving.state import AppState

# The drain has ended when these are answered: the replica is on its way out, and a retry goes
# to another one (or to this one once it is back).
_STOPPING_RETRY_AFTER_S: Final = 1.0


class _BeforeTheQueue:
    """The requests of one lifespan that have not handed their job to the batcher yet (reading
    or decoding their body). When its `stopping` event is set, each is cancelled; admitted()
    turns that into ShuttingDown. A worker thread still decoding one is left to finish, its
    result dropped (service.serving.offload abandons it)."""

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


@asynccontextmanager
async def admitted(state: AppState, exchange: Exchange) -> AsyncIterator[None]:
    """One compute request, from its start until it is answered: counted in
    sdpa_requests_in_flight, and registered until it reaches the batcher (the pipeline calls
    `exchange.queued()` then) so that a drain ending before then answers it ShuttingDown (503)
    rather than leaving it to the exit."""
    with state.metrics.requests_in_flight.track_inprogress():
        async with _until_queued(state) as queued:
            exchange.queued = queued
            yield
