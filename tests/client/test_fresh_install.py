"""`pip install ./sdpa_client` in a fresh virtual environment brings in numpy and httpx only.

Slow (a venv, a build and the dependencies: about 15 s here). The package folder is copied to a
temporary directory first: pip builds in the source tree, and its build/ and *.egg-info output
must not land in the checkout. Skipped, saying why, when the package index cannot be reached;
any other failure fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_STACK = ("torch", "fastapi", "pydantic", "uvicorn", "starlette")
NETWORK_ERRORS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ProxyError",
    "Max retries exceeded",
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run(args: list[str | Path], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args[:3]} exited {proc.returncode}:\n{output[-4000:]}"
    return proc.stdout


def test_client_installs_alone(tmp_path: Path) -> None:
    started = time.monotonic()
    source = tmp_path / "src" / "sdpa_client"
    shutil.copytree(
        REPO_ROOT / "sdpa_client",
        source,
        ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"),
    )
    venv = tmp_path / "venv"
    bin_dir = venv / "bin"
    # Nothing of this interpreter's environment may leak in: no PYTHONPATH, no active venv.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_DEFAULT_TIMEOUT="20", PIP_RETRIES="1")  # offline: give up in seconds
    run([sys.executable, "-m", "venv", venv], cwd=tmp_path, env=env, timeout=120)

    install = subprocess.run(
        [bin_dir / "pip", "install", "--no-input", "--progress-bar", "off", source],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if install.returncode != 0:
        output = install.stdout + install.stderr
        offline = [line for line in output.splitlines() if any(m in line for m in NETWORK_ERRORS)]
        if offline:
            pytest.skip(f"the package index cannot be reached: {offline[0].strip()[:300]}")
        pytest.fail(f"pip install ./sdpa_client failed:\n{output[-4000:]}")

    listed = json.loads(
        run([bin_dir / "pip", "list", "--format=json"], cwd=tmp_path, env=env, timeout=120)
    )
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in listed}
    assert [name for name in SERVER_STACK if name in installed] == []
    assert {"sdpa-client", "numpy", "httpx"} <= installed.keys()

    # Run from tmp_path: the checkout is not on sys.path, so this is the installed copy.
    probe = (
        "import json, sys, importlib.metadata as md, pathlib\n"
        "import sdpa_client, sdpa_client.loadtest\n"
        "print(json.dumps({'version': sdpa_client.__version__,\n"
        "  'metadata': md.version('sdpa-client'),\n"
        "  'file': sdpa_client.__file__,\n"
        "  'typed': (pathlib.Path(sdpa_client.__file__).parent / 'py.typed').is_file(),\n"
        f"  'loaded': sorted(m for m in {list(SERVER_STACK)!r} if m in sys.modules)}}))"
    )
    seen = json.loads(run([bin_dir / "python", "-c", probe], cwd=tmp_path, env=env, timeout=120))
    with (REPO_ROOT / "pyproject.toml").open("rb") as f:
        root_version = tomllib.load(f)["project"]["version"]
    assert seen["version"] == seen["metadata"] == installed["sdpa-client"] == root_version
    assert Path(seen["file"]).is_relative_to(venv)
    assert seen["typed"] is True
    assert seen["loaded"] == []

    usage = run([bin_dir / "sdpa-loadtest", "--help"], cwd=tmp_path, env=env, timeout=120)
    assert "usage: sdpa-loadtest" in usage
    print(f"fresh venv + pip install ./sdpa_client + checks: {time.monotonic() - started:.1f} s")
