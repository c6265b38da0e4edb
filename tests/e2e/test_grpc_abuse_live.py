"""The gRPC door under attack, against a real `sdpa-service serve` on loopback: raw HTTP/2 (the
`h2` package, tests.support.h2_grpc) where grpc's own client cannot misbehave enough.

Each attack of issue 40 is replayed and the server's answer checked: the gRPC status, the
refusal counted in sdpa_rejected_total, the server's RSS within its bounds, a keyed bystander
served throughout. Memory bounds: SDPA_MAX_INFLIGHT_BYTES = 64 MiB, SDPA_MAX_BODY_BYTES =
32 MiB (one message read at a time: service.grpc_limits.ReadSlots).

Bounded: every wait has a deadline, every loop a count; loopback only.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from multiprocessing.queues import Queue
from typing import Any

import httpx
import numpy as np
import pytest

from service.wire.grpc import grpc_predict_v2_pb2 as pb
from tests.support.app import API_SERVER_ENV
from tests.support.attack import memory_kb, reset_peak
from tests.support.live_server import LiveServer, free_port, live_server

h2_grpc = pytest.importorskip("tests.support.h2_grpc")
pytest.importorskip("tritonclient.grpc")

pytestmark = pytest.mark.xdist_group("grpc-abuse")

API_KEY = "grpc-abuse-key"
MiB = 1 << 20
MAX_BODY = 32 * MiB
MAX_INFLIGHT = 64 * MiB
MAX_CONNECTIONS = 48
# gRPC's status codes as numbers (the trailers carry them so).
UNAUTHENTICATED, DEADLINE_EXCEEDED, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, OK = (
    "16", "4", "3", "8", "0",
)  # fmt: skip


class Door:
    def __init__(self, server: LiveServer, port: int) -> None:
        self.server = server
        self.port = port
        self.target = f"127.0.0.1:{port}"

    def rejected(self, reason: str) -> float:
        series = f'sdpa_rejected_total{{reason="{reason}"}} '
        headers = {"Authorization": f"Bearer {API_KEY}"}
        text = httpx.get(f"{self.server.url}/metrics", headers=headers, timeout=10).text
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(series)]
        return values[0] if values else 0.0

    def reset_peak_mb(self) -> float:
        """The server's RSS now, its peak reset to it."""
        return reset_peak(self.server) / 1024

    def peak_mb(self) -> float:
        return memory_kb(self.server)["VmHWM"] / 1024

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.server.process.pid}/fd"))


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    port = free_port()
    env = {
        **API_SERVER_ENV,
        "SDPA_API_KEYS": API_KEY,
        "SDPA_GRPC_PORT": str(port),
        "SDPA_MAX_BODY_BYTES": str(MAX_BODY),
        "SDPA_MAX_INFLIGHT_BYTES": str(MAX_INFLIGHT),
        "SDPA_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "SDPA_READ_TIMEOUT_S": "3",
        "SDPA_SEND_TIMEOUT_S": "2",
        "SDPA_LOG_LEVEL": "info",
    }
    with live_server(env, tmp_path=tmp_path_factory.mktemp("grpc-abuse")) as server:
        yield Door(server, port)


def infer_message(shape: tuple[int, ...] = (1, 2, 8, 16)) -> bytes:
    """A valid ModelInferRequest: q, k, v of `shape`, FP32, in raw_input_contents."""
    rng = np.random.default_rng(0)
    request = pb.ModelInferRequest(model_name="attention")
    for name in ("q", "k", "v"):
        request.inputs.add(name=name, datatype="FP32", shape=list(shape))
        request.raw_input_contents.append(rng.standard_normal(shape).astype(np.float32).tobytes())
    return request.SerializeToString()


def one_call(door: Door, message: bytes, *, key: str | None = API_KEY, **kw: Any) -> Any:
    client = h2_grpc.RawGrpc(door.port, window=kw.pop("window", None))
    try:
        stream_id = client.open(h2_grpc.call_headers(door.port, key=key, **kw), b"", end=False)
        client.send_all(stream_id, message, seconds=20)
        return client.wait(stream_id, 20)
    finally:
        client.close()


def test_a_valid_call_over_raw_http2_is_answered(door: Door) -> None:
    stream = one_call(door, h2_grpc.frame(infer_message()))
    assert stream.status == OK, stream.headers
    answer = pb.ModelInferResponse.FromString(bytes(stream.data[5:]))
    assert [output.name for output in answer.outputs] == ["output"]


def test_unkeyed_callers_hold_nothing_while_their_messages_trickle(door: Door) -> None:
    """20 calls without a key, each declaring a 30 MB message and sending what the window
    lets through, then nothing: each is refused at once (UNAUTHENTICATED), none is read."""
    before_rss, before = door.reset_peak_mb(), door.rejected("unauthorized")
    prefix = h2_grpc.frame(b"\x00" * (30 * 1000 * 1000))
    clients = [h2_grpc.RawGrpc(door.port) for _ in range(20)]
    try:
        streams = [
            (client, client.open(h2_grpc.call_headers(door.port), prefix, end=False))
            for client in clients
        ]
        for client, stream_id in streams:
            assert client.wait(stream_id, 10).status == UNAUTHENTICATED
        growth = door.peak_mb() - before_rss
    finally:
        for client in clients:
            client.close()
    assert door.rejected("unauthorized") - before == 20
    assert growth < 32, f"RSS grew {growth:.0f} MB"


def test_a_keyed_message_that_never_arrives_whole_is_dropped_at_the_read_timeout(
    door: Door,
) -> None:
    """Four keyed calls declaring 30 MB messages and sending part of them: one is read at a time
    (64 MiB over twice 32 MiB), and each is dropped at SDPA_READ_TIMEOUT_S (DEADLINE_EXCEEDED)."""
    before = door.rejected("read_timeout")
    prefix = h2_grpc.frame(b"\x00" * (30 * 1000 * 1000))[: 4 * MiB]
    clients = [h2_grpc.RawGrpc(door.port) for _ in range(4)]
    try:
        streams = []
        for client in clients:
            stream_id = client.open(h2_grpc.call_headers(door.port, key=API_KEY), b"", end=False)
            streams.append((client, stream_id))
        sent_at = time.monotonic()
        while time.monotonic() - sent_at < 1.0:  # what the windows let through, for a second
            for client, stream_id in streams:
                client.send(stream_id, prefix, end=False)
                client.pump(0.05)
        results = [client.wait(stream_id, 15) for client, stream_id in streams]
    finally:
        for client in clients:
            client.close()
    assert [r.status for r in results] == [DEADLINE_EXCEEDED] * 4, [r.headers for r in results]
    assert "SDPA_READ_TIMEOUT_S" in results[0].headers.get("grpc-message", "")
    assert door.rejected("read_timeout") - before == 4


def test_a_peer_that_never_reads_its_answer_is_dropped_at_the_send_timeout(door: Door) -> None:
    """A keyed call whose client gives the server a 16-byte window and never opens it: the
    answer (128 KiB of output) cannot leave; at SDPA_SEND_TIMEOUT_S the call is dropped, the
    answer freed, a 499 logged and `send_timeout` counted."""
    before = door.rejected("send_timeout")
    stream = one_call(door, h2_grpc.frame(infer_message((1, 4, 128, 64))), window=16)
    # grpc-core keeps the answer's bytes queued behind the closed window (aio cannot reset the
    # stream): the client sees no status, and the connection's age bounds the rest.
    assert stream.status is None
    assert len(stream.data) <= 16
    assert door.rejected("send_timeout") - before == 1
    log = door.server.log()
    assert "SDPA_SEND_TIMEOUT_S" in log
    assert '"route":"grpc:ModelInfer","status":499' in log


def test_gzip_bombs_without_a_key_inflate_nothing(door: Door) -> None:
    """12 gzip messages of about 30 KB that would inflate to 30 MB each, without a key:
    refused before they are read, so never inflated."""
    bomb = h2_grpc.gzip_frame(b"\x00" * (30 * 1000 * 1000))
    gzip_headers = (("grpc-encoding", "gzip"),)
    before_rss = door.reset_peak_mb()
    clients = [h2_grpc.RawGrpc(door.port) for _ in range(12)]
    try:
        streams = [
            (client, client.open(h2_grpc.call_headers(door.port, extra=gzip_headers), bomb))
            for client in clients
        ]
        results = [client.wait(stream_id, 30) for client, stream_id in streams]
        growth = door.peak_mb() - before_rss
    finally:
        for client in clients:
            client.close()
    assert [r.status for r in results] == [UNAUTHENTICATED] * 12
    assert growth < 32, f"RSS grew {growth:.0f} MB"


def test_keyed_gzip_bombs_are_read_one_at_a_time_and_refused(door: Door) -> None:
    """12 keyed gzip messages of about 30 KB that inflate to 30 MB of zeros (not a message:
    INVALID_ARGUMENT), and one that inflates past SDPA_MAX_BODY_BYTES (RESOURCE_EXHAUSTED).
    Their peak RSS is measured by bench/attacks.py (glibc keeps the freed 30 MB chunks in its
    arenas until the heap is trimmed)."""
    under = h2_grpc.gzip_frame(b"\x00" * (30 * 1000 * 1000))
    over = h2_grpc.gzip_frame(b"\x00" * (MAX_BODY + MiB))
    gzip_headers = (("grpc-encoding", "gzip"),)
    clients = [h2_grpc.RawGrpc(door.port) for _ in range(13)]
    try:
        streams = [
            (client, client.open(h2_grpc.call_headers(door.port, key=API_KEY, extra=gzip_headers),
                                 over if index == 12 else under))
            for index, client in enumerate(clients)
        ]  # fmt: skip
        results = [client.wait(stream_id, 30) for client, stream_id in streams]
    finally:
        for client in clients:
            client.close()
    assert [r.status for r in results[:12]] == [INVALID_ARGUMENT] * 12
    assert results[12].status == RESOURCE_EXHAUSTED, results[12].headers


def test_a_crafted_message_of_empty_inputs_is_refused_by_its_count(door: Door) -> None:
    """4 MiB of empty `inputs` entries (2 million of them): refused by their count before
    protobuf parses the message."""
    message = b"\x0a\x09attention" + b"\x2a\x00" * (2 * MiB)
    stream = one_call(door, h2_grpc.frame(message))
    assert stream.status == INVALID_ARGUMENT
    assert "more than 6 inputs" in stream.headers["grpc-message"]


def _bystander(target: str, ready: Any, stop: Any, results: Queue[tuple[int, list[str]]]) -> None:
    import tritonclient.grpc as grpcclient

    rng = np.random.default_rng(1)
    client = grpcclient.InferenceServerClient(target)
    arrays = [rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3)]
    ok, failures = 0, []
    while not stop.is_set():
        inputs = []
        for name, array in zip(("q", "k", "v"), arrays, strict=True):
            tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            client.infer(
                "attention", inputs, headers={"authorization": f"Bearer {API_KEY}"},
                client_timeout=30,
            )  # fmt: skip
            ok += 1
            ready.set()
        except Exception as exc:
            failures.append(repr(exc)[:200])
        time.sleep(0.02)
    client.close()
    results.put((ok, failures))


def test_rapid_reset_spares_a_keyed_bystander(door: Door) -> None:
    """Streams opened without a key and reset at once, as fast as one client can (rapid reset,
    CVE-2023-44487), while a keyed bystander on a connection of its own calls ModelInfer: none
    of the bystander's calls fails."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    results: Queue[tuple[int, list[str]]] = context.Queue()
    bystander = context.Process(
        target=_bystander, args=(door.target, ready, stop, results), daemon=True
    )
    bystander.start()
    assert ready.wait(60)  # its first call answered (it imports tritonclient first)
    attacker = h2_grpc.RawGrpc(door.port)
    opened = 0
    try:
        give_up = time.monotonic() + 5.0
        while time.monotonic() < give_up and not attacker.closed and opened < 50_000:
            for _ in range(100):
                stream_id = attacker.conn.get_next_available_stream_id()
                attacker.conn.send_headers(stream_id, h2_grpc.call_headers(door.port))
                attacker.conn.reset_stream(stream_id, error_code=8)
                opened += 1
            try:
                attacker.flush()
            except OSError:
                break
            attacker.pump(0.001)
    finally:
        attacker.close()
        time.sleep(0.5)
        stop.set()
        ok, failures = results.get(timeout=60)
        bystander.join(timeout=30)
    print(f"rapid reset: {opened} streams reset; bystander {ok} calls; GOAWAY {attacker.goaway}")
    assert opened > 1000
    assert ok > 1
    assert failures == []


def test_connections_past_the_cap_are_closed_and_http_still_answers(door: Door) -> None:
    """Twice SDPA_MAX_CONNECTIONS idle HTTP/2 connections: those past the cap are closed by the
    server, its descriptors stay bounded, and the HTTP door still answers."""
    before = door.descriptors()
    clients = []
    try:
        for _ in range(2 * MAX_CONNECTIONS):
            clients.append(h2_grpc.RawGrpc(door.port))
        for client in clients:
            client.pump(0.05)
        time.sleep(1.0)
        for client in clients:
            client.pump(0.05)
        open_ones = sum(not client.closed for client in clients)
        grown = door.descriptors() - before
        health = httpx.get(f"{door.server.url}/v2/health/ready", timeout=10)
    finally:
        for client in clients:
            client.close()
    assert open_ones <= MAX_CONNECTIONS, open_ones
    assert grown <= MAX_CONNECTIONS + 8, grown
    assert health.status_code == 200
