"""The one place that maps exceptions to HTTP responses, all of them problem+json.

A ServiceError answers with its own status and headers (Retry-After on a 503); sdpa_core's
SdpaError is a 422 whose errors[].loc names the parameter; routing errors (404/405) and
FastAPI's request validation keep their status; a device out of memory is a 503; a client that
left while its body was read is logged as 499 (no response can reach it). Anything else
is our bug: a generic 500 whose traceback goes to the log only. A bare ValueError/TypeError is
never mapped to a 4xx. The middlewares that answer before routing (auth, body limit) build their
responses here too, so the envelope cannot drift.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Final

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from sdpa_core.errors import SdpaError
from service.errors import PROBLEM_JSON, FieldError, ServiceError, problem_payload
from service.wire.models import field_errors

logger = logging.getLogger("sdpa.app")

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
    errors = field_errors(exc.errors(), prefix=())
    detail = f"{len(errors)} invalid field(s)" if errors else "invalid request"
    return problem_response(status=422, detail=detail, errors=errors)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return problem_response(status=exc.status_code, detail=str(exc.detail), headers=exc.headers)


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    # The client closed the connection while its body was being read: nobody reads this
    # answer, and it is no error of ours (no traceback). The access log and the metrics record
    # nginx's "client closed request".
    return Response(status_code=CLIENT_CLOSED)


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
    app.add_exception_handler(ClientDisconnect, _on_client_gone)
    app.add_exception_handler(torch.OutOfMemoryError, _on_device_oom)
    app.add_exception_handler(Exception, _on_unhandled)
