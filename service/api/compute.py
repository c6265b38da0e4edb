"""What the HTTP compute routes share: admit the request, read its body, bind a serving Call
to it (its tenant, its in-flight bytes, its connection), run the serving pipeline through the
route's door, answer. A client that leaves is logged 499.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response

from service.api.deps import request_id
from service.api.disconnect import ClientDisconnected, cancel_on_disconnect
from service.http_errors import CLIENT_CLOSED
from service.routes import BATCH_SIZE, PHASES, RESERVE_ANSWER, TENANT
from service.serving import pipeline
from service.serving.frame import admitted, bind_call
from service.serving.pipeline import Call, Door, Served
from service.serving.state import AppState
from service.tenants import ANONYMOUS

A = TypeVar("A")


async def serve_with(
    request: Request,
    state: AppState,
    door_for: Callable[[bytes], Door[Any, Any, A]],
    respond: Callable[[Served[A]], Response],
) -> Response:
    """The frame of every compute route, v1's and v2's: read the request, run the door that
    `door_for` makes of its body through the pipeline, and `respond` with its answer."""
    async with admitted(state) as queued:
        started = time.monotonic()
        body = await request.body()
        call = _bind(request, state, started=started, queued=queued)
        try:
            served = await pipeline.run(door_for(body), call)
        except ClientDisconnected:
            return client_closed()
    # The access log and the trace read these (service.routes).
    setattr(request.state, BATCH_SIZE, served.phases.batch_size)
    setattr(request.state, PHASES, served.phases)
    return respond(served)


def _bind(request: Request, state: AppState, *, started: float, queued: Callable[[], None]) -> Call:
    def until_gone(waiting: Awaitable[Any]) -> Awaitable[Any]:
        # A client that disconnects while its job waits takes the job out of the queue.
        return cancel_on_disconnect(request, waiting)

    return bind_call(
        state,
        # The tenant the auth middleware named (service.tenants); without keys, "anonymous".
        tenant=getattr(request.state, TENANT, ANONYMOUS),
        request_id=request_id(request),
        started=started,
        received=time.monotonic(),
        queued=queued,
        reserve_answer=getattr(request.state, RESERVE_ANSWER, None),
        until_gone=until_gone,
    )


def json_answer(served: Served[bytes]) -> Response:
    """A 200 with a JSON body and its Server-Timing."""
    return Response(
        content=served.answer,
        media_type="application/json",
        headers={"Server-Timing": served.phases.server_timing()},
    )


def client_closed() -> Response:
    # Nobody reads this; it exists so the access log records what happened.
    return Response(status_code=CLIENT_CLOSED)
