"""Connection limits at the protocol layer: read and send timeouts, and a connection cap.

uvicorn 0.54 arms no timer on a fresh connection, nor while request headers or a body trickle
in (only between requests of a keep-alive connection), so an idle or trickling client holds a
socket and a file descriptor forever. Its `limit_concurrency` answers 503 only once a request
arrives on a connection it already accepted. And a client that reads none of its response holds
the response's memory for as long as it likes. ASGI middleware cannot see any of this: it runs
only once a request's headers are complete. So the service runs uvicorn with this subclass of
its httptools protocol (`uvicorn.Config(http=...)`):

- read timeout: while the server waits for a client's bytes (a fresh connection, headers, a
  body), every byte restarts a timer of `read_timeout_s`. When it fires before the request's
  headers are complete, the client gets a 408 problem+json and the connection closes; once the
  app has the request (a stalled body), the connection closes and the app sees the disconnect
  (a 499 in the access log). While the app computes or answers, no read timer runs.
- send timeout: when the client stops reading and the write buffer passes its high-water mark,
  a timer of `send_timeout_s` starts; it stops when the client reads again. When it fires, the
  connection is aborted and the pending response freed.
- connection cap: a connection beyond `max_connections` gets a 503 problem+json with
  Retry-After at once and is closed, before any request is read.
- shutdown: when uvicorn shuts down (after the drain), a connection idle at that moment is not
  closed at once, since its client may be sending a request right then, which would be lost
  unanswered; it gets `shutdown_idle_grace_s` for a request to arrive, which is then answered
  (with `Connection: close`), and otherwise closes. A connection mid-request closes after its
  response.
- delivery: an answer handed to a client that reads slower than the server writes is not yet
  delivered. Each request's scope carries, as the ASGI extension DELIVERY_EXTENSION, an awaitable
  that tells whether its answer reached the client (the access log logs 499 when it did not:
  the client left, or the send timeout dropped it, while its answer was being sent).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import PROBLEM_JSON, problem_payload


def problem_bytes(
    status: int, reason: str, detail: str, *, retry_after_s: int | None = None
) -> bytes:
    """A complete HTTP/1.1 problem+json response that closes the connection."""
    body = json.dumps(problem_payload(status=status, detail=detail)).encode()
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


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a read timeout, a send timeout and a connection cap
    (the module docstring). Configure it with guarded_protocol()."""

    read_timeout_s: ClassVar[float] = 15.0
    send_timeout_s: ClassVar[float] = 60.0
    max_connections: ClassVar[int] = 2048
    shutdown_idle_grace_s: ClassVar[float] = 0.5

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._headers_complete = False
        # Set when the connection was lost before its last answer was complete and written out.
        self._lost_undelivered = False
        self._delivery_waiters: set[asyncio.Future[bool]] = set()
        self._shutting_down = False
        self._request_begun = False  # a request's first bytes arrived, its response not done

    # -- the connection cap and the first read timer --------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _touch()
        if len(self.connections) > self.max_connections:
            detail = (
                f"the server holds its maximum of {self.max_connections} connections "
                "(SDPA_MAX_CONNECTIONS); retry later"
            )
            transport.write(problem_bytes(503, "Service Unavailable", detail, retry_after_s=1))
            transport.close()
            return
        self._arm_read_timer()  # the first request's bytes

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        self._cancel_send_timer()
        # Backed up: bytes were still waiting for the client (an abort drops them silently).
        self._lost_undelivered = self in _backed_up or (
            self.cycle is not None and not self.cycle.response_complete
        )
        _backed_up.discard(self)
        self._settle_delivery(not self._lost_undelivered)
        super().connection_lost(exc)

    # -- reading ---------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._read_timer is not None:
            self._arm_read_timer()  # any byte restarts the wait for the next one
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # uvicorn types extensions' values as dicts; ASGI lets a server put any object there.
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
        extensions[DELIVERY_EXTENSION] = self.delivered
        self._headers_complete = False
        self._request_begun = True
        _touch()
        self._arm_read_timer()

    def on_headers_complete(self) -> None:
        self._headers_complete = True
        super().on_headers_complete()
        if self._shutting_down and self.cycle is not None:
            self.cycle.keep_alive = False  # answered, then closed

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel_read_timer()  # the whole request is in: the client owes nothing now

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._request_begun = False
        # uvicorn's keep-alive timer now bounds the wait for the next request.
        self._cancel_read_timer()

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._on_read_timeout)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if not self._headers_complete or self.cycle is None or self.cycle.response_complete:
            # No app has this request yet: the client can still be told why.
            detail = (
                f"no byte of the request arrived for {self.read_timeout_s:g} s "
                "(SDPA_READ_TIMEOUT_S)"
            )
            self.transport.write(problem_bytes(408, "Request Timeout", detail))
        # Mid-body the app is reading: closing makes its next receive() a disconnect.
        self.transport.close()

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown (the module docstring): an idle connection gets a grace
        for a request that may be on its way; one mid-request closes after its response."""
        self._shutting_down = True
        if self._request_begun:
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
            return  # on_headers_complete turns keep-alive off for a request still arriving
        self.loop.call_later(self.shutdown_idle_grace_s, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if not self._request_begun and not self.transport.is_closing():
            self.transport.close()

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


def guarded_protocol(
    *, read_timeout_s: float, send_timeout_s: float, max_connections: int
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "read_timeout_s": read_timeout_s,
            "send_timeout_s": send_timeout_s,
            "max_connections": max_connections,
        },
    )
