"""Dynamic batching end to end, against a real `sdpa-service serve` on loopback.

- 200 concurrent requests of mixed shapes and options: each equals sdpa_core.attention called
  here on that request alone, and the server computed exactly 200 items (batch sizes sum).
- Backpressure: a full queue is a 503 with Retry-After; a deadline that passes while queued is
  a 504; requests whose clients disconnected are dropped before compute. A long
  SDPA_MAX_BATCH_DELAY_MS holds queued requests deterministically (the worker waits for the
  batch to grow), so none of these checks depends on how fast this machine computes.
"""

from __future__ import annotations

import asyncio
import base64
import math
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sdpa_core import AttentionResult, attention
from tests.support.live_server import LiveServer, live_server

N_REQUESTS = 200


# ---- wire helpers (numpy + base64 only, independent of service.wire.codec) -------------------


def wire(t: torch.Tensor) -> dict[str, Any]:
    if t.dtype == torch.bool:
        raw, name = t.numpy().astype("u1").tobytes(), "bool"
    else:
        raw, name = t.numpy().astype("<f4").tobytes(), "float32"
    return {"dtype": name, "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}


def unwire(obj: dict[str, Any]) -> torch.Tensor:
    assert obj["dtype"] == "float32"
    arr = np.frombuffer(base64.b64decode(obj["b64"]), dtype="<f4").reshape(obj["shape"])
    return torch.from_numpy(arr.copy())


def listed(x: Any) -> torch.Tensor:
    """A per-head / per-row JSON list (null = -inf, as for lse) as float64."""
    arr = np.asarray(x, dtype=object)
    filled = np.where(arr == None, -math.inf, arr).astype(np.float64)  # noqa: E711
    return torch.from_numpy(filled)


def metric(server: LiveServer, name: str, labels: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in (labels or {}).items()
            ):
                return float(sample.value)
    return 0.0


def wait_for(predicate: Callable[[], bool], *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


# ---- request mix ---------------------------------------------------------------------------

OPTION_MIX: list[dict[str, Any]] = [
    {"diagnostics": "none"},
    {"diagnostics": "summary"},
    {"diagnostics": "full", "return_weights": True, "causal": "bottom_right"},
    {"diagnostics": "summary", "causal": True, "key_lengths": True},
    {"diagnostics": "none", "attn_mask": True, "return_weights": True},
]


def make_request(rng: random.Random, gen: torch.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """(wire body, the same request as sdpa_core.attention kwargs)."""
    options = dict(rng.choice(OPTION_MIX))
    lead: tuple[int, ...] = rng.choice([(1,), (2,), ()])
    heads, d = 2, 16
    lo, hi = rng.choice([(33, 40), (17, 20)])  # two length buckets
    n_q, n_kv = rng.randint(lo, hi), rng.randint(lo, hi)
    q = torch.randn(*lead, heads, n_q, d, generator=gen)
    k = torch.randn(*lead, heads, n_kv, d, generator=gen)
    v = torch.randn(*lead, heads, n_kv, d, generator=gen)
    kwargs: dict[str, Any] = {
        "causal": options.get("causal", False),
        "return_weights": options.get("return_weights", False),
        "diagnostics": options["diagnostics"],
    }
    body: dict[str, Any] = {"q": wire(q), "k": wire(k), "v": wire(v), **kwargs}
    if options.get("key_lengths") and lead:
        lengths = torch.randint(1, n_kv + 1, lead, generator=gen)
        kwargs["key_lengths"] = lengths
        body["key_lengths"] = lengths.tolist()
    if options.get("attn_mask"):
        mask = torch.rand(n_q, n_kv, generator=gen) < 0.8
        kwargs["attn_mask"] = mask
        body["attn_mask"] = wire(mask)
    return body, {"q": q, "k": k, "v": v, **kwargs}


def assert_matches_solo(response: dict[str, Any], want: AttentionResult) -> None:
    tol: dict[str, Any] = {"atol": 2e-6, "rtol": 2e-5}
    torch.testing.assert_close(unwire(response["output"]), want.output, **tol)
    if want.weights is None:
        assert response["weights"] is None
    else:
        torch.testing.assert_close(unwire(response["weights"]), want.weights, **tol)
    if want.diagnostics is None:
        assert response["diagnostics"] is None
        return
    got = response["diagnostics"]
    for name, value in want.diagnostics.summary.as_dict().items():
        if name == "masked_rows":
            assert got["summary"][name] == value
        else:
            assert math.isclose(got["summary"][name], value, rel_tol=1e-4, abs_tol=1e-5), name
    for name, tensor in want.diagnostics.per_head.as_dict().items():
        torch.testing.assert_close(
            listed(got["per_head"][name]), tensor.double(), atol=1e-5, rtol=1e-4, msg=name
        )
    if want.diagnostics.per_row is None:
        assert got["per_row"] is None
    else:
        for name, tensor in want.diagnostics.per_row.as_dict().items():
            torch.testing.assert_close(
                listed(got["per_row"][name]), tensor.double(), atol=1e-5, rtol=1e-4, msg=name
            )


# ---- servers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # A short batch delay makes batching certain under this load (not only likely).
    env = {"SDPA_MAX_BATCH_DELAY_MS": "20", "SDPA_LOG_LEVEL": "warning"}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("batching")) as server:
        yield server


def test_concurrent_mixed_requests_equal_their_solo_results(batching_server: LiveServer) -> None:
    rng = random.Random(42)
    gen = torch.Generator().manual_seed(42)
    requests = [make_request(rng, gen) for _ in range(N_REQUESTS)]
    computed_before = metric(batching_server, "sdpa_batch_size_sum")

    async def send_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=N_REQUESTS, max_keepalive_connections=N_REQUESTS)
        async with httpx.AsyncClient(
            base_url=batching_server.url, timeout=120.0, limits=limits
        ) as client:
            return await asyncio.gather(
                *(client.post("/v1/attention", json=body) for body, _ in requests)
            )

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200] * N_REQUESTS
    batch_sizes = []
    for response, (_, kwargs) in zip(responses, requests, strict=True):
        payload = response.json()
        assert_matches_solo(payload, attention(**kwargs))
        batch_sizes.append(payload["meta"]["batch_size"])
    assert max(batch_sizes) > 1, "nothing was batched"
    # Every accepted request was computed exactly once: the batch sizes add up to 200.
    assert metric(batching_server, "sdpa_batch_size_sum") - computed_before == N_REQUESTS


@pytest.fixture(scope="module")
def holding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server whose worker waits up to 3 s for a batch to grow: queued requests stay queued."""
    env = {
        "SDPA_MAX_BATCH_SIZE": "64",
        "SDPA_MAX_BATCH_DELAY_MS": "3000",
        "SDPA_MAX_QUEUE": "4",
        "SDPA_LOG_LEVEL": "warning",
    }
    with live_server(env, tmp_path=tmp_path_factory.mktemp("holding")) as server:
        yield server


def small_body(seed: int, **extra: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=gen) for _ in range(3))
    return {"q": wire(q), "k": wire(k), "v": wire(v), "diagnostics": "none", **extra}


def test_disconnect_deadline_and_full_queue(holding_server: LiveServer, tmp_path: Path) -> None:
    url = holding_server.url

    # 1. Clients that give up while queued: dropped before compute, counted.
    async def give_up() -> list[BaseException | httpx.Response]:
        timeout = httpx.Timeout(30.0, read=0.3)
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            return await asyncio.gather(
                *(client.post("/v1/attention", json=small_body(i)) for i in range(2)),
                return_exceptions=True,
            )

    outcomes = asyncio.run(give_up())
    assert all(isinstance(o, httpx.ReadTimeout) for o in outcomes), outcomes
    wait_for(lambda: metric(holding_server, "sdpa_rejected_total", {"reason": "disconnected"}) == 2)
    assert metric(holding_server, "sdpa_queue_depth") == 0

    # 2. A deadline that passes while queued: 504, problem+json, never computed.
    late = httpx.post(f"{url}/v1/attention", json=small_body(3, timeout_ms=200), timeout=30)
    assert late.status_code == 504
    assert late.headers["content-type"].startswith("application/problem+json")
    assert late.json()["status"] == 504

    # 3. A full queue: 503 with Retry-After (whole seconds, >= 1), problem+json.
    async def fill_and_overflow() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
            queued = [
                asyncio.create_task(client.post("/v1/attention", json=small_body(10 + i)))
                for i in range(4)
            ]
            for _ in range(1000):  # bounded: until all four are queued
                depth = await client.get("/metrics")
                if "sdpa_queue_depth 4.0" in depth.text:
                    break
                await asyncio.sleep(0.02)
            overflow = await client.post("/v1/attention", json=small_body(20))
            return list(await asyncio.gather(*queued)), overflow

    accepted, overflow = asyncio.run(fill_and_overflow())
    assert overflow.status_code == 503
    assert overflow.headers["content-type"].startswith("application/problem+json")
    assert int(overflow.headers["retry-after"]) >= 1
    assert [r.status_code for r in accepted] == [200] * 4
    assert {r.json()["meta"]["batch_size"] for r in accepted} == {4}  # one batch of four

    # Only the four accepted requests were ever computed.
    assert metric(holding_server, "sdpa_batch_size_sum") == 4
    assert metric(holding_server, "sdpa_batch_size_count") == 1
    assert metric(holding_server, "sdpa_rejected_total", {"reason": "disconnected"}) == 2
    assert metric(holding_server, "sdpa_rejected_total", {"reason": "deadline"}) == 1
    assert metric(holding_server, "sdpa_rejected_total", {"reason": "queue_full"}) == 1
