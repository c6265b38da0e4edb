"""One run, five systems, one load generator: how much does sdpa-service buy over the baselines?

    .venv/bin/python bench/compare.py            # full: ~10 min on 2 cores
    .venv/bin/python bench/compare.py --quick    # ~4 min: 3 s per cell

Systems, each started on a free loopback port (one uvicorn worker each) and measured in turn with
sdpa-loadtest's core (sdpa_client.loadgen.run_load, closed loop at each concurrency):

- in-process: sdpa_core.attention() on prepared tensors, called from `concurrency` threads: no
  HTTP, no encoding. The floor of latency: what the compute alone costs here.
- no-op: bench/noop_app.py, a FastAPI endpoint that reads the same base64 body as the service
  and answers as many bytes as the service answers, without parsing or computing anything: the
  HTTP floor (one uvicorn worker + this generator, same bytes both ways).
- naive: bench/naive_app.py, the tutorial approach: nested JSON lists, pydantic models, the
  formula softmax(QK^T/sqrt(d))V in torch inside `async def` (compute in the event loop), no
  batching.
- service, batching off: `sdpa-service serve` with SDPA_MAX_BATCH_SIZE=1.
- service, batching on: `sdpa-service serve` with its defaults (SDPA_MAX_BATCH_SIZE=32, no delay).

Payloads are sdpa-loadtest's presets (small, medium, large); each body is encoded once. The no-op
endpoint and the service get base64 tensors; the naive app gets JSON lists (its only format) —
that difference is the point of the comparison, and the table says so.

Writes bench/results/compare.json (every cell: throughput, latency percentiles, errors, the
generator's and the server's CPU), compare.md (the ratio table and the targets) and two plots
(compare_throughput.png, compare_latency_cdf.png). Bounded: every cell stops issuing requests
after --duration seconds, and every request is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `service` and `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import free_port  # noqa: E402
from sdpa_client import Encoding, encode_tensor  # noqa: E402
from sdpa_client.loadgen import (  # noqa: E402
    PRESETS,
    HttpSender,
    LoadPlan,
    LoadReport,
    Payload,
    Preset,
    Sender,
    run_load,
)

RESULTS = REPO_ROOT / "bench" / "results"

# (key, label) in table order.
SYSTEMS: tuple[tuple[str, str], ...] = (
    ("inprocess", "in-process sdpa_core"),
    ("noop", "no-op HTTP"),
    ("naive", "naive FastAPI"),
    ("service_b1", "service, batching off"),
    ("service", "service, batching on"),
)
LABELS = dict(SYSTEMS)

# Targets of issue 6, at the highest concurrency measured (16 by default).
SPEEDUP_TARGETS = {"large": 20.0, "medium": 5.0, "small": 3.0}
NOOP_SHARE_TARGET = 0.70


# ---- servers ----------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server process so far (None without psutil)."""
        try:
            import psutil
        except ImportError:
            return None
        try:
            times = psutil.Process(self.process.pid).cpu_times()
        except psutil.Error:
            return None
        return float(times.user + times.system)


def _command(
    system: str, port: int, *, torch_threads: int | None
) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDPA_")}
    env["PYTHONUNBUFFERED"] = "1"
    if torch_threads is not None and system != "noop":
        # torch sizes its intra-op pool from these at start-up (same for naive and service).
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if system in ("noop", "naive"):
        app = "bench.noop_app:app" if system == "noop" else "bench.naive_app:app"
        # Same uvicorn as the service (uvloop + httptools when installed), no access log.
        cmd = [sys.executable, "-m", "uvicorn", app, *host, "--log-level", "warning",
               "--no-access-log"]  # fmt: skip
        return cmd, env
    if system == "service_b1":
        env["SDPA_MAX_BATCH_SIZE"] = "1"
    return [sys.executable, "-m", "service.cli", "serve", *host], env


@contextlib.contextmanager
def running(
    system: str, *, log_dir: Path, device: str | None, torch_threads: int | None
) -> Iterator[Server]:
    port = free_port()
    cmd, env = _command(system, port, torch_threads=torch_threads)
    if device is not None and system.startswith("service"):
        env["SDPA_DEVICE"] = device
    log_path = log_dir / f"{system}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    server = Server(system, f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_ready(server, timeout_s=180.0)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def _wait_ready(server: Server, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{tail}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/readyz", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{server.name} not ready within {timeout_s} s")


def service_reply_bytes(preset: Preset) -> int:
    """About the size of the service's base64 answer to `preset`: output (+ weights) as
    base64 plus ~150 bytes of meta and ~250 bytes per head of summary diagnostics (measured on
    the presets: within 1% of the real answer). The no-op endpoint sends back this many bytes."""
    b, h, n, d = preset.shape
    tensors = {"output": encode_tensor(np.zeros((b, h, n, d), np.float32))}
    if preset.return_weights:
        tensors["weights"] = encode_tensor(np.zeros((b, h, n, n), np.float32))
    extra = 150 + (250 * h if preset.diagnostics != "none" else 0)
    return len(json.dumps(tensors)) + extra


# ---- the in-process floor ----------------------------------------------------------------------


def inprocess_call(preset: Preset, *, device: str) -> Callable[[], None]:
    import torch

    from sdpa_core import attention

    q, k, v = (torch.from_numpy(a).to(device) for a in preset.arrays())  # [B, H, N, D]

    def call() -> None:
        result = attention(
            q, k, v, return_weights=preset.return_weights, diagnostics=preset.diagnostics
        )
        result.output.cpu()  # the service hands back host memory too
        if result.weights is not None:
            result.weights.cpu()

    return call


def executor_sender(
    call: Callable[[], None], pool: concurrent.futures.ThreadPoolExecutor
) -> Sender:
    async def send() -> int:
        await asyncio.get_running_loop().run_in_executor(pool, call)
        return 200

    return send


# ---- one cell ---------------------------------------------------------------------------------


@dataclass
class Cell:
    system: str
    preset: str
    concurrency: int
    body_bytes: int
    report: LoadReport
    server_cpu_percent: float | None
    warmup_concurrency: int

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "label": LABELS[self.system],
            "preset": self.preset,
            "concurrency": self.concurrency,
            "body_bytes": self.body_bytes,
            "server_cpu_percent": self.server_cpu_percent,
            "warmup_concurrency": self.warmup_concurrency,
            **self.report.summary(),
        }


@dataclass
class Options:
    presets: list[str]
    concurrency: list[int]
    duration_s: float
    warmup_s: float
    timeout_s: float
    systems: list[str]
    device: str | None
    torch_threads: int | None
    out: Path
    argv: list[str] = field(default_factory=list)


async def measure(
    send: Sender, concurrency: int, opts: Options, cpu: Callable[[], float | None]
) -> tuple[LoadReport, float | None, int]:
    # Warm-up: one request to learn the service time, then `concurrency` workers for warmup_s
    # unless that would queue longer than warmup_s (the naive app on large payloads): then one.
    probe = await run_load(send, LoadPlan(concurrency=1, requests=1, timeout_s=opts.timeout_s))
    one = probe.latency.max_ms / 1000 if probe.ok else opts.timeout_s
    warm_c = concurrency if one * concurrency <= opts.warmup_s else 1
    await run_load(
        send, LoadPlan(concurrency=warm_c, duration_s=opts.warmup_s, timeout_s=opts.timeout_s)
    )
    cpu0, t0 = cpu(), time.perf_counter()
    report = await run_load(
        send,
        LoadPlan(concurrency=concurrency, duration_s=opts.duration_s, timeout_s=opts.timeout_s),
    )
    cpu1, wall = cpu(), time.perf_counter() - t0
    server_cpu = None if cpu0 is None or cpu1 is None else 100.0 * (cpu1 - cpu0) / wall
    return report, server_cpu, warm_c


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_system(system: str, opts: Options, log_dir: Path) -> tuple[list[Cell], dict[str, Any]]:
    cells: list[Cell] = []
    info: dict[str, Any] = {}
    if system == "inprocess":
        import torch

        device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        device = "cpu" if device == "auto" else device
        if opts.torch_threads is not None:
            torch.set_num_threads(opts.torch_threads)
        info = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads()}
        for name in opts.presets:
            call = inprocess_call(PRESETS[name], device=device)
            for c in opts.concurrency:
                with concurrent.futures.ThreadPoolExecutor(max_workers=c) as pool:
                    report, _, warm_c = asyncio.run(
                        measure(executor_sender(call, pool), c, opts, lambda: None)
                    )
                cells.append(Cell(system, name, c, 0, report, None, warm_c))
                _log_cell(cells[-1])
        return cells, info

    encoding: Encoding = "json" if system == "naive" else "base64"
    payloads = {n: Payload.from_preset(PRESETS[n], encoding=encoding) for n in opts.presets}
    if system == "noop":  # same bytes both ways: answer as much as the service answers
        payloads = {
            n: dataclasses.replace(p, path=f"{p.path}?reply={service_reply_bytes(PRESETS[n])}")
            for n, p in payloads.items()
        }
    with running(
        system, log_dir=log_dir, device=opts.device, torch_threads=opts.torch_threads
    ) as server:
        if system.startswith("service"):
            info = httpx.get(f"{server.url}/v1/info", timeout=10).json()
        for name in opts.presets:
            payload = payloads[name]
            for c in opts.concurrency:

                async def cell(payload: Payload = payload, c: int = c) -> Any:
                    async with HttpSender(server.url, payload, timeout_s=opts.timeout_s) as send:
                        return await measure(send, c, opts, server.cpu_seconds)

                report, server_cpu, warm_c = _runner_run(cell())
                cells.append(Cell(system, name, c, len(payload.body), report, server_cpu, warm_c))
                _log_cell(cells[-1])
    return cells, info


def _runner_run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _log_cell(cell: Cell) -> None:
    r = cell.report
    errs = f" errors={dict(r.errors)}" if r.errors else ""
    srv = (
        f" server_cpu={cell.server_cpu_percent:.0f}%" if cell.server_cpu_percent is not None else ""
    )
    _log(
        f"  {cell.system:<11} {cell.preset:<6} c={cell.concurrency:<3} "
        f"{r.throughput_rps:9.1f}/s  p50={r.latency.p50_ms:8.2f} ms  p99={r.latency.p99_ms:8.2f} ms"
        f"  client_cpu={r.client_cpu_percent:.0f}%{srv}{errs}"
    )


# ---- outputs ----------------------------------------------------------------------------------


def _get(cells: Sequence[Cell], system: str, preset: str, c: int) -> Cell | None:
    for cell in cells:
        if (cell.system, cell.preset, cell.concurrency) == (system, preset, c):
            return cell
    return None


def _rps(cell: Cell | None) -> str:
    if cell is None:
        return "—"
    r = cell.report
    text = f"{r.throughput_rps:,.1f}" if r.throughput_rps < 100 else f"{r.throughput_rps:,.0f}"
    return text + (" ⚠" if r.errors else "")


def _ratio(a: Cell | None, b: Cell | None, *, percent: bool = False) -> str:
    if a is None or b is None or b.report.throughput_rps <= 0:
        return "—"
    x = a.report.throughput_rps / b.report.throughput_rps
    return f"{100 * x:.0f}%" if percent else f"{x:.1f}×"


def _lat(cell: Cell | None) -> str:
    if cell is None or not cell.report.latency.count:
        return "—"
    lat = cell.report.latency
    return f"{lat.p50_ms:.1f} / {lat.p99_ms:.1f}"


def _mib(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MiB"


def markdown(cells: Sequence[Cell], opts: Options, meta: dict[str, Any]) -> str:
    top = max(opts.concurrency)
    lines = [
        "## sdpa-service against the baselines",
        "",
        f"`{meta['command']}` — {meta['date']}, {meta['machine']}; service on "
        f"{meta.get('service_device', '?')}, torch intra-op threads: "
        f"{meta['torch_threads'] or 'torch default'}. Closed loop, {opts.duration_s:g} s per cell "
        f"after a {opts.warmup_s:g} s warm-up; throughput = successful answers per second.",
        "",
        "| payload | conc. | in-process sdpa_core | no-op HTTP | naive FastAPI "
        "| service, batching off | service, batching on | on ÷ naive | on ÷ no-op | on ÷ off |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in opts.presets:
        for c in opts.concurrency:
            row = {s: _get(cells, s, name, c) for s, _ in SYSTEMS}
            lines.append(
                f"| {name} | {c} | {_rps(row['inprocess'])} | {_rps(row['noop'])} "
                f"| {_rps(row['naive'])} | {_rps(row['service_b1'])} | {_rps(row['service'])} "
                f"| {_ratio(row['service'], row['naive'])} "
                f"| {_ratio(row['service'], row['noop'], percent=True)} "
                f"| {_ratio(row['service'], row['service_b1'])} |"
            )
    lines += [
        "",
        f"Latency p50 / p99 (ms) at concurrency {top}:",
        "",
        "| payload | " + " | ".join(label for _, label in SYSTEMS) + " |",
        "|---|" + "---:|" * len(SYSTEMS),
    ]
    for name in opts.presets:
        lat = " | ".join(_lat(_get(cells, s, name, top)) for s, _ in SYSTEMS)
        lines.append(f"| {name} | {lat} |")

    lines += [
        "",
        f"Targets (concurrency {top}):",
        "",
        "| target | measured | met |",
        "|---|---:|:-:|",
    ]
    for name, target in SPEEDUP_TARGETS.items():
        if name in opts.presets:
            ours, naive = _get(cells, "service", name, top), _get(cells, "naive", name, top)
            lines.append(_target_row(f"{name}: service ≥ {target:g}× naive", ours, naive, target))
    if "small" in opts.presets:
        ours, noop = _get(cells, "service", "small", top), _get(cells, "noop", "small", top)
        lines.append(
            _target_row(
                f"small: service ≥ {100 * NOOP_SHARE_TARGET:.0f}% of no-op",
                ours,
                noop,
                NOOP_SHARE_TARGET,
                percent=True,
            )
        )

    lines += ["", "Generator ceiling (no-op endpoint, same bytes as the service):", ""]
    for name in opts.presets:
        noop = _get(cells, "noop", name, top)
        if noop is not None:
            r = noop.report
            lines.append(
                f"- {name} ({_mib(noop.body_bytes)} body), concurrency {top}: "
                f"{r.throughput_rps:,.0f} req/s with the generator at "
                f"{r.client_cpu_percent:.0f}% of one core"
                + (
                    f" and the server at {noop.server_cpu_percent:.0f}%"
                    if noop.server_cpu_percent is not None
                    else ""
                )
                + "."
            )
    sizes = []
    for name in opts.presets:
        b64 = _get(cells, "service", name, top) or _get(cells, "noop", name, top)
        js = _get(cells, "naive", name, top)
        if b64 is not None and js is not None:
            sizes.append(f"{name} {_mib(b64.body_bytes)} vs {_mib(js.body_bytes)}")
    lines += [
        "",
        "Notes:",
        "",
        "- Encodings differ on purpose: the service and the no-op endpoint receive base64 tensors, "
        "the naive app nested JSON lists (the tutorial approach), so the ratio includes the cost "
        "of the JSON encoding. Request bodies, base64 vs JSON: " + ("; ".join(sizes) or "—") + ".",
        "- The naive app computes no diagnostics; the service computes what each preset asks "
        "(small and large: output only; medium: weights + summary diagnostics), so on medium it "
        "does more work.",
        "- The no-op endpoint reads the body and answers as many bytes as the service answers "
        "(padding), but parses, decodes, computes and encodes nothing.",
        "- In-process = sdpa_core.attention() from `concurrency` threads on prepared tensors: no "
        "HTTP, no encoding. Its 'client CPU' is the compute itself.",
        "- All systems, the generator and anything else running share this machine's cores "
        f"({meta['cpus']} here): the no-op row is the ceiling of generator + one uvicorn worker, "
        "and a ⚠ marks a cell with errors (see compare.json). 1-minute load average at the "
        f"start and end of the run: {meta['load_average_before'][0]:.1f} and "
        f"{meta['load_average_after'][0]:.1f}. On a shared machine single cells move by up to "
        "2-3× between runs: read the ratios, and re-run on a quiet machine before quoting "
        "absolute numbers.",
    ]
    return "\n".join(lines) + "\n"


def _target_row(
    label: str, a: Cell | None, b: Cell | None, target: float, *, percent: bool = False
) -> str:
    if a is None or b is None or b.report.throughput_rps <= 0:
        return f"| {label} | — | — |"
    x = a.report.throughput_rps / b.report.throughput_rps
    shown = f"{100 * x:.0f}%" if percent else f"{x:.1f}×"
    return f"| {label} | {shown} | {'yes' if x >= target else 'no'} |"


def plots(cells: Sequence[Cell], opts: Options) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        _log("matplotlib missing: no plots (pip install 'sdpa-service[plot]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip([s for s, _ in SYSTEMS], ["#777777", "#bbbbbb", "#cc3311", "#0077bb",
                                                  "#009988"], strict=True))  # fmt: skip
    n = len(opts.presets)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4.2), squeeze=False)
    for ax, name in zip(axes[0], opts.presets, strict=True):
        for system, label in SYSTEMS:
            pts = [(c, cell.report.throughput_rps) for c in opts.concurrency
                   if (cell := _get(cells, system, name, c)) is not None]  # fmt: skip
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=label, color=colors[system])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(opts.concurrency, [str(c) for c in opts.concurrency])
        ax.set_title(f"{name}: {PRESETS[name].describe()}", fontsize=9)
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_ylabel("successful requests / s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    throughput_png = opts.out / "compare_throughput.png"
    fig.savefig(throughput_png, dpi=110)
    plt.close(fig)

    top = max(opts.concurrency)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4.2), squeeze=False)
    for ax, name in zip(axes[0], opts.presets, strict=True):
        for system, label in SYSTEMS:
            cell = _get(cells, system, name, top)
            if cell is None:
                continue
            ms = np.sort([r.latency_s * 1000 for r in cell.report.records if r.error is None])
            if len(ms):
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=label, color=colors[system])
        ax.set_xscale("log")
        ax.set_title(f"{name}, concurrency {top}", fontsize=9)
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    cdf_png = opts.out / "compare_latency_cdf.png"
    fig.savefig(cdf_png, dpi=110)
    plt.close(fig)
    return [throughput_png, cdf_png]


# ---- main -------------------------------------------------------------------------------------


def _csv_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        return [kind(part) for part in text.split(",") if part.strip()]

    return parse


def parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 s cells, 0.5 s warm-up")
    p.add_argument("--presets", type=_csv_list(str), default=["small", "medium", "large"])
    p.add_argument("--concurrency", type=_csv_list(int), default=[1, 4, 16])
    p.add_argument("--duration", type=float, help="seconds per cell (default 8; --quick 3)")
    p.add_argument("--warmup", type=float, help="warm-up seconds per cell (default 1.5; quick 0.5)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--systems", type=_csv_list(str), default=[s for s, _ in SYSTEMS],
                   help="subset of: " + ", ".join(s for s, _ in SYSTEMS))  # fmt: skip
    p.add_argument("--device", help="SDPA_DEVICE for the service and the in-process floor")
    p.add_argument(
        "--torch-threads", type=int,
        help="intra-op threads for every torch system (OMP_NUM_THREADS; default: torch's own)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    unknown = set(args.systems) - set(LABELS) or set(args.presets) - set(PRESETS)
    if unknown:
        p.error(f"unknown: {', '.join(sorted(unknown))}")
    return Options(
        presets=args.presets,
        concurrency=sorted(set(args.concurrency)),
        duration_s=args.duration or (3.0 if args.quick else 8.0),
        warmup_s=args.warmup if args.warmup is not None else (0.5 if args.quick else 1.5),
        timeout_s=args.timeout,
        systems=[s for s, _ in SYSTEMS if s in args.systems],
        device=args.device,
        torch_threads=args.torch_threads,
        out=args.out,
        argv=list(sys.argv[1:] if argv is None else argv),
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python bench/compare.py", *map(shlex.quote, opts.argv)])
    started = time.perf_counter()
    load_before = os.getloadavg()
    cells: list[Cell] = []
    infos: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sdpa-compare-") as tmp:
        for system in opts.systems:
            _log(f"{LABELS[system]}:")
            got, info = run_system(system, opts, Path(tmp))
            cells += got
            infos[system] = info
    meta = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "service_device": (infos.get("service") or infos.get("service_b1") or {}).get("device"),
        "torch_threads": opts.torch_threads,
        "systems": infos,
        "duration_s": opts.duration_s,
        "warmup_s": opts.warmup_s,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    document = {"meta": meta, "cells": [c.to_json() for c in cells]}
    (opts.out / "compare.json").write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(cells, opts, meta)
    (opts.out / "compare.md").write_text(table)
    written = plots(cells, opts)
    print(table)
    _log(f"wrote {opts.out / 'compare.json'}, {opts.out / 'compare.md'}"
         + "".join(f", {p}" for p in written) + f" in {meta['wall_s']} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
