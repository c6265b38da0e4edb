"""Body size limit (413) and content type (415): a pure ASGI middleware in front of the routes.

A body is refused while it streams in, never after: a Content-Length above the limit is answered
before a byte of the body is read, and a body without one (chunked) is counted chunk by chunk
and refused as soon as the count passes the limit. A 1 GB upload therefore costs at most the
limit plus one chunk of memory.

Requests with a body (POST, PUT, PATCH) to a route that takes their method must declare JSON:
application/json or any application/*+json, parameters (charset) allowed; v2 bodies (under
/v2/) are exempt, since Triton's binary extension puts raw bytes after their JSON header.
Anything else is a 415 before the body is read. A method the path does not have (PUT
/healthz) is left to routing, which answers 405 with an Allow header (and 404 for an unknown
path): the request would never reach a route, so its content type is no reason to refuse it.
Its body is still limited.
"""

from __future__ import annotations

import re
from typing import Final

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import FieldError, PayloadTooLarge, ServiceError, UnsupportedMediaType
from service.http_errors import service_error_response
from service.metrics import Metrics
from service.routes import is_v2_path, route_path
from service.wire.lengths import parse_length

_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


class BodyTooLarge(PayloadTooLarge):
    """Raised from receive() when a streaming body passes the limit.

    The route's `await request.body()` raises it; the app's ServiceError handler answers 413.
    Should something swallow it, the middleware still answers 413 if no response has started.
    """


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length when it is a plain number of ASCII digits, else None."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return parse_length(value)
    return None


# How much of a streamed body's start is kept to tell how its tensors were encoded: a v1 body
# names its first tensor's encoding within its first few hundred bytes ({"q": {"b64": ...} or
# {"q": [[...). Bounded, so that the advice costs nothing next to the limit itself.
_SNIFF_BYTES: Final = 4096

# What to do about the refusal, by what was sent (`_advice`): the advice of a 413 must fit the
# request, never tell a caller to switch to the encoding it already uses.
_SPLIT: Final = "split it into smaller requests (fewer batch items or shorter sequences)"
ADVICE_V1_LISTS: Final = (
    f'its tensors are JSON lists: send them as base64 ("b64", about 3x smaller), or {_SPLIT}'
)
ADVICE_V1_BASE64: Final = f"its tensors are already base64, the compact encoding: {_SPLIT}"
ADVICE_V1_UNKNOWN: Final = (
    f'{_SPLIT}; if its tensors are JSON lists, base64 ("b64") is about 3x smaller'
)
ADVICE_V2_JSON: Final = (
    "its tensors are JSON numbers: send them as binary data (Inference-Header-Content-Length, "
    f"about 3x smaller), or {_SPLIT}"
)
ADVICE_V2_BINARY: Final = f"its tensors are already binary, the compact encoding: {_SPLIT}"


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return bytes(value)
    return None


def _advice(scope: Scope, start: bytes) -> str:
    """What the caller can do about a body over the limit, from what it sent: the path (v1 or
    v2), v2's binary framing header, and for v1 the start of the body when some of it was read
    (a refusal on Content-Length alone reads none: then the advice names both cases)."""
    if is_v2_path(route_path(scope)):
        # Triton's binary extension: the JSON header's length is declared, raw bytes follow.
        if _header(scope, b"inference-header-content-length") is not None:
            return ADVICE_V2_BINARY
        return ADVICE_V2_JSON
    if b'"b64"' in start:
        return ADVICE_V1_BASE64
    # A JSON list of numbers (or of lists) as a field's value: {"q": [[0.1, ...
    if re.search(rb'":\s*\[', start):
        return ADVICE_V1_LISTS
    return ADVICE_V1_UNKNOWN


def _too_large(limit: int, scope: Scope, start: bytes = b"") -> PayloadTooLarge:
    msg = (
        f"request body exceeds the limit of {limit} bytes (SDPA_MAX_BODY_BYTES); "
        f"{_advice(scope, start)}"
    )
    return BodyTooLarge(msg, errors=[FieldError(loc=("body",), msg=msg, type="too_large")])


def is_json_content_type(value: bytes) -> bool:
    """application/json or application/<anything>+json, ignoring parameters and case."""
    media = value.split(b";", 1)[0].strip().lower()
    if media == b"application/json":
        return True
    kind, _, subtype = media.partition(b"/")
    return kind == b"application" and subtype.endswith(b"+json")


def reaches_a_route(scope: Scope) -> bool:
    """Whether the app's router would hand this request to a route that takes its method.

    False when routing answers by itself (404, 405, a redirect). True when the app has no router
    to ask (the middleware around a bare ASGI app): then every request is checked.
    """
    router = getattr(scope.get("app"), "router", None)
    routes = getattr(router, "routes", None)
    if routes is None:
        return True
    # As Starlette's Router does: the first full match (path and method) takes the request; a
    # path match under another method is only partial.
    return any(route.matches(scope)[0] is Match.FULL for route in routes)


class BodyLimitMiddleware:
    """413 for bodies over `max_body_bytes` (counted while streaming), 415 for non-JSON bodies
    to a route that takes them."""

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int, metrics: Metrics | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return

        content_type = b""
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value

        # v2 (Open Inference Protocol) bodies may carry binary tensor data after their JSON
        # header, and its clients declare them as application/octet-stream or not at all: the
        # route reads the framing from Inference-Header-Content-Length instead.
        v2 = is_v2_path(route_path(scope))
        if not v2 and not is_json_content_type(content_type) and reaches_a_route(scope):
            shown = content_type.decode("latin-1")[:100] or "none"
            msg = f"request bodies must be JSON (Content-Type: application/json); got {shown}"
            error: ServiceError = UnsupportedMediaType(
                msg,
                errors=[FieldError(loc=("header", "content-type"), msg=msg, type="media_type")],
            )
            await service_error_response(error)(scope, receive, send)
            return

        limit = self.max_body_bytes
        declared = declared_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, receive, send)
            return

        received = 0
        refused = False
        start = b""  # the body's first bytes, for the refusal's advice

        async def counting_receive() -> Message:
            nonlocal received, refused, start
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                if len(start) < _SNIFF_BYTES:
                    start += chunk[: _SNIFF_BYTES - len(start)]
                received += len(chunk)
                if received > limit:
                    if not refused:
                        refused = True
                        self._count_refusal()
                    raise _too_large(limit, scope, start)
            return message

        response_started = False

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if response_started:
                raise
            await service_error_response(_too_large(limit, scope, start))(scope, receive, send)

    def _count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="too_large").inc()

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._count_refusal()
        # The rest of the body is never read into memory: uvicorn discards what still arrives.
        error = _too_large(self.max_body_bytes, scope)
        await service_error_response(error)(scope, receive, send)
