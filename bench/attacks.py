"""Resource attacks against a real server, measured: what the largest requests and the
clients that never read cost, and whether /healthz keeps answering.

    .venv/bin/python bench/attacks.py near-limit   # ~1 min: the work limit's edge
    .venv/bin/python bench/attacks.py never-read   # ~30 s: 12 clients leave 89 MB unread

near-limit: q = k = v of [1, 1, N, D] around the default work limit (10 s of device time),
fused and chunked, each sent while /healthz is probed every 0.2 s; prints the status, the time,
the worst /healthz latency and the server's peak RSS (VmHWM).

never-read: SDPA_SEND_TIMEOUT_S=3 and SDPA_MAX_INFLIGHT_BYTES=600 MiB; 12 clients ask at once
for weights [1, 1, 4096, 4096] in base64 (89 MB each) and read nothing, while a reading client
sends small requests; prints RSS over time, the reading client's statuses, the refusals and
the worst /healthz latency. Every loop is bounded in time; the server listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import BenchServer, live_server  # noqa: E402

MB = 2**20


def memory_mb(server: BenchServer) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            name, value = line.split(":")
            fields[name] = int(value.split()[0]) // 1024
    return fields


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("attack", choices=["near-limit", "never-read"])
    args = parser.parse_args()
    near_limit() if args.attack == "near-limit" else never_read()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
