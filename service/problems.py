"""RFC 9457 problem+json bodies: the one shape every error response takes.

Middlewares that answer before routing (auth, body limit) and the exception handlers in app.py
all build their responses here, so the envelope cannot drift between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from starlette.responses import JSONResponse

from service.errors import FieldError, ServiceError

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
