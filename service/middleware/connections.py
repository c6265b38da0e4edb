"""Limits at the protocol layer: what uvicorn's httptools protocol leaves unbounded below the
application, where ASGI middleware cannot see (it runs only once a request's headers are
complete). The service runs uvicorn with GuardedHttpToolsProtocol (`uvicorn.Config(http=...)`,
built by guarded_protocol() from the settings).

What uvicorn 0.54 with httptools 0.9 does on its own, checked in their code: it feeds every
byte it reads to the parser at once; the parser builds a header value with `bytes +=` across
reads (quadratic: a 64 MB value took 3.1 s of event-loop time) and uvicorn keeps every header
line, without limit; a read of pipelined requests is parsed whole, each request becoming a task's
worth of state at once, and reading resumes after every answer (GET /healthz pipelined and never
read grew a server to 4.96 GB); it arms no timer on a fresh connection nor while headers or a
body trickle in; its `limit_concurrency` answers 503 only once a request arrives on a
connection it already accepted. So this protocol keeps the bytes it reads and decides itself
what the parser may have:

- header bytes (SDPA_MAX_HEADER_BYTES, default 32 KiB): the request line and all header lines
  of one request, blank lines before it and the empty line that ends it included. The bytes of
  a request's head are held until a whole line is in, and the parser is fed whole lines (each
  header value reaches it in one piece: nothing is concatenated); a head that cannot end within
  the budget gets a 431 problem+json and the connection closes, before the parser saw more than
  the budget.
- header lines (SDPA_MAX_HEADERS, default 100): counted before they reach the parser; past
  the bound, 431 and the connection closes.
- a chunked body's trailer section has the same two bounds. Past one, nothing more of the
  connection is parsed; the app already holds the request, so its next receive() raises a 431
  (TrailersTooLarge), which the app answers as it answers its own refusals (its access log
  says 431), and the connection closes after that answer.
- a chunked body's framing: each chunk costs Python time here (reading where the body ends),
  whatever its size, and llhttp takes a size line of any length. A size line (hex digits,
  leading zeros, extensions, CRLF) past MAX_CHUNK_SIZE_LINE (4 KiB), and a body whose chunks
  past the first FREE_CHUNKS (1,024) bring under MIN_CHUNK_AVERAGE (64 bytes) of data each on
  average, get a 400 the same way (ChunksRefused, from the app's receive()). Before, a 240 KB
  read of 1-byte chunks held the event loop 131 ms (plain uvicorn: 23 ms), now 1 ms and
  refused; and 32 KiB/s of an endless extension held a connection and the app's request for
  ever. A body llhttp cannot frame (a size that is not hex, data without its CRLF, a
  Transfer-Encoding other than chunked) gets a 400 the same way (BadBodyFraming), uncounted.
- header deadline (SDPA_READ_TIMEOUT_S, default 15 s): a request's headers must be complete
  within it of their first byte, however steadily they trickle; else a 408 problem+json and the
  connection closes.
- idle read timeout (the same setting): while the server waits for a client's bytes (a fresh
  connection's first request, a body), every byte restarts a timer. When it fires on a fresh
  connection, the client gets a 408; mid-body (the app has the request) the connection closes
  and the app sees the disconnect (a 499 in the access log). While the app computes or answers,
  or while the server itself stopped reading, no read timer runs.
- minimum body rate (SDPA_MIN_BODY_RATE, default 32 KiB/s; 0 = none), as Apache
  mod_reqtimeout's body=...,MinRate=...: a body must arrive within SDPA_READ_TIMEOUT_S of the
  app's first read of it, extended by one second for every SDPA_MIN_BODY_RATE bytes it
  brought (of a chunked body, its chunks' data, not their framing); the time the server itself
  does not read (the app has not read what it was given, the request waits behind another)
  does not count. Past it the connection closes, as the idle timer does mid-body. Without it,
  a byte every few seconds held a connection whose request the app holds for ever, and the
  cap never closes those: 2,048 of them, about 205 B/s in all, locked everyone out; now that
  takes SDPA_MIN_BODY_RATE x SDPA_MAX_CONNECTIONS (64 MiB/s).
- an answer given before its request's body was read (an early 413, 401 or 503): the rest of
  that body is never parsed, nor anything after it. The answer is written and the sending
  side closed, what the client still sends is read and dropped for linger_s (2 s) at most, and
  the connection closes (RFC 9112 section 9.6). uvicorn reads on, dropping the body as it comes,
  for as long as a client sends a byte now and then.
- Upgrade (h2c, websocket) and CONNECT requests: llhttp ends one at its head and never
  delivers its body. Without a body it is answered as a plain request (the service speaks
  HTTP/1.1 only) with Connection: close, and nothing after its head is parsed; with a body
  (Content-Length or Transfer-Encoding) it gets a 400 before the app sees it, and the
  connection closes: the app would have answered it without its body, and the body was parsed
  as the next request (request smuggling behind a proxy that forwards Upgrade).
- pipelining (SDPA_MAX_PIPELINED_REQUESTS, default 8): at most that many requests of one
  connection parsed and unanswered. The parser is fed one request's head at a time and a body
  only up to its end (Content-Length, or the chunked framing read here), so it never parses
  ahead; beyond the bound the server holds the bytes it read and stops reading the connection
  (backpressure: no queue, no 4xx), and feeds the next request as answers complete. Each such
  pause counts in sdpa_connection_reads_paused_total. A request's body is fed only while the
  app has read what it was given before (uvicorn's 64 KiB high-water mark), so the body of a
  request waiting behind another does not grow either. A pipelined request refused at its
  head (431, 408, an upgrade with a body, unparsable) while answers before it are pending is
  answered after them, in order (RFC 9112 section 9.3.2), and nothing more is read meanwhile.
  Any refusal on a connection that answered before lingers as an early answer does: the
  answers may still sit in the kernel's send queue, and a close with the client's bytes unread
  resets the connection and drops them. A head under way when an answer completes is bounded
  by its deadline, not uvicorn's keep-alive timer (which closed it mid-head).
- send timeout (SDPA_SEND_TIMEOUT_S, default 60 s): when the client stops reading and the write
  buffer passes its high-water mark, a timer starts; it stops when the client reads again. When
  it fires, the connection is aborted and the pending response freed.
- connection cap (SDPA_MAX_CONNECTIONS, default 2048): a connection beyond it closes the one
  doing no useful work to make room: the one whose request headers have been incomplete the
  longest (a connection that sent nothing yet counts from its start) gets a 408, else the one
  idle the longest between keep-alive requests gets a 503 with Retry-After. A connection whose
  request the app holds (its body being read, computed, answered) is never closed for it. Only
  when every connection is busy does the newcomer get a 503 with Retry-After, before any
  request is read. A slowloris client thus holds its connections only until others need them.
  A connection answered early and lingering goes first of all, without a word. The candidates
  of each kind are kept in arrival order as their state changes, so a newcomer at the cap
  costs the event loop the same whatever the cap (a scan of every connection took 4.4 ms per
  newcomer at 2,048 connections).
- shutdown: when uvicorn shuts down (after the drain), a connection with no request in the app
  is not closed at once, since its client may be sending a request right then, which would be
  lost unanswered: it gets `shutdown_idle_grace_s` (0.5 s) for a request's headers to complete,
  which is then answered (with `Connection: close`); otherwise it closes (a 503 if a request's
  headers were under way). A connection with a request in the app closes after that answer;
  requests pipelined behind it are not read.
- delivery: an answer handed to a client that reads slower than the server writes is not yet
  delivered. Each request's scope carries, as the ASGI extension DELIVERY_EXTENSION, an awaitable
  that tells whether its answer reached the client (the access log logs 499 when it did not:
  the client left, or the send timeout dropped it, while its answer was being sent).

Refusals count in sdpa_rejected_total by reason: header_too_large (431, trailers included),
header_timeout (408 at the header deadline), read_timeout (the idle timer), body_too_slow (the
minimum body rate), chunk_framing (400: a chunked body's framing), connections (the cap: a
connection closed to make room, or a newcomer refused).

Why this layer and not uvicorn's h11 protocol with its limit (h11_max_incomplete_event_size):
h11 bounds a head's bytes (a 400, no metric) and parses one request at a time, but counts no
header lines, has no header deadline, no read or send timeout and no cap, which would all have
to be added to it as they are here; and its pure-Python parsing served small requests about 7%
slower than this layer in the same run (bench/attack_protocol.py's figures, issue 23's note).

The uvicorn and httptools behaviour this relies on, private attributes included, is exercised
by tests/service/test_protocol_contract.py; pyproject.toml pins the versions it was checked on.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, Final

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from service.errors import PROBLEM_JSON, ServiceError, problem_payload
from service.wire.lengths import parse_length

if TYPE_CHECKING:
    from uvicorn._types import ASGIReceiveEvent, ASGISendEvent

    from service.metrics import Metrics

logger = logging.getLogger("sdpa.connections")


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
# connection reached its client. It waits while the client reads slower than the server writes
# (bounded by the send timeout) and is False when the connection was lost with bytes unsent.
DELIVERY_EXTENSION: Final = "sdpa.delivery"
Delivery = Callable[[], Awaitable[bool]]

# The connections whose client reads slower than the server writes (write buffer past its
# high-water mark): their unsent answers are memory the in-flight limit must count.
_backed_up: set[GuardedHttpToolsProtocol] = set()


# time.monotonic() of the latest accepted connection or request start, on any connection: the
# server waits for a quiet moment before it closes its listener (service.server).
_last_activity = 0.0


def last_activity() -> float:
    """time.monotonic() when a connection was last accepted or a request last began."""
    return _last_activity


def _touch() -> None:
    global _last_activity
    _last_activity = time.monotonic()


def unsent_bytes() -> int:
    """Bytes of answers handed over but not yet taken by their clients (write buffers)."""
    return sum(protocol.transport.get_write_buffer_size() for protocol in _backed_up)


# -- framing: where a request's head and body end -----------------------------------------

_HEAD_END: Final = b"\r\n\r\n"
# CR and LF before a request line are skipped by the parser (llhttp); skipped here as well, the
# first "\r\n\r\n" of a head is its end.
_NOT_CRLF: Final = re.compile(rb"[^\r\n]")
# The parser is fed whole lines of a head, but the first bytes of its request line (up to
# this many) as they come, so that what is not HTTP (a TLS handshake on the plain port) gets
# its 400 without waiting for a line end.
REQUEST_LINE_PROBE: Final = 16
_HEX_PREFIX: Final = re.compile(rb"[0-9A-Fa-f]*")
# A whole size line of up to 16 digits and no extension, as clients send it: read in one match
# (C) instead of byte by byte in Python.
_WHOLE_SIZE_LINE: Final = re.compile(rb"([0-9A-Fa-f]{1,16})\r\n")
# A chunk-size line (hex digits, extensions, CRLF) longer than this is refused: llhttp takes
# leading zeros and an extension without end, which held a connection for ever as "body" that
# never brought the app a byte. A size line a client sends is a few bytes.
MAX_CHUNK_SIZE_LINE: Final = 4096
# Each chunk costs Python time here (about 1 us on the fast path, 2-3 us otherwise) whatever
# its size; a body of 1-byte chunks held the event loop 147 ms per 240 KB read (plain uvicorn:
# 24.5 ms). The first FREE_CHUNKS chunks are free; the data of the chunks past them must
# average MIN_CHUNK_AVERAGE bytes, which bounds that time per byte read (about 16 ns a byte, 2 s
# of a core for a 128 MiB body). A client streaming a file sends chunks of KiBs; one that sends
# each piece of a generator as a chunk (httpx, requests and aiohttp do) must join small pieces.
FREE_CHUNKS: Final = 1024
MIN_CHUNK_AVERAGE: Final = 64


class ChunkedBodyEnd:
    """Reads the framing of a chunked request body (RFC 9112 section 7.1) in the bytes that
    follow its head, to tell where it ends: the parser is fed no byte past it.

    Only the framing is read (size lines, data lengths, the trailer section); the parser
    validates everything. On input it refuses, the parser's error closes the connection before
    this count matters. Trailer lines are released whole (a value arrives in one piece) and
    counted, in bytes and lines, so that the protocol bounds them like a head's. It refuses
    (`refused`, and takes no more) a size line past MAX_CHUNK_SIZE_LINE and chunks too small
    on average (FREE_CHUNKS, MIN_CHUNK_AVERAGE); `data_bytes` counts the chunks' data alone,
    which is what the body's minimum rate credits.
    """

    _SIZE_LINE, _DATA, _TRAILERS = range(3)
    SIZE_LINE_TOO_LONG: Final = "size_line"
    CHUNKS_TOO_SMALL: Final = "small_chunks"

    def __init__(self) -> None:
        self._state = self._SIZE_LINE
        self._left = 0  # bytes of the current chunk's data and its CRLF still to come
        self._digits = bytearray()  # the size line's hex digits, leading zeros left out
        self._in_digits = True  # no other byte of the size line seen yet
        self._line = 0  # bytes of the current size line taken
        self._scanned = 0  # bytes of a held partial trailer line known to hold no line end
        self.chunks = 0  # non-final chunks begun
        self._declared = 0  # their sizes, summed
        self.data_bytes = 0  # chunk data taken (no framing)
        self.trailer_bytes = 0
        self.trailer_lines = 0
        self.done = False
        self.refused: str | None = None

    def take(self, buf: bytes | bytearray, start: int, end: int) -> int:
        """How many bytes of buf[start:end] the parser may have: up to the body's end, and in
        the trailer section up to the last complete line; none past a refusal."""
        pos = start
        while pos < end and not self.done and self.refused is None:
            if self._state == self._DATA:
                left = self._left
                step = min(left, end - pos)
                if left > 2:
                    self.data_bytes += min(step, left - 2)  # not its CRLF
                self._left = left - step
                pos += step
                if not self._left:
                    self._state = self._SIZE_LINE
                continue
            if self._state == self._TRAILERS:
                # A partial line is held and searched again with more bytes: only these are.
                newline = buf.find(b"\n", pos + self._scanned, end)
                if newline < 0:
                    self._scanned = end - pos
                    break  # a partial trailer line waits for the rest of it
                self._scanned = 0
                line = newline + 1 - pos
                self.trailer_bytes += line
                pos = newline + 1
                self.done = line == 2  # the empty line (CRLF) that ends the section
                self.trailer_lines += not self.done
                continue
            if not self._line:
                pos = self._take_whole_chunks(buf, pos, end)
                if self._state != self._SIZE_LINE or pos == end or self.refused is not None:
                    continue
            newline = buf.find(b"\n", pos, end)
            line_end = end if newline < 0 else newline + 1
            self._line += line_end - pos
            if self._line > MAX_CHUNK_SIZE_LINE:
                self.refused = self.SIZE_LINE_TOO_LONG
                break
            if self._in_digits:  # what follows them (an extension) is the parser's alone
                run = _HEX_PREFIX.match(buf, pos, line_end)
                digits = run[0] if run else b""
                self._in_digits = run is not None and run.end() == line_end
                if not self._digits:
                    digits = digits.lstrip(b"0")
                # More than 16 digits overflow 64 bits, which the parser refuses.
                self._digits += digits[: 17 - len(self._digits)]
            pos = line_end
            if newline >= 0:
                size = int(self._digits or b"0", 16)
                self._digits.clear()
                self._in_digits = True
                self._end_size_line(size)
        return pos - start

    def _take_whole_chunks(self, buf: bytes | bytearray, pos: int, end: int) -> int:
        """The fast path, from the start of a size line: chunks whose size line is whole and
        plain, in a loop of locals (1-byte chunks cost 2.6 us each through take's general
        loop); where the first size line is not so, nothing is taken."""
        chunks, declared, data = self.chunks, self._declared, 0
        while True:
            whole = _WHOLE_SIZE_LINE.match(buf, pos, end)
            if whole is None:
                break
            size = int(whole[1], 16)
            pos = whole.end()
            if not size:
                self._state = self._TRAILERS
                break
            chunks += 1
            declared += size
            if declared < (chunks - FREE_CHUNKS) * MIN_CHUNK_AVERAGE:
                self.refused = self.CHUNKS_TOO_SMALL
                break
            if end - pos < size + 2:  # the data (and its CRLF) goes on in a later read
                data += min(size, end - pos)
                self._state, self._left = self._DATA, size + 2 - (end - pos)
                pos = end
                break
            data += size
            pos += size + 2
        self.chunks, self._declared = chunks, declared
        self.data_bytes += data
        return pos

    def _end_size_line(self, size: int) -> None:
        self._line = 0
        if not size:
            self._state = self._TRAILERS
            return
        self._state, self._left = self._DATA, size + 2  # data, then CRLF
        self.chunks += 1
        self._declared += size
        if self._declared < (self.chunks - FREE_CHUNKS) * MIN_CHUNK_AVERAGE:
            self.refused = self.CHUNKS_TOO_SMALL


def is_chunked(transfer_encoding: bytes) -> bool:
    """Whether a request with this Transfer-Encoding has a chunked body (its last coding)."""
    return transfer_encoding.rsplit(b",", 1)[-1].strip().lower() == b"chunked"


class _ProtocolFlow(FlowControl):
    """uvicorn's FlowControl (which the protocol and each request's cycle share), with reading
    left to the protocol: uvicorn pauses reading when it queues a pipelined request or a body
    passes its high-water mark, and resumes it when an answer completes or the app reads its
    body. The protocol holds the bytes it should not parse yet instead (and pauses reading
    itself), so a pause request is moot and a resume is the cue to feed the parser again."""

    def __init__(self, transport: asyncio.Transport, on_resume: Callable[[], None]) -> None:
        super().__init__(transport)
        self._on_resume = on_resume

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        self._on_resume()


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


class _Evictable:
    """The connections of one server that the cap may close, each kind in a dict ordered from
    the longest-waiting: a connection is appended when it becomes evictable (or its head
    starts) and removed when it stops being so, so that the cap finds its victim at once
    instead of scanning every connection (4.4 ms per newcomer at 2,048 connections did)."""

    def __init__(self) -> None:
        # OrderedDict, not dict: a dict's first key is found past the holes its deleted keys
        # left at the front (linear in them until it is resized); an OrderedDict's is linked.
        # Answered before their body was read, or refused after answers, lingering until the
        # client has read the answer.
        self.answered: collections.OrderedDict[GuardedHttpToolsProtocol, None] = (
            collections.OrderedDict()
        )
        # A request's headers incomplete, or none sent yet on a fresh connection.
        self.heads: collections.OrderedDict[GuardedHttpToolsProtocol, None] = (
            collections.OrderedDict()
        )
        # Idle between keep-alive requests.
        self.idle: collections.OrderedDict[GuardedHttpToolsProtocol, None] = (
            collections.OrderedDict()
        )
        # Closed by us but still among the server's connections (connection_lost comes on a
        # later loop turn): they no longer count against the cap.
        self.closing = 0

    def oldest(self) -> GuardedHttpToolsProtocol | None:
        """The connection the cap closes first: answered, then the longest with incomplete
        headers, then the longest idle."""
        for kind in (self.answered, self.heads, self.idle):
            if kind:
                return next(iter(kind))
        return None


# One table per server (uvicorn's ServerState holds its connections).
_evictable: weakref.WeakKeyDictionary[ServerState, _Evictable] = weakref.WeakKeyDictionary()


def _evictable_of(server_state: ServerState) -> _Evictable:
    table = _evictable.get(server_state)
    if table is None:
        table = _evictable[server_state] = _Evictable()
    return table


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds on headers, pipelining, reading, sending and
    connections (the module docstring). Configure it with guarded_protocol()."""

    read_timeout_s: ClassVar[float] = 15.0
    send_timeout_s: ClassVar[float] = 60.0
    max_connections: ClassVar[int] = 2048
    max_header_bytes: ClassVar[int] = 32 * 1024
    max_headers: ClassVar[int] = 100
    max_pipelined_requests: ClassVar[int] = 8
    min_body_rate: ClassVar[int] = 32 * 1024
    shutdown_idle_grace_s: ClassVar[float] = 0.5
    # After an answer given before its request's body was read, or a refusal on a connection
    # that answered before: how long what the client still sends is read and dropped, the
    # answer written and the sending side closed, before the connection closes (closing at
    # once, with the client's bytes unread, would reset the connection, and a client still
    # sending could lose the answer, or the answers before it still in the kernel's queue).
    linger_s: ClassVar[float] = 2.0
    metrics: ClassVar[Metrics | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        # Set when the connection was lost before its last answer was complete and written out.
        self._lost_undelivered = False
        self._delivery_waiters: set[asyncio.Future[bool]] = set()
        self._shutting_down = False

        # Input: bytes read and not yet fed to the parser, and whether the transport reads.
        self._held = bytearray()
        self._reading = True
        self._blocked = False  # the pump stopped at a bound, not for want of bytes
        self._pump_soon: asyncio.Handle | None = None
        # The current request, from the parser's point of view.
        self._in_body = False  # headers complete, message not
        self._head_since: float | None = None  # monotonic time of the head's first byte
        self._head_bytes = 0  # bytes of the head taken (fed or skipped)
        self._head_fed = 0  # of which fed to the parser
        self._head_tail = b""  # the last (up to 3) bytes fed: "\r\n\r\n" may span two reads
        self._head_scanned = 0  # held bytes of the head known to hold no line end
        self._head_lines = 0  # line ends fed: the request line's, then one per header line
        # How the current request's body ends, read from its headers: the bytes of a
        # Content-Length body the parser may still have, or a chunked framing.
        self._body_left = 0
        self._chunked: ChunkedBodyEnd | None = None
        self._transfer_coded = False  # the request has a Transfer-Encoding (chunked or not)
        # Requests parsed and not yet answered (the pipelining bound), and idleness (the cap).
        # Oldest first: the one the app answers now, then those waiting behind it.
        self._unanswered: collections.deque[RequestResponseCycle] = collections.deque()
        self._answered_any = False
        self._idle_since = time.monotonic()
        # Nothing more is parsed on this connection (after an upgrade request, a refused
        # trailer section, an answer given before its body was read), and the answer to such
        # a request is written, its sending side closed, until linger_s passes.
        self._input_closed = False
        self._lingering = False
        # The body's minimum rate (min_body_rate): its bytes taken, and its clock, which runs
        # once the app asked for the body and only while the server reads the connection.
        self._body_bytes = 0
        self._body_asked = False
        self._body_spent_s = 0.0  # running time before _body_running_since
        self._body_running_since: float | None = None
        # A trailer section past its bound: the request whose receive() raises it.
        self._refusal: tuple[RequestResponseCycle, ServiceError] | None = None
        self._head_refused = False  # an upgrade request with a body (400): no cycle was made
        # A refusal of a request pipelined behind others, written once their answers are
        # (_after_answers).
        self._deferred: Callable[[], None] | None = None
        # Where the connection cap finds this connection (_Evictable), if anywhere.
        self._evictable = _evictable_of(self.server_state)
        self._filed: collections.OrderedDict[GuardedHttpToolsProtocol, None] | None = None
        self._closing_counted = False
        self._head_started = False  # a head started in the read being fed: file it anew

    # -- the connection cap and the first read timer --------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _ProtocolFlow(transport, self._on_app_read)
        _touch()
        if len(self.connections) > self.max_connections and not self._make_room():
            detail = (
                f"the server holds its maximum of {self.max_connections} connections "
                "(SDPA_MAX_CONNECTIONS), each with a request in progress; retry later"
            )
            self._count("connections")
            transport.write(problem_bytes(503, "Service Unavailable", detail, retry_after_s=1))
            self._close()
            return
        self._refile()
        self._arm_read_timer()  # the first request's bytes

    def _make_room(self) -> bool:
        """At the cap: close the connection doing the least useful work; False if every one
        has a request in the app. O(1): the candidates are kept in order (_Evictable)."""
        table = self._evictable
        # This connection is among them; those closing no longer count.
        while len(self.connections) - table.closing > self.max_connections:
            victim = table.oldest()
            if victim is None:
                return False
            if victim.transport.is_closing():
                victim._count_closing()  # closed by uvicorn, where we did not see it
                continue
            victim._evict()
        return True

    def _evictable_kind(self) -> collections.OrderedDict[GuardedHttpToolsProtocol, None] | None:
        """Where the cap finds this connection now: answered (lingering), headers incomplete
        (or none yet on a fresh connection), idle between keep-alive requests; None while the
        app holds a request of it or it is closing."""
        if self._closing_counted:
            return None
        table = self._evictable
        if self._lingering:
            return table.answered
        if self._unanswered or self._in_body:
            return None
        if self._head_since is not None or not self._answered_any:
            return table.heads
        return table.idle

    def _refile(self, *, anew: bool = False) -> None:
        """File this connection where the cap finds it, at the end (the newest) when it moves
        there or `anew` (a head started: its wait starts now)."""
        kind = self._evictable_kind()
        if kind is self._filed and not anew:
            return
        if self._filed is not None:
            del self._filed[self]
        self._filed = kind
        if kind is not None:
            kind[self] = None

    def _unfile(self) -> None:
        if self._filed is not None:
            del self._filed[self]
            self._filed = None

    def _close(self) -> None:
        """Close the connection (flushing what was written), no longer counted at the cap."""
        self.transport.close()
        self._count_closing()

    def _count_closing(self) -> None:
        if not self._closing_counted:
            self._closing_counted = True
            self._evictable.closing += 1
            self._refile()

    def _evict(self) -> None:
        self._count("connections")
        if self._lingering:  # its answer was written: nothing more to say
            self._close()
            return
        held_for = time.monotonic() - (self._head_since or self._idle_since)
        if self._head_since is not None or not self._answered_any:
            detail = (
                f"this connection's request headers were incomplete after {held_for:.1f} s while "
                f"the server held its maximum of {self.max_connections} connections "
                "(SDPA_MAX_CONNECTIONS): it was closed to admit another; send a request's "
                "headers at once"
            )
            self._close_with(problem_bytes(408, "Request Timeout", detail), at_once=True)
        else:
            detail = (
                f"this connection was idle for {held_for:.1f} s while the server held its "
                f"maximum of {self.max_connections} connections (SDPA_MAX_CONNECTIONS): it was "
                "closed to admit another; retry on a new connection"
            )
            self._close_with(
                problem_bytes(503, "Service Unavailable", detail, retry_after_s=1), at_once=True
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        self._cancel_send_timer()
        self._cancel_head_timer()
        self._stop_body_clock()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self._pump_soon is not None:
            self._pump_soon.cancel()
        self._held = bytearray()
        if self._closing_counted:
            self._evictable.closing -= 1
        self._closing_counted = True  # gone: filed nowhere, counted nowhere
        self._refile()
        # Backed up: bytes were still waiting for the client (an abort drops them silently).
        self._lost_undelivered = self in _backed_up or (
            self.cycle is not None and not self.cycle.response_complete
        )
        _backed_up.discard(self)
        self._settle_delivery(not self._lost_undelivered)
        super().connection_lost(exc)
        # uvicorn 0.54 tells only the latest request parsed (self.cycle) that its client left:
        # one answered before it, behind which it was pipelined, would write on to the closed
        # transport, which uvloop 0.23 refuses with a RuntimeError (a traceback in the log).
        for cycle in self._unanswered:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()  # closes an idle keep-alive connection
        self._count_closing()

    # -- reading: what the parser may have ---------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._input_closed:
            return  # never parsed (reading is paused, or the connection lingers: dropped)
        self._unset_keepalive_if_required()  # as uvicorn's data_received
        if self._read_timer is not None:
            self._arm_read_timer()  # any byte restarts the wait for the next one
        if self._held:
            self._held += data
            taken = self._pump(self._held)
            del self._held[:taken]
        else:
            taken = self._pump(data)
            if taken < len(data):
                self._held += memoryview(data)[taken:]
        self._settle()

    def _on_app_read(self) -> None:
        """uvicorn resumes reading: an app asked for its body (receive()), or an answer
        completed. The body's clock starts at its own app's first read of it (a client that
        expects 100-continue sends nothing before), and the held bytes are fed (soon, not from
        inside uvicorn). A receive() of an earlier request's app (the disconnect watch while
        it computes) resumes the same flow: a request pipelined behind it, whose app has not
        started, is not the oldest unanswered, and its clock waits for its turn."""
        unanswered = self._unanswered
        if self._in_body and not self._body_asked and unanswered and unanswered[0] is self.cycle:
            self._body_asked = True
            self._sync_body_clock()
        if self._pump_soon is None and self._held:
            self._pump_soon = self.loop.call_soon(self._pump_held)

    def _schedule_pump(self) -> None:
        """An answer completed or the app read its body: feed the held bytes (soon, not from
        inside uvicorn's callback)."""
        if self._pump_soon is None and self._held:
            self._pump_soon = self.loop.call_soon(self._pump_held)

    def _pump_held(self) -> None:
        self._pump_soon = None
        if self._held and not self.transport.is_closing() and not self._input_closed:
            del self._held[: self._pump(self._held)]
            self._settle()

    def _pump(self, buf: bytes | bytearray) -> int:
        """Feed the parser what it may have of buf now; return how many bytes it took."""
        pos, end = 0, len(buf)
        self._blocked = False
        while pos < end and not self.transport.is_closing() and not self._input_closed:
            if self._in_body:
                cycle = self.cycle
                if len(cycle.body) > HIGH_WATER_LIMIT and not cycle.response_complete:
                    # The app has not read what it was given (it asks again by receive()).
                    self._blocked = True
                    break
                taken = self._body_step(buf, pos, end)
            elif self._may_start_request():
                taken = self._head_step(buf, pos, end)
            else:
                self._blocked = True
                break
            if not taken:
                break
            pos += taken
        return pos

    def _may_start_request(self) -> bool:
        if self._head_since is not None:
            return True  # under way: the bounds were checked when it began
        if self._input_closed:
            return False
        if len(self._unanswered) >= self.max_pipelined_requests:
            return False
        return not (self._shutting_down and self._unanswered)

    def _head_step(self, buf: bytes | bytearray, pos: int, end: int) -> int:
        """Take what the parser may have of the current request's head from buf[pos:end]."""
        start = pos
        if self._head_since is None:  # its first byte
            self._head_since = time.monotonic()
            self._unset_keepalive_if_required()
            # Its headers' wait starts now: filed anew by _settle, once this read is fed, if
            # they are still incomplete then (most heads end in the read they start in).
            self._head_started = True
        if not self._head_fed and not self._head_scanned and buf[pos] in b"\r\n":
            first = _NOT_CRLF.search(buf, pos, end)
            pos = end if first is None else first.start()
            self._head_bytes += pos - start
            if self._head_bytes >= self.max_header_bytes:
                self._refuse_header_bytes()
                return end - start
            if first is None:
                return pos - start
        # Bytes held from an earlier read were searched then: only the new ones are (a line
        # trickled a byte at a time costs linear time, not quadratic).
        scan = pos + self._head_scanned
        head_end = self._find_head_end(buf, pos, scan, end)
        if head_end is not None:
            if self._head_bytes + (head_end - pos) > self.max_header_bytes:
                self._refuse_header_bytes()
                return end - start
            self._feed_head(buf, pos, head_end, complete=True)
            return head_end - start
        last_line = buf.rfind(b"\n", scan, end)
        if self._head_bytes + (end - pos) >= self.max_header_bytes:
            # It cannot end within the budget. Its whole lines go to the parser first, so that
            # what is not HTTP at all gets the parser's 400 instead.
            if last_line < 0 or self._feed_head(buf, pos, last_line + 1, complete=False):
                self._refuse_header_bytes()
            return end - start
        if last_line >= 0:
            stop = last_line + 1
        elif not self._head_fed:
            stop = min(end, pos + REQUEST_LINE_PROBE)
        else:
            self._head_scanned = end - pos
            return pos - start  # the rest of a line: wait for its end
        self._feed_head(buf, pos, stop, complete=False)
        self._head_scanned = end - stop  # no line end after `stop`
        return stop - start

    def _find_head_end(self, buf: bytes | bytearray, pos: int, scan: int, end: int) -> int | None:
        """Where the head ends in buf[pos:end] (just after its "\\r\\n\\r\\n"), or None; the
        bytes before `scan` hold no line end."""
        if self._head_tail:
            joined = self._head_tail + bytes(buf[pos : min(end, pos + 3)])
            found = joined.find(_HEAD_END)
            if found >= 0:
                return pos + found + 4 - len(self._head_tail)
        found = buf.find(_HEAD_END, max(pos, scan - 3), end)
        return None if found < 0 else found + 4

    def _feed_head(self, buf: bytes | bytearray, pos: int, stop: int, *, complete: bool) -> bool:
        """Feed whole lines of the head (or the first bytes of its request line): counted
        first, so that past SDPA_MAX_HEADERS the parser gets none of them."""
        self._head_lines += buf.count(b"\n", pos, stop)
        # Neither the request line nor the empty line that ends a complete head is a header.
        if self._head_lines - 1 - complete > self.max_headers:
            self._refuse_header_lines()
            return False
        self._head_scanned = 0
        self._head_bytes += stop - pos
        self._head_fed += stop - pos
        self._head_tail = (self._head_tail + bytes(buf[max(pos, stop - 3) : stop]))[-3:]
        return self._feed(buf, pos, stop)

    def _body_step(self, buf: bytes | bytearray, pos: int, end: int) -> int:
        """Feed the parser the current request's body from buf[pos:end], up to its end."""
        chunked = self._chunked
        if chunked is not None:
            data_before = chunked.data_bytes
            taken = chunked.take(buf, pos, end)
            if chunked.refused is not None:
                self._refuse_chunks(chunked.refused)
                return end - pos
            if chunked.trailer_lines > self.max_headers:
                self._refuse_trailers(
                    f"the request's trailer section has more than {self.max_headers} lines "
                    "(SDPA_MAX_HEADERS); send fewer trailer fields"
                )
                return end - pos
            if chunked.trailer_bytes > self.max_header_bytes or (
                not taken and chunked.trailer_bytes + end - pos >= self.max_header_bytes
            ):
                self._refuse_trailers(
                    f"the request's trailer section exceeds {self.max_header_bytes} bytes "
                    "(SDPA_MAX_HEADER_BYTES); send fewer or shorter trailer fields"
                )
                return end - pos
            done = chunked.done
            # Only data is progress (the minimum rate): framing (size lines, extensions, leading
            # zeros) brought the app nothing.
            self._body_bytes += chunked.data_bytes - data_before
        else:
            taken = min(self._body_left, end - pos)
            self._body_left -= taken
            done = not self._body_left
            self._body_bytes += taken
        if taken and not self._feed(buf, pos, pos + taken):
            return end - pos
        if done == self._in_body:
            # The parser and this framing disagree on where the body ends (never seen: a
            # guard): the next request's bytes cannot be told apart, so stop here.
            logger.error("request framing lost; closing the connection")
            self._close()
            return end - pos
        return taken

    def _feed(self, buf: bytes | bytearray, pos: int, stop: int) -> bool:
        """Feed buf[pos:stop] to the parser (uvicorn's data_received, a slice at a time);
        False once the connection is closing."""
        whole = pos == 0 and stop == len(buf) and isinstance(buf, bytes)
        data = buf if whole else memoryview(buf)[pos:stop]
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._parser_error(error)
        except httptools.HttpParserUpgrade:
            # An Upgrade (h2c, websocket) or CONNECT request, which llhttp ends at its head
            # (on_headers_complete took care of it): nothing after it is parsed.
            pass
        finally:
            if isinstance(data, memoryview):
                data.release()  # a bytearray cannot grow while a view of it lives
        # Closed, or refused behind answers still pending (_after_answers): parse no more.
        return not self.transport.is_closing() and not self._input_closed

    def _parser_error(self, error: httptools.HttpParserError) -> None:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        if self._in_body and self._transfer_coded:
            # Its body is malformed (its chunk framing, a Transfer-Encoding llhttp cannot
            # read): the app holds that request, and answers it from its body's read, in its
            # turn. Deferred like a refused head instead, it waited for its own answer, which
            # never came: the app waited for a body never fed, and the connection was held
            # for ever.
            detail = (
                f"the request's body is not valid HTTP/1.1 framing ({error}); send it with a "
                "Content-Length, or as chunks of hex sizes, with no other Transfer-Encoding"
            )
            self._refuse_body(None, BadBodyFraming(detail))
            return
        if self._unanswered and not self._in_body:  # a head behind answers still pending
            self._after_answers(
                lambda: self._write_and_linger(problem_bytes(400, "Bad Request", msg))
            )
            return
        # (An error inside a body without a Transfer-Encoding, which llhttp reads as opaque
        # bytes, is not expected: 400 and close, every request unanswered told it is gone.)
        self._send_400(msg)

    def _send_400(self, msg: str) -> None:
        self.send_400_response(msg)  # and closes
        self._count_closing()

    def _settle(self) -> None:
        """After the parser was fed: read while it may have more, else hold and pause; run
        the one timer that fits what the connection waits for (and the body's clock); and file
        a head that started and is still incomplete where the cap finds it."""
        if self.transport.is_closing() or self._lingering:
            return
        if self._head_started:
            self._head_started = False
            if self._head_since is not None:
                self._refile(anew=True)
        if self._input_closed:
            self._held = bytearray()  # never parsed
        blocked = self._input_closed or (self._blocked and bool(self._held))
        if blocked and self._reading:
            self._reading = False
            self.transport.pause_reading()
            if not self._in_body and len(self._unanswered) >= self.max_pipelined_requests:
                self._count_pause()
        elif not blocked and not self._reading:
            self._reading = True
            self.transport.resume_reading()
        if self._in_body or self._body_running_since is not None:
            self._sync_body_clock()
        if not self._reading:
            self._cancel_read_timer()  # the client owes nothing while the server does not read
            return
        if self._head_since is not None and not self._in_body:
            self._cancel_read_timer()  # the head's deadline comes first
            if self._head_timer is None:
                self._head_timer = self.loop.call_at(
                    self._head_since + self.read_timeout_s, self._on_head_deadline
                )
        elif self._in_body or (not self._unanswered and not self._answered_any):
            if self._read_timer is None:
                self._arm_read_timer()
        else:
            self._cancel_read_timer()  # answers pending, or idle: uvicorn's keep-alive timer

    # -- the parser's callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # uvicorn types extensions' values as dicts; ASGI lets a server put any object there.
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
        extensions[DELIVERY_EXTENSION] = self.delivered
        _touch()

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self._frame_body()
        upgrade = self.parser.should_upgrade()
        if upgrade and (self._chunked is not None or self._body_left):
            self._refuse_upgrade_with_body()
            return
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not previous:
            self._unanswered.append(cycle)
        self._in_body = True  # until on_message_complete, in this very call when bodiless
        self._body_bytes, self._body_asked, self._body_spent_s = 0, False, 0.0
        if self._transfer_coded:
            # Its framing may be refused after the app has the request (its chunk rules, its
            # trailer section's bound, a coding llhttp cannot read): its body read says so.
            cycle.receive = self._refusable_receive(cycle)  # type: ignore[method-assign]
        if self._transfer_coded or self._body_left:
            cycle.send = self._send_saying_close(cycle)  # type: ignore[method-assign, assignment]
        if upgrade:
            # An Upgrade (h2c, websocket) or CONNECT request without a body: the service speaks
            # HTTP/1.1 only (serve() runs uvicorn with ws="none") and answers it as a plain
            # request, then closes: what follows its head is the protocol it asked for, or a
            # request smuggled past a proxy that took it for one, and is never parsed.
            cycle.keep_alive = False
            self._input_closed = True
        if self._shutting_down:
            cycle.keep_alive = False  # answered, then closed
        self._unfile()  # the app holds a request of it now

    def _frame_body(self) -> None:
        """Read how the current request's body ends from its headers (uvicorn's list, names in
        lower case)."""
        self._chunked, self._body_left, self._transfer_coded = None, 0, False
        for name, value in self.headers:
            if name == b"transfer-encoding":
                self._transfer_coded = True
                if is_chunked(value):
                    self._chunked = ChunkedBodyEnd()
            elif name == b"content-length":
                # Past 18 digits it reads as 10**18 bytes: a body that no stream ends either.
                self._body_left = parse_length(value) or 0

    def _refusable_receive(
        self, cycle: RequestResponseCycle
    ) -> Callable[[], Coroutine[Any, Any, ASGIReceiveEvent]]:
        """The cycle's receive(), which raises the refusal of its trailer section (_refusal)
        once it is refused: the app's body read answers it (uvicorn 0.54's run_asgi hands the
        app the cycle's `receive` attribute when the request's task starts)."""
        receive = cycle.receive

        async def receive_or_refuse() -> ASGIReceiveEvent:
            message = await receive()
            refusal = self._refusal
            if refusal is not None and refusal[0] is cycle:
                self._refusal = None
                raise refusal[1]
            return message

        return receive_or_refuse

    def _send_saying_close(
        self, cycle: RequestResponseCycle
    ) -> Callable[[ASGISendEvent], Coroutine[Any, Any, None]]:
        """The cycle's send(), which says `Connection: close` in an answer the app starts
        before its body was read (an early 401, 413 or 503): the connection ends after that
        answer (_linger), and a client not told so sent its next request on it and got no
        answer. uvicorn closes at once an answer that says so; that close is left to the
        linger instead (closed with the body's bytes unread, the kernel may reset the
        connection before the client reads the answer)."""
        send = cycle.send

        async def send_saying_close(message: ASGISendEvent) -> None:
            if message["type"] != "http.response.start" or cycle is not self.cycle:
                await send(message)
                return
            if not self._in_body:  # the body was read whole: keep-alive as usual
                await send(message)
                return
            keep_alive = cycle.keep_alive
            headers = [*message.get("headers", ()), (b"connection", b"close")]
            await send({**message, "headers": headers})
            cycle.keep_alive = keep_alive  # (uvicorn read the header as a close at the end)

        return send_saying_close

    def on_message_complete(self) -> None:
        if self._head_refused:
            return  # llhttp completes an upgrade request at its head: refused, no cycle made
        super().on_message_complete()
        self._in_body = False
        if self._body_timer is not None or self._body_running_since is not None:
            self._stop_body_clock()
        self._head_since = None
        self._head_bytes = self._head_fed = self._head_scanned = self._head_lines = 0
        self._head_tail = b""
        self._cancel_read_timer()  # the whole request is in: the client owes nothing now

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._head_since is not None:
            # The next request's head started while this answer was pending, and uvicorn,
            # which sees no request parsed, armed its keep-alive timer: the head's deadline
            # bounds the wait instead (that timer closed it mid-head, resetting the answers
            # still in the kernel's send queue).
            self._unset_keepalive_if_required()
        if self._unanswered:
            self._unanswered.popleft()
        self._answered_any = True
        if self.transport.is_closing():
            self._count_closing()  # uvicorn closed it after its answer (Connection: close)
            return
        if self._deferred is not None and not self._unanswered:
            refuse, self._deferred = self._deferred, None
            self._unset_keepalive_if_required()  # uvicorn's timer, armed just now: closing
            refuse()
            return
        if self._in_body and not self._unanswered:
            self._linger()  # answered before its body was read
            return
        if not self._unanswered:
            self._idle_since = time.monotonic()
            self._refile()
        self._schedule_pump()  # room for a request held behind this one

    def _linger(self) -> None:
        """The app answered a request before its body was read (an early 413, 401 or 503, a
        refused trailer section), or a request was refused on a connection that answered
        before (_close_with): the rest of that body is never parsed, and no request after
        it. The answer is written and the sending side closed (the client reads the answer and
        an end of stream); what the client still sends is read and dropped, for linger_s at
        most, and the connection closes (RFC 9112 section 9.6). Reading on instead, as uvicorn
        does, let a client hold the connection for ever by sending a byte now and then."""
        self._input_closed = self._lingering = True
        self._in_body = False
        self._held = bytearray()
        self._stop_body_clock()
        self._cancel_read_timer()
        self._unset_keepalive_if_required()  # uvicorn's keep-alive timer: linger_s instead
        if not self._reading:
            self._reading = True
            self.transport.resume_reading()
        if not self.transport.can_write_eof():
            self._close()
            return
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(self.linger_s, self._end_linger)
        self._refile()

    def _end_linger(self) -> None:
        self._linger_timer = None
        if not self.transport.is_closing():
            self._close()

    # -- refusals --------------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason=reason).inc()

    def _count_pause(self) -> None:
        if self.metrics is not None:
            self.metrics.reads_paused_total.inc()

    def _close_with(self, response: bytes, *, at_once: bool = False) -> None:
        """Refuse the request under way with `response`, then end the connection: after the
        answers pending before it, and lingering if answers were written on it (they may still
        sit in the kernel's send queue, which a close with the client's bytes unread resets).
        `at_once` (the cap's eviction) and a shutdown close as soon as it is written."""
        self._cancel_head_timer()
        self._cancel_read_timer()
        self._held = bytearray()
        if self._unanswered:
            self._after_answers(lambda: self._write_and_linger(response))
            return
        if self._answered_any and not (at_once or self._shutting_down):
            self._write_and_linger(response)
            return
        self._write_and_close(response)

    def _write_and_close(self, response: bytes) -> None:
        self.transport.write(response)
        self._close()

    def _write_and_linger(self, response: bytes) -> None:
        """A refusal after answers: those may still sit in the kernel's send queue, and what
        the client pipelined after the refused head is unread; closed at once, the kernel
        resets the connection and drops them (the answers it waited for were lost). Written,
        then the connection lingers as after an early answer."""
        self.transport.write(response)
        self._linger()

    def _after_answers(self, refuse: Callable[[], None]) -> None:
        """A request pipelined behind others is refused (its head too large, too slow, an
        upgrade with a body, unparsable) while their answers are pending. Those go first (RFC
        9112 section 9.3.2: a client pairs answers with its requests in order; written at once,
        the refusal read as the first request's answer and that answer was lost). So nothing
        more is parsed or read, and `refuse` runs once the last of them is sent; if one of
        them closes the connection (Connection: close, shutdown), it is never said."""
        self._input_closed = True
        self._held = bytearray()
        self._deferred = refuse
        if self._reading:
            self._reading = False
            self.transport.pause_reading()

    def _refuse_header_bytes(self) -> None:
        self._count("header_too_large")
        detail = (
            f"the request line and headers exceed {self.max_header_bytes} bytes "
            "(SDPA_MAX_HEADER_BYTES); send fewer or shorter headers (data belongs in the body)"
        )
        self._close_with(problem_bytes(431, "Request Header Fields Too Large", detail))

    def _refuse_header_lines(self) -> None:
        self._count("header_too_large")
        detail = (
            f"the request has more than {self.max_headers} header lines (SDPA_MAX_HEADERS); "
            "send fewer headers"
        )
        self._close_with(problem_bytes(431, "Request Header Fields Too Large", detail))

    def _refuse_trailers(self, detail: str) -> None:
        """A chunked body's trailer section passed its bound: a 431 (TrailersTooLarge), as
        _refuse_body tells."""
        self._refuse_body("header_too_large", TrailersTooLarge(detail))

    def _refuse_chunks(self, refused: str) -> None:
        """A chunked body's framing passed its bounds (ChunkedBodyEnd): a 400 (ChunksRefused),
        as _refuse_body tells."""
        if refused == ChunkedBodyEnd.SIZE_LINE_TOO_LONG:
            detail = (
                f"a chunk-size line of the request's chunked body exceeds {MAX_CHUNK_SIZE_LINE} "
                "bytes (its hex digits, leading zeros and extensions); send each chunk's size "
                "in hex without padding or extensions"
            )
        else:
            detail = (
                f"the request's chunked body's chunks past its first {FREE_CHUNKS} bring under "
                f"{MIN_CHUNK_AVERAGE} bytes of data each on average; join small pieces into "
                "chunks of KiBs, or send the body with a Content-Length"
            )
        self._refuse_body("chunk_framing", ChunksRefused(detail))

    def _refuse_body(self, reason: str | None, error: ServiceError) -> None:
        """A body is malformed, or a chunked body passed a bound of its framing or trailer
        section. The app holds the request already: its next receive() raises `error`, which
        it answers as it answers its own refusals (its access log says the error's status),
        and the connection closes after that answer (_linger). Nothing more of the connection
        is parsed. Counted under `reason`, if any."""
        if reason is not None:
            self._count(reason)
        self._input_closed = True
        cycle = self.cycle
        if cycle.response_started:  # answering already: it sees the connection close
            self._close()
            return
        self._refusal = (cycle, error)
        cycle.message_event.set()  # a receive() waiting now returns, and raises it

    def _refuse_upgrade_with_body(self) -> None:
        """llhttp ends an Upgrade or CONNECT request at its head and never delivers its body:
        the app would answer it without the body the client sent (a misleading 422), and the
        body would be parsed as the next request (one a proxy forwarding Upgrade took for
        body bytes: request smuggling). So such a request with a body gets a 400 before the
        app sees it, and the connection closes."""
        self._head_refused = True
        detail = (
            "a request asking to switch protocols (Connection: upgrade and an Upgrade header) "
            "or a CONNECT cannot carry a body here: the server speaks HTTP/1.1 only and ends "
            "such a request at its headers; send it without the Upgrade header"
        )
        self._close_with(problem_bytes(400, "Bad Request", detail))

    # -- timers ----------------------------------------------------------------------------

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._on_read_timeout)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        self._count("read_timeout")
        if not self._in_body:
            # No app has a request yet: the client can still be told why.
            detail = (
                f"no byte of the request arrived for {self.read_timeout_s:g} s "
                "(SDPA_READ_TIMEOUT_S)"
            )
            self._close_with(problem_bytes(408, "Request Timeout", detail))
            return
        # Mid-body the app is reading: closing makes its next receive() a disconnect.
        self._close()

    def _on_head_deadline(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._head_since is None or self._in_body:
            return
        self._count("header_timeout")
        detail = (
            f"the request's headers were not complete within {self.read_timeout_s:g} s of "
            "their first byte (SDPA_READ_TIMEOUT_S); send them at once"
        )
        self._close_with(problem_bytes(408, "Request Timeout", detail))

    def _sync_body_clock(self) -> None:
        """Run the body's clock (min_body_rate) while the app waits for a body the server
        reads; stop it otherwise, keeping the time it ran."""
        running = (
            self._in_body
            and self._body_asked
            and self._reading
            and not self._input_closed
            and self.min_body_rate > 0
        )
        if running == (self._body_running_since is not None):
            return
        if running:
            self._body_running_since = self.loop.time()
            self._arm_body_timer()
        else:
            self._stop_body_clock()

    def _stop_body_clock(self) -> None:
        if self._body_running_since is not None:
            self._body_spent_s += self.loop.time() - self._body_running_since
            self._body_running_since = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_deadline(self, running_since: float) -> float:
        """read_timeout_s from the first read of the body, plus a second for every
        min_body_rate bytes it brought, less the time the clock ran before `running_since`."""
        credit_s = self.read_timeout_s + self._body_bytes / self.min_body_rate
        return running_since + credit_s - self._body_spent_s

    def _arm_body_timer(self) -> None:
        # One timer per body, not one per read: when it fires early (bytes came meanwhile),
        # it is armed again at the later deadline.
        assert self._body_running_since is not None
        when = self._body_deadline(self._body_running_since)
        self._body_timer = self.loop.call_at(when, self._on_body_clock)

    def _on_body_clock(self) -> None:
        self._body_timer = None
        since = self._body_running_since
        if since is None or self.transport.is_closing():
            return
        if self.loop.time() + 0.001 < self._body_deadline(since):
            self._arm_body_timer()
            return
        self._count("body_too_slow")
        self._stop_body_clock()
        # The app holds the request: closing makes its next receive() a disconnect (499 in
        # the access log), as the idle timer does mid-body.
        self._close()

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown (the module docstring): a connection without a request
        in the app gets a grace for one under way; one with a request in the app closes after
        its answer, and the pump starts no request behind it."""
        self._shutting_down = True
        if self._lingering:
            self._close()
            return
        if self._unanswered or self._in_body:
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
            return
        self.loop.call_later(self.shutdown_idle_grace_s, self._close_if_no_request)

    def _close_if_no_request(self) -> None:
        if self.transport.is_closing() or self._unanswered or self._in_body:
            return  # a request came: answered, then closed
        if self._lingering:  # refused during the grace, its sending side closed: end it now
            self._close()
            return
        if self._head_since is not None:
            detail = "the server is shutting down; send the request again (elsewhere)"
            self._close_with(
                problem_bytes(503, "Service Unavailable", detail, retry_after_s=1), at_once=True
            )
            return
        self._close()

    # -- writing ---------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        _backed_up.add(self)
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._on_send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        _backed_up.discard(self)
        self._cancel_send_timer()
        self._settle_delivery(True)

    async def delivered(self) -> bool:
        """Whether the answers handed to this connection reached the client: at once unless
        the client reads slower than the server writes; then when it catches up (True) or the
        connection is lost, by the client or the send timeout (False)."""
        if self._lost_undelivered:
            return False
        if self not in _backed_up:
            return True
        waiter: asyncio.Future[bool] = self.loop.create_future()
        self._delivery_waiters.add(waiter)
        try:
            return await waiter
        finally:
            self._delivery_waiters.discard(waiter)

    def _settle_delivery(self, delivered: bool) -> None:
        for waiter in self._delivery_waiters:
            if not waiter.done():
                waiter.set_result(delivered)

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _on_send_timeout(self) -> None:
        self._send_timer = None
        # abort, not close: close would wait to flush the very bytes the client does not read.
        self.transport.abort()
        self._count_closing()


def guarded_protocol(
    *,
    read_timeout_s: float,
    send_timeout_s: float,
    max_connections: int,
    max_header_bytes: int,
    max_headers: int,
    max_pipelined_requests: int,
    min_body_rate: int,
    metrics: Metrics | None,
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits; refusals counted in
    `metrics` (the app's)."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "read_timeout_s": read_timeout_s,
            "send_timeout_s": send_timeout_s,
            "max_connections": max_connections,
            "max_header_bytes": max_header_bytes,
            "max_headers": max_headers,
            "max_pipelined_requests": max_pipelined_requests,
            "min_body_rate": min_body_rate,
            "metrics": metrics,
        },
    )
