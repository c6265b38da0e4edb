"""The four timers: the idle read timer (SDPA_READ_TIMEOUT_S, restarted by every byte), the head's
deadline (its headers complete within SDPA_READ_TIMEOUT_S of their first byte), the body's
minimum rate (SDPA_MIN_BODY_RATE, a clock that runs only while the app waits for a body the
server reads) and the send timeout (SDPA_SEND_TIMEOUT_S, while a client reads nothing of an
answer past the write buffer's high-water mark)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.protocol.errors import problem_bytes

if TYPE_CHECKING:
    from service.protocol.connection import GuardedHttpToolsProtocol


def arm_read_timer(conn: GuardedHttpToolsProtocol) -> None:
    conn._cancel_read_timer()
    conn._read_timer = conn.loop.call_later(conn.read_timeout_s, conn._on_read_timeout)


def cancel_read_timer(conn: GuardedHttpToolsProtocol) -> None:
    if conn._read_timer is not None:
        conn._read_timer.cancel()
        conn._read_timer = None


def cancel_head_timer(conn: GuardedHttpToolsProtocol) -> None:
    if conn._head_timer is not None:
        conn._head_timer.cancel()
        conn._head_timer = None


def on_read_timeout(conn: GuardedHttpToolsProtocol) -> None:
    conn._read_timer = None
    if conn.transport.is_closing():
        return
    conn._count("read_timeout")
    if not conn._in_body:
        # No app has a request yet: the client can still be told why.
        detail = (
            f"no byte of the request arrived for {conn.read_timeout_s:g} s (SDPA_READ_TIMEOUT_S)"
        )
        conn._close_with(problem_bytes(408, "Request Timeout", detail))
        return
    # Mid-body the app is reading: closing makes its next receive() a disconnect.
    conn._close()


def on_head_deadline(conn: GuardedHttpToolsProtocol) -> None:
    conn._head_timer = None
    if conn.transport.is_closing() or conn._head_since is None or conn._in_body:
        return
    conn._count("header_timeout")
    detail = (
        f"the request's headers were not complete within {conn.read_timeout_s:g} s of "
        "their first byte (SDPA_READ_TIMEOUT_S); send them at once"
    )
    conn._close_with(problem_bytes(408, "Request Timeout", detail))


def sync_body_clock(conn: GuardedHttpToolsProtocol) -> None:
    """Run the body's clock (min_body_rate) while the app waits for a body the server
    reads; stop it otherwise, keeping the time it ran."""
    running = (
        conn._in_body
        and conn._body_asked
        and conn._reading
        and not conn._input_closed
        and conn.min_body_rate > 0
    )
    if running == (conn._body_running_since is not None):
        return
    if running:
        conn._body_running_since = conn.loop.time()
        conn._arm_body_timer()
    else:
        conn._stop_body_clock()


def stop_body_clock(conn: GuardedHttpToolsProtocol) -> None:
    if conn._body_running_since is not None:
        conn._body_spent_s += conn.loop.time() - conn._body_running_since
        conn._body_running_since = None
    if conn._body_timer is not None:
        conn._body_timer.cancel()
        conn._body_timer = None


def body_deadline(conn: GuardedHttpToolsProtocol, running_since: float) -> float:
    """read_timeout_s from the first read of the body, plus a second for every
    min_body_rate bytes it brought, less the time the clock ran before `running_since`."""
    credit_s = conn.read_timeout_s + conn._body_bytes / conn.min_body_rate
    return running_since + credit_s - conn._body_spent_s


def arm_body_timer(conn: GuardedHttpToolsProtocol) -> None:
    # One timer per body, not one per read: when it fires early (bytes came meanwhile),
    # it is armed again at the later deadline.
    assert conn._body_running_since is not None
    when = conn._body_deadline(conn._body_running_since)
    conn._body_timer = conn.loop.call_at(when, conn._on_body_clock)


def on_body_clock(conn: GuardedHttpToolsProtocol) -> None:
    conn._body_timer = None
    since = conn._body_running_since
    if since is None or conn.transport.is_closing():
        return
    if conn.loop.time() + 0.001 < conn._body_deadline(since):
        conn._arm_body_timer()
        return
    conn._count("body_too_slow")
    conn._stop_body_clock()
    # The app holds the request: closing makes its next receive() a disconnect (499 in
    # the access log), as the idle timer does mid-body.
    conn._close()


def cancel_send_timer(conn: GuardedHttpToolsProtocol) -> None:
    if conn._send_timer is not None:
        conn._send_timer.cancel()
        conn._send_timer = None


def on_send_timeout(conn: GuardedHttpToolsProtocol) -> None:
    conn._send_timer = None
    # abort, not close: close would wait to flush the very bytes the client does not read.
    conn.transport.abort()
    conn._count_closing()
