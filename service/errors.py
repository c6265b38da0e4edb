"""The service's error tree and the shape of every error body (RFC 9457 problem+json).

Every error a client can cause is a ServiceError subclass that carries its HTTP status, so the
rooms that raise them (wire, serving, runtime) need no web framework. service.api.errors turns
them for a client: service.serving turns sdpa_core's SdpaError and a device out of memory into
ServiceErrors, and each door words them in its own envelope, chosen once (service.http_errors:
problem+json or the Open Inference Protocol's {"error"}; service.api.grpc: a gRPC status).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any, Final, Protocol


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

    @property
    def field_detail(self) -> str:
        """The detail without the field's own name in front, for an envelope that names the
        field in its own words (the Open Inference Protocol's: service.wire.v2_errors)."""
        return self.detail


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


class CoreRefusal(Protocol):
    """What sdpa_core's SdpaError carries (this module imports no torch)."""

    message: str
    param: str
    expected: Any
    got: Any


# sdpa_core words its refusals for a Python caller of attention(). Some of its advice is no door's
# to follow: no door takes allow_nonfinite (the service never computes NaN/Inf inputs), and the
# Open Inference Protocol asks for the weights by an output where v1 has return_weights. Every
# core refusal reaches a door through InvalidInput.from_core, which words its advice here, once:
# (the core's words, v1's, the Open Inference Protocol's, for its REST and gRPC doors alike).
_CORE_ADVICE: Final = (
    (" (pass allow_nonfinite=True to accept them)", "", ""),
    (
        "when return_weights is true",
        "when return_weights is true",
        "when the output 'weights' is requested",
    ),
)


class InvalidInput(InvalidRequest):
    """sdpa_core refused the inputs (SdpaError: shapes, masks, dtypes, non-finite values, memory
    budgets); `errors[0]` locates the parameter, its msg says what was expected and got, in v1's
    words; field_detail says it in the Open Inference Protocol's (from_core)."""

    def __init__(
        self, detail: str, *, errors: list[FieldError] | None = None, v2_detail: str | None = None
    ) -> None:
        super().__init__(detail, errors=errors)
        self._v2_detail = v2_detail

    @classmethod
    def from_core(cls, exc: CoreRefusal) -> InvalidInput:
        """sdpa_core's refusal as a client error whose errors[0].loc names the parameter (loc
        ["body", *param]), its advice worded for each door (_CORE_ADVICE)."""
        parts = [exc.message]
        if exc.expected is not None:
            parts.append(f"expected {exc.expected}")
        if exc.got is not None:
            parts.append(f"got {exc.got}")
        v1 = v2 = "; ".join(parts)
        for core, v1_words, v2_words in _CORE_ADVICE:
            v1, v2 = v1.replace(core, v1_words), v2.replace(core, v2_words)
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in type(exc).__name__)
        error = FieldError(loc=("body", *exc.param.split(".")), msg=v1, type=snake.lstrip("_"))
        return cls(f"{exc.param}: {v1}", errors=[error], v2_detail=v2)

    @property
    def field_detail(self) -> str:
        if self._v2_detail is not None:
            return self._v2_detail
        return self.errors[0].msg if self.errors else self.detail


class RetryLater(ServiceError):
    """A momentary refusal: it always carries Retry-After, in whole seconds."""

    def __init__(
        self, detail: str, *, retry_after_s: float, errors: list[FieldError] | None = None
    ) -> None:
        super().__init__(detail, errors=errors)
        # Retry-After takes whole seconds (RFC 9110 §10.2.3); never advertise 0.
        self.retry_after_s = max(1, int(-(-retry_after_s // 1)))

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class TenantQueueFull(RetryLater):
    """429: the request's tenant holds its whole share of the queue (SDPA_TENANT_MAX_QUEUE_SHARE);
    Retry-After is that tenant's own backlog at its fair share of the device."""

    status = 429
    title = "Too many requests"


class Unavailable(RetryLater):
    """503: the queue is full or the service is draining."""

    status = 503
    title = "Service unavailable"


class QueueFull(Unavailable):
    title = "Queue full"


class ShuttingDown(Unavailable):
    title = "Shutting down"


class DeadlineUnreachable(Unavailable):
    """503: a long request the device could finish by its deadline alone, but not beside the
    long requests admitted before it (service.runtime.batcher: Deadlines of long items)."""

    title = "Deadline unreachable"


class MemoryBusy(Unavailable):
    """503: the bodies being read and the results not yet sent fill SDPA_MAX_INFLIGHT_BYTES."""

    title = "Memory busy"


class DeviceOutOfMemory(Unavailable):
    """503: the device ran out of memory; memory on it is shared by whatever runs at the
    moment, so a retry may well fit."""

    title = "Device out of memory"


class DeadlineExceeded(ServiceError):
    """504: the request's deadline passed before it ran; it was never computed."""

    status = 504
    title = "Deadline exceeded"


# ---- bounded error bodies ------------------------------------------------------------------
# An error body is bounded whatever the request holds: a body of a million unknown fields was
# once answered with 84 MB of errors, and a client's key or value can be megabytes long. At most
# MAX_LISTED_ERRORS field errors are listed (the detail says how many there were, see
# and_more()), and every text a client can lengthen is cut: messages and details at
# MAX_ERROR_TEXT characters, each part of a loc at MAX_LOC_TEXT.

MAX_LISTED_ERRORS: Final = 10
MAX_ERROR_TEXT: Final = 500
MAX_LOC_TEXT: Final = 64


def clip(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """`text`, cut to `limit` characters (the last one "…") when longer."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def and_more(total: int, *, listed: int) -> str:
    """What follows an error's first message when it had company: " (and 99,999 more; 10
    listed)", or "" for one error."""
    if total <= 1:
        return ""
    shown = f"; {listed} listed" if listed < total else ""
    return f" (and {total - 1:,} more{shown})"


def _loc_part(part: str | int) -> str | int:
    return clip(part, MAX_LOC_TEXT) if isinstance(part, str) else part


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
    429: "Too many requests",
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
    """The JSON object of one problem. `errors` lists field-level problems with their loc: the
    first MAX_LISTED_ERRORS of them, their texts clipped (the raiser's detail counts them all)."""
    return {
        "type": type_,
        "title": title or _DEFAULT_TITLES.get(status, "Error"),
        "status": status,
        "detail": clip(detail),
        "errors": [
            {"loc": [_loc_part(part) for part in e.loc], "msg": clip(e.msg), "type": e.type}
            for e in islice(errors, MAX_LISTED_ERRORS)
        ],
    }
