"""Compressed request bodies (Content-Encoding: gzip or deflate), inflated while they stream in.

tritonclient (request_compression_algorithm="gzip" | "deflate") and other HTTP clients may send
compressed bodies. This pure ASGI middleware inflates them for everything inside it, so the
body limit (service.middleware.body_limit) and the in-flight bytes count the inflated body, the
memory a request really holds: SDPA_MAX_BODY_BYTES bounds the body after inflation.

Inflation is bounded: each step inflates at most CHUNK_BYTES, handing the rest of its input to
the next step, so a small compressed body that inflates to gigabytes (a "zip bomb") is refused
by the body limit (413) after it has inflated past the limit, never held whole. A body that is
not valid gzip/zlib data, or ends before its stream does, is a 422 (400 on v2); an encoding
other than gzip, deflate or identity is a 415 (400 on v2).
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import service_error_response
from service.errors import FieldError, InvalidRequest, UnsupportedMediaType

# The most bytes one inflation step produces: the body limit sees each step's output before
# the next one runs.
CHUNK_BYTES: Final = 256 * 1024
# zlib's window bits for "gzip or zlib, whichever header the stream has" (32 + 15): HTTP's
# "deflate" is the zlib format (RFC 9110 §8.4.1.2), as zlib.compress writes it.
_GZIP_OR_ZLIB: Final = 32 + zlib.MAX_WBITS
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})
_ENCODINGS: Final = frozenset({b"gzip", b"x-gzip", b"deflate"})


def _bad_body(encoding: str, why: str) -> InvalidRequest:
    msg = f"the request body is not valid {encoding} data ({why})"
    return InvalidRequest(
        msg, errors=[FieldError(loc=("header", "content-encoding"), msg=msg, type="encoding")]
    )


class ContentEncodingMiddleware:
    """Inflate gzip and deflate request bodies chunk by chunk for the app inside."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        encoding = None
        for name, value in scope["headers"]:
            if name == b"content-encoding":
                encoding = value.strip().lower()
        if encoding is None or encoding == b"identity":
            await self.app(scope, receive, send)
            return
        if encoding not in _ENCODINGS:
            shown = encoding.decode("latin-1")[:40]
            msg = f"Content-Encoding {shown!r} is not supported; send gzip, deflate or identity"
            error = UnsupportedMediaType(
                msg,
                errors=[FieldError(loc=("header", "content-encoding"), msg=msg, type="encoding")],
            )
            await service_error_response(error)(scope, receive, send)
            return
        # Inside, the body is the inflated one: its length is unknown until it has streamed.
        # The scope is changed in place, not copied: the router records the matched route in
        # it, and the access log outside reads the route from the same dict.
        scope["headers"] = [
            (name, value)
            for name, value in scope["headers"]
            if name not in (b"content-encoding", b"content-length")
        ]
        await self.app(scope, _inflating(receive, encoding.decode("latin-1")), send)


def _inflating(receive: Receive, encoding: str) -> Receive:
    """receive() of the inflated body: each message carries at most CHUNK_BYTES of it."""
    inflater = zlib.decompressobj(_GZIP_OR_ZLIB)
    pending = b""  # compressed input not yet inflated (beyond the last step's output bound)
    upstream_done = False
    delivered = False  # the whole inflated body was handed on

    async def receive_inflated() -> Message:
        nonlocal pending, upstream_done, delivered
        if delivered:
            # After the body, receive() waits for the disconnect (service.api.disconnect).
            return await receive()
        while True:
            if not pending and not upstream_done:
                message = await receive()
                if message["type"] != "http.request":
                    return message  # a disconnect passes through
                pending = message.get("body", b"")
                upstream_done = not message.get("more_body", False)
            else:
                # Inflating from what was already received awaits nothing: without this, a
                # small body that inflates to megabytes would hold the event loop throughout.
                await asyncio.sleep(0)
            try:
                out = inflater.decompress(pending, CHUNK_BYTES)
            except zlib.error as exc:
                raise _bad_body(encoding, str(exc)) from None
            pending = inflater.unconsumed_tail
            finished = upstream_done and not pending
            if finished and not inflater.eof:
                raise _bad_body(encoding, "the compressed stream ends early")
            if finished and inflater.unused_data:
                raise _bad_body(encoding, "bytes follow the end of the compressed stream")
            if out or finished:
                delivered = finished
                return {"type": "http.request", "body": out, "more_body": not finished}

    return receive_inflated
