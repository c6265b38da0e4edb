"""The service's errors and the one place that maps exceptions to HTTP responses.

Every error a client can cause is a ServiceError subclass with its HTTP status; sdpa_core's
SdpaError is a 422 naming its parameter; routing errors (404/405) and request validation keep
their status; a device out of memory is a 503. Every error response is RFC 9457
problem+json (problem_response), the middlewares' too. Anything else is our bug: a generic 500
whose traceback goes to the log only. A bare ValueError/TypeError is never mapped to a 4xx.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from sdpa_core import SdpaError

logger = logging.getLogger("sdpa.app")


@dataclass(frozen=True, slots=True)
class FieldError:
    """One problem with one field, as in the problem+json "errors" list."""

    loc: tuple[str | int, ...]
    msg: str
    type: str = "value_error"


class ServiceError(Exception):
    """Base of client-caused errors. Subclasses fix status and title."""

    status: int = 400
    title: str = "Bad request"
    problem_type: str = "about:blank"

    def __init__(self, detail: str, *, errors: list[FieldError] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors: list[FieldError] = errors or []

    @property
    def headers(self) -> dict[str, str]:
        return {}


class Unauthorized(ServiceError):
    status = 401
    title = "Unauthorized"

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="sdpa-service"'}


class PayloadTooLarge(ServiceError):
    status = 413
    title = "Payload too large"


class UnsupportedMediaType(ServiceError):
    status = 415
    title = "Unsupported media type"


class InvalidRequest(ServiceError):
    """Shapes, masks, dtypes, non-finite values, element limits: anything semantically wrong."""

    status = 422
    title = "Invalid request"


class Unavailable(ServiceError):
    """503: the queue is full or the service is draining. Always carries Retry-After."""

    status = 503
    title = "Service unavailable"

    def __init__(
        self, detail: str, *, retry_after_s: float, errors: list[FieldError] | None = None
    ) -> None:
        super().__init__(detail, errors=errors)
        # Retry-After takes whole seconds (RFC 9110 §10.2.3); never advertise 0.
        self.retry_after_s = max(1, int(-(-retry_after_s // 1)))

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class QueueFull(Unavailable):
    title = "Queue full"


class ShuttingDown(Unavailable):
    title = "Shutting down"


class DeadlineExceeded(ServiceError):
    """504: the request's deadline passed before it ran; it was never computed."""

    status = 504
    title = "Deadline exceeded"


# ---- problem+json ----------------------------------------------------------------------

PROBLEM_JSON = "application/problem+json"

# Titles for statuses we answer without a ServiceError (e.g. 404 from routing, 500).
_DEFAULT_TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    404: "Not found",
    405: "Method not allowed",
    413: "Payload too large",
    415: "Unsupported media type",
    422: "Invalid request",
    500: "Internal server error",
    503: "Service unavailable",
    504: "Deadline exceeded",
}


def problem_payload(
    *,
    status: int,
    detail: str,
    title: str | None = None,
    errors: Iterable[FieldError] = (),
    type_: str = "about:blank",
) -> dict[str, Any]:
    """The JSON object of one problem. `errors` lists field-level problems with their loc."""
    return {
        "type": type_,
        "title": title or _DEFAULT_TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        "errors": [{"loc": list(e.loc), "msg": e.msg, "type": e.type} for e in errors],
    }


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


def service_error_response(exc: ServiceError) -> JSONResponse:
    """The response for a client-caused error, with its status and headers (Retry-After...)."""
    return problem_response(
        status=exc.status,
        detail=exc.detail,
        title=exc.title,
        errors=exc.errors,
        headers=exc.headers,
    )


# ---- exception handlers --------------------------------------------------------------------


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


async def _on_service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return service_error_response(exc)


async def _on_sdpa_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SdpaError)
    parts = [exc.message]
    if exc.expected is not None:
        parts.append(f"expected {exc.expected}")
    if exc.got is not None:
        parts.append(f"got {exc.got}")
    error = FieldError(
        loc=("body", *exc.param.split(".")), msg="; ".join(parts), type=_snake(type(exc).__name__)
    )
    return problem_response(status=422, detail=str(exc), errors=[error])


async def _on_request_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    # Imported here: the wire models raise this module's InvalidRequest (an import cycle).
    from service.wire.models import field_errors

    errors = field_errors(exc.errors(), prefix=())
    detail = f"{len(errors)} invalid field(s)" if errors else "invalid request"
    return problem_response(status=422, detail=detail, errors=errors)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return problem_response(status=exc.status_code, detail=str(exc.detail), headers=exc.headers)


async def _on_device_oom(request: Request, exc: Exception) -> Response:
    # Memory on the device is shared by whatever runs at the moment: a retry may well fit.
    logger.warning("device out of memory: %s", exc)
    return problem_response(
        status=503,
        detail="the device ran out of memory; retry later, or send a smaller request",
        headers={"Retry-After": "1"},
    )


async def _on_unhandled(request: Request, exc: Exception) -> Response:
    rid = getattr(request.state, "request_id", None)
    logger.exception("unhandled error (request_id=%s)", rid, exc_info=exc)
    detail = "internal server error" + (f"; request id {rid}" if rid else "")
    # Starlette runs this handler in ServerErrorMiddleware, outside the access log's send
    # wrapper: echo the id here, so that the one response an operator must trace carries it.
    headers = {"X-Request-ID": rid} if isinstance(rid, str) else None
    return problem_response(status=500, detail=detail, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a request can raise to its problem+json response."""
    app.add_exception_handler(ServiceError, _on_service_error)
    app.add_exception_handler(SdpaError, _on_sdpa_error)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(torch.OutOfMemoryError, _on_device_oom)
    app.add_exception_handler(Exception, _on_unhandled)
