"""The warnings ledger (tests/support/warnings_ledger.py) in real pytest runs of small test files:
a warning nobody explained fails a run whose tests pass, and is listed with the test that warned
(under xdist too, where a worker warns); a run without warnings is untouched. The explained ones,
pyproject.toml's "ignore" filters, are each precise (message, category and module) and give
their reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.live_server import REPO_ROOT


def run_pytest(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest with the ledger alone (no repository configuration, no other plugin) on one test
    file."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    (tmp_path / "test_sample.py").write_text(body, encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.warnings_ledger",
         "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py"), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )  # fmt: skip


NEW_WARNING = """
import warnings

def test_warns():
    warnings.warn("a kind of trouble nobody explained", UserWarning)
"""


def test_a_new_warning_fails_a_passing_run_and_is_listed(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, NEW_WARNING)
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout
    assert "1 passed" in proc.stdout
    assert "unexplained warnings" in proc.stdout
    assert "1 x UserWarning: a kind of trouble nobody explained" in proc.stdout
    assert "test_sample.py::test_warns" in proc.stdout


def test_a_worker_s_new_warning_fails_the_run_too(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, NEW_WARNING, "-p", "xdist.plugin", "-n", "1")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout
    assert "1 x UserWarning: a kind of trouble nobody explained" in proc.stdout


def test_a_run_without_warnings_passes(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, "def test_quiet():\n    assert True\n")
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    assert "unexplained warnings" not in proc.stdout


def test_each_explained_warning_is_filtered_precisely_with_its_reason() -> None:
    lines = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8").splitlines()
    start = lines.index("filterwarnings = [")
    end = lines.index("]", start)
    ignores = 0
    for i in range(start + 1, end):
        entry = lines[i].strip()
        if not entry.startswith('"ignore:'):
            continue
        ignores += 1
        _, message, category, module = entry.strip('",').split(":")
        # never a whole category or module: its message, its category, the module that warns
        assert all(part.strip() for part in (message, category, module)), entry
        assert lines[i - 1].strip().startswith("#"), f"no reason given above {entry}"
    assert ignores >= 2  # torch's script_method and nested tensors
