"""The protocol layer in process, with an in-memory transport (no socket, no server).

First the contract: what service.protocol and service.server rely on in uvicorn
0.54, httptools 0.9 (llhttp) and anyio, private attributes included. If an upgrade changes one of
these, a test here fails before a server misbehaves (pyproject.toml pins the ranges checked).
Then GuardedHttpToolsProtocol's own bounds, driven byte by byte: header bytes and lines, the
pipelining bound, the body of a request waiting behind another, the header deadline and the
connection cap.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import logging
import re
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.to_thread
import httptools
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from service.errors import ServiceError, problem_payload
from service.metrics import Metrics
from service.middleware.access_log import AccessLogMiddleware
from service.protocol import GuardedHttpToolsProtocol, guarded_protocol
from service.protocol.framing import (
    FREE_CHUNKS,
    MAX_CHUNK_SIZE_LINE,
    MIN_CHUNK_AVERAGE,
    ChunkedBodyEnd,
)
from service.server import UVICORN_SHUTDOWN_PAUSE_S
from service.settings import Settings
from service.wire.lengths import parse_length

GET = b"GET /%d HTTP/1.1\r\nHost: t\r\n\r\n"


class MemoryTransport(asyncio.Transport):
    """A transport that keeps what is written and whether reading is paused; closing it tells
    the protocol the connection is lost, as a real one does (on the next loop turn). Once that
    happened, a write raises, as uvloop 0.23's does (asyncio's would drop it)."""

    # is_closing() calls on every transport: what the connection cap looks at per newcomer.
    closing_checks = 0

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.written = bytearray()
        self.closed = False
        self.eof_written = False  # the sending side closed (write_eof): the client reads EOF
        self.reading = True
        self.pauses = 0
        self.protocol: asyncio.Protocol | None = None
        self.lost = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.lost or self.eof_written:
            raise RuntimeError("unable to perform operation on a closed transport")
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.call_soon(self._lose)

    def _lose(self) -> None:
        self.lost = True
        if self.protocol is not None:
            self.protocol.connection_lost(None)

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        MemoryTransport.closing_checks += 1
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False
        self.pauses += 1

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def responses(self) -> list[bytes]:
        """The status lines written so far."""
        return re.findall(rb"HTTP/1\.1 \d{3} [^\r]*", self.written)


class HeldApp:
    """An ASGI app that reads a request's whole body, then answers 200 once released."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes, asyncio.Event]] = []
        _apps.append(self)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        release = asyncio.Event()
        self.requests.append((scope["path"], body, release))
        await release.wait()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    def release_all(self) -> None:
        for _, _, release in self.requests:
            release.set()


class ParserSpy:
    """Wraps a connection's httptools parser to count what it is fed."""

    def __init__(self, parser: httptools.HttpRequestParser) -> None:
        self.parser = parser
        self.fed: list[int] = []

    def feed_data(self, data: memoryview) -> None:
        self.fed.append(len(data))
        self.parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


_configs: dict[tuple[type[HttpToolsProtocol], int], uvicorn.Config] = {}


def connect(
    protocol_class: type[HttpToolsProtocol],
    app: Any,
    loop: asyncio.AbstractEventLoop,
    state: ServerState | None = None,
) -> tuple[Any, MemoryTransport]:
    config = _configs.get((protocol_class, id(app)))
    if config is None or config.app is not app:  # loaded once per app and class: many connect
        config = uvicorn.Config(
            app, http=protocol_class, ws="none", lifespan="off", log_config=None
        )
        config.load()
        _configs[(protocol_class, id(app))] = config
    protocol = protocol_class(
        config=config, server_state=state or ServerState(), app_state={}, _loop=loop
    )
    transport = MemoryTransport(loop)
    transport.protocol = protocol
    protocol.connection_made(transport)
    return protocol, transport


def guarded(**limits: Any) -> type[GuardedHttpToolsProtocol]:
    defaults: dict[str, Any] = {
        "read_timeout_s": 15.0,
        "send_timeout_s": 60.0,
        "max_connections": 100,
        "max_header_bytes": 1024,
        "max_headers": 16,
        "max_pipelined_requests": 4,
        "min_body_rate": 0,
        "metrics": Metrics(),
    }
    return guarded_protocol(**{**defaults, **limits})


_apps: list[HeldApp] = []


def run(scenario: Callable[[asyncio.AbstractEventLoop], Awaitable[None]]) -> None:
    async def main() -> None:
        try:
            await scenario(asyncio.get_running_loop())
        finally:  # answer what is still held, so that no task is cancelled mid-request
            for app in _apps:
                app.release_all()
            _apps.clear()
            await turns(10)

    asyncio.run(main())


async def turns(count: int = 5) -> None:
    """Let the loop run the tasks and callbacks that are ready."""
    for _ in range(count):
        await asyncio.sleep(0)


def counter(metrics: Metrics | None, name: str, **labels: str) -> float:
    assert metrics is not None
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def problem(transport: MemoryTransport) -> dict[str, Any]:
    body = bytes(transport.written).split(b"\r\n\r\n", 1)[1]
    parsed: dict[str, Any] = json.loads(body)
    return parsed


# -- the contract: httptools (llhttp) --------------------------------------------------------


class Events:
    """A parser protocol that records its callbacks."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_message_begin(self) -> None:
        self.events.append("begin")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.events.append((name, value))

    def on_headers_complete(self) -> None:
        self.events.append("headers")

    def on_body(self, body: bytes) -> None:
        self.events.append(bytes(body))

    def on_message_complete(self) -> None:
        self.events.append("complete")


def test_llhttp_skips_blank_lines_before_a_request_and_completes_a_bodiless_one_at_once() -> None:
    events = Events()
    parser = httptools.HttpRequestParser(events)
    parser.feed_data(memoryview(b"\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: t\r\n\r\n"))
    # In the same feed: the protocol knows the head was the whole request when feed_data returns.
    assert events.events == ["begin", (b"Host", b"t"), "headers", "complete"]


def test_llhttp_refuses_a_bare_lf_so_a_head_ends_at_its_first_crlf_crlf() -> None:
    with pytest.raises(httptools.HttpParserError):
        httptools.HttpRequestParser(Events()).feed_data(b"GET / HTTP/1.1\nHost: t\n\n")


def test_llhttp_concatenates_a_header_value_fed_in_pieces() -> None:
    # The `bytes +=` that made a streamed header value quadratic: the protocol feeds whole lines.
    events = Events()
    parser = httptools.HttpRequestParser(events)
    for piece in (b"GET / HTTP/1.1\r\nX-A: ab", b"cd", b"ef\r\n\r\n"):
        parser.feed_data(piece)
    assert (b"X-A", b"abcdef") in events.events


def test_llhttp_reports_an_upgrade_apart_from_its_errors_and_parses_on() -> None:
    events = Events()
    parser = httptools.HttpRequestParser(events)
    with pytest.raises(httptools.HttpParserUpgrade):
        parser.feed_data(b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
    assert events.events[-1] == "complete"
    # Fed on, the parser takes what follows for a new request: the protocol feeds it nothing
    # more once an upgrade request's head is in.
    parser.feed_data(b"GET /2 HTTP/1.1\r\n\r\n")
    assert events.events[-3:] == ["begin", "headers", "complete"]
    # The protocol catches HttpParserError (a 400) and HttpParserUpgrade apart.
    assert not issubclass(httptools.HttpParserUpgrade, httptools.HttpParserError)


@pytest.mark.parametrize(
    "framing",
    [b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n"],
    ids=["content-length", "chunked"],
)
def test_llhttp_ends_an_upgrade_request_at_its_head_and_never_delivers_its_body(
    framing: bytes,
) -> None:
    """Why an upgrade request with a body gets a 400: the app would get it without the body
    its client sent, and the body's bytes would come next, as if they were a request."""
    events = Events()
    parser = httptools.HttpRequestParser(events)
    head = b"POST / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n" + framing + b"\r\n"
    with pytest.raises(httptools.HttpParserUpgrade) as upgrade:
        parser.feed_data(head + b"5\r\nhello\r\n0\r\n\r\n")
    assert upgrade.value.args == (len(head),)  # where the head ends: nothing after it taken
    assert events.events[-2:] == ["headers", "complete"]
    assert parser.should_upgrade()  # already true in on_headers_complete (uvicorn asks there)


def test_llhttp_takes_leading_zeros_in_content_length_and_so_does_parse_length() -> None:
    events = Events()
    value = b"0" * 5000 + b"5"
    httptools.HttpRequestParser(events).feed_data(
        b"POST / HTTP/1.1\r\nContent-Length: " + value + b"\r\n\r\nhello"
    )
    assert events.events[-2:] == [b"hello", "complete"]
    assert parse_length(value) == 5  # the body's end, as the protocol frames it


@st.composite
def chunked_bodies(draw: st.DrawFn) -> bytes:
    chunks = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=5))
    body = b""
    for chunk in chunks:
        size = draw(st.sampled_from(["%x", "%X", "000%x", "0" * 40 + "%x"])) % len(chunk)
        extension = draw(st.sampled_from(["", ";a=b", ';name="x y"', ";z"]))
        body += size.encode() + extension.encode() + b"\r\n" + chunk + b"\r\n"
    trailers = draw(st.lists(st.sampled_from([b"X-T: 1\r\n", b"Y: a b\r\n"]), max_size=2))
    return body + b"0\r\n" + b"".join(trailers) + b"\r\n"


@settings(max_examples=200, deadline=None)
@given(body=chunked_bodies(), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_the_chunked_framing_ends_where_llhttp_ends_the_message(
    body: bytes, cuts: list[int]
) -> None:
    """ChunkedBodyEnd, fed the body and a pipelined request behind it in arbitrary pieces,
    releases exactly the body: the parser completes the message on its last byte, and never
    sees a byte of the next request."""
    events = Events()
    parser = httptools.HttpRequestParser(events)
    parser.feed_data(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    stream = body + GET % 2
    framing = ChunkedBodyEnd()
    held = b""
    released = 0
    for start, stop in zip([0, *sorted(cuts)], [*sorted(cuts), len(stream)], strict=True):
        held += stream[start:stop]
        taken = framing.take(held, 0, len(held))
        parser.feed_data(held[:taken])
        released += taken
        held = held[taken:]
        if framing.done:
            break
    assert framing.done
    assert released == len(body)
    assert events.events[-1] == "complete"
    assert events.events.count("begin") == 1


# -- the contract: uvicorn's protocol and server -------------------------------------------


def test_uvicorn_protocol_attributes_the_guarded_one_uses() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        state = ServerState()
        protocol, transport = connect(HttpToolsProtocol, HeldApp(), loop, state)
        assert protocol.connections is state.connections
        assert protocol in state.connections
        assert isinstance(protocol.flow, FlowControl)
        assert isinstance(protocol.parser, httptools.HttpRequestParser)
        assert protocol.cycle is None
        assert isinstance(protocol.pipeline, collections.deque)
        assert protocol.timeout_keep_alive_task is None
        assert protocol.expect_100_continue is False
        for method in (
            "_unset_keepalive_if_required",
            "send_400_response",
            "on_response_complete",
            "shutdown",
            "timeout_keep_alive_handler",
        ):
            assert callable(getattr(protocol, method)), method
        assert list(inspect.signature(FlowControl).parameters) == ["transport"]
        assert isinstance(HIGH_WATER_LIMIT, int)
        protocol.send_400_response("bad")
        assert transport.responses() == [b"HTTP/1.1 400 Bad Request"]
        assert transport.closed

    run(scenario)


def test_uvicorn_asks_its_flow_control_to_pause_and_resume_reading() -> None:
    """The points where the guarded protocol's own flow control takes over: a pipelined request
    queued (pause), a body past the high-water mark (pause), the app reading its body and an
    answer completing (resume); and the cycle's on_response callback arms keep-alive."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(HttpToolsProtocol, app, loop)
        protocol.data_received(GET % 1 + GET % 2)
        assert len(protocol.pipeline) == 1  # the second waits, its cycle built
        assert isinstance(protocol.cycle, RequestResponseCycle)
        assert protocol.cycle.flow is protocol.flow
        assert not transport.reading  # flow.pause_reading
        await turns()
        assert transport.reading  # the running request's receive(): flow.resume_reading
        app.release_all()
        await turns()
        assert transport.responses() == [b"HTTP/1.1 200 OK"]  # the second starts now
        await turns()
        app.release_all()
        await turns()
        assert len(transport.responses()) == 2
        assert protocol.timeout_keep_alive_task is not None  # on_response_complete
        protocol._unset_keepalive_if_required()
        assert protocol.timeout_keep_alive_task is None

        protocol, transport = connect(HttpToolsProtocol, HeldApp(), loop)
        body = b"x" * (HIGH_WATER_LIMIT + 1)
        protocol.data_received(b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
        protocol.data_received(body)
        assert isinstance(protocol.cycle.body, bytearray)
        assert len(protocol.cycle.body) == len(body)
        assert not transport.reading
        transport.close()
        await turns()

    run(scenario)


def test_uvicorn_hands_the_app_the_cycle_s_receive_attribute_when_its_task_starts() -> None:
    """The guarded protocol replaces a chunked request's `cycle.receive` right after
    on_headers_complete, to raise a refused trailer section from it; the app must get that one,
    not the method bound before. An early answer leaves the cycle keep-alive (uvicorn closes
    only when keep_alive is off) and arms uvicorn's keep-alive timer, which the protocol
    replaces by its linger."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        got: list[Any] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            got.append(await receive())
            await send({"type": "http.response.start", "status": 413, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        protocol, transport = connect(HttpToolsProtocol, app, loop)
        protocol.data_received(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        original = protocol.cycle.receive

        async def replaced() -> Any:
            return {"replaced": await original()}

        protocol.cycle.receive = replaced
        await turns()
        assert got == [{"replaced": {"type": "http.request", "body": b"abc", "more_body": True}}]
        assert transport.responses() == [b"HTTP/1.1 413 Request Entity Too Large"]
        assert not transport.closed  # the rest of the body would be read on
        assert protocol.timeout_keep_alive_task is not None
        transport.close()
        await turns()

    run(scenario)


def test_uvicorn_server_shutdown_asks_each_connection_then_waits_a_bounded_time() -> None:
    class Connection:
        asked = False

        def shutdown(self) -> None:
            self.asked = True

    class Lifespan:
        async def shutdown(self) -> None:
            pass

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        server = uvicorn.Server(uvicorn.Config(HeldApp(), timeout_graceful_shutdown=0))
        server.servers = []
        server.lifespan = Lifespan()  # type: ignore[assignment]
        stuck = Connection()
        server.server_state.connections.add(stuck)  # type: ignore[arg-type]
        # It never leaves: the shutdown still returns, after timeout_graceful_shutdown.
        await asyncio.wait_for(server.shutdown(), timeout=10)
        assert stuck.asked
        # The pause after asking the connections, counted in service.server's worst case.
        pause = f"await asyncio.sleep({UVICORN_SHUTDOWN_PAUSE_S})"
        assert pause in inspect.getsource(uvicorn.Server.shutdown)

    run(scenario)


def test_uvicorn_server_records_a_handled_signal_to_raise_it_again() -> None:
    # Why DrainingServer.handle_exit never calls this one (service.server's docstring).
    server = uvicorn.Server(uvicorn.Config(HeldApp()))
    server.handle_exit(signal.SIGTERM, None)
    assert server._captured_signals == [signal.SIGTERM]
    assert server.should_exit


def test_uvicorn_config_takes_the_protocol_class_and_no_websockets() -> None:
    protocol_class = guarded()
    config = uvicorn.Config(HeldApp(), http=protocol_class, ws="none")
    config.load()
    assert config.http_protocol_class is protocol_class
    assert config.ws_protocol_class is None


def test_a_cancelled_anyio_worker_thread_runs_on_and_the_interpreter_would_join_it() -> None:
    """Why service.server leaves with os._exit when a thread is still busy: cancelling the task
    that waits on anyio.to_thread ends the task, not its thread, which is not a daemon."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        release = threading.Event()
        task = asyncio.ensure_future(anyio.to_thread.run_sync(release.wait))
        try:
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.wait([task], timeout=10)
            assert task.cancelled()
            workers = [t for t in threading.enumerate() if t.name == "AnyIO worker thread"]
            assert workers
            assert not any(worker.daemon for worker in workers)
            assert not release.is_set()  # still waiting in its thread
        finally:
            release.set()

    run(scenario)


# -- the guarded protocol's bounds -----------------------------------------------------------


def head_of(size: int) -> bytes:
    """A GET /healthz head of exactly `size` bytes (an X-Pad header fills it)."""
    start, end = b"GET /healthz HTTP/1.1\r\nX-Pad: ", b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def test_a_head_of_the_budget_is_served_and_one_byte_more_gets_431_unparsed() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(guarded(max_header_bytes=1024), app, loop)
        protocol.data_received(head_of(1024))
        await turns()
        assert [path for path, _, _ in app.requests] == ["/healthz"]

        protocol, transport = connect(guarded(max_header_bytes=1024), HeldApp(), loop)
        spy = protocol.parser = ParserSpy(protocol.parser)
        for offset in range(0, 1025, 100):  # in reads of 100 bytes
            protocol.data_received(head_of(1025)[offset : offset + 100])
        assert transport.responses() == [b"HTTP/1.1 431 Request Header Fields Too Large"]
        assert "SDPA_MAX_HEADER_BYTES" in problem(transport)["detail"]
        assert transport.closed
        assert sum(spy.fed) <= 1024
        assert counter(protocol.metrics, "sdpa_rejected_total", reason="header_too_large") == 1

    run(scenario)


def test_a_streamed_header_value_reaches_the_parser_in_one_piece() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, _ = connect(guarded(max_header_bytes=4096), app, loop)
        spy = protocol.parser = ParserSpy(protocol.parser)
        request = b"GET /healthz HTTP/1.1\r\nX-Long: " + b"v" * 3000 + b"\r\nHost: t\r\n\r\n"
        for byte in range(len(request)):
            protocol.data_received(request[byte : byte + 1])
        await turns()
        assert [path for path, _, _ in app.requests] == ["/healthz"]
        # The request line's first bytes, its rest, and one feed per header line: not one per
        # byte, so nothing is concatenated 3,000 times.
        assert len(spy.fed) <= 5
        assert (b"x-long", b"v" * 3000) in protocol.headers

    run(scenario)


def test_more_header_lines_than_the_bound_get_431() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        def request(lines: int) -> bytes:
            return b"GET /healthz HTTP/1.1\r\n" + b"X-N: v\r\n" * lines + b"\r\n"

        app = HeldApp()
        protocol, transport = connect(guarded(max_headers=16), app, loop)
        protocol.data_received(request(16))
        await turns()
        assert len(app.requests) == 1
        protocol, transport = connect(guarded(max_headers=16), app, loop)
        protocol.data_received(request(17))
        await turns()
        assert transport.responses() == [b"HTTP/1.1 431 Request Header Fields Too Large"]
        assert "SDPA_MAX_HEADERS" in problem(transport)["detail"]
        assert len(app.requests) == 1

    run(scenario)


class BodyReader:
    """An ASGI app that reads a request's whole body and answers 200 with its length; a
    ServiceError raised while it reads is answered with its status, as the service's handlers
    answer one (the route's body read is where the in-flight bound's refusals surface too)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        try:
            more = True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
        except ServiceError as exc:
            payload = json.dumps(problem_payload(status=exc.status, detail=exc.detail)).encode()
            status, answer = exc.status, payload
        else:
            self.bodies.append(body)
            status, answer = 200, b"%d" % len(body)
        headers = [(b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


def lingering(protocol_class: type[GuardedHttpToolsProtocol]) -> type[GuardedHttpToolsProtocol]:
    """The class with a short linger after an early answer (the default is 2 s)."""
    return type("Lingering", (protocol_class,), {"linger_s": 0.05})


@pytest.mark.parametrize(
    ("trailers", "setting"),
    [
        ([b"X-Trailer: t\r\n"] * 17, "SDPA_MAX_HEADERS"),
        ([b"X-T: " + b"t" * 1100], "SDPA_MAX_HEADER_BYTES"),
    ],
    ids=["lines", "bytes"],
)
def test_a_trailer_section_past_its_bound_is_answered_431_by_the_app_then_closed(
    caplog: pytest.LogCaptureFixture, trailers: list[bytes], setting: str
) -> None:
    """Before: a bare close, and the access log said 499 (client closed) for what the server
    closed. The app, which holds the request, now gets the refusal from its body read and
    answers 431 naming the setting; its access log says 431; nothing after is parsed."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        metrics = Metrics()
        reader = BodyReader()
        app = AccessLogMiddleware(reader, metrics=metrics)
        protocol_class = lingering(guarded(max_headers=16, max_header_bytes=1024))
        protocol, transport = connect(protocol_class, app, loop)
        protocol.data_received(
            b"POST /t HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n"
        )
        await turns()  # the app reads the body
        for trailer in trailers:
            protocol.data_received(trailer)
        protocol.data_received(b"\r\n" + GET % 2)  # never parsed
        await turns()
        assert transport.responses() == [b"HTTP/1.1 431 Request Header Fields Too Large"]
        assert setting in problem(transport)["detail"]
        assert counter(protocol.metrics, "sdpa_rejected_total", reason="header_too_large") == 1
        assert reader.bodies == []
        assert transport.eof_written  # answered, the sending side closed: lingering
        assert not transport.closed
        await asyncio.sleep(0.1)
        assert transport.closed
        labels = {"route": "unmatched", "status": "431", "tenant": "anonymous"}
        assert counter(metrics, "sdpa_requests_total", **labels) == 1

    with caplog.at_level(logging.INFO, logger="sdpa.access"):
        run(scenario)
    assert [r.json_fields["status"] for r in caplog.records if r.name == "sdpa.access"] == [431]


def chunks_of(size: int, count: int) -> bytes:
    return (b"%x\r\n" % size + b"c" * size + b"\r\n") * count


CHUNKED_HEAD = b"POST /t HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_body_of_tiny_chunks_is_answered_400_by_the_app_after_the_free_chunks() -> None:
    """Before: each chunk cost about 3 us of Python whatever its size, and a read was handled
    in one step: a 240 KB read of 1-byte chunks held the event loop 131 ms (plain uvicorn's:
    23 ms), and a body could go on so without end. Now the chunks past the first FREE_CHUNKS
    must bring MIN_CHUNK_AVERAGE bytes of data each on average: the parser gets no more than
    the first chunk past that (by hand, the first count c with c bytes under 64 (c - 1024):
    1,041), and the app's body read raises a 400 naming the rule, which it answers; nothing
    after is parsed."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        reader = BodyReader()
        protocol, transport = connect(lingering(guarded()), reader, loop)
        protocol.data_received(CHUNKED_HEAD)
        await turns()
        spy = protocol.parser = ParserSpy(protocol.parser)
        protocol.data_received(chunks_of(1, 40000) + b"0\r\n\r\n" + GET % 2)
        await turns()
        first_refused = FREE_CHUNKS * MIN_CHUNK_AVERAGE // (MIN_CHUNK_AVERAGE - 1) + 1
        assert sum(spy.fed) <= first_refused * len(chunks_of(1, 1))
        assert transport.responses() == [b"HTTP/1.1 400 Bad Request"]
        detail = problem(transport)["detail"]
        assert f"past its first {FREE_CHUNKS}" in detail
        assert f"{MIN_CHUNK_AVERAGE} bytes" in detail
        assert counter(protocol.metrics, "sdpa_rejected_total", reason="chunk_framing") == 1
        assert reader.bodies == []
        assert transport.eof_written  # answered, the sending side closed: lingering

    run(scenario)


@pytest.mark.parametrize(
    ("body", "data"),
    [
        (chunks_of(1, FREE_CHUNKS), FREE_CHUNKS),  # the free chunks, however small
        # The free chunks are free: large ones after them need not pay for them (a review
        # found a generator's first small pieces made the rest of a body a 400).
        (chunks_of(1, FREE_CHUNKS) + chunks_of(65536, 4), FREE_CHUNKS + 4 * 65536),
        (chunks_of(MIN_CHUNK_AVERAGE, 3 * FREE_CHUNKS), MIN_CHUNK_AVERAGE * 3 * FREE_CHUNKS),
        # A big chunk pays for small ones after it: the average is what is bounded.
        (
            chunks_of(MIN_CHUNK_AVERAGE * 4 * FREE_CHUNKS, 1) + chunks_of(1, 3 * FREE_CHUNKS),
            MIN_CHUNK_AVERAGE * 4 * FREE_CHUNKS + 3 * FREE_CHUNKS,
        ),
    ],
    ids=["free", "free-then-large", "average", "amortized"],
)
def test_a_chunked_body_within_the_chunk_rule_is_read_whole(body: bytes, data: int) -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        reader = BodyReader()
        protocol, transport = connect(guarded(), reader, loop)
        protocol.data_received(CHUNKED_HEAD)
        stream = body + b"0\r\n\r\n"
        for start in range(0, len(stream), 65536):  # a socket read at a time
            protocol.data_received(stream[start : start + 65536])
            await turns()
        assert [len(got) for got in reader.bodies] == [data]
        assert transport.responses() == [b"HTTP/1.1 200 OK"]
        assert counter(protocol.metrics, "sdpa_rejected_total", reason="chunk_framing") == 0

    run(scenario)


@pytest.mark.parametrize(
    ("size_line", "accepted"),
    [
        (b"0" * (MAX_CHUNK_SIZE_LINE - 3) + b"1\r\n", True),  # at the bound: its CRLF counts
        (b"0" * (MAX_CHUNK_SIZE_LINE - 2) + b"1\r\n", False),
        (b"1;" + b"e" * (MAX_CHUNK_SIZE_LINE - 4) + b"\r\n", True),
        (b"1;" + b"e" * 100_000, False),  # no line end yet: refused all the same
    ],
    ids=["zeros-at-bound", "zeros-past", "extension-at-bound", "extension-without-end"],
)
def test_a_chunk_size_line_past_its_bound_is_answered_400(size_line: bytes, accepted: bool) -> None:
    """Before: llhttp took leading zeros and an extension without end, and their bytes counted
    as body for the minimum rate and the idle timer: 32 KiB/s of them held a connection and
    the app's request for ever while the app got no byte."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        reader = BodyReader()
        protocol, transport = connect(lingering(guarded()), reader, loop)
        protocol.data_received(CHUNKED_HEAD)
        await turns()
        for start in range(0, len(size_line), 1000):  # trickled: the bound spans reads
            protocol.data_received(size_line[start : start + 1000])
        if accepted:
            protocol.data_received(b"x\r\n0\r\n\r\n")
        await turns()
        if accepted:
            assert reader.bodies == [b"x"]
            assert transport.responses() == [b"HTTP/1.1 200 OK"]
        else:
            assert reader.bodies == []
            assert transport.responses() == [b"HTTP/1.1 400 Bad Request"]
            assert f"exceeds {MAX_CHUNK_SIZE_LINE} bytes" in problem(transport)["detail"]
            assert counter(protocol.metrics, "sdpa_rejected_total", reason="chunk_framing") == 1

    run(scenario)


def test_only_chunk_data_counts_toward_the_minimum_body_rate() -> None:
    """Chunks of 1 data byte behind 300 bytes of extension, every 10 ms or slower: 30 KB/s on
    the wire, at most 100 B/s of data, under the minimum of 400 B/s. Before, the framing counted
    and the body went on; now the connection closes at the body's deadline (about 67 ms)."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        protocol, transport = connect(
            guarded(read_timeout_s=0.05, min_body_rate=400), HeldApp(), loop
        )
        protocol.data_received(CHUNKED_HEAD)
        for _ in range(30):  # 0.3 s at least: the deadline is long past
            if transport.closed:
                break
            protocol.data_received(b"1;" + b"e" * 300 + b"\r\nx\r\n")
            await asyncio.sleep(0.01)
        assert transport.closed
        assert counter(protocol.metrics, "sdpa_rejected_total", reason="body_too_slow") == 1

    run(scenario)


class ScanCounter(bytearray):
    """Bytes that count what find() searches in them."""

    searched = 0

    def find(self, sub: Any, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        ScanCounter.searched += (len(self) if end is None else end) - (start or 0)
        return super().find(sub, start, end)


def test_a_trailer_line_trickled_a_byte_at_a_time_is_searched_once() -> None:
    """Before, a partial trailer line held was searched from its start on every read: a line
    of n bytes trickled cost n**2 / 2 (257 ms for 32,000 one-byte reads); now only the new
    bytes are searched, as for a head."""
    framing = ChunkedBodyEnd()
    held = ScanCounter(b"1\r\nx\r\n0\r\nX-T: ")
    held = held[framing.take(held, 0, len(held)) :]
    line = b"a" * 5000 + b"\r\n\r\n"
    ScanCounter.searched = 0
    for byte in line:
        held = ScanCounter(held + bytes([byte]))
        held = ScanCounter(held[framing.take(held, 0, len(held)) :])
    assert framing.done
    assert framing.trailer_lines == 1
    assert ScanCounter.searched <= 2 * len(line)


class EarlyAnswer:
    """An ASGI app that answers 413 at once, reading none of the body."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def test_an_answer_given_before_the_body_was_read_ends_the_connection_after_a_linger() -> None:
    """Before: the rest of a 1 TB body was fed to the parser for as long as the client sent a
    byte now and then. Now the answer is written, the sending side closed, what the client
    still sends dropped unparsed (a request smuggled in it too), and the connection closes
    after linger_s. The answer says `Connection: close` (a review found a client told nothing
    sent its next request on the connection, and got no answer)."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = EarlyAnswer()
        protocol, transport = connect(lingering(guarded()), app, loop)
        spy = protocol.parser = ParserSpy(protocol.parser)
        protocol.data_received(b"POST /1 HTTP/1.1\r\nContent-Length: 1000000000000\r\n\r\n{")
        await turns()
        assert transport.responses() == [b"HTTP/1.1 413 Request Entity Too Large"]
        head = bytes(transport.written).split(b"\r\n\r\n", 1)[0].lower()
        assert head.count(b"\r\nconnection: close") == 1
        assert transport.eof_written
        assert not transport.closed
        fed = sum(spy.fed)
        protocol.data_received(b" " * 1000 + GET % 2)
        assert sum(spy.fed) == fed
        await asyncio.sleep(0.1)
        assert transport.closed
        assert app.paths == ["/1"]

    run(scenario)


def test_a_body_slower_than_the_minimum_rate_is_closed_at_its_deadline() -> None:
    """A byte every 10 ms never lets the idle timer (300 ms) fire. At a minimum of 400 B/s the
    body's deadline is 300 ms + 1 s per 400 bytes from the app's first read: at 100 B/s it
    passes at 400 ms (t = 0.3 + 100 t / 400). With the rate off (0), the same body goes
    on past it (the idle timer alone). (With a 50 ms idle timer a loaded machine's 10 ms sleeps
    overshot it now and then: the margins are the timer's, not the machine's.)"""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        for rate in (400, 0):
            app = HeldApp()
            protocol, transport = connect(
                guarded(read_timeout_s=0.3, min_body_rate=rate), app, loop
            )
            protocol.data_received(b"POST /1 HTTP/1.1\r\nContent-Length: 1000\r\n\r\n")
            started = loop.time()
            for _ in range(100):  # 1 s of sleeps at most
                if transport.closed or loop.time() - started > 0.5:
                    break
                protocol.data_received(b" ")
                await asyncio.sleep(0.01)
            took = loop.time() - started
            slow = counter(protocol.metrics, "sdpa_rejected_total", reason="body_too_slow")
            if rate:
                assert transport.closed
                assert 0.3 <= took < 1.0
                assert slow == 1
                assert transport.responses() == []  # the app sees the disconnect
            else:
                assert took > 0.5  # past the rate's deadline, still open
                assert not transport.closed
                assert slow == 0
                transport.close()
            await turns()

    run(scenario)


def test_the_minimum_body_rate_is_a_setting_of_32_kib_a_second_that_0_turns_off() -> None:
    assert Settings().min_body_rate == 32768
    assert Settings(min_body_rate=0).min_body_rate == 0
    with pytest.raises(ValidationError, match="min_body_rate"):
        Settings(min_body_rate=-1)


def test_a_body_above_the_minimum_rate_is_read_to_its_end() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = BodyReader()
        protocol, transport = connect(guarded(read_timeout_s=0.05, min_body_rate=200), app, loop)
        protocol.data_received(b"POST /1 HTTP/1.1\r\nContent-Length: 150\r\n\r\n")
        for _ in range(15):  # 1,000 B/s for 0.15 s: three times the read timeout
            await asyncio.sleep(0.01)
            protocol.data_received(b"x" * 10)
        await turns()
        assert app.bodies == [b"x" * 150]
        assert not transport.closed

    run(scenario)


def test_the_body_clock_runs_only_while_the_app_asked_for_it_and_the_server_reads() -> None:
    """The app reads its body only after 0.15 s (three read timeouts): its first bytes stop
    the reading (the high-water mark), the rest waits in the client's buffers, and neither
    that wait nor the time before the app's first read counts against the client."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        release = asyncio.Event()
        reader = BodyReader()

        async def late(scope: Any, receive: Any, send: Any) -> None:
            await release.wait()
            await reader(scope, receive, send)

        protocol, transport = connect(guarded(read_timeout_s=0.05, min_body_rate=200), late, loop)
        body = b"y" * (4 * HIGH_WATER_LIMIT)
        protocol.data_received(b"POST /1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
        sent = 0
        while transport.reading and sent < len(body):
            protocol.data_received(body[sent : sent + 65536])
            sent += 65536
        assert not transport.reading
        await asyncio.sleep(0.15)
        assert not transport.closed
        release.set()
        for _ in range(100):  # bounded: a few reads
            await turns()
            if transport.reading and sent < len(body):
                protocol.data_received(body[sent : sent + 65536])
                sent += 65536
            if reader.bodies:
                break
        assert [len(got) for got in reader.bodies] == [len(body)]

    run(scenario)


def test_the_body_clock_of_a_pipelined_request_waits_for_its_own_app() -> None:
    """The app of /1 watches for a disconnect while it computes (a receive(), as
    service/api/disconnect.py does), which resumes the connection's reading. Before, that
    started the clock of /2's body, pipelined behind it and not yet read by any app: a body
    trickled at 100 B/s, under the minimum of 1,000 B/s, was closed while it waited its turn.
    Now its clock starts when its own app reads it."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        release = asyncio.Event()
        bodies: list[bytes] = []
        watchers: list[asyncio.Task[Any]] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            bodies.append(body)
            if scope["path"] == "/1":
                watchers.append(asyncio.ensure_future(receive()))  # the disconnect watch
                await release.wait()
            headers = [(b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})

        protocol, transport = connect(guarded(read_timeout_s=0.05, min_body_rate=1000), app, loop)
        protocol.data_received(
            b"POST /1 HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
            b"POST /2 HTTP/1.1\r\nContent-Length: 40\r\n\r\n"
        )
        await turns()
        assert watchers
        for _ in range(30):  # while /1 computes: a byte every 10 ms or slower
            protocol.data_received(b"x")
            await asyncio.sleep(0.01)
        assert not transport.closed
        release.set()
        await turns()
        protocol.data_received(b"y" * 10)  # /2's app reads now: the rest at once
        await turns()
        assert bodies == [b"", b"x" * 30 + b"y" * 10]
        assert transport.responses() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]
        assert counter(protocol.metrics, "sdpa_rejected_total", reason="body_too_slow") == 0

    run(scenario)


@pytest.mark.parametrize("framing", [b"Content-Length: %d\r\n", b"Transfer-Encoding: chunked\r\n"])
def test_an_upgrade_request_with_a_body_gets_400_and_its_body_is_never_a_request(
    framing: bytes,
) -> None:
    """The review's smuggling: the body of a POST asking for h2c was served as a GET."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(guarded(), app, loop)
        inner = GET % 2
        body = inner if b"Length" in framing else b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner)
        protocol.data_received(
            b"POST /1 HTTP/1.1\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            + (framing % len(inner) if b"%d" in framing else framing)
            + b"\r\n"
            + body
        )
        await turns()
        assert transport.responses() == [b"HTTP/1.1 400 Bad Request"]
        assert "Upgrade" in problem(transport)["detail"]
        assert transport.closed
        assert app.requests == []

    run(scenario)


def test_an_upgrade_request_without_a_body_is_answered_then_the_connection_closes() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(guarded(), app, loop)
        protocol.data_received(
            b"GET /1 HTTP/1.1\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n\r\n"
            + GET % 2  # what a proxy might forward as the next request: never parsed
        )
        await turns()
        assert [path for path, _, _ in app.requests] == ["/1"]
        app.release_all()
        await turns()
        assert transport.responses() == [b"HTTP/1.1 200 OK"]
        assert b"connection: close" in transport.written
        assert transport.closed
        assert [path for path, _, _ in app.requests] == ["/1"]

    run(scenario)


def test_pipelined_requests_past_the_bound_wait_unparsed_with_reading_paused() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(guarded(max_pipelined_requests=4), app, loop)
        protocol.data_received(b"".join(GET % i for i in range(20)))
        await turns()
        assert len(protocol.pipeline) == 3  # 4 parsed: one running, three queued
        assert not transport.reading
        assert counter(protocol.metrics, "sdpa_connection_reads_paused_total") == 1
        for answered in range(20):  # one answer at a time
            waiting = [r for r in app.requests if not r[2].is_set()]
            assert len(app.requests) - answered + len(protocol.pipeline) <= 4
            waiting[0][2].set()
            await turns()
        assert [path for path, _, _ in app.requests] == [f"/{i}" for i in range(20)]
        assert len(transport.responses()) == 20
        assert transport.reading  # all of it parsed: reading again

    run(scenario)


@pytest.mark.parametrize(
    ("pipelined", "refusal"),
    [
        (b"GET /2 HTTP/1.1\r\nX: " + b"a" * 2000, b"HTTP/1.1 431 Request Header Fields Too Large"),
        (
            b"GET /2 HTTP/1.1\r\n" + b"X: a\r\n" * 20,
            b"HTTP/1.1 431 Request Header Fields Too Large",
        ),
        (
            b"POST /2 HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
            b"Content-Length: 2\r\n\r\nhi",
            b"HTTP/1.1 400 Bad Request",
        ),
        (b"GET /2 HTTP/1.1\r\nHo", b"HTTP/1.1 408 Request Timeout"),  # its head's deadline
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b"HTTP/1.1 400 Bad Request"),
    ],
    ids=["header-bytes", "header-lines", "upgrade-with-body", "head-deadline", "unparsable"],
)
def test_a_pipelined_request_s_refusal_is_written_after_the_answers_before_it(
    pipelined: bytes, refusal: bytes
) -> None:
    """Before: the refusal was written, and the connection closed, while the app computed the
    request before it: the client read the refusal as that request's answer, and the answer
    was lost (RFC 9112 section 9.3.2 wants answers in request order). Now nothing more is read
    and the refusal follows the answers before it; then the connection lingers (its sending
    side closed, what the client pipelined read and dropped) before it closes: closed at once
    with those bytes unread, the kernel resets it and may drop the answers still queued."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(lingering(guarded(read_timeout_s=0.05)), app, loop)
        protocol.data_received(GET % 1 + GET % 3 + pipelined)
        await asyncio.sleep(0.1)  # past the pipelined head's deadline
        protocol.data_received(GET % 4)  # never parsed
        await turns()
        assert transport.responses() == []
        assert not transport.closed
        assert not transport.reading
        for _ in range(2):  # /1, then /3 (which started once /1 was answered)
            app.release_all()
            await turns()
        assert transport.responses() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", refusal]
        assert transport.eof_written
        assert not transport.closed
        protocol.data_received(GET % 5)  # read and dropped
        await asyncio.sleep(0.1)  # past the linger
        assert transport.closed
        assert transport.responses() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", refusal]
        assert [path for path, _, _ in app.requests] == ["/1", "/3"]

    run(scenario)


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nab\r\n0\r\n\r\n",  # a size that is not hex
        b"3 \r\nabc\r\n0\r\n\r\n",  # a space after the size
        b"1\r\nxY",  # data without its CRLF
    ],
    ids=["not-hex", "space", "no-crlf"],
)
def test_a_malformed_body_is_answered_400_by_the_app_then_the_connection_lingers(
    body: bytes,
) -> None:
    """llhttp refuses a body's framing after the app holds its request. A review found that
    refusal deferred as if it were a head's, behind the request's own answer, which never
    came: the app waited for a body never fed, and the connection was held, unevictable, for
    ever (2,048 such connections of 100 bytes locked everyone out). Now the app's body read
    raises a 400 (BadBodyFraming), the app answers it, and the connection lingers, then
    closes."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        reader = BodyReader()
        protocol, transport = connect(lingering(guarded()), reader, loop)
        protocol.data_received(CHUNKED_HEAD + body)
        await turns()
        assert transport.responses() == [b"HTTP/1.1 400 Bad Request"]
        assert "not valid HTTP/1.1 framing" in problem(transport)["detail"]
        assert reader.bodies == []
        assert transport.eof_written
        await asyncio.sleep(0.1)  # past the linger
        assert transport.closed

    run(scenario)


def test_a_malformed_body_pipelined_behind_a_held_request_is_answered_in_its_turn() -> None:
    """/1 is computing when /2's chunked body turns out malformed: /1 is answered 200, then
    /2's app reads its body and answers the 400, then the connection lingers and closes."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        reader = BodyReader()
        app = HeldApp()

        async def route(scope: Any, receive: Any, send: Any) -> None:
            target = app if scope["path"] == "/1" else reader
            await target(scope, receive, send)

        protocol, transport = connect(lingering(guarded()), route, loop)
        protocol.data_received(GET % 1 + CHUNKED_HEAD + b"zz\r\nab\r\n")
        await turns()
        assert transport.responses() == []
        app.release_all()
        await turns()
        assert transport.responses() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request"]
        await asyncio.sleep(0.1)  # past the linger
        assert transport.closed

    run(scenario)


def test_a_pipelined_refusal_behind_an_answer_that_closes_is_never_written() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(guarded(), app, loop)
        protocol.data_received(
            b"GET /1 HTTP/1.1\r\nConnection: close\r\n\r\nGET /2 HTTP/1.1\r\nX: " + b"a" * 2000
        )
        await turns()
        app.release_all()
        await turns()
        assert transport.responses() == [b"HTTP/1.1 200 OK"]
        assert transport.closed

    run(scenario)


def test_a_client_that_leaves_mid_pipeline_is_not_written_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """uvicorn tells only the latest request parsed that its client left; the guarded protocol
    tells the one answered before it too, which would otherwise write to the closed transport
    (a RuntimeError from uvloop, a traceback in the log)."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(guarded(), app, loop)
        protocol.data_received(GET % 1 + GET % 2)
        await turns()
        transport.close()  # the client reset the connection
        await turns()
        app.release_all()
        await turns()
        assert transport.responses() == []

    run(scenario)
    assert "Exception in ASGI application" not in caplog.text


def test_the_body_of_a_request_waiting_behind_another_stops_at_the_high_water_mark() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(guarded(), app, loop)
        body = b"b" * (1 << 20)
        stream = GET % 1 + b"POST /2 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        read, sent = 65536, 0
        while sent < len(stream) and transport.reading:  # a socket read at a time
            protocol.data_received(stream[sent : sent + read])
            sent += read
            await turns()
        # The first request is held by the app; the second's body stops past the mark.
        assert len(app.requests) == 1
        assert not transport.reading
        assert len(protocol.cycle.body) <= HIGH_WATER_LIMIT + read
        app.release_all()
        for _ in range(1000):  # bounded: the stream is 17 reads
            await turns()
            if sent >= len(stream):
                break
            if transport.reading:
                protocol.data_received(stream[sent : sent + read])
                sent += read
        await turns()
        assert [(path, len(got)) for path, got, _ in app.requests] == [("/1", 0), ("/2", 1 << 20)]
        app.release_all()
        await turns()

    run(scenario)


def test_headers_trickled_steadily_get_408_at_the_deadline_from_their_first_byte() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        protocol, transport = connect(guarded(read_timeout_s=0.2), HeldApp(), loop)
        started = loop.time()
        for byte in (b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"s" * 100)[:60]:
            if transport.closed:
                break
            protocol.data_received(bytes([byte]))  # every 20 ms: the idle timer never fires
            await asyncio.sleep(0.02)
        assert transport.responses() == [b"HTTP/1.1 408 Request Timeout"]
        assert "within 0.2 s of their first byte" in problem(transport)["detail"]
        assert loop.time() - started < 1.0  # 60 bytes took 1.2 s: they did not all go out
        assert counter(protocol.metrics, "sdpa_rejected_total", reason="header_timeout") == 1

    run(scenario)


def test_a_refusal_after_answers_lingers_so_the_answers_in_flight_are_not_reset() -> None:
    """Answers written on a connection may still sit in the kernel's send queue (a client that
    pipelines and reads later). Closing at once after a later refusal, with the client's bytes
    unread, resets the connection and they were lost (CI: 693 of about 12,000 answers read).
    So the refusal is written, the sending side closed, and the connection lingers."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol_class = type("Lingering", (guarded(read_timeout_s=0.2),), {"linger_s": 1.0})
        protocol, transport = connect(protocol_class, app, loop)
        protocol.data_received(GET % 1 + b"GET /2 HTTP/1.1\r\nHo")
        await turns()
        app.release_all()
        await asyncio.sleep(0.3)  # /2's head deadline
        assert transport.responses() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 408 Request Timeout"]
        assert transport.eof_written
        assert not transport.closed  # what the client still sends is read and dropped
        protocol.data_received(b"st: t\r\n\r\n" + GET % 3)
        await asyncio.sleep(1.0)
        assert transport.closed
        assert [path for path, _, _ in app.requests] == ["/1"]

    run(scenario)


def test_a_refusal_during_shutdown_closes_at_once_without_a_second_answer() -> None:
    """A head under way at shutdown, refused inside the grace (431), on a connection that
    answered before: it closes at once, not lingering. Lingering, it had closed its sending
    side, and the grace's end then wrote a 503 after it (uvloop raises on that: a review)."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol_class = type("Graceful", (guarded(),), {"shutdown_idle_grace_s": 0.1})
        protocol, transport = connect(protocol_class, app, loop)
        protocol.data_received(GET % 1)
        await turns()
        app.release_all()
        await turns()
        protocol.data_received(b"GET /2 HTTP/1.1\r\nX: ")
        protocol.shutdown()
        protocol.data_received(b"a" * 2000)  # past max_header_bytes (1024)
        await asyncio.sleep(0.2)  # the grace ends
        assert transport.responses() == [
            b"HTTP/1.1 200 OK",
            b"HTTP/1.1 431 Request Header Fields Too Large",
        ]
        assert transport.closed

    run(scenario)


def test_a_head_started_behind_a_pending_answer_is_bounded_by_its_deadline_not_keep_alive() -> None:
    """A head that starts while an answer is pending, then stalls: the answer completes and
    uvicorn, which sees no request parsed, arms its keep-alive timer. It closed the connection
    mid-head, with no answer to the head (and its close reset the answers still in the
    kernel's send queue). Now the head's deadline bounds it, and answers it 408."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        app = HeldApp()
        protocol, transport = connect(lingering(guarded(read_timeout_s=0.3)), app, loop)
        protocol.timeout_keep_alive = 0.05
        protocol.data_received(GET % 1 + b"GET /2 HTTP/1.1\r\nHo")
        await turns()
        app.release_all()
        await asyncio.sleep(0.2)  # four keep-alive timeouts; the head's deadline not yet
        assert not transport.closed
        await asyncio.sleep(0.15)
        assert transport.responses() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 408 Request Timeout"]

    run(scenario)


def test_at_the_cap_the_connection_doing_least_is_closed_and_the_newcomer_admitted() -> None:
    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        protocol_class = guarded(max_connections=3)
        state = ServerState()
        app = HeldApp()
        idle, idle_transport = connect(protocol_class, app, loop, state)
        idle.data_received(GET % 0)
        await turns()
        app.release_all()
        await turns()  # answered: idle between keep-alive requests
        busy, busy_transport = connect(protocol_class, app, loop, state)
        busy.data_received(GET % 1)  # the app holds it
        slow, slow_transport = connect(protocol_class, app, loop, state)
        slow.data_received(b"GET /2 HTTP/1.1\r\nHo")  # headers incomplete

        # Headers incomplete go first (408), the longest-waiting of them.
        _, first = connect(protocol_class, app, loop, state)
        assert slow_transport.responses() == [b"HTTP/1.1 408 Request Timeout"]
        assert "SDPA_MAX_CONNECTIONS" in problem(slow_transport)["detail"]
        await turns()
        # A connection that sent nothing yet counts as one whose headers are incomplete.
        second, second_transport = connect(protocol_class, app, loop, state)
        assert first.responses() == [b"HTTP/1.1 408 Request Timeout"]
        await turns()
        second.data_received(GET % 2)  # now the app holds it
        await turns()
        # Then the one idle longest between keep-alive requests (503: it may retry at once).
        third, third_transport = connect(protocol_class, app, loop, state)
        assert idle_transport.responses()[-1] == b"HTTP/1.1 503 Service Unavailable"
        assert not busy_transport.closed
        assert not second_transport.closed
        assert not third_transport.closed
        await turns()
        third.data_received(GET % 3)
        await turns()
        # Every connection has a request in the app: the next one is refused.
        _, refused = connect(protocol_class, app, loop, state)
        assert refused.responses() == [b"HTTP/1.1 503 Service Unavailable"]
        assert b"retry-after: 1" in refused.written
        assert counter(protocol_class.metrics, "sdpa_rejected_total", reason="connections") == 4
        app.release_all()
        await turns()

    run(scenario)


def test_the_cap_finds_its_victim_without_looking_at_every_connection() -> None:
    """Before, each newcomer at the cap asked every connection whether it was closing and how
    little it did (4.4 ms of event loop per newcomer at 2,048 connections, bench's cap-flood);
    now the candidates are kept in order and the first is taken, however many there are."""

    async def scenario(loop: asyncio.AbstractEventLoop) -> None:
        protocol_class = guarded(max_connections=500)
        state = ServerState()
        app = HeldApp()
        held = [connect(protocol_class, app, loop, state)[1] for _ in range(500)]
        for newcomer in range(3):
            MemoryTransport.closing_checks = 0
            connect(protocol_class, app, loop, state)
            assert MemoryTransport.closing_checks <= 2
            # The longest-waiting (the first accepted) goes first, as before.
            assert held[newcomer].responses() == [b"HTTP/1.1 408 Request Timeout"]
            assert not held[newcomer + 1].closed
        for transport in held:
            transport.close()
        await turns()

    run(scenario)
