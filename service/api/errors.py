"""The exception handlers: every exception a request can raise, as a response in the envelope
of the door that serves its path (service.http_errors; service.routes chooses it, once).

A ServiceError answers with its own status and headers (Retry-After on a 503); serving has
already turned sdpa_core's errors (a 422 whose errors[].loc names the parameter) and a device out
of memory (503) into ServiceErrors. Routing errors (404/405) and FastAPI's request validation
keep their status; a client that left while its body was read is logged as 499 (no response can
reach it). Anything else is our bug: a generic 500 whose traceback goes to the log only. A bare
ValueError/TypeError is never mapped to a 4xx.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from service.errors import FieldError, InvalidRequest, ServiceError
from service.http_errors import CLIENT_CLOSED, error_response
from service.routes import Envelope, envelope_of, route_path
from service.serving.exchange import exchange_of
from service.wire.models import field_errors

logger = logging.getLogger("sdpa.app")


class _Status(ServiceError):
    """An error whose status was decided elsewhere (routing, our own bugs), to be worded in a
    door's envelope like every ServiceError."""

    def __init__(self, status: int, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.title = ""
        self._headers = headers or {}

    @property
    def headers(self) -> dict[str, str]:
        return self._headers


def _respond(request: Request, exc: ServiceError) -> Response:
    return error_response(exc, envelope_of(route_path(request.scope)))


async def _on_service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return _respond(request, exc)


async def _on_request_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    raw = exc.errors()
    errors: list[FieldError] = field_errors(raw, prefix=())
    detail = f"{len(raw)} invalid field(s)" if raw else "invalid request"
    if envelope_of(route_path(request.scope)) is Envelope.V2 and errors:
        detail = errors[0].msg  # v2's one message: the first field's
        errors = []
    return _respond(request, InvalidRequest(detail, errors=errors))


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    detail = str(exc.detail)
    if exc.status_code == 404 and envelope_of(route_path(request.scope)) is Envelope.V2:
        detail = (
            f"no such resource: {request.url.path} (this server serves the model "
            "'attention', version '1')"
        )
    headers = dict(exc.headers) if exc.headers else None
    return _respond(request, _Status(exc.status_code, detail, headers=headers))


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    # The client closed the connection while its body was being read: nobody reads this
    # answer, and it is no error of ours (no traceback). The access log and the metrics record
    # nginx's "client closed request".
    return Response(status_code=CLIENT_CLOSED)


async def _on_unhandled(request: Request, exc: Exception) -> Response:
    try:
        rid: str | None = exchange_of(request.scope).request_id
    except LookupError:  # an app built without the edge: no id to give
        rid = None
    logger.exception("unhandled error (request_id=%s)", rid, exc_info=exc)
    detail = "internal server error" + (f"; request id {rid}" if rid else "")
    # Starlette runs this handler in ServerErrorMiddleware, outside the edge's send wrapper:
    # echo the id here, so that the one response an operator must trace carries it.
    headers = {"X-Request-ID": rid} if rid is not None else None
    return _respond(request, _Status(500, detail, headers=headers))


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a request can raise to its response."""
    app.add_exception_handler(ServiceError, _on_service_error)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(ClientDisconnect, _on_client_gone)
    app.add_exception_handler(Exception, _on_unhandled)
