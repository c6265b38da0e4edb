"""Compressed request bodies (Content-Encoding: gzip or deflate), inflated while they stream in.

tritonclient (request_compression_algorithm="gzip" | "deflate") and other HTTP clients may send
compressed bodies. This pure ASGI middleware inflates them for everything inside it, so the
body limit (service.middleware.body_limit) and the in-flight bytes count the inflated body, the
memory a request really holds: SDPA_MAX_BODY_BYTES bounds the body after inflation.

Codings are read as RFC 9110 §8.4 lists them: every Content-Encoding header of the request,
joined, is one comma-separated list in the order the codings were applied, so they are undone
in reverse ("gzip, deflate": inflate the deflate layer, then the gzip one). At most MAX_CODINGS
are undone; a longer list, or a coding other than gzip, x-gzip, deflate or identity, is a 415
(400 on v2) naming the header. A gzip layer may hold several members, one after the other (RFC
1952 §2.2: `cat a.gz b.gz` is one gzip body): each is inflated in turn.

Inflation is bounded: every layer inflates at most CHUNK_BYTES per step, handing the rest of
its input to the next step, so a small compressed body that inflates to gigabytes (a "zip
bomb"), through one layer or two, is refused by the body limit (413) after it has inflated past
the limit, never held whole. What a layer reads is bounded too (`max_body_bytes`): a stream of
empty deflate blocks or empty gzip members inflates to nothing, and would otherwise be read
forever without the body limit ever seeing a byte. A body that is not valid gzip/zlib data, or
ends before its stream does, is a 422 (400 on v2).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import FieldError, InvalidRequest, UnsupportedMediaType
from service.http_errors import service_error_response
from service.metrics import Metrics
from service.middleware.body_limit import BodyTooLarge

# The most bytes one inflation step produces: the layer (or the body limit) inside sees each
# step's output before the next one runs.
CHUNK_BYTES: Final = 256 * 1024
# The most codings one body may carry. RFC 9110 allows any number, and none of our clients
# applies more than one: two leave room for a proxy that compresses an already compressed body.
# Each layer holds a zlib window (32 KiB) and up to CHUNK_BYTES of pending input, and costs a
# pass over every byte of its input, which a longer list would multiply for no client.
MAX_CODINGS: Final = 2
# zlib's window bits for each coding: gzip's format (16 + 15), and HTTP's "deflate", which is
# the zlib format (RFC 9110 §8.4.1.2, as zlib.compress writes it: 15). Each layer takes its own
# format only, so that the order of several codings means what it says.
_WINDOW_BITS: Final = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})
_GZIP: Final = frozenset({"gzip", "x-gzip"})
_SHOWN_CHARS: Final = 60  # of a refused header value, in the 415's message


def _content_encoding_error(msg: str, kind: str) -> FieldError:
    return FieldError(loc=("header", "content-encoding"), msg=msg, type=kind)


def _bad_body(coding: str, why: str) -> InvalidRequest:
    msg = f"the request body is not valid {coding} data ({why})"
    return InvalidRequest(msg, errors=[_content_encoding_error(msg, "encoding")])


def _unsupported(msg: str) -> UnsupportedMediaType:
    return UnsupportedMediaType(msg, errors=[_content_encoding_error(msg, "encoding")])


def request_codings(headers: list[tuple[bytes, bytes]]) -> list[str] | UnsupportedMediaType:
    """The codings of a request's body in the order they were applied (identity and empty list
    elements dropped), or the 415 that refuses them."""
    values = [value for name, value in headers if name == b"content-encoding"]
    if not values:
        return []
    listed = b",".join(values).decode("latin-1")
    codings = [part.strip().lower() for part in listed.split(",")]
    codings = [coding for coding in codings if coding and coding != "identity"]
    shown = listed[:_SHOWN_CHARS]
    for coding in codings:
        if coding not in _WINDOW_BITS:
            return _unsupported(
                f"Content-Encoding {coding[:_SHOWN_CHARS]!r} is not supported (in {shown!r}); "
                "send gzip, deflate or identity"
            )
    if len(codings) > MAX_CODINGS:
        return _unsupported(
            f"Content-Encoding {shown!r} lists {len(codings)} codings; at most {MAX_CODINGS} "
            "are decoded: compress the body once"
        )
    return codings


class ContentEncodingMiddleware:
    """Inflate gzip and deflate request bodies chunk by chunk for the app inside.

    max_body_bytes (SDPA_MAX_BODY_BYTES): the most bytes each layer reads; None reads without
    bound (the body limit inside still bounds the inflated body).
    """

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int | None = None, metrics: Metrics | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        codings = request_codings(scope["headers"])
        if isinstance(codings, UnsupportedMediaType):
            await service_error_response(codings)(scope, receive, send)
            return
        if not codings:
            await self.app(scope, receive, send)
            return
        # Inside, the body is the inflated one: its length is unknown until it has streamed.
        # The scope is changed in place, not copied: the router records the matched route in
        # it, and the access log outside reads the route from the same dict.
        scope["headers"] = [
            (name, value)
            for name, value in scope["headers"]
            if name not in (b"content-encoding", b"content-length")
        ]
        for coding in reversed(codings):  # the last applied is the first undone
            receive = _Inflating(
                receive, coding, max_read=self.max_body_bytes, on_refusal=self._count_refusal
            )
        await self.app(scope, receive, send)

    def _count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="too_large").inc()


class _Inflating:
    """receive() of one coding's inflated bytes, read from the receive() of its compressed
    bytes: each message carries at most CHUNK_BYTES."""

    def __init__(
        self,
        source: Receive,
        coding: str,
        *,
        max_read: int | None,
        on_refusal: Callable[[], None],
    ) -> None:
        self.source = source
        self.coding = coding
        self.max_read = max_read
        self.on_refusal = on_refusal
        self.inflater = zlib.decompressobj(_WINDOW_BITS[coding])
        self.pending = b""  # input read but not yet inflated (beyond a step's output bound)
        self.read = 0  # bytes of input read
        self.source_done = False
        self.delivered = False  # the whole inflated body was handed on

    async def __call__(self) -> Message:
        if self.delivered:
            # After the body, receive() waits for the disconnect (service.api.disconnect).
            return await self.source()
        while True:
            if not self.pending and not self.source_done:
                message = await self.source()
                if message["type"] != "http.request":
                    return message  # a disconnect passes through
                self._take(message.get("body", b""), more=message.get("more_body", False))
            else:
                # Inflating from what was already received awaits nothing: without this, a
                # small body that inflates to megabytes would hold the event loop throughout.
                await asyncio.sleep(0)
            out = self._step()
            # A step that filled its output bound may hold more output inside zlib even with
            # no input left; only a shorter step has inflated everything it was given.
            drained = not self.pending and len(out) < CHUNK_BYTES
            finished = self.source_done and drained and self.inflater.eof
            if self.source_done and drained and not self.inflater.eof:
                raise _bad_body(self.coding, "the compressed stream ends early")
            if out or finished:
                self.delivered = finished
                return {"type": "http.request", "body": out, "more_body": not finished}

    def _take(self, chunk: bytes, *, more: bool) -> None:
        self.read += len(chunk)
        if self.max_read is not None and self.read > self.max_read:
            self.on_refusal()
            msg = (
                f"the {self.coding}-compressed request body passed {self.max_read} bytes, the "
                "limit of SDPA_MAX_BODY_BYTES on bodies before and after inflation; send "
                "smaller requests"
            )
            raise BodyTooLarge(msg, errors=[FieldError(loc=("body",), msg=msg, type="too_large")])
        self.pending = chunk
        self.source_done = not more

    def _step(self) -> bytes:
        """Inflate at most CHUNK_BYTES of the pending input; a gzip member that ends with bytes
        after it hands them to a fresh inflater, as the next member."""
        if self.inflater.eof and self.pending:
            if self.coding not in _GZIP:
                raise _bad_body(self.coding, "bytes follow the end of the compressed stream")
            self.inflater = zlib.decompressobj(_WINDOW_BITS[self.coding])
        try:
            out = self.inflater.decompress(self.pending, CHUNK_BYTES)
        except zlib.error as exc:
            raise _bad_body(self.coding, str(exc)) from None
        # At a stream's end zlib puts the input after it in unused_data (unconsumed_tail may
        # still show the same bytes: CPython 3.11's zlib keeps both).
        self.pending = (
            self.inflater.unused_data if self.inflater.eof else self.inflater.unconsumed_tail
        )
        return out
