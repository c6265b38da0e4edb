"""Cancel a request's pending work when its client disconnects.

A client that gives up (a timeout on its side, a closed socket) should not cost device time:
its request is dropped from the batcher's queue before compute. ASGI tells a handler about a
disconnect through ``receive()``: once the body was read, the next message is
``{"type": "http.disconnect"}``, delivered when the connection closes. So the route races its
awaitable (the batcher's submit) against that message, without polling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

R = TypeVar("R")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready; nobody gets a response."""


async def _wait_for_disconnect(request: Request) -> None:
    # After the body was read, receive() only returns on disconnect (uvicorn, httpx's ASGI
    # transport); stray body messages, if any, are skipped.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, awaitable: Awaitable[R]) -> R:
    """Await `awaitable`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Call it after the request body was read. Cancelling the caller cancels the awaitable too.
    """
    work: asyncio.Future[R] = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    racers: set[asyncio.Future[Any]] = {work, watcher}
    try:
        await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watcher.cancel()
        raise
    if work.done():
        watcher.cancel()
        return work.result()
    if watcher.exception() is not None:
        # receive() failed (not a disconnect): we cannot watch, so just wait for the answer.
        return await work
    work.cancel()
    # Let the cancelled work run its cleanup (the batcher drops a queued item and counts it)
    # before the route learns about the disconnect.
    await asyncio.wait({work})
    raise ClientDisconnected("the client disconnected before the response was ready")
