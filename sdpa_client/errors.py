"""The exceptions this client raises, and how an HTTP error answer becomes one of them.

Every error is an `SDPARequestError`. An answer other than 2xx becomes the subclass for its
status (`SDPAValidationError` for 422, `SDPARateLimited` for 429, `SDPAUnavailable` for 503,
...), carrying the fields of the server's problem+json body (RFC 9457): status, title, detail,
and `errors` with the `loc` of each field at fault (a v2 answer's {"error": ...} is its detail).
No answer at all (refused, reset, timed out) is an `SDPAConnectionError`.
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only read through its attributes: no import cost at run time
    import httpx


@dataclass(frozen=True, slots=True)
class FieldProblem:
    """One field-level problem of an error answer.

    Attributes:
        loc: where the problem is, e.g. ("body", "k", "shape").
        msg: what is wrong with it.
        type: the server's kind of problem (e.g. "value_error"), when it says.
    """

    loc: tuple[str | int, ...]
    msg: str
    type: str | None = None


class SDPARequestError(Exception):
    """Base of every error this client raises.

    Attributes:
        status: the HTTP status, or None when no answer came (transport failure).
        title: the problem's short summary (or the transport error's name).
        detail: what happened, in words.
        errors: the field-level problems (`FieldProblem`), possibly empty.
        problem_type: the problem+json "type" URI ("about:blank" when none).
        retry_after_s: the server's Retry-After, in seconds from now, when it sent one.
        request_id: the server's X-Request-ID for this call, to find it in the server's log.
        attempts: how many times the request was sent before giving up.
    """

    def __init__(
        self,
        status: int | None,
        title: str,
        detail: str,
        *,
        errors: Sequence[FieldProblem] = (),
        problem_type: str = "about:blank",
        retry_after_s: float | None = None,
        request_id: str | None = None,
        attempts: int = 1,
    ) -> None:
        self.status = status
        self.title = title
        self.detail = detail
        self.errors: list[FieldProblem] = list(errors)
        self.problem_type = problem_type
        self.retry_after_s = retry_after_s
        self.request_id = request_id
        self.attempts = attempts
        super().__init__(self._message())

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles as cls(*args); ours take keyword-only fields (multiprocessing,
        # concurrent.futures and pytest-xdist pickle exceptions).
        return (_rebuild_error, (type(self), self.__dict__.copy()))

    def _message(self) -> str:
        head = f"{self.status} {self.title}" if self.status is not None else self.title
        # The server's detail often is (or holds) its one field problem's msg: each is said
        # once, the field problems the detail already says are left out.
        text = f"{head}: {self.detail}" if self.detail else head
        unsaid = [e for e in self.errors if not e.msg or e.msg not in self.detail]
        if unsaid:
            shown = "; ".join(f"{'.'.join(map(str, e.loc))}: {e.msg}" for e in unsaid[:3])
            more = f" (+{len(unsaid) - 3} more)" if len(unsaid) > 3 else ""
            text = f"{text} [{shown}{more}]"
        return text


def _rebuild_error(cls: type[SDPARequestError], state: dict[str, Any]) -> SDPARequestError:
    err = cls.__new__(cls)
    err.__dict__.update(state)
    Exception.__init__(err, err._message())
    return err


class SDPAClientError(SDPARequestError):
    """4xx: the request was wrong; repeating it unchanged will fail again (except 429,
    `SDPARateLimited`: the request was right but came too soon)."""


class SDPAAuthError(SDPAClientError):
    """401/403: missing or wrong API key."""


class SDPAPayloadTooLarge(SDPAClientError):
    """413: the body is larger than the server accepts (its SDPA_MAX_BODY_BYTES).

    Also raised by the client itself, before sending, for a body over the limit the server
    advertised (/v1/info limits.max_body_bytes): then `.attempts` is 0 and `.limit_bytes` and
    `.body_bytes` say the limit and the body's size (None on a server's 413).
    """

    limit_bytes: int | None = None
    body_bytes: int | None = None


class SDPAUnsupportedMediaType(SDPAClientError):
    """415: the body was not sent as JSON."""


class SDPAValidationError(SDPAClientError):
    """400/422: shapes, masks, dtypes, non-finite values or limits; see `.errors`."""


class SDPARateLimited(SDPAClientError):
    """429: this caller's tenant (its API key) holds its whole share of the server's queue.

    Other tenants are still served (503, `SDPAUnavailable`, is the whole server being full).
    The request itself was fine: it is retried after `.retry_after_s` (the tenant's own
    backlog) like a 503, within the client's RetryPolicy; raised once the retries are spent.
    `.detail` names the share, e.g. "tenant 'team-a' holds 512 of its 512 queued requests".
    """


class SDPAServerError(SDPARequestError):
    """5xx."""


class SDPAUnavailable(SDPAServerError):
    """503: queue full or server draining; `.retry_after_s` says when to come back."""


class SDPATimeout(SDPAServerError):
    """504: the request's deadline passed before it was computed."""


class SDPAConnectionError(SDPARequestError):
    """No HTTP answer: connection refused or reset, DNS, write or connect timeout."""


class SDPAReadTimeout(SDPAConnectionError):
    """The server accepted the request but did not answer within the client's read timeout."""


class SDPAProtocolError(SDPARequestError):
    """A 2xx answer this client cannot read (not JSON, or a field missing or malformed)."""


_STATUS_CLASSES: dict[int, type[SDPARequestError]] = {
    400: SDPAValidationError,
    401: SDPAAuthError,
    403: SDPAAuthError,
    413: SDPAPayloadTooLarge,
    415: SDPAUnsupportedMediaType,
    422: SDPAValidationError,
    429: SDPARateLimited,
    503: SDPAUnavailable,
    504: SDPATimeout,
}


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Read a Retry-After header as seconds from now.

    Args:
        value: the header: delta-seconds ("2") or an HTTP-date (RFC 9110 section 10.2.3).
        now: the reference time for an HTTP-date (default: the current time).

    Returns:
        Seconds to wait (0 for a date in the past), or None when absent or unreadable.
    """
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; obsolete forms may parse naive
        when = when.replace(tzinfo=UTC)
    reference = now or datetime.now(UTC)
    return max(0.0, (when - reference).total_seconds())


def error_from_response(response: httpx.Response, *, attempts: int = 1) -> SDPARequestError:
    """The typed exception for an answer other than 2xx.

    Args:
        response: the answer, with a problem+json body or any other.
        attempts: how many times the request had been sent.

    Returns:
        The `SDPARequestError` subclass for the status, with the problem's fields.
    """
    status = response.status_code
    title = response.reason_phrase or "HTTP error"
    detail = ""
    problem_type = "about:blank"
    errors: list[FieldProblem] = []
    try:
        payload = response.json()
    except (ValueError, UnicodeDecodeError):
        payload = None
        detail = response.text[:500]
    if isinstance(payload, dict):
        title = str(payload.get("title") or title)
        # problem+json's detail, or the Open Inference Protocol's {"error": ...} (v2)
        detail = str(payload.get("detail") or payload.get("error") or "")
        problem_type = str(payload.get("type") or problem_type)
        errors = [
            _field_problem(item) for item in payload.get("errors") or () if isinstance(item, dict)
        ]
    cls = _STATUS_CLASSES.get(status) or _class_for_range(status)
    return cls(
        status,
        title,
        detail,
        errors=errors,
        problem_type=problem_type,
        retry_after_s=parse_retry_after(response.headers.get("retry-after")),
        request_id=response.headers.get("x-request-id"),
        attempts=attempts,
    )


def _field_problem(item: dict[str, Any]) -> FieldProblem:
    loc = item.get("loc") or ()
    kind = item.get("type")
    return FieldProblem(
        loc=tuple(p if isinstance(p, int) else str(p) for p in loc),
        msg=str(item.get("msg", "")),
        type=None if kind is None else str(kind),
    )


def _class_for_range(status: int) -> type[SDPARequestError]:
    if 400 <= status < 500:
        return SDPAClientError
    return SDPAServerError if status >= 500 else SDPARequestError
