"""What the HTTP compute routes share: admit the request, read its body, run the serving
pipeline through the route's door with the request's Exchange (the edge made it: its id, its
tenant, its in-flight holding), answer. A client that leaves is logged 499.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response

from service.api.disconnect import ClientDisconnected, cancel_on_disconnect
from service.http_errors import CLIENT_CLOSED
from service.serving import pipeline
from service.serving.exchange import exchange_of
from service.serving.frame import admitted
from service.serving.pipeline import Door, Served
from service.serving.state import AppState

A = TypeVar("A")


async def serve_with(
    request: Request,
    state: AppState,
    door_for: Callable[[bytes], Door[Any, Any, A]],
    respond: Callable[[Served[A]], Response],
) -> Response:
    """The frame of every compute route, v1's and v2's: read the request, run the door that
    `door_for` makes of its body through the pipeline, and `respond` with its answer."""
    exchange = exchange_of(request.scope)
    async with admitted(state, exchange):
        body = await request.body()
        exchange.received = time.monotonic()
        try:
            # A client that disconnects while its job waits takes the job out of the queue.
            served = await cancel_on_disconnect(
                request, pipeline.run(door_for(body), exchange, state), exchange
            )
        except ClientDisconnected:
            return client_closed()
    return respond(served)


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
