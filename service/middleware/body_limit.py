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

from typing import Final

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import FieldError, PayloadTooLarge, ServiceError, UnsupportedMediaType
from service.http_errors import service_error_response
from service.metrics import Metrics
from service.routes import is_v2_path
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


def _too_large(limit: int) -> PayloadTooLarge:
    msg = (
        f"request body exceeds the limit of {limit} bytes (SDPA_MAX_BODY_BYTES); send smaller "
        "requests, or base64 tensors instead of JSON lists (about 3x smaller)"
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
        v2 = is_v2_path(scope["path"])
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

        async def counting_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if not refused:
                        refused = True
                        self._count_refusal()
                    raise _too_large(limit)
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
            await service_error_response(_too_large(limit))(scope, receive, send)

    def _count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="too_large").inc()

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._count_refusal()
        # The rest of the body is never read into memory: uvicorn discards what still arrives.
        await service_error_response(_too_large(self.max_body_bytes))(scope, receive, send)
