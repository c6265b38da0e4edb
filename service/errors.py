"""The service's error tree.

Every error a client can cause is a ServiceError subclass with its HTTP status. The handlers in
app.py are the one place that maps errors to responses; sdpa_core's SdpaError is mapped there to
422. A bare ValueError/TypeError is never mapped to a 4xx: a bug of ours must stay a 500.
"""

from __future__ import annotations

from dataclasses import dataclass


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
