"""Body framing: where a request's body ends (Content-Length, or the chunked framing read
here), so that the parser is fed no byte past it; a chunked body's framing and trailer
section bounded (a size line past MAX_CHUNK_SIZE_LINE, chunks too small on average, trailers
past SDPA_MAX_HEADER_BYTES or SDPA_MAX_HEADERS), refused from the app's body read."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from service.errors import ServiceError
from service.protocol.errors import ChunksRefused, TrailersTooLarge
from service.wire.lengths import parse_length

if TYPE_CHECKING:
    from uvicorn._types import ASGIReceiveEvent

    from service.protocol.connection import GuardedHttpToolsProtocol

logger = logging.getLogger("sdpa.connections")

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


def body_step(conn: GuardedHttpToolsProtocol, buf: bytes | bytearray, pos: int, end: int) -> int:
    """Feed the parser the current request's body from buf[pos:end], up to its end."""
    chunked = conn._chunked
    if chunked is not None:
        data_before = chunked.data_bytes
        taken = chunked.take(buf, pos, end)
        if chunked.refused is not None:
            conn._refuse_chunks(chunked.refused)
            return end - pos
        if chunked.trailer_lines > conn.max_headers:
            conn._refuse_trailers(
                f"the request's trailer section has more than {conn.max_headers} lines "
                "(SDPA_MAX_HEADERS); send fewer trailer fields"
            )
            return end - pos
        if chunked.trailer_bytes > conn.max_header_bytes or (
            not taken and chunked.trailer_bytes + end - pos >= conn.max_header_bytes
        ):
            conn._refuse_trailers(
                f"the request's trailer section exceeds {conn.max_header_bytes} bytes "
                "(SDPA_MAX_HEADER_BYTES); send fewer or shorter trailer fields"
            )
            return end - pos
        done = chunked.done
        # Only data is progress (the minimum rate): framing (size lines, extensions, leading
        # zeros) brought the app nothing.
        conn._body_bytes += chunked.data_bytes - data_before
    else:
        taken = min(conn._body_left, end - pos)
        conn._body_left -= taken
        done = not conn._body_left
        conn._body_bytes += taken
    if taken and not conn._feed(buf, pos, pos + taken):
        return end - pos
    if done == conn._in_body:
        # The parser and this framing disagree on where the body ends (never seen: a
        # guard): the next request's bytes cannot be told apart, so stop here.
        logger.error("request framing lost; closing the connection")
        conn._close()
        return end - pos
    return taken


def frame_body(conn: GuardedHttpToolsProtocol) -> None:
    """Read how the current request's body ends from its headers (uvicorn's list, names in
    lower case)."""
    conn._chunked, conn._body_left, conn._transfer_coded = None, 0, False
    for name, value in conn.headers:
        if name == b"transfer-encoding":
            conn._transfer_coded = True
            if is_chunked(value):
                conn._chunked = ChunkedBodyEnd()
        elif name == b"content-length":
            # Past 18 digits it reads as 10**18 bytes: a body that no stream ends either.
            conn._body_left = parse_length(value) or 0


def refusable_receive(
    conn: GuardedHttpToolsProtocol, cycle: RequestResponseCycle
) -> Callable[[], Coroutine[Any, Any, ASGIReceiveEvent]]:
    """The cycle's receive(), which raises the refusal of its trailer section (_refusal)
    once it is refused: the app's body read answers it (uvicorn 0.54's run_asgi hands the
    app the cycle's `receive` attribute when the request's task starts)."""
    receive = cycle.receive

    async def receive_or_refuse() -> ASGIReceiveEvent:
        message = await receive()
        refusal = conn._refusal
        if refusal is not None and refusal[0] is cycle:
            conn._refusal = None
            raise refusal[1]
        return message

    return receive_or_refuse


def refuse_trailers(conn: GuardedHttpToolsProtocol, detail: str) -> None:
    """A chunked body's trailer section passed its bound: a 431 (TrailersTooLarge), as
    _refuse_body tells."""
    conn._refuse_body("header_too_large", TrailersTooLarge(detail))


def refuse_chunks(conn: GuardedHttpToolsProtocol, refused: str) -> None:
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
    conn._refuse_body("chunk_framing", ChunksRefused(detail))


def refuse_body(conn: GuardedHttpToolsProtocol, reason: str | None, error: ServiceError) -> None:
    """A body is malformed, or a chunked body passed a bound of its framing or trailer
    section. The app holds the request already: its next receive() raises `error`, which
    it answers as it answers its own refusals (its access log says the error's status),
    and the connection closes after that answer (_linger). Nothing more of the connection
    is parsed. Counted under `reason`, if any."""
    if reason is not None:
        conn._count(reason)
    conn._input_closed = True
    cycle = conn.cycle
    if cycle.response_started:  # answering already: it sees the connection close
        conn._close()
        return
    conn._refusal = (cycle, error)
    cycle.message_event.set()  # a receive() waiting now returns, and raises it
