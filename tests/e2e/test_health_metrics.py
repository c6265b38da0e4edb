"""Attention health metrics against a real server: requests with attention known by hand move
each histogram's count, sum and buckets exactly as computed here; sampling at rate 1 and 0; the
tag cap; the 422 for a bad tag; non-finite inputs counted; the process metrics present.

Scores are built so that the softmax is known in closed form: q = [1, 0], k_j = [s_j, 0] and
scale 1 give row scores s_j. /metrics is read with prometheus_client's own text parser.
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.live_server import LiveServer, live_server

SINK_TOKENS = 2
UNIT = [round(i * 0.05, 2) for i in range(21)]  # the documented buckets, written out
LOGIT = sorted([2.0**e for e in range(-2, 15)] + [100.0])  # and QK-Clip's tau
HISTOGRAMS = {
    "sdpa_attention_entropy_normalized": UNIT,
    "sdpa_attention_max_weight": UNIT,
    "sdpa_attention_saturated_fraction": UNIT,
    "sdpa_attention_sink_share": UNIT,
    "sdpa_attention_logit_abs_max": LOGIT,
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def sampling_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_HEALTH_SAMPLE_RATE": "1", "SDPA_HEALTH_SINK_TOKENS": str(SINK_TOKENS)}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("health_rate1")) as server:
        yield server


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_HEALTH_SAMPLE_RATE": "0", "SDPA_HEALTH_MAX_TAGS": "2"}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("health_rate0")) as server:
        yield server


# ---- helpers ------------------------------------------------------------------------------


def scrape(url: str) -> Samples:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    if "tag" in labels:  # health series carry the tenant: "anonymous" without keys
        labels.setdefault("tenant", "anonymous")
    return samples.get((name, frozenset(labels.items())), 0.0)


def b64(array: np.ndarray) -> dict[str, object]:
    return {
        "dtype": "float64",
        "shape": list(array.shape),
        "b64": base64.b64encode(array.astype("<f8").tobytes()).decode(),
    }


def scores_request(rows: Sequence[Sequence[float]], n_q: int = 3) -> dict[str, object]:
    """q, k, v whose head h has row scores rows[h] (every query row alike), scale 1."""
    heads, n_kv = len(rows), len(rows[0])
    q = np.zeros((1, heads, n_q, 2))
    q[..., 0] = 1.0
    k = np.zeros((1, heads, n_kv, 2))
    k[0, :, :, 0] = np.asarray(rows)
    return {"q": b64(q), "k": b64(k), "v": b64(k), "scale": 1.0}


def by_hand(scores: Sequence[float]) -> dict[str, float]:
    """One head's statistics for row scores `scores` (every row alike), from the formulas."""
    e = [math.exp(s - max(scores)) for s in scores]
    p = [x / sum(e) for x in e]
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    return {
        "sdpa_attention_entropy_normalized": min(1.0, entropy / math.log(len(p))),
        "sdpa_attention_max_weight": max(p),
        "sdpa_attention_saturated_fraction": 1.0 if max(p) >= 0.99 else 0.0,
        "sdpa_attention_sink_share": sum(p[:SINK_TOKENS]),
        "sdpa_attention_logit_abs_max": max(abs(s) for s in scores),
    }


def assert_histograms_moved(
    before: Samples, after: Samples, tag: str, heads: Sequence[dict[str, float]]
) -> None:
    """Each histogram of `tag` moved by exactly the heads' values: count, sum and every
    cumulative bucket."""
    for name, bounds in HISTOGRAMS.items():
        values = [h[name] for h in heads]

        def delta(suffix: str, name: str = name, **labels: str) -> float:
            key = {"tag": tag, **labels}
            return value(after, name + suffix, **key) - value(before, name + suffix, **key)

        assert delta("_count") == len(values), name
        assert delta("_sum") == pytest.approx(sum(values), rel=1e-9, abs=1e-12), name
        for bound in bounds:
            expected = sum(1 for v in values if v <= bound)
            assert delta("_bucket", le=str(float(bound))) == expected, (name, bound)
        assert delta("_bucket", le="+Inf") == len(values), name


def post(url: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}/v1/attention", json=body, timeout=30.0)


def wait_for(url: str, name: str, target: float, timeout: float = 20.0, **labels: str) -> Samples:
    """Scrape until the sample reaches `target` (samples are computed when the device idles)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if value(samples, name, **labels) >= target or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


UNIFORM = [0.0] * 6  # normalized entropy 1, max weight 1/6, sink 2/6
ONE_HOT = [0.0, 0.0, 0.0, 60.0, 0.0, 0.0]  # saturated, sink ~ 0, logits up to 60
SINK = [math.log(10.0), 0.0, 0.0, 0.0, 0.0, 0.0]  # p_0 = 10/15, sink (10 + 1)/15


# ---- the histograms -----------------------------------------------------------------------


def test_requested_diagnostics_move_each_histogram_as_by_hand(sampling_server: LiveServer) -> None:
    url = sampling_server.url
    before = scrape(url)
    body = scores_request([UNIFORM, ONE_HOT, SINK]) | {"tag": "known", "diagnostics": "summary"}
    response = post(url, body)
    assert response.status_code == 200, response.text
    summary = response.json()["diagnostics"]["summary"]
    assert summary["sink_share"] == pytest.approx((2 / 6 + 0 + 11 / 15) / 3, abs=1e-12)
    after = scrape(url)
    assert_histograms_moved(before, after, "known", [by_hand(h) for h in (UNIFORM, ONE_HOT, SINK)])
    obs = "sdpa_health_observations_total"
    assert value(after, obs, tag="known", source="requested") == 1
    assert value(after, obs, tag="known", source="sampled") == 0
    assert value(after, "sdpa_attention_masked_rows_total", tag="known") == 0


def test_the_per_head_gauges_hold_the_latest_requests_heads_as_by_hand(
    sampling_server: LiveServer,
) -> None:
    """sdpa_attention_head_*{tag, head}: each head of the tag's latest request."""
    url = sampling_server.url
    tag = "lm/layer0"
    assert post(url, scores_request([SINK, SINK]) | {"tag": tag}).status_code == 200
    heads = [UNIFORM, ONE_HOT, SINK]
    assert post(url, scores_request(heads) | {"tag": tag}).status_code == 200
    after = scrape(url)
    gauges = {
        "sdpa_attention_head_entropy_normalized": "sdpa_attention_entropy_normalized",
        "sdpa_attention_head_sink_share": "sdpa_attention_sink_share",
        "sdpa_attention_head_logit_abs_max": "sdpa_attention_logit_abs_max",
    }
    for gauge, statistic in gauges.items():
        exported = {
            dict(labels)["head"]: v
            for (name, labels), v in after.items()
            if name == gauge and ("tag", tag) in labels
        }
        want = {str(h): by_hand(scores)[statistic] for h, scores in enumerate(heads)}
        assert exported.keys() == want.keys(), gauge
        for head, v in want.items():
            assert exported[head] == pytest.approx(v, rel=1e-9, abs=1e-12), (gauge, head)


def test_masked_rows_are_counted_and_a_fully_masked_head_is_not_observed(
    sampling_server: LiveServer,
) -> None:
    url = sampling_server.url
    before = scrape(url)
    body = scores_request([UNIFORM, SINK], n_q=4) | {
        "tag": "masked",
        "key_lengths": [[0, 6]],  # head 0 sees no key: its 4 rows are masked
    }
    assert post(url, body).status_code == 200
    after = scrape(url)
    assert_histograms_moved(before, after, "masked", [by_hand(SINK)])
    assert value(after, "sdpa_attention_masked_rows_total", tag="masked") == 4


def test_rate_1_samples_a_request_without_diagnostics_after_its_answer(
    sampling_server: LiveServer,
) -> None:
    url = sampling_server.url
    before = scrape(url)
    body = scores_request([SINK, UNIFORM]) | {"tag": "sampled", "diagnostics": "none"}
    response = post(url, body)
    assert response.status_code == 200
    assert response.json()["diagnostics"] is None
    after = wait_for(url, "sdpa_health_observations_total", 1, tag="sampled", source="sampled")
    assert value(after, "sdpa_health_observations_total", tag="sampled", source="sampled") == 1
    assert value(after, "sdpa_health_observations_total", tag="sampled", source="requested") == 0
    assert_histograms_moved(before, after, "sampled", [by_hand(SINK), by_hand(UNIFORM)])


def test_untagged_requests_count_as_default(sampling_server: LiveServer) -> None:
    url = sampling_server.url
    before = scrape(url)
    assert post(url, scores_request([UNIFORM])).status_code == 200
    after = scrape(url)
    obs = "sdpa_health_observations_total"
    moved = value(after, obs, tag="default", source="requested") - value(
        before, obs, tag="default", source="requested"
    )
    assert moved == 1


def test_rate_0_never_samples(capped_server: LiveServer) -> None:
    url = capped_server.url
    before = scrape(url)
    for _ in range(20):
        assert post(url, scores_request([SINK]) | {"diagnostics": "none"}).status_code == 200
    time.sleep(0.5)  # the device has been idle: a sample, were there one, would have run
    after = scrape(url)
    sampled = [
        v for (name, labels), v in after.items()
        if name == "sdpa_health_observations_total" and ("source", "sampled") in labels
    ]  # fmt: skip
    assert sum(sampled) == 0
    assert value(after, "sdpa_attention_sink_share_count", tag="default") == value(
        before, "sdpa_attention_sink_share_count", tag="default"
    )


def test_tags_past_the_cap_count_as_other(capped_server: LiveServer) -> None:
    url = capped_server.url
    before = scrape(url)
    seen = {
        dict(labels)["tag"]
        for (name, labels), v in before.items()
        if name == "sdpa_health_observations_total" and v > 0
    }
    room = max(0, 2 - len(seen))  # SDPA_HEALTH_MAX_TAGS = 2
    fresh = ["cap.a", "cap:b", "cap/c", "cap-d"]
    for tag in fresh:
        assert post(url, scores_request([UNIFORM]) | {"tag": tag}).status_code == 200
    after = scrape(url)
    obs = "sdpa_health_observations_total"
    for tag in fresh[:room]:
        assert value(after, obs, tag=tag, source="requested") == 1
    for tag in fresh[room:]:
        assert value(after, obs, tag=tag, source="requested") == 0
    other = value(after, obs, tag="other", source="requested") - value(
        before, obs, tag="other", source="requested"
    )
    assert other == len(fresh) - room
    assert value(after, "sdpa_attention_entropy_normalized_count", tag="cap-d") == 0


@pytest.mark.parametrize("tag", ["has space", "x" * 65, "", "é", "semi;colon"])
def test_a_bad_tag_is_a_422_naming_the_field(capped_server: LiveServer, tag: str) -> None:
    response = post(capped_server.url, scores_request([UNIFORM]) | {"tag": tag})
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("application/problem+json")
    assert [e["loc"] for e in response.json()["errors"]] == [["body", "tag"]]


def test_a_64_character_tag_is_fine(capped_server: LiveServer) -> None:
    assert post(capped_server.url, scores_request([UNIFORM]) | {"tag": "T" * 64}).status_code == 200


def test_nonfinite_inputs_are_counted(capped_server: LiveServer) -> None:
    url = capped_server.url
    before = value(scrape(url), "sdpa_nonfinite_inputs_total", tenant="anonymous")
    body = scores_request([UNIFORM])
    q = np.zeros((1, 1, 3, 2))
    q[0, 0, 1, 0] = np.nan
    body["q"] = b64(q)
    response = post(url, body)
    assert response.status_code == 422
    assert value(scrape(url), "sdpa_nonfinite_inputs_total", tenant="anonymous") == before + 1


def test_process_and_in_flight_metrics_are_exported(capped_server: LiveServer) -> None:
    samples = scrape(capped_server.url)
    names = {name for name, _ in samples}
    for name in (
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "python_gc_collections_total",
        "sdpa_requests_in_flight",
    ):
        assert name in names, name
    assert value(samples, "process_resident_memory_bytes") > 10e6
    assert value(samples, "sdpa_requests_in_flight") == 0  # nothing in flight while we scrape


def test_live_servers_logged_no_traceback(
    sampling_server: LiveServer, capped_server: LiveServer, tmp_path: Path
) -> None:
    for server in (sampling_server, capped_server):
        assert "Traceback" not in server.log()
