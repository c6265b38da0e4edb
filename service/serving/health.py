"""Attention health: request diagnostics turned into Prometheus series, and sampling.

Two sources feed the health histograms (service.metrics, "attention health"):
- requested: a request that asked for diagnostics is observed from the diagnostics it gets;
- sampled: of the requests that did not ask, a share SDPA_HEALTH_SAMPLE_RATE is offered here
  after its answer is computed. Its summary is computed later, on the device thread, only
  while the batcher has nothing queued (DynamicBatcher's idle work), so it never sits on any
  request's critical path: at worst a request arriving during a sample waits for that one
  sample to finish, and samples are bounded so that this wait is too.

Bounds: at most MAX_PENDING_SAMPLES waiting, whose estimated device time (the cost model's
chunked-path seconds, the path a summary runs on) adds up to at most MAX_PENDING_SAMPLE_S and
whose input tensors (held until the sample runs, beyond the in-flight limit's reach) add up to
at most MAX_PENDING_SAMPLE_BYTES; a sample that does not fit is dropped and counted in
sdpa_health_samples_dropped_total.

Tenants: every health series carries the request's tenant (the API key's name, service.tenants)
beside its tag, so two tenants using the same tag ("model/layer0") write into series of their
own, and one tenant's key never reaches another's.

Tags: SDPA_HEALTH_MAX_TAGS slots, each a (tenant, tag) whose series are its own, so that a client
cannot grow the registry without bound. Each tenant has its share of them (tag_quota: the
tenants' weights, as the queue shares them; at least one), kept least recently used first: a
new tag takes a free slot of its tenant's, else the slot of that tenant's tag idle longest if
it was idle for at least TAG_IDLE_BEFORE_EVICTION_S (its series are removed and the eviction
counted in sdpa_health_tags_evicted_total), else it is counted as "other" (under its tenant).
So one tenant filling its share takes nothing of another's, the first tags a client sends no
longer hold their slots until a restart, and a client sending new tags in a stream can only take
slots of its own tags nobody used for that long: tags in use keep their series.

Reported: POST /v1/health/observe (service.api.observe) records statistics computed elsewhere
(the tap's local mode) through observe_reported, into the same series (source="reported").

Per head: besides the histograms (one observation per (sequence, head)), the gauges
sdpa_attention_head_*{tag, head} hold each head's statistics in the tag's latest request, for
a layer x head heatmap of a model whose every layer the tap sends under its own tag. Only
heads at an index below SDPA_HEALTH_MAX_HEADS have such series (a 32-head layer fits the
default of 64 twice over); a head that sees no key in a request keeps its previous values.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
from prometheus_client import Histogram

from sdpa_core import Diagnostics
from service.metrics import Metrics
from service.runtime.jobs import PreparedJob
from service.runtime.policy import CostModel, WorkShape
from service.tenants import ANONYMOUS
from service.wire.observe import Observation

logger = logging.getLogger("sdpa.health")

DEFAULT_TAG: Final = "default"
OTHER_TAG: Final = "other"
# Longer than any scrape interval (Prometheus' default is 1 min) by far, so a tag's last values
# were scraped before its series go, and long enough that a tag used every few minutes (a model
# sampled by the tap every n forwards) keeps its slot.
TAG_IDLE_BEFORE_EVICTION_S: Final = 600.0
MAX_PENDING_SAMPLES: Final = 16
# A sample runs only while the device is idle, but a request that arrives meanwhile waits for
# it: 50 ms of device time bounds that wait (and the queue holds at most that much in all).
MAX_PENDING_SAMPLE_S: Final = 0.05
MAX_PENDING_SAMPLE_BYTES: Final = 64 * 1024 * 1024

Source = Literal["requested", "sampled", "reported"]
# Computes a job's summary diagnostics on the device thread (service.runtime.engine).
Diagnose = Callable[[PreparedJob], Diagnostics]


@dataclass(frozen=True, slots=True)
class _Sample:
    prepared: PreparedJob
    tag: str
    tenant: str
    seconds: float
    nbytes: int


def observe_many(child: Histogram, values: npt.NDArray[Any]) -> None:
    """child.observe(v) for every v in `values`, in a handful of numpy operations.

    One request may carry a million heads (the element limit allows it): observed one by one
    on the event loop, their five histograms held it for seconds. This writes what observe()
    writes, bucket counts and the sum, by bucket: prometheus_client keeps a histogram child's
    per-bucket counts in `_buckets` (non-cumulative, value <= bound) and its sum in `_sum`
    (checked with prometheus_client 0.2x; tests/e2e/test_health_metrics.py pins the counts).
    """
    finite = values[~np.isnan(values)]  # observe() counts NaN in no bucket
    if not finite.size:
        return
    bounds = np.asarray(child._upper_bounds, dtype=np.float64)
    # The first bound >= value: the bucket observe() would count it in (the last is +Inf).
    counts = np.bincount(np.searchsorted(bounds, finite, side="left"), minlength=len(bounds))
    for bucket, count in zip(child._buckets, counts.tolist(), strict=True):
        if count:
            bucket.inc(count)
    child._sum.inc(float(finite.sum(dtype=np.float64)))


@dataclass(frozen=True, slots=True)
class LatestHeads:
    """One request's statistics per head index (each [H]), pooled over its sequences."""

    entropy: npt.NDArray[np.float64]  # mean normalized entropy over the head's rows seeing a key
    sink: npt.NDArray[np.float64]  # mean sink share over the same rows
    logit: npt.NDArray[np.float64]  # max |scaled score| over the sequences (-inf: none seen)
    seen: npt.NDArray[np.bool_]  # some row of the head, in some sequence, saw a key


def latest_heads(
    rows: npt.NDArray[Any],
    *,
    entropy: npt.NDArray[Any],
    sink: npt.NDArray[Any],
    logit: npt.NDArray[Any],
) -> LatestHeads:
    """Per head, over the sequences: each argument is [S, H], rows[s, h] the rows of head h in
    sequence s that see a key. A sequence's per-head means weigh by those rows, so that the
    result is the mean over all the head's rows in the request (the summary's definition, per
    head); with no masked rows, the plain mean over the sequences."""
    total = rows.sum(axis=0)  # [H]
    weights = rows / np.maximum(total, 1)  # [S, H]; 0 where a head saw nothing
    return LatestHeads(
        entropy=(entropy * weights).sum(axis=0, dtype=np.float64),
        sink=(sink * weights).sum(axis=0, dtype=np.float64),
        logit=np.where(rows > 0, logit, -np.inf).max(axis=0, initial=-np.inf).astype(np.float64),
        seen=total > 0,
    )


def tag_quotas(max_tags: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Each tenant's share of the `max_tags` slots, by weight (as the queue shares the device),
    at least one each."""
    total = sum(weights.values())
    if not weights or total <= 0:
        return {}
    return {name: max(1, math.floor(max_tags * w / total)) for name, w in weights.items()}


class HealthMonitor:
    """Observes diagnostics into the health metrics and keeps the bounded queue of samples.

    Everything but the sample's computation runs on the event loop (offer, next_sample); the
    computation and its observation run on the device thread (prometheus_client's collectors
    are thread-safe).
    """

    def __init__(
        self,
        *,
        metrics: Metrics,
        diagnose: Diagnose,
        sample_rate: float,
        max_tags: int,
        max_heads: int = 64,  # SDPA_HEALTH_MAX_HEADS's default (a test keeps them equal)
        tenant_weights: Mapping[str, float] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._diagnose = diagnose
        self._sample_rate = sample_rate
        self._max_tags = max_tags
        self._max_heads = max_heads
        # Each tenant's slots (a tenant not configured, as in tests, gets all of them).
        self._quotas = tag_quotas(max_tags, tenant_weights or {})
        # Per tenant, the tags holding a slot -> when each was last used, least recent first.
        self._tags: dict[str, collections.OrderedDict[str, float]] = {}
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._pending: collections.deque[_Sample] = collections.deque()
        self._pending_s = 0.0
        self._pending_bytes = 0
        # Set by the app to wake the batcher's idle worker when a sample arrives.
        self.on_offer: Callable[[], None] | None = None

    # -- tags --------------------------------------------------------------------------------

    def tag_quota(self, tenant: str) -> int:
        """How many tags of `tenant` have series of their own."""
        return self._quotas.get(tenant, self._max_tags)

    def label(self, tag: str | None, tenant: str = ANONYMOUS) -> str:
        """The metrics label of a request's tag: its own when it holds one of its tenant's
        slots or can take one (the module docstring), "other" otherwise (the wire model
        validated its characters)."""
        if tag is None:
            tag = DEFAULT_TAG
        now = self._clock()
        tags = self._tags.setdefault(tenant, collections.OrderedDict())
        if tag in tags:
            tags[tag] = now
            tags.move_to_end(tag)
            return tag
        if len(tags) >= self.tag_quota(tenant):
            idlest, last_used = next(iter(tags.items()))
            if now - last_used < TAG_IDLE_BEFORE_EVICTION_S:
                return OTHER_TAG
            del tags[idlest]
            self._metrics.forget_tag(idlest, tenant=tenant, heads=self._max_heads)
            self._metrics.health_tags_evicted_total.inc()
        tags[tag] = now
        return tag

    def _holds(self, tenant: str, tag: str) -> bool:
        return tag in self._tags.get(tenant, ())

    # -- observing ---------------------------------------------------------------------------

    def observe(
        self,
        diagnostics: Diagnostics,
        *,
        n_q: int,
        tag: str,
        source: Source,
        tenant: str = ANONYMOUS,
    ) -> None:
        """Feed one request's diagnostics to the health metrics: each histogram once per
        (sequence, head) that has a row seeing at least one key (a fully masked head has no
        attention to judge: its rows count in masked_rows only), and the per-head gauges with
        the request's statistics of each head below max_heads that saw a key."""
        per_head = diagnostics.per_head
        heads = per_head.masked_rows.shape[-1] if per_head.masked_rows.dim() else 1
        # Each statistic as [S, H] (S: the request's sequences, its leading dims flattened).
        rows = n_q - per_head.masked_rows.reshape(-1, heads).cpu().numpy()  # rows seeing a key
        entropy, max_weight, saturated, sink, logit = (
            t.reshape(-1, heads).cpu().numpy()
            for t in (
                per_head.normalized_entropy,
                per_head.max_weight,
                per_head.saturated_fraction,
                per_head.sink_share,
                per_head.score_abs_max_scaled,
            )
        )
        self._record(
            _Heads(rows, entropy, max_weight, saturated, sink, logit),
            masked_rows=float(diagnostics.summary.masked_rows),
            tag=tag,
            tenant=tenant,
            source=source,
        )

    def observe_reported(self, observation: Observation, *, tenant: str) -> str:
        """Record statistics computed elsewhere (POST /v1/health/observe, validated by
        service.wire.observe) as a computed request's (source="reported"); returns the label
        its tag got."""
        heads = observation.per_head
        entropy = heads.normalized_entropy
        if heads.masked_rows is not None and observation.n_q is not None:
            rows = observation.n_q - heads.masked_rows
            masked = float(heads.masked_rows.sum())
        else:
            rows, masked = np.ones_like(entropy), 0.0
        tag = self.label(observation.tag, tenant)
        self._record(
            _Heads(
                rows, entropy, heads.max_weight, heads.saturated_fraction, heads.sink_share,
                heads.score_abs_max_scaled,
            ),
            masked_rows=masked,
            tag=tag,
            tenant=tenant,
            source="reported",
        )  # fmt: skip
        return tag

    def _record(
        self, heads: _Heads, *, masked_rows: float, tag: str, tenant: str, source: Source
    ) -> None:
        m = self._metrics
        seen = heads.rows.reshape(-1) > 0  # (sequence, head) pairs with attention
        for histogram, values in (
            (m.attention_entropy_normalized, heads.entropy),
            (m.attention_max_weight, heads.max_weight),
            (m.attention_saturated_fraction, heads.saturated),
            (m.attention_sink_share, heads.sink),
            (m.attention_logit_abs_max, heads.logit),
        ):
            if values is not None:  # a report may leave the saturated fraction out
                observe_many(histogram.labels(tag=tag, tenant=tenant), values.reshape(-1)[seen])
        exported = slice(0, self._max_heads)  # the heads with series of their own
        pooled = latest_heads(
            heads.rows[:, exported],
            entropy=heads.entropy[:, exported],
            sink=heads.sink[:, exported],
            logit=heads.logit[:, exported],
        )
        self._set_heads(tag, tenant, pooled)
        m.attention_masked_rows_total.labels(tag=tag, tenant=tenant).inc(masked_rows)
        m.health_observations_total.labels(tag=tag, tenant=tenant, source=source).inc()

    def _set_heads(self, tag: str, tenant: str, heads: LatestHeads) -> None:
        """The per-head gauges of `tag`: one label lookup and set per gauge and head seen."""
        gauges = self._metrics.head_gauges()
        entropy, sink, logit = (a.tolist() for a in (heads.entropy, heads.sink, heads.logit))
        for head in np.flatnonzero(heads.seen).tolist():
            label = str(head)
            for gauge, value in zip(gauges, (entropy[head], sink[head], logit[head]), strict=True):
                gauge.labels(tag, tenant, label).set(value)

    def count_nonfinite(self, tenant: str) -> None:
        """A request of `tenant` was refused for NaN/Inf in an input."""
        self._metrics.nonfinite_inputs_total.labels(tenant=tenant).inc()

    def after_answer(
        self,
        prepared: PreparedJob,
        *,
        tag: str | None,
        diagnostics: Diagnostics | None,
        cost: CostModel,
        tenant: str = ANONYMOUS,
    ) -> None:
        """Once a request's answer is ready: observe the diagnostics it asked for, or else
        (sampled at the configured rate) queue its summary for an idle device, its device
        time estimated by the cost model on the chunked path that computes it."""
        spec = prepared.spec
        if diagnostics is not None:
            label = self.label(tag, tenant)
            self.observe(diagnostics, n_q=spec.n_q, tag=label, source="requested", tenant=tenant)
        elif self.should_sample():
            shape = WorkShape(spec.batch, spec.heads, spec.n_q, spec.n_kv, spec.d, spec.d_v)
            seconds = cost.seconds(shape, "chunked")
            self.offer(prepared, tag=self.label(tag, tenant), seconds=seconds, tenant=tenant)

    # -- sampling ----------------------------------------------------------------------------

    def should_sample(self) -> bool:
        """Whether a request that did not ask for diagnostics is sampled (rate 1: always;
        0: never)."""
        rate = self._sample_rate
        return rate >= 1.0 or (rate > 0.0 and self._rng.random() < rate)

    def offer(
        self, prepared: PreparedJob, *, tag: str, seconds: float, tenant: str = ANONYMOUS
    ) -> bool:
        """Queue a sampled job whose summary costs an estimated `seconds` of device time;
        False (and counted as dropped) when it does not fit the bounds."""
        nbytes = _input_bytes(prepared)
        if (
            len(self._pending) >= MAX_PENDING_SAMPLES
            or self._pending_s + seconds > MAX_PENDING_SAMPLE_S
            or self._pending_bytes + nbytes > MAX_PENDING_SAMPLE_BYTES
        ):
            self._metrics.health_samples_dropped_total.inc()
            return False
        sample = _Sample(prepared=prepared, tag=tag, tenant=tenant, seconds=seconds, nbytes=nbytes)
        self._pending.append(sample)
        self._pending_s += seconds
        self._pending_bytes += nbytes
        if self.on_offer is not None:
            self.on_offer()
        return True

    @property
    def pending(self) -> int:
        """Samples waiting for an idle device."""
        return len(self._pending)

    def next_sample(self) -> Callable[[], None] | None:
        """The batcher's idle work: the oldest sample as a call for the device thread, or None."""
        if not self._pending:
            return None
        sample = self._pending.popleft()
        self._pending_s = max(0.0, self._pending_s - sample.seconds)
        self._pending_bytes -= sample.nbytes
        return lambda: self._run(sample)

    def drop_pending(self) -> None:
        """Forget every waiting sample (the service is draining), counting them as dropped."""
        if self._pending:
            self._metrics.health_samples_dropped_total.inc(len(self._pending))
        self._pending.clear()
        self._pending_s = 0.0
        self._pending_bytes = 0

    def _run(self, sample: _Sample) -> None:
        """On the device thread: the sample's summary, then its observation."""
        try:
            diagnostics = self._diagnose(sample.prepared)
        except Exception:
            # The request itself was answered; its sample must not take the worker down.
            logger.exception("health sample failed")
            return
        # The tag may have lost its slot while the sample waited: its series must not return.
        tenant = sample.tenant
        tag = sample.tag if self._holds(tenant, sample.tag) else OTHER_TAG
        n_q = sample.prepared.spec.n_q
        self.observe(diagnostics, n_q=n_q, tag=tag, source="sampled", tenant=tenant)
        if tag != OTHER_TAG and not self._holds(tenant, tag):
            # Evicted (on the event loop) while this thread observed: what it wrote after the
            # eviction's removal would stay for good, with no slot left to remove it.
            self._metrics.forget_tag(tag, tenant=tenant, heads=self._max_heads)


@dataclass(frozen=True, slots=True)
class _Heads:
    """One observation's per-head statistics, each [S, H]; rows: the rows seeing a key."""

    rows: npt.NDArray[Any]
    entropy: npt.NDArray[Any]  # normalized
    max_weight: npt.NDArray[Any]
    saturated: npt.NDArray[Any] | None
    sink: npt.NDArray[Any]
    logit: npt.NDArray[Any]


def _input_bytes(prepared: PreparedJob) -> int:
    """Bytes of the tensors a queued sample keeps alive (its inputs and masks)."""
    job = prepared.job
    tensors = [job.q, job.k, getattr(job, "v", None), *job.masks.tensors()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
