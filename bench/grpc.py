"""The Open Inference Protocol over gRPC against its targets (issue 27).

    .venv/bin/python bench/grpc.py            # ~3 min on 2 cores
    .venv/bin/python bench/grpc.py --quick    # ~1.5 min, fewer requests

Two measurements, against one real server (`sdpa-service serve`, CPU, its gRPC door on a free
port) and a no-op gRPC server (`bench/grpc.py noop`: grpc.aio on uvloop, as the service's
loop; it reads the whole message and answers a message of a given size, decoding nothing):

1. W3 latency (B1 H8 N1024 D64 float32, no weights, no diagnostics: the fused path) at
   concurrency 1 over loopback: the p50 of a ModelInfer call (tritonclient.grpc's request,
   serialized once; the raw bytes sent and received on one grpc channel, so that client-side
   protobuf work costs neither side) next to compute + a no-op call that carries the same
   request bytes and gets as many bytes back as the service answers. Compute is timed twice:
   in this process (sdpa_core.attention on a worker thread, as the engine runs it) and as the
   server's engine reports it (compute_ms). v2 REST binary on the same run, for comparison.
   The cases alternate in blocks, so drift in the machine's load hits all alike.
   Target: gRPC p50 <= 1.2 x (compute p50 + no-op p50).
2. Throughput at concurrency 16 on the small payload ([1, 4, 64, 64], no diagnostics): 16
   closed-loop workers (sdpa_client.loadgen.run_load), each on its own channel or connection:
   gRPC ModelInfer against v2 REST binary data (HttpSender), both the same tensors, and the
   no-op gRPC server for the ceiling. Rounds alternate.
   Target: gRPC throughput >= 1 x REST v2 binary's.

Every loop is bounded in count and in time. Writes bench/results/grpc.json and grpc.md.
"""

from __future__ import annotations

import argparse
import asyncio
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder leads sys.path, and this file would shadow grpcio's `grpc`
# package: take the folder out, and make `service` and `bench` importable from the root.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.support import free_port, live_server  # noqa: E402
from sdpa_client.loadgen import PRESETS, HttpSender, LoadPlan, Payload, run_load  # noqa: E402
from sdpa_client.v2 import HEADER_LENGTH, INFER_PATH, build_infer_request  # noqa: E402
from sdpa_core import attention  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
W3 = (1, 8, 1024, 64)
BLOCK = 5
CELL_SECONDS = 90.0
TARGETS = {"w3_ratio": 1.2, "throughput_ratio": 1.0}
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
READY_METHOD = "/inference.GRPCInferenceService/ServerReady"
REPLY_BYTES_KEY = "reply-bytes"  # the no-op server answers this many bytes
MAX_MESSAGE = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---- the no-op gRPC server -----------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _reply(size: int) -> bytes:
    return b"\0" * size


async def _serve_noop(port: int) -> None:
    async def infer(request: bytes, context: Any) -> bytes:
        size = dict(context.invocation_metadata() or ()).get(REPLY_BYTES_KEY, "0")
        return _reply(int(size))

    async def ready(request: bytes, context: Any) -> bytes:
        return b""

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(infer),
            "ServerReady": grpc.unary_unary_rpc_method_handler(ready),
        },
    )
    server = grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def noop_main(port: int) -> None:
    try:  # the loop the service runs (uvicorn picks uvloop when it is installed)
        import uvloop

        uvloop.run(_serve_noop(port))
    except ImportError:
        asyncio.run(_serve_noop(port))


def wait_for_grpc(target: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Until a ServerReady call on `target` answers (any answer: the port serves)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        ready = channel.unary_unary(READY_METHOD)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the gRPC server on {target} exited")
            try:
                ready(b"", timeout=1.0)
                return
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(f"{target} not serving within {timeout} s")


@contextmanager
def noop_server() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "noop", "--port", str(port)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = f"127.0.0.1:{port}"
    try:
        wait_for_grpc(target, process, timeout=60.0)
        yield target
    finally:
        process.terminate()
        process.wait(timeout=30)


# ---- requests ------------------------------------------------------------------------------


def grpc_request(inputs: dict[str, np.ndarray], *, parameters: dict[str, Any]) -> bytes:
    """The ModelInferRequest tritonclient.grpc sends for these inputs, serialized."""
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc._utils import _get_inference_request

    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    request = _get_inference_request(
        model_name="attention", inputs=tensors, model_version="", request_id="", outputs=None,
        sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None,
        parameters=parameters or None,
    )  # fmt: skip
    return bytes(request.SerializeToString())


def rest_inputs(payload: Payload) -> dict[str, np.ndarray]:
    """The tensors of a v2 binary request (the loadgen's preset), as numpy arrays."""
    header_length = int(dict(payload.headers)[HEADER_LENGTH])
    header = json.loads(payload.body[:header_length])
    arrays, offset = {}, header_length
    for entry in header["inputs"]:
        size = entry["parameters"]["binary_data_size"]
        raw = payload.body[offset : offset + size]
        arrays[entry["name"]] = np.frombuffer(raw, dtype="<f4").reshape(entry["shape"]).copy()
        offset += size
    return arrays


def response_parameters(raw: bytes) -> dict[str, Any]:
    from tritonclient.grpc import service_pb2

    response = service_pb2.ModelInferResponse.FromString(raw)
    return {
        key: getattr(value, value.WhichOneof("parameter_choice"))
        for key, value in response.parameters.items()
    }


_DEVICE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-compute")


def on_worker_thread(compute: Callable[[], object]) -> float:
    def run() -> float:
        started = time.perf_counter()
        compute()
        return (time.perf_counter() - started) * 1000.0

    return _DEVICE_THREAD.submit(run).result()


# ---- 1. W3 latency -------------------------------------------------------------------------


def _add_phases(into: dict[str, list[float]], server_timing: str) -> None:
    """read;dur=0.120, decode;dur=0.410, ... -> each phase's duration, appended."""
    for part in server_timing.split(","):
        name, _, duration = part.strip().partition(";dur=")
        into.setdefault(name, []).append(float(duration))


def measure_w3(service_grpc: str, service_http: str, noop: str, count: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(W3, dtype=np.float32) for _ in range(3))
    raw = grpc_request({"q": q, "k": k, "v": v}, parameters={"diagnostics": "none"})
    rest_body, rest_headers = build_infer_request(q, k, v, diagnostics="none", binary=True)
    tensors = [torch.from_numpy(x) for x in (q, k, v)]

    with (
        grpc.insecure_channel(service_grpc, options=CHANNEL_OPTIONS) as service_channel,
        grpc.insecure_channel(noop, options=CHANNEL_OPTIONS) as noop_channel,
        httpx.Client(timeout=120.0) as http,
    ):
        service_call = service_channel.unary_unary(INFER_METHOD)
        noop_call = noop_channel.unary_unary(INFER_METHOD)
        first = service_call(raw, timeout=120)
        # The answer is right, or there is no figure at all.
        from tritonclient.grpc import InferResult, service_pb2

        got = InferResult(service_pb2.ModelInferResponse.FromString(first)).as_numpy("output")
        want = attention(*tensors).output.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        reply_metadata = ((REPLY_BYTES_KEY, str(len(first))),)

        def timed(call: Callable[[], object]) -> tuple[float, object]:
            started = time.perf_counter()
            result = call()
            return (time.perf_counter() - started) * 1000.0, result

        runs: dict[str, Callable[[], object]] = {
            "grpc": lambda: service_call.with_call(raw, timeout=120),
            "noop": lambda: noop_call(raw, metadata=reply_metadata, timeout=120),
            "v2_rest": lambda: http.post(
                f"{service_http}{INFER_PATH}", content=rest_body, headers=rest_headers
            ).raise_for_status(),
        }
        samples: dict[str, list[float]] = {name: [] for name in (*runs, "compute")}
        server_compute: list[float] = []
        # The server's own account of each call (Server-Timing: the header over REST, the
        # trailing metadata over gRPC), phase by phase.
        phases: dict[str, dict[str, list[float]]] = {"grpc": {}, "v2_rest": {}}
        for call in runs.values():
            for _ in range(3):
                call()
        for _ in range(3):
            on_worker_thread(lambda: attention(*tensors))
        deadline = time.monotonic() + CELL_SECONDS
        while len(samples["grpc"]) < count and time.monotonic() < deadline:
            for name, call in runs.items():
                for _ in range(BLOCK):
                    ms, result = timed(call)
                    samples[name].append(ms)
                    if name == "grpc":
                        assert isinstance(result, tuple)
                        answer, rpc = result
                        server_compute.append(float(response_parameters(answer)["compute_ms"]))
                        timing = dict(rpc.trailing_metadata())["server-timing"]
                        _add_phases(phases["grpc"], timing)
                    elif name == "v2_rest":
                        assert isinstance(result, httpx.Response)
                        _add_phases(phases["v2_rest"], result.headers["server-timing"])
            for _ in range(BLOCK):
                samples["compute"].append(on_worker_thread(lambda: attention(*tensors)))
    medians = {name: p50(values) for name, values in samples.items()}
    medians["server_compute"] = p50(server_compute)
    floor = medians["compute"] + medians["noop"]
    server_floor = medians["server_compute"] + medians["noop"]
    return {
        "shape": list(W3),
        "server_timing_p50_ms": {
            door: {phase: round(p50(values), 3) for phase, values in by_phase.items()}
            for door, by_phase in phases.items()
        },
        "requests_each": len(samples["grpc"]),
        "request_bytes": {"grpc": len(raw), "v2_rest": len(rest_body)},
        "response_bytes": {"grpc": len(first)},
        "p50_ms": {name: round(ms, 3) for name, ms in medians.items()},
        "floor_ms": round(floor, 3),
        "ratio": round(medians["grpc"] / floor, 3),
        "server_floor_ms": round(server_floor, 3),
        "server_ratio": round(medians["grpc"] / server_floor, 3),
        "v2_rest_ratio": round(medians["v2_rest"] / floor, 3),
    }


# ---- 2. throughput at c=16 -----------------------------------------------------------------


class GrpcSender:
    """One ModelInfer message, sent raw; the answer read whole, then dropped. One channel per
    concurrent call (created on first need, then reused), as HttpSender keeps one connection
    per concurrent request."""

    def __init__(self, target: str, raw: bytes, *, metadata: tuple[tuple[str, str], ...] = ()):
        self._target = target
        self._raw = raw
        self._metadata = metadata or None
        self._idle: list[tuple[grpc.aio.Channel, Any]] = []
        self._all: list[grpc.aio.Channel] = []

    def _method(self) -> tuple[grpc.aio.Channel, Any]:
        if self._idle:
            return self._idle.pop()
        channel = grpc.aio.insecure_channel(self._target, options=CHANNEL_OPTIONS)
        self._all.append(channel)
        return channel, channel.unary_unary(INFER_METHOD)

    async def __call__(self) -> int:
        pair = self._method()
        try:
            await pair[1](self._raw, metadata=self._metadata, timeout=60)
            return 200
        except grpc.aio.AioRpcError as exc:
            return {grpc.StatusCode.UNAVAILABLE: 503}.get(exc.code(), 500)
        finally:
            self._idle.append(pair)

    async def aclose(self) -> None:
        for channel in self._all:
            await channel.close()


async def _run(send: Any, seconds: float, name: str) -> float:
    await run_load(send, LoadPlan(concurrency=16, duration_s=1.0))  # warm-up
    report = await run_load(send, LoadPlan(concurrency=16, duration_s=seconds))
    if report.ok != report.sent:
        raise RuntimeError(f"{name}: {report.sent - report.ok} requests failed")
    return float(report.throughput_rps)


async def _grpc_throughput(
    target: str, raw: bytes, seconds: float, metadata: tuple[tuple[str, str], ...] = ()
) -> float:
    sender = GrpcSender(target, raw, metadata=metadata)
    try:
        return await _run(sender, seconds, target)
    finally:
        await sender.aclose()


async def _rest_throughput(url: str, payload: Payload, seconds: float) -> float:
    async with HttpSender(url, payload) as send:
        return await _run(send, seconds, url)


def measure_throughput(
    service_grpc: str, service_http: str, noop: str, seconds: float, rounds: int
) -> dict[str, Any]:
    rest = Payload.from_preset(PRESETS["small"], protocol="v2")
    raw = grpc_request(rest_inputs(rest), parameters={"diagnostics": "none"})
    with grpc.insecure_channel(service_grpc) as channel:
        reply = channel.unary_unary(INFER_METHOD)(raw, timeout=60)
    noop_metadata = ((REPLY_BYTES_KEY, str(len(reply))),)
    rps: dict[str, list[float]] = {"grpc": [], "v2_rest": [], "noop_grpc": []}
    for _ in range(rounds):  # alternating, so that drift hits all three
        rps["grpc"].append(asyncio.run(_grpc_throughput(service_grpc, raw, seconds)))
        rps["v2_rest"].append(asyncio.run(_rest_throughput(service_http, rest, seconds)))
        rps["noop_grpc"].append(
            asyncio.run(_grpc_throughput(noop, raw, seconds, metadata=noop_metadata))
        )
    medians = {name: p50(values) for name, values in rps.items()}
    return {
        "preset": PRESETS["small"].describe(),
        "request_bytes": {"grpc": len(raw), "v2_rest": len(rest.body)},
        "response_bytes": {"grpc": len(reply)},
        "seconds_each": seconds,
        "rounds": rounds,
        "rps": {name: [round(x, 1) for x in values] for name, values in rps.items()},
        "rps_median": {name: round(x, 1) for name, x in medians.items()},
        "ratio": round(medians["grpc"] / medians["v2_rest"], 3),
        "noop_ratio": round(medians["grpc"] / medians["noop_grpc"], 3),
    }


# ---- the report ----------------------------------------------------------------------------


def run(quick: bool) -> dict[str, Any]:
    load_before = os.getloadavg()
    grpc_port = free_port()
    env = {"SDPA_LOG_LEVEL": "warning", "SDPA_GRPC_PORT": str(grpc_port)}
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server(env, tmp_path=Path(tmp)) as service,
        noop_server() as noop,
    ):
        target = f"127.0.0.1:{grpc_port}"
        w3 = measure_w3(target, service.url, noop, count=40 if quick else 100)
        throughput = measure_throughput(
            target, service.url, noop, seconds=3.0 if quick else 6.0, rounds=2 if quick else 3
        )
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "grpcio": grpc.__version__,
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        },
        "quick": quick,
        "targets": TARGETS,
        "w3": w3,
        "throughput_c16": throughput,
    }


def _verdict(value: float, target: float, *, at_most: bool) -> str:
    ok = value <= target if at_most else value >= target
    return "met" if ok else "NOT met"


def to_markdown(report: dict[str, Any]) -> str:
    w3, thr, t = report["w3"], report["throughput_c16"], report["targets"]
    machine = report["machine"]
    p = w3["p50_ms"]
    lines = [
        f"# gRPC (Open Inference Protocol, raw tensor contents) — {report['date']}",
        "",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs, torch {machine['torch']}, "
        f"grpcio {machine['grpcio']}, load {machine['load_before']} before, "
        f"{machine['load_after']} after. Quick: {report['quick']}.",
        "",
        "| measurement | value | floor | ratio | target | verdict |",
        "|---|---|---|---|---|---|",
        f"| W3 gRPC p50 (ms) | {p['grpc']} | compute {p['compute']} + no-op gRPC {p['noop']} "
        f"= {w3['floor_ms']} | {w3['ratio']} | <= {t['w3_ratio']} | "
        f"{_verdict(w3['ratio'], t['w3_ratio'], at_most=True)} |",
        f"| W3 gRPC p50 (ms), floor with the server's compute_ms | {p['grpc']} | compute "
        f"{p['server_compute']} + no-op gRPC {p['noop']} = {w3['server_floor_ms']} | "
        f"{w3['server_ratio']} | <= {t['w3_ratio']} | "
        f"{_verdict(w3['server_ratio'], t['w3_ratio'], at_most=True)} |",
        f"| W3 v2 REST binary p50 (ms), same run | {p['v2_rest']} | {w3['floor_ms']} | "
        f"{w3['v2_rest_ratio']} | (comparison) | |",
        f"| c=16 small, gRPC (req/s) | {thr['rps_median']['grpc']} | v2 REST binary "
        f"{thr['rps_median']['v2_rest']} | {thr['ratio']} | >= {t['throughput_ratio']} | "
        f"{_verdict(thr['ratio'], t['throughput_ratio'], at_most=False)} |",
        f"| c=16 small, gRPC against the no-op gRPC server (req/s) | "
        f"{thr['rps_median']['grpc']} | no-op {thr['rps_median']['noop_grpc']} | "
        f"{thr['noop_ratio']} | (comparison) | |",
        "",
        "W3, where the server's time went (p50 of each Server-Timing phase, ms): "
        + "; ".join(
            f"{door} " + ", ".join(f"{k} {v}" for k, v in by_phase.items())
            for door, by_phase in w3["server_timing_p50_ms"].items()
        )
        + ".",
        "",
        f"W3 calls: {w3['request_bytes']} bytes in, {w3['response_bytes']} bytes out; "
        f"{w3['requests_each']} calls each. Throughput rounds (req/s): {thr['rps']}; "
        f"request bytes {thr['request_bytes']}.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    noop = sub.add_parser("noop", help="serve the no-op gRPC server (used by the benchmark)")
    noop.add_argument("--port", type=int, required=True)
    parser.add_argument("--quick", action="store_true", help="fewer requests (about 1.5 min)")
    args = parser.parse_args()
    if args.command == "noop":
        noop_main(args.port)
        return 0
    report = run(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grpc.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    markdown = to_markdown(report)
    (RESULTS / "grpc.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
