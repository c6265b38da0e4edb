"""Linger: after an answer given before its request's body was read (an early 413, 401 or 503),
or a refusal on a connection that answered before, the answer is written and the sending side
closed, what the client still sends is read and dropped for linger_s at most, and the
connection closes (RFC 9112 section 9.6): closed at once with the client's bytes unread, the
kernel would reset it and drop answers still in its send queue."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

if TYPE_CHECKING:
    from uvicorn._types import ASGISendEvent

    from service.protocol.connection import GuardedHttpToolsProtocol


def send_saying_close(
    conn: GuardedHttpToolsProtocol, cycle: RequestResponseCycle
) -> Callable[[ASGISendEvent], Coroutine[Any, Any, None]]:
    """The cycle's send(), which says `Connection: close` in an answer the app starts
    before its body was read (an early 401, 413 or 503): the connection ends after that
    answer (_linger), and a client not told so sent its next request on it and got no
    answer. uvicorn closes at once an answer that says so; that close is left to the
    linger instead (closed with the body's bytes unread, the kernel may reset the
    connection before the client reads the answer)."""
    send = cycle.send

    async def send_saying_close(message: ASGISendEvent) -> None:
        if message["type"] != "http.response.start" or cycle is not conn.cycle:
            await send(message)
            return
        if not conn._in_body:  # the body was read whole: keep-alive as usual
            await send(message)
            return
        keep_alive = cycle.keep_alive
        headers = [*message.get("headers", ()), (b"connection", b"close")]
        await send({**message, "headers": headers})
        cycle.keep_alive = keep_alive  # (uvicorn read the header as a close at the end)

    return send_saying_close


def linger(conn: GuardedHttpToolsProtocol) -> None:
    """The app answered a request before its body was read (an early 413, 401 or 503, a
    refused trailer section), or a request was refused on a connection that answered
    before (_close_with): the rest of that body is never parsed, and no request after
    it. The answer is written and the sending side closed (the client reads the answer and
    an end of stream); what the client still sends is read and dropped, for linger_s at
    most, and the connection closes (RFC 9112 section 9.6). Reading on instead, as uvicorn
    does, let a client hold the connection for ever by sending a byte now and then."""
    conn._input_closed = conn._lingering = True
    conn._in_body = False
    conn._held = bytearray()
    conn._stop_body_clock()
    conn._cancel_read_timer()
    conn._unset_keepalive_if_required()  # uvicorn's keep-alive timer: linger_s instead
    if not conn._reading:
        conn._reading = True
        conn.transport.resume_reading()
    if not conn.transport.can_write_eof():
        conn._close()
        return
    conn.transport.write_eof()
    conn._linger_timer = conn.loop.call_later(conn.linger_s, conn._end_linger)
    conn._refile()


def end_linger(conn: GuardedHttpToolsProtocol) -> None:
    conn._linger_timer = None
    if not conn.transport.is_closing():
        conn._close()


def close_with(conn: GuardedHttpToolsProtocol, response: bytes, *, at_once: bool = False) -> None:
    """Refuse the request under way with `response`, then end the connection: after the
    answers pending before it, and lingering if answers were written on it (they may still
    sit in the kernel's send queue, which a close with the client's bytes unread resets).
    `at_once` (the cap's eviction) and a shutdown close as soon as it is written."""
    conn._cancel_head_timer()
    conn._cancel_read_timer()
    conn._held = bytearray()
    if conn._unanswered:
        conn._after_answers(lambda: conn._write_and_linger(response))
        return
    if conn._answered_any and not (at_once or conn._shutting_down):
        conn._write_and_linger(response)
        return
    conn._write_and_close(response)


def write_and_close(conn: GuardedHttpToolsProtocol, response: bytes) -> None:
    conn.transport.write(response)
    conn._close()


def write_and_linger(conn: GuardedHttpToolsProtocol, response: bytes) -> None:
    """A refusal after answers: those may still sit in the kernel's send queue, and what
    the client pipelined after the refused head is unread; closed at once, the kernel
    resets the connection and drops them (the answers it waited for were lost). Written,
    then the connection lingers as after an early answer."""
    conn.transport.write(response)
    conn._linger()
