"""The connection cap (SDPA_MAX_CONNECTIONS): a connection beyond it closes the one doing the
least useful work (lingering after an early answer, then the longest with incomplete headers, a
408, then the longest idle between keep-alive requests, a 503); only when every connection has a
request in the app is the newcomer refused (503). The candidates are kept in order as their
state changes, so a newcomer at the cap costs the same whatever the cap."""

from __future__ import annotations

import collections
import time
import weakref
from typing import TYPE_CHECKING

from uvicorn.server import ServerState

from service.protocol.errors import problem_bytes

if TYPE_CHECKING:
    from service.protocol.connection import GuardedHttpToolsProtocol


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
evictables: weakref.WeakKeyDictionary[ServerState, _Evictable] = weakref.WeakKeyDictionary()


def evictable_of(server_state: ServerState) -> _Evictable:
    table = evictables.get(server_state)
    if table is None:
        table = evictables[server_state] = _Evictable()
    return table


def make_room(conn: GuardedHttpToolsProtocol) -> bool:
    """At the cap: close the connection doing the least useful work; False if every one
    has a request in the app. O(1): the candidates are kept in order (_Evictable)."""
    table = conn._evictable
    # This connection is among them; those closing no longer count.
    while len(conn.connections) - table.closing > conn.max_connections:
        victim = table.oldest()
        if victim is None:
            return False
        if victim.transport.is_closing():
            victim._count_closing()  # closed by uvicorn, where we did not see it
            continue
        victim._evict()
    return True


def evictable_kind(
    conn: GuardedHttpToolsProtocol,
) -> collections.OrderedDict[GuardedHttpToolsProtocol, None] | None:
    """Where the cap finds this connection now: answered (lingering), headers incomplete
    (or none yet on a fresh connection), idle between keep-alive requests; None while the
    app holds a request of it or it is closing."""
    if conn._closing_counted:
        return None
    table = conn._evictable
    if conn._lingering:
        return table.answered
    if conn._unanswered or conn._in_body:
        return None
    if conn._head_since is not None or not conn._answered_any:
        return table.heads
    return table.idle


def refile(conn: GuardedHttpToolsProtocol, *, anew: bool = False) -> None:
    """File this connection where the cap finds it, at the end (the newest) when it moves
    there or `anew` (a head started: its wait starts now)."""
    kind = conn._evictable_kind()
    if kind is conn._filed and not anew:
        return
    if conn._filed is not None:
        del conn._filed[conn]
    conn._filed = kind
    if kind is not None:
        kind[conn] = None


def unfile(conn: GuardedHttpToolsProtocol) -> None:
    if conn._filed is not None:
        del conn._filed[conn]
        conn._filed = None


def close(conn: GuardedHttpToolsProtocol) -> None:
    """Close the connection (flushing what was written), no longer counted at the cap."""
    conn.transport.close()
    conn._count_closing()


def count_closing(conn: GuardedHttpToolsProtocol) -> None:
    if not conn._closing_counted:
        conn._closing_counted = True
        conn._evictable.closing += 1
        conn._refile()


def evict(conn: GuardedHttpToolsProtocol) -> None:
    conn._count("connections")
    if conn._lingering:  # its answer was written: nothing more to say
        conn._close()
        return
    held_for = time.monotonic() - (conn._head_since or conn._idle_since)
    if conn._head_since is not None or not conn._answered_any:
        detail = (
            f"this connection's request headers were incomplete after {held_for:.1f} s while "
            f"the server held its maximum of {conn.max_connections} connections "
            "(SDPA_MAX_CONNECTIONS): it was closed to admit another; send a request's "
            "headers at once"
        )
        conn._close_with(problem_bytes(408, "Request Timeout", detail), at_once=True)
    else:
        detail = (
            f"this connection was idle for {held_for:.1f} s while the server held its "
            f"maximum of {conn.max_connections} connections (SDPA_MAX_CONNECTIONS): it was "
            "closed to admit another; retry on a new connection"
        )
        conn._close_with(
            problem_bytes(503, "Service Unavailable", detail, retry_after_s=1), at_once=True
        )
