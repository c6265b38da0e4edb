"""The Open Inference Protocol (v2) with binary tensor data, against its targets (issue 16).

    .venv/bin/python bench/v2.py            # ~2 min on 2 cores
    .venv/bin/python bench/v2.py --quick    # ~1 min, fewer requests

Three measurements:

1. W3 latency (B1 H8 N1024 D64 float32, no weights, no diagnostics: the fused path) at
   concurrency 1 over loopback, one keep-alive httpx client: the client's end-to-end p50 of a v2
   binary request, next to in-process compute (sdpa_core.attention on a worker thread, as the
   engine runs it) + a no-op endpoint (bench/noop_app.py, same uvicorn) that reads the same
   request bytes and answers as many bytes as the service does. v1 base64 on the same run, for
   comparison. The three alternate in blocks, so drift in the machine's load hits all alike.
   Target: v2 p50 <= 1.2 x (compute p50 + no-op p50).
2. Decode of an 8 MiB binary request (q, k, v [1, 8, 1365, 64] float32) in this process: what
   the server does from body bytes to torch tensors (split the header, parse it, np.frombuffer
   and the one copy into torch), next to a memcpy of the same bytes into a fresh buffer
   (np.frombuffer(body).copy()). Target: decode p50 <= 1.5 x memcpy p50.
3. Throughput at concurrency 16 on the small payload ([1, 4, 64, 64], no diagnostics), 16
   single-connection httpx clients (sdpa_client.loadgen): v2 binary against the service, and
   the same bytes against the no-op. Target: v2 >= 0.9 x the no-op's.

Every loop is bounded in count and in time. Writes bench/results/v2.json and bench/results/v2.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `service` and `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.support import free_port, live_server, wait_until_ready  # noqa: E402
from sdpa_client.loadgen import PRESETS, HttpSender, LoadPlan, Payload, run_load  # noqa: E402
from sdpa_client.v2 import HEADER_LENGTH, INFER_PATH, build_infer_request  # noqa: E402
from sdpa_core import attention  # noqa: E402
from service.wire.codec import loads  # noqa: E402
from service.wire.v2_codec import decode_inputs, split_header  # noqa: E402
from service.wire.v2_models import parse_infer_request  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
W3 = (1, 8, 1024, 64)
DECODE_SHAPE = (1, 8, 1365, 64)  # x 3 tensors x 4 bytes = 8.0 MiB
BLOCK = 5
CELL_SECONDS = 90.0
TARGETS = {"w3_ratio": 1.2, "decode_ratio": 1.5, "throughput_ratio": 0.9}


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@contextmanager
def noop_server() -> Iterator[str]:
    """bench/noop_app.py on its own uvicorn (the same server stack as the service)."""
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "bench.noop_app:app", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--no-access-log"]  # fmt: skip
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process, timeout=60.0)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def qkv(shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    return q, k, v


def v1_base64_body(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> bytes:
    def wire(t: np.ndarray) -> dict[str, Any]:
        return {
            "dtype": "float32",
            "shape": list(t.shape),
            "b64": base64.b64encode(t.tobytes()).decode(),
        }

    body = {"q": wire(q), "k": wire(k), "v": wire(v), "diagnostics": "none"}
    return json.dumps(body).encode()


def timed(
    client: httpx.Client, url: str, body: bytes, headers: dict[str, str]
) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = client.post(url, content=body, headers=headers)
    elapsed = (time.perf_counter() - started) * 1000.0
    response.raise_for_status()
    return elapsed, response


_DEVICE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-compute")


def on_worker_thread(compute: Callable[[], object]) -> float:
    def run() -> float:
        started = time.perf_counter()
        compute()
        return (time.perf_counter() - started) * 1000.0

    return _DEVICE_THREAD.submit(run).result()


# ---- 1. W3 latency -------------------------------------------------------------------------


def measure_w3(client: httpx.Client, service: str, noop: str, count: int) -> dict[str, Any]:
    q, k, v = qkv(W3)
    v2_body, v2_headers = build_infer_request(q, k, v, diagnostics="none", binary=True)
    v1_body = v1_base64_body(q, k, v)
    json_headers = {"content-type": "application/json"}
    _, first = timed(client, f"{service}{INFER_PATH}", v2_body, v2_headers)
    reply_bytes = len(first.content)
    _, first_v1 = timed(client, f"{service}/v1/attention", v1_body, json_headers)
    tensors = [torch.from_numpy(x) for x in (q, k, v)]

    def compute() -> object:
        return attention(*tensors)

    runs: dict[str, tuple[str, bytes, dict[str, str]]] = {
        "v2_binary": (f"{service}{INFER_PATH}", v2_body, v2_headers),
        "v1_base64": (f"{service}/v1/attention", v1_body, json_headers),
        "noop": (f"{noop}/v1/attention?reply={reply_bytes}", v2_body, v2_headers),
    }
    samples: dict[str, list[float]] = {name: [] for name in (*runs, "compute", "server_compute")}
    for url, body, headers in runs.values():
        for _ in range(3):
            timed(client, url, body, headers)
    for _ in range(3):
        on_worker_thread(compute)
    deadline = time.monotonic() + CELL_SECONDS
    while len(samples["v2_binary"]) < count and time.monotonic() < deadline:
        for name, (url, body, headers) in runs.items():
            for _ in range(BLOCK):
                ms, response = timed(client, url, body, headers)
                samples[name].append(ms)
                if name == "v2_binary":  # the engine's own time, from the response parameters
                    header = response.content[: int(response.headers[HEADER_LENGTH])]
                    samples["server_compute"].append(json.loads(header)["parameters"]["compute_ms"])
        for _ in range(BLOCK):
            samples["compute"].append(on_worker_thread(compute))
    medians = {name: p50(values) for name, values in samples.items()}
    floor = medians["compute"] + medians["noop"]
    # The same floor with the compute the server's engine measured on its own device thread: on
    # a loaded machine, compute timed in this process competes with the server for the cores.
    server_floor = medians["server_compute"] + medians["noop"]
    return {
        "shape": list(W3),
        "requests_each": len(samples["v2_binary"]),
        "request_bytes": {"v2_binary": len(v2_body), "v1_base64": len(v1_body)},
        "response_bytes": {"v2_binary": reply_bytes, "v1_base64": len(first_v1.content)},
        "p50_ms": {name: round(ms, 3) for name, ms in medians.items()},
        "floor_ms": round(floor, 3),
        "ratio": round(medians["v2_binary"] / floor, 3),
        "v1_ratio": round(medians["v1_base64"] / floor, 3),
        "server_floor_ms": round(server_floor, 3),
        "server_ratio": round(medians["v2_binary"] / server_floor, 3),
    }


# ---- 2. decode of 8 MiB --------------------------------------------------------------------


def measure_decode(repeats: int) -> dict[str, Any]:
    q, k, v = qkv(DECODE_SHAPE)
    body, headers = build_infer_request(q, k, v, diagnostics="none", binary=True)
    header_length = headers["Inference-Header-Content-Length"]

    def decode() -> object:
        header, offset = split_header(body, header_length)
        request = parse_infer_request(loads(header))
        return decode_inputs(request, body, offset, max_elements=1 << 26)

    def memcpy() -> object:
        return np.frombuffer(body, dtype=np.uint8).copy()

    tensors = decode()
    assert isinstance(tensors, dict)
    np.testing.assert_array_equal(tensors["v"].numpy(), v)  # decoded right, or no figure at all
    times: dict[str, list[float]] = {"decode": [], "memcpy": []}
    deadline = time.monotonic() + 60.0
    for _ in range(repeats):
        for name, fn in (("decode", decode), ("memcpy", memcpy)):
            started = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - started) * 1000.0)
        if time.monotonic() > deadline:
            break
    medians = {name: p50(values) for name, values in times.items()}
    return {
        "body_bytes": len(body),
        "repeats": len(times["decode"]),
        "p50_ms": {name: round(ms, 3) for name, ms in medians.items()},
        "ratio": round(medians["decode"] / medians["memcpy"], 3),
    }


# ---- 3. throughput at c=16 -----------------------------------------------------------------


async def _throughput(url: str, payload: Payload, seconds: float) -> float:
    async with HttpSender(url, payload) as send:
        await run_load(send, LoadPlan(concurrency=16, duration_s=1.0))  # warm-up
        report = await run_load(send, LoadPlan(concurrency=16, duration_s=seconds))
    if report.ok != report.sent:
        raise RuntimeError(f"{payload.path}: {report.sent - report.ok} requests failed")
    return report.throughput_rps


def measure_throughput(service: str, noop: str, seconds: float, rounds: int) -> dict[str, Any]:
    v2 = Payload.from_preset(PRESETS["small"], protocol="v2")
    v1 = Payload.from_preset(PRESETS["small"], encoding="base64")
    noop_payload = Payload(v2.name, "/v1/attention", v2.body, v2.description, v2.headers)
    rps: dict[str, list[float]] = {"v2_binary": [], "v1_base64": [], "noop": []}
    for _ in range(rounds):  # alternating, so that drift hits all three
        rps["v2_binary"].append(asyncio.run(_throughput(service, v2, seconds)))
        rps["v1_base64"].append(asyncio.run(_throughput(service, v1, seconds)))
        rps["noop"].append(asyncio.run(_throughput(noop, noop_payload, seconds)))
    medians = {name: p50(values) for name, values in rps.items()}
    return {
        "preset": PRESETS["small"].describe(),
        "request_bytes": len(v2.body),
        "seconds_each": seconds,
        "rounds": rounds,
        "rps": {name: [round(x, 1) for x in values] for name, values in rps.items()},
        "rps_median": {name: round(x, 1) for name, x in medians.items()},
        "ratio": round(medians["v2_binary"] / medians["noop"], 3),
        "v1_ratio": round(medians["v1_base64"] / medians["noop"], 3),
    }


# ---- the report ----------------------------------------------------------------------------


def run(quick: bool) -> dict[str, Any]:
    load_before = os.getloadavg()
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server({"SDPA_LOG_LEVEL": "warning"}, tmp_path=Path(tmp)) as service,
        noop_server() as noop,
        httpx.Client(timeout=120.0) as client,
    ):
        w3 = measure_w3(client, service.url, noop, count=40 if quick else 120)
        throughput = measure_throughput(
            service.url, noop, seconds=3.0 if quick else 6.0, rounds=2 if quick else 3
        )
    decode = measure_decode(repeats=30 if quick else 100)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        },
        "quick": quick,
        "targets": TARGETS,
        "w3": w3,
        "decode": decode,
        "throughput_c16": throughput,
    }


def _verdict(value: float, target: float, *, at_most: bool) -> str:
    ok = value <= target if at_most else value >= target
    return "met" if ok else "NOT met"


def to_markdown(report: dict[str, Any]) -> str:
    w3, dec, thr = report["w3"], report["decode"], report["throughput_c16"]
    t = report["targets"]
    lines = [
        f"# v2 (Open Inference Protocol, binary tensor data) — {report['date']}",
        "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs, torch "
        f"{report['machine']['torch']}, load {report['machine']['load_before']} before, "
        f"{report['machine']['load_after']} after. Quick: {report['quick']}.",
        "",
        "| measurement | value | floor | ratio | target | verdict |",
        "|---|---|---|---|---|---|",
        f"| W3 v2 binary p50 (ms) | {w3['p50_ms']['v2_binary']} | compute "
        f"{w3['p50_ms']['compute']} + no-op {w3['p50_ms']['noop']} = {w3['floor_ms']} | "
        f"{w3['ratio']} | <= {t['w3_ratio']} | "
        f"{_verdict(w3['ratio'], t['w3_ratio'], at_most=True)} |",
        f"| W3 v2 binary p50 (ms), floor with the server's compute_ms | "
        f"{w3['p50_ms']['v2_binary']} | compute {w3['p50_ms']['server_compute']} + no-op "
        f"{w3['p50_ms']['noop']} = {w3['server_floor_ms']} | {w3['server_ratio']} | "
        f"<= {t['w3_ratio']} | {_verdict(w3['server_ratio'], t['w3_ratio'], at_most=True)} |",
        f"| W3 v1 base64 p50 (ms), same run | {w3['p50_ms']['v1_base64']} | {w3['floor_ms']} | "
        f"{w3['v1_ratio']} | (comparison) | |",
        f"| decode of {dec['body_bytes']} B (ms) | {dec['p50_ms']['decode']} | memcpy "
        f"{dec['p50_ms']['memcpy']} | {dec['ratio']} | <= {t['decode_ratio']} | "
        f"{_verdict(dec['ratio'], t['decode_ratio'], at_most=True)} |",
        f"| c=16 small, v2 binary (req/s) | {thr['rps_median']['v2_binary']} | no-op "
        f"{thr['rps_median']['noop']} | {thr['ratio']} | >= {t['throughput_ratio']} | "
        f"{_verdict(thr['ratio'], t['throughput_ratio'], at_most=False)} |",
        f"| c=16 small, v1 base64 (req/s), same run | {thr['rps_median']['v1_base64']} | no-op "
        f"{thr['rps_median']['noop']} | {thr['v1_ratio']} | (comparison) | |",
        "",
        f"W3 requests: {w3['request_bytes']} bytes in, {w3['response_bytes']} bytes out; "
        f"{w3['requests_each']} requests each. Throughput rounds: {thr['rps']}.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (about 1 min)")
    args = parser.parse_args()
    report = run(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "v2.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    markdown = to_markdown(report)
    (RESULTS / "v2.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
