"""Tenants' health apart, /metrics behind its own key, and POST /v1/health/observe's refusals,
on a real server (uvicorn on loopback) with two tenants' keys and a metrics key.

The expected series are computed here by hand from the values each tenant reported.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.live_server import LiveServer, live_server

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789"}
METRICS_KEY = "metrics-key-0123456789"
MAX_TAGS = 8  # two tenants of weight 1: 4 tags each


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {
        "SDPA_API_KEYS": ",".join(f"{name}={key}" for name, key in KEYS.items()),
        "SDPA_METRICS_KEY": METRICS_KEY,
        "SDPA_HEALTH_MAX_TAGS": str(MAX_TAGS),
        "SDPA_HEALTH_SAMPLE_RATE": "0",
    }
    with live_server(env, tmp_path=tmp_path_factory.mktemp("tenants")) as running:
        yield running


def as_(tenant: str) -> dict[str, str]:
    return {"X-API-Key": KEYS[tenant]}


def observation(tag: str, entropy: list[list[float]], **extra: Any) -> dict[str, Any]:
    heads = len(entropy[0])
    keys = extra.pop("visible_keys_max", 16)
    per_head = {
        "entropy": [[e * math.log(keys) for e in row] for row in entropy],
        "normalized_entropy": entropy,
        "max_weight": [[0.5] * heads for _ in entropy],
        "sink_share": [[0.25] * heads for _ in entropy],
        "score_abs_max_scaled": [[3.0] * heads for _ in entropy],
        **extra.pop("per_head", {}),
    }
    return {"tag": tag, "visible_keys_max": keys, "per_head": per_head, **extra}


def observe(server: LiveServer, tenant: str | None, *observations: Any) -> httpx.Response:
    headers = {} if tenant is None else as_(tenant)
    return httpx.post(
        f"{server.url}/v1/health/observe",
        json={"observations": list(observations)},
        headers=headers,
        timeout=30,
    )


def scrape(server: LiveServer) -> str:
    answer = httpx.get(f"{server.url}/metrics", headers={"X-API-Key": METRICS_KEY}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.text


def value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if found == labels:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_two_tenants_with_the_same_tags_keep_their_own_series(server: LiveServer) -> None:
    alice = [[0.1, 0.2, 0.3]]
    bob = [[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]]
    assert observe(server, "alice", observation("shared/layer0", alice)).status_code == 200
    answer = observe(server, "bob", observation("shared/layer0", bob))
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"recorded": 1, "tags": ["shared/layer0"]}
    text = scrape(server)
    name = "sdpa_attention_entropy_normalized"
    for tenant, values in (("alice", alice), ("bob", bob)):
        flat = np.asarray(values).ravel()
        labels = {"tag": "shared/layer0", "tenant": tenant}
        assert value(text, f"{name}_count", **labels) == flat.size
        assert value(text, f"{name}_sum", **labels) == pytest.approx(flat.sum())
        # The per-head gauge: each head's mean over the tenant's sequences.
        for head in range(3):
            got = value(text, "sdpa_attention_head_entropy_normalized", head=str(head), **labels)
            assert got == pytest.approx(np.asarray(values)[:, head].mean())
        assert value(
            text, "sdpa_health_observations_total", source="reported", **labels
        ) == 1  # fmt: skip


def test_one_tenant_filling_its_share_evicts_nothing_of_the_others(server: LiveServer) -> None:
    assert observe(server, "bob", observation("bob/layer0", [[0.5]])).status_code == 200
    # Alice's share is MAX_TAGS / 2 = 4 tags (one already held by the test above, if it ran).
    tags = [observe(server, "alice", observation(f"flood/{i}", [[0.5]])).json()["tags"][0]
            for i in range(8)]  # fmt: skip
    assert tags.count("other") >= 4
    assert len({t for t in tags if t != "other"}) <= 4
    # Bob's tags are all still his, and a new one of his still gets its own series.
    answer = observe(server, "bob", observation("bob/layer1", [[0.5]]))
    assert answer.json()["tags"] == ["bob/layer1"]
    text = scrape(server)
    for tag in ("bob/layer0", "bob/layer1"):
        count = value(text, "sdpa_attention_entropy_normalized_count", tag=tag, tenant="bob")
        assert count == 1
    assert value(text, "sdpa_health_tags_evicted_total") in (None, 0.0)


def test_a_tenants_key_reads_neither_metrics_nor_the_others_info(server: LiveServer) -> None:
    for headers in (as_("alice"), as_("bob"), {}, {"X-API-Key": "nope"}):
        answer = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10)
        assert answer.status_code == 401, (headers, answer.text)
        assert "SDPA_METRICS_KEY" in answer.json()["detail"]
    bearer = {"Authorization": f"Bearer {METRICS_KEY}"}
    assert httpx.get(f"{server.url}/metrics", headers=bearer, timeout=10).status_code == 200
    # The metrics key is no tenant's key: it computes and reads nothing else.
    info = httpx.get(f"{server.url}/v1/info", headers={"X-API-Key": METRICS_KEY}, timeout=10)
    assert info.status_code == 401
    for tenant in KEYS:
        info = httpx.get(f"{server.url}/v1/info", headers=as_(tenant), timeout=10)
        assert info.status_code == 200
        listed = [entry["name"] for entry in info.json()["tenants"]["tenants"]]
        assert listed == [tenant]
        assert tenant not in json.dumps(
            httpx.get(
                f"{server.url}/v1/info",
                headers=as_(next(t for t in KEYS if t != tenant)),
                timeout=10,
            ).json()
        )


def test_a_computed_requests_health_carries_its_tenant(server: LiveServer) -> None:
    eye = [[[1.0, 0.0], [0.0, 1.0]]]
    body = {"q": eye, "k": eye, "v": eye, "tag": "computed", "diagnostics": "summary"}
    answer = httpx.post(f"{server.url}/v1/attention", json=body, headers=as_("bob"), timeout=30)
    assert answer.status_code == 200, answer.text
    text = scrape(server)
    labels = {"tag": "computed", "tenant": "bob"}
    assert value(text, "sdpa_attention_entropy_normalized_count", **labels) == 1
    assert value(text, "sdpa_attention_entropy_normalized_count", tag="computed",
                 tenant="alice") is None  # fmt: skip


def packed(values: np.ndarray[Any, Any], dtype: str = "float32") -> dict[str, Any]:
    data = np.ascontiguousarray(values, dtype="<f4" if dtype == "float32" else "<f8")
    return {
        "dtype": dtype,
        "shape": list(data.shape),
        "b64": base64.b64encode(data.tobytes()).decode(),
    }


def post_raw(server: LiveServer, body: bytes) -> httpx.Response:
    headers = {**as_("bob"), "content-type": "application/json"}
    return httpx.post(f"{server.url}/v1/health/observe", content=body, headers=headers, timeout=60)


def test_a_packed_report_is_recorded_as_a_listed_one(server: LiveServer) -> None:
    entropy = np.asarray([[0.25, 0.75]])
    obs = observation("packed/layer0", entropy.tolist())
    obs["per_head"] = {name: packed(np.asarray(v)) for name, v in obs["per_head"].items()}
    name = "sdpa_attention_entropy_normalized_sum"
    before = scrape(server)
    answer = observe(server, "alice", obs)
    assert answer.status_code == 200, answer.text
    # Alice's share may be full (the tests above): then it counts under "other", hers still.
    labels = {"tag": answer.json()["tags"][0], "tenant": "alice"}
    added = (value(scrape(server), name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)
    assert added == pytest.approx(1.0)


def _refused(answer: httpx.Response, status: int, *loc: Any) -> str:
    assert answer.status_code == status, answer.text
    problem = answer.json()
    if not loc:
        return str(problem["detail"])
    named = [e for e in problem["errors"] if e["loc"] == list(loc)]
    assert named, problem
    return str(named[0]["msg"])


def test_observe_refuses_what_it_cannot_record(server: LiveServer) -> None:
    where = ("body", "observations", 0, "per_head")
    good = observation("refused", [[0.5, 0.5]])
    # Out of range: each names its field and its bounds.
    bad = observation("refused", [[0.5, 1.5]])
    assert "at most 1" in _refused(observe(server, "bob", bad), 422, *where, "normalized_entropy")
    bad = observation("refused", [[0.5, 0.5]], per_head={"max_weight": [[0.5, -0.1]]})
    _refused(observe(server, "bob", bad), 422, *where, "max_weight")
    bad = observation("refused", [[0.5, 0.5]], per_head={"entropy": [[0.5, 3.0]]},
                      visible_keys_max=4)  # fmt: skip
    assert "at most 1.386" in _refused(observe(server, "bob", bad), 422, *where, "entropy")
    bad = observation("refused", [[0.5, 0.5]], per_head={"masked_rows": [[1.0, 0.0]]})
    assert "n_q" in _refused(observe(server, "bob", bad), 422, *where, "masked_rows")
    bad = observation("refused", [[0.5, 0.5]], per_head={"masked_rows": [[1.5, 0.0]]}, n_q=4)
    _refused(observe(server, "bob", bad), 422, *where, "masked_rows")
    bad = observation("refused", [[0.5, 0.5]], per_head={"sink_share": [[0.5]]})
    assert "shape" in _refused(observe(server, "bob", bad), 422, *where, "sink_share")
    # Not finite: 1e999 is JSON, and reads as infinity.
    raw = json.dumps({"observations": [good]}).replace("3.0", "1e999", 1).encode()
    answer = post_raw(server, raw)
    assert "finite" in _refused(answer, 422, *where, "score_abs_max_scaled")
    nan = packed(np.asarray([[0.5, np.nan]]))
    packed_nan = {**good, "per_head": {**good["per_head"], "max_weight": nan}}
    _refused(observe(server, "bob", packed_nan), 422, *where, "max_weight")
    # Unknown fields, missing ones, a bad tag.
    bad = {**good, "per_head": {**good["per_head"], "entropyy": [[0.1, 0.1]]}}
    _refused(observe(server, "bob", bad), 422, *where, "entropyy")
    bad = {**good, "per_head": {k: v for k, v in good["per_head"].items() if k != "sink_share"}}
    _refused(observe(server, "bob", bad), 422, *where, "sink_share")
    _refused(observe(server, "bob", {**good, "tag": "a b"}), 422, "body", "observations", 0, "tag")
    # Oversized: too many heads in one observation, too many observations, too many bytes.
    wide = observation("refused", [[0.5] * 300] * 300)
    assert "65,536" in _refused(observe(server, "bob", wide), 422, *where, "entropy")
    many = [good] * 257
    _refused(observe(server, "bob", *many), 422, "body", "observations")
    huge = b'{"observations": [' + b" " * (17 * 1024 * 1024) + b"]}"
    answer = post_raw(server, huge)
    assert answer.status_code == 413, answer.text
    # Unkeyed, or with the metrics key: 401, and nothing recorded.
    assert observe(server, None, good).status_code == 401
    answer = httpx.post(f"{server.url}/v1/health/observe", json={"observations": [good]},
                        headers={"X-API-Key": METRICS_KEY}, timeout=10)  # fmt: skip
    assert answer.status_code == 401
    assert value(scrape(server), "sdpa_attention_entropy_normalized_count", tag="refused",
                 tenant="bob") is None  # fmt: skip
