"""Attacks against a real server, measured: what each costs the server (status and time of the
bound's answer, peak RSS growth) and whether another client is still served beside it.

    .venv/bin/python bench/attacks.py ATTACK [ATTACK ...]     # or: all
    .venv/bin/python bench/attacks.py --tree /tmp/old ATTACK  # the same against older code

--tree serves another checkout (a `git worktree add /tmp/old COMMIT`) with this .venv: the
attacks are this tree's, the server that one's (before-and-after figures).

The resources issue (here):
    near-limit      ~1 min: requests around the work limit (10 s of device time)
    never-read      ~30 s: 12 clients leave 89 MB answers unread
    long-flood      ~40 s: 16 clients loop long requests beside a small one
The hardening issue (23):
    huge-header, many-headers, trickle, pipeline, sigterm   bench/attack_protocol.py
    parse-peak, json-body, bodies-flood, header-numbers    bench/attack_bodies.py
    decode-costs, slow-bodies                              bench/attack_decode.py
    wrong-answers   ~30 s: the misleading answers (here)
    long requests sharing a deadline: bench/long_deadlines.py (old vs new batcher)
The edge issue (40), the gRPC door:
    grpc-trickle, grpc-gzip, grpc-crafted, grpc-never-read, grpc-reset, grpc-connections
                                                           bench/attack_grpc.py

near-limit: q = k = v of [1, 1, N, D] around the default work limit (10 s of device time),
fused and chunked, each sent while /healthz is probed every 0.2 s; prints the status, the time,
the worst /healthz latency and the server's peak RSS (VmHWM).

never-read: SDPA_SEND_TIMEOUT_S=3 and SDPA_MAX_INFLIGHT_BYTES=600 MiB; 12 clients ask at once
for weights [1, 1, 4096, 4096] in base64 (89 MB each) and read nothing, while a reading client
sends small requests; prints RSS over time, the reading client's statuses, the refusals and
the worst /healthz latency.

long-flood: the largest legal synthetic /v1/analyze (8192 x 8192 scores, the weights-element
limit) and the next size up; then, for 25 s, 16 clients each looping long requests (half the
synthetic analyze, half a 16 MB summary attention: at most 2 x MAX_RUNNING_LONG long requests
run at once) beside a small client every 20 ms; prints the long requests' statuses, the small
client's p50 / p99 / max, and the server's peak RSS.

wrong-answers (SDPA_API_KEYS set): a scale infinite in float32 with diagnostics "none"; 90 API
keys in one request; 2,000 distinct tags from one client; booleans among v2 FP32 numbers; a
refusal's route label. Prints each status and what /metrics says of it.

Every loop is bounded in time; the server listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench import attack_bodies, attack_decode, attack_grpc, attack_protocol  # noqa: E402
from bench.support import (  # noqa: E402
    LONG_ANALYZE,
    SMALL,
    Bystander,
    attacked_server,
    live_server,
    log_summary,
    long_attention_body,
    memory_mb,
    metric,
    serve_from,
)

MB = 2**20


def tensor_body(n: int, d: int, **options: object) -> bytes:
    x = np.random.default_rng(0).standard_normal((1, 1, n, d)).astype(np.float32)
    t = {"dtype": "float32", "shape": list(x.shape), "b64": base64.b64encode(x).decode()}
    return json.dumps({"q": t, "k": t, "v": t, **options}).encode()


def near_limit() -> None:
    with tempfile.TemporaryDirectory() as tmp, live_server({}, tmp_path=Path(tmp)) as server:
        info = httpx.get(f"{server.url}/v1/info").json()
        print("work limit (FLOPs):", f"{info['limits']['max_request_flops']:.3g}")
        print("cost model:", json.dumps(info["cost_model"]["paths"]))
        cases = ((60000, 64, "none"), (70000, 64, "none"), (20000, 64, "summary"),
                 (26000, 64, "summary"), (200000, 1, "none"))  # fmt: skip
        for n, d, diagnostics in cases:
            body = tensor_body(n, d, diagnostics=diagnostics)
            worst, stop = [0.0], threading.Event()

            def probe(worst: list[float] = worst, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    started = time.monotonic()
                    httpx.get(f"{server.url}/healthz", timeout=30)
                    worst[0] = max(worst[0], time.monotonic() - started)
                    time.sleep(0.2)

            prober = threading.Thread(target=probe)
            prober.start()
            started = time.monotonic()
            response = httpx.post(
                f"{server.url}/v1/attention", content=body,
                headers={"content-type": "application/json"}, timeout=120,
            )  # fmt: skip
            elapsed = time.monotonic() - started
            stop.set()
            prober.join()
            said = (
                response.json()["errors"][0]["msg"][:100]
                if response.status_code != 200
                else response.headers.get("server-timing", "")
            )
            peak = memory_mb(server)["VmHWM"]
            print(
                f"[1, 1, {n}, {d}] {diagnostics}: {len(body) // MB} MB -> {response.status_code} "
                f"in {elapsed:.2f} s; /healthz worst {worst[0] * 1e3:.0f} ms; VmHWM {peak} MB; "
                f"{said}"
            )


def never_read() -> None:
    env = {"SDPA_SEND_TIMEOUT_S": "3", "SDPA_MAX_INFLIGHT_BYTES": str(600 * MB)}
    with tempfile.TemporaryDirectory() as tmp, live_server(env, tmp_path=Path(tmp)) as server:
        host, port = server.url.removeprefix("http://").split(":")
        print("baseline MB:", memory_mb(server))
        body = tensor_body(4096, 16, return_weights=True, diagnostics="none")
        request = (
            b"POST /v1/attention HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        unread = []
        started = time.monotonic()
        for _ in range(12):
            sock = socket.create_connection((host, int(port)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.sendall(request)
            unread.append(sock)
        rss, reader, worst = [], [], 0.0
        small = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}
        while time.monotonic() - started < 16:
            rss.append((round(time.monotonic() - started, 1), memory_mb(server)["VmRSS"]))
            probe = time.monotonic()
            httpx.get(f"{server.url}/healthz", timeout=5)
            worst = max(worst, time.monotonic() - probe)
            status = httpx.post(f"{server.url}/v1/attention", json=small, timeout=10).status_code
            reader.append((round(time.monotonic() - started, 1), status))
            time.sleep(0.5)
        metrics = httpx.get(f"{server.url}/metrics").text.splitlines()
        print("peak MB:", memory_mb(server))
        print("RSS over time (s, MB):", rss)
        print("reading client (s, status):", reader)
        print("refused:", [m for m in metrics if m.startswith("sdpa_rejected_total")])
        print(f"/healthz worst: {worst * 1e3:.0f} ms")
        for sock in unread:
            sock.close()


def long_flood(seconds: float = 25.0, clients: int = 16) -> None:
    with tempfile.TemporaryDirectory() as tmp, live_server({}, tmp_path=Path(tmp)) as server:
        print("baseline MB:", memory_mb(server))
        for n in (8192, 16384):
            body = {"synthetic": {**LONG_ANALYZE["synthetic"], "n_q": n, "n_k": n}}
            started = time.perf_counter()
            response = httpx.post(f"{server.url}/v1/analyze", json=body, timeout=120)
            took = time.perf_counter() - started
            detail = "" if response.status_code == 200 else response.json()["detail"]
            print(f"analyze {n} x {n}: {response.status_code} in {took:.2f} s {detail}")
        bodies = [("/v1/analyze", json.dumps(LONG_ANALYZE).encode()),
                  ("/v1/attention", long_attention_body())]  # fmt: skip
        stop = time.monotonic() + seconds
        statuses: list[int] = []
        small_ms: list[float] = []

        def flood(i: int) -> None:
            path, body = bodies[i % 2]
            with httpx.Client(timeout=120) as client:
                while time.monotonic() < stop:
                    response = client.post(
                        f"{server.url}{path}",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                    statuses.append(response.status_code)

        def small_client() -> None:
            small = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}
            with httpx.Client(timeout=30) as client:
                while time.monotonic() < stop:
                    started = time.perf_counter()
                    client.post(f"{server.url}/v1/attention", json=small).raise_for_status()
                    small_ms.append((time.perf_counter() - started) * 1e3)
                    time.sleep(0.02)

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(clients)]
        threads.append(threading.Thread(target=small_client))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        small_ms.sort()
        p99 = small_ms[min(len(small_ms) - 1, int(0.99 * len(small_ms)))]
        print("long requests' statuses:", dict(collections.Counter(statuses)))
        print(f"small client: p50 {small_ms[len(small_ms) // 2]:.0f} ms, p99 {p99:.0f} ms, "
              f"max {small_ms[-1]:.0f} ms")  # fmt: skip
        print("peak MB:", memory_mb(server))


def wrong_answers() -> None:
    key = "bench-key"
    auth = {"X-API-Key": key}
    with (
        attacked_server({"SDPA_API_KEYS": key}) as server,
        Bystander(server.url, headers=auth) as bystander,
    ):
        with httpx.Client(base_url=server.url, timeout=30, headers=auth) as client:
            x = [[1.0, 0.0], [2.0, 0.0]]  # every q.k > 0: -1e308 made every score -inf
            body = {"q": x, "k": x, "v": x, "scale": -1e308, "diagnostics": "none"}
            answer = client.post("/v1/attention", json=body)
            print(f"scale -1e308, diagnostics none: {answer.status_code} {answer.text[:120]}")
            # 90: the request's other header lines stay under SDPA_MAX_HEADERS (100).
            guesses = [("X-API-Key", f"guess-{i}") for i in range(89)] + [("X-API-Key", key)]
            answer = httpx.post(f"{server.url}/v1/attention", json=SMALL, headers=guesses)
            print(f"90 API keys in one request: {answer.status_code} {answer.text[:120]}")
            started = time.monotonic()
            small = {**SMALL, "diagnostics": "summary"}
            statuses = collections.Counter(
                client.post("/v1/attention", json={**small, "tag": f"t{i}"}).status_code
                for i in range(2000)
            )
            print(f"2,000 distinct tags in {time.monotonic() - started:.1f} s: {dict(statuses)}")
            inputs = [
                {"name": n, "datatype": "FP32", "shape": [1, 2], "data": [1.0, True]}
                for n in ("q", "k", "v")
            ]
            answer = client.post("/v2/models/attention/infer", json={"inputs": inputs})
            print(f"v2 FP32 data with a boolean: {answer.status_code} {answer.text[:120]}")
            metrics = client.get("/metrics").text
        tags = set(
            re.findall(r'^sdpa_health_observations_total\{[^}]*tag="([^"]+)"', metrics, re.M)
        )
        print(f"tags with series of their own: {len(tags - {'other'})} (+ other)")
        for series in (
            'sdpa_rejected_total{reason="unauthorized"}',
            'sdpa_requests_total{route="/v1/attention",status="401",tenant="anonymous"}',
            "sdpa_health_tags_evicted_total",
        ):
            print(f"{series} {metric(server, series, headers=auth)}")
        print(log_summary(server.log()))
    print(bystander.summary())


ATTACKS: dict[str, Callable[[], None]] = {
    "near-limit": near_limit,
    "never-read": never_read,
    "long-flood": long_flood,
    **attack_protocol.ATTACKS,
    **attack_bodies.ATTACKS,
    **attack_decode.ATTACKS,
    "wrong-answers": wrong_answers,
    **attack_grpc.ATTACKS,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n", 1)[0].split()),
        epilog="attacks: " + ", ".join(ATTACKS),
    )
    parser.add_argument("attacks", nargs="+", choices=[*ATTACKS, "all"], metavar="ATTACK")
    parser.add_argument("--tree", type=Path, help="serve this checkout instead (older code)")
    args = parser.parse_args()
    if args.tree is not None:
        serve_from(args.tree)
    for name, attack in ATTACKS.items():
        if name in args.attacks or "all" in args.attacks:
            print(f"== {name}", flush=True)
            attack()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
