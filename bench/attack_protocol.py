"""Attacks below the application (the HTTP/1.1 protocol layer) against a real server, measured:
how each bound answers, what the server's memory does, whether another client is still served,
and how long the server takes to exit when SIGTERM comes in the middle of the attack.

    .venv/bin/python bench/attacks.py huge-header    # ~15 s: one header value streamed
    .venv/bin/python bench/attacks.py many-headers   # ~15 s: header lines streamed
    .venv/bin/python bench/attacks.py trickle        # ~25 s: 20 clients, a byte / 1.5 s
    .venv/bin/python bench/attacks.py pipeline       # ~15 s: GET /healthz never read
    .venv/bin/python bench/attacks.py sigterm        # ~90 s: SIGTERM during each attack
    .venv/bin/python bench/attacks.py slow-body      # ~45 s: 2,048 bodies, a byte / 5 s each
    .venv/bin/python bench/attacks.py cap-flood      # ~20 s: connections churned at the cap
    .venv/bin/python bench/attacks.py tiny-chunks    # ~20 s: chunked bodies of 1-byte chunks
    .venv/bin/python bench/attacks.py all

For every attack a bystander (its own keep-alive connection, a fresh one whenever the server
closed it) sends GET /healthz every 0.15 s; printed: the status of the bound's answer and when it
came, the server's peak RSS growth (VmHWM, reset before the attack), the bystander's p50 / p99 /
max and failures, the 500s and tracebacks in the server's log; with SIGTERM, the exit code and
the seconds from the signal to the exit.

huge-header: `X-Big: aaaa...` streamed at full speed (64 KiB sends) for at most 64 MiB or 10 s.
many-headers: `X-N: v` lines streamed the same way, for at most 256 MiB or 10 s.
trickle: SDPA_MAX_CONNECTIONS=20 and SDPA_READ_TIMEOUT_S=5; 20 clients each send one byte of a
request's headers every 1.5 s, and reconnect whenever the server closes them, for 20 s.
pipeline: one connection sends pipelined `GET /healthz` as fast as the server reads them and
never reads an answer, for 10 s (SDPA_SEND_TIMEOUT_S=60, the default, outlasts it).
sigterm: SIGTERM 2 s into each of the above (the trickle with its default read timeout) and 0.5 s
after a 128 MiB JSON-list body was sent (its decoding runs on a worker thread for seconds).
slow-body: the defaults (a cap of 2,048 connections, SDPA_READ_TIMEOUT_S=15,
SDPA_MIN_BODY_RATE=32768); 2,048 connections each send a POST's head with Content-Length: 1000
and then one byte of its body every 5 s (under the idle timer), for 30 s, never reconnecting;
printed: how long the server kept them, what they sent in all, the body_too_slow refusals, and a
bystander's statuses (503 while every connection is busy, 200 once the bodies' deadlines closed
them). Before SDPA_MIN_BODY_RATE, 205 B/s in all held the cap for as long as the attacker liked.
cap-flood: the default cap; two threads open connections that send nothing, as fast as they can
with at most twice the cap open, for 8 s; each newcomer at the cap closes the connection waiting
longest (O(1), not a scan of every connection: 4.4 ms per newcomer at 2,048 did); printed: the
connections opened and closed by the server per second, and the keep-alive bystander.

tiny-chunks: two clients send POST /v1/attention with a chunked body of 1-byte chunks (6 wire
bytes each) as fast as the server reads, for 8 s, reconnecting after each answer; printed: the
answers, the bytes sent, and the bystander (each chunk costs the protocol layer Python time
whatever its size: before the chunk rule a 240 KB read held the event loop 131 ms).

Every loop is bounded in time and count; the server listens on 127.0.0.1. Importable: each
attack is a function that starts its own server (bench/attacks.py runs them).
"""

from __future__ import annotations

import collections
import contextlib
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import (  # noqa: E402
    BenchServer,
    Bystander,
    attacked_server,
    log_summary,
    memory_mb,
    metric,
    reset_peak,
)

MiB = 2**20
HEAD = b"GET /healthz HTTP/1.1\r\nHost: bench\r\n"
PIPELINED = b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n"


def address(server: BenchServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_answer(sock: socket.socket) -> bytes:
    """What the server has sent so far (b"" once it closed), without blocking."""
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b"?"  # nothing yet
    except OSError:
        return b""
    finally:
        sock.setblocking(True)


@dataclass
class StreamResult:
    answer: bytes = b""  # the first bytes the server sent back
    answered_after_s: float | None = None
    sent_bytes: int = 0


def stream_header(
    server: BenchServer,
    piece: bytes,
    *,
    max_bytes: int,
    seconds: float,
    stop: threading.Event | None = None,
) -> StreamResult:
    """Send HEAD, then `piece` over and over (64 KiB sends) until the server answers or closes,
    `max_bytes` went out, `seconds` passed, or `stop` is set."""
    result = StreamResult()
    chunk = piece * max(1, 65536 // len(piece))
    started = time.monotonic()
    with socket.create_connection(address(server), timeout=1) as sock:
        sock.sendall(HEAD)
        result.sent_bytes = len(HEAD)
        while result.sent_bytes < max_bytes and time.monotonic() - started < seconds:
            if stop is not None and stop.is_set():
                break
            try:
                sock.sendall(chunk)
                result.sent_bytes += len(chunk)
            except TimeoutError:
                pass  # the server stopped reading: see whether it answered
            except OSError:
                pass  # reset: it answered and closed
            reply = read_answer(sock)
            if reply != b"?":
                result.answer = reply
                result.answered_after_s = time.monotonic() - started
                break
        if result.answered_after_s is None:  # give it a moment to answer what was sent
            sock.settimeout(2)
            with contextlib.suppress(OSError):
                result.answer = sock.recv(65536)
                result.answered_after_s = time.monotonic() - started
    return result


def status_of(answer: bytes) -> str:
    if not answer:
        return "closed without an answer"
    first = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    return first[:60]


def header_attack(name: str, piece: bytes, max_bytes: int) -> None:
    with attacked_server({}) as server:
        info = httpx.get(f"{server.url}/v1/info").json()["limits"]
        bounds = {key: info.get(key) for key in ("max_header_bytes", "max_headers")}
        print(f"== {name}: limits {bounds}")
        refused_before = metric(server, 'sdpa_rejected_total{reason="header_too_large"}')
        baseline = reset_peak(server)
        with Bystander(server.url, small=False) as bystander:
            result = stream_header(server, piece, max_bytes=max_bytes, seconds=10)
            time.sleep(0.5)
        growth = memory_mb(server)["VmHWM"] - baseline
        refused = metric(server, 'sdpa_rejected_total{reason="header_too_large"}')
        when = "never" if result.answered_after_s is None else f"{result.answered_after_s:.2f} s"
        sent = result.sent_bytes / MiB
        print(
            f"answer: {status_of(result.answer)} after {when}, {sent:.1f} MiB sent; "
            f"counted {refused - refused_before:g}"
        )
        print(f"peak RSS growth: {growth:.0f} MiB")
        print(bystander.summary())
        print(log_summary(server.log()))


def huge_header() -> None:
    header_attack("huge header value", b"a", 64 * MiB)


def many_headers() -> None:
    header_attack("many header lines", b"X-N: v\r\n", 256 * MiB)


def reconnect(
    server: BenchServer, stop: threading.Event, answers: collections.Counter[str]
) -> socket.socket | None:
    """A new connection to the server; None (counted, after a short wait) when none is made."""
    try:
        return socket.create_connection(address(server), timeout=1)
    except OSError:
        answers["connect failed"] += 1
        stop.wait(0.1)
        return None


def trickler(
    server: BenchServer,
    stop: threading.Event,
    answers: collections.Counter[str],
    period_s: float = 1.5,
) -> None:
    """Send one byte of HEAD every period_s; reconnect whenever the server closes."""
    while not stop.is_set():
        sock = reconnect(server, stop, answers)
        if sock is None:
            continue
        with sock:
            for byte in HEAD * 1000:  # bounded: the loop ends on stop or a close long before
                if stop.is_set():
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    answers["reset"] += 1
                    break
                reply = read_answer(sock)
                if reply != b"?":
                    answers[status_of(reply)[:32]] += 1
                    break
                stop.wait(period_s)


def trickle(read_timeout_s: float = 5.0, seconds: float = 20.0) -> None:
    env = {"SDPA_MAX_CONNECTIONS": "20", "SDPA_READ_TIMEOUT_S": str(read_timeout_s)}
    with attacked_server(env) as server:
        print(
            f"== 20 trickling clients, SDPA_MAX_CONNECTIONS=20, SDPA_READ_TIMEOUT_S="
            f"{read_timeout_s:g}, {seconds:g} s"
        )
        stop = threading.Event()
        answers: collections.Counter[str] = collections.Counter()
        threads = [
            threading.Thread(target=trickler, args=(server, stop, answers)) for _ in range(20)
        ]
        baseline = reset_peak(server)
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # every trickler connected
        with Bystander(server.url, small=False) as bystander:
            time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        growth = memory_mb(server)["VmHWM"] - baseline
        rejected = {
            reason: metric(server, f'sdpa_rejected_total{{reason="{reason}"}}')
            for reason in ("header_timeout", "read_timeout", "connections")
        }
        print("the tricklers were answered:", dict(answers))
        print("refusals counted:", rejected)
        print(f"peak RSS growth: {growth:.0f} MiB")
        print(bystander.summary())
        print(log_summary(server.log()))


def flood_pipeline(
    server: BenchServer, seconds: float, stop: threading.Event | None = None
) -> tuple[int, float | None]:
    """Pipelined GET /healthz on one connection for `seconds`, never reading an answer ->
    (requests sent, seconds until the server first stopped reading)."""
    batch = PIPELINED * 256
    sent = 0
    first_stall: float | None = None
    started = time.monotonic()
    with socket.create_connection(address(server), timeout=0.5) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        while time.monotonic() - started < seconds and not (stop and stop.is_set()):
            try:
                sock.sendall(batch)
                sent += 256
            except TimeoutError:
                if first_stall is None:
                    first_stall = time.monotonic() - started
            except OSError:
                break
    return sent, first_stall


def pipeline(seconds: float = 10.0) -> None:
    with attacked_server({}) as server:
        print(f"== pipelined GET /healthz, never read, {seconds:g} s")
        paused_before = metric(server, "sdpa_connection_reads_paused_total")
        baseline = reset_peak(server)
        with Bystander(server.url, small=False) as bystander:
            sent, stalled = flood_pipeline(server, seconds)
        growth = memory_mb(server)["VmHWM"] - baseline
        paused = metric(server, "sdpa_connection_reads_paused_total") - paused_before
        stall = "never" if stalled is None else f"after {stalled:.2f} s"
        print(
            f"sent {sent} requests ({sent * len(PIPELINED) / MiB:.1f} MiB); the server stopped "
            f"reading {stall}; reads paused {paused:g} times"
        )
        print(f"peak RSS growth: {growth:.0f} MiB")
        print(bystander.summary())
        print(log_summary(server.log()))


def json_list_body(mib: int = 128) -> bytes:
    """A v1 attention body whose q, k and v are [1, N, 1] nested JSON lists, about `mib` MiB in
    all: single-element rows are the slowest shape to decode (about 20 s for 128 MiB here)."""
    row = b"[0.123456789]"
    rows = (mib * MiB) // 3 // (len(row) + 1)
    tensor = b"[[" + b",".join([row] * rows) + b"]]"
    return b'{"q": ' + tensor + b', "k": ' + tensor + b', "v": ' + tensor + b"}"


def sigterm_during(
    name: str,
    attack: Callable[[BenchServer, threading.Event], object],
    env: dict[str, str],
    after_s: float = 2.0,
) -> None:
    with attacked_server(env) as server:
        stop = threading.Event()
        thread = threading.Thread(target=attack, args=(server, stop), daemon=True)
        thread.start()
        with Bystander(server.url, small=False) as bystander:
            time.sleep(after_s)
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            try:
                code: int | str = server.process.wait(timeout=120)
            except subprocess.TimeoutExpired:  # reported; live_server kills it
                code = "still running after 120 s"
            exited_s = time.monotonic() - signalled
        stop.set()
        thread.join(timeout=10)
        log = server.log()
        print(
            f"== SIGTERM during {name}: exit {code} after {exited_s:.1f} s; "
            f"{bystander.summary()}; {log_summary(log)}"
        )


def sigterm() -> None:
    def huge(server: BenchServer, stop: threading.Event) -> None:
        stream_header(server, b"a", max_bytes=2**40, seconds=120, stop=stop)

    def trickling(server: BenchServer, stop: threading.Event) -> None:
        trickler(server, stop, collections.Counter(), period_s=0.5)

    def flood(server: BenchServer, stop: threading.Event) -> None:
        flood_pipeline(server, 120, stop)

    body = json_list_body()

    def json_body(server: BenchServer, stop: threading.Event) -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{server.url}/v1/attention",
                content=body,
                headers={"content-type": "application/json"},
                timeout=120,
            )

    sigterm_during("a huge header streaming", huge, {})
    sigterm_during("a header trickling (a byte / 0.5 s)", trickling, {})
    sigterm_during("a pipelined flood never read", flood, {})
    print(f"(the JSON-list body: {len(body) / MiB:.0f} MiB)")
    sigterm_during(
        "a 128 MiB JSON-list body decoding",
        json_body,
        {"SDPA_MAX_BODY_BYTES": str(256 * MiB)},
        after_s=3.0,
    )


def raise_descriptor_limit(wanted: int) -> None:
    """Room for `wanted` sockets on both sides (the server inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, wanted)), hard))


SLOW_BODY_HEAD = (
    b"POST /v1/attention HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{"
)


def slow_body(connections: int = 2048, gap_s: float = 5.0, seconds: float = 30.0) -> None:
    raise_descriptor_limit(2 * connections + 256)
    with attacked_server({}) as server:
        limits = httpx.get(f"{server.url}/v1/info").json()["limits"]
        bounds = {key: limits.get(key) for key in ("max_connections", "read_timeout_s")}
        bounds["min_body_rate"] = limits.get("min_body_rate", "none (older code)")
        print(
            f"== {connections} slow bodies, a byte every {gap_s:g} s each, {seconds:g} s: {bounds}"
        )
        too_slow = metric(server, 'sdpa_rejected_total{reason="body_too_slow"}')
        started = time.monotonic()
        socks = [socket.create_connection(address(server), timeout=5) for _ in range(connections)]
        for sock in socks:
            sock.sendall(SLOW_BODY_HEAD)
            sock.setblocking(False)
        sent = len(SLOW_BODY_HEAD) * connections
        kept_s: list[float] = []
        open_ones = dict.fromkeys(socks)
        with Bystander(server.url) as bystander:
            next_byte = time.monotonic() + gap_s
            while open_ones and time.monotonic() - started < seconds:  # bounded in time
                for sock in list(open_ones):
                    try:
                        closed = sock.recv(65536) == b""
                    except BlockingIOError:
                        closed = False
                    except OSError:
                        closed = True
                    if closed:
                        kept_s.append(time.monotonic() - started)
                        del open_ones[sock]
                if time.monotonic() >= next_byte:
                    for sock in open_ones:
                        with contextlib.suppress(OSError):
                            sent += sock.send(b" ")
                    next_byte += gap_s
                time.sleep(0.05)
            attack_s = time.monotonic() - started
        for sock in socks:
            sock.close()
        kept_s.sort()
        held = (
            f"closed by the server: {len(kept_s)}, after {kept_s[0]:.1f} to {kept_s[-1]:.1f} s"
            if kept_s
            else "none closed by the server"
        )
        print(
            f"{held}; still open at the end: {len(open_ones)}; the attacker sent "
            f"{sent} B ({sent / attack_s:.0f} B/s)"
        )
        refused = metric(server, 'sdpa_rejected_total{reason="body_too_slow"}') - too_slow
        print(f"body_too_slow refusals: {refused:g}")
        print(bystander.summary())
        print(log_summary(server.log()))


def cap_flood(seconds: float = 8.0) -> None:
    with attacked_server({}) as server:
        cap = int(httpx.get(f"{server.url}/v1/info").json()["limits"]["max_connections"])
        raise_descriptor_limit(4 * cap + 256)
        print(
            f"== connections that send nothing, at most {2 * cap} open, {seconds:g} s (cap {cap})"
        )
        opened = collections.Counter[str]()
        lock = threading.Lock()

        def attacker(stop_at: float) -> None:
            selector = selectors.DefaultSelector()
            live = made = lost = 0
            while time.monotonic() < stop_at:  # bounded in time
                if live < cap:  # two attackers: at most twice the cap open
                    sock = socket.socket()
                    sock.setblocking(False)
                    sock.connect_ex(address(server))
                    selector.register(sock, selectors.EVENT_READ)
                    live, made = live + 1, made + 1
                for key, _ in selector.select(0):
                    selector.unregister(key.fileobj)
                    key.fileobj.close()  # type: ignore[union-attr]
                    live, lost = live - 1, lost + 1
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            with lock:
                opened.update(opened=made, closed=lost)

        with Bystander(server.url, small=False, every_s=0.1) as bystander:
            stop_at = time.monotonic() + seconds
            threads = [threading.Thread(target=attacker, args=(stop_at,)) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=seconds + 30)
        made_room = metric(server, 'sdpa_rejected_total{reason="connections"}')
        print(
            f"opened {opened['opened'] / seconds:.0f}/s, closed by the server "
            f"{opened['closed'] / seconds:.0f}/s; refusals counted (connections): {made_room:g}"
        )
        print(bystander.summary())
        print(log_summary(server.log()))


def tiny_chunk_client(
    server: BenchServer, stop: threading.Event, answers: collections.Counter[str], sent: list[int]
) -> None:
    """POST bodies of 1-byte chunks until `stop`, a new connection after each answer."""
    head = (
        b"POST /v1/attention HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunks = b"1\r\n \r\n" * 10_000  # 60 KB a send
    while not stop.is_set():
        sock = reconnect(server, stop, answers)
        if sock is None:
            continue
        with sock:
            sock.sendall(head)
            for _ in range(2_000):  # at most 120 MB a request; the answer ends it long before
                if stop.is_set():
                    break
                try:
                    sock.sendall(chunks)
                    sent[0] += len(chunks)
                except TimeoutError:
                    pass  # the server stopped reading: see whether it answered
                except OSError:
                    pass  # it answered and closed
                reply = read_answer(sock)
                if reply != b"?":
                    answers[status_of(reply)[:40]] += 1
                    break


def tiny_chunks(seconds: float = 8.0) -> None:
    with attacked_server({}) as server:
        print(f"== 2 clients sending bodies of 1-byte chunks, {seconds:g} s")
        answers: collections.Counter[str] = collections.Counter()
        sent = [0]
        stop = threading.Event()
        with Bystander(server.url, small=False) as bystander:
            clients = [
                threading.Thread(target=tiny_chunk_client, args=(server, stop, answers, sent))
                for _ in range(2)
            ]
            for client in clients:
                client.start()
            time.sleep(seconds)
            stop.set()
            for client in clients:
                client.join(timeout=10)
        refused = metric(server, 'sdpa_rejected_total{reason="chunk_framing"}')
        print(f"answers: {dict(answers)}; sent {sent[0] / MiB:.1f} MiB; chunk_framing {refused:g}")
        print(bystander.summary())
        print(log_summary(server.log()))


ATTACKS: dict[str, Callable[[], None]] = {
    "huge-header": huge_header,
    "many-headers": many_headers,
    "trickle": trickle,
    "pipeline": pipeline,
    "sigterm": sigterm,
    "slow-body": slow_body,
    "cap-flood": cap_flood,
    "tiny-chunks": tiny_chunks,
}
