"""Engine: runs one group of requests on the device as ONE sdpa_core.attention call.

Stack, pad, compute, split
--------------------------
Every request of a group is flattened to [b, H, N, D] (b = the product of its own leading
dims; a 3-D or 2-D input has b = 1) and concatenated along the batch dim. Requests of one
shape are simply stacked. Different N_q / N_kv are padded with zeros to the group's maximum:

- padded keys become invisible through key_lengths (each request's own key_lengths, or its
  length N_kv), or through a key_padding_mask [B, (H,) N_kv] when some request brings its own
  key_padding_mask; a request's attn_mask is padded with False (bool) or -inf (float);
- padded query rows are computed and sliced off on return.

Padding sits at the end of the sequence, except for causal "bottom_right", whose alignment
depends on N_kv - N_q: there both the queries and the keys are padded at the *front*, so that
in the padded batch real query i still sees exactly the real keys j <= i + N_kv - N_q (the
padded keys before them are masked), whatever the group's maximum lengths are.

Each request then gets its own slice of the output and weights, and its own diagnostics:
summarize() over its own rows of the batch's RowStats, never batch-pooled numbers. So a
request's output, weights and diagnostics equal a solo call's up to float reduction order.

A request is validated (cheaply: shapes, masks, finiteness) before it joins the batch, so a
bad one fails alone with its own SdpaError; if the batched call itself fails, each request of
that batch is retried alone, so every request still gets its own answer. AnalyzeJobs run alone.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from sdpa_core import (
    AttentionResult,
    Diagnostics,
    InputSpec,
    RowStats,
    ScalingReport,
    SdpaError,
    analyze_scaling,
    attention,
    summarize,
    validate_inputs,
)
from service.metrics import Metrics

Strategy = str | tuple[str, float]
_DIAGNOSTICS_LEVELS = ("none", "summary", "full")
# Unique keys for jobs that must run alone (analysis, inputs too malformed to key).
_ALONE = itertools.count()
# A batch grows only while its padded score matrix [B, H, N_q, N_kv] (accumulation dtype) fits
# this budget; a single request always runs. On a GPU the budget bounds memory: batching pays
# for itself through fewer kernel launches and fuller occupancy. On a CPU one call costs only
# ~0.1 ms of overhead, and batching pays only while the batch's working set stays in the core's
# L2 cache (about 1 MiB here): measured on a 2-core EPYC (torch 2.13, one intra-op thread),
# [4, 64, 64] requests ran 1.4-1.6x faster per item in batches of 4-16 (64 KiB of scores
# each), while [8, 256, 256] requests with weights ran 0.5-0.9x as fast in any batch (2 MiB of
# scores each: every batch spills to L3/DRAM). So CPU batches are sized to ~L2.
MAX_BATCH_SCORE_BYTES = {"cpu": 1024 * 1024, "cuda": 256 * 1024 * 1024}


@dataclass(frozen=True, slots=True)
class AttentionJob:
    """One /v1/attention request: CPU tensors as decoded, in the request's own shape."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool | str = False  # False/True/"top_left"/"bottom_right"
    key_lengths: torch.Tensor | None = None  # int64
    key_padding_mask: torch.Tensor | None = None  # bool, True = padding
    attn_mask: torch.Tensor | None = None  # bool (True = attend) or float (additive)
    scale: float | None = None
    return_weights: bool = False
    diagnostics: str = "none"  # "none" | "summary" | "full"
    # What sdpa_core.validate_inputs returned for exactly these tensors and options, when the
    # caller (the route, to answer 422 before queueing) has run it with the finiteness check.
    # The engine then trusts it: it neither validates the job again nor has attention() scan
    # the inputs for NaN/Inf a second time (one read of every element each).
    checked: InputSpec | None = None


@dataclass(frozen=True, slots=True)
class AnalyzeJob:
    """One /v1/analyze request: runs alone (a group of one)."""

    q: torch.Tensor
    k: torch.Tensor
    strategies: tuple[Strategy, ...] | None = None
    causal: bool | str = False
    key_lengths: torch.Tensor | None = None
    key_padding_mask: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class AttentionOutcome:
    """A request's result (CPU tensors, shaped as the solo call's) and how its batch ran."""

    result: AttentionResult
    compute_ms: float
    device: str


@dataclass(frozen=True, slots=True)
class AnalyzeOutcome:
    report: ScalingReport
    compute_ms: float
    device: str


Job = AttentionJob | AnalyzeJob
Outcome = AttentionOutcome | AnalyzeOutcome


def length_bucket(n: int) -> int:
    """The length bucket of a sequence length: n rounded up to three significant bits.

    Buckets: 1, 2, ..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, ...
    (four per doubling). Requests share a batch only within a bucket of N_q and of N_kv, and
    are padded to the group's maximum, so in every bucket max/min < 1.25: a request is padded
    by under 25% per length and its N_q * N_kv work by under 1.25^2 = 1.56x in the worst
    case (typically far less, since the group maximum is usually close to most members).

    Why geometric: attention's cost grows as N_q * N_kv, so what must stay bounded is the
    *relative* padding, at every scale. Fixed multiples (ceil to 64) pad a 10-token request
    6x and are needlessly fine for 8k-token ones; powers of two bound the waste only by 4x.
    Four buckets per doubling keep the count small (about 40 between 16 and 16k), so traffic
    of similar lengths still meets in one batch. Lengths up to 8 are exact: decode-style
    requests (N_q = 1) would otherwise be padded many times over.
    """
    if n <= 0:
        return n
    step = 1 << max(0, (n - 1).bit_length() - 3)
    return -(-n // step) * step


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cpu'; 'cuda' / 'cuda:N' (must exist)."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {spec!r} requested but CUDA is not available")
        index = device.index if device.index is not None else 0
        if index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA devices"
            )
    elif device.type != "cpu":
        raise RuntimeError(f"unsupported device {spec!r} (auto, cpu, cuda or cuda:N)")
    return device


def _causal_mode(causal: object) -> str:
    if causal is None or causal is False:
        return "none"
    if causal is True:
        return "top_left"
    if causal in ("none", "top_left", "bottom_right"):
        return str(causal)
    raise ValueError(f"unknown causal option {causal!r}")


@dataclass(frozen=True, slots=True)
class _Member:
    """A validated job and where its rows sit in the batch."""

    index: int  # position in run_batch's input
    job: AttentionJob
    spec: InputSpec
    offset: int = 0  # first row of the batch dim


class Engine:
    """Runs groups of jobs on one device (sync; called on the batcher's device thread)."""

    def __init__(
        self,
        device: torch.device,
        *,
        memory_budget_bytes: int | None = None,
        max_batch_score_bytes: int | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.device = device
        self.memory_budget_bytes = memory_budget_bytes
        budget = (
            max_batch_score_bytes
            if max_batch_score_bytes is not None
            else MAX_BATCH_SCORE_BYTES.get(device.type, MAX_BATCH_SCORE_BYTES["cuda"])
        )
        # With a memory budget, a batch must not exceed it where its members alone would not
        # (sdpa_core refuses weights above the budget).
        if memory_budget_bytes is not None:
            budget = min(budget, memory_budget_bytes)
        self._max_batch_score_bytes = budget
        self._metrics = metrics

    @property
    def max_batch_cost(self) -> float:
        """The budget batch_cost() sums to: padded score bytes per device call."""
        return float(self._max_batch_score_bytes)

    def batch_cost(self, job: Job) -> float:
        """An upper bound of the job's share of a batch's padded score matrix, in bytes.

        It uses the length buckets (a group is padded to at most its bucket), so the costs of a
        batch's members add up to at least its padded score bytes. For the batcher's
        batch_cost/max_batch_cost: a batch then never holds more than the engine runs at once.
        """
        if isinstance(job, AnalyzeJob):
            return 0.0
        try:
            q, k = job.q, job.k
            heads = q.shape[-3] if q.dim() >= 3 else 1
            rows = math.prod(q.shape[:-3]) if q.dim() >= 4 else 1
            item = 8 if q.dtype == torch.float64 else 4
            n_q, n_kv = length_bucket(q.shape[-2]), length_bucket(k.shape[-2])
            return float(rows * heads * n_q * n_kv * item)
        except (AttributeError, IndexError, TypeError):
            return 0.0

    # -- warm-up -------------------------------------------------------------------------

    def warmup(self) -> None:
        """One real attention call on the device (fused) and one with diagnostics."""
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 16, 16, generator=gen) for _ in range(3))  # [1, 2, 16, 16]
        q, k, v = q.to(self.device), k.to(self.device), v.to(self.device)
        attention(q, k, v)
        result = attention(q, k, v, diagnostics="summary")
        result.output.cpu()  # waits for the device (a CUDA sync)

    # -- grouping ------------------------------------------------------------------------

    def group_key(self, job: Job) -> Hashable:
        """Jobs with equal keys may run as one batch (see module doc and length_bucket)."""
        if isinstance(job, AnalyzeJob):
            return ("analyze", next(_ALONE))
        if self.batch_cost(job) > self.max_batch_cost / 2:
            # No other request of its size fits beside it in one call: it runs alone, and the
            # batcher never holds it back to wait for (or behind) same-group requests.
            return ("alone", next(_ALONE))
        try:
            q, k, v = job.q, job.k, job.v
            if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
                raise ValueError("rank")
            heads = q.shape[-3] if q.dim() >= 3 else 1
            kv_heads = k.shape[-3] if k.dim() >= 3 else 1
            mask = job.attn_mask
            return (
                "attention",
                str(q.device),
                str(q.dtype),
                q.shape[-1],  # D
                v.shape[-1],  # D_v
                heads,
                kv_heads,
                _causal_mode(job.causal),
                job.scale,
                bool(job.return_weights),
                job.diagnostics,
                # The mask kind changes the math (bias vs visibility) and the kernel.
                "none" if mask is None else str(mask.dtype),
                length_bucket(q.shape[-2]),
                length_bucket(k.shape[-2]),
            )
        except (ValueError, AttributeError, IndexError, TypeError):
            # Too malformed to key: it runs alone and fails validation there.
            return ("alone", next(_ALONE))

    # -- running -------------------------------------------------------------------------

    def run_batch(self, jobs: Sequence[Job]) -> list[Outcome | BaseException]:
        """Run `jobs` (normally one group); one failing job never fails the others."""
        results: list[Outcome | BaseException | None] = [None] * len(jobs)
        groups: dict[Hashable, list[_Member]] = {}
        for index, job in enumerate(jobs):
            if isinstance(job, AnalyzeJob):
                results[index] = self._run_analyze(job)
                continue
            try:
                spec = self._validate(job)
            except Exception as exc:  # the job's own error (SdpaError -> 422)
                results[index] = exc
                continue
            # A job alone needs no key: it is its own group (and the key costs string work).
            key = index if len(jobs) == 1 else self.group_key(job)
            groups.setdefault(key, []).append(_Member(index=index, job=job, spec=spec))

        for members in groups.values():
            for batch in self._split_by_memory(members):
                for member, outcome in zip(batch, self._run_isolated(batch), strict=True):
                    results[member.index] = outcome
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _validate(self, job: AttentionJob) -> InputSpec:
        if job.diagnostics not in _DIAGNOSTICS_LEVELS:
            raise SdpaError(
                "unknown diagnostics level",
                param="diagnostics",
                expected='"none", "summary" or "full"',
                got=repr(job.diagnostics),
            )
        if job.checked is not None:
            return job.checked
        return validate_inputs(
            job.q,
            job.k,
            job.v,
            causal=job.causal,
            key_lengths=job.key_lengths,
            key_padding_mask=job.key_padding_mask,
            attn_mask=job.attn_mask,
            scale=job.scale,
        )

    def _split_by_memory(self, members: list[_Member]) -> list[list[_Member]]:
        """Consecutive sub-batches whose padded score matrix fits the batch budget."""
        batches: list[list[_Member]] = []
        current: list[_Member] = []
        rows = n_q = n_kv = 0
        for member in members:
            spec = member.spec
            item = 8 if spec.dtype == torch.float64 else 4
            grown = (
                (rows + spec.batch) * spec.heads * max(n_q, spec.n_q) * max(n_kv, spec.n_kv) * item
            )
            if current and grown > self._max_batch_score_bytes:
                batches.append(current)
                current, rows, n_q, n_kv = [], 0, 0, 0
            current.append(member)
            rows += spec.batch
            n_q, n_kv = max(n_q, spec.n_q), max(n_kv, spec.n_kv)
        if current:
            batches.append(current)
        return batches

    def _run_isolated(self, batch: list[_Member]) -> list[Outcome | BaseException]:
        """The batch as one call; if that call fails, each member alone (its own answer)."""
        try:
            return list(self._run_group(batch))
        except Exception as exc:
            if len(batch) == 1:
                return [exc]
        outcomes: list[Outcome | BaseException] = []
        for member in batch:
            try:
                outcomes.extend(self._run_group([member]))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _observe(self, path: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.compute_seconds.labels(path=path).observe(seconds)

    def _run_analyze(self, job: AnalyzeJob) -> AnalyzeOutcome | BaseException:
        started = time.perf_counter()
        try:
            dev = self.device
            report = analyze_scaling(
                job.q.to(dev),
                job.k.to(dev),
                strategies=job.strategies,
                causal=job.causal,
                key_lengths=None if job.key_lengths is None else job.key_lengths.to(dev),
                key_padding_mask=_to(job.key_padding_mask, dev),
                attn_mask=_to(job.attn_mask, dev),
            )
        except Exception as exc:
            return exc
        seconds = time.perf_counter() - started
        self._observe("analyze", seconds)
        return AnalyzeOutcome(report=report, compute_ms=seconds * 1e3, device=str(self.device))

    def _run_group(self, batch: list[_Member]) -> list[AttentionOutcome]:
        started = time.perf_counter()
        results = [self._run_alone(batch[0])] if len(batch) == 1 else self._run_padded(batch)
        seconds = time.perf_counter() - started
        self._observe(results[0].path, seconds)
        device = str(self.device)
        return [
            AttentionOutcome(result=result, compute_ms=seconds * 1e3, device=device)
            for result in results
        ]

    def _run_alone(self, member: _Member) -> AttentionResult:
        """A group of one: the request's own tensors, exactly the solo call."""
        job, dev = member.job, self.device
        result = attention(
            job.q.to(dev),
            job.k.to(dev),
            job.v.to(dev),
            causal=job.causal,
            key_lengths=_to(job.key_lengths, dev),
            key_padding_mask=_to(job.key_padding_mask, dev),
            attn_mask=_to(job.attn_mask, dev),
            scale=job.scale,
            return_weights=job.return_weights,
            diagnostics=job.diagnostics,
            memory_budget_bytes=self.memory_budget_bytes,
            # Every member passed validate_inputs with its NaN/Inf scan: the route's (job.checked)
            # or run_batch's own (_validate). A second scan would only cost time.
            check_finite=False,
        )
        if dev.type == "cpu":
            return result
        row_stats = None if result.row_stats is None else _row_stats_to_cpu(result.row_stats)
        return AttentionResult(
            output=result.output.cpu(),
            weights=None if result.weights is None else result.weights.cpu(),
            diagnostics=_summarize(row_stats, job, member.spec),
            row_stats=row_stats,
            path=result.path,
            backend=result.backend,
        )

    def _run_padded(self, batch: list[_Member]) -> list[AttentionResult]:
        first = batch[0].job
        spec0 = batch[0].spec
        heads, kv_heads, d, d_v = spec0.heads, spec0.kv_heads, spec0.d, spec0.d_v
        dtype = spec0.dtype
        front = spec0.causal == "bottom_right"
        n_q = max(m.spec.n_q for m in batch)
        n_kv = max(m.spec.n_kv for m in batch)
        placed: list[_Member] = []
        rows = 0
        for m in batch:
            placed.append(_Member(index=m.index, job=m.job, spec=m.spec, offset=rows))
            rows += m.spec.batch

        def q_rows(spec: InputSpec) -> slice:
            return slice(n_q - spec.n_q, n_q) if front else slice(0, spec.n_q)

        def kv_cols(spec: InputSpec) -> slice:
            return slice(n_kv - spec.n_kv, n_kv) if front else slice(0, spec.n_kv)

        same_shape = all(m.spec.n_q == n_q and m.spec.n_kv == n_kv for m in batch)
        if same_shape:
            q = torch.cat([m.job.q.reshape(m.spec.batch, heads, n_q, d) for m in batch])
            k = torch.cat([m.job.k.reshape(m.spec.batch, kv_heads, n_kv, d) for m in batch])
            v = torch.cat([m.job.v.reshape(m.spec.batch, kv_heads, n_kv, d_v) for m in batch])
        else:
            q = torch.zeros(rows, heads, n_q, d, dtype=dtype)  # [B, H, N_q, D]
            k = torch.zeros(rows, kv_heads, n_kv, d, dtype=dtype)  # [B, H_kv, N_kv, D]
            v = torch.zeros(rows, kv_heads, n_kv, d_v, dtype=dtype)  # [B, H_kv, N_kv, D_v]
            for m in placed:
                s, b = m.spec, slice(m.offset, m.offset + m.spec.batch)
                q[b, :, q_rows(s)] = m.job.q.reshape(s.batch, heads, s.n_q, d)
                k[b, :, kv_cols(s)] = m.job.k.reshape(s.batch, kv_heads, s.n_kv, d)
                v[b, :, kv_cols(s)] = m.job.v.reshape(s.batch, kv_heads, s.n_kv, d_v)

        key_lengths, key_padding_mask = _batch_key_masks(placed, rows, heads, n_kv, front)
        attn_mask = _batch_attn_mask(placed, rows, heads, n_q, n_kv, q_rows, kv_cols)

        dev = self.device
        result = attention(
            q.to(dev),
            k.to(dev),
            v.to(dev),
            causal=first.causal,
            key_lengths=_to(key_lengths, dev),
            key_padding_mask=_to(key_padding_mask, dev),
            attn_mask=_to(attn_mask, dev),
            scale=first.scale,
            return_weights=first.return_weights,
            diagnostics=first.diagnostics,
            memory_budget_bytes=self.memory_budget_bytes,
            # Every member was scanned (see _run_alone), and padding adds only zeros and (float
            # masks) -inf: checked members make a checked batch.
            check_finite=False,
        )
        output = result.output.cpu()  # [B, H, N_q, D_v]
        weights = None if result.weights is None else result.weights.cpu()  # [B, H, N_q, N_kv]
        row_stats = None if result.row_stats is None else _row_stats_to_cpu(result.row_stats)

        results: list[AttentionResult] = []
        for m in placed:
            s, b = m.spec, slice(m.offset, m.offset + m.spec.batch)
            rq, ck = q_rows(s), kv_cols(s)
            own_rows: RowStats | None = None
            if row_stats is not None:
                own_rows = row_stats.index((b, slice(None), rq)).reshape(s.row_shape)
            results.append(
                AttentionResult(
                    output=output[b, :, rq].reshape(*s.row_shape, d_v),
                    weights=None
                    if weights is None
                    else weights[b, :, rq, ck].reshape(*s.row_shape, s.n_kv),
                    diagnostics=_summarize(own_rows, m.job, s),
                    row_stats=own_rows,
                    path=result.path,
                    backend=result.backend,
                )
            )
        return results


def _to(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if x is None else x.to(device)


def _row_stats_to_cpu(rs: RowStats) -> RowStats:
    return RowStats(**{name: t.cpu() for name, t in rs.as_dict().items()})


def resolved_scale(job: AttentionJob, spec: InputSpec) -> float:
    """The softmax scale sdpa_core uses: the request's, or 1/sqrt(D)."""
    return float(job.scale) if job.scale is not None else 1.0 / math.sqrt(spec.d)


def _summarize(rs: RowStats | None, job: AttentionJob, spec: InputSpec) -> Diagnostics | None:
    if rs is None or job.diagnostics == "none":
        return None
    level: Literal["summary", "full"] = "full" if job.diagnostics == "full" else "summary"
    return summarize(rs, scale=resolved_scale(job, spec), level=level)


def _own_key_padding(member: _Member, heads: int) -> torch.Tensor | None:
    """The member's own key padding as bool [b, H|1, n_kv] (True = padding), or None."""
    job, s = member.job, member.spec
    n_batch = len(s.batch_shape)
    pad: torch.Tensor | None = None
    if job.key_lengths is not None:
        kl = torch.as_tensor(job.key_lengths, dtype=torch.int64)
        per_head = kl.dim() > n_batch and not s.two_d
        kl = kl.reshape(s.batch, heads if per_head else 1, 1)  # [b, H|1, 1]
        pad = torch.arange(s.n_kv) >= kl  # [b, H|1, n_kv]
    if job.key_padding_mask is not None:
        kpm = job.key_padding_mask
        per_head = kpm.dim() - 1 > n_batch and not s.two_d
        kpm = kpm.reshape(s.batch, heads if per_head else 1, s.n_kv)  # [b, H|1, n_kv]
        pad = kpm if pad is None else pad | kpm
    return pad


def _batch_key_masks(
    placed: list[_Member], rows: int, heads: int, n_kv: int, front: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch's key visibility: key_lengths [B] or [B, H] when every request's padding is a
    suffix (end padding, no key_padding_mask), else a key_padding_mask [B, (H,) N_kv]."""
    needs = any(
        m.spec.n_kv < n_kv or m.job.key_lengths is not None or m.job.key_padding_mask is not None
        for m in placed
    )
    if not needs:
        return None, None

    def per_head_of(m: _Member) -> bool:
        if m.spec.two_d:
            return False
        n_batch = len(m.spec.batch_shape)
        kl, kpm = m.job.key_lengths, m.job.key_padding_mask
        return (kl is not None and kl.dim() > n_batch) or (
            kpm is not None and kpm.dim() - 1 > n_batch
        )

    per_head = any(per_head_of(m) for m in placed)
    width = heads if per_head else 1
    if not front and all(m.job.key_padding_mask is None for m in placed):
        lengths = torch.empty(rows, width, dtype=torch.int64)  # [B, H|1]
        for m in placed:
            b = slice(m.offset, m.offset + m.spec.batch)
            if m.job.key_lengths is None:
                lengths[b] = m.spec.n_kv
            else:
                kl = torch.as_tensor(m.job.key_lengths, dtype=torch.int64)
                own_per_head = kl.dim() > len(m.spec.batch_shape) and not m.spec.two_d
                lengths[b] = kl.reshape(m.spec.batch, heads if own_per_head else 1)
        return (lengths if per_head else lengths[:, 0]), None

    padding = torch.ones(rows, width, n_kv, dtype=torch.bool)  # [B, H|1, N_kv], all padding
    for m in placed:
        b = slice(m.offset, m.offset + m.spec.batch)
        cols = slice(n_kv - m.spec.n_kv, n_kv) if front else slice(0, m.spec.n_kv)
        own = _own_key_padding(m, heads)
        padding[b, :, cols] = False if own is None else own
    return None, (padding if per_head else padding[:, 0])


def _batch_attn_mask(
    placed: list[_Member],
    rows: int,
    heads: int,
    n_q: int,
    n_kv: int,
    q_rows: Callable[[InputSpec], slice],
    kv_cols: Callable[[InputSpec], slice],
) -> torch.Tensor | None:
    """Every request's attn_mask placed in a [B, H|1, N_q, N_kv] mask; padding False / -inf."""
    masks = [m.job.attn_mask for m in placed]
    if all(mask is None for mask in masks):
        return None
    first = next(mask for mask in masks if mask is not None)

    def has_heads(m: _Member) -> bool:
        mask = m.job.attn_mask
        return mask is not None and not m.spec.two_d and mask.dim() >= 3 and mask.shape[-3] > 1

    width = heads if any(has_heads(m) for m in placed) else 1
    fill: bool | float = False if first.dtype == torch.bool else -math.inf
    out = torch.full((rows, width, n_q, n_kv), fill, dtype=first.dtype)  # [B, H|1, N_q, N_kv]
    for m in placed:
        mask = m.job.attn_mask
        if mask is None:  # cannot happen within one group (the mask kind is in the key)
            raise RuntimeError("a group mixes requests with and without attn_mask")
        s = m.spec
        own_width = heads if has_heads(m) else 1
        full = mask.expand(*s.row_shape, s.n_kv) if own_width > 1 else mask
        if own_width == 1:
            # Broadcast everything but the head dim: [..., 1, n_q, n_kv] -> [b, 1, n_q, n_kv].
            lead = (*s.batch_shape, 1, s.n_q, s.n_kv) if not s.two_d else (1, 1, s.n_q, s.n_kv)
            rank = len(lead)
            full = mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape)).expand(*lead)
        own = full.reshape(s.batch, own_width, s.n_q, s.n_kv)  # [b, H|1, n_q, n_kv]
        b = slice(m.offset, m.offset + s.batch)
        out[b, :, q_rows(s), kv_cols(s)] = own
    return out
