"""Slow bodies against a real server, measured (issue 23): bodies whose shape, not size, makes
them costly to decode or to refuse. What each costs the event loop, and what it answers.

    .venv/bin/python bench/attack_decode.py decode-costs   # ~1 min, no server
    .venv/bin/python bench/attack_decode.py slow-bodies    # ~2 min

decode-costs: no server; each shape decoded as the service decodes it (service.serving.offload
decides inline or a worker thread, the collector paused while it runs) beside an asyncio timer
that wakes every millisecond: the shape's size, the estimate and the decision, the decode's
time, and the longest the loop went without running (the worst stall one request's decoding
caused; the issue's target is 50 ms). A worker thread frees the loop only from work that lets
the GIL go: the JSON parser and numpy reading nested lists hold it throughout.

slow-bodies: for each shape, two clients loop it for --seconds (default 8) beside a bystander
that sends GET /healthz and a small POST /v1/attention every 0.1 s; prints the answers'
statuses and sizes (the error body's, bounded), the bystander's p50 / p99 / max per probe (the
/healthz maximum is the worst stall of the loop an attacker caused), and the 500s and
tracebacks in the server's log.

Shapes: 90,000 unknown fields (979 KB, the issue's), 1,000,000 unknown fields (12 MB), 2,000
unknown fields in each of q, k and v, one unknown field of 1 MB, nested single-element lists
([N, 1, 1]; 1 MiB and 16 MiB), rank-6 single-element lists (1 MiB), rows of 2 numbers (1 MiB),
booleans among numbers, v2 parameters of 90,000 unknown fields, v2 single-element lists
(1 MiB), and an Inference-Header-Content-Length of 4,301 digits.

Every loop is bounded in time and count; the server listens on 127.0.0.1. Figures on a shared
machine are noisy: rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import live_server  # noqa: E402

MB = 2**20
SMALL = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}
JSON = {"content-type": "application/json"}
V1 = "/v1/attention"
V2 = "/v2/models/attention/infer"


@dataclass(frozen=True)
class Shape:
    """A body that is slow for its shape: where it goes, with which headers."""

    name: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def _unknown_fields(count: int) -> str:
    # "f12345": 0 -> 11 bytes a field: 90,000 of them in 979 KB, as in the issue.
    return ", ".join(f'"f{i}": 0' for i in range(count))


def _single_element_rows(n: int, rank: int = 3) -> str:
    """A tensor [n, 1, ...] (rank dims) of single-element lists, as JSON text."""
    leaf = "[" * (rank - 1) + "0.5" + "]" * (rank - 1)
    return "[" + ", ".join([leaf] * n) + "]"


def _v2(inputs: list[str], extra: str = "") -> bytes:
    return ('{"inputs": [' + ", ".join(inputs) + "]" + extra + "}").encode()


def _v2_input(name: str, data: str, shape: list[int]) -> str:
    return f'{{"name": "{name}", "datatype": "FP32", "shape": {shape}, "data": {data}}}'


def shapes() -> list[Shape]:
    """The slow bodies, built once (the 16 MiB one takes a second)."""
    ok = '"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]'
    per_tensor = _unknown_fields(2000)
    tensor = f'{{"dtype": "float32", "data": [[1.0, 0.0]], {per_tensor}}}'
    mib_rows = MB // 8 // 3  # "[[0.5]], " is 9 bytes: q, k, v of about 1 MiB together
    rank6_rows = MB // 17 // 3
    pairs = MB // 14 // 3
    mixed = "[" + ", ".join(["[0.5, true]"] * (MB // 14 // 3)) + "]"
    v2_small = [_v2_input(n, "[1.0, 2.0]", [1, 2]) for n in "qkv"]
    v2_rows = MB // 8 // 3
    v2_nested = [_v2_input(n, _single_element_rows(v2_rows), [v2_rows, 1, 1]) for n in "qkv"]
    return [
        Shape("90,000 unknown fields", V1, f"{{{ok}, {_unknown_fields(90_000)}}}".encode()),
        Shape("1,000,000 unknown fields", V1, f"{{{ok}, {_unknown_fields(10**6)}}}".encode()),
        Shape("2,000 unknown fields in q, k, v", V1,
              f'{{"q": {tensor}, "k": {tensor}, "v": {tensor}}}'.encode()),
        Shape("one 1 MB unknown field", V1, f'{{{ok}, "{"x" * MB}": 0}}'.encode()),
        Shape("[N, 1, 1] lists, 1 MiB", V1, "{{{}}}".format(", ".join(
            f'"{n}": {_single_element_rows(mib_rows)}' for n in "qkv")).encode()),
        Shape("[N, 1, 1] lists, 16 MiB", V1, "{{{}}}".format(", ".join(
            f'"{n}": {_single_element_rows(16 * mib_rows)}' for n in "qkv")).encode()),
        Shape("rank-6 single-element lists, 1 MiB", V1, "{{{}}}".format(", ".join(
            f'"{n}": {_single_element_rows(rank6_rows, rank=6)}' for n in "qkv")).encode()),
        Shape("rows of 2 numbers, 1 MiB", V1, "{{{}}}".format(", ".join(
            f'"{n}": [' + ", ".join(["[0.5, 0.25]"] * pairs) + "]" for n in "qkv")).encode()),
        Shape("booleans among numbers, 1 MiB", V1,
              f'{{"q": {mixed}, "k": {mixed}, "v": {mixed}}}'.encode()),
        Shape("v2 parameters: 90,000 unknown", V2,
              _v2(v2_small, f', "parameters": {{{_unknown_fields(90_000)}}}')),
        Shape("v2 [N, 1, 1] lists, 1 MiB", V2, _v2(v2_nested)),
        Shape("v2 header length of 4,301 digits", V2, _v2(v2_small),
              {"Inference-Header-Content-Length": "1" * 4301}),
    ]  # fmt: skip


# ---- decode-costs ----------------------------------------------------------------------------


async def _decode_beside_a_timer(shape: Shape) -> tuple[bool, float, float, str]:
    """Decode `shape` as the pipeline does -> (inline, seconds, the loop's longest gap, result)."""
    from service.errors import ServiceError
    from service.runtime.policy import CostModel
    from service.serving.offload import decode_inline, run_decoding
    from service.serving.prepare import prepare_attention
    from service.serving.prepare_v2 import prepare_infer
    from service.settings import Settings
    from service.wire.lengths import parse_length

    settings = Settings(device="cpu")
    cost = CostModel.uncalibrated()
    length = shape.headers.get("Inference-Header-Content-Length")
    json_bytes = None if length is None else parse_length(length)
    inline = decode_inline(shape.body, json_bytes=json_bytes)
    worst = 0.0
    running = True

    async def timer() -> None:
        nonlocal worst
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last - 0.001)
            last = now

    ticking = asyncio.create_task(timer())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    try:
        if shape.path == V2:
            await run_decoding(inline, prepare_infer, shape.body, length, settings, cost)
        else:
            await run_decoding(inline, prepare_attention, shape.body, settings, cost)
        result = "decoded"
    except ServiceError as exc:
        result = f"{exc.status}: {exc.detail[:70]}"
    took = time.perf_counter() - started
    await asyncio.sleep(0.01)
    running = False
    await ticking
    return inline, took, worst, result


def decode_costs() -> None:
    import torch

    torch.set_num_threads(1)  # as the server's loop and decoding workers run torch
    # A small body first, padded to leave the loop: the first decode pays for imports and
    # for starting the worker thread.
    padded = json.dumps(SMALL).encode() + b" " * MB
    asyncio.run(_decode_beside_a_timer(Shape("warm-up", V1, padded)))
    for shape in shapes():
        inline, took, worst, result = asyncio.run(_decode_beside_a_timer(shape))
        where = "inline" if inline else "worker"
        print(
            f"{shape.name:36s} {len(shape.body) / MB:6.2f} MiB {where:6s} decode "
            f"{took * 1e3:7.1f} ms, loop stalled {worst * 1e3:6.1f} ms at worst -> {result}",
            flush=True,
        )


# ---- slow-bodies -----------------------------------------------------------------------------


@dataclass
class Bystander:
    """GET /healthz and a small POST /v1/attention every `every_s` seconds, timed apart."""

    url: str
    every_s: float = 0.1
    latencies_ms: dict[str, list[float]] = field(
        default_factory=lambda: {"/healthz": [], "small attention": []}
    )
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    failures: int = 0  # requests that got no answer within 10 s
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                for probe in self.latencies_ms:
                    started = time.perf_counter()
                    try:
                        if probe == "/healthz":
                            response = client.get("/healthz")
                        else:
                            response = client.post(V1, json=SMALL)
                        self.statuses[response.status_code] += 1
                    except httpx.HTTPError:
                        self.failures += 1
                    self.latencies_ms[probe].append((time.perf_counter() - started) * 1e3)
                self._stop.wait(self.every_s)

    def __enter__(self) -> Bystander:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def summary(self) -> str:
        parts = []
        for probe, values in self.latencies_ms.items():
            ms = sorted(values) or [0.0]
            p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
            p50 = ms[len(ms) // 2]
            parts.append(f"{probe} p50 {p50:.0f} / p99 {p99:.0f} / max {ms[-1]:.0f} ms")
        return (
            f"bystander: {'; '.join(parts)}; statuses {dict(self.statuses)}, "
            f"no answer {self.failures}"
        )


def log_errors(text: str) -> str:
    """The 500s in the access log and the tracebacks in the server's output."""
    five_hundreds = len(re.findall(r'"status": ?500\b', text))
    return f"500s in the log: {five_hundreds}, tracebacks: {text.count('Traceback')}"


def _loop_shape(url: str, shape: Shape, stop_at: float, answers: list[tuple[int, int]]) -> None:
    headers = {**JSON, **shape.headers}
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.monotonic() < stop_at:
            response = client.post(shape.path, content=shape.body, headers=headers)
            answers.append((response.status_code, len(response.content)))


def slow_bodies(seconds: float = 8.0, clients: int = 2) -> None:
    bodies = shapes()
    with tempfile.TemporaryDirectory() as tmp, live_server({}, tmp_path=Path(tmp)) as server:
        log = Path(tmp) / f"server-{server.url.rsplit(':', 1)[1]}.log"
        for shape in bodies:
            answers: list[tuple[int, int]] = []
            stop_at = time.monotonic() + seconds
            threads = [
                threading.Thread(target=_loop_shape, args=(server.url, shape, stop_at, answers))
                for _ in range(clients)
            ]
            with Bystander(server.url) as bystander:
                time.sleep(0.3)  # a few quiet probes first
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            statuses = collections.Counter(status for status, _ in answers)
            sizes = sorted({size for _, size in answers})
            print(f"{shape.name} ({len(shape.body) / MB:.2f} MiB, {clients} clients, "
                  f"{seconds:.0f} s): {len(answers)} answers {dict(statuses)}, "
                  f"answer bytes {sizes[:3]}")  # fmt: skip
            print(f"  {bystander.summary()}", flush=True)
        print(log_errors(log.read_text(encoding="utf-8", errors="replace")))


ATTACKS: dict[str, Callable[[], None]] = {
    "decode-costs": decode_costs,
    "slow-bodies": slow_bodies,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("attack", choices=list(ATTACKS))
    parser.add_argument("--seconds", type=float, default=8.0, help="slow-bodies: per shape")
    args = parser.parse_args()
    if args.attack == "slow-bodies":
        slow_bodies(seconds=args.seconds)
    else:
        ATTACKS[args.attack]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
