"""The protocol layer's refusals: the complete responses it writes itself before the app has a
request, and the errors a request's receive() raises once the app holds it (the app answers
those as it answers its own refusals)."""

from __future__ import annotations

import json

from service.errors import PROBLEM_JSON, ServiceError, problem_payload


def problem_bytes(
    status: int, reason: str, detail: str, *, retry_after_s: int | None = None
) -> bytes:
    """A complete HTTP/1.1 problem+json response that closes the connection."""
    body = json.dumps(problem_payload(status=status, title=reason, detail=detail)).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        f"content-type: {PROBLEM_JSON}",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


# scope["extensions"][DELIVERY_EXTENSION]: () -> awaitable bool, whether the answer handed to the


class TrailersTooLarge(ServiceError):
    """431, raised from the receive() of a request whose chunked body's trailer section passed
    SDPA_MAX_HEADER_BYTES or SDPA_MAX_HEADERS: it reaches the app's body read, and the app
    answers it (its envelope, its access log) as it answers a refusal of the in-flight bound."""

    status = 431
    title = "Request Header Fields Too Large"


class BadBodyFraming(ServiceError):
    """400, raised from the receive() of a request whose body llhttp could not frame (a chunk
    size that is not hex, data without its CRLF, a Transfer-Encoding other than chunked): the
    app answers it as it answers TrailersTooLarge."""

    status = 400
    title = "Bad request"


class ChunksRefused(ServiceError):
    """400, raised from the receive() of a request whose chunked body's framing passed its
    bounds (a size line past MAX_CHUNK_SIZE_LINE, chunks too small on average): the app
    answers it as it answers TrailersTooLarge."""

    status = 400
    title = "Bad request"
