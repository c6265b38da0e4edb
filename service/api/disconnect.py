"""Cancel a request's pending work when its client disconnects.

A client that gives up (a timeout on its side, a closed socket) should not cost device time:
its request is dropped from the batcher's queue before compute. The watcher tells the request's
Exchange (`client_gone`); it cancels the serving task only while the Exchange says its job waits
in the queue (`waiting`), and serving itself refuses to queue the job of a client gone while its
body was decoded (a decoding on a worker thread is not abandoned: the in-flight bytes count it
until it ends). ASGI tells a handler about a
disconnect through ``receive()``: once the body was read, the next message is
``{"type": "http.disconnect"}``, delivered when the connection closes. So a watcher task waits
for that message, without polling, and cancels the handler's own task when it comes.

The work is awaited in the handler's task itself, not in a task of its own: the answer then
reaches the handler in one event-loop step instead of three (a task per request, and
asyncio.wait's callbacks, cost a measurable share of a small request's overhead).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from service.serving.exchange import ClientDisconnected, Exchange

__all__ = ["ClientDisconnected", "cancel_on_disconnect"]

R = TypeVar("R")


async def _wait_for_disconnect(request: Request) -> None:
    # After the body was read, receive() only returns on disconnect (uvicorn, httpx's ASGI
    # transport); stray body messages, if any, are skipped.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(
    request: Request, awaitable: Awaitable[R], exchange: Exchange | None = None
) -> R:
    """Await `awaitable`; if the client disconnects first, cancel it and raise ClientDisconnected.
    With `exchange`, the request's: the disconnect is told to it, and cancels `awaitable` only
    while its job waits in the queue (then, or when serving would queue it).

    Call it after the request body was read, from the task that serves the request. The
    awaitable's own cancellation handling (the batcher drops a queued item) runs before
    ClientDisconnected reaches the caller. A cancellation from anyone else propagates as usual.
    """
    owner = asyncio.current_task()
    if owner is None:  # not in a task: nothing to cancel, just wait
        return await awaitable
    disconnected = False
    finished = False

    def on_watcher_done(watcher: asyncio.Task[None]) -> None:
        nonlocal disconnected
        # `finished`: the callback may run after the work already completed (it was scheduled
        # in the same loop step); the handler must not be cancelled while it encodes.
        if finished or watcher.cancelled() or watcher.exception() is not None:
            # A receive() that failed (not a disconnect) means we cannot watch: just wait.
            return
        if exchange is not None:
            exchange.client_gone = True
            if not exchange.waiting:
                return  # serving will not queue it; an answer being made is logged 499
        disconnected = True
        owner.cancel()

    watcher = asyncio.create_task(_wait_for_disconnect(request))
    watcher.add_done_callback(on_watcher_done)
    try:
        return await awaitable
    except asyncio.CancelledError:
        # uncancel() == 0: the only cancellation pending was ours.
        if disconnected and owner.uncancel() == 0:
            raise ClientDisconnected(
                "the client disconnected before the response was ready"
            ) from None
        raise
    finally:
        finished = True
        watcher.cancel()
