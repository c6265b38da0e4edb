"""Ray Serve (service.ray) on this machine: what three replicas buy over one, what Ray's proxy
costs per request, and how long a replica's death takes to heal (issue 28's Ray targets).

    .venv/bin/python bench/ray.py            # ~9 min on 2 cores
    .venv/bin/python bench/ray.py --quick    # ~5 min, shorter cells, one round

One Ray node of this machine (ray.init, one HTTP proxy on a free loopback port, logical CPUs
enough for every replica: the OS shares the two cores), three applications side by side, each
with the service's default settings on the CPU:
- "one": build({"num_replicas": 1}), the retrying ingress in front (/one);
- "three": build({"num_replicas": 3}) (/three);
- "direct": build({"num_replicas": 1, "ingress": "direct"}), the app as Ray's ingress (/direct);
and `sdpa-service serve` on a free port (uvicorn, no Ray) for reference.

(a) Throughput: a closed loop of CONCURRENCY keep-alive httpx clients (threads of this process)
    for a cell's seconds after a warm-up, cells alternated (uvicorn, direct, one, three) per
    round;
    requests per second, and process CPU time per request of the replicas, of the ingress, of
    the proxy and of this client (psutil, user + system), and the machine's whole CPU.
(b) Overhead per request at concurrency 1: GET /healthz (no compute) and the small attention
    payload, uvicorn vs Ray direct vs Ray retrying, in alternated blocks; p50 and the Ray
    minus uvicorn difference.
(c) Recovery: under a closed loop of 4 clients on "three" that never retry, one replica killed
    (ray.kill, SIGKILL of its process); from the kill, when Ray's controller stops counting it
    as running, when its replacement starts, and when three replicas run again (the new one
    warmed up: full capacity); and what the clients saw (failures, requests per second).

Payloads (q, k, v float32, base64, as bench/service.py): small [1, 4, 64, 64] fused, no
diagnostics; medium [1, 8, 256, 64] with weights and summary diagnostics (the dense path).

Never run as a test. Writes bench/results/ray.json and bench/results/ray.md.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path, and `import ray` would import
# this very file: the repository's root instead (it makes `service` and `bench` importable).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Before ray is imported: Ray reads them then (its processes inherit them).
TEMP_DIR = tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp")
os.environ.update(
    {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback addresses
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_SERVE_LOG_TO_STDERR": "0",
        "RAY_TMPDIR": TEMP_DIR,
        # A node on loopback for minutes: no token (Ray 2.60 would otherwise write one to
        # ~/.ray/auth_token and turn token authentication on).
        "RAY_AUTH_MODE": "disabled",
    }
)

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from bench.support import free_port, live_server  # noqa: E402
from service.ray import build  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
CONCURRENCY = 8
APPS = {
    "one": {"num_replicas": 1},
    "three": {"num_replicas": 3},
    "direct": {"num_replicas": 1, "ingress": "direct"},
}
SYSTEMS = ("uvicorn", "direct", "one", "three")


def tensor(x: np.ndarray) -> dict[str, Any]:
    return {
        "dtype": "float32",
        "shape": list(x.shape),
        "b64": base64.b64encode(x.tobytes()).decode(),
    }


def attention_body(shape: tuple[int, ...], **options: Any) -> bytes:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    return json.dumps({"q": tensor(q), "k": tensor(k), "v": tensor(v), **options}).encode()


PAYLOADS = {
    "small": attention_body((1, 4, 64, 64), diagnostics="none"),
    "medium": attention_body((1, 8, 256, 64), return_weights=True, diagnostics="summary"),
}
HEADERS = {"content-type": "application/json"}


# ---- the systems ---------------------------------------------------------------------------


@dataclass
class Ray:
    """The local Ray node, its proxy and the three applications."""

    url: str

    def prefix(self, app: str) -> str:
        return f"{self.url}/{app}"

    def details(self) -> dict[str, Any]:
        return dict(serve.context._get_global_client().get_serve_details())

    def replicas(self, app: str, deployment: str = "sdpa") -> list[dict[str, Any]]:
        """The deployment's replicas (none when the application has no such deployment: the
        direct one has no ingress)."""
        deployments = self.details()["applications"][app]["deployments"]
        return list(deployments.get(deployment, {}).get("replicas", []))

    def pids(self, app: str, deployment: str = "sdpa") -> list[int]:
        return [r["pid"] for r in self.replicas(app, deployment) if r["state"] == "RUNNING"]

    def wait_running(self, app: str, count: int, timeout_s: float = 300.0) -> None:
        give_up = time.monotonic() + timeout_s
        while len(self.pids(app)) != count or serve.status().applications[app].status != "RUNNING":
            if time.monotonic() > give_up:
                raise TimeoutError(f"{app}: not {count} replicas running in {timeout_s} s")
            time.sleep(0.2)


def ray_processes(title: str) -> list[int]:
    """Our Ray processes whose title starts with `title` (ray::ProxyActor, ...)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            cmdline = process.cmdline()
        except psutil.Error:
            continue
        if cmdline and cmdline[0].startswith(title):
            found.append(process.pid)
    return found


@contextmanager
def local_ray() -> Iterator[Ray]:
    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        for name, args in APPS.items():
            serve.run(build({**args, "device": "cpu"}), name=name, route_prefix=f"/{name}")
        system = Ray(url=f"http://127.0.0.1:{port}")
        for name, args in APPS.items():
            system.wait_running(name, int(args["num_replicas"]))
        yield system
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def machine_cpu_seconds() -> float:
    times = psutil.cpu_times()
    return float(times.user + times.system + times.nice + times.irq + times.softirq)


# ---- a closed loop -------------------------------------------------------------------------


@dataclass
class Loop:
    """`clients` threads posting `body` to `url` back to back until stopped (or `max_s`)."""

    url: str
    body: bytes
    clients: int
    max_s: float
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    answered: list[float] = field(default_factory=list)  # monotonic instants of 200s
    statuses: Counter[str] = field(default_factory=Counter)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Loop:
        give_up = time.monotonic() + self.max_s

        def run() -> None:
            with httpx.Client(timeout=60) as client:
                while not self.stop.is_set() and time.monotonic() < give_up:
                    try:
                        status = str(
                            client.post(self.url, content=self.body, headers=HEADERS).status_code
                        )
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    with self.lock:
                        self.statuses[status] += 1
                        if status == "200":
                            self.answered.append(time.monotonic())

        self.threads = [threading.Thread(target=run, daemon=True) for _ in range(self.clients)]
        for thread in self.threads:
            thread.start()
        return self

    def count(self) -> int:
        with self.lock:
            return len(self.answered)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=90)


def attention_url(system: str, ray_system: Ray, uvicorn_url: str) -> str:
    base = uvicorn_url if system == "uvicorn" else ray_system.prefix(system)
    return f"{base}/v1/attention"


def measure_throughput(
    system: str, payload: str, ray_system: Ray, uvicorn_url: str, uvicorn_pid: int, cell_s: float
) -> dict[str, Any]:
    url = attention_url(system, ray_system, uvicorn_url)
    if system == "uvicorn":
        groups = {"replicas": [uvicorn_pid], "ingress": [], "proxy": []}
    else:
        groups = {
            "replicas": ray_system.pids(system),
            "ingress": ray_system.pids(system, "ingress"),
            "proxy": ray_processes("ray::ProxyActor"),
        }
    groups["client"] = [os.getpid()]
    loop = Loop(url, PAYLOADS[payload], CONCURRENCY, max_s=cell_s + 30).start()
    time.sleep(2.0)  # warm-up: connections, the batcher's pace
    before = {name: cpu_seconds(pids) for name, pids in groups.items()}
    machine_before = machine_cpu_seconds()
    count_before, started = loop.count(), time.monotonic()
    time.sleep(cell_s)
    count, elapsed = loop.count() - count_before, time.monotonic() - started
    after = {name: cpu_seconds(pids) for name, pids in groups.items()}
    machine = machine_cpu_seconds() - machine_before
    loop.finish()
    cpu_ms = {
        name: (after[name] - before[name]) * 1e3 / max(count, 1) for name in groups if groups[name]
    }
    failed = sum(n for status, n in loop.statuses.items() if status != "200")
    return {
        "system": system,
        "payload": payload,
        "requests": count,
        "rps": count / elapsed,
        "cpu_ms_per_request": cpu_ms,
        "machine_cpu_busy": machine / elapsed / (psutil.cpu_count() or 1),
        "failed": failed,
    }


# ---- (b) overhead at concurrency 1 ----------------------------------------------------------


def measure_overhead(
    ray_system: Ray, uvicorn_url: str, requests: int, block: int = 20
) -> dict[str, Any]:
    targets = {
        "uvicorn": uvicorn_url,
        "ray direct": ray_system.prefix("direct"),
        "ray retrying": ray_system.prefix("one"),
    }
    kinds: dict[str, Callable[[httpx.Client, str], int]] = {
        "healthz": lambda client, base: client.get(f"{base}/healthz").status_code,
        "small": lambda client, base: (
            client.post(
                f"{base}/v1/attention", content=PAYLOADS["small"], headers=HEADERS
            ).status_code
        ),
    }
    times: dict[str, dict[str, list[float]]] = {k: {t: [] for t in targets} for k in kinds}
    with httpx.Client(timeout=60) as client:
        for kind, call in kinds.items():
            for base in targets.values():  # warm connections
                call(client, base)
            give_up = time.monotonic() + 120.0
            while len(times[kind]["uvicorn"]) < requests and time.monotonic() < give_up:
                for name, base in targets.items():
                    for _ in range(block):
                        started = time.perf_counter()
                        status = call(client, base)
                        elapsed_ms = (time.perf_counter() - started) * 1e3
                        if status == 200:
                            times[kind][name].append(elapsed_ms)
    out: dict[str, Any] = {}
    for kind, by_target in times.items():
        p50 = {name: statistics.median(values) for name, values in by_target.items()}
        out[kind] = {
            "p50_ms": p50,
            "mean_ms": {name: statistics.fmean(v) for name, v in by_target.items()},
            "requests": {name: len(v) for name, v in by_target.items()},
            "overhead_p50_ms": {
                name: p50[name] - p50["uvicorn"] for name in by_target if name != "uvicorn"
            },
        }
    return out


# ---- (c) recovery ---------------------------------------------------------------------------


def measure_recovery(ray_system: Ray, rounds: int) -> list[dict[str, Any]]:
    url = f"{ray_system.prefix('three')}/v1/attention"
    results = []
    for _ in range(rounds):
        ray_system.wait_running("three", 3)
        before = {r["actor_name"] for r in ray_system.replicas("three")}
        loop = Loop(url, PAYLOADS["small"], 4, max_s=240.0).start()
        time.sleep(4.0)
        victim = ray_system.replicas("three")[0]
        before_rps = _rate(loop, time.monotonic() - 3.0, time.monotonic())
        killed, killed_wall = time.monotonic(), time.time()
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        noticed = started = restored = None
        give_up = killed + 180.0
        while time.monotonic() < give_up:
            replicas = ray_system.replicas("three")
            names = {r["actor_name"] for r in replicas if r["state"] == "RUNNING"}
            now = time.monotonic() - killed
            if noticed is None and victim["actor_name"] not in names:
                noticed = now
            new = [r for r in replicas if r["actor_name"] != victim["actor_name"]]
            if started is None and len(new) >= 3:
                started = now
            if noticed is not None and len(names) == 3:
                restored = now
                break
            time.sleep(0.1)
        time.sleep(3.0)
        after_rps = _rate(loop, time.monotonic() - 3.0, time.monotonic())
        loop.finish()
        failed = sum(n for status, n in loop.statuses.items() if status != "200")
        replacement = [r for r in ray_system.replicas("three") if r["actor_name"] not in before]
        phases = _start_phases(replacement[0], killed_wall) if replacement else {}
        results.append(
            {
                "noticed_s": noticed,
                "replacement_started_s": started,
                # From the replacement's own log: its app's lifespan began; warm-up done.
                "lifespan_started_s": phases.get("Waiting for application startup."),
                "warmed_up_s": phases.get("warmed up on cpu"),
                "restored_s": restored,
                "rps_before": before_rps,
                "rps_after_restored": after_rps,
                "client_failures": failed,
                "statuses": dict(loop.statuses),
            }
        )
        print(f"  recovery: {results[-1]}", flush=True)
    return results


def _start_phases(replica: dict[str, Any], since: float) -> dict[str, float]:
    """Seconds from `since` (wall clock) to the replica's log lines of interest. Its JSON lines
    go to its stderr, which Ray Serve writes into the replica's log (log_file_path, under the
    session's logs; with RAY_SERVE_LOG_TO_STDERR=0) or its worker's .err file."""
    found: dict[str, float] = {}
    logs = Path(TEMP_DIR) / "ray" / "session_latest" / "logs"
    paths = [logs / str(replica.get("log_file_path") or "").lstrip("/")]
    paths.extend(logs.glob(f"worker-*-{replica['pid']}.err"))
    for path in paths:
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start < 0:
                continue
            try:
                record = json.loads(line[start:])
            except ValueError:
                continue
            message = record.get("msg")
            if message in ("Waiting for application startup.", "warmed up on cpu"):
                when = datetime.fromisoformat(record["ts"]).timestamp()
                found.setdefault(message, when - since)
    return found


def _rate(loop: Loop, start: float, end: float) -> float:
    with loop.lock:
        return sum(start <= t < end for t in loop.answered) / (end - start)


# ---- the run ---------------------------------------------------------------------------------


def run(quick: bool) -> dict[str, Any]:
    cell_s = 6.0 if quick else 10.0
    rounds = 1 if quick else 2
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server({"SDPA_DEVICE": "cpu"}, tmp_path=Path(tmp)) as uvicorn,
        local_ray() as ray_system,
    ):
        print(f"up in {time.monotonic() - started:.0f} s", flush=True)
        throughput = []
        for payload in PAYLOADS:
            for _ in range(rounds):
                for system in SYSTEMS:
                    cell = measure_throughput(
                        system, payload, ray_system, uvicorn.url, uvicorn.process.pid, cell_s
                    )
                    print(f"  {cell}", flush=True)
                    throughput.append(cell)
        overhead = measure_overhead(ray_system, uvicorn.url, requests=100 if quick else 300)
        print(f"  overhead: {overhead}", flush=True)
        recovery = measure_recovery(ray_system, rounds=1 if quick else 2)
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "bench/ray.py" + (" --quick" if quick else ""),
        "machine": {
            "cpus": psutil.cpu_count(),
            "python": platform.python_version(),
            "ray": ray.__version__,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
        },
        "concurrency": CONCURRENCY,
        "cell_s": cell_s,
        "throughput": throughput,
        "overhead": overhead,
        "recovery": recovery,
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over the rounds, per payload and system; three ÷ one."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cell in result["throughput"]:
        by.setdefault((cell["payload"], cell["system"]), []).append(cell)
    table: dict[str, dict[str, Any]] = {}
    for (payload, system), cells in by.items():
        groups = {k for cell in cells for k in cell["cpu_ms_per_request"]}
        table.setdefault(payload, {})[system] = {
            "rps": statistics.median(c["rps"] for c in cells),
            "cpu_ms": {
                g: statistics.median(c["cpu_ms_per_request"][g] for c in cells) for g in groups
            },
            "machine_cpu_busy": statistics.median(c["machine_cpu_busy"] for c in cells),
            "failed": sum(c["failed"] for c in cells),
        }
    for systems in table.values():
        systems["three_over_one"] = systems["three"]["rps"] / systems["one"]["rps"]
        systems["one_over_uvicorn"] = systems["one"]["rps"] / systems["uvicorn"]["rps"]
        systems["direct_over_uvicorn"] = systems["direct"]["rps"] / systems["uvicorn"]["rps"]
    restored = [r["restored_s"] for r in result["recovery"] if r["restored_s"] is not None]
    return {
        "throughput": table,
        "recovery_restored_median_s": statistics.median(restored) if restored else None,
    }


def write(result: dict[str, Any]) -> None:
    summary = summarize(result)
    result["summary"] = summary
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ray.json").write_text(json.dumps(result, indent=2) + "\n")
    machine = result["machine"]
    lines = [
        "# Ray Serve (service.ray) on this machine",
        "",
        f"`.venv/bin/python {result['command']}` — {result['when']}, {machine['cpus']} CPUs, "
        f"ray {machine['ray']}; load average before/after: {machine['load_before']:.2f} / "
        f"{machine['load_after']:.2f} (shared machine: expect noise).",
        "",
        f"## Throughput (closed loop, concurrency {result['concurrency']}, "
        f"{result['cell_s']:.0f} s cells, median of the rounds)",
        "",
        "CPU ms per request: process CPU (user + system) over the cell's requests; "
        "machine: the share of all cores busy (every process, other users' too).",
        "",
        "| payload | system | req/s | replicas | ingress | proxy | client | machine busy |"
        " failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for payload, systems in summary["throughput"].items():
        for system in SYSTEMS:
            row = systems[system]
            cpu = row["cpu_ms"]
            cells = [f"{cpu[g]:.2f}" if g in cpu else "–" for g in ("replicas", "ingress", "proxy")]
            lines.append(
                f"| {payload} | {system} | {row['rps']:.1f} | {' | '.join(cells)} | "
                f"{cpu['client']:.2f} | {row['machine_cpu_busy']:.0%} | {row['failed']} |"
            )
    lines.append("")
    for payload, systems in summary["throughput"].items():
        lines.append(
            f"- {payload}: three replicas ÷ one (retrying ingress) = "
            f"**{systems['three_over_one']:.2f}**; one replica ÷ uvicorn: retrying ingress "
            f"{systems['one_over_uvicorn']:.2f}, direct {systems['direct_over_uvicorn']:.2f}"
        )
    lines += [
        "",
        "## Overhead per request at concurrency 1 (p50, ms)",
        "",
        "| request | uvicorn | Ray direct | Ray retrying | direct − uvicorn | retrying − uvicorn |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, row in result["overhead"].items():
        p50, over = row["p50_ms"], row["overhead_p50_ms"]
        lines.append(
            f"| {kind} | {p50['uvicorn']:.2f} | {p50['ray direct']:.2f} | "
            f"{p50['ray retrying']:.2f} | {over['ray direct']:+.2f} | {over['ray retrying']:+.2f} |"
        )
    lines += [
        "",
        "## A replica's death to full capacity (three replicas, 4 clients that never retry)",
        "",
        "Seconds from ray.kill: Ray's controller stops counting it running; its replacement "
        "appears; the replacement's process has started the app's lifespan (Ray's worker and "
        "the imports, torch's among them, done); its warm-up is done (the statistics kernel "
        "compiled from inductor's cache, the cost model measured); three replicas run again.",
        "",
        "| round | noticed | replacement started | lifespan started | warmed up | restored |"
        " req/s before | req/s after | client failures |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for number, row in enumerate(result["recovery"], start=1):

        def s(value: float | None) -> str:
            return "–" if value is None else f"{value:.1f}"

        lines.append(
            f"| {number} | {s(row['noticed_s'])} | {s(row['replacement_started_s'])} | "
            f"{s(row['lifespan_started_s'])} | {s(row['warmed_up_s'])} | "
            f"{s(row['restored_s'])} | {row['rps_before']:.1f} | {row['rps_after_restored']:.1f} |"
            f" {row['client_failures']} |"
        )
    median = summary["recovery_restored_median_s"]
    lines += ["", f"Median death → full capacity: {'–' if median is None else f'{median:.1f} s'}."]
    (RESULTS / "ray.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter cells, one round")
    args = parser.parse_args()
    try:
        result = run(args.quick)
    finally:
        import shutil

        shutil.rmtree(TEMP_DIR, ignore_errors=True)
    write(result)
    print((RESULTS / "ray.md").read_text())


if __name__ == "__main__":
    main()
