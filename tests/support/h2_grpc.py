"""A raw HTTP/2 gRPC client (the `h2` package on a plain socket), for the gRPC door's abuse tests:
it sends what grpc's own client never would (a message's first bytes only, a gzip bomb, streams
reset as soon as they open, a window it never opens) and reports what came back.
"""

from __future__ import annotations

import gzip
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
# The most one send() hands the socket, however wide the windows: sendall stays short.
SEND_AT_ONCE = 1 << 20


def frame(message: bytes, *, compressed: bool = False) -> bytes:
    """gRPC's length-prefixed message: a compressed flag, a 4-byte big-endian length, the bytes."""
    return struct.pack(">?I", compressed, len(message)) + message


def gzip_frame(message: bytes) -> bytes:
    return frame(gzip.compress(message, compresslevel=9), compressed=True)


def call_headers(
    port: int, *, key: str | None = None, extra: tuple[tuple[str, str], ...] = ()
) -> list[tuple[str, str]]:
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", INFER_PATH),
        (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if key is not None:
        headers.append(("authorization", f"Bearer {key}"))
    return headers + list(extra)


@dataclass
class Stream:
    """What came back on one stream."""

    headers: dict[str, str] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    reset: int | None = None
    ended: bool = False

    @property
    def status(self) -> str | None:
        """grpc-status, from the trailers (or a trailers-only answer's headers)."""
        return self.headers.get("grpc-status")


class RawGrpc:
    """One HTTP/2 connection to the gRPC door. `window`: the flow-control window this client
    gives the server (None: h2's default, opened again as data is read)."""

    def __init__(self, port: int, *, window: int | None = None, timeout: float = 10) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config=config)
        self.reads = window is None
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.streams: dict[int, Stream] = {}
        self.goaway: Any = None
        self.closed = False
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(self, headers: list[tuple[str, str]], body: bytes = b"", *, end: bool = True) -> int:
        """A new stream with these headers and as much of `body` as the windows let through."""
        stream_id = self.conn.get_next_available_stream_id()
        self.streams[stream_id] = Stream()
        self.conn.send_headers(stream_id, headers, end_stream=not body and end)
        if body:
            self.send(stream_id, body, end=end)
        self.flush()
        return stream_id

    def send(self, stream_id: int, body: bytes, *, end: bool) -> int:
        """Send what the flow-control windows allow of `body` -> the bytes sent (none once the
        server has closed the stream)."""
        sent = 0
        try:
            window = self.conn.local_flow_control_window(stream_id)
            allowed = min(len(body), window, SEND_AT_ONCE)
            size = self.conn.max_outbound_frame_size
            while sent < allowed:
                chunk = body[sent : min(allowed, sent + size)]
                self.conn.send_data(stream_id, chunk)
                sent += len(chunk)
            if end and sent == len(body):
                self.conn.end_stream(stream_id)
        except h2.exceptions.StreamClosedError:
            self.streams[stream_id].ended = True
        self.flush()
        return sent

    def send_all(self, stream_id: int, body: bytes, *, seconds: float, end: bool = True) -> int:
        """Send `body` as the server opens its windows, for up to `seconds` -> bytes sent."""
        give_up = time.monotonic() + seconds
        sent = 0
        stream = self.streams[stream_id]
        while time.monotonic() < give_up and not (self.closed or stream.ended or stream.reset):
            try:
                sent += self.send(stream_id, body[sent:], end=end)
            except TimeoutError:  # the server has stopped reading this connection
                break
            if sent == len(body):
                break
            self.pump(0.02)
        return sent

    def reset(self, stream_id: int) -> None:
        self.conn.reset_stream(stream_id, error_code=8)  # CANCEL
        self.flush()

    def pump(self, seconds: float) -> None:
        """Read and handle what the server sends, for up to `seconds`."""
        give_up = time.monotonic() + seconds
        while not self.closed and (left := give_up - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                return
            except OSError:
                self.closed = True
                return
            if not data:
                self.closed = True
                return
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError:  # frames after the connection ended
                self.closed = True
                return
            for event in events:
                self._handle(event)
            self.flush()

    def wait(self, stream_id: int, seconds: float) -> Stream:
        """Pump until the stream has ended (or was reset), or `seconds` passed."""
        give_up = time.monotonic() + seconds
        stream = self.streams[stream_id]
        while not (stream.ended or stream.reset is not None or self.closed):
            left = give_up - time.monotonic()
            if left <= 0:
                break
            self.pump(min(left, 0.2))
        return stream

    def _handle(self, event: Any) -> None:
        stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            if stream is not None:
                stream.headers.update(dict(event.headers))
        elif isinstance(event, h2.events.DataReceived):
            if stream is not None:
                stream.data += event.data
            if self.reads:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            if stream is not None:
                stream.ended = True
        elif isinstance(event, h2.events.StreamReset):
            if stream is not None:
                stream.reset = event.error_code
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event

    def close(self) -> None:
        self.sock.close()
