"""The per-head gauges sdpa_attention_head_*{tag, head}: a tag's latest request, per head index,
pooled over its sequences; bounded by max_heads; removed with the tag's slot. Also the
settings that size the health series for models (tags per layer) and the QK-Clip bucket.

Scores are built so that the softmax is known in closed form: q = [1, 0], k_j = [s_j, 0] and
scale 1 give every query row of a head the scores s_j (tests/e2e/test_health_metrics.py does
the same against a live server)."""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from sdpa_core import Diagnostics, attention
from service.metrics import LOGIT_BUCKETS, QK_CLIP_TAU, Metrics
from service.runtime.engine import Engine
from service.runtime.jobs import AttentionJob, prepare
from service.serving.health import (
    OTHER_TAG,
    TAG_IDLE_BEFORE_EVICTION_S,
    HealthMonitor,
    latest_heads,
)
from service.settings import Settings
from tests.service.test_health import FakeClock
from tests.support.app import in_process_client, small_settings

SINK_TOKENS = 2
N_Q = 3
UNIFORM = [0.0] * 6  # normalized entropy 1, sink 2/6, logit 0
ONE_HOT = [0.0, 0.0, 0.0, 60.0, 0.0, 0.0]  # entropy ~0, sink ~0, logit 60
SINK = [math.log(10.0), 0.0, 0.0, 0.0, 0.0, 0.0]  # p_0 = 10/15: sink (10 + 1)/15
BIG = [120.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # above QK-Clip's tau, all on the sink
GAUGES = {
    "entropy": "sdpa_attention_head_entropy_normalized",
    "sink": "sdpa_attention_head_sink_share",
    "logit": "sdpa_attention_head_logit_abs_max",
}


def by_hand(scores: Sequence[float]) -> dict[str, float]:
    """One head's statistics for row scores `scores` (every row alike), from the formulas."""
    e = [math.exp(s - max(scores)) for s in scores]
    p = [x / sum(e) for x in e]
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    return {
        "entropy": entropy / math.log(len(p)),
        "sink": sum(p[:SINK_TOKENS]),
        "logit": max(abs(s) for s in scores),
    }


def tensors(sequences: Sequence[Sequence[Sequence[float]]]) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, H, N_Q | n_kv, 2] whose head h of sequence b has row scores
    sequences[b][h]."""
    scores = torch.tensor(sequences, dtype=torch.float64)  # [B, H, n_kv]
    q = torch.zeros(*scores.shape[:2], N_Q, 2, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(*scores.shape, 2, dtype=torch.float64)
    k[..., 0] = scores
    return q, k, k.clone()


def diagnose(
    sequences: Sequence[Sequence[Sequence[float]]], *, key_lengths: list[list[int]] | None = None
) -> Diagnostics:
    q, k, v = tensors(sequences)
    lengths = None if key_lengths is None else torch.tensor(key_lengths)
    result = attention(
        q, k, v, scale=1.0, key_lengths=lengths, diagnostics="summary", sink_tokens=SINK_TOKENS
    )
    assert result.diagnostics is not None
    return result.diagnostics


def monitor(
    metrics: Metrics, *, max_heads: int = 64, max_tags: int = 64, clock: FakeClock | None = None
) -> HealthMonitor:
    return HealthMonitor(
        metrics=metrics,
        diagnose=Engine(torch.device("cpu"), sink_tokens=SINK_TOKENS).diagnose,
        sample_rate=1.0,
        max_tags=max_tags,
        max_heads=max_heads,
        rng=random.Random(0),
        clock=clock if clock is not None else FakeClock(),
    )


def heads_of(metrics: Metrics, tag: str) -> dict[str, dict[str, float]]:
    """gauge key -> {head label: value} of the tag's per-head series."""
    out: dict[str, dict[str, float]] = {key: {} for key in GAUGES}
    for key, name in GAUGES.items():
        for family in metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and sample.labels["tag"] == tag:
                    out[key][sample.labels["head"]] = sample.value
    return out


def test_the_gauges_hold_each_heads_statistics_pooled_over_the_sequences_by_hand() -> None:
    """Two sequences of three heads: entropy and sink are the means over the sequences, the
    logit the max; a (sequence, head) that sees no key counts in neither."""
    metrics = Metrics()
    health = monitor(metrics)
    sequences = [[UNIFORM, ONE_HOT, SINK], [SINK, UNIFORM, BIG]]
    # Head 2 of sequence 1 sees no key: head 2 is sequence 0's alone.
    diagnostics = diagnose(sequences, key_lengths=[[6, 6, 6], [6, 6, 0]])
    health.observe(diagnostics, n_q=N_Q, tag="minilm/layer0", source="requested")

    u, o, s = by_hand(UNIFORM), by_hand(ONE_HOT), by_hand(SINK)
    mean = {key: [(u[key] + s[key]) / 2, (o[key] + u[key]) / 2, s[key]] for key in u}
    mean["logit"] = [math.log(10.0), 60.0, math.log(10.0)]  # max over the sequences
    want = {key: dict(zip("012", values, strict=True)) for key, values in mean.items()}
    got = heads_of(metrics, "minilm/layer0")
    for key, values in want.items():
        assert got[key].keys() == values.keys(), key
        for head, value in values.items():
            assert got[key][head] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, head)
    # The histograms still see one observation per (sequence, head) with attention: 5.
    count = metrics.registry.get_sample_value(
        "sdpa_attention_entropy_normalized_count", {"tag": "minilm/layer0", "tenant": "anonymous"}
    )
    assert count == 5


def test_the_latest_request_wins_and_a_head_that_saw_nothing_keeps_its_values() -> None:
    metrics = Metrics()
    health = monitor(metrics)
    health.observe(diagnose([[UNIFORM, SINK]]), n_q=N_Q, tag="m/layer1", source="requested")
    later = diagnose([[ONE_HOT, BIG]], key_lengths=[[6, 0]])  # head 1 sees no key
    health.observe(later, n_q=N_Q, tag="m/layer1", source="sampled")
    got = heads_of(metrics, "m/layer1")
    assert got["entropy"]["0"] == pytest.approx(by_hand(ONE_HOT)["entropy"], abs=1e-12)
    assert got["logit"] == {"0": 60.0, "1": pytest.approx(math.log(10.0))}  # head 1: the first
    assert got["sink"]["1"] == pytest.approx(by_hand(SINK)["sink"])


def test_pooling_weighs_each_sequence_by_the_rows_that_see_a_key() -> None:
    """latest_heads over [S, H]: the mean over all of a head's rows, the max of its logits
    where it saw a key, nothing for a head that saw none."""
    rows = np.array([[3, 0, 1], [1, 0, 0]])
    entropy = np.array([[0.2, 0.5, 0.9], [0.6, 0.5, 0.1]])
    sink = np.array([[1.0, 0.0, 0.4], [0.0, 0.0, 0.8]])
    logit = np.array([[2.0, 7.0, 5.0], [9.0, 8.0, 50.0]])
    heads = latest_heads(rows, entropy=entropy, sink=sink, logit=logit)
    assert heads.seen.tolist() == [True, False, True]
    assert heads.entropy[0] == pytest.approx((3 * 0.2 + 1 * 0.6) / 4)
    assert heads.sink[0] == pytest.approx(3 / 4)
    assert heads.entropy[2] == pytest.approx(0.9)  # sequence 1's head 2 saw nothing
    assert heads.logit[[0, 2]].tolist() == [9.0, 5.0]


def test_heads_past_max_heads_have_no_series_and_0_turns_them_off() -> None:
    metrics = Metrics()
    monitor(metrics, max_heads=2).observe(
        diagnose([[UNIFORM, SINK, ONE_HOT]]), n_q=N_Q, tag="t", source="requested"
    )
    got = heads_of(metrics, "t")
    assert all(set(values) == {"0", "1"} for values in got.values()), got
    # The histograms keep every head.
    count = metrics.registry.get_sample_value(
        "sdpa_attention_sink_share_count", {"tag": "t", "tenant": "anonymous"}
    )
    assert count == 3

    metrics = Metrics()
    monitor(metrics, max_heads=0).observe(
        diagnose([[UNIFORM]]), n_q=N_Q, tag="t", source="requested"
    )
    assert heads_of(metrics, "t") == {key: {} for key in GAUGES}


def test_many_heads_export_only_the_bound() -> None:
    """A request of 100,000 heads (a 3-D input read as [H, N, D]) sets 3 x max_heads series."""
    metrics = Metrics()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(100_000, 2, 4, generator=gen)
    diagnostics = attention(q, q, q, diagnostics="summary").diagnostics
    assert diagnostics is not None
    monitor(metrics, max_heads=64).observe(diagnostics, n_q=2, tag="wide", source="requested")
    got = heads_of(metrics, "wide")
    assert all(set(values) == {str(h) for h in range(64)} for values in got.values())


def test_a_single_head_input_is_head_0() -> None:
    """A 2-D q is one head of one sequence: per_head is 0-d."""
    metrics = Metrics()
    q, k, v = (t[0, 0] for t in tensors([[SINK]]))
    diagnostics = attention(q, k, v, scale=1.0, diagnostics="summary", sink_tokens=SINK_TOKENS)
    assert diagnostics.diagnostics is not None
    monitor(metrics).observe(diagnostics.diagnostics, n_q=N_Q, tag="one", source="requested")
    assert heads_of(metrics, "one")["sink"] == {"0": pytest.approx(by_hand(SINK)["sink"])}


def test_eviction_removes_the_tags_head_series() -> None:
    metrics, clock = Metrics(), FakeClock()
    health = monitor(metrics, max_tags=1, clock=clock)
    health.observe(
        diagnose([[UNIFORM, SINK]]), n_q=N_Q, tag=health.label("old/layer0"), source="requested"
    )
    assert set(heads_of(metrics, "old/layer0")["entropy"]) == {"0", "1"}
    assert health.label("new/layer0") == OTHER_TAG  # "old/layer0" is in use
    clock.now += TAG_IDLE_BEFORE_EVICTION_S
    tag = health.label("new/layer0")
    assert tag == "new/layer0"
    assert heads_of(metrics, "old/layer0") == {key: {} for key in GAUGES}
    health.observe(diagnose([[ONE_HOT]]), n_q=N_Q, tag=tag, source="requested")
    assert heads_of(metrics, "new/layer0")["logit"] == {"0": 60.0}


def test_a_sample_sets_the_gauges_and_one_that_lost_its_slot_leaves_none() -> None:
    metrics, clock = Metrics(), FakeClock()
    health = monitor(metrics, max_tags=1, clock=clock)
    q, k, v = tensors([[SINK, UNIFORM]])
    prepared = prepare(AttentionJob(q=q, k=k, v=v, scale=1.0))
    assert health.offer(prepared, tag=health.label("s/layer0"), seconds=0.001)
    run = health.next_sample()
    assert run is not None
    run()
    assert heads_of(metrics, "s/layer0")["sink"] == {
        "0": pytest.approx(by_hand(SINK)["sink"]),
        "1": pytest.approx(by_hand(UNIFORM)["sink"]),
    }
    # Queued, then its tag evicted before it ran: "other" gets its values, the tag none.
    assert health.offer(prepared, tag=health.label("s/layer0"), seconds=0.001)
    clock.now += TAG_IDLE_BEFORE_EVICTION_S
    assert health.label("taker") == "taker"
    run = health.next_sample()
    assert run is not None
    run()
    assert heads_of(metrics, "s/layer0") == {key: {} for key in GAUGES}
    assert set(heads_of(metrics, OTHER_TAG)["sink"]) == {"0", "1"}


def test_the_settings_size_the_health_series_for_models() -> None:
    """256 tags: one per layer of 8 models of 32 layers. max_heads: the app's default is the
    monitor's own."""
    defaults = Settings.model_fields
    assert defaults["health_max_tags"].default == 256
    assert defaults["health_max_heads"].default == 64
    signature = inspect.signature(HealthMonitor)
    assert signature.parameters["max_heads"].default == defaults["health_max_heads"].default
    assert Settings(health_max_heads=0).health_max_heads == 0


def test_the_logit_buckets_hold_qk_clips_threshold() -> None:
    assert QK_CLIP_TAU == 100.0
    assert QK_CLIP_TAU in LOGIT_BUCKETS
    assert list(LOGIT_BUCKETS) == sorted(set(LOGIT_BUCKETS))
    assert {2.0**e for e in range(-2, 15)} < set(LOGIT_BUCKETS)


def test_a_tag_costs_128_series_plus_3_per_head() -> None:
    """The estimate beside SDPA_HEALTH_MAX_TAGS (settings.py): five histograms (buckets, sum,
    count, _created), three counters (with _created), and 3 gauges per head exported."""
    from prometheus_client import generate_latest

    metrics = Metrics()
    health = monitor(metrics)
    diagnostics = diagnose([[UNIFORM] * 12])  # 12 heads, as all-MiniLM-L6-v2's layers
    health.observe(diagnostics, n_q=N_Q, tag="t", source="requested")
    health.observe(diagnostics, n_q=N_Q, tag="t", source="sampled")
    text = generate_latest(metrics.registry).decode()
    series = [line for line in text.splitlines() if 'tag="t"' in line and line[0] != "#"]
    assert len(series) == 128 + 3 * 12


def test_the_app_passes_sdpa_health_max_heads_to_its_monitor() -> None:
    """SDPA_HEALTH_MAX_HEADS reaches the running app: with 2, a request of 4 heads exports heads
    0 and 1 alone on /metrics."""
    body = {
        "q": np.ones((4, 3, 2), dtype=np.float32).tolist(),
        "k": np.ones((4, 5, 2), dtype=np.float32).tolist(),
        "v": np.ones((4, 5, 2), dtype=np.float32).tolist(),
        "diagnostics": "summary",
        "tag": "m/layer0",
    }
    settings = small_settings(health_max_heads=2, health_sample_rate=0.0)
    with in_process_client(settings) as client:
        assert client.post("/v1/attention", json=body).status_code == 200
        text = client.get("/metrics").text
    heads = {
        line.split('head="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("sdpa_attention_head_entropy_normalized{") and 'tag="m/layer0"' in line
    }
    assert heads == {"0", "1"}
