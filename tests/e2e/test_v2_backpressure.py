"""v2 requests meet v1's backpressure, against a real server whose worker holds queued requests
(SDPA_MAX_BATCH_DELAY_MS = 3 s, SDPA_MAX_QUEUE = 4), so no check depends on this machine's
speed: clients that give up while queued are dropped before compute, a deadline (v2's `timeout`
parameter, µs) that passes while queued is a 504, and a full queue is a 503 with Retry-After,
each with v2's {"error"} body."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.test_batching import metric, wait_for
from tests.support.live_server import LiveServer, live_server

pytestmark = pytest.mark.xdist_group("v2-backpressure")

URL = "/v2/models/attention/infer"


@pytest.fixture(scope="module")
def holding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {
        "SDPA_MAX_BATCH_SIZE": "64",
        "SDPA_MAX_BATCH_DELAY_MS": "3000",
        "SDPA_MAX_QUEUE": "4",
        "SDPA_LOG_LEVEL": "warning",
    }
    with live_server(env, tmp_path=tmp_path_factory.mktemp("v2-holding")) as server:
        yield server


def body(seed: int, **parameters: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    inputs = [
        {"name": n, "shape": [1, 2, 8, 8], "datatype": "FP32",
         "data": rng.standard_normal(128).tolist()}
        for n in ("q", "k", "v")
    ]  # fmt: skip
    return {"inputs": inputs, "parameters": parameters}


def test_v2_disconnect_deadline_and_full_queue(holding_server: LiveServer) -> None:
    url = holding_server.url
    dropped_before = metric(holding_server, "sdpa_rejected_total", {"reason": "disconnected"})

    # 1. Clients that give up while queued: dropped before compute, counted.
    async def give_up() -> list[BaseException | httpx.Response]:
        timeout = httpx.Timeout(30.0, read=0.3)
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            return await asyncio.gather(
                *(client.post(URL, json=body(i)) for i in range(2)), return_exceptions=True
            )

    outcomes = asyncio.run(give_up())
    assert all(isinstance(o, httpx.ReadTimeout) for o in outcomes), outcomes
    wait_for(
        lambda: (
            metric(holding_server, "sdpa_rejected_total", {"reason": "disconnected"})
            == dropped_before + 2
        )
    )
    assert metric(holding_server, "sdpa_queue_depth") == 0

    # 2. A deadline (200 ms, in µs as tritonclient sends it) that passes while queued: 504.
    late = httpx.post(f"{url}{URL}", json=body(3, timeout=200_000), timeout=30)
    assert late.status_code == 504
    assert set(late.json()) == {"error"}

    # 3. A full queue: 503 with Retry-After, {"error"}.
    async def fill_and_overflow() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
            queued = [asyncio.create_task(client.post(URL, json=body(10 + i))) for i in range(4)]
            for _ in range(1000):  # bounded: until all four are queued
                if "sdpa_queue_depth 4.0" in (await client.get("/metrics")).text:
                    break
                await asyncio.sleep(0.02)
            overflow = await client.post(URL, json=body(20))
            return list(await asyncio.gather(*queued)), overflow

    queued, overflow = asyncio.run(fill_and_overflow())
    assert overflow.status_code == 503
    assert int(overflow.headers["retry-after"]) >= 1
    assert set(overflow.json()) == {"error"}
    assert [r.status_code for r in queued] == [200] * 4
    assert {r.json()["parameters"]["batch_size"] for r in queued} == {4}  # one batch of four
