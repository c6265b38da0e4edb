"""No warning in a test run goes unexplained: a pytest plugin (tests/conftest.py loads it).

A user reads the warnings summary of `make test` as trouble. The warnings that are explained
are filtered precisely, each with its reason, in pyproject.toml's filterwarnings (the message,
category and module of a third party's warning we cannot fix, e.g. torch's own). Any other
warning pytest collects fails the run (exit status 1, with the tests passed), listed once per
message with the test and the line that warned, so that it is fixed or filtered with its reason.
Under xdist the workers' warnings reach the controller, which judges.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Seen:
    category: str
    message: str
    where: str  # the test (or the phase: "collect", "config"), then the file and line that warned


_SEEN: list[Seen] = []


def pytest_warning_recorded(
    warning_message: warnings.WarningMessage, when: str, nodeid: str, location: object
) -> None:
    where = f"{nodeid or when} ({warning_message.filename}:{warning_message.lineno})"
    _SEEN.append(Seen(warning_message.category.__name__, str(warning_message.message), where))


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # an xdist worker: the controller judges


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _is_worker(session.config) and _SEEN and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    if _is_worker(config) or not _SEEN:
        return
    terminalreporter.section(
        "unexplained warnings: fix each, or filter it precisely with its reason in pyproject.toml",
        red=True,
    )
    first: dict[tuple[str, str], Seen] = {}
    for seen in _SEEN:
        first.setdefault((seen.category, seen.message), seen)
    times = Counter((seen.category, seen.message) for seen in _SEEN)
    for (category, message), seen in first.items():
        terminalreporter.write_line(
            f"{times[category, message]} x {category}: {message}\n    first at {seen.where}"
        )
