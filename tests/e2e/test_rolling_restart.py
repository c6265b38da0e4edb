"""A rolling restart behind a real nginx (Debian's package): three replicas behind the compose
scale-out config (deploy/compose/nginx.conf, its addresses and paths adapted to loopback), a
closed loop of sdpa-loadtest through nginx, and each replica in turn SIGTERMed and started
again on its port. No request may fail: a draining replica answers 503 (nothing computed) and
nginx sends the request to another; a replica that is down refuses the connection, and nginx
tries another.

Run with `-s` to see the figures (BENCHMARKS.md quotes them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.live_server import REPO_ROOT, LiveServer, free_port, live_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("nginx") is None, reason="needs nginx (Debian's package)"),
]

NGINX_CONF = REPO_ROOT / "deploy" / "compose" / "nginx.conf"
REPLICAS = 3
# Short drains: the replicas hold small requests only.
REPLICA_ENV = {"SDPA_DRAIN_TIMEOUT_S": "10"}


def render_nginx_conf(conf: str, *, listen: int, upstreams: list[int], tmp: Path) -> str:
    """The compose config on loopback: fixed upstream addresses instead of Docker's DNS (and
    `resolve`, which needs nginx >= 1.27.3), our port, and files under tmp."""
    servers = "\n".join(
        f"        server 127.0.0.1:{port} max_fails=3 fail_timeout=10s;" for port in upstreams
    )
    replaced = [
        (r"\n\s*resolver [^\n]*;", ""),
        (r"\n\s*server sdpa-replica:8000 resolve ([^\n]*);", "\n" + servers),
        (r"listen 8080;", f"listen 127.0.0.1:{listen};"),
        (r"pid /tmp/nginx.pid;", f"pid {tmp}/nginx.pid;"),
        (r"access_log /dev/stdout json;", f"access_log {tmp}/access.log json;"),
        (r"error_log /dev/stderr warn;", f"error_log {tmp}/error.log warn;"),
    ]
    for pattern, replacement in replaced:
        conf, count = re.subn(pattern, replacement, conf)
        assert count == 1, f"deploy/compose/nginx.conf no longer has {pattern!r}"
    temp_paths = "".join(
        f"\n    {name}_temp_path {tmp}/{name};"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = conf.replace("http {", "http {" + temp_paths, 1)
    if os.geteuid() == 0:  # workers would run as nobody and could not use tmp's 0700 folders
        conf = "user root;\n" + conf
    return conf


@contextmanager
def nginx(upstreams: list[int], tmp: Path) -> Iterator[str]:
    """nginx with the compose config in front of `upstreams` -> its URL."""
    port = free_port()
    path = tmp / "nginx.conf"
    conf = NGINX_CONF.read_text()
    path.write_text(render_nginx_conf(conf, listen=port, upstreams=upstreams, tmp=tmp))
    process = subprocess.Popen(
        ["nginx", "-c", str(path), "-p", str(tmp), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(f"{url}/nginx-health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, (tmp / "error.log").read_text()
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_rolling_restart_behind_nginx_fails_no_request(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(REPLICAS)]
    with ExitStack() as stack:
        replicas: list[LiveServer] = []
        slowest_start = 0.0
        for port in ports:
            started = time.monotonic()
            replicas.append(
                stack.enter_context(live_server(REPLICA_ENV, tmp_path=tmp_path, port=port))
            )
            slowest_start = max(slowest_start, time.monotonic() - started)
        # Load long enough for three restarts on this machine: each a drain (up to 3 s of
        # linger) and a start as slow as the slowest so far, with room for a busier machine.
        load_seconds = round(3 + REPLICAS * (4 + 2.5 * slowest_start + 1) + 5)
        url = stack.enter_context(nginx(ports, tmp_path))
        report_path = tmp_path / "load.json"
        load = subprocess.Popen(
            [sys.executable, "-m", "sdpa_client.loadtest", "--url", url, "--preset", "small",
             "--concurrency", "8", "--duration", str(load_seconds), "--no-progress",
             "--json", str(report_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        restarts = []
        time.sleep(3)  # load on all three first
        for i, port in enumerate(ports):
            started = time.monotonic()
            code = replicas[i].stop(signal.SIGTERM, timeout=30)
            stopped = time.monotonic()
            assert code == 0, replicas[i].log()[-2000:]
            replicas[i] = stack.enter_context(
                live_server(REPLICA_ENV, tmp_path=tmp_path, port=port)
            )
            restarts.append((stopped - started, time.monotonic() - stopped))
            time.sleep(1)  # serving again before the next one goes
        assert load.poll() is None, "the load ended before the last restart"
        assert load.wait(timeout=load_seconds + 60) == 0, load.stderr.read() if load.stderr else ""
        report = json.loads(report_path.read_text())["report"]
    print(
        f"\nrolling restart of {REPLICAS} replicas under closed-loop load (c=8, small): "
        f"{report['sent']} sent, {report['ok']} ok, errors {report['errors']}, "
        f"p50 {report['latency']['p50_ms']:.1f} ms, p99 {report['latency']['p99_ms']:.1f} ms, "
        f"max {report['latency']['max_ms']:.1f} ms; per replica (drain to exit s, start to "
        f"ready s): {[(round(a, 2), round(b, 2)) for a, b in restarts]}"
    )
    assert report["errors"] == {}, report["errors"]
    assert report["ok"] == report["sent"] > 0


def _served(url: str) -> float:
    """How many attention requests a replica answered 200 (its own metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    pattern = r'^sdpa_requests_total\{route="/v1/attention",status="200",[^}]*\} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, flags=re.MULTILINE))


def test_a_replica_killed_under_load_costs_no_request(tmp_path: Path) -> None:
    """SIGKILL, not a drain: the replica's requests in flight die with it. nginx sees the
    connection reset (or refused) and, since the service is a pure function of its request,
    sends the request to another replica (proxy_next_upstream error ... non_idempotent). The
    replica is then started again, as an orchestrator would, and the time until it serves
    through nginx again (full capacity) is reported."""
    ports = [free_port() for _ in range(REPLICAS)]
    with ExitStack() as stack:
        replicas = [
            stack.enter_context(live_server(REPLICA_ENV, tmp_path=tmp_path, port=port))
            for port in ports
        ]
        url = stack.enter_context(nginx(ports, tmp_path))
        load_seconds = 40
        report_path = tmp_path / "load.json"
        load = subprocess.Popen(
            [sys.executable, "-m", "sdpa_client.loadtest", "--url", url, "--preset", "small",
             "--concurrency", "8", "--duration", str(load_seconds), "--no-progress",
             "--json", str(report_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        time.sleep(4)  # load on all three first
        victim = 1
        assert _served(replicas[victim].url) > 0, "the victim served nothing before its death"
        killed = time.monotonic()
        assert replicas[victim].stop(signal.SIGKILL, timeout=10) == -signal.SIGKILL
        replicas[victim] = stack.enter_context(
            live_server(REPLICA_ENV, tmp_path=tmp_path, port=ports[victim])
        )
        ready = time.monotonic()
        # Full capacity: nginx sends the new replica work again (after fail_timeout at worst).
        restored = None
        while restored is None and time.monotonic() < killed + load_seconds - 8:
            if _served(replicas[victim].url) > 0:
                restored = time.monotonic()
            time.sleep(0.2)
        assert load.wait(timeout=load_seconds + 60) == 0, load.stderr.read() if load.stderr else ""
        report = json.loads(report_path.read_text())["report"]
    print(
        f"\none of {REPLICAS} replicas SIGKILLed under closed-loop load (c=8, small): "
        f"{report['sent']} sent, {report['ok']} ok, errors {report['errors']}, "
        f"p99 {report['latency']['p99_ms']:.1f} ms, max {report['latency']['max_ms']:.1f} ms; "
        f"death to started-and-ready {ready - killed:.2f} s, death to serving through nginx "
        f"{'never' if restored is None else f'{restored - killed:.2f} s'}"
    )
    assert report["errors"] == {}, report["errors"]
    assert report["ok"] == report["sent"] > 0
    assert restored is not None, "the restarted replica got no request through nginx"
