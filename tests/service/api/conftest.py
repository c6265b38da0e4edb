"""One in-process app per test module, with the small limits of tests.support.app."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.app import in_process_client, small_settings


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with in_process_client(small_settings()) as c:
        yield c
