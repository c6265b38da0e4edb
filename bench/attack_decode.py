"""Slow bodies against a real server, measured (issue 23): bodies whose shape, not size, makes
them costly to decode or to refuse, and the big JSON-list bodies a client may legally send.
What each costs the event loop, the process's memory, and what it answers.

    .venv/bin/python bench/attack_decode.py decode-costs     # ~3 min, no server
    .venv/bin/python bench/attack_decode.py decode-memory    # ~3 min, no server
    .venv/bin/python bench/attack_decode.py slow-bodies      # ~4 min
    (--only TEXT: the shapes whose name holds TEXT)

decode-costs: no server; each shape decoded as the service decodes it (service.serving.offload
decides inline or a worker thread, the collector paused on a worker) beside an asyncio timer
that wakes every millisecond: the shape's size and where it decodes, then "before" (the body
parsed whole, as before service.wire.json_arrays) and "after" (as the pipeline decodes it now:
a body that leaves the loop has its big arrays of numbers parsed in pieces): each the decode's
time and the longest the loop went without running (the worst stall one request's decoding
caused; the issue's target is 50 ms). A worker thread frees the loop only from work that lets
the GIL go: from_json and numpy reading nested lists hold it throughout a call, which is why
the arrays are parsed in pieces of 256 KiB.

decode-memory: no server; each shape decoded before and after, each in a fresh process: the
growth of its peak RSS (VmHWM, reset with clear_refs) while it decodes, as a multiple of the
body and per ',' of it (what service.middleware.inflight reserves: ELEMENT_PEAK_BYTES per ',').

slow-bodies: for each shape, two clients loop it for --seconds (default 8) beside a bystander
in a process of its own that sends GET /healthz and a small POST /v1/attention every 0.15 s;
prints the answers' statuses and sizes (the error body's, bounded), the bystander's p50 / p99 /
max (its worst latency is the worst stall of the loop an attacker caused), and the 500s and
tracebacks in the server's log.

Shapes: 90,000 unknown fields (979 KB, the issue's), 1,000,000 unknown fields (12 MB), 2,000
unknown fields in each of q, k and v, one unknown field of 1 MB, nested single-element lists
([N, 1, 1]; 1 MiB and 16 MiB), rank-6 single-element lists (1 MiB), rows of 2 numbers (1 MiB),
booleans among numbers, v2 parameters of 90,000 unknown fields, v2 single-element lists
(1 MiB), an Inference-Header-Content-Length of 4,301 digits; and the big legal ones: 128 MiB of
rows of 64 numbers (v1 tensor objects' data, v1 bare lists, v2 data: q, k, v [N, 64], refused
for their work once decoded), a 32 MiB bool mask and a 16 MiB float mask with nulls as JSON.

Every loop is bounded in time and count; the server listens on 127.0.0.1. Figures on a shared
machine are noisy: rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import Bystander, attacked_server, log_summary  # noqa: E402

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


def _rows(rows: int, width: int = 64) -> str:
    """`rows` rows of `width` numbers of 6 decimals as JSON (1,024 distinct rows, repeated)."""
    rng = random.Random(0)
    block = ["[" + ", ".join(f"{rng.uniform(-2, 2):.6f}" for _ in range(width)) + "]"
             for _ in range(1024)]  # fmt: skip
    return "[" + ", ".join(block[i % len(block)] for i in range(rows)) + "]"


def _mask(side: int, *, nulls: bool) -> str:
    """A [side, side] attn_mask as JSON: booleans, or numbers with null for -inf."""
    rng = random.Random(1)
    if nulls:
        leaves = [
            f"{rng.uniform(-2, 2):.3f}" if rng.random() < 0.7 else "null" for _ in range(4096)
        ]
    else:
        leaves = ["true" if rng.random() < 0.5 else "false" for _ in range(4096)]
    rows = [", ".join(leaves[(i * 7 + j) % 4096] for j in range(side)) for i in range(64)]
    return "[" + ", ".join("[" + rows[i % 64] + "]" for i in range(side)) + "]"


def big_shapes() -> list[tuple[str, str, Callable[[], bytes]]]:
    """The big legal JSON-list bodies: (name, path, how to build it), built one at a time."""
    row_bytes = len(_rows(1024)) / 1024  # the average row, with its ", "
    n = int((128 * MB - 4096) / 3 / row_bytes)  # q, k, v of rows of 64 numbers: 128 MiB

    def v1_data() -> bytes:
        t = f'{{"dtype": "float32", "shape": [{n}, 64], "data": {_rows(n)}}}'
        return f'{{"q": {t}, "k": {t}, "v": {t}, "diagnostics": "none"}}'.encode()

    def v1_lists() -> bytes:
        t = _rows(n)
        return f'{{"q": {t}, "k": {t}, "v": {t}, "diagnostics": "none"}}'.encode()

    def v2_data() -> bytes:
        t = _rows(n)
        inputs = [f'{{"name": "{k}", "datatype": "FP32", "shape": [{n}, 64], "data": {t}}}'
                  for k in "qkv"]  # fmt: skip
        return _v2(inputs)

    def masked(side: int, *, nulls: bool) -> Callable[[], bytes]:
        def build() -> bytes:
            t = _rows(side, 8)
            return (f'{{"q": {t}, "k": {t}, "v": {t}, "attn_mask": {_mask(side, nulls=nulls)}, '
                    '"diagnostics": "none"}').encode()  # fmt: skip

        return build

    return [
        ("rows of 64, 128 MiB, v1 data", V1, v1_data),
        ("rows of 64, 128 MiB, v1 lists", V1, v1_lists),
        ("rows of 64, 128 MiB, v2 data", V2, v2_data),
        ("bool mask, 32 MiB", V1, masked(2360, nulls=False)),  # "true, " about 6 bytes
        ("float mask with nulls, 16 MiB", V1, masked(1530, nulls=True)),
    ]


def all_shapes(only: str = "") -> Iterator[Shape]:
    """Every shape whose name holds `only`, the big ones built as they come."""
    for shape in shapes():
        if only in shape.name:
            yield shape
    for name, path, build in big_shapes():
        if only in name:
            yield Shape(name, path, build())


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


async def _decode_beside_a_timer(shape: Shape, *, whole: bool) -> tuple[bool, float, float, str]:
    """Decode `shape` as the pipeline does (`whole`: with its arrays parsed whole, as before)
    -> (inline, seconds, the loop's longest gap, result)."""
    from service.errors import ServiceError
    from service.runtime.policy import CostModel
    from service.serving.offload import decode_inline, run_decoding
    from service.serving.prepare import prepare_attention
    from service.serving.prepare_v2 import prepare_infer
    from service.settings import Settings
    from service.wire.json_arrays import PIECES
    from service.wire.lengths import parse_length

    settings = Settings(device="cpu")
    cost = CostModel.uncalibrated()
    length = shape.headers.get("Inference-Header-Content-Length")
    json_bytes = None if length is None else parse_length(length)
    inline = decode_inline(shape.body, json_bytes=json_bytes)
    pieces = None if inline or whole else PIECES
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
            await run_decoding(
                inline, prepare_infer, shape.body, length, settings, cost, pieces=pieces
            )
        else:
            await run_decoding(inline, prepare_attention, shape.body, settings, cost, pieces=pieces)
        result = "decoded"
    except ServiceError as exc:
        result = f"{exc.status}: {exc.detail[:60]}"
    took = time.perf_counter() - started
    await asyncio.sleep(0.01)
    running = False
    await ticking
    return inline, took, worst, result


def decode_costs(only: str = "") -> None:
    import torch

    torch.set_num_threads(1)  # as the server's loop and decoding workers run torch
    # A small body first, padded to leave the loop: the first decode pays for imports and
    # for starting the worker thread.
    padded = json.dumps(SMALL).encode() + b" " * MB
    for whole in (True, False):
        asyncio.run(_decode_beside_a_timer(Shape("warm-up", V1, padded), whole=whole))
    print(f"{'shape':36s} {'size':>10s} {'where':6s} {'before: decode, worst stall':>29s}   "
          f"{'after: decode, worst stall':>28s}   result")  # fmt: skip
    for shape in all_shapes(only):
        _, before, before_worst, _ = asyncio.run(_decode_beside_a_timer(shape, whole=True))
        inline, took, worst, result = asyncio.run(_decode_beside_a_timer(shape, whole=False))
        where = "inline" if inline else "worker"
        print(
            f"{shape.name:36s} {len(shape.body) / MB:6.2f} MiB {where:6s} "
            f"{before * 1e3:9.0f} ms, {before_worst * 1e3:7.1f} ms   "
            f"{took * 1e3:9.0f} ms, {worst * 1e3:7.1f} ms   {result}",
            flush=True,
        )


# ---- decode-memory ---------------------------------------------------------------------------


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _decode_once(name: str, whole: bool) -> None:
    """In a fresh process: decode the shape `name` -> its peak RSS growth, printed as JSON."""
    import gc

    import torch

    from service.errors import ServiceError
    from service.runtime.policy import CostModel
    from service.serving.prepare import prepare_attention
    from service.serving.prepare_v2 import prepare_infer
    from service.settings import Settings
    from service.wire.json_arrays import PIECES

    torch.set_num_threads(1)
    (shape,) = [s for s in all_shapes(name) if s.name == name]
    settings, cost = Settings(device="cpu"), CostModel.uncalibrated()
    pieces = None if whole else PIECES
    gc.collect()
    gc.disable()  # as on a worker (service.serving.gc_pause)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _peak_kib()
    try:
        if shape.path == V2:
            prepare_infer(shape.body, None, settings, cost, pieces=pieces)
        else:
            prepare_attention(shape.body, settings, cost, pieces=pieces)
    except ServiceError:
        pass  # refused once decoded (the work limit): the decode's peak is what is measured
    grown = (_peak_kib() - before) * 1024
    print(json.dumps({"grown": grown, "body": len(shape.body), "commas": shape.body.count(b",")}))


def decode_memory(only: str = "") -> None:
    names = [name for name, _, _ in big_shapes() if only in name]
    names += [s.name for s in shapes() if only in s.name and "lists" in s.name]
    print(
        f"{'shape':36s} {'body':>8s}   {'before: peak growth':>30s}   {'after: peak growth':>30s}"
    )
    for name in names:
        figures = []
        for whole in (True, False):
            out = subprocess.run(
                [sys.executable, __file__, "_decode-once", name, "whole" if whole else "pieces"],
                capture_output=True, text=True, check=True, timeout=600,
            )  # fmt: skip
            figures.append(json.loads(out.stdout.strip().splitlines()[-1]))
        body, commas = figures[0]["body"], figures[0]["commas"]
        cells = [
            f"{f['grown'] / MB:6.0f} MiB {f['grown'] / body:5.2f}x {f['grown'] / commas:6.1f} B/','"
            for f in figures
        ]
        print(f"{name:36s} {body / MB:4.0f} MiB   {cells[0]:>30s}   {cells[1]:>30s}", flush=True)


# ---- slow-bodies -----------------------------------------------------------------------------


def _loop_shape(url: str, shape: Shape, stop_at: float, answers: list[tuple[int, int]]) -> None:
    headers = {**JSON, **shape.headers}
    with httpx.Client(base_url=url, timeout=120) as client:
        while time.monotonic() < stop_at:
            response = client.post(shape.path, content=shape.body, headers=headers)
            answers.append((response.status_code, len(response.content)))


def slow_bodies(seconds: float = 8.0, clients: int = 2, only: str = "") -> None:
    # A bound above what two 128 MiB JSON bodies reserve at 52 bytes per ',' (the in-flight
    # estimate of a whole parse): what is measured here is the loop, not that bound.
    env = {"SDPA_MAX_INFLIGHT_BYTES": str(8 * 1024 * MB)}
    with attacked_server(env) as server:
        for shape in all_shapes(only):
            answers: list[tuple[int, int]] = []
            stop_at = time.monotonic() + seconds
            threads = [
                threading.Thread(target=_loop_shape, args=(server.url, shape, stop_at, answers))
                for _ in range(clients)
            ]
            with Bystander(server.url) as bystander:
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
        print(log_summary(server.log()))


ATTACKS: dict[str, Callable[[], None]] = {
    "decode-costs": decode_costs,
    "decode-memory": decode_memory,
    "slow-bodies": slow_bodies,
}


def main() -> int:
    if sys.argv[1:2] == ["_decode-once"]:  # decode-memory's fresh process for one shape
        _decode_once(sys.argv[2], sys.argv[3] == "whole")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("attack", choices=list(ATTACKS))
    parser.add_argument("--seconds", type=float, default=8.0, help="slow-bodies: per shape")
    parser.add_argument("--only", default="", help="the shapes whose name holds this text")
    args = parser.parse_args()
    if args.attack == "slow-bodies":
        slow_bodies(seconds=args.seconds, only=args.only)
    elif args.attack == "decode-memory":
        decode_memory(args.only)
    else:
        decode_costs(args.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
