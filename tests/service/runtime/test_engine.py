"""Engine and batching policy against sdpa_core directly: a request batched with others (stacked,
padded, front-padded for bottom_right) gets what it gets alone — output, weights and per-request
diagnostics (summary, per_head, per_row) — and a bad request never reaches a batch.

The truth for batch invariance is sdpa_core.attention called on the request alone; one test
also checks a padded batch against a float64 softmax written here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdpa_core import (
    AnalysisRun,
    AttentionResult,
    AttentionRun,
    Masks,
    RowStats,
    SdpaError,
    analyze_scaling,
    attention,
    summarize,
    validate_inputs,
)
from service.metrics import Metrics
from service.runtime.device import resolve_device, to_host
from service.runtime.device import to_device as stage
from service.runtime.engine import Engine
from service.runtime.jobs import (
    AnalyzeJob,
    AnalyzeOutcome,
    AttentionJob,
    AttentionOutcome,
    Job,
    Outcome,
    PreparedJob,
    prepare,
)
from service.runtime.policy import length_bucket

BOTTOM_RIGHT = Masks(causal="bottom_right")

CPU = torch.device("cpu")


def tolerances(dtype: torch.dtype) -> dict[str, Any]:
    # Padding only changes float reduction order (and possibly the SDPA kernel on the fused
    # path), so the bounds are a few ulps of the accumulation dtype, not torch's loose ones.
    return {
        torch.float64: {"atol": 1e-12, "rtol": 1e-10},
        torch.float32: {"atol": 2e-6, "rtol": 2e-5},
        torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
        torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    }[dtype]


def solo(job: AttentionJob) -> AttentionResult:
    return attention(
        job.q,
        job.k,
        job.v,
        causal=job.masks.causal,
        key_lengths=job.masks.key_lengths,
        key_padding_mask=job.masks.key_padding_mask,
        attn_mask=job.masks.attn_mask,
        scale=job.scale,
        return_weights=job.return_weights,
        diagnostics=job.diagnostics,
    )


def assert_same_result(
    got: AttentionResult, want: AttentionResult, dtype: torch.dtype, *, loose: bool = False
) -> None:
    tol = tolerances(dtype)
    if loose:  # across CUDA kernels
        tol = {"atol": max(tol["atol"], 1e-4), "rtol": max(tol["rtol"], 1e-4)}
        if dtype in (torch.float16, torch.bfloat16):
            tol = tolerances(torch.bfloat16)
    stat_tol = tolerances(torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.output.shape == want.output.shape
    assert got.output.device.type == "cpu"
    torch.testing.assert_close(got.output, want.output, **tol)
    assert got.path == want.path
    if want.weights is None:
        assert got.weights is None
    else:
        assert got.weights is not None
        torch.testing.assert_close(got.weights, want.weights, **tol)
    if want.diagnostics is None:
        assert got.diagnostics is None
        return
    assert got.diagnostics is not None
    g, w = got.diagnostics, want.diagnostics
    for name, value in w.summary.as_dict().items():
        other = g.summary.as_dict()[name]
        if name == "masked_rows":
            assert other == value
        else:
            assert math.isclose(other, value, rel_tol=1e-4, abs_tol=1e-5), (name, other, value)
    for name, tensor in w.per_head.as_dict().items():
        other_t = g.per_head.as_dict()[name]
        assert other_t.shape == tensor.shape, name
        torch.testing.assert_close(other_t, tensor, atol=1e-5, rtol=1e-4, msg=name)
    if w.per_row is None:
        assert g.per_row is None
    else:
        assert g.per_row is not None
        for name, tensor in w.per_row.as_dict().items():
            other_t = g.per_row.as_dict()[name]
            assert other_t.shape == tensor.shape, name
            torch.testing.assert_close(other_t, tensor, **stat_tol, msg=name)


def run_and_compare(
    engine: Engine, jobs: Sequence[AttentionJob], *, expect_calls: int | None = 1
) -> list[AttentionOutcome]:
    outcomes: list[AttentionOutcome] = []
    for job, outcome in zip(jobs, engine.run_batch(prepared(jobs)), strict=True):
        assert isinstance(outcome, AttentionOutcome), outcome
        assert outcome.device == "cpu"
        assert outcome.compute_ms >= 0
        assert_same_result(outcome.result, solo(job), job.q.dtype)
        outcomes.append(outcome)
    if expect_calls is not None and engine._metrics is not None:
        result = outcomes[0].result
        calls = engine._metrics.registry.get_sample_value(
            "sdpa_compute_seconds_count",
            {"path": result.path, "backend": result.backend or "none"},
        )
        assert calls == expect_calls
    return outcomes


def make_engine(**kwargs: Any) -> Engine:
    return Engine(CPU, metrics=Metrics(), **kwargs)


def prepared(jobs: Sequence[Job]) -> list[PreparedJob]:
    """Jobs as the runtime takes them: validated once by prepare()."""
    return [prepare(job) for job in jobs]


def key(engine: Engine, job: Job) -> object:
    """The job's group key under the engine's batching policy."""
    return engine.policy.group_key(prepare(job))


def cost(engine: Engine, job: Job) -> float:
    """The job's batch cost under the engine's batching policy."""
    return engine.policy.batch_cost(prepare(job))


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def make_job(
    gen: torch.Generator,
    lead: tuple[int, ...],
    n_q: int,
    n_kv: int,
    *,
    heads: int = 4,
    kv_heads: int | None = None,
    d: int = 16,
    d_v: int | None = None,
    dtype: torch.dtype = torch.float32,
    key_lengths: str | None = None,  # None | "seq" | "head"
    key_padding_mask: str | None = None,
    attn_mask: str | None = None,  # None | "bool" | "bool_heads" | "float"
    causal: bool | str = False,
    **options: Any,
) -> AttentionJob:
    kv_heads = kv_heads or heads
    d_v = d_v or d
    q = randn(gen, *lead, heads, n_q, d, dtype=dtype)
    k = randn(gen, *lead, kv_heads, n_kv, d, dtype=dtype)
    v = randn(gen, *lead, kv_heads, n_kv, d_v, dtype=dtype)
    seq_shape, head_shape = lead, (*lead, heads)
    kl = kpm = mask = None
    if key_lengths is not None:
        shape = seq_shape if key_lengths == "seq" else head_shape
        kl = torch.randint(1, n_kv + 1, shape, generator=gen, dtype=torch.int64)
    if key_padding_mask is not None:
        shape = (*(seq_shape if key_padding_mask == "seq" else head_shape), n_kv)
        kpm = torch.rand(shape, generator=gen) < 0.3
        kpm[..., 0] = False  # keep one key, as clients usually do (fully masked rows: own test)
    if attn_mask == "bool":
        mask = torch.rand(n_q, n_kv, generator=gen) < 0.7  # broadcast over batch and heads
    elif attn_mask == "bool_heads":
        mask = torch.rand(*lead, heads, n_q, n_kv, generator=gen) < 0.7
    elif attn_mask == "float":
        mask = randn(gen, 1, n_q, n_kv, dtype=dtype)
        mask[..., 1] = -math.inf
    masks = Masks(causal=causal, key_lengths=kl, key_padding_mask=kpm, attn_mask=mask)
    return AttentionJob(q=q, k=k, v=v, masks=masks, **options)


# Mixed leading dims (4-D, 3-D, 5-D) and lengths within one bucket (33..40 for both).
SHAPES = [((2,), 33, 40), ((), 40, 34), ((2, 3), 37, 38), ((1,), 40, 40), ((), 35, 33)]

OPTIONS: list[dict[str, Any]] = [
    {},
    {"diagnostics": "summary"},
    {"diagnostics": "full"},
    {"return_weights": True},
    {"return_weights": True, "diagnostics": "full"},
    {"causal": True, "diagnostics": "full"},
    {"causal": "bottom_right", "return_weights": True, "diagnostics": "full"},
    {"causal": "bottom_right"},
    {"causal": "top_left"},
    {"key_lengths": "seq", "diagnostics": "summary"},
    {"key_lengths": "head", "return_weights": True},
    {"key_padding_mask": "seq", "diagnostics": "full", "causal": "bottom_right"},
    {"key_padding_mask": "head", "return_weights": True, "diagnostics": "summary"},
    {"attn_mask": "bool", "diagnostics": "full"},
    {"attn_mask": "bool_heads", "return_weights": True, "causal": True},
    {"attn_mask": "float", "return_weights": True, "diagnostics": "full"},
    {"attn_mask": "float", "causal": "bottom_right"},
    {"scale": 0.05, "diagnostics": "summary"},
    {"scale": -0.3, "return_weights": True},
    {"kv_heads": 2, "diagnostics": "full", "key_lengths": "seq"},
    {"kv_heads": 1, "return_weights": True, "causal": "bottom_right"},
    {"d_v": 8, "diagnostics": "summary"},
    {"dtype": torch.float64, "return_weights": True, "diagnostics": "full"},
    {"dtype": torch.bfloat16, "diagnostics": "summary"},
    {"dtype": torch.float16, "return_weights": True},
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_mixed_shapes_batched_equal_solo(options: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(7)
    jobs = [make_job(gen, lead, n_q, n_kv, **options) for lead, n_q, n_kv in SHAPES]
    engine = make_engine()
    assert len({key(engine, job) for job in jobs}) == 1  # they really share one call
    run_and_compare(engine, jobs, expect_calls=1)


@pytest.mark.parametrize("options", [{}, {"diagnostics": "full"}, {"attn_mask": "float"}])
def test_prepared_jobs_carry_their_validation(options: dict[str, Any]) -> None:
    """prepare() validates each job once (with the NaN/Inf scan) and hands the engine its
    InputSpec; the engine trusts it instead of scanning again. Alone and batched, padded or
    not, the results are those of sdpa_core's own (validating) call. Only prepare() can make a
    PreparedJob."""
    gen = torch.Generator().manual_seed(12)
    jobs = [make_job(gen, lead, n_q, n_kv, **options) for lead, n_q, n_kv in SHAPES]
    for job in jobs:
        spec = validate_inputs(job.q, job.k, job.v, job.masks)
        prepared_job = prepare(job)
        assert prepared_job.spec == spec
        with pytest.raises(TypeError, match="prepare"):
            PreparedJob(job=job, spec=spec)
        with pytest.raises(TypeError, match="prepare"):  # no copy with another job either
            replace(prepared_job, job=replace(job, q=job.q * math.nan))
    engine = make_engine()
    for batch in (jobs, jobs[:1]):
        run_and_compare(engine, batch, expect_calls=None)


def test_same_shape_requests_are_stacked_and_equal_solo() -> None:
    gen = torch.Generator().manual_seed(1)
    jobs = [make_job(gen, (1,), 64, 64, diagnostics="full") for _ in range(6)]
    run_and_compare(make_engine(), jobs, expect_calls=1)


def test_two_d_requests_keep_their_shape() -> None:
    gen = torch.Generator().manual_seed(2)
    jobs = [
        AttentionJob(
            q=randn(gen, n_q, 8),
            k=randn(gen, n_kv, 8),
            v=randn(gen, n_kv, 8),
            return_weights=True,
            diagnostics="full",
        )
        for n_q, n_kv in [(9, 10), (10, 9), (10, 10)]
    ]
    outcomes = run_and_compare(make_engine(), jobs, expect_calls=1)
    assert outcomes[0].result.output.shape == (9, 8)
    assert outcomes[0].result.weights is not None
    assert outcomes[0].result.weights.shape == (9, 10)
    per_row = outcomes[0].result.diagnostics.per_row  # type: ignore[union-attr]
    assert per_row is not None
    assert per_row.entropy.shape == (9,)


def test_fully_masked_rows_counted_per_request() -> None:
    """bottom_right with N_q > N_kv leaves the first rows without keys: masked_rows is the
    request's own count, not the batch's (whose padded rows are also empty)."""
    gen = torch.Generator().manual_seed(3)
    jobs = [
        make_job(gen, (1,), n_q, n_kv, causal="bottom_right", diagnostics="full")
        for n_q, n_kv in [(40, 34), (36, 40), (38, 33)]
    ]
    outcomes = run_and_compare(make_engine(), jobs)
    heads = 4
    for job, outcome in zip(jobs, outcomes, strict=True):
        n_q, n_kv = job.q.shape[-2], job.k.shape[-2]
        diag = outcome.result.diagnostics
        assert diag is not None
        assert diag.summary.masked_rows == heads * max(0, n_q - n_kv)


def test_padded_batch_against_float64_reference() -> None:
    """Independent of sdpa_core: softmax(q k^T * scale + masks) v written out here."""
    gen = torch.Generator().manual_seed(4)
    jobs = [
        make_job(gen, lead, n_q, n_kv, dtype=torch.float64, causal=causal, return_weights=True,
                 key_lengths="seq")
        for lead, n_q, n_kv, causal in [
            ((2,), 18, 20, "bottom_right"), ((1,), 20, 17, "bottom_right"),
            ((2,), 19, 19, "bottom_right"),
        ]
    ]  # fmt: skip
    engine = make_engine()
    assert len({key(engine, job) for job in jobs}) == 1  # one padded call
    outcomes = engine.run_batch(prepared(jobs))
    for job, outcome in zip(jobs, outcomes, strict=True):
        assert isinstance(outcome, AttentionOutcome)
        q, k, v = job.q, job.k, job.v
        n_q, n_kv, d = q.shape[-2], k.shape[-2], q.shape[-1]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)  # [B, H, N_q, N_kv]
        i = torch.arange(n_q).unsqueeze(-1)
        j = torch.arange(n_kv)
        visible = j <= i + (n_kv - n_q)  # [N_q, N_kv] bottom-right causal
        lengths = job.masks.key_lengths
        assert isinstance(lengths, torch.Tensor)
        visible = visible & (j < lengths.reshape(-1, 1, 1, 1))  # [B, 1, N_q, N_kv]
        scores = scores.masked_fill(~visible, -math.inf)
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows -> 0
        torch.testing.assert_close(outcome.result.weights, weights, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(outcome.result.output, weights @ v, atol=1e-12, rtol=1e-10)


def test_bad_request_fails_alone() -> None:
    """Each bad job fails prepare() with its own SdpaError naming the parameter, so it never
    joins a batch; the good ones run as one batch and equal their solo calls."""
    gen = torch.Generator().manual_seed(5)
    good = [make_job(gen, (1,), 33, 40, diagnostics="summary") for _ in range(3)]
    nan_q = good[0].q.clone()
    nan_q[0, 0, 0, 0] = math.nan
    too_long = torch.tensor([41])
    bad = [
        AttentionJob(q=nan_q, k=good[0].k, v=good[0].v, diagnostics="summary"),
        AttentionJob(q=good[1].q, k=good[1].k, v=good[1].v, masks=Masks(key_lengths=too_long),
                     diagnostics="summary"),
        AttentionJob(q=good[2].q, k=good[2].k[..., :8], v=good[2].v, diagnostics="summary"),
        AttentionJob(q=good[2].q[0, 0, 0], k=good[2].k, v=good[2].v, diagnostics="summary"),
        AttentionJob(q=good[2].q, k=good[2].k, v=good[2].v, diagnostics="everything"),
    ]  # fmt: skip
    params = []
    for job in bad:
        with pytest.raises(SdpaError) as raised:
            prepare(job)
        params.append(raised.value.param)
    assert params == ["q", "key_lengths", "k", "q", "diagnostics"]
    run_and_compare(make_engine(), good, expect_calls=1)


def test_a_failing_batch_is_retried_one_by_one() -> None:
    """If the batched call itself fails, each member runs alone: one whose own call fails gets
    its own exception, the others their results."""
    gen = torch.Generator().manual_seed(15)
    jobs = [make_job(gen, (1,), 33, 40, diagnostics="summary") for _ in range(3)]
    batch = prepared(jobs)
    # A job whose tensors turn bad after validation (the engine trusts its spec): its key
    # padding refers to more keys than it has, so the padded call and its own call both fail.
    job = batch[1].job
    broken = replace(job, masks=replace(job.masks, key_lengths=torch.tensor([10**6])))
    assert isinstance(broken, AttentionJob)
    object.__setattr__(batch[1], "job", broken)
    outcomes = make_engine().run_batch(batch)
    assert isinstance(outcomes[1], Exception)
    for index in (0, 2):
        outcome = outcomes[index]
        assert isinstance(outcome, AttentionOutcome), outcome
        assert_same_result(outcome.result, solo(jobs[index]), torch.float32)


def test_analyze_job_runs_alone_and_equals_analyze_scaling() -> None:
    gen = torch.Generator().manual_seed(6)
    q, k = randn(gen, 2, 32, 64), randn(gen, 2, 40, 64)
    engine = make_engine()
    job = AnalyzeJob(q=q, k=k, strategies=("sqrt_dk", ("custom", 3.0)), masks=BOTTOM_RIGHT)
    other = make_job(gen, (1,), 33, 40)
    assert key(engine, job) != key(
        engine, AnalyzeJob(q=q, k=k, strategies=job.strategies, masks=job.masks)
    )
    outcomes = engine.run_batch(prepared([job, other]))
    assert isinstance(outcomes[0], AnalyzeOutcome)
    assert isinstance(outcomes[1], AttentionOutcome)
    want = analyze_scaling(q, k, strategies=job.strategies, causal="bottom_right")
    assert outcomes[0].report == want


def test_group_key_separates_every_option_that_changes_the_math() -> None:
    gen = torch.Generator().manual_seed(8)
    engine = make_engine()
    base = make_job(gen, (1,), 40, 40)
    base_key = key(engine, base)
    variants: list[AttentionJob] = [
        make_job(gen, (1,), 40, 40, dtype=torch.float64),
        make_job(gen, (1,), 40, 40, d=32),
        make_job(gen, (1,), 40, 40, d_v=8),
        make_job(gen, (1,), 40, 40, heads=8),
        make_job(gen, (1,), 40, 40, kv_heads=2),
        make_job(gen, (1,), 40, 40, causal=True),
        make_job(gen, (1,), 40, 40, causal="bottom_right"),
        make_job(gen, (1,), 40, 40, scale=0.5),
        make_job(gen, (1,), 40, 40, return_weights=True),
        make_job(gen, (1,), 40, 40, diagnostics="summary"),
        make_job(gen, (1,), 40, 40, diagnostics="full"),
        make_job(gen, (1,), 40, 40, attn_mask="bool"),
        make_job(gen, (1,), 40, 40, attn_mask="float"),
        make_job(gen, (1,), 41, 40),  # next N_q bucket
        make_job(gen, (1,), 40, 41),  # next N_kv bucket
    ]
    keys = [key(engine, job) for job in variants]
    assert base_key not in keys
    assert len(set(keys)) == len(keys)
    # What does not change the math shares the key: lengths in the bucket, batch dims, the
    # request's own key_lengths / key_padding_mask, and causal True == "top_left".
    same = [
        make_job(gen, (3, 2), 33, 35),
        make_job(gen, (), 36, 40),
        make_job(gen, (1,), 40, 40, key_lengths="head"),
        make_job(gen, (1,), 40, 40, key_padding_mask="seq"),
    ]
    assert {key(engine, job) for job in same} == {base_key}
    assert key(engine, make_job(gen, (1,), 40, 40, causal=True)) == key(
        engine, make_job(gen, (1,), 40, 40, causal="top_left")
    )


def test_length_bucket_rule() -> None:
    # Three significant bits: hand-listed start of the sequence.
    assert [length_bucket(n) for n in range(1, 18)] == [
        1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20,
    ]  # fmt: skip
    assert [length_bucket(n) for n in (33, 40, 41, 64, 65, 129, 1000, 4096, 4097)] == [
        40, 40, 48, 64, 80, 160, 1024, 4096, 5120,
    ]  # fmt: skip
    for n in range(1, 20000):
        b = length_bucket(n)
        assert n <= b < 1.25 * n or b == n  # padding per length under 25%
        assert length_bucket(b) == b
        assert len(bin(b)[2:].rstrip("0")) <= 3  # at most three significant bits
        assert b == n or length_bucket(n - 1) <= b  # monotone


def test_memory_cap_splits_a_group_into_sub_batches() -> None:
    gen = torch.Generator().manual_seed(9)
    jobs = [make_job(gen, (1,), 40, 40, return_weights=True) for _ in range(5)]
    one = 4 * 40 * 40 * 4  # bytes of one request's float32 weights [1, 4, 40, 40]
    engine = make_engine(max_batch_score_bytes=2 * one)
    run_and_compare(engine, jobs, expect_calls=3)  # 2 + 2 + 1


def test_batch_cost_bounds_the_padded_score_bytes() -> None:
    """The costs of a group's members add up to at least its padded score matrix's bytes."""
    gen = torch.Generator().manual_seed(11)
    engine = make_engine(max_batch_score_bytes=1 << 30)
    jobs = [make_job(gen, lead, n_q, n_kv) for lead, n_q, n_kv in SHAPES]
    rows = sum(math.prod(job.q.shape[:-3]) for job in jobs)
    padded = rows * 4 * max(j.q.shape[-2] for j in jobs) * max(j.k.shape[-2] for j in jobs) * 4
    assert sum(cost(engine, job) for job in jobs) >= padded
    assert cost(engine, AnalyzeJob(q=jobs[0].q, k=jobs[0].k)) == 0.0


def test_cpu_batches_are_cache_sized_and_big_requests_run_alone() -> None:
    """On CPU (1 MiB of scores per call): [1, 8, 256, 256] requests (2 MiB each) get a key of
    their own; [1, 4, 64, 64] ones (64 KiB) share one, and 32 of them run as 2 calls."""
    gen = torch.Generator().manual_seed(12)
    engine = make_engine()
    assert engine.policy.max_batch_cost == 1 << 20
    big = [make_job(gen, (1,), 256, 256, heads=8, d=8) for _ in range(2)]
    assert key(engine, big[0]) != key(engine, big[1])
    small = [make_job(gen, (1,), 64, 64, d=8) for _ in range(32)]
    assert len({key(engine, job) for job in small}) == 1
    run_and_compare(engine, small, expect_calls=2)


def test_warmup_and_resolve_device() -> None:
    make_engine().warmup()
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device("cpu") == CPU
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            resolve_device("cuda")
        with pytest.raises(RuntimeError, match="CUDA"):
            resolve_device("cuda:1")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(
        # Lengths within one bucket (17..20), so that every example is one padded call.
        st.tuples(st.integers(17, 20), st.integers(17, 20), st.sampled_from([(), (1,), (2,)])),
        min_size=2,
        max_size=5,
    ),
    causal=st.sampled_from([False, True, "bottom_right"]),
    weights=st.booleans(),
    level=st.sampled_from(["none", "summary", "full"]),
    key_lengths=st.sampled_from([None, "seq", "head"]),
    seed=st.integers(0, 2**16),
)
def test_property_any_group_batched_equals_solo(
    lengths: list[tuple[int, int, tuple[int, ...]]],
    causal: bool | str,
    weights: bool,
    level: str,
    key_lengths: str | None,
    seed: int,
) -> None:
    """Whatever lengths and batch dims share a call, each request equals its solo call."""
    gen = torch.Generator().manual_seed(seed)
    jobs = [
        make_job(gen, lead, n_q, n_kv, heads=2, d=8, causal=causal, return_weights=weights,
                 diagnostics=level, key_lengths=key_lengths)
        for n_q, n_kv, lead in lengths
    ]  # fmt: skip
    run_and_compare(make_engine(), jobs, expect_calls=1)


def to_device(job: AttentionJob, device: torch.device) -> AttentionJob:
    return replace(
        job,
        q=job.q.to(device),
        k=job.k.to(device),
        v=job.v.to(device),
        masks=job.masks.to(device),
    )


def result_to_cpu(result: AttentionResult, level: str, *, scale: float) -> AttentionResult:
    rows = result.row_stats
    cpu_rows = None if rows is None else RowStats(**{n: t.cpu() for n, t in rows.as_dict().items()})
    return AttentionResult(
        output=result.output.cpu(),
        weights=None if result.weights is None else result.weights.cpu(),
        diagnostics=None
        if cpu_rows is None or level == "none"
        else summarize(cpu_rows, scale=scale, level="full" if level == "full" else "summary"),
        row_stats=cpu_rows,
        path=result.path,
        backend=result.backend,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_batched_equals_solo_on_device() -> None:
    """On CUDA: each request of a padded batch equals its solo call on the same device."""
    gen = torch.Generator().manual_seed(10)
    device = torch.device("cuda")
    engine = Engine(device, metrics=Metrics())
    engine.warmup()
    for options in OPTIONS:
        # An explicit scale (1.0 unless the option names one), which both sides' summaries use:
        # the solo result's row statistics are summarized again on the host with it.
        opts = {**options, "scale": options.get("scale", 1.0)}
        jobs = [make_job(gen, lead, n_q, n_kv, **opts) for lead, n_q, n_kv in SHAPES]
        outcomes = engine.run_batch(prepared(jobs))
        for job, outcome in zip(jobs, outcomes, strict=True):
            assert isinstance(outcome, AttentionOutcome), outcome
            assert outcome.device.startswith("cuda")
            assert job.scale is not None
            want = result_to_cpu(solo(to_device(job, device)), job.diagnostics, scale=job.scale)
            # GPU kernels change with the mask (flash without, efficient/math with): allow
            # float32 1e-4 there; diagnostics are float32 statistics either way.
            dtype = job.q.dtype
            gpu_dtype = torch.float16 if dtype in (torch.float16, torch.bfloat16) else dtype
            assert_same_result(outcome.result, want, gpu_dtype, loose=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_overflow_is_refused_from_the_host_copy() -> None:
    """On CUDA the run leaves the overflow check to the engine (check_overflow=False: no
    reduction of the output and no wait for the device per call), which refuses the result on
    its host copy as attention() would (param "scale"): alone, and in a batch beside a sound
    request, which is answered as its solo call."""
    device = torch.device("cuda")
    engine = Engine(device, metrics=Metrics())
    gen = torch.Generator().manual_seed(31)
    huge = torch.full((1, 4, 8, 16), 1e19)  # q.k.scale = 1.6e40: past float32's range
    bad = AttentionJob(q=huge, k=huge.clone(), v=huge.clone(), scale=10.0)
    good = make_job(gen, (1,), 8, 8, d=16, scale=10.0)
    for jobs in ([bad], [bad, good]):
        outcomes = engine.run_batch(prepared(jobs))
        assert isinstance(outcomes[0], SdpaError), outcomes[0]
        assert outcomes[0].param == "scale"
        if len(jobs) == 2:
            answered = outcomes[1]
            assert isinstance(answered, AttentionOutcome), answered
            want = result_to_cpu(solo(to_device(good, device)), "none", scale=10.0)
            assert_same_result(answered.result, want, torch.float32, loose=True)


# -- long jobs: sdpa_core's run, stepped as it is ----------------------------------------


def run_long(
    engine: Engine, job: AttentionJob | AnalyzeJob, tiles: int
) -> tuple[AttentionRun | AnalysisRun, Outcome, list[float]]:
    """start_long's run stepped to its end as the runtime steps it (service.runtime.long_runs:
    each tile's seconds told to note_tile and summed, the result made the job's Outcome by
    finish_long) -> the run, the Outcome, and share_done after each step."""
    prepared = prepare(job)
    run = engine.start_long(prepared, tiles)
    assert run.share_done == 0.0
    shares: list[float] = []
    done, seconds = False, 0.0
    while not done:
        started = time.perf_counter()
        done = run.step()
        took = time.perf_counter() - started
        engine.note_tile(run, took)
        seconds += took
        shares.append(run.share_done)
    return run, engine.finish_long(prepared, run.result(), seconds), shares


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_a_long_job_in_tiles_equals_the_solo_call(options: dict[str, Any]) -> None:
    """start_long's run, stepped tile by tile as the runtime does, gives the solo call's
    result (output, weights, diagnostics) for every option; each tile is one observation of
    sdpa_compute_seconds."""
    gen = torch.Generator().manual_seed(21)
    job = make_job(gen, (2, 3), 37, 38, **options)
    engine = make_engine()
    run, outcome, shares = run_long(engine, job, 7)
    steps = len(shares)
    assert isinstance(outcome, AttentionOutcome), outcome
    assert steps == run.tiles_total == run.tiles_done >= 6  # six sequences at least
    assert shares == sorted(shares)
    assert 0 < shares[0] < 1
    assert shares[-1] == 1.0
    assert_same_result(outcome.result, solo(job), job.q.dtype)
    result = outcome.result
    assert engine._metrics is not None
    observed = engine._metrics.registry.get_sample_value(
        "sdpa_compute_seconds_count", {"path": result.path, "backend": result.backend or "none"}
    )
    assert observed == steps
    assert outcome.compute_ms > 0


def test_a_long_analyze_job_in_tiles_equals_analyze_scaling() -> None:
    gen = torch.Generator().manual_seed(22)
    q, k = randn(gen, 2, 4, 32, 16), randn(gen, 2, 4, 40, 16)
    job = AnalyzeJob(q=q, k=k, strategies=("sqrt_dk", ("tiny", 1e-40)), masks=BOTTOM_RIGHT)
    run, outcome, _ = run_long(make_engine(), job, 9)
    assert isinstance(outcome, AnalyzeOutcome), outcome
    assert run.tiles_total == 6  # 3 passes x 2 sequences (32 rows: one chunked row tile)
    want = analyze_scaling(q, k, strategies=job.strategies, causal="bottom_right")
    assert outcome.report.raw_score_variance == pytest.approx(want.raw_score_variance, rel=1e-6)
    for got, expected in zip(outcome.report.strategies, want.strategies, strict=True):
        assert got.entropy == pytest.approx(expected.entropy, rel=1e-5, abs=1e-7)
        assert got.max_weight == pytest.approx(expected.max_weight, rel=1e-5, abs=1e-7)


def test_a_long_job_that_fails_ends_with_its_own_error() -> None:
    """Scaled scores that overflow float32 are found once the whole result is there: every
    tile runs, and the run's result() raises the error attention() raises (the runtime makes it
    the request's answer: test_long_runs.py)."""
    q = torch.full((1, 1, 8, 4), 1e19)
    job = AttentionJob(q=q, k=q.clone(), v=q.clone(), scale=10.0)
    with pytest.raises(SdpaError) as direct:
        solo(job)
    with pytest.raises(SdpaError) as tiled:
        run_long(make_engine(), job, 4)
    assert type(tiled.value) is type(direct.value)
    assert tiled.value.param == direct.value.param


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_long_jobs_and_pinned_copies() -> None:
    """On CUDA: a long job's tiles equal the solo call on the device, and its tensors come
    back through pinned memory (to_host) intact and on the CPU."""
    device = torch.device("cuda")
    engine = Engine(device, metrics=Metrics())
    gen = torch.Generator().manual_seed(23)
    for options in ({"causal": "bottom_right", "diagnostics": "full"}, {"return_weights": True}):
        job = make_job(gen, (2,), 40, 36, **{**options, "scale": 1.0})
        _, outcome, _ = run_long(engine, job, 5)
        assert isinstance(outcome, AttentionOutcome), outcome
        assert outcome.result.output.device.type == "cpu"
        want = result_to_cpu(solo(to_device(job, device)), job.diagnostics, scale=1.0)
        assert_same_result(outcome.result, want, torch.float32, loose=True)

    host = torch.randn(3, 5, 7, generator=gen)
    on_gpu = stage(host, device)
    assert on_gpu.device.type == "cuda"
    back, nothing = to_host([on_gpu * 2, None])
    assert nothing is None
    assert back is not None
    assert back.device.type == "cpu"
    assert back.is_pinned()
    assert torch.equal(back, host * 2)
