"""The one place that maps exceptions to HTTP responses: problem+json, and under /v2 (the Open
Inference Protocol) {"error": "..."} with 400 where v1 answers 422.

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
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from sdpa_core.errors import SdpaError
from service.errors import PROBLEM_JSON, FieldError, ServiceError, clip, problem_payload
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


# ---- the Open Inference Protocol's errors (v2) ---------------------------------------------
# Under /v2 every error is {"error": "<message>"}, as tritonclient and KServe's clients parse
# it, and what v1 answers 422 (or 415) is a 400; other statuses and headers are v1's.

_V2_STATUS: Final = {422: 400, 415: 400}
_V2_INPUTS: Final = frozenset({"q", "k", "v", "key_lengths", "key_padding_mask", "attn_mask"})
# v1 field names (in errors[].loc) -> what a v2 request calls them.
_V2_NAMES: Final = {
    "return_weights": "output 'weights'",
    "response_encoding": "outputs",
    "timeout_ms": "parameter 'timeout'",
}


def is_v2_path(path: str) -> bool:
    """Whether `path` is served by the Open Inference Protocol (v2)."""
    return path == "/v2" or path.startswith("/v2/")


def v2_name(field: str | int) -> str:
    """A v1 field name as v2 names it: input 'q', output 'weights', parameter 'scale'."""
    if field in _V2_INPUTS:
        return f"input {field!r}"
    return _V2_NAMES.get(str(field), f"parameter {field!r}")


def v2_message(detail: str, errors: Sequence[FieldError]) -> str:
    """An error's message in v2's words. The serving layer's shared checks locate their field
    by its v1 name (loc ["body", name]): the message then starts with its v2 name."""
    loc = errors[0].loc if errors else ()
    if len(loc) > 1 and loc[0] == "body":
        return f"{v2_name(loc[1])}: {detail}"
    return detail


def v2_error_response(
    *, status: int, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """{"error": message} with v2's status for it; the message clipped (service.errors)."""
    return JSONResponse(
        {"error": clip(message)},
        status_code=_V2_STATUS.get(status, status),
        headers=dict(headers) if headers else None,
    )


class ServiceErrorResponse(JSONResponse):
    """A client-caused error's response: problem+json, or v2's {"error"} when it answers a /v2
    path. Chosen when sent, since the middlewares that answer before routing (auth, body limit,
    in-flight bytes) build it without a request."""

    def __init__(self, exc: ServiceError) -> None:
        super().__init__(
            problem_payload(
                status=exc.status, detail=exc.detail, title=exc.title, errors=exc.errors
            ),
            status_code=exc.status,
            headers=exc.headers or None,
            media_type=PROBLEM_JSON,
        )
        self._v2 = v2_error_response(
            status=exc.status, message=v2_message(exc.detail, exc.errors), headers=exc.headers
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if is_v2_path(scope.get("path", "")):
            await self._v2(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def service_error_response(exc: ServiceError) -> JSONResponse:
    """The response for a client-caused error, with its status and headers (Retry-After...)."""
    return ServiceErrorResponse(exc)


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
    if is_v2_path(request.url.path):
        name = v2_name(exc.param.split(".")[0])
        return v2_error_response(status=422, message=f"{name}: {'; '.join(parts)}")
    error = FieldError(
        loc=("body", *exc.param.split(".")), msg="; ".join(parts), type=_snake(type(exc).__name__)
    )
    return problem_response(status=422, detail=str(exc), errors=[error])


async def _on_request_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    raw = exc.errors()
    errors = field_errors(raw, prefix=())
    detail = f"{len(raw)} invalid field(s)" if raw else "invalid request"
    if is_v2_path(request.url.path):
        return v2_error_response(status=422, message=errors[0].msg if errors else detail)
    return problem_response(status=422, detail=detail, errors=errors)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if is_v2_path(request.url.path):
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (
                f"no such resource: {request.url.path} (this server serves the model "
                "'attention', version '1')"
            )
        return v2_error_response(status=exc.status_code, message=message, headers=exc.headers)
    return problem_response(status=exc.status_code, detail=str(exc.detail), headers=exc.headers)


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    # The client closed the connection while its body was being read: nobody reads this
    # answer, and it is no error of ours (no traceback). The access log and the metrics record
    # nginx's "client closed request".
    return Response(status_code=CLIENT_CLOSED)


async def _on_device_oom(request: Request, exc: Exception) -> Response:
    # Memory on the device is shared by whatever runs at the moment: a retry may well fit.
    logger.warning("device out of memory: %s", exc)
    detail = "the device ran out of memory; retry later, or send a smaller request"
    if is_v2_path(request.url.path):
        return v2_error_response(status=503, message=detail, headers={"Retry-After": "1"})
    return problem_response(status=503, detail=detail, headers={"Retry-After": "1"})


async def _on_unhandled(request: Request, exc: Exception) -> Response:
    rid = getattr(request.state, "request_id", None)
    logger.exception("unhandled error (request_id=%s)", rid, exc_info=exc)
    detail = "internal server error" + (f"; request id {rid}" if rid else "")
    # Starlette runs this handler in ServerErrorMiddleware, outside the access log's send
    # wrapper: echo the id here, so that the one response an operator must trace carries it.
    headers = {"X-Request-ID": rid} if isinstance(rid, str) else None
    if is_v2_path(request.url.path):
        return v2_error_response(status=500, message=detail, headers=headers)
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
