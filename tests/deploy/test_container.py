"""The image, built from the real Dockerfile with `make image` and run with buildah.

Needs root, buildah, and either the base image python:3.11-slim in buildah's store or debootstrap
to make the stand-in base (scripts/make-stand-in-base.sh); skips cleanly otherwise. No Docker
engine runs here and podman cannot start containers, so the image runs under
`buildah run --isolation chroot --network host`, which sets up what a runtime would from the
image's own config (USER, ENV, WORKDIR): the commands run are the image's CMD and HEALTHCHECK as
`buildah inspect` reads them from the built image, after a check that they equal the Dockerfile.

Two deliberate changes, both for a shared machine: the CMD binds --host 0.0.0.0 (a container
needs it; its loopback is its own), swapped for 127.0.0.1 after checking it is 0.0.0.0, and
SDPA_PORT is a free port instead of 8000 (the healthcheck finds the server through it alone), and
so is SDPA_GRPC_PORT instead of 8001.

Read-only root: buildah has no --read-only, so the test bind-mounts every top-level directory of
the image's root read-only over itself and puts a tmpfs on /tmp, as Kubernetes'
readOnlyRootFilesystem with an emptyDir on /tmp does. One path stays outside that: / itself
(buildah's mount point; root-owned, so uid 10001 cannot write it either). A separate check shows
that, even without those mounts, uid 10001 can write nowhere in the image but /tmp and the
world-writable scratch directories every Debian root has.

The build reuses buildah's layer cache (--layers): with the base image and the torch layer cached,
a change to the code rebuilds the small code layers only. Facts (build time, image size,
start-to-ready time) go to build/container-test-report.json and to the terminal.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from service.server import worst_case_exit_s
from tests.deploy.dockerfile_parser import REPO_ROOT, final_stage, healthcheck
from tests.support.live_server import free_port

# One xdist worker builds and runs the image: two would build the same tag at once.
pytestmark = [
    pytest.mark.container,
    pytest.mark.slow,
    pytest.mark.xdist_group("container"),
    pytest.mark.timeout(1500),
]

TEST_IMAGE = os.environ.get("SDPA_TEST_IMAGE", "localhost/sdpa-service:test")
# The goal for the CPU image (decimal GB, as registries and `buildah images` count).
SIZE_GOAL_BYTES = 1_200_000_000
REPORT = REPO_ROOT / "build" / "container-test-report.json"
BUILD_TIMEOUT_S = 1200
# Paths a non-root user may write in any Debian root (mode 1777), without the read-only mounts.
WORLD_WRITABLE_SCRATCH = {"/tmp", "/var/tmp", "/var/lock", "/run/lock", "/dev/shm"}


@dataclass
class Image:
    name: str
    config: dict[str, Any]
    build_s: float
    facts: dict[str, Any] = field(default_factory=dict)


def _base_image() -> str:
    text = (REPO_ROOT / "Dockerfile").read_text(encoding="utf-8")
    version = re.search(r"^ARG PYTHON_VERSION=(\S+)$", text, re.MULTILINE)
    assert version is not None
    return f"python:{version.group(1)}-slim"


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "buildah's chroot isolation needs Linux"
    if os.geteuid() != 0:
        return "needs root (buildah's store and chroot isolation)"
    if shutil.which("buildah") is None:
        return "buildah is not installed (.ci/run installs it on Debian)"
    has_base = subprocess.run(
        ["buildah", "inspect", "--type", "image", _base_image()],
        capture_output=True,
        timeout=60,
        check=False,
    )
    if has_base.returncode != 0 and shutil.which("debootstrap") is None:
        return f"{_base_image()} is not in buildah's store and debootstrap (stand-in) is missing"
    return None


def _torch_wheels_dir() -> str | None:
    """pip's find-links folder when it holds a torch wheel (this machine's CPU build)."""
    configured = os.environ.get("SDPA_TEST_TORCH_WHEELS")
    if configured:
        return configured
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    for match in re.finditer(r"find-links='([^']+)'", proc.stdout):
        for folder in match.group(1).split():
            if any(Path(folder).glob("torch-*.whl")):
                return folder
    return None


def _buildah(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        ["buildah", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"buildah {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def _write_report(image: Image) -> None:
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    facts = {"image": image.name, "build_s": round(image.build_s, 1), **image.facts}
    REPORT.write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    command = ["make", "image", f"IMAGE={TEST_IMAGE}", "CONTAINER_TOOL=buildah"]
    wheels = _torch_wheels_dir()
    if wheels is not None:
        command.append(f"TORCH_WHEELS={wheels}")
    start = time.monotonic()
    proc = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
    )
    build_s = time.monotonic() - start
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    inspected = json.loads(_buildah("inspect", "--type", "image", TEST_IMAGE))
    built = Image(TEST_IMAGE, inspected["Docker"]["config"], build_s)
    # An image built on scripts/make-stand-in-base.sh's base says so (the label is inherited).
    labels = built.config.get("Labels") or {}
    built.facts["stand_in_base"] = "io.github.sdpa-service.stand-in-base" in labels
    if built.facts["stand_in_base"]:
        assert "STAND-IN" in proc.stderr, "make image built on the stand-in without saying so"
    yield built
    _write_report(built)


@dataclass
class Container:
    name: str
    root: Path  # the image's root filesystem, mounted on this machine

    def read_only_args(self) -> list[str]:
        """Every top-level directory of the image bound read-only over itself; tmpfs on /tmp."""
        args: list[str] = []
        for entry in sorted(self.root.iterdir()):
            if entry.is_symlink() or not entry.is_dir():
                continue  # bin -> usr/bin and friends follow their target
            if entry.name in {"tmp", "proc", "sys", "dev"}:
                continue  # /tmp: the tmpfs below; the rest are the kernel's
            args += ["-v", f"{entry}:/{entry.name}:ro"]
        return [*args, "--mount", "type=tmpfs,destination=/tmp"]

    def run_argv(self, argv: list[str], *, read_only: bool, env: dict[str, str]) -> list[str]:
        options = ["--isolation", "chroot", "--network", "host"]
        if read_only:
            # buildah binds its /run/.containerenv into the root and removes the file after each
            # run: with it already there (in this container's own writable layer, not the
            # image), /run can be mounted read-only too.
            (self.root / "run" / ".containerenv").touch()
            options += self.read_only_args()
        for key, value in env.items():
            options += ["-e", f"{key}={value}"]
        return ["buildah", "run", *options, self.name, "--", *argv]

    def run(
        self, argv: list[str], *, read_only: bool = True, env: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return subprocess.run(
            self.run_argv(argv, read_only=read_only, env=env or {}),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@pytest.fixture(scope="module")
def container(image: Image) -> Iterator[Container]:
    name = f"sdpa-container-test-{os.getpid()}"
    _buildah("from", "--pull-never", "--name", name, image.name)
    try:
        root = Path(_buildah("mount", name).strip())
        yield Container(name, root)
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True, timeout=120, check=False)


def test_image_config_is_the_dockerfiles(image: Image) -> None:
    stage = final_stage()
    config = image.config
    user = stage.last("USER")
    assert user is not None
    assert config["User"] == user.args == "10001:10001"
    options, health = healthcheck(stage)
    # --format docker keeps the HEALTHCHECK (the OCI format has none and drops it).
    assert config["Healthcheck"]["Test"] == ["CMD", *health]
    assert config["Healthcheck"]["Timeout"] == int(options["timeout"].rstrip("s")) * 10**9
    assert config["Cmd"] == ["sdpa-service", "serve", "--host", "0.0.0.0"]
    assert config["StopSignal"] == "SIGTERM"
    assert set(config["ExposedPorts"]) == {"8000/tcp", "8001/tcp"}  # HTTP, gRPC
    env = _config_env(config)
    assert env["SDPA_DRAIN_TIMEOUT_S"] == stage.env()["SDPA_DRAIN_TIMEOUT_S"]
    assert env["HOME"] == "/tmp"


# Tries to create a file in each directory and prints {path: errno name or "ok"}.
_PROBE_WRITES = """
import errno, json, os, sys
result = {}
for path in sys.argv[1:]:
    target = os.path.join(path, ".sdpa-write-probe")
    try:
        with open(target, "w") as handle:
            handle.write("x")
        os.unlink(target)
        result[path] = "ok"
    except OSError as exc:
        result[path] = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "writes": result}))
"""

# Every path below / (one filesystem: the image's) that the running user may write.
_WRITABLE_PATHS = """
import json, os
found = []
for top, dirs, files in os.walk("/"):
    if top in ("/proc", "/sys", "/dev"):
        dirs[:] = []
        continue
    for name in dirs + files:
        path = os.path.join(top, name)
        if not os.path.islink(path) and os.access(path, os.W_OK):
            found.append(path)
print(json.dumps(found))
"""


def test_runs_as_uid_10001_with_a_read_only_root_except_tmp(container: Container) -> None:
    targets = ["/tmp", "/opt/venv", "/opt/app", "/etc", "/usr/local", "/var/lib", "/run",
               # world-writable (1777) in the image: only the read-only mount refuses these
               "/var/tmp", "/run/lock"]  # fmt: skip
    proc = container.run(["python", "-c", _PROBE_WRITES, *targets], read_only=True)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout)
    # The image's USER, not a --user override: the process is uid/gid 10001.
    assert (probe["uid"], probe["gid"]) == (10001, 10001)
    writes = probe["writes"]
    assert writes.pop("/tmp") == "ok"
    # Everything else is refused by the read-only mount itself (not merely by permissions).
    assert writes == dict.fromkeys(writes, errno.errorcode[errno.EROFS])
    # `/` itself is buildah's mount point, not bound read-only: root-owned, so refused anyway.
    proc = container.run(["python", "-c", _PROBE_WRITES, "/"], read_only=True)
    assert json.loads(proc.stdout)["writes"] == {"/": errno.errorcode[errno.EACCES]}

    # Without the read-only mounts, ownership alone keeps uid 10001 out of the image's files.
    proc = container.run(["python", "-c", _WRITABLE_PATHS], read_only=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    writable = json.loads(proc.stdout)
    outside = [p for p in writable if not any(
        p == d or p.startswith(d + "/") for d in WORLD_WRITABLE_SCRATCH
    )]  # fmt: skip
    assert outside == [], outside[:20]


def _service_process(runner: subprocess.Popen[bytes]) -> psutil.Process | None:
    """The image's CMD as it runs: the uid-10001 python below `buildah run`.

    buildah's chroot runner starts it through buildah-chroot-exec, which also runs as uid 10001
    with the command line in its arguments and only waits for its child: a runtime signals the
    command itself, so the test picks the innermost such process.
    """
    try:
        children = psutil.Process(runner.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    candidates: list[psutil.Process] = []
    for child in children:
        try:
            if child.uids().real == 10001 and "serve" in child.cmdline():
                candidates.append(child)
        except psutil.NoSuchProcess:
            continue
    pids = {c.pid for c in candidates}
    leaves = [c for c in candidates if not any(g.pid in pids for g in _children(c))]
    return leaves[0] if len(leaves) == 1 else None


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return list(process.children())
    except psutil.NoSuchProcess:
        return []


def _config_env(config: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in config["Env"])


def _log_message(line: str) -> str | None:
    """The "msg" of one JSON log line (None for anything else)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("msg") if isinstance(record, dict) else None


def _tensor(wire: dict[str, Any]) -> np.ndarray:
    """A tensor as the service sends it with JSON encoding: {"dtype", "shape", "data"}."""
    assert wire["dtype"] == "float32", wire["dtype"]
    return np.asarray(wire["data"], dtype=np.float64).reshape(wire["shape"])


def _float64_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    scores = (q @ k.T) / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    result: np.ndarray = weights @ v
    return result


def test_cmd_serves_healthcheck_gates_on_warm_up_and_sigterm_drains(
    image: Image, container: Container, tmp_path: Path
) -> None:
    config = image.config
    serve = list(config["Cmd"])
    host = serve.index("--host")
    assert serve[host + 1] == "0.0.0.0"
    serve[host + 1] = "127.0.0.1"
    health = list(config["Healthcheck"]["Test"])
    assert health[0] == "CMD"
    health_timeout_s = config["Healthcheck"]["Timeout"] / 10**9
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A 1.5 s batching window holds the drain test's request in the queue while SIGTERM lands.
    env = {"SDPA_PORT": str(port), "SDPA_DEVICE": "cpu", "SDPA_MAX_BATCH_DELAY_MS": "1500",
           "SDPA_GRPC_PORT": str(free_port())}  # fmt: skip

    def healthcheck_passes() -> bool:
        proc = container.run(health[1:], env=env, timeout=health_timeout_s + 30)
        return proc.returncode == 0

    # Nothing serves yet: the HEALTHCHECK command fails.
    assert not healthcheck_passes()

    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        runner = subprocess.Popen(
            container.run_argv(serve, read_only=True, env=env), stdout=log, stderr=log
        )
    started = time.monotonic()
    try:
        # Right after the start, torch is still importing or warming up: not healthy yet.
        assert not healthcheck_passes(), log_path.read_text()[-3000:]
        # Docker's view: the HEALTHCHECK command, polled (bounded by the start period).
        deadline = started + config["Healthcheck"]["StartPeriod"] / 10**9
        healthy = False
        while not healthy and time.monotonic() < deadline:
            assert runner.poll() is None, log_path.read_text()[-3000:]
            healthy = healthcheck_passes()
        assert healthy, log_path.read_text()[-3000:]
        image.facts["start_to_healthy_s"] = round(time.monotonic() - started, 1)
        ready = httpx.get(f"{url}/readyz", timeout=10)
        assert ready.status_code == 200

        # One attention request, checked against a float64 reference computed here.
        rng = np.random.default_rng(18)
        q, k, v = (rng.standard_normal(shape) for shape in ((5, 16), (7, 16), (7, 8)))
        body = {"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "diagnostics": "none"}
        response = httpx.post(f"{url}/v1/attention", json=body, timeout=30)
        assert response.status_code == 200, response.text
        output = _tensor(response.json()["output"])
        np.testing.assert_allclose(output, _float64_attention(q, k, v), rtol=1e-5, atol=1e-6)

        metrics = httpx.get(f"{url}/metrics", timeout=10)
        assert metrics.status_code == 200
        assert re.search(r'^sdpa_requests_total\{[^}]*status="200"', metrics.text, re.MULTILINE)

        # SIGTERM, as a runtime sends the image's STOPSIGNAL, while a request waits in the queue.
        answers: list[httpx.Response | httpx.HTTPError] = []

        def send() -> None:
            try:
                answers.append(httpx.post(f"{url}/v1/attention", json=body, timeout=60))
            except httpx.HTTPError as exc:
                answers.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        queued_by = time.monotonic() + 10
        while time.monotonic() < queued_by:
            depth = re.search(r"^sdpa_queue_depth (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
            if depth is not None and float(depth.group(1)) >= 1:
                break
            time.sleep(0.02)
        service = _service_process(runner)
        assert service is not None, "the serving process was not found below buildah run"
        service.send_signal(getattr(signal, config["StopSignal"]))
        stopped = time.monotonic()
        # The grace period the Dockerfile documents (`docker stop -t 45`).
        documented = re.search(
            r"docker stop -t (\d+)", (REPO_ROOT / "Dockerfile").read_text(encoding="utf-8")
        )
        assert documented is not None
        grace_s = float(documented.group(1))
        assert runner.wait(timeout=grace_s) == 0, log_path.read_text()[-3000:]
        image.facts["sigterm_to_exit_s"] = round(time.monotonic() - stopped, 2)
        sender.join(timeout=30)
        # The queued request was finished by the drain, not dropped.
        assert len(answers) == 1
        answer = answers[0]
        assert isinstance(answer, httpx.Response), repr(answer)
        assert answer.status_code == 200, answer.text
        drained = _tensor(answer.json()["output"])
        np.testing.assert_allclose(drained, _float64_attention(q, k, v), rtol=1e-5, atol=1e-6)
        drain_s = float(_config_env(config)["SDPA_DRAIN_TIMEOUT_S"])
        assert grace_s > worst_case_exit_s(drain_s)
        messages = [_log_message(line) for line in log_path.read_text().splitlines()]
        assert messages.index("draining") < messages.index("drained")
    finally:
        if runner.poll() is None:
            service = _service_process(runner)
            if service is not None:
                service.kill()
            runner.kill()
            runner.wait(timeout=30)
    # Down again: the HEALTHCHECK command fails.
    assert not healthcheck_passes()


# Loads the CPU flash kernel the way the warm-up does and checks one tile against torch's SDPA.
_CPU_FLASH = """
import json, torch
from sdpa_core.kernels import cpu_flash
ok, why = cpu_flash.build()
q = torch.randn(1, 2, 70, 16, generator=torch.Generator().manual_seed(0))
out, stats = cpu_flash.flash_tile(q, q, q, scale=0.25, q_start=0, causal_shift=0,
    key_lengths=None, visible=None, bias=None, sink_tokens=4)
ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True, scale=0.25)
print(json.dumps({"ok": ok, "why": why, "from": cpu_flash.loaded_from(),
    "error": float((out - ref).abs().max()), "fields": len(stats)}))
"""


def test_the_cpu_flash_kernel_is_prebuilt_and_runs_without_a_compiler(
    container: Container,
) -> None:
    """The image carries the kernel compiled at build time: on a read-only root, as uid
    10001, with no compiler in the image, build() loads it and it computes attention."""
    proc = container.run(["python", "-I", "-c", _CPU_FLASH], read_only=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ok"], result["why"]
    assert result["from"] == "prebuilt"
    assert result["error"] < 1e-5
    assert result["fields"] == 10


_COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++", "tcc", "cpp", "as", "ld", "make")


def test_no_compiler_pip_cache_tests_or_bench_in_the_image(
    image: Image, container: Container
) -> None:
    root = container.root
    path_dirs = _config_env(image.config)["PATH"].split(":")
    found = [f"{d}/{c}" for d in path_dirs for c in _COMPILERS if (root / d[1:] / c).exists()]
    assert found == [], found
    assert not list((root / "usr" / "lib").glob("gcc*")), "a gcc runtime toolchain is present"
    # No pip cache anywhere: not root's, not $HOME's (/tmp), not the build's.
    caches = [p for p in root.glob("**/.cache/pip") if p.is_dir()]
    assert caches == [], caches
    # Not the sources, tests or benchmarks: only the installed packages.
    assert not (root / "src").exists()
    names = {p.name for p in (root / "opt" / "app").iterdir()}
    assert {"sdpa_core", "service", "sdpa_client"} <= names
    assert not names & {"tests", "bench", "src"}
    ours = ("test_container.py", "live_server.py", "attacks.py")
    stray = [p for name in ours for p in root.glob(f"opt/**/{name}")]
    assert stray == [], stray
    # torch's own C++ test binaries and headers were dropped in the torch layer.
    torch_dirs = list((root / "opt" / "venv").glob("lib/python3*/site-packages/torch"))
    assert len(torch_dirs) == 1
    assert not (torch_dirs[0] / "test").exists()
    assert not (torch_dirs[0] / "include").exists()
    assert sorted(p.name for p in (torch_dirs[0] / "bin").iterdir()) == ["torch_shm_manager"]


def test_image_size_is_within_the_goal(image: Image) -> None:
    listed = json.loads(_buildah("images", "--json", image.name))
    assert len(listed) == 1
    size = _image_size_bytes(image.name)
    image.facts["size_bytes"] = size
    image.facts["size_listed"] = listed[0]["size"]
    assert size <= SIZE_GOAL_BYTES, f"{size / 1e9:.2f} GB > {SIZE_GOAL_BYTES / 1e9:.1f} GB"


def _image_size_bytes(name: str) -> int:
    """The image's size in the store: the sum of its layers (uncompressed, as stored locally)."""
    manifest = json.loads(json.loads(_buildah("inspect", "--type", "image", name))["Manifest"])
    return sum(int(layer["size"]) for layer in manifest["layers"])
