"""Prometheus collectors, one registry per app so that apps made in tests never collide.

Because the registry is the app's own (not prometheus_client's global REGISTRY), the process,
GC and platform collectors that the global registry carries by default are registered here
explicitly: without them /metrics would lack the process's RSS, CPU, descriptors and GC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

# Latency buckets from 0.5 ms to 30 s: small payloads answer in about a millisecond, while a
# request with weights at the element limit can take seconds.
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

# Statistics in [0, 1]: buckets 0.05 apart, 0 included (a head with no saturated row, or no
# weight on its sink, lands exactly in le="0.0").
UNIT_BUCKETS: Final = tuple(round(i * 0.05, 2) for i in range(21))
# QK-Clip's threshold on a head's max logit (Kimi K2, MuonClip, arXiv 2507.20534): the cap tau
# = 100 its training enforced per head; runs without it saw values above 1000.
QK_CLIP_TAU: Final = 100.0
# max |scaled score|: log-spaced, powers of 2 from 1/4 to 16384, plus QK_CLIP_TAU so that the
# share of heads above it is exact (SdpaAttentionLogitQkClip). Healthy heads sit around 1-10;
# ViT-22B's and Wortsman et al.'s logit growth runs to the thousands before divergence.
LOGIT_BUCKETS: Final = tuple(sorted((*(2.0**e for e in range(-2, 15)), QK_CLIP_TAU)))

HEALTH_SOURCES: Final = ("requested", "sampled", "reported")
# A /metrics rendering starts at least this many times its predecessor's duration after that
# one ended: rendering takes at most 1/(1 + RENDER_GAP) of one thread's time (the GIL's, while
# it runs), however many clients scrape. At full cardinality (256 tags x 64 heads, about
# 0.7 s a rendering) that is one rendering every 3.5 s; a small registry's few ms, every ~10 ms.
RENDER_GAP: Final = 4.0


class Renderings:
    """GET /metrics's text, rendered off the event loop, one rendering at a time, shared.

    A scrape gets a rendering that starts after it arrived (never an older text: a scrape after
    a request sees that request counted), and every scrape that arrives before that rendering
    starts shares it: eight concurrent scrapers cost one rendering, not eight. Renderings are
    spaced by RENDER_GAP times the last one's duration, so scrapers in a loop cannot keep a
    thread rendering, holding the GIL, all the time. A scrape that leaves does not cancel the
    rendering others wait for.
    """

    def __init__(
        self,
        render: Callable[[], bytes],
        *,
        gap: float = RENDER_GAP,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_render: Callable[[float], None] | None = None,
    ) -> None:
        self._render = render
        self._sleep = sleep
        self._gap = gap
        self._clock = clock
        self._on_render = on_render
        self._next: asyncio.Future[bytes] | None = None  # not started yet: new scrapes join it
        self._last: asyncio.Task[None] | None = None  # the latest rendering's task
        self._free_at = 0.0  # when the next rendering may start
        self.count = 0  # renderings done

    async def latest(self) -> bytes:
        """A rendering that starts after this call (shared with the scrapes that join it)."""
        loop = asyncio.get_running_loop()
        waiting = self._next
        if waiting is None or waiting.done() or waiting.get_loop() is not loop:
            waiting = self._next = loop.create_future()
            previous = (
                self._last if self._last is not None and self._last.get_loop() is loop else None
            )
            self._last = loop.create_task(self._run(waiting, previous))
        return await asyncio.shield(waiting)

    async def _run(
        self, result: asyncio.Future[bytes], previous: asyncio.Task[None] | None
    ) -> None:
        try:
            if previous is not None:
                await asyncio.wait([previous])
            delay = self._free_at - self._clock()
            if delay > 0:
                await self._sleep(delay)
            if self._next is result:
                self._next = None  # started: scrapes from now on wait for the next one
            started = self._clock()
            text = await asyncio.to_thread(self._render)
            ended = self._clock()
            self._free_at = ended + self._gap * (ended - started)
            self.count += 1
            if self._on_render is not None:
                self._on_render(ended - started)
        except BaseException as exc:  # the scrapes waiting get it (a bug of ours: their 500)
            if self._next is result:
                self._next = None
            if not result.done():
                result.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        result.set_result(text)


class Metrics:
    """The service's Prometheus collectors (sdpa_*), registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.metrics_render_seconds = Histogram(
            "sdpa_metrics_render_seconds",
            "Time one rendering of /metrics took (off the event loop; concurrent scrapes share "
            "one, spaced RENDER_GAP times its duration apart).",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.renderings = Renderings(
            lambda: generate_latest(self.registry), on_render=self.metrics_render_seconds.observe
        )
        # process_* (RSS, CPU seconds, open descriptors, start time), python_gc_*, python_info.
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)  # registers nothing off CPython
        self.requests_total = Counter(
            "sdpa_requests_total",
            "HTTP requests answered, by the tenant (API key name) they came as.",
            ["route", "status", "tenant"],
            registry=reg,
        )
        self.request_duration_seconds = Histogram(
            "sdpa_request_duration_seconds",
            "HTTP request latency, from the first byte read to the response.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.requests_in_flight = Gauge(
            "sdpa_requests_in_flight",
            "Compute requests (attention, analyze) being read, queued, computed or encoded.",
            registry=reg,
        )
        self.queue_depth = Gauge(
            "sdpa_queue_depth", "Requests waiting in the batcher's queue.", registry=reg
        )
        self.backlog_seconds = Gauge(
            "sdpa_backlog_seconds",
            "Estimated seconds to work off the queue and the batch on the device: the cost "
            "model's estimate over the measured throughput (what Retry-After says).",
            registry=reg,
        )
        self.tenant_backlog_seconds = Gauge(
            "sdpa_tenant_backlog_seconds",
            "Estimated seconds to work off one tenant's queued and running work at its fair "
            "share of the device now (what its 429's Retry-After says).",
            ["tenant"],
            registry=reg,
        )
        self.queue_wait_seconds = Histogram(
            "sdpa_queue_wait_seconds",
            "Time a request waited in the queue before its batch started.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.batch_size = Histogram(
            "sdpa_batch_size", "Requests per device batch.", buckets=_BATCH_BUCKETS, registry=reg
        )
        self.compute_seconds = Histogram(
            "sdpa_compute_seconds",
            "Device time of one batch (or one tile of a long request), by the sdpa_core path "
            "that ran and the backend torch's "
            "SDPA chose on the fused path (none elsewhere).",
            ["path", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.abandoned_total = Counter(
            "sdpa_abandoned_total",
            "Long requests dropped while they ran, at a tile boundary, by reason "
            "(deadline, disconnected): no further tile of theirs is computed.",
            ["reason"],
            registry=reg,
        )
        self.broken_admissions_total = Counter(
            "sdpa_broken_admissions_total",
            "Requests admitted that then ended 504 (their deadline passed while queued or "
            "while they ran), by tenant: promises the runtime broke.",
            ["tenant"],
            registry=reg,
        )
        self.reads_paused_total = Counter(
            "sdpa_connection_reads_paused_total",
            "Times the server stopped reading a connection because SDPA_MAX_PIPELINED_REQUESTS "
            "of its requests waited unanswered (backpressure: reading resumes as they are "
            "answered and read).",
            registry=reg,
        )
        self.rejected_total = Counter(
            "sdpa_rejected_total",
            "Requests refused or dropped before compute, by reason: queue_full, "
            "deadline_unreachable (a long request that would miss its deadline beside those "
            "admitted), deadline, disconnected, shutting_down, too_large, inflight_bytes, "
            "unauthorized; below the application: header_too_large (431), header_timeout "
            "(408), read_timeout, body_too_slow (the minimum body rate), chunk_framing (400: a "
            "chunk-size line too long, or chunks too small on average), connections (the "
            "connection cap).",
            ["reason"],
            registry=reg,
        )

        # -- attention health (service.serving.health) ----------------------------------------
        # Each histogram is observed once per (sequence, head) of a request that computed
        # diagnostics, with the rows of that head that see at least one key.
        self.attention_entropy_normalized = Histogram(
            "sdpa_attention_entropy_normalized",
            "Mean normalized row entropy (H / log visible keys) of one head; near 0 = collapse.",
            ["tag", "tenant"],
            buckets=UNIT_BUCKETS,
            registry=reg,
        )
        self.attention_max_weight = Histogram(
            "sdpa_attention_max_weight",
            "Mean of the rows' largest weight, per head.",
            ["tag", "tenant"],
            buckets=UNIT_BUCKETS,
            registry=reg,
        )
        self.attention_saturated_fraction = Histogram(
            "sdpa_attention_saturated_fraction",
            "Share of a head's rows whose max weight is >= 0.99.",
            ["tag", "tenant"],
            buckets=UNIT_BUCKETS,
            registry=reg,
        )
        self.attention_sink_share = Histogram(
            "sdpa_attention_sink_share",
            "Mean share of a row's attention on its first SDPA_HEALTH_SINK_TOKENS keys, per head.",
            ["tag", "tenant"],
            buckets=UNIT_BUCKETS,
            registry=reg,
        )
        self.attention_logit_abs_max = Histogram(
            "sdpa_attention_logit_abs_max",
            "Largest |scaled score| (q.k times the scale) of a head.",
            ["tag", "tenant"],
            buckets=LOGIT_BUCKETS,
            registry=reg,
        )
        # Per head: the latest request of a tag that computed diagnostics, one series per head
        # index below SDPA_HEALTH_MAX_HEADS (a layer x head heatmap of a model the tap sends,
        # one tag per layer). Over the request's sequences: entropy and sink share are the
        # means over the head's rows that see a key, the logit the max.
        self.attention_head_entropy_normalized = Gauge(
            "sdpa_attention_head_entropy_normalized",
            "Mean normalized row entropy (H / log visible keys) of each head, in the tag's "
            "latest request.",
            ["tag", "tenant", "head"],
            registry=reg,
        )
        self.attention_head_sink_share = Gauge(
            "sdpa_attention_head_sink_share",
            "Mean share of a row's attention on its first SDPA_HEALTH_SINK_TOKENS keys, of each "
            "head, in the tag's latest request.",
            ["tag", "tenant", "head"],
            registry=reg,
        )
        self.attention_head_logit_abs_max = Gauge(
            "sdpa_attention_head_logit_abs_max",
            "Largest |scaled score| of each head, in the tag's latest request.",
            ["tag", "tenant", "head"],
            registry=reg,
        )
        self.attention_masked_rows_total = Counter(
            "sdpa_attention_masked_rows_total",
            "Query rows that saw no key (output 0), in requests that computed diagnostics.",
            ["tag", "tenant"],
            registry=reg,
        )
        self.nonfinite_inputs_total = Counter(
            "sdpa_nonfinite_inputs_total",
            "Requests refused because an input held NaN or Inf.",
            ["tenant"],
            registry=reg,
        )
        self.health_observations_total = Counter(
            "sdpa_health_observations_total",
            "Requests whose diagnostics fed the health histograms, by source "
            "(requested: the client asked for diagnostics; sampled: SDPA_HEALTH_SAMPLE_RATE; "
            "reported: statistics computed elsewhere, POST /v1/health/observe).",
            ["tag", "tenant", "source"],
            registry=reg,
        )
        self.health_tags_evicted_total = Counter(
            "sdpa_health_tags_evicted_total",
            "Request tags whose health series were removed to give their slot to a new tag "
            "(SDPA_HEALTH_MAX_TAGS slots; only a tag idle for a while can lose its slot).",
            registry=reg,
        )
        self.health_samples_dropped_total = Counter(
            "sdpa_health_samples_dropped_total",
            "Sampled requests whose health summary was not computed: the bounded queue of "
            "samples was full, or the service was draining.",
            registry=reg,
        )

    def forget_tag(self, tag: str, *, tenant: str, heads: int) -> None:
        """Remove every health series of `tenant` labelled `tag` (its slot goes to another
        tag), the per-head ones of head indices below `heads` included."""
        for collector in (
            self.attention_entropy_normalized,
            self.attention_max_weight,
            self.attention_saturated_fraction,
            self.attention_sink_share,
            self.attention_logit_abs_max,
            self.attention_masked_rows_total,
        ):
            collector.remove(tag, tenant)  # a no-op for a series never observed
        for source in HEALTH_SOURCES:
            self.health_observations_total.remove(tag, tenant, source)
        for gauge in self.head_gauges():
            for head in range(heads):
                gauge.remove(tag, tenant, str(head))

    def head_gauges(self) -> tuple[Gauge, Gauge, Gauge]:
        """The per-head gauges {tag, tenant, head}: entropy (normalized), sink share, max logit."""
        return (
            self.attention_head_entropy_normalized,
            self.attention_head_sink_share,
            self.attention_head_logit_abs_max,
        )

    def track_device_memory(self, read_bytes: Callable[[], float]) -> None:
        """Export sdpa_device_memory_allocated_bytes, read at each scrape (CUDA: the bytes of
        tensors torch holds on the device). Called once, by the app, when the device is CUDA."""
        gauge = Gauge(
            "sdpa_device_memory_allocated_bytes",
            "Device memory held by tensors (torch.cuda.memory_allocated), read at scrape time.",
            registry=self.registry,
        )
        gauge.set_function(read_bytes)
