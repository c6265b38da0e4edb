"""HealthMonitor and the batcher's idle work: tag cap, sampling rates, the bounded queue of
samples, and samples that run only while nothing is queued. Real Metrics (read back through
the registry), real prepared jobs, a real CPU engine computing the sampled summaries."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Sequence

import pytest
import torch

from sdpa_core import attention
from service.metrics import Metrics
from service.runtime.batcher import BatcherConfig, BatcherPolicy, DynamicBatcher
from service.runtime.engine import Engine
from service.runtime.jobs import AttentionJob, PreparedJob, prepare
from service.serving.health import (
    MAX_PENDING_SAMPLE_BYTES,
    MAX_PENDING_SAMPLE_S,
    MAX_PENDING_SAMPLES,
    OTHER_TAG,
    TAG_IDLE_BEFORE_EVICTION_S,
    HealthMonitor,
)


def job(seed: int = 0, *, n: int = 8) -> PreparedJob:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    return prepare(AttentionJob(q=q, k=k, v=v))


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    if "tag" in labels:  # health series carry the tenant: "anonymous" without keys
        labels.setdefault("tenant", "anonymous")
    return metrics.registry.get_sample_value(name, labels) or 0.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def monitor(
    metrics: Metrics, *, rate: float = 1.0, max_tags: int = 64, clock: FakeClock | None = None
) -> HealthMonitor:
    engine = Engine(torch.device("cpu"), sink_tokens=3)
    return HealthMonitor(
        metrics=metrics,
        diagnose=engine.diagnose,
        sample_rate=rate,
        max_tags=max_tags,
        rng=random.Random(0),
        clock=clock if clock is not None else FakeClock(),
    )


def test_tags_past_the_cap_are_other_and_known_tags_keep_their_label() -> None:
    health = monitor(Metrics(), max_tags=2)
    assert health.label(None) == "default"
    assert health.label("a") == "a"
    assert health.label("b") == OTHER_TAG  # "default" and "a" fill the two places
    assert health.label("a") == "a"
    assert health.label(None) == "default"


def _observe_requested(metrics: Metrics, health: HealthMonitor, tag: str) -> str:
    prepared = job(1)
    j = prepared.job
    assert isinstance(j, AttentionJob)
    diagnostics = attention(j.q, j.k, j.v, diagnostics="summary").diagnostics
    label = health.label(tag)
    health.observe(diagnostics, n_q=prepared.spec.n_q, tag=label, source="requested")
    return label


def test_a_tag_idle_long_enough_gives_its_slot_to_a_new_one_and_its_series_go() -> None:
    metrics, clock = Metrics(), FakeClock()
    health = monitor(metrics, max_tags=2, clock=clock)
    assert _observe_requested(metrics, health, "old") == "old"
    clock.now += 1.0
    assert _observe_requested(metrics, health, "busy") == "busy"
    # Both slots held and neither tag idle long enough: a newcomer is "other".
    clock.now += TAG_IDLE_BEFORE_EVICTION_S - 1.5
    assert _observe_requested(metrics, health, "new") == OTHER_TAG
    assert health.label("busy") == "busy"  # in use: its idle time starts again
    clock.now += 1.0  # "old" is now idle for exactly the threshold, "busy" for 1 s
    assert _observe_requested(metrics, health, "new") == "new"
    assert sample(metrics, "sdpa_health_tags_evicted_total") == 1
    for name in ("sdpa_attention_entropy_normalized_count", "sdpa_attention_masked_rows_total"):
        assert (
            metrics.registry.get_sample_value(name, {"tag": "old", "tenant": "anonymous"}) is None
        )
    assert sample(metrics, "sdpa_attention_entropy_normalized_count", tag="new") == 2  # 2 heads
    assert (
        metrics.registry.get_sample_value(
            "sdpa_health_observations_total",
            {"tag": "old", "tenant": "anonymous", "source": "requested"},
        )
        is None
    )
    assert sample(metrics, "sdpa_health_observations_total", tag="busy", source="requested") == 1
    # A stream of new tags cannot take the slots of tags in use.
    for i in range(50):
        clock.now += 1.0
        health.label("busy")
        health.label("new")
        assert health.label(f"squatter{i}") == OTHER_TAG
    assert sample(metrics, "sdpa_health_tags_evicted_total") == 1


def test_a_sample_whose_tag_lost_its_slot_while_it_waited_is_counted_as_other() -> None:
    metrics, clock = Metrics(), FakeClock()
    health = monitor(metrics, max_tags=1, clock=clock)
    assert health.offer(job(2), tag=health.label("gone"), seconds=0.001)
    clock.now += TAG_IDLE_BEFORE_EVICTION_S
    assert health.label("taker") == "taker"
    run = health.next_sample()
    assert run is not None
    run()
    assert sample(metrics, "sdpa_health_observations_total", tag=OTHER_TAG, source="sampled") == 1
    assert (
        metrics.registry.get_sample_value(
            "sdpa_attention_sink_share_count", {"tag": "gone", "tenant": "anonymous"}
        )
        is None
    )


@pytest.mark.parametrize(
    ("rate", "low", "high"), [(0.0, 0, 0), (1.0, 2000, 2000), (0.25, 420, 580)]
)
def test_sampling_rate(rate: float, low: int, high: int) -> None:
    health = monitor(Metrics(), rate=rate)
    hits = sum(health.should_sample() for _ in range(2000))
    assert low <= hits <= high  # 0.25: 500 expected, +-4.6 sigma


def test_a_sample_observes_what_a_requested_summary_would() -> None:
    """The sampled summary (engine.diagnose, sink_tokens 3) feeds the same histograms, with
    source=sampled, as the diagnostics the job would have got by asking."""
    metrics = Metrics()
    health = monitor(metrics)
    prepared = job(3)
    assert health.offer(prepared, tag=health.label("t"), seconds=0.001)
    run = health.next_sample()
    assert run is not None
    run()
    j = prepared.job
    assert isinstance(j, AttentionJob)
    asked = attention(j.q, j.k, j.v, diagnostics="summary", sink_tokens=3).diagnostics
    assert asked is not None
    assert sample(metrics, "sdpa_health_observations_total", tag="t", source="sampled") == 1
    assert sample(metrics, "sdpa_attention_sink_share_count", tag="t") == 2  # two heads
    want = float(asked.per_head.sink_share.sum())
    assert sample(metrics, "sdpa_attention_sink_share_sum", tag="t") == pytest.approx(want)
    assert health.next_sample() is None


def test_the_queue_of_samples_is_bounded_by_count_and_by_device_time() -> None:
    metrics = Metrics()
    health = monitor(metrics)
    for _ in range(MAX_PENDING_SAMPLES):
        assert health.offer(job(), tag="t", seconds=0.0)
    assert not health.offer(job(), tag="t", seconds=0.0)
    assert health.pending == MAX_PENDING_SAMPLES
    health.drop_pending()
    assert health.pending == 0
    assert sample(metrics, "sdpa_health_samples_dropped_total") == 1 + MAX_PENDING_SAMPLES

    assert not health.offer(job(), tag="t", seconds=MAX_PENDING_SAMPLE_S * 1.01)  # alone too big
    assert health.offer(job(), tag="t", seconds=MAX_PENDING_SAMPLE_S * 0.6)
    assert not health.offer(job(), tag="t", seconds=MAX_PENDING_SAMPLE_S * 0.6)
    run = health.next_sample()  # taken: its time no longer counts
    assert run is not None
    assert health.offer(job(), tag="t", seconds=MAX_PENDING_SAMPLE_S * 0.6)


def test_idle_work_runs_only_while_nothing_is_queued() -> None:
    """A batch held on the device with requests queued behind it: the idle work offered
    meanwhile runs after the queue has drained, never before a queued request."""
    order: list[str] = []
    gate = threading.Event()
    idle: list[str] = []

    def run_batch(items: Sequence[str]) -> list[str]:
        if "hold" in items:
            gate.wait(5.0)
        order.extend(items)
        return list(items)

    def idle_work() -> Callable[[], None] | None:
        if not idle:
            return None
        name = idle.pop()
        return lambda: order.append(name)

    async def scenario() -> None:
        batcher: DynamicBatcher[str, str] = DynamicBatcher(
            run_batch,
            BatcherPolicy(group_key=lambda item: item),
            BatcherConfig(max_batch_size=1, max_queue=16),
            idle_work=idle_work,
        )
        await batcher.start()
        held = asyncio.create_task(batcher.submit("hold", deadline=1e12))
        await asyncio.sleep(0.05)
        queued = [asyncio.create_task(batcher.submit(x, deadline=1e12)) for x in ("a", "b")]
        await asyncio.sleep(0.01)
        idle.append("sample")
        batcher.wake()
        await asyncio.sleep(0.05)
        assert order == []  # the device is held: nothing ran, the sample neither
        gate.set()
        await asyncio.gather(held, *queued)
        for _ in range(100):
            if "sample" in order:
                break
            await asyncio.sleep(0.01)
        await batcher.drain(5.0)

    asyncio.run(scenario())
    assert order == ["hold", "a", "b", "sample"]


def test_the_queue_of_samples_is_bounded_by_the_bytes_it_holds() -> None:
    """Queued samples keep their inputs alive: their bytes are bounded too."""
    health = monitor(Metrics())
    # q, k, v [1, 1, n, 1] float64 holding 40% of the bound together
    n = int(MAX_PENDING_SAMPLE_BYTES * 0.4) // (3 * 8)
    tensors = (torch.zeros(1, 1, n, 1, dtype=torch.float64) for _ in range(3))
    big = prepare(AttentionJob(*tensors))
    assert health.offer(big, tag="t", seconds=0.0)
    assert health.offer(big, tag="t", seconds=0.0)
    assert not health.offer(big, tag="t", seconds=0.0)  # 120% of the bound
    assert health.next_sample() is not None  # one ran: its bytes are free again
    assert health.offer(big, tag="t", seconds=0.0)


def test_device_memory_is_read_at_each_scrape() -> None:
    """What the app registers on CUDA (torch.cuda.memory_allocated), read when scraped."""
    metrics = Metrics()
    held = [1024.0]
    metrics.track_device_memory(lambda: held[0])
    assert sample(metrics, "sdpa_device_memory_allocated_bytes") == 1024.0
    held[0] = 4096.0
    assert sample(metrics, "sdpa_device_memory_allocated_bytes") == 4096.0


def test_observe_many_writes_what_observe_writes_one_by_one() -> None:
    """The bulk path must leave a histogram exactly as prometheus_client's own observe() does:
    values on bucket bounds, between them, beyond the last finite bound, negative, +inf and
    NaN (which observe() counts in no bucket)."""
    import numpy as np
    from prometheus_client import CollectorRegistry, Histogram

    from service.serving.health import observe_many

    bounds = [0.05 * i for i in range(21)]
    values = np.array([0.0, 0.05, 0.051, 0.5, 0.99, 1.0, 1.5, -0.2, np.inf, 0.7, 0.05], np.float32)

    def samples(histogram: Histogram) -> dict[str, float]:
        return {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for family in histogram.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        }

    one_by_one = Histogram("a", "a", ["tag"], buckets=bounds, registry=CollectorRegistry())
    for value in values.tolist():
        one_by_one.labels(tag="t").observe(value)
    bulk = Histogram("a", "a", ["tag"], buckets=bounds, registry=CollectorRegistry())
    observe_many(bulk.labels(tag="t"), np.append(values, np.nan))
    assert samples(bulk) == samples(one_by_one)
