"""Prometheus collectors, one registry per app so that apps made in tests never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets from 0.5 ms to 30 s: small payloads answer in about a millisecond, while a
# request with weights at the element limit can take seconds.
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Metrics:
    """The service's Prometheus collectors (sdpa_*), registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.requests_total = Counter(
            "sdpa_requests_total", "HTTP requests answered.", ["route", "status"], registry=reg
        )
        self.request_duration_seconds = Histogram(
            "sdpa_request_duration_seconds",
            "HTTP request latency, from the first byte read to the response.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_depth = Gauge(
            "sdpa_queue_depth", "Requests waiting in the batcher's queue.", registry=reg
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
            "Device time of one batch, by the sdpa_core path that ran.",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.rejected_total = Counter(
            "sdpa_rejected_total",
            "Requests refused or dropped before compute, by reason "
            "(queue_full, deadline, disconnected, shutting_down, too_large, unauthorized).",
            ["reason"],
            registry=reg,
        )
