"""Where one request's time goes: server-side phases, JSON lists vs base64, next to a no-op.

    .venv/bin/python bench/service.py            # ~3 min on 2 cores
    .venv/bin/python bench/service.py --quick    # ~1 min, fewer requests

Payloads (q, k, v float32, seeded):
- small:  [1, 4, 64, 64],   no diagnostics (the fused path);
- medium: [1, 8, 256, 64],  with weights and the summary diagnostics (the dense path);
- large:  [1, 8, 1024, 64], no weights, no diagnostics (the fused path).

For each payload and each encoding (JSON lists: {"dtype", "shape", "data"} in and out; base64:
{"dtype", "shape", "b64"} in and out) it measures, at concurrency 1 over loopback with one
keep-alive httpx client:
- the server's own phases, from the Server-Timing header of every response (p50): read (the
  body off the socket), decode (parse + validate + tensors), queue, compute (the engine on the
  device thread), dispatch (the thread hop), encode;
- the end-to-end p50 seen by the client (request sent to response body read);
- the same for a no-op FastAPI endpoint (defined below, run by the same uvicorn) that reads the
  same request bytes and answers a tiny JSON object ("no-op"), and one that answers a body as
  large as the service's response ("no-op, same reply size");
- in-process compute: sdpa_core.attention on the same tensors in this process (p50), called on
  a dedicated worker thread as the service's engine does. (On the main thread of a loaded 2-core
  machine, torch's intra-op threads make small calls 10-40x slower: 8 ms instead of 0.2 ms for
  the small payload, measured; that would flatter the service.)

Requests to the service, requests to the no-op and in-process compute calls alternate in blocks,
so drift in the shared machine's load hits all of them alike. Every loop is bounded in count and
in time.

Targets (issue 3): large base64 p50 <= 1.5 x (in-process compute + no-op p50); base64 >= 10x
faster than JSON lists on large; small base64 p50 <= no-op p50 + 1 ms.

Writes bench/results/service.json and bench/results/service.md.
"""

from __future__ import annotations

import argparse
import base64
import functools
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `service` and `tests` importable
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from starlette.responses import Response  # noqa: E402

from bench.support import free_port, live_server, wait_until_ready  # noqa: E402
from sdpa_core import attention  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
PHASES = ("read", "decode", "queue", "compute", "dispatch", "encode")


@dataclass(frozen=True)
class Payload:
    name: str
    shape: tuple[int, ...]
    options: dict[str, Any]
    # Requests per cell (payload x encoding x system), full run; --quick divides by 4.
    count: dict[str, int]


PAYLOADS = (
    Payload("small", (1, 4, 64, 64), {"diagnostics": "none"}, {"json": 300, "base64": 600}),
    Payload(
        "medium",
        (1, 8, 256, 64),
        {"return_weights": True, "diagnostics": "summary"},
        {"json": 60, "base64": 200},
    ),
    Payload("large", (1, 8, 1024, 64), {"diagnostics": "none"}, {"json": 16, "base64": 80}),
)
CELL_SECONDS = 25.0  # upper bound of measured time per cell
BLOCK = 10  # requests per alternation block


# ---- the no-op endpoint ------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _reply(size: int) -> bytes:
    if size <= 16:
        return b'{"ok":true}'
    return b'{"pad":"' + b"x" * (size - 10) + b'"}'


def make_noop_app() -> FastAPI:
    """POST /noop reads the whole body and answers {"ok":true}, or `?reply=N` bytes of JSON."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/noop")
    async def noop(request: Request) -> Response:
        await request.body()
        size = int(request.query_params.get("reply", "0"))
        return Response(content=_reply(size), media_type="application/json")

    @app.get("/readyz")
    async def ready() -> Response:
        return Response(content=b'{"status":"ready"}', media_type="application/json")

    return app


def serve_noop(port: int) -> None:
    import uvicorn

    uvicorn.run(make_noop_app(), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, server_header=False)  # fmt: skip


@contextmanager
def noop_server() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-noop", str(port)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process, timeout=60.0)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


# ---- measuring ---------------------------------------------------------------------------


def wire(t: np.ndarray, encoding: str) -> dict[str, Any]:
    head = {"dtype": "float32", "shape": list(t.shape)}
    if encoding == "base64":
        return {**head, "b64": base64.b64encode(t.tobytes()).decode()}
    return {**head, "data": t.tolist()}


def from_wire(obj: dict[str, Any]) -> torch.Tensor:
    if "b64" in obj:
        arr = np.frombuffer(base64.b64decode(obj["b64"]), dtype="<f4").reshape(obj["shape"])
        return torch.from_numpy(arr.copy())
    return torch.tensor(obj["data"], dtype=torch.float32)


def parse_server_timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Cell:
    e2e_ms: list[float] = field(default_factory=list)
    noop_ms: list[float] = field(default_factory=list)
    noop_same_reply_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)  # in process, between the blocks
    phases: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    request_bytes: int = 0
    response_bytes: int = 0
    path: str = ""


def timed_post(client: httpx.Client, url: str, body: bytes) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = client.post(url, content=body, headers={"content-type": "application/json"})
    elapsed = (time.perf_counter() - started) * 1000.0
    response.raise_for_status()
    return elapsed, response


def timed_compute(compute: Callable[[], object]) -> float:
    """Milliseconds of one compute() call, timed on the worker thread that runs it."""
    started = time.perf_counter()
    compute()
    return (time.perf_counter() - started) * 1000.0


_DEVICE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-compute")


def on_worker_thread(compute: Callable[[], object]) -> float:
    return _DEVICE_THREAD.submit(timed_compute, compute).result()


def measure_cell(
    client: httpx.Client,
    service_url: str,
    noop_url: str,
    body: bytes,
    count: int,
    check: Callable[[dict[str, Any]], None],
    compute: Callable[[], object],
) -> Cell:
    cell = Cell(request_bytes=len(body))
    _, first = timed_post(client, f"{service_url}/v1/attention", body)
    reply = first.json()
    check(reply)
    cell.path = reply["meta"]["path"]
    cell.response_bytes = len(first.content)
    same_reply = f"{noop_url}/noop?reply={cell.response_bytes}"
    for url in (f"{service_url}/v1/attention", f"{noop_url}/noop", same_reply):
        for _ in range(3):  # warm-up
            timed_post(client, url, body)
    for _ in range(3):
        on_worker_thread(compute)
    deadline = time.monotonic() + CELL_SECONDS
    while len(cell.e2e_ms) < count and time.monotonic() < deadline:
        for _ in range(BLOCK):
            ms, response = timed_post(client, f"{service_url}/v1/attention", body)
            cell.e2e_ms.append(ms)
            for name, dur in parse_server_timing(response.headers["server-timing"]).items():
                cell.phases.setdefault(name, []).append(dur)
        for _ in range(BLOCK):
            cell.noop_ms.append(timed_post(client, f"{noop_url}/noop", body)[0])
        for _ in range(BLOCK):
            cell.noop_same_reply_ms.append(timed_post(client, same_reply, body)[0])
        # In-process compute in the same rhythm, so that it sees the same machine load.
        for _ in range(BLOCK):
            cell.compute_ms.append(on_worker_thread(compute))
    return cell


def run(quick: bool) -> dict[str, Any]:
    scale = 4 if quick else 1
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server(
            {"SDPA_DEVICE": "cpu", "SDPA_LOG_LEVEL": "warning"}, tmp_path=Path(tmp)
        ) as service,
        noop_server() as noop_url,
        httpx.Client(timeout=120.0) as client,
    ):
        for payload in PAYLOADS:
            rng = np.random.default_rng(0)
            arrays = [rng.standard_normal(payload.shape, dtype=np.float32) for _ in range(3)]
            tensors = [torch.from_numpy(a) for a in arrays]
            expected = attention(*tensors, **payload.options)
            compute = functools.partial(attention, *tensors, **payload.options)

            def check(reply: dict[str, Any], expected: Any = expected) -> None:
                torch.testing.assert_close(from_wire(reply["output"]), expected.output)
                if expected.weights is not None:
                    torch.testing.assert_close(from_wire(reply["weights"]), expected.weights)

            entry: dict[str, Any] = {
                "shape": list(payload.shape),
                "options": payload.options,
                "in_process_path": expected.path,
                "encodings": {},
            }
            for encoding in ("json", "base64"):
                body = json.dumps(
                    {**{n: wire(a, encoding) for n, a in zip("qkv", arrays, strict=True)},
                     **payload.options, "response_encoding": encoding}
                ).encode()  # fmt: skip
                count = max(BLOCK, payload.count[encoding] // scale)
                cell = measure_cell(client, service.url, noop_url, body, count, check, compute)
                e2e, noop = p50(cell.e2e_ms), p50(cell.noop_ms)
                entry["encodings"][encoding] = {
                    "requests": len(cell.e2e_ms),
                    "request_mb": round(cell.request_bytes / 1e6, 3),
                    "response_mb": round(cell.response_bytes / 1e6, 3),
                    "path": cell.path,
                    "in_process_compute_p50_ms": round(p50(cell.compute_ms), 3),
                    "server_p50_ms": {k: round(p50(v), 3) for k, v in cell.phases.items()},
                    "e2e_p50_ms": round(e2e, 3),
                    "noop_p50_ms": round(noop, 3),
                    "noop_same_reply_p50_ms": round(p50(cell.noop_same_reply_ms), 3),
                    "over_noop_ms": round(e2e - noop, 3),
                }
                server = entry["encodings"][encoding]["server_p50_ms"]
                print(f"{payload.name:6s} {encoding:6s} e2e p50 {e2e:9.2f} ms  no-op {noop:8.2f} ms"
                      f"  compute in process {p50(cell.compute_ms):.2f} ms  server {server}",
                      flush=True)  # fmt: skip
            results[payload.name] = entry

    large, small = results["large"], results["small"]
    large_b64 = large["encodings"]["base64"]
    bound = 1.5 * (large_b64["in_process_compute_p50_ms"] + large_b64["noop_p50_ms"])
    large_json = large["encodings"]["json"]
    speedup = large_json["e2e_p50_ms"] / large_b64["e2e_p50_ms"]
    # The same ratio without the compute both pay (the server's own compute phase): what the
    # encodings cost, which is what the target is about; on a CPU the compute dominates base64.
    speedup_ex_compute = (large_json["e2e_p50_ms"] - large_json["server_p50_ms"]["compute"]) / (
        large_b64["e2e_p50_ms"] - large_b64["server_p50_ms"]["compute"]
    )
    small_over = small["encodings"]["base64"]["over_noop_ms"]
    targets = {
        "large_base64_p50_ms": large_b64["e2e_p50_ms"],
        "large_base64_bound_ms": round(bound, 3),
        "large_base64_ok": large_b64["e2e_p50_ms"] <= bound,
        "large_base64_vs_json_speedup": round(speedup, 2),
        "large_base64_vs_json_ok": speedup >= 10,
        "large_base64_vs_json_speedup_excluding_compute": round(speedup_ex_compute, 2),
        "small_base64_over_noop_ms": small_over,
        "small_fused": small["encodings"]["base64"]["path"] == "fused",
        "small_over_noop_ok": small_over <= 1.0,
    }
    return {
        "benchmark": "service",
        "command": ".venv/bin/python bench/service.py" + (" --quick" if quick else ""),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "payloads": results,
        "targets": targets,
    }


def to_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# Service: one request, phase by phase (concurrency 1, loopback)",
        "",
        f"`{report['command']}` — {report['when']}, {m['cpus']} CPUs, torch {m['torch']} "
        f"({m['torch_threads']} threads); load average before/after: "
        f"{m['loadavg_before'][0]} / {m['loadavg_after'][0]} (shared machine: expect noise).",
        "",
        "Server phases are p50 of the Server-Timing header; end-to-end and no-op are p50 seen by "
        "the client. No-op: a FastAPI endpoint that reads the same request bytes and answers "
        '`{"ok":true}` (same reply: answers as many bytes as the service).',
        "",
        "| payload | encoding | path | request MB | response MB | read | decode | queue | "
        "compute | dispatch | encode | in-process compute | e2e p50 | no-op p50 | "
        "no-op same reply | e2e − no-op |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in report["payloads"].items():
        for encoding, cell in entry["encodings"].items():
            s = cell["server_p50_ms"]
            phases = " | ".join(f"{s.get(p, float('nan')):.2f}" for p in PHASES)
            lines.append(
                f"| {name} | {encoding} | {cell['path']} | {cell['request_mb']:.2f} | "
                f"{cell['response_mb']:.2f} | {phases} | {cell['in_process_compute_p50_ms']:.2f} | "
                f"{cell['e2e_p50_ms']:.2f} | {cell['noop_p50_ms']:.2f} | "
                f"{cell['noop_same_reply_p50_ms']:.2f} | {cell['over_noop_ms']:.2f} |"
            )
    t = report["targets"]
    ok = {True: "met", False: "NOT met"}
    lines += [
        "",
        "All times in ms.",
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| large base64 p50 ≤ 1.5 × (in-process compute + no-op) | {t['large_base64_p50_ms']:.1f}"
        f" ≤ {t['large_base64_bound_ms']:.1f} | {ok[t['large_base64_ok']]} |",
        f"| large: base64 ≥ 10× faster than JSON lists | {t['large_base64_vs_json_speedup']:.1f}×"
        f" ({t['large_base64_vs_json_speedup_excluding_compute']:.1f}× without the compute both "
        f"pay) | {ok[t['large_base64_vs_json_ok']]} |",
        f"| small (fused: {t['small_fused']}) base64 p50 ≤ no-op + 1 ms | "
        f"+{t['small_base64_over_noop_ms']:.2f} ms | {ok[t['small_over_noop_ok']]} |",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--serve-noop", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_noop:
        serve_noop(args.serve_noop)
        return 0
    report = run(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "service.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (RESULTS / "service.md").write_text(to_markdown(report), encoding="utf-8")
    print(to_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
