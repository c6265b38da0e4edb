"""Pipelining: the bytes read are held and the parser is fed what it may have now (one request's
head at a time, a body only up to its end and only while the app has read what it was given), at
most SDPA_MAX_PIPELINED_REQUESTS requests parsed and unanswered; past that the server stops
reading the connection (backpressure) and feeds the next request as answers complete. A request
refused at its head behind pending answers is answered after them, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl

from service.protocol.errors import BadBodyFraming, problem_bytes

if TYPE_CHECKING:
    from service.protocol.connection import GuardedHttpToolsProtocol


class ProtocolFlow(FlowControl):
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


def data_received(conn: GuardedHttpToolsProtocol, data: bytes) -> None:
    if conn._input_closed:
        return  # never parsed (reading is paused, or the connection lingers: dropped)
    conn._unset_keepalive_if_required()  # as uvicorn's data_received
    if conn._read_timer is not None:
        conn._arm_read_timer()  # any byte restarts the wait for the next one
    if conn._held:
        conn._held += data
        taken = conn._pump(conn._held)
        del conn._held[:taken]
    else:
        taken = conn._pump(data)
        if taken < len(data):
            conn._held += memoryview(data)[taken:]
    conn._settle()


def on_app_read(conn: GuardedHttpToolsProtocol) -> None:
    """uvicorn resumes reading: an app asked for its body (receive()), or an answer
    completed. The body's clock starts at its own app's first read of it (a client that
    expects 100-continue sends nothing before), and the held bytes are fed (soon, not from
    inside uvicorn). A receive() of an earlier request's app (the disconnect watch while
    it computes) resumes the same flow: a request pipelined behind it, whose app has not
    started, is not the oldest unanswered, and its clock waits for its turn."""
    unanswered = conn._unanswered
    if conn._in_body and not conn._body_asked and unanswered and unanswered[0] is conn.cycle:
        conn._body_asked = True
        conn._sync_body_clock()
    if conn._pump_soon is None and conn._held:
        conn._pump_soon = conn.loop.call_soon(conn._pump_held)


def schedule_pump(conn: GuardedHttpToolsProtocol) -> None:
    """An answer completed or the app read its body: feed the held bytes (soon, not from
    inside uvicorn's callback)."""
    if conn._pump_soon is None and conn._held:
        conn._pump_soon = conn.loop.call_soon(conn._pump_held)


def pump_held(conn: GuardedHttpToolsProtocol) -> None:
    conn._pump_soon = None
    if conn._held and not conn.transport.is_closing() and not conn._input_closed:
        del conn._held[: conn._pump(conn._held)]
        conn._settle()


def pump(conn: GuardedHttpToolsProtocol, buf: bytes | bytearray) -> int:
    """Feed the parser what it may have of buf now; return how many bytes it took."""
    pos, end = 0, len(buf)
    conn._blocked = False
    while pos < end and not conn.transport.is_closing() and not conn._input_closed:
        if conn._in_body:
            cycle = conn.cycle
            if len(cycle.body) > HIGH_WATER_LIMIT and not cycle.response_complete:
                # The app has not read what it was given (it asks again by receive()).
                conn._blocked = True
                break
            taken = conn._body_step(buf, pos, end)
        elif conn._may_start_request():
            taken = conn._head_step(buf, pos, end)
        else:
            conn._blocked = True
            break
        if not taken:
            break
        pos += taken
    return pos


def may_start_request(conn: GuardedHttpToolsProtocol) -> bool:
    if conn._head_since is not None:
        return True  # under way: the bounds were checked when it began
    if conn._input_closed:
        return False
    if len(conn._unanswered) >= conn.max_pipelined_requests:
        return False
    return not (conn._shutting_down and conn._unanswered)


def feed(conn: GuardedHttpToolsProtocol, buf: bytes | bytearray, pos: int, stop: int) -> bool:
    """Feed buf[pos:stop] to the parser (uvicorn's data_received, a slice at a time);
    False once the connection is closing."""
    whole = pos == 0 and stop == len(buf) and isinstance(buf, bytes)
    data = buf if whole else memoryview(buf)[pos:stop]
    try:
        conn.parser.feed_data(data)
    except httptools.HttpParserError as error:
        conn._parser_error(error)
    except httptools.HttpParserUpgrade:
        # An Upgrade (h2c, websocket) or CONNECT request, which llhttp ends at its head
        # (on_headers_complete took care of it): nothing after it is parsed.
        pass
    finally:
        if isinstance(data, memoryview):
            data.release()  # a bytearray cannot grow while a view of it lives
    # Closed, or refused behind answers still pending (_after_answers): parse no more.
    return not conn.transport.is_closing() and not conn._input_closed


def parser_error(conn: GuardedHttpToolsProtocol, error: httptools.HttpParserError) -> None:
    msg = "Invalid HTTP request received."
    conn.logger.warning(msg)
    if conn._in_body and conn._transfer_coded:
        # Its body is malformed (its chunk framing, a Transfer-Encoding llhttp cannot
        # read): the app holds that request, and answers it from its body's read, in its
        # turn. Deferred like a refused head instead, it waited for its own answer, which
        # never came: the app waited for a body never fed, and the connection was held
        # for ever.
        detail = (
            f"the request's body is not valid HTTP/1.1 framing ({error}); send it with a "
            "Content-Length, or as chunks of hex sizes, with no other Transfer-Encoding"
        )
        conn._refuse_body(None, BadBodyFraming(detail))
        return
    if conn._unanswered and not conn._in_body:  # a head behind answers still pending
        conn._after_answers(lambda: conn._write_and_linger(problem_bytes(400, "Bad Request", msg)))
        return
    # (An error inside a body without a Transfer-Encoding, which llhttp reads as opaque
    # bytes, is not expected: 400 and close, every request unanswered told it is gone.)
    conn._send_400(msg)


def send_400(conn: GuardedHttpToolsProtocol, msg: str) -> None:
    conn.send_400_response(msg)  # and closes
    conn._count_closing()


def settle(conn: GuardedHttpToolsProtocol) -> None:
    """After the parser was fed: read while it may have more, else hold and pause; run
    the one timer that fits what the connection waits for (and the body's clock); and file
    a head that started and is still incomplete where the cap finds it."""
    if conn.transport.is_closing() or conn._lingering:
        return
    if conn._head_started:
        conn._head_started = False
        if conn._head_since is not None:
            conn._refile(anew=True)
    if conn._input_closed:
        conn._held = bytearray()  # never parsed
    blocked = conn._input_closed or (conn._blocked and bool(conn._held))
    if blocked and conn._reading:
        conn._reading = False
        conn.transport.pause_reading()
        if not conn._in_body and len(conn._unanswered) >= conn.max_pipelined_requests:
            conn._count_pause()
    elif not blocked and not conn._reading:
        conn._reading = True
        conn.transport.resume_reading()
    if conn._in_body or conn._body_running_since is not None:
        conn._sync_body_clock()
    if not conn._reading:
        conn._cancel_read_timer()  # the client owes nothing while the server does not read
        return
    if conn._head_since is not None and not conn._in_body:
        conn._cancel_read_timer()  # the head's deadline comes first
        if conn._head_timer is None:
            conn._head_timer = conn.loop.call_at(
                conn._head_since + conn.read_timeout_s, conn._on_head_deadline
            )
    elif conn._in_body or (not conn._unanswered and not conn._answered_any):
        if conn._read_timer is None:
            conn._arm_read_timer()
    else:
        conn._cancel_read_timer()  # answers pending, or idle: uvicorn's keep-alive timer


def after_answers(conn: GuardedHttpToolsProtocol, refuse: Callable[[], None]) -> None:
    """A request pipelined behind others is refused (its head too large, too slow, an
    upgrade with a body, unparsable) while their answers are pending. Those go first (RFC
    9112 section 9.3.2: a client pairs answers with its requests in order; written at once,
    the refusal read as the first request's answer and that answer was lost). So nothing
    more is parsed or read, and `refuse` runs once the last of them is sent; if one of
    them closes the connection (Connection: close, shutdown), it is never said."""
    conn._input_closed = True
    conn._held = bytearray()
    conn._deferred = refuse
    if conn._reading:
        conn._reading = False
        conn.transport.pause_reading()
