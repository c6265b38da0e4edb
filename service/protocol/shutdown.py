"""Shutdown: when uvicorn shuts down (after the drain), a connection with no request in the app
gets shutdown_idle_grace_s for a request's headers under way to complete (then answered, with
Connection: close), else closes (a 503 if a head was under way); one with a request in the app
closes after that answer. And when a connection or a request last began, on any connection:
the server waits for a quiet moment before it closes its listener (service.server)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from service.protocol.errors import problem_bytes

if TYPE_CHECKING:
    from service.protocol.connection import GuardedHttpToolsProtocol


# time.monotonic() of the latest accepted connection or request start, on any connection: the
# server waits for a quiet moment before it closes its listener (service.server).
_last_activity = 0.0


def last_activity() -> float:
    """time.monotonic() when a connection was last accepted or a request last began."""
    return _last_activity


def touch() -> None:
    global _last_activity
    _last_activity = time.monotonic()


def start_shutdown(conn: GuardedHttpToolsProtocol) -> None:
    """uvicorn's graceful shutdown (the module docstring): a connection without a request
    in the app gets a grace for one under way; one with a request in the app closes after
    its answer, and the pump starts no request behind it."""
    conn._shutting_down = True
    if conn._lingering:
        conn._close()
        return
    if conn._unanswered or conn._in_body:
        if conn.cycle is not None and not conn.cycle.response_complete:
            conn.cycle.keep_alive = False
        return
    conn.loop.call_later(conn.shutdown_idle_grace_s, conn._close_if_no_request)


def close_if_no_request(conn: GuardedHttpToolsProtocol) -> None:
    if conn.transport.is_closing() or conn._unanswered or conn._in_body:
        return  # a request came: answered, then closed
    if conn._lingering:  # refused during the grace, its sending side closed: end it now
        conn._close()
        return
    if conn._head_since is not None:
        detail = "the server is shutting down; send the request again (elsewhere)"
        conn._close_with(
            problem_bytes(503, "Service Unavailable", detail, retry_after_s=1), at_once=True
        )
        return
    conn._close()
