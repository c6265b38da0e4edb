"""Attacks with request bodies against a real server, measured (issue 23): what parsing a JSON
body holds, the largest JSON-list bodies alone and six at once, compressed bodies, and numbers
and codings in headers. Each attack runs beside a bystander that probes /healthz and sends a
small request every 0.15 s.

    .venv/bin/python bench/attacks.py parse-peak       # ~1 min, no server
    .venv/bin/python bench/attacks.py json-body        # ~1 min
    .venv/bin/python bench/attacks.py bodies-flood     # ~1 min
    .venv/bin/python bench/attacks.py header-numbers   # ~30 s

parse-peak: no server; q, k, v bodies prepared as the service prepares them, each in a fresh
process, with the growth of its peak RSS (VmHWM after clear_refs) per JSON separator, beside
what service.middleware.inflight reserves for them (ELEMENT_PEAK_BYTES per ",",
CONTAINER_PEAK_BYTES per "[" or "{", KEY_PEAK_BYTES per ":"). Where those constants come from.

json-body: one 128 MiB JSON-list body (q, k, v [1, 1, 138000, 64] of one-decimal numbers, the
body limit's size) against SDPA_MAX_INFLIGHT_BYTES = 512 MiB, then against the default bound (a
quarter of the memory): its status and time, the server's peak RSS growth (VmHWM), the
bystander's p50 / p99 / max, and the 500s and tracebacks in the server's log.

bodies-flood: SDPA_MAX_INFLIGHT_BYTES = 512 MiB; for 20 s, 6 clients loop 128 MiB bodies: three
send the JSON-list body above, three the same gzip-compressed (about 0.3 MB on the wire, no
Content-Length once inflated); prints their statuses, the peak RSS growth against twice the
bound (the issue's check), the bystander, the refusals' metrics and the log's 500s.

header-numbers: Content-Length and Inference-Header-Content-Length of 5,000 leading zeros or
4,301 digits (int() refuses strings past 4,300 digits), multi-member gzip, two Content-Encoding
headers, three codings: each status and time on a raw socket, then the log's 500s.

To compare with an older server: `git worktree add /tmp/old COMMIT`, then
`.venv/bin/python bench/attacks.py --tree /tmp/old json-body`.

Every loop is bounded in time and count; the server listens on 127.0.0.1. Figures on a shared
machine are noisy: rerun on a quiet one.
"""

from __future__ import annotations

import collections
import gzip
import json
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import (  # noqa: E402
    SMALL,
    Bystander,
    attacked_server,
    log_summary,
    memory_mb,
    reset_peak,
)

MB = 2**20
BOUND = 512 * MB  # the SDPA_MAX_INFLIGHT_BYTES for these attacks
JSON = {"content-type": "application/json"}
# q, k, v [1, 1, N, 64] of "0.5": 322 bytes a row, so N = 138,000 makes a body just under the
# default SDPA_MAX_BODY_BYTES (128 MiB) of 5-byte numbers, each parsed into a Python float.
ROWS = 138_000
SEPARATORS = (b",", b"[", b"{", b":")


# ---- the server and its bystander ------------------------------------------------------------


# ---- bodies ----------------------------------------------------------------------------------


def json_list_body(rows: int = ROWS, d: int = 64) -> bytes:
    """q, k, v [1, 1, rows, d] as JSON lists of 0.5, without diagnostics."""
    row = "[" + ", ".join(["0.5"] * d) + "]"
    tensor = "[[[" + ", ".join([row] * rows) + "]]]"
    return f'{{"q": {tensor}, "k": {tensor}, "v": {tensor}, "diagnostics": "none"}}'.encode()


def separators(body: bytes) -> dict[str, int]:
    return {sep.decode(): body.count(sep) for sep in SEPARATORS}


# ---- parse-peak ------------------------------------------------------------------------------

# Each kind: how its body is built (elements per tensor: 2**21) and which door prepares it.
PARSE_KINDS = ("v1 numbers", "v1 one-number lists", "v1 empty lists", "v2 flat data",
               "object keys")  # fmt: skip


def _parse_body(kind: str, elements: int) -> bytes:
    numbers = ", ".join(f"{(i % 19 - 9) / 10}" for i in range(64))  # one decimal: short
    if kind == "v1 numbers":
        rows = ", ".join(["[" + numbers + "]"] * (elements // 64))
        t = f"[[[{rows}]]]"
        return f'{{"q": {t}, "k": {t}, "v": {t}, "diagnostics": "none"}}'.encode()
    if kind == "v1 one-number lists":
        t = "[[" + ", ".join(f"[{(i % 19 - 9) / 10}]" for i in range(elements)) + "]]"
        return f'{{"q": {t}, "k": {t}, "v": {t}, "diagnostics": "none"}}'.encode()
    if kind == "v1 empty lists":  # refused once parsed (an empty dimension)
        t = "[" + ",".join(["[]"] * elements) + "]"
        return f'{{"q": {t}, "k": {t}, "v": {t}}}'.encode()
    if kind == "v2 flat data":
        flat = "[" + ", ".join([numbers] * (elements // 64)) + "]"
        inputs = ", ".join(
            f'{{"name": "{n}", "shape": [1, 1, {elements // 64}, 64], "datatype": "FP32", '
            f'"data": {flat}}}'
            for n in "qkv"
        )
        return f'{{"inputs": [{inputs}]}}'.encode()
    if kind == "object keys":  # parsed only (what refusing unknown fields costs is not this)
        return ("{" + ", ".join(f'"k{i}": 0' for i in range(elements)) + "}").encode()
    raise ValueError(kind)


def _peak_rss_bytes(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field_name)


def parse_child(kind: str, elements: int) -> None:
    """In a fresh process: prepare one body of `kind`, print its separators and peak growth."""
    from sdpa_core.errors import SdpaError
    from service.errors import ServiceError
    from service.runtime.policy import CostModel
    from service.serving.prepare import prepare_attention
    from service.serving.prepare_v2 import prepare_infer
    from service.settings import Settings
    from service.wire.codec import loads

    settings = Settings(max_request_flops=1e30, max_body_bytes=1 << 30)
    body = _parse_body(kind, elements)
    prepare: Callable[[], object]
    if kind.startswith("v1"):
        prepare = lambda: prepare_attention(body, settings, CostModel.uncalibrated())  # noqa: E731
    elif kind.startswith("v2"):
        prepare = lambda: prepare_infer(body, None, settings, CostModel.uncalibrated())  # noqa: E731
    else:
        prepare = lambda: loads(body)  # noqa: E731
    Path("/proc/self/clear_refs").write_text("5")
    before = _peak_rss_bytes("VmRSS")
    try:
        prepare()
        outcome = "prepared"
    except (ServiceError, SdpaError) as exc:
        outcome = f"refused once parsed: {type(exc).__name__}"
    peak = _peak_rss_bytes("VmHWM") - before
    print(json.dumps({"body": len(body), "peak": peak, "outcome": outcome, **separators(body)}))


def parse_peak(elements: int = 2**21) -> None:
    from service.middleware.inflight import (
        CONTAINER_PEAK_BYTES,
        ELEMENT_PEAK_BYTES,
        KEY_PEAK_BYTES,
        parse_estimate,
    )

    print(f"reserved: {ELEMENT_PEAK_BYTES} B per ',', {CONTAINER_PEAK_BYTES} per '[' or '{{', "
          f"{KEY_PEAK_BYTES} per ':'")  # fmt: skip
    for kind in PARSE_KINDS:
        code = f"from bench.attack_bodies import parse_child; parse_child({kind!r}, {elements})"
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=300, check=True,
        )  # fmt: skip
        got = json.loads(done.stdout.strip().splitlines()[-1])
        estimate = parse_estimate(_parse_body(kind, elements))
        per = got["peak"] / max(1, got[","])
        print(
            f"{kind}: body {got['body'] / MB:.1f} MB, ',' {got[',']}, '[' {got['[']}, "
            f"'{{' {got['{']}, ':' {got[':']} -> peak growth {got['peak'] / MB:.0f} MB "
            f"({got['peak'] / got['body']:.1f}x the body, {per:.1f} B per ','); reserved "
            f"{estimate / MB:.0f} MB ({estimate / max(1, got['peak']):.2f}x the peak); "
            f"{got['outcome']}"
        )


# ---- json-body -------------------------------------------------------------------------------


def post_timed(client: httpx.Client, url: str, body: bytes, headers: dict[str, str]) -> str:
    started = time.perf_counter()
    try:
        response = client.post(url, content=body, headers=headers)
    except httpx.HTTPError as exc:
        return f"no answer ({type(exc).__name__}) after {time.perf_counter() - started:.2f} s"
    took = time.perf_counter() - started
    said = ""
    if response.status_code != 200:
        said = response.text[:160]
    return f"{response.status_code} in {took:.2f} s {said}"


def json_body() -> None:
    body = json_list_body()
    print(f"body: {len(body) / MB:.1f} MiB, separators {separators(body)}")
    for bound in (BOUND, None):
        env = {} if bound is None else {"SDPA_MAX_INFLIGHT_BYTES": str(bound)}
        with attacked_server(env) as server:
            named = "the default" if bound is None else f"{bound // MB} MiB"
            with Bystander(server.url) as bystander, httpx.Client(timeout=300) as client:
                baseline = reset_peak(server)
                said = post_timed(client, f"{server.url}/v1/attention", body, JSON)
                growth = memory_mb(server)["VmHWM"] - baseline
            print(f"SDPA_MAX_INFLIGHT_BYTES {named}: {said}")
            print(f"  peak RSS growth {growth:.0f} MB ({growth * MB / len(body):.1f}x the body)")
            print(f"  {bystander.summary()}")
            print(f"  {log_summary(server.log())}")


# ---- bodies-flood ----------------------------------------------------------------------------


def bodies_flood(seconds: float = 20.0, clients: int = 6, max_each: int = 40) -> None:
    body = json_list_body()
    packed = gzip.compress(body, compresslevel=6)
    print(f"bodies: JSON lists {len(body) / MB:.1f} MiB, gzip {len(packed) / MB:.2f} MiB")
    kinds = [("json", body, JSON), ("gzip", packed, {**JSON, "content-encoding": "gzip"})]
    env = {"SDPA_MAX_INFLIGHT_BYTES": str(BOUND)}
    with attacked_server(env) as server:
        statuses: dict[str, collections.Counter[int | str]] = {
            name: collections.Counter() for name, _, _ in kinds
        }
        took: dict[str, list[float]] = {name: [] for name, _, _ in kinds}

        def flood(i: int, stop: float) -> None:
            name, content, headers = kinds[i % 2]
            with httpx.Client(timeout=120) as client:
                for _ in range(max_each):
                    if time.monotonic() > stop:
                        return
                    started = time.perf_counter()
                    try:
                        status: int | str = client.post(
                            f"{server.url}/v1/attention", content=content, headers=headers
                        ).status_code
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    statuses[name][status] += 1
                    took[name].append(time.perf_counter() - started)

        with Bystander(server.url) as bystander:
            baseline = reset_peak(server)
            stop = time.monotonic() + seconds
            threads = [threading.Thread(target=flood, args=(i, stop)) for i in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            growth = memory_mb(server)["VmHWM"] - baseline
        for name in statuses:
            times = sorted(took[name]) or [0.0]
            print(f"{name}: statuses {dict(statuses[name])}, p50 {times[len(times) // 2]:.2f} s, "
                  f"max {times[-1]:.2f} s")  # fmt: skip
        verdict = "below" if growth * MB < 2 * BOUND else "ABOVE"
        print(f"peak RSS growth {growth:.0f} MB: {verdict} twice the bound ({2 * BOUND // MB} MB)")
        print(bystander.summary())
        metrics = httpx.get(f"{server.url}/metrics").text.splitlines()
        print("refused:", [m for m in metrics if m.startswith("sdpa_rejected_total")])
        print(log_summary(server.log()))


# ---- header-numbers --------------------------------------------------------------------------


def raw_request(url: str, head: list[str], body: bytes, timeout_s: float = 30.0) -> str:
    """Send one request as written (headers the HTTP clients would refuse to write) -> the
    status line and the time to it."""
    host, port = url.removeprefix("http://").split(":")
    started = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        request = "\r\n".join(["POST " + head[0] + " HTTP/1.1", "Host: bench", *head[1:]])
        sock.sendall(request.encode("latin-1") + b"\r\n\r\n" + body)
        reply = b""
        while b"\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    status = reply.split(b"\r\n", 1)[0].decode("latin-1") or "(closed)"
    return f"{status} in {(time.perf_counter() - started) * 1e3:.0f} ms"


def header_numbers() -> None:
    small = json.dumps(SMALL).encode()
    v2_header = json.dumps(
        {"inputs": [{"name": n, "shape": [1, 2], "datatype": "FP32",
                     "parameters": {"binary_data_size": 8}} for n in "qkv"]}
    ).encode()  # fmt: skip
    v2_body = v2_header + b"\0\0\x80?" * 6  # 1.0 as little-endian float32
    v2 = "/v2/models/attention/infer"
    half = len(small) // 2
    cases: list[tuple[str, list[str], bytes]] = [
        ("Content-Length of 5,000 leading zeros",
         ["/v1/attention", "Content-Type: application/json",
          f"Content-Length: {'0' * 5000}{len(small)}"], small),
        ("Content-Length of 4,301 digits",
         ["/v1/attention", "Content-Type: application/json", f"Content-Length: {'9' * 4301}"],
         small),
        ("Inference-Header-Content-Length of 5,000 leading zeros",
         [v2, f"Content-Length: {len(v2_body)}",
          f"Inference-Header-Content-Length: {'0' * 5000}{len(v2_header)}"], v2_body),
        ("Inference-Header-Content-Length of 4,301 digits",
         [v2, f"Content-Length: {len(v2_body)}",
          f"Inference-Header-Content-Length: {'9' * 4301}"], v2_body),
        ("two gzip members",
         ["/v1/attention", "Content-Type: application/json", "Content-Encoding: gzip"],
         gzip.compress(small[:half]) + gzip.compress(small[half:])),
        ("two Content-Encoding headers (deflate, then gzip)",
         ["/v1/attention", "Content-Type: application/json", "Content-Encoding: deflate",
          "Content-Encoding: gzip"], gzip.compress(zlib.compress(small))),
        ("three codings",
         ["/v1/attention", "Content-Type: application/json", "Content-Encoding: gzip, gzip, gzip"],
         gzip.compress(gzip.compress(gzip.compress(small)))),
    ]  # fmt: skip
    with attacked_server({}) as server, Bystander(server.url) as bystander:
        for name, head, body in cases:
            if not any(line.startswith("Content-Length") for line in head[1:]):
                head = [*head, f"Content-Length: {len(body)}"]
            print(f"{name}: {raw_request(server.url, head, body)}")
        print(log_summary(server.log()))
    print(bystander.summary())


ATTACKS: dict[str, Callable[[], None]] = {
    "parse-peak": parse_peak,
    "json-body": json_body,
    "bodies-flood": bodies_flood,
    "header-numbers": header_numbers,
}
