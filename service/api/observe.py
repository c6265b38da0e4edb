"""POST /v1/health/observe: attention statistics computed where the model runs (the tap's local
mode, sdpa_client.tap) recorded into the health metrics, as a computed request's would be, under
the caller's tenant (source="reported").

The body (service.wire.observe) is checked whole before anything is recorded: a 422 names the
observation and the field, a body over MAX_OBSERVE_BODY_BYTES is a 413. Like every route it is
keyed (service.middleware.auth), counted in the in-flight bytes and requests, and refused while
the service drains. Nothing reaches the device: the answer says how each tag was labelled.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api.deps import StateDep
from service.api.openapi import UNAUTHORIZED_DOC, json_ref, problem_doc, request_body
from service.errors import FieldError, PayloadTooLarge, ShuttingDown, Unavailable
from service.serving.exchange import exchange_of
from service.serving.frame import admitted
from service.wire.codec import dumps, loads_request
from service.wire.observe import MAX_OBSERVATIONS, OBSERVE_EXAMPLE, ObserveRequest, parse_observe

router = APIRouter()

# Reports are a few KB a layer (a 12-head layer of 8 sequences packed: about 3.6 KB); a body past
# this is no tap's, and parsing it would hold a worker thread for long.
MAX_OBSERVE_BODY_BYTES: Final = 16 * 1024 * 1024
# Bodies up to this are parsed on the event loop (a tap's batch of layers: tens of KB).
INLINE_BYTES: Final = 64 * 1024


def _too_large(size: int | None) -> PayloadTooLarge:
    got = "" if size is None else f"; got {size:,}"
    msg = (
        f"a /v1/health/observe body holds at most {MAX_OBSERVE_BODY_BYTES:,} bytes{got}: send "
        f"fewer observations per body (at most {MAX_OBSERVATIONS} are taken in any case)"
    )
    return PayloadTooLarge(msg, errors=[FieldError(loc=("body",), msg=msg, type="too_large")])


def _parse(body: bytes) -> ObserveRequest:
    return parse_observe(loads_request(body))


async def observe(request: Request, state: StateDep) -> Response:
    """Record per-head attention statistics computed elsewhere."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_OBSERVE_BODY_BYTES:
        raise _too_large(int(declared))
    if state.draining():
        # As a compute request is refused once the drain began: a report arriving now would
        # be recorded into series the last scrape may never read.
        raise ShuttingDown("the service is shutting down", retry_after_s=1.0)
    exchange = exchange_of(request.scope)
    async with admitted(state, exchange):
        body = await request.body()
        if len(body) > MAX_OBSERVE_BODY_BYTES:
            raise _too_large(len(body))
        if len(body) <= INLINE_BYTES:
            parsed = _parse(body)
        else:
            parsed = await asyncio.to_thread(_parse, body)
        health = state.health
        if health is None:
            raise Unavailable("not ready: the service is starting", retry_after_s=1.0)
        # Nothing is queued: from here a drain need not wait for it. Until here (the body, the
        # parse) a drain that ends answers it 503, as it does a compute request not yet queued.
        exchange.queued()
        tags = [health.observe_reported(obs, tenant=exchange.tenant) for obs in parsed.observations]
    return Response(
        content=dumps({"recorded": len(tags), "tags": tags}), media_type="application/json"
    )


_ANSWER: Final[dict[str, Any]] = {
    "description": "Recorded: how many observations, and the tag each was labelled with "
    '("other" past the tenant\'s share of SDPA_HEALTH_MAX_TAGS).',
    "content": {
        "application/json": {
            "schema": json_ref("ObserveResponse"),
            "example": {"recorded": 1, "tags": ["minilm/layer0"]},
        }
    },
}

router.add_api_route(
    "/v1/health/observe",
    observe,
    methods=["POST"],
    operation_id="observe",
    summary="Record attention statistics computed elsewhere",
    description=(
        "Per-head statistics of attention calls computed where the model runs (sdpa_client's "
        "AttentionTap with compute='local'), recorded into the attention-health metrics under "
        'the caller\'s tenant with source="reported". Nothing is computed here.'
    ),
    openapi_extra=request_body("ObserveRequest", OBSERVE_EXAMPLE),
    responses={
        200: _ANSWER,
        401: UNAUTHORIZED_DOC,
        413: problem_doc("The body is over 16 MiB."),
        415: problem_doc("The body is not declared as JSON (Content-Type: application/json)."),
        422: problem_doc(
            "A field is malformed, out of range or not finite; errors[].loc names it."
        ),
        503: problem_doc("Starting or shutting down.", retry_after=True),
    },
    tags=["health"],
)
