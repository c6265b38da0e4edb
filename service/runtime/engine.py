"""Engine: runs one group of prepared jobs on the device as ONE sdpa_core.attention call.

Called on the batcher's device thread. A group of one runs the request's own tensors, exactly
the solo call; a larger group is collated into one padded batch (service.runtime.collate) and
split back, so each request gets what it would get alone up to float reduction order. Jobs
arrive prepared (validated once, service.runtime.jobs), so the engine neither validates them
again nor has attention() scan them for NaN/Inf a second time. If a batched call fails, each
of its requests is retried alone, so every request still gets its own answer. Analysis jobs
run alone.

A long job (more than one slice of estimated device time) runs alone as sdpa_core's TiledRun
(start_long: AttentionRun or AnalysisRun, one protocol), stepped as it is one tile at a time
by the runtime (service.runtime.long_runs), which checks the deadline and the client and runs
short batches between tiles; note_tile observes each tile's seconds, finish_long makes the
job's Outcome of the result.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from sdpa_core import (
    DEFAULT_SINK_TOKENS,
    STANDARD_STRATEGIES,
    AnalysisRun,
    AttentionOptions,
    AttentionResult,
    AttentionRun,
    Diagnostics,
    Masks,
    RowStats,
    ScalingReport,
    analyze_scaling,
    attention,
    resolve_scale,
)
from sdpa_core.nonfinite import check_no_overflow
from service.metrics import Metrics
from service.runtime.collate import collate, member_diagnostics, split
from service.runtime.device import results_on_host, to_device
from service.runtime.jobs import (
    AnalyzeJob,
    AnalyzeOutcome,
    AttentionJob,
    AttentionOutcome,
    Outcome,
    PreparedJob,
)
from service.runtime.policy import (
    MAX_BATCH_SCORE_BYTES,
    BatchPolicy,
    CostModel,
    Member,
    PathCost,
    WorkShape,
    path_flops,
)

# What a long job's run gives: an AttentionResult or a ScalingReport.


class Engine:
    """Runs groups of prepared jobs on one device (sync; called on the device thread)."""

    def __init__(
        self,
        device: torch.device,
        *,
        memory_budget_bytes: int | None = None,
        max_batch_score_bytes: int | None = None,
        metrics: Metrics | None = None,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
    ) -> None:
        self.device = device
        # The key positions whose share is diagnostics' sink_share (SDPA_HEALTH_SINK_TOKENS;
        # the app sets it on an engine a test passes in, too).
        self.sink_tokens = sink_tokens
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
        self.policy = BatchPolicy(budget)
        self._metrics = metrics

    def report_to(self, metrics: Metrics) -> None:
        """Observe compute times on `metrics` from now on (the app's registry: an engine built
        before its app, as tests pass to create_app, reports where /metrics reads)."""
        self._metrics = metrics

    # -- warm-up -------------------------------------------------------------------------

    def warmup(self) -> None:
        """One real attention call on the device (fused) and one with diagnostics."""
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 16, 16, generator=gen) for _ in range(3))  # [1, 2, 16, 16]
        q, k, v = (to_device(x, self.device) for x in (q, k, v))
        attention(q, k, v)
        result = attention(q, k, v, diagnostics="summary")
        result.output.cpu()  # waits for the device (a CUDA sync)

    # -- calibration ---------------------------------------------------------------------

    def calibrate(self) -> CostModel:
        """Measure the cost model on this device (about a second on a 2-core CPU; at warm-up).

        Each path runs on [1, 2, 512, D] with D = 256 and D = 16 and on a tiny [1, 1, 16, 16]
        (the fastest of a few calls after a warm one). The tiny call gives the fixed cost of a
        call; D = 256, beyond it, the seconds per FLOP. Below some head dim a smaller
        one costs no less: the per-score work (softmax, and the statistics of the diagnostics
        paths) dominates. On a 2-core CPU with torch 2.13, fused calls with D = 2 and D = 32
        both took 0.58 ms at N = 512. The floor is the head dim at which D = 16's time would
        be spent at D = 256's cost per FLOP.
        """
        gen = torch.Generator().manual_seed(1)
        runs: dict[str, Callable[[tuple[torch.Tensor, ...]], object]] = {
            "fused": lambda qkv: attention(*qkv),
            "dense": lambda qkv: attention(*qkv, return_weights=True, diagnostics="summary"),
            "chunked": lambda qkv: attention(*qkv, diagnostics="summary"),
            "analyze": lambda qkv: analyze_scaling(qkv[0], qkv[1]),
        }
        timings: dict[int, dict[str, float]] = {}
        for d, shape in ((256, (1, 2, 512, 256)), (16, (1, 2, 512, 16)), (0, (1, 1, 16, 16))):
            qkv = tuple(torch.randn(shape, generator=gen).to(self.device) for _ in range(3))
            timings[d] = {
                path: self._fastest(functools.partial(run, qkv)) for path, run in runs.items()
            }
        paths = {}
        for path in runs:
            strategies = len(STANDARD_STRATEGIES) if path == "analyze" else 0
            wide = WorkShape(1, 2, 512, 512, 256, 256, strategies)
            overhead = timings[0][path]
            per_flop = max(timings[256][path] - overhead, 1e-9) / path_flops(wide, path, 1)
            narrow = WorkShape(1, 2, 512, 512, 16, 16, strategies)
            # The floor f with path_flops(narrow, f) * per_flop == D = 16's time, by bisection
            # (the FLOPs grow monotonically with f).
            low, high = 1, 256
            while low < high:
                mid = (low + high) // 2
                if path_flops(narrow, path, mid) * per_flop < timings[16][path] - overhead:
                    low = mid + 1
                else:
                    high = mid
            paths[path] = PathCost(seconds_per_flop=per_flop, d_floor=low, overhead_s=overhead)
        return CostModel(paths, calibrated=True)

    def _fastest(self, call: Callable[[], object], repeats: int = 3) -> float:
        """The fastest of `repeats` timed calls after a warm one, device work included."""
        call()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - started)
        return min(times)

    # -- running -------------------------------------------------------------------------

    def run_batch(self, jobs: Sequence[PreparedJob]) -> list[Outcome | BaseException]:
        """Run `jobs` (normally one group); one failing job never fails the others."""
        results: list[Outcome | BaseException | None] = [None] * len(jobs)
        groups: dict[Hashable, list[Member]] = {}
        for index, prepared in enumerate(jobs):
            job = prepared.job
            if isinstance(job, AnalyzeJob):
                results[index] = self._run_analyze(job)
                continue
            # A job alone needs no key: it is its own group (and the key costs string work).
            key = index if len(jobs) == 1 else self.policy.group_key(prepared)
            groups.setdefault(key, []).append(Member(index=index, job=job, spec=prepared.spec))

        for members in groups.values():
            for batch in self.policy.split_by_memory(members):
                for member, outcome in zip(batch, self._run_isolated(batch), strict=True):
                    results[member.index] = outcome
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _run_isolated(self, batch: list[Member]) -> list[Outcome | BaseException]:
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

    def diagnose(self, prepared: PreparedJob) -> Diagnostics:
        """Summary diagnostics of an attention job that did not ask for them (the health
        monitor's samples): the job alone, on the chunked path, on this device."""
        job = prepared.job
        if not isinstance(job, AttentionJob):
            raise TypeError(f"only attention jobs have diagnostics, not {type(job).__name__}")
        dev = self.device
        options = AttentionOptions(
            scale=job.scale,
            diagnostics="summary",
            memory_budget_bytes=self.memory_budget_bytes,
            check_finite=False,  # validated once, when the request was prepared
            sink_tokens=self.sink_tokens,
        )
        result = AttentionRun(
            to_device(job.q, dev),
            to_device(job.k, dev),
            to_device(job.v, dev),
            job.masks.to(dev, move=to_device),
            options,
        ).run()
        assert result.diagnostics is not None  # asked for
        if self.device.type == "cpu":
            return result.diagnostics
        return _diagnostics_on_cpu(result.diagnostics)

    def observe_compute(self, path: str, seconds: float, backend: str | None = None) -> None:
        if self._metrics is not None:
            # The backend torch's SDPA chose (flash, efficient, math...): "none" off the fused
            # path, where no kernel choice is made.
            labels = {"path": path, "backend": backend or "none"}
            self._metrics.compute_seconds.labels(**labels).observe(seconds)

    def _analysis_run(self, job: AnalyzeJob, tiles: int = 1) -> AnalysisRun:
        dev = self.device
        return AnalysisRun(
            to_device(job.q, dev),
            to_device(job.k, dev),
            job.masks.to(dev, move=to_device),
            strategies=job.strategies,
            tiles=tiles,
        )

    def _run_analyze(self, job: AnalyzeJob) -> AnalyzeOutcome | BaseException:
        started = time.perf_counter()
        try:
            run = self._analysis_run(job)
            report = run.run()
        except Exception as exc:
            return exc
        seconds = time.perf_counter() - started
        self.observe_compute(run.path, seconds, run.backend)
        return AnalyzeOutcome(report=report, compute_ms=seconds * 1e3, device=str(self.device))

    # -- long jobs -----------------------------------------------------------------------

    def start_long(self, prepared: PreparedJob, tiles: int) -> AnalysisRun | AttentionRun:
        """`prepared` as sdpa_core's run of about `tiles` tiles, stepped by the runtime as it
        is (service.runtime.long_runs; on the device thread, like run_batch: its inputs move
        to the device here)."""
        job = prepared.job
        if isinstance(job, AnalyzeJob):
            return self._analysis_run(job, tiles)
        member = Member(index=0, job=job, spec=prepared.spec)
        return self._attention_run(member, job.q, job.k, job.v, job.masks, tiles=tiles)

    def note_tile(self, run: AnalysisRun | AttentionRun, seconds: float) -> None:
        """One tile of a long job took `seconds` (observed in sdpa_compute_seconds under the
        run's path and backend)."""
        self.observe_compute(run.path, seconds, run.backend)

    def finish_long(
        self, prepared: PreparedJob, result: ScalingReport | AttentionResult, seconds: float
    ) -> Outcome:
        """A long job's Outcome of its run's result and the `seconds` its tiles took (on the
        device thread: the attention result's copy to the host)."""
        job, device, ms = prepared.job, str(self.device), seconds * 1e3
        if isinstance(job, AnalyzeJob):
            assert isinstance(result, ScalingReport)
            return AnalyzeOutcome(report=result, compute_ms=ms, device=device)
        assert isinstance(result, AttentionResult)
        member = Member(index=0, job=job, spec=prepared.spec)
        return AttentionOutcome(result=self._on_host(member, result), compute_ms=ms, device=device)

    def _run_group(self, batch: list[Member]) -> list[AttentionOutcome]:
        started = time.perf_counter()
        results = [self._run_alone(batch[0])] if len(batch) == 1 else self._run_padded(batch)
        seconds = time.perf_counter() - started
        self.observe_compute(results[0].path, seconds, results[0].backend)
        device = str(self.device)
        return [
            AttentionOutcome(result=result, compute_ms=seconds * 1e3, device=device)
            for result in results
        ]

    def _attention_run(
        self,
        first: Member,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        masks: Masks,
        *,
        tiles: int = 1,
    ) -> AttentionRun:
        """sdpa_core's AttentionRun on the device with the group's options (those of its
        first job), in `tiles` tiles."""
        job, dev = first.job, self.device
        options = AttentionOptions(
            scale=job.scale,
            return_weights=job.return_weights,
            diagnostics=job.diagnostics,
            memory_budget_bytes=self.memory_budget_bytes,
            sink_tokens=self.sink_tokens,
            # Every job was prepared: validated once with its NaN/Inf scan. Padding adds only
            # zeros and (float masks) -inf, so prepared members make a checked batch too.
            check_finite=False,
            # On a GPU the result's overflow check runs on its copy on the host (_on_host,
            # _run_padded): there it is a reduction the device and the copy's one wait are
            # spared (issue 37: no stream synchronization per call beyond the answer's).
            check_overflow=self.device.type == "cpu",
        )
        return AttentionRun(
            to_device(q, dev),
            to_device(k, dev),
            to_device(v, dev),
            masks.to(dev, move=to_device),
            options,
            tiles=tiles,
        )

    def _run_alone(self, member: Member) -> AttentionResult:
        """A group of one: the request's own tensors, exactly the solo call."""
        job = member.job
        result = self._attention_run(member, job.q, job.k, job.v, job.masks).run()
        return self._on_host(member, result)

    def _on_host(self, member: Member, result: AttentionResult) -> AttentionResult:
        """A job's own result with its tensors on the CPU (as it is on a CPU device)."""
        if self.device.type == "cpu":
            return result
        output, weights, row_stats = results_on_host(
            result.output, result.weights, result.row_stats
        )
        _refuse_overflow(member, output, row_stats)
        return AttentionResult(
            output=output,
            weights=weights,
            diagnostics=member_diagnostics(row_stats, member.job, member.spec),
            row_stats=row_stats,
            path=result.path,
            backend=result.backend,
        )

    def _run_padded(self, batch: list[Member]) -> list[AttentionResult]:
        collated = collate(batch)
        result = self._attention_run(
            batch[0], collated.q, collated.k, collated.v, collated.masks
        ).run()
        results = split(collated, result)
        if self.device.type != "cpu":
            # (A member whose scores overflowed fails the batch: run_batch then runs each
            # member alone, so that only its own request is refused.)
            for member, own in zip(batch, results, strict=True):
                _refuse_overflow(member, own.output, own.row_stats)
        return results


def _refuse_overflow(member: Member, output: torch.Tensor, row_stats: RowStats | None) -> None:
    """sdpa_core's refusal of a result that overflowed, on its copy on the host (a GPU's run
    leaves it to us: check_overflow=False)."""
    scale = resolve_scale(member.job.scale, member.spec.d)
    check_no_overflow(output, row_stats, scale=scale, accum_dtype=member.spec.accum_dtype)


def _diagnostics_on_cpu(diagnostics: Diagnostics) -> Diagnostics:
    """Diagnostics with their per-head tensors on the CPU (summaries are floats already)."""
    return Diagnostics(
        summary=diagnostics.summary,
        per_head=type(diagnostics.per_head)(
            **{name: t.cpu() for name, t in diagnostics.per_head.as_dict().items()}
        ),
        per_row=None,
    )
