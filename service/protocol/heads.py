"""Head limits: a request's line and header lines held until whole and fed to the parser a line
at a time, counted in bytes (SDPA_MAX_HEADER_BYTES) and lines (SDPA_MAX_HEADERS) before it sees
them: past either, 431 and the connection closes. An Upgrade or CONNECT request with a body is
refused at its head (400)."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Final

from service.protocol.errors import problem_bytes

if TYPE_CHECKING:
    from service.protocol.connection import GuardedHttpToolsProtocol

_HEAD_END: Final = b"\r\n\r\n"
# CR and LF before a request line are skipped by the parser (llhttp); skipped here as well, the
# first "\r\n\r\n" of a head is its end.
_NOT_CRLF: Final = re.compile(rb"[^\r\n]")
# The parser is fed whole lines of a head, but the first bytes of its request line (up to
# this many) as they come, so that what is not HTTP (a TLS handshake on the plain port) gets
# its 400 without waiting for a line end.
REQUEST_LINE_PROBE: Final = 16


def head_step(conn: GuardedHttpToolsProtocol, buf: bytes | bytearray, pos: int, end: int) -> int:
    """Take what the parser may have of the current request's head from buf[pos:end]."""
    start = pos
    if conn._head_since is None:  # its first byte
        conn._head_since = time.monotonic()
        conn._unset_keepalive_if_required()
        # Its headers' wait starts now: filed anew by _settle, once this read is fed, if
        # they are still incomplete then (most heads end in the read they start in).
        conn._head_started = True
    if not conn._head_fed and not conn._head_scanned and buf[pos] in b"\r\n":
        first = _NOT_CRLF.search(buf, pos, end)
        pos = end if first is None else first.start()
        conn._head_bytes += pos - start
        if conn._head_bytes >= conn.max_header_bytes:
            conn._refuse_header_bytes()
            return end - start
        if first is None:
            return pos - start
    # Bytes held from an earlier read were searched then: only the new ones are (a line
    # trickled a byte at a time costs linear time, not quadratic).
    scan = pos + conn._head_scanned
    head_end = conn._find_head_end(buf, pos, scan, end)
    if head_end is not None:
        if conn._head_bytes + (head_end - pos) > conn.max_header_bytes:
            conn._refuse_header_bytes()
            return end - start
        conn._feed_head(buf, pos, head_end, complete=True)
        return head_end - start
    last_line = buf.rfind(b"\n", scan, end)
    if conn._head_bytes + (end - pos) >= conn.max_header_bytes:
        # It cannot end within the budget. Its whole lines go to the parser first, so that
        # what is not HTTP at all gets the parser's 400 instead.
        if last_line < 0 or conn._feed_head(buf, pos, last_line + 1, complete=False):
            conn._refuse_header_bytes()
        return end - start
    if last_line >= 0:
        stop = last_line + 1
    elif not conn._head_fed:
        stop = min(end, pos + REQUEST_LINE_PROBE)
    else:
        conn._head_scanned = end - pos
        return pos - start  # the rest of a line: wait for its end
    conn._feed_head(buf, pos, stop, complete=False)
    conn._head_scanned = end - stop  # no line end after `stop`
    return stop - start


def find_head_end(
    conn: GuardedHttpToolsProtocol, buf: bytes | bytearray, pos: int, scan: int, end: int
) -> int | None:
    """Where the head ends in buf[pos:end] (just after its "\\r\\n\\r\\n"), or None; the
    bytes before `scan` hold no line end."""
    if conn._head_tail:
        joined = conn._head_tail + bytes(buf[pos : min(end, pos + 3)])
        found = joined.find(_HEAD_END)
        if found >= 0:
            return pos + found + 4 - len(conn._head_tail)
    found = buf.find(_HEAD_END, max(pos, scan - 3), end)
    return None if found < 0 else found + 4


def feed_head(
    conn: GuardedHttpToolsProtocol, buf: bytes | bytearray, pos: int, stop: int, *, complete: bool
) -> bool:
    """Feed whole lines of the head (or the first bytes of its request line): counted
    first, so that past SDPA_MAX_HEADERS the parser gets none of them."""
    conn._head_lines += buf.count(b"\n", pos, stop)
    # Neither the request line nor the empty line that ends a complete head is a header.
    if conn._head_lines - 1 - complete > conn.max_headers:
        conn._refuse_header_lines()
        return False
    conn._head_scanned = 0
    conn._head_bytes += stop - pos
    conn._head_fed += stop - pos
    conn._head_tail = (conn._head_tail + bytes(buf[max(pos, stop - 3) : stop]))[-3:]
    return conn._feed(buf, pos, stop)


def refuse_header_bytes(conn: GuardedHttpToolsProtocol) -> None:
    conn._count("header_too_large")
    detail = (
        f"the request line and headers exceed {conn.max_header_bytes} bytes "
        "(SDPA_MAX_HEADER_BYTES); send fewer or shorter headers (data belongs in the body)"
    )
    conn._close_with(problem_bytes(431, "Request Header Fields Too Large", detail))


def refuse_header_lines(conn: GuardedHttpToolsProtocol) -> None:
    conn._count("header_too_large")
    detail = (
        f"the request has more than {conn.max_headers} header lines (SDPA_MAX_HEADERS); "
        "send fewer headers"
    )
    conn._close_with(problem_bytes(431, "Request Header Fields Too Large", detail))


def refuse_upgrade_with_body(conn: GuardedHttpToolsProtocol) -> None:
    """llhttp ends an Upgrade or CONNECT request at its head and never delivers its body:
    the app would answer it without the body the client sent (a misleading 422), and the
    body would be parsed as the next request (one a proxy forwarding Upgrade took for
    body bytes: request smuggling). So such a request with a body gets a 400 before the
    app sees it, and the connection closes."""
    conn._head_refused = True
    detail = (
        "a request asking to switch protocols (Connection: upgrade and an Upgrade header) "
        "or a CONNECT cannot carry a body here: the server speaks HTTP/1.1 only and ends "
        "such a request at its headers; send it without the Upgrade header"
    )
    conn._close_with(problem_bytes(400, "Bad Request", detail))
