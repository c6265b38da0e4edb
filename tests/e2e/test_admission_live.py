"""Admission keeps its word against real servers on loopback (issue 38).

- The soak's mix for a minute (bench/soak.py's long streams beside small requests): closed
  loops of small requests, two closed loops of analyses (synthetic 8192 x 8192 scores: seconds
  of device time) and one of long attention requests (q = k = v [1, 8, 8192, 16], summary
  diagnostics), each with a 60 s deadline. The truth: no request admitted ends 504
  (sdpa_broken_admissions_total stays 0, and no client sees a 504), and most long attention
  requests are answered; those refused are refused at once (503/429 with Retry-After, which
  the loops honour).
- Two tenants (weights 3 and 1) each send 12 long requests at once with the same deadline: each
  tenant's admitted ones are in proportion to its weight (places and device shared by weight),
  none of the other's is refused because one tenant's hold every place, and every admitted one
  finishes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.live_server import LiveServer, live_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("admission-live")]

SOAK_ENV = {"SDPA_MAX_BATCH_DELAY_MS": "2", "SDPA_REQUEST_TIMEOUT_MS": "60000"}
ANALYZE = {"synthetic": {"n_q": 8192, "n_k": 8192, "d_k": 128, "std": 1.0, "seed": 0}}
SMALL = {
    "q": [[1.0, 0.0], [0.0, 1.0]],
    "k": [[1.0, 0.0], [0.0, 1.0]],
    "v": [[1.0, 2.0], [3.0, 4.0]],
}
KEYS = {"big": "key-big-3", "small": "key-small-1"}


def long_attention_body() -> bytes:
    """bench/soak.py's long request: q = k = v [1, 8, 8192, 16], summary diagnostics."""
    x = np.random.default_rng(0).standard_normal((1, 8, 8192, 16)).astype(np.float32)
    tensor = {
        "dtype": "float32",
        "shape": list(x.shape),
        "b64": base64.b64encode(x.tobytes()).decode(),
    }
    return json.dumps({"q": tensor, "k": tensor, "v": tensor, "diagnostics": "summary"}).encode()


def metric(server: LiveServer, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30).text
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(SOAK_ENV, tmp_path=tmp_path_factory.mktemp("soak")) as server:
        yield server


async def _loop(
    client: httpx.AsyncClient, until: float, path: str, body: bytes, name: str, tally: Counter[str]
) -> None:
    """A closed loop: send, count the status, honour a refusal's Retry-After (at most 5 s)."""
    while time.monotonic() < until:
        try:
            response = await client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as error:
            tally[f"{name} {type(error).__name__}"] += 1
            continue
        tally[f"{name} {response.status_code}"] += 1
        if response.status_code == 504:
            print(name, response.json().get("detail"))
        if response.status_code in (429, 503):
            retry = float(response.headers.get("retry-after", "1"))
            await asyncio.sleep(min(5.0, retry, max(0.0, until - time.monotonic())))


async def _mix(url: str, seconds: float) -> Counter[str]:
    tally: Counter[str] = Counter()
    until = time.monotonic() + seconds
    small = json.dumps(SMALL).encode()
    analyze = json.dumps(ANALYZE).encode()
    long = long_attention_body()
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        loops = [_loop(client, until, "/v1/attention", small, "small", tally) for _ in range(2)]
        loops += [_loop(client, until, "/v1/analyze", analyze, "analyze", tally) for _ in range(2)]
        loops.append(_loop(client, until, "/v1/attention", long, "long", tally))
        await asyncio.gather(*loops)
    return tally


def test_the_soaks_mix_for_a_minute_breaks_no_admission(soak_server: LiveServer) -> None:
    """A minute of the soak's mix: no 504 at all (every admitted request answered within its
    60 s deadline; sdpa_broken_admissions_total 0) and most long attention requests answered.
    Before (issue 38), the soak answered 0 of 10 long attention requests: each was admitted
    and ended 504 while the analyses took the device."""
    tally = asyncio.run(_mix(soak_server.url, 60.0))
    print(dict(tally))
    assert not [name for name in tally if name.endswith(" 504")], tally
    assert metric(soak_server, "sdpa_broken_admissions_total") == 0
    assert tally["small 200"] > 0
    assert tally["analyze 200"] > 0
    answered, refused = tally["long 200"], tally["long 503"] + tally["long 429"]
    assert answered >= 1, tally
    # Most long requests sent are answered; the rest were refused at once, not abandoned.
    assert answered >= refused or refused <= 2, tally


def test_two_tenants_long_requests_are_admitted_by_weight(tmp_path: Path) -> None:
    """big (weight 3) and small (weight 1) each send 12 analyses at once, with a deadline
    that holds only some of them: big's admitted outnumber small's about 3 to 1 (between 1.5
    and 6), small has at least one admitted (its place was kept), and every admitted one is
    answered 200 (no 504)."""
    env = {
        "SDPA_API_KEYS": ",".join(f"{name}={key}" for name, key in KEYS.items()),
        "SDPA_TENANT_WEIGHTS": "big=3,small=1",
        "SDPA_REQUEST_TIMEOUT_MS": "120000",
    }
    body = {"synthetic": {"n_q": 4096, "n_k": 4096, "d_k": 64, "std": 1.0, "seed": 0}}

    async def send_all(url: str, timeout_ms: float) -> dict[str, Counter[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:

            async def one(tenant: str) -> tuple[str, int]:
                response = await client.post(
                    "/v1/analyze",
                    json={**body, "timeout_ms": timeout_ms},
                    headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                )
                if response.status_code == 504:
                    print(tenant, round(time.monotonic() - sent, 2), response.json()["detail"])
                return tenant, response.status_code

            sent = time.monotonic()
            answers = await asyncio.gather(*(one(t) for t in ("big", "small") for _ in range(12)))
        counts: dict[str, Counter[int]] = {"big": Counter(), "small": Counter()}
        for tenant, status in answers:
            counts[tenant][status] += 1
        return counts

    with live_server(env, tmp_path=tmp_path) as server:
        # One analysis alone, for its time on this machine (the deadline below holds several).
        started = time.monotonic()
        alone = httpx.post(
            f"{server.url}/v1/analyze",
            json=body,
            headers={"Authorization": f"Bearer {KEYS['big']}"},
            timeout=300,
        )
        assert alone.status_code == 200
        one_s = time.monotonic() - started
        counts = asyncio.run(send_all(server.url, timeout_ms=8 * one_s * 1000))
        broken = metric(server, "sdpa_broken_admissions_total", {"X-API-Key": KEYS["big"]})
    print(counts, f"one analysis {one_s:.2f} s")
    for tenant in counts:
        assert set(counts[tenant]) <= {200, 429, 503}, counts
    assert broken == 0
    big, small = counts["big"][200], counts["small"][200]
    assert small >= 1, counts
    assert 1.5 <= big / small <= 6.0, counts


def test_a_parked_long_request_banks_no_credit_live(tmp_path: Path) -> None:
    """The credit game of issue 38 on a real server (two tenants, weight 1 each): `parker`
    floods small requests (16 at a time) for 10 s while `other` sends one small request at a
    time; then `other` starts four long attention requests and `parker` parks one, all with an
    hour to go; 10 s later `parker` floods again. `other`'s small requests completed during the
    second flood are at least half those of the first. Before, the parked request waited for a
    place behind `other`'s four, its tenant's virtual time stood still meanwhile, and its flood
    then held the device (the issue: 2 in 30 s against 104)."""
    keys = {"parker": "key-parker-0", "other": "key-other-0"}
    env = {
        "SDPA_API_KEYS": ",".join(f"{name}={key}" for name, key in keys.items()),
        "SDPA_REQUEST_TIMEOUT_MS": "3600000",
    }
    small = json.dumps(SMALL).encode()

    def headers(tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {keys[tenant]}", "content-type": "application/json"}

    async def flood_window(client: httpx.AsyncClient, seconds: float) -> int:
        """`parker` floods while `other` sends one at a time: `other`'s completions."""
        until = time.monotonic() + seconds
        done = 0

        async def flood() -> None:
            while time.monotonic() < until:
                await client.post("/v1/attention", content=small, headers=headers("parker"))

        async def one_at_a_time() -> None:
            nonlocal done
            while time.monotonic() < until:
                response = await client.post(
                    "/v1/attention", content=small, headers=headers("other")
                )
                done += response.status_code == 200

        await asyncio.gather(one_at_a_time(), *(flood() for _ in range(16)))
        return done

    async def game(url: str) -> tuple[int, int]:
        limits = httpx.Limits(max_connections=32)
        long = json.loads(long_attention_body())
        long["timeout_ms"] = 3_600_000
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
            before = await flood_window(client, 10.0)
            held = [
                asyncio.create_task(client.post("/v1/attention", json=long, headers=headers(t)))
                for t in ("other",) * 4 + ("parker",)
            ]
            await asyncio.sleep(10.0)
            during = await flood_window(client, 10.0)
            for task in held:  # (their clients leave: dropped at their next tile)
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        return before, during

    with live_server(env, tmp_path=tmp_path) as server:
        before, during = asyncio.run(game(server.url))
    print(f"other's small requests: {before} in the first flood, {during} with one parked")
    assert before > 0
    assert during >= before / 2, (before, during)
