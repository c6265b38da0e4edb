"""Error responses over HTTP, in the envelope of the door that serves the path: problem+json
(RFC 9457) on v1 and everything else, {"error": "..."} on the Open Inference Protocol's REST
door (service.routes.envelope_of chooses, once).

The exception handlers (service.api.errors) and the middlewares that answer before routing
(API key, body limit, content encoding, in-flight bytes) all answer through here, so the
envelope cannot drift between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from service.errors import PROBLEM_JSON, FieldError, ServiceError, clip, problem_payload
from service.routes import Envelope, envelope_of, route_path
from service.wire.v2_errors import v2_message, v2_status

# Status logged for a client that went away before its answer (nginx's "client closed request").
CLIENT_CLOSED: Final = 499


def problem_response(
    *,
    status: int,
    detail: str,
    title: str | None = None,
    errors: Iterable[FieldError] = (),
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A complete problem+json response."""
    return JSONResponse(
        problem_payload(status=status, detail=detail, title=title, errors=errors),
        status_code=status,
        headers=dict(headers) if headers else None,
        media_type=PROBLEM_JSON,
    )


def v2_error_response(
    *, status: int, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """{"error": message} with v2's status for `status`; the message clipped (service.errors)."""
    return JSONResponse(
        {"error": clip(message)},
        status_code=v2_status(status),
        headers=dict(headers) if headers else None,
    )


def error_response(exc: ServiceError, envelope: Envelope) -> JSONResponse:
    """A client-caused error's response in `envelope`, with its status and headers."""
    if envelope is Envelope.V2:
        return v2_error_response(status=exc.status, message=v2_message(exc), headers=exc.headers)
    return problem_response(
        status=exc.status,
        detail=exc.detail,
        title=exc.title,
        errors=exc.errors,
        headers=exc.headers,
    )


class ServiceErrorResponse:
    """An ASGI response for a client-caused error, in the envelope of the path it answers: for
    the middlewares, which refuse a request before any route (or door) is chosen."""

    def __init__(self, exc: ServiceError) -> None:
        self.exc = exc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if "path" in scope else ""
        response = error_response(self.exc, envelope_of(path))
        await response(scope, receive, send)


def service_error_response(exc: ServiceError) -> ServiceErrorResponse:
    """The response for a client-caused error, with its status and headers (Retry-After...)."""
    return ServiceErrorResponse(exc)
