"""GuardedHttpToolsProtocol: uvicorn's httptools protocol with the bounds of this package, one
module per job (service.protocol's docstring). This module holds the connection's state and
uvicorn's hooks (a connection made or lost, the parser's callbacks, the transport's flow), and
binds each job's functions as the connection's methods."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service.errors import ServiceError
from service.protocol import cap, delivery, framing, heads, linger, pipelining, timers
from service.protocol.cap import evictable_of
from service.protocol.delivery import DELIVERY_EXTENSION, backed_up
from service.protocol.errors import problem_bytes
from service.protocol.framing import ChunkedBodyEnd
from service.protocol.pipelining import ProtocolFlow
from service.protocol.shutdown import close_if_no_request, start_shutdown, touch

if TYPE_CHECKING:
    from collections.abc import Callable

    from service.metrics import Metrics


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
        self._evictable = evictable_of(self.server_state)
        self._filed: collections.OrderedDict[GuardedHttpToolsProtocol, None] | None = None
        self._closing_counted = False
        self._head_started = False  # a head started in the read being fed: file it anew

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = ProtocolFlow(transport, self._on_app_read)
        touch()
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
        self._lost_undelivered = self in backed_up or (
            self.cycle is not None and not self.cycle.response_complete
        )
        backed_up.discard(self)
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

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # uvicorn types extensions' values as dicts; ASGI lets a server put any object there.
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
        extensions[DELIVERY_EXTENSION] = self.delivered
        touch()

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

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason=reason).inc()

    def _count_pause(self) -> None:
        if self.metrics is not None:
            self.metrics.reads_paused_total.inc()

    def pause_writing(self) -> None:
        super().pause_writing()
        backed_up.add(self)
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._on_send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        backed_up.discard(self)
        self._cancel_send_timer()
        self._settle_delivery(True)

    # -- each job's functions, bound as the connection's methods --------------------------

    # heads
    _head_step = heads.head_step
    _find_head_end = heads.find_head_end
    _feed_head = heads.feed_head
    _refuse_header_bytes = heads.refuse_header_bytes
    _refuse_header_lines = heads.refuse_header_lines
    _refuse_upgrade_with_body = heads.refuse_upgrade_with_body
    # framing
    _refusable_receive = framing.refusable_receive
    _body_step = framing.body_step
    _frame_body = framing.frame_body
    _refuse_trailers = framing.refuse_trailers
    _refuse_chunks = framing.refuse_chunks
    _refuse_body = framing.refuse_body
    # pipelining
    data_received = pipelining.data_received
    _on_app_read = pipelining.on_app_read
    _schedule_pump = pipelining.schedule_pump
    _pump_held = pipelining.pump_held
    _pump = pipelining.pump
    _may_start_request = pipelining.may_start_request
    _feed = pipelining.feed
    _parser_error = pipelining.parser_error
    _send_400 = pipelining.send_400
    _settle = pipelining.settle
    _after_answers = pipelining.after_answers
    # timers
    _arm_read_timer = timers.arm_read_timer
    _cancel_read_timer = timers.cancel_read_timer
    _cancel_head_timer = timers.cancel_head_timer
    _on_read_timeout = timers.on_read_timeout
    _on_head_deadline = timers.on_head_deadline
    _sync_body_clock = timers.sync_body_clock
    _stop_body_clock = timers.stop_body_clock
    _body_deadline = timers.body_deadline
    _arm_body_timer = timers.arm_body_timer
    _on_body_clock = timers.on_body_clock
    _cancel_send_timer = timers.cancel_send_timer
    _on_send_timeout = timers.on_send_timeout
    # cap
    _make_room = cap.make_room
    _evictable_kind = cap.evictable_kind
    _refile = cap.refile
    _unfile = cap.unfile
    _close = cap.close
    _count_closing = cap.count_closing
    _evict = cap.evict
    # linger
    _send_saying_close = linger.send_saying_close
    _linger = linger.linger
    _end_linger = linger.end_linger
    _close_with = linger.close_with
    _write_and_close = linger.write_and_close
    _write_and_linger = linger.write_and_linger
    # delivery
    delivered = delivery.delivered
    _settle_delivery = delivery.settle_delivery
    # shutdown
    shutdown = start_shutdown
    _close_if_no_request = close_if_no_request


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
