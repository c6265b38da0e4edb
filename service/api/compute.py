"""What the compute routes share: read the body, bind a serving Call to this request, run the
serving pipeline, answer."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.responses import Response

from service.api.deps import AppState, request_id, running_batcher
from service.api.disconnect import ClientDisconnected, cancel_on_disconnect
from service.api.errors import CLIENT_CLOSED
from service.middleware.inflight import RESERVE_ANSWER
from service.runtime.batcher import BatchResult
from service.runtime.jobs import Outcome, PreparedJob
from service.serving.pipeline import Call, Reply

# A serving pipeline: body bytes and a Call -> a Reply (service.serving.pipeline).
Pipeline = Callable[[bytes, Call], Awaitable[Reply]]


async def read_call(request: Request, state: AppState) -> tuple[bytes, Call]:
    """Read the body and bind a serving Call to this request, its batcher and its client."""
    started = time.monotonic()
    body = await request.body()
    received = time.monotonic()
    batcher = running_batcher(state)

    async def submit(job: PreparedJob, deadline: float) -> BatchResult[Outcome]:
        # A client that disconnects while its job waits takes the job out of the queue.
        return await cancel_on_disconnect(request, batcher.submit(job, deadline=deadline))

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
        body, call = await read_call(request, state)
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
