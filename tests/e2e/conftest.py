"""Shared e2e fixtures: one real `sdpa-service serve` per worker with the small limits of
API_SERVER_ENV, for the tests that need sockets (schema fuzzing, bodies cut while streaming)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.app import API_SERVER_ENV
from tests.support.live_server import LiveServer, live_server


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real server on a free loopback port with the small limits of API_SERVER_ENV."""
    with live_server(API_SERVER_ENV, tmp_path=tmp_path_factory.mktemp("api_server")) as server:
        yield server
