"""AttentionTap: a live model's attention, sampled every n forwards and sent to sdpa-service.

    from sdpa_client.tap import AttentionTap

    with AttentionTap("http://sdpa:8000", model="minilm", every=100) as tap:
        with tap.attach(model):
            for batch in batches:
                model(**batch)
        tap.flush(timeout_s=30.0)
        for report in tap.reports:
            print(report.tag, report.summary["normalized_entropy"])

Two modes (`compute`):
- "service" (the default): what the forward's thread does for a sampled attention call is
  reserve room in the queue (or drop and count), copy q, k, v and the mask to host memory, and
  queue them. Encoding, sending and reading the answer happen on the sender thread.
- "local": the statistics are computed where the model runs, by sdpa_core on the model's own
  device (sdpa_client.tap.local: at once on the CPU; on CUDA from device copies on a side
  stream, on the tap's thread), and only the per-head statistics are sent, one request per
  sampled forward's layers, to POST /v1/health/observe (a few KB a layer); url=None sends
  nothing and keeps the reports local (reports, on_report).
The model's own kernel runs unchanged in both.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Self

import httpx
import numpy.typing as npt
import torch

from sdpa_client.tap.hooks import AttentionCall, attach_hooks
from sdpa_client.tap.host import HostCopier, nbytes
from sdpa_client.tap.local import Inputs, LocalStatistics, Statistics, observation
from sdpa_client.tap.sender import Poster, Sample, Sender
from sdpa_client.trace_context import trace_headers
from sdpa_client.types import AttentionResponse

logger = logging.getLogger("sdpa_client.tap")

TapProtocol = Literal["v1", "v2"]
TapDiagnostics = Literal["summary", "full"]
TapCompute = Literal["service", "local"]
# A local sample's room in the queue besides its inputs: its statistics (a few KB).
_LOCAL_REPORT_BYTES: Final = 16 * 1024
# The most observations one POST /v1/health/observe carries (the service takes 256).
_OBSERVATIONS_PER_POST: Final = 64
# The service's tag rule (1-64 of [A-Za-z0-9_.:/-]), leaving room for "/layer{i}".
_MODEL_NAME: Final = re.compile(r"[A-Za-z0-9_.:/-]{1,48}")


@dataclass(frozen=True, slots=True, eq=False)
class LayerReport:
    """The service's answer for one layer of one sampled forward.

    Attributes:
        forward: the forward's number, from 0 per attach.
        layer: the layer index (HF models) or the call's order in the forward.
        tag: "{model}/layer{layer}", the tag of the health metrics it fed.
        summary: statistic name -> value, pooled over the layer's sequences and heads.
        per_head: statistic name -> ndarray [B, H].
        per_row: with diagnostics="full", statistic name -> ndarray [B, H, N_q]; else None.
    """

    forward: int
    layer: int
    tag: str
    summary: Mapping[str, Any]
    per_head: Mapping[str, npt.NDArray[Any]]
    per_row: Mapping[str, npt.NDArray[Any]] | None = None


@dataclass(frozen=True, slots=True)
class _Local:
    """A local-mode sample on its way to the sender: its statistics (CPU: computed already),
    or the inputs to compute them from (CUDA: device copies on the side stream)."""

    forward: int
    layer: int
    tag: str
    nbytes: int
    statistics: Statistics | None
    inputs: Inputs | None
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class TapStats:
    """Counts since the tap was made. Every sampled call ends answered, failed or dropped.

    Attributes:
        forwards: forwards run while attached.
        sampled: attention calls of sampled forwards.
        sent: samples posted to the service.
        answered: samples the service answered with diagnostics.
        dropped: samples not sent: the queue of unsent bytes was full, or the tap closed first.
        failed: samples that got an error or no answer, or could not be read or copied.
    """

    forwards: int = 0
    sampled: int = 0
    sent: int = 0
    answered: int = 0
    dropped: int = 0
    failed: int = 0


@dataclass
class _Counts:
    forwards_before: int = 0  # forwards of earlier attaches
    sampled: int = 0
    sent: int = 0
    answered: int = 0
    dropped: int = 0
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


class AttentionTap:
    """Samples a model's attention calls and sends them to sdpa-service for diagnostics."""

    def __init__(
        self,
        url: str | None,
        *,
        model: str = "model",
        every: int = 100,
        diagnostics: TapDiagnostics = "summary",
        api_key: str | None = None,
        protocol: TapProtocol = "v1",
        max_queue_bytes: int = 64 << 20,
        timeout_s: float = 10.0,
        on_report: Callable[[LayerReport], None] | None = None,
        max_reports: int = 10_000,
        transport: httpx.BaseTransport | None = None,
        compute: TapCompute = "service",
        sink_tokens: int = 4,
    ) -> None:
        """Open the tap (its sender thread starts; nothing is sent before a sampled forward).

        Args:
            url: the service, e.g. "http://sdpa:8000"; None (compute="local" only): nothing
                is sent, the reports stay in this process.
            model: the name in the tags "{model}/layer{i}" (1-48 of A-Z a-z 0-9 _ . : / -).
            every: forward n (from 0 per attach) is sampled when n % every == 0.
            diagnostics: "summary" (summary and per-head statistics) or "full" (adds per-row).
            api_key: sent as "Authorization: Bearer <key>".
            protocol: "v1" (JSON, base64 tensors) or "v2" (Open Inference Protocol, binary).
            max_queue_bytes: host copies not yet answered, at most; past it samples are dropped.
            timeout_s: how long one sample may wait for its answer (also the service's deadline).
            on_report: called with each LayerReport on the sender thread (log it to W&B,
                TensorBoard...); what it raises is logged, never propagated.
            max_reports: how many of the latest reports `reports` keeps (a long run would
                otherwise keep them all); on_report sees every one.
            transport: an httpx transport in place of the network (tests).
            compute: "service" sends q, k, v and the mask of each sampled call for the service
                to compute; "local" computes the statistics here, with sdpa_core on the
                model's device, and sends only the per-head statistics (POST
                /v1/health/observe; with protocol "v2" too: it is a v1 route).
            sink_tokens: compute="local": the key positions whose share of a row's attention
                is sink_share (set it to the service's SDPA_HEALTH_SINK_TOKENS, default 4).

        Raises:
            ValueError: an argument outside the ranges above.
            ImportError: compute="local" without sdpa_core (the server's distribution).
        """
        if not _MODEL_NAME.fullmatch(model):
            raise ValueError(
                f"model: 1-48 characters of A-Z a-z 0-9 _ . : / - (it starts the metrics' tag "
                f"'{{model}}/layer{{i}}'), got {model!r}"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: an integer >= 1, got {every!r}")
        if diagnostics not in ("summary", "full"):
            raise ValueError(f"diagnostics: 'summary' or 'full', got {diagnostics!r}")
        if protocol not in ("v1", "v2"):
            raise ValueError(f"protocol: 'v1' or 'v2', got {protocol!r}")
        if max_queue_bytes < 1:
            raise ValueError(f"max_queue_bytes: >= 1, got {max_queue_bytes!r}")
        if max_reports < 0:
            raise ValueError(f"max_reports: >= 0, got {max_reports!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: > 0, got {timeout_s!r}")
        if compute not in ("service", "local"):
            raise ValueError(f"compute: 'service' or 'local', got {compute!r}")
        if url is None and compute != "local":
            raise ValueError("url: None keeps the reports local, which needs compute='local'")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens: an integer >= 0, got {sink_tokens!r}")
        self.model = model
        self.every = every
        self.diagnostics = diagnostics
        self.timeout_s = float(timeout_s)
        self._on_report = on_report
        self._reports: collections.deque[LayerReport] = collections.deque(maxlen=max_reports)
        self._counts = _Counts()
        self.compute = compute
        self._copier = HostCopier()
        self._local = (
            LocalStatistics(diagnostics=diagnostics, sink_tokens=sink_tokens)
            if compute == "local"
            else None
        )
        self._poster = None if url is None else Poster(
            url, api_key=api_key, protocol=protocol, diagnostics=diagnostics,
            timeout_s=self.timeout_s, transport=transport,
        )  # fmt: skip
        if self._local is None:
            self._sender = Sender(
                self._post, max_queue_bytes=max_queue_bytes,
                on_answer=self._answered, on_failure=self._failed,
            )  # fmt: skip
        else:
            self._sender = Sender(
                self._post_local, max_queue_bytes=max_queue_bytes,
                on_answer=self._answered_local, on_failure=self._failed,
                batch=_OBSERVATIONS_PER_POST,
            )  # fmt: skip
        self._gate_forwards: Callable[[], int] = lambda: 0
        self._attached = False
        self._closed = False
        self.first_failure: str | None = None
        # compute="local": the sdpa_core path (and backend) of the latest computed call.
        self.local_kernel: str | None = None

    # -- the public surface ---------------------------------------------------------------

    @contextlib.contextmanager
    def attach(self, model: torch.nn.Module) -> Iterator[Self]:
        """Watch `model` while the block runs; forwards are counted from 0.

        The functions the model calls its attention through (for a transformers model, those
        registered under its implementations' names; else torch.nn.functional's
        scaled_dot_product_attention) are wrapped while attached; the model keeps its names,
        masks and kernels (sdpa_client.tap.hooks).

        Raises:
            RuntimeError: the tap is closed, or already attached.
            ValueError: a transformers model that refuses a registered attention function.
        """
        if self._closed:
            raise RuntimeError("attach: the tap is closed")
        if self._attached:
            raise RuntimeError("attach: the tap is already attached to a model")
        self._attached = True
        try:
            with attach_hooks(
                model, self.every, self._capture, self._capture_failed, self._sender.hold
            ) as gate:
                self._gate_forwards = lambda: gate.forwards
                try:
                    yield self
                finally:
                    self._counts.add("forwards_before", gate.forwards)
                    self._gate_forwards = lambda: 0
        finally:
            self._attached = False

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued sample is answered or has failed.

        Returns:
            True when nothing is left, False when `timeout_s` passed first.
        """
        return self._sender.flush(timeout_s)

    @property
    def reports(self) -> list[LayerReport]:
        """The latest `max_reports` LayerReports, in arrival order (a copy)."""
        with self._counts.lock:
            return list(self._reports)

    @property
    def last_body_bytes(self) -> int:
        """compute="local" with a url: the size of the latest POST /v1/health/observe body."""
        return 0 if self._poster is None else self._poster.last_body_bytes

    @property
    def stats(self) -> TapStats:
        c = self._counts
        with c.lock:
            return TapStats(
                forwards=c.forwards_before + self._gate_forwards(), sampled=c.sampled,
                sent=c.sent, answered=c.answered, dropped=c.dropped, failed=c.failed,
            )  # fmt: skip

    def close(self, timeout_s: float | None = None) -> None:
        """Wait up to `timeout_s` (default: the tap's timeout_s) for queued samples, count the
        rest as dropped, and close the connection. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        unsent = self._sender.close(self.timeout_s if timeout_s is None else timeout_s)
        self._counts.add("dropped", len(unsent))
        if self._poster is not None:
            self._poster.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the forward's thread ---------------------------------------------------------------

    def _capture(self, call: AttentionCall) -> None:
        if self._local is not None:
            self._capture_local(self._local, call)
            return
        self._counts.add("sampled")
        if call.unsupported:
            self._counts.add("failed")
            self._note_failure(
                f"layer {call.layer}: the kernel also got {call.unsupported}, which the service "
                "cannot reproduce; not sent"
            )
            return
        size = nbytes(call.q, call.k, call.v, call.attn_mask, call.key_padding_mask)
        if not self._sender.reserve(size):
            self._counts.add("dropped")
            return
        try:
            host = self._copier.copy(call.q, call.k, call.v, call.attn_mask, call.key_padding_mask)
            # The forward's trace context (traceparent), sent later from the sender's thread.
            headers = trace_headers()
        except BaseException:
            self._sender.cancel(size)
            raise  # the hooks' shield counts it as failed, and never lets it reach the model
        if not self._sender.put(
            Sample(
                forward=call.forward,
                layer=call.layer,
                tag=f"{self.model}/layer{call.layer}",
                host=host,
                scale=call.scale,
                causal=call.causal,
                nbytes=size,
                headers=headers,
            )
        ):
            self._counts.add("dropped")  # the tap closed while this sample was being copied

    def _capture_local(self, local: LocalStatistics, call: AttentionCall) -> None:
        self._counts.add("sampled")
        if call.unsupported:
            self._counts.add("failed")
            self._note_failure(
                f"layer {call.layer}: the kernel also got {call.unsupported}, which sdpa_core "
                "cannot reproduce; not computed"
            )
            return
        on_device = call.q.device.type == "cuda"
        size = _LOCAL_REPORT_BYTES + (
            nbytes(call.q, call.k, call.v, call.attn_mask, call.key_padding_mask)
            if on_device
            else 0
        )
        if not self._sender.reserve(size):
            self._counts.add("dropped")
            return
        tag = f"{self.model}/layer{call.layer}"
        try:
            inputs = local.inputs(call)
            statistics = None if on_device else local.compute(inputs)
            headers = trace_headers() if self._poster is not None else {}
        except BaseException:
            self._sender.cancel(size)
            raise  # the hooks' shield counts it as failed, and never lets it reach the model
        if statistics is not None:  # the report is there at once; on_report runs on the sender
            self._keep(self._report(call.forward, call.layer, tag, statistics))
        queued = _Local(
            forward=call.forward, layer=call.layer, tag=tag, nbytes=size,
            statistics=statistics, inputs=None if statistics is not None else inputs,
            headers=headers,
        )  # fmt: skip
        if not self._sender.put(queued):
            self._counts.add("dropped")

    def _capture_failed(self, exc: BaseException) -> None:
        self._counts.add("failed")

    # -- the sender's thread ---------------------------------------------------------------

    def _post(self, sample: Sample) -> AttentionResponse:
        assert self._poster is not None  # compute="service" always has a url
        self._counts.add("sent")
        return self._poster.post(sample)

    def _answered(self, sample: Sample, answer: AttentionResponse) -> None:
        diagnostics = answer.diagnostics
        if diagnostics is None:
            self._counts.add("failed")
            return
        report = LayerReport(
            forward=sample.forward, layer=sample.layer, tag=sample.tag,
            summary=dict(diagnostics.summary), per_head=dict(diagnostics.per_head),
            per_row=None if diagnostics.per_row is None else dict(diagnostics.per_row),
        )  # fmt: skip
        with self._counts.lock:
            self._counts.answered += 1
            self._reports.append(report)
        if self._on_report is not None:
            self._on_report(report)

    def _report(self, forward: int, layer: int, tag: str, stats: Statistics) -> LayerReport:
        self.local_kernel = stats.path + ("" if stats.backend is None else f" ({stats.backend})")
        return LayerReport(
            forward=forward, layer=layer, tag=tag, summary=stats.summary,
            per_head=stats.per_head, per_row=stats.per_row,
        )  # fmt: skip

    def _keep(self, report: LayerReport) -> None:
        with self._counts.lock:
            self._reports.append(report)

    def _post_local(self, group: list[_Local]) -> list[Any]:
        """On the sender's thread: compute what is left (CUDA), hand each report to on_report,
        and post the group's statistics in one request; one outcome per sample."""
        outcomes: list[Any] = []
        sendable: list[tuple[int, LayerReport, Statistics]] = []
        for item in group:
            try:
                stats = item.statistics
                if stats is None:
                    assert item.inputs is not None
                    assert self._local is not None
                    stats = self._local.compute(item.inputs)
                    report = self._report(item.forward, item.layer, item.tag, stats)
                    self._keep(report)
                else:
                    report = self._report(item.forward, item.layer, item.tag, stats)
            except Exception as exc:
                outcomes.append(exc)
                continue
            outcomes.append(report)
            sendable.append((len(outcomes) - 1, report, stats))
        for _, report, _ in sendable:
            if self._on_report is not None:
                try:
                    self._on_report(report)
                except Exception:  # a user's on_report must not stop the sender
                    logger.exception("tap: on_report raised")
        if self._poster is None or not sendable:
            return outcomes
        body = {"observations": [observation(r.tag, st) for _, r, st in sendable]}
        headers = next((dict(item.headers) for item in group if item.headers), {})
        self._counts.add("sent", len(sendable))
        try:
            self._poster.observe(body, headers)
        except Exception as exc:
            for index, _, _ in sendable:
                outcomes[index] = exc
        return outcomes

    def _answered_local(self, item: _Local, report: LayerReport) -> None:
        self._counts.add("answered")

    def _failed(self, sample: Sample | _Local, exc: BaseException) -> None:
        self._counts.add("failed")
        self._note_failure(f"{sample.tag} of forward {sample.forward}: {exc}")

    def _note_failure(self, what: str) -> None:
        """Keep the first failure's reason (`first_failure`); log it once at warning level, the
        others at debug level."""
        with self._counts.lock:
            first = self.first_failure is None
            if first:
                self.first_failure = what
        logger.log(logging.WARNING if first else logging.DEBUG, "tap: %s", what)
