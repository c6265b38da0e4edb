"""SDPA_MAX_INFLIGHT_BYTES: the bytes all requests hold together, bounded.

A request holds the body it has read, what parsing that body will take, and the answer bytes it
hands to the server until the app is done with it; after that, what its client has not taken
yet waits in the connection's write buffer (service.protocol counts those of
clients that fell behind; the send timeout frees a client that reads nothing).

- Its declared body (Content-Length, at most SDPA_MAX_BODY_BYTES) must fit beside the bytes
  held when it arrives, or it gets 503 with Retry-After before any of its body is read; but
  only what has arrived, and BODY_WINDOW ahead of it, is held: a client that declares a large
  body and sends it slowly, or not at all, holds the room it really takes (declaring 1/48 of
  the limit on each of 48 connections and sending nothing had locked everyone out at a few
  bytes a second). Bodies declared together that do not all fit are refused mid-stream (below)
  as they grow.
- Its body is counted as it arrives, after inflation (service.middleware.content_encoding sits
  outside): a chunked or compressed body, which declares nothing, grows its reservation chunk
  by chunk, and so does the parse estimate below. A step that would take the bytes held past
  the limit is refused there, mid-stream: 503 with Retry-After while others hold the room, 413
  when the body alone passes the limit, 422 when its body and parse estimate do.
- Parsing a JSON body holds more than its bytes: pydantic_core's from_json builds a Python
  object for every number and list, and numpy copies them again (preparing a body of
  one-decimal numbers grows the peak RSS by 8.8x its size, one of one-number lists by 18x, one
  of empty lists by 30x: bench/attack_bodies.py parse-peak). So the body's JSON separators
  are counted as it arrives (`,` for an element, `[` or `{` for a container, `:` for a key),
  and each reserves what it cost to parse, measured on this service (bench/attack_bodies.py
  parse-peak). Base64 tensors hold none of them, but their strings become a Python str as long
  as themselves and then their decoded bytes: the estimate is at least STRING_PEAK_RATIO times
  the JSON read. Under /v2/ with Inference-Header-Content-Length, only the JSON header is
  scanned: binary data holds no JSON.
  The parse reservation is dropped once the request is decoded (serving's first
  reserve_answer on the request's Holding).
- Once a request is decoded, its answer's working set is reserved before it is computed, or
  the request gets that 503 (422 when it could never fit).

Probes and metrics are never refused for it: an orchestrator must still see the process alive,
and an operator why it refuses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import FieldError, InvalidRequest, MemoryBusy, PayloadTooLarge, ServiceError
from service.http_errors import service_error_response
from service.metrics import Metrics
from service.middleware.body_limit import declared_length
from service.protocol import unsent_bytes
from service.routes import UNMETERED_PATHS, is_v2_path, route_path
from service.serving.exchange import exchange_of
from service.serving.inflight import Holding, InflightBytes, memory_busy
from service.serving.offload import INLINE_MAX_BYTES
from service.wire.codec import occurrences
from service.wire.lengths import parse_length

MB: Final = 1e6
# What parsing a JSON body holds at its peak besides the body, per separator byte: the Python
# objects from_json builds and numpy's copies of them, measured by the growth of peak RSS while
# v1 and v2 bodies are prepared (bench/attack_bodies.py parse-peak; numpy 2.4, pydantic_core
# 2.50, CPython 3.11). An element (`,`): 48-49 bytes in v1 lists and in v2's flat data (a float
# object, its list slot, numpy's float64 and the float32 tensor). A container (`[` or `{`):
# 84-89 more (a one-number list, an empty list: the list object and its slot). A key (`:`):
# 101-103 with its comma (the key string and its dict slot). Rounded up.
ELEMENT_PEAK_BYTES: Final = 52
CONTAINER_PEAK_BYTES: Final = 88
KEY_PEAK_BYTES: Final = 56
_SEPARATORS: Final = (
    (ord(","), ELEMENT_PEAK_BYTES),
    (ord("["), CONTAINER_PEAK_BYTES),
    (ord("{"), CONTAINER_PEAK_BYTES),
    (ord(":"), KEY_PEAK_BYTES),
)
# Past its first INLINE_MAX_BYTES a body decodes off the loop, its big arrays of numbers parsed
# in pieces straight into numpy (service.wire.json_arrays): a number holds its float64 value and
# the tensor's copy, 12.7 bytes a ',' at most measured (bench/attack_decode.py decode-memory),
# and a '[' nothing. The envelope around the arrays (at most 16,384 values, whose '[' this
# counts at an element's cost) is parsed as before; so are keys.
PIECES_ELEMENT_PEAK_BYTES: Final = 16
_PIECES_SEPARATORS: Final = (
    (ord(","), PIECES_ELEMENT_PEAK_BYTES),
    (ord("["), PIECES_ELEMENT_PEAK_BYTES),
    (ord("{"), CONTAINER_PEAK_BYTES),
    (ord(":"), KEY_PEAK_BYTES),
)
# The first bytes of every body's estimate are not reserved: a request's envelope (its field
# names, shapes, options: about 2 KB of estimate for a base64 request) parses to a few
# kilobytes, and reserving it would refuse base64 bodies that exactly fill the limit.
ENVELOPE_BYTES: Final = 8 * 1024
V2_HEADER_LENGTH: Final = b"inference-header-content-length"
# How far ahead of what has arrived a declared body is held: a socket read and its buffers.
BODY_WINDOW: Final = 1024 * 1024
# A JSON string (a base64 tensor) becomes a Python str as long as itself, then its decoded bytes
# (3/4 of it): decoding a base64 body holds 1.75x its size beside the body (an 85 MiB body
# peaked 2.8x its size). The parse estimate is at least that share of the JSON read.
STRING_PEAK_RATIO: Final = 1.75

# cgroup v2, then v1: the memory the container may use ("max" or a huge number: no limit).
_CGROUP_LIMITS: Final = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def process_memory_limit() -> int:
    """The memory this process may use: its cgroup's limit, else the machine's RAM."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            return int(text)
    return physical


def default_inflight_bytes() -> int:
    """A quarter of the memory the process may use."""
    return process_memory_limit() // 4


def parse_estimate(chunk: bytes, *, offset: int = 0) -> int:
    """What parsing `chunk`, found at `offset` in a JSON body, will hold at its peak, from its
    separators: parsed whole within the body's first INLINE_MAX_BYTES, in pieces past them. A
    base64 chunk holds none, and costs four memchr passes (wire.codec.occurrences finds rare
    bytes one by one before it counts them)."""
    whole = min(len(chunk), max(0, INLINE_MAX_BYTES - offset))
    head = chunk if whole == len(chunk) else chunk[:whole]
    estimate = sum(cost * occurrences(head, separator) for separator, cost in _SEPARATORS)
    if whole < len(chunk):
        tail = chunk[whole:]
        estimate += sum(cost * occurrences(tail, sep) for sep, cost in _PIECES_SEPARATORS)
    return estimate


def json_prefix(scope: Scope) -> int | None:
    """How many leading bytes of the body are JSON: a v2 request's Inference-Header-Content-Length
    (the rest is binary data), else None (all of it). Not a number: None, and the route refuses
    the request once read."""
    if not is_v2_path(route_path(scope)):
        return None
    for name, value in scope["headers"]:
        if name == V2_HEADER_LENGTH:
            return parse_length(value)
    return None


class InflightBytesMiddleware:
    """503 for new requests, and for bodies mid-stream, while the requests in flight hold more
    than `max_bytes`. Each request's holding (service.serving.inflight.Holding) goes into its
    Exchange, where serving reserves the answer."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        max_body_bytes: int,
        metrics: Metrics | None = None,
        ledger: InflightBytes | None = None,
    ) -> None:
        """`ledger`: the application's (AppState.inflight), shared with the gRPC door; None:
        one of its own (a middleware alone, in a test)."""
        self.app = app
        self.max_bytes = max_bytes
        self.max_body_bytes = max_body_bytes  # SDPA_MAX_BODY_BYTES: no body reads past it
        self.metrics = metrics
        self.ledger = (
            ledger if ledger is not None else InflightBytes(max_bytes, unsent=unsent_bytes)
        )

    @property
    def held(self) -> int:
        """Bytes all requests in flight hold now, every door's."""
        return self.ledger.held

    @held.setter
    def held(self, value: int) -> None:
        self.ledger.held = value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in UNMETERED_PATHS:
            await self.app(scope, receive, send)
            return
        # A declared body that does not fit now is refused before any of it is read (module
        # docstring); one that fits holds what arrives, and a window ahead of it.
        declared = min(declared_length(scope) or 0, self.max_body_bytes)
        if declared > self.max_bytes:
            error: ServiceError = self.body_too_big(declared, declared=True)
            await service_error_response(error)(scope, receive, send)
            return
        if not self.ledger.fits(declared):
            error = self.busy(self.ledger.in_flight(declared))
            await service_error_response(error)(scope, receive, send)
            return

        holding = RequestHolding(self, declared=declared, json_bytes=json_prefix(scope))
        exchange_of(scope).holding = holding.holding

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                holding.arrived(message.get("body", b""))
            return message

        response_started = False

        async def counting_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            elif message["type"] == "http.response.body":
                holding.holding.handed_over(len(message.get("body", b"")))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        except ServiceError as exc:
            # A refusal raised from receive() reaches the route's body read, and the app's
            # ServiceError handler answers it; should it escape the app (a body read outside
            # the handlers), the client still gets its status, never a 500.
            if exc is not holding.refusal or response_started:
                raise
            await service_error_response(exc)(scope, receive, send)
        finally:
            holding.holding.release()

    def count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="inflight_bytes").inc()

    def busy(self, in_flight: int) -> MemoryBusy:
        self.count_refusal()
        return memory_busy(in_flight, self.max_bytes)

    def parse_too_big(self, body: int, parse: int) -> InvalidRequest:
        self.count_refusal()
        msg = (
            f"parsing this request's JSON would hold about {parse / MB:.3g} MB beside its "
            f"{body / MB:.3g} MB body (about {ELEMENT_PEAK_BYTES} bytes a number and "
            f"{CONTAINER_PEAK_BYTES} a list), above SDPA_MAX_INFLIGHT_BYTES = "
            f"{self.max_bytes / MB:.3g} MB for all requests together; send tensors as base64 "
            "(v2: binary data), or fewer elements per request"
        )
        return InvalidRequest(
            msg, errors=[FieldError(loc=("body",), msg=msg, type="inflight_limit")]
        )

    def body_too_big(self, nbytes: int, *, declared: bool) -> PayloadTooLarge:
        self.count_refusal()
        loc: tuple[str, ...] = ("header", "content-length") if declared else ("body",)
        what = (
            f"the body ({nbytes} bytes, Content-Length) is"
            if declared
            else f"the body passed {nbytes} bytes, which is"
        )
        msg = (
            f"{what} larger than SDPA_MAX_INFLIGHT_BYTES = {self.max_bytes} allows all "
            "requests together; split the request or send base64 tensors"
        )
        return PayloadTooLarge(msg, errors=[FieldError(loc=loc, msg=msg, type="inflight")])


class RequestHolding:
    """How one HTTP request's body grows its holding (service.serving.inflight.Holding): the
    body declared, or read if more, and the parse estimate of the JSON read so far (until the
    request is decoded). Every growth is checked; shrinking never is. Serving reserves the
    answer on the same holding, through the request's Exchange."""

    def __init__(
        self, limit: InflightBytesMiddleware, *, declared: int, json_bytes: int | None
    ) -> None:
        self.limit = limit
        self.declared = declared
        self.received = 0  # bytes of the body read
        self.json_left = json_bytes  # bytes of JSON still to scan (None: the whole body)
        self.json_scanned = 0  # of them, scanned (with json_left)
        self.estimate = 0  # the parse estimate of the JSON read so far
        self.refusal: ServiceError | None = None  # raised from receive(), once
        self.holding = Holding(
            limit.ledger,
            metrics=limit.metrics,
            holds="its body, inputs, results and encoded answer",
            advice='ask for base64, no weights, diagnostics other than "full", or fewer '
            "queries per request",
        )
        self.holding.body = self.body()
        self.holding.hold()

    def body(self) -> int:
        return max(self.received, min(self.declared, self.received + BODY_WINDOW))

    def parse(self) -> int:
        json_read = self.received if self.json_left is None else self.json_scanned
        strings = int(STRING_PEAK_RATIO * json_read)
        return max(0, max(self.estimate, strings) - ENVELOPE_BYTES)

    def arrived(self, chunk: bytes) -> None:
        """A chunk of the body was read: count it and what parsing it will hold. Raises the
        refusal when that would take the request, or all requests, past the limit."""
        if self.refusal is not None:
            raise self.refusal
        holding = self.holding
        self.received += len(chunk)
        if not holding.decoded:
            offset = self.received - len(chunk)
            if self.json_left is None:
                self.estimate += parse_estimate(chunk, offset=offset)
            elif self.json_left > 0:
                self.estimate += parse_estimate(chunk[: self.json_left], offset=offset)
                self.json_scanned += min(len(chunk), self.json_left)
                self.json_left = max(0, self.json_left - len(chunk))
        holding.body, holding.parse = self.body(), self.parse()
        growth = holding.total() - holding.counted
        if growth > 0:
            self.refusal = self._refusal(growth)
            if self.refusal is not None:
                raise self.refusal
        holding.hold()

    def _refusal(self, growth: int) -> ServiceError | None:
        limit, holding = self.limit, self.holding
        parse = 0 if holding.decoded else holding.parse
        if holding.body > limit.max_bytes:
            return limit.body_too_big(holding.body, declared=False)
        if holding.body + parse > limit.max_bytes:
            return limit.parse_too_big(holding.body, parse)
        if not limit.ledger.fits(growth):
            return limit.busy(limit.ledger.in_flight(growth))
        return None
