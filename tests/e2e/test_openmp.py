"""`sdpa-service serve` makes torch's idle OpenMP workers sleep (service.server.OPENMP_DEFAULTS).

libgomp itself is the witness: with OMP_DISPLAY_ENV=VERBOSE it prints, on the server's stderr,
the settings it took when torch loaded it. GOMP_SPINCOUNT is how long an idle worker spins:
300000 when OMP_WAIT_POLICY is unset, 0 for PASSIVE, 30000000000 for ACTIVE. (Its
OMP_WAIT_POLICY line says PASSIVE for both unset and PASSIVE, so it proves nothing.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.live_server import live_server


def _spin_count(log: str) -> int:
    match = re.search(r"GOMP_SPINCOUNT = '(\d+)'", log)
    assert match is not None, "libgomp printed no GOMP_SPINCOUNT (OMP_DISPLAY_ENV ignored?)"
    return int(match.group(1))


@pytest.mark.parametrize(
    ("operator_env", "expected_spin_count"),
    [
        ({}, 0),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, 30_000_000_000),
        # README "Operations": a short spin for traffic of long chunked requests.
        ({"GOMP_SPINCOUNT": "30000"}, 30_000),
    ],
    ids=["default-passive", "operator-policy-wins", "operator-spin-count-wins"],
)
def test_the_server_makes_idle_openmp_workers_sleep_unless_told_otherwise(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    operator_env: dict[str, str],
    expected_spin_count: int,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # the server inherits this environment
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = {"OMP_DISPLAY_ENV": "VERBOSE", **operator_env}
    with live_server(env, tmp_path=tmp_path) as server:
        log = server.log()
    assert _spin_count(log) == expected_spin_count
