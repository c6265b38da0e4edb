"""The compiled statistics kernel (sdpa_core.stats_kernel) against the float64 reference and
the eager loop: every statistic, mask option, input dtype and scale it takes.

Compiling takes seconds (tens on a cold inductor cache), once for the module: slow.
"""

from __future__ import annotations

import math
import shutil
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdpa_core import AttentionResult, attention
from sdpa_core.stats_kernel import (
    KernelStats,
    compile_kernels,
    kernel_mode,
    kernel_stats,
)
from tests.core.reference import ATOL, RTOL, reference_attention, reference_rows, visibility

pytestmark = pytest.mark.slow


def _unique_graphs() -> int:
    """The graphs dynamo compiled in this process. Imported here, not at the top: collecting
    this (slow) module, as `make unit` does before deselecting it, need not import dynamo."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module", autouse=True)
def kernel() -> KernelStats:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: inductor cannot build the kernel")
    stats = compile_kernels()
    assert stats.compiled, stats.reason
    return stats


def _kernel_and_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, must_run: bool = True, **kw: Any
) -> tuple[AttentionResult, AttentionResult]:
    """attention() with diagnostics "full" on the chunked path, with the kernel (asserting that
    it ran compiled, unless must_run is False: a block of one key or one row runs eagerly, and
    so does every block of a scale too small to fold) and with the eager loop."""
    before, graphs = kernel_stats(), _unique_graphs()
    with kernel_mode("always"):  # these tiles are small: "auto" would run the eager loop
        fast = attention(q, k, v, diagnostics="full", path="chunked", **kw)
    after = kernel_stats()
    assert after.calls > before.calls or not must_run, "the compiled kernel did not run"
    assert _unique_graphs() == graphs, "a request compiled a graph"
    with kernel_mode("off"):
        calls = kernel_stats().calls
        eager = attention(q, k, v, diagnostics="full", path="chunked", **kw)
        assert kernel_stats().calls == calls  # the eager loop, really
    return fast, eager


_MASKS: dict[str, dict[str, Any]] = {
    "none": {},
    "causal": {"causal": True},
    "bottom_right": {"causal": "bottom_right"},
    "key_lengths": {"key_lengths": torch.tensor([3, 70])},
    "padding": {"key_padding_mask": torch.arange(70).remainder(5).eq(0).expand(2, 70)},
    "bool_mask": {
        "attn_mask": torch.rand(40, 70, generator=torch.Generator().manual_seed(3)) < 0.4
    },
    "float_bias": {
        "attn_mask": torch.randn(40, 70, generator=torch.Generator().manual_seed(4)).masked_fill(
            torch.rand(40, 70, generator=torch.Generator().manual_seed(5)) < 0.2, -math.inf
        )
    },
    "causal_and_lengths": {"causal": True, "key_lengths": torch.tensor([0, 50])},
}


@pytest.mark.parametrize("mask", list(_MASKS))
@pytest.mark.parametrize("scale", [None, -0.7, 2e-5, 40.0])
def test_every_statistic_matches_the_float64_reference(mask: str, scale: float | None) -> None:
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 40, 16, generator=gen)
    k = torch.randn(2, 2, 70, 16, generator=gen)  # GQA: two query heads per kv head
    v = torch.randn(2, 2, 70, 8, generator=gen)
    kw = _MASKS[mask]
    fast, _ = _kernel_and_eager(q, k, v, scale=scale, block_size=32, **kw)
    s = 0.25 if scale is None else scale
    bias = kw.get("attn_mask") if kw.get("attn_mask", torch.ones(1)).is_floating_point() else None
    kl = kw.get("key_lengths")
    kpm = kw.get("key_padding_mask")
    vis = visibility(
        b=2,
        h=4,
        n_q=40,
        n_kv=70,
        causal={True: "top_left"}.get(kw.get("causal", "none"), kw.get("causal", "none")),
        key_lengths=None if kl is None else kl.tolist(),
        key_padding_mask=kpm,
        attn_mask=kw.get("attn_mask"),
    )
    ref = reference_attention(q, k, v, vis, scale=s, bias=bias)
    rows = reference_rows(ref, scale=s, bias=bias)
    assert fast.row_stats is not None
    assert fast.diagnostics is not None
    # fp32 scores carry an absolute error of about eps x |score|, which the softmax turns into
    # the same absolute error on the weights: the tolerance grows with the largest score.
    atol = 2e-5 + 4e-7 * float((ref.raw * s).abs().max())
    torch.testing.assert_close(fast.output.double(), ref.out, atol=atol, rtol=1e-4)
    active = rows.visible_keys > 0
    for name in ("entropy", "max_weight", "grad_health", "jacobian_fro"):
        got = getattr(fast.row_stats, name).double().numpy()
        np.testing.assert_allclose(got, getattr(rows, name), atol=atol, rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(
        fast.row_stats.lse.double().numpy()[active], rows.lse[active], atol=5 * atol, rtol=1e-5
    )
    np.testing.assert_array_equal(fast.row_stats.visible_keys.numpy(), rows.visible_keys)
    summary = fast.diagnostics.summary
    assert summary.masked_rows == rows.masked_rows
    assert summary.score_mean_raw == pytest.approx(rows.pooled_mean_raw, rel=1e-4, abs=1e-5)
    assert summary.score_variance_raw == pytest.approx(rows.pooled_var_raw, rel=1e-4)
    assert summary.score_abs_max_scaled == pytest.approx(abs(s) * rows.abs_max_raw, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_entropy_near_zero_does_not_cancel(dtype: torch.dtype) -> None:
    """One-hot rows (a key far above the others) at a large scale, from low-precision inputs:
    entropy = log l - t / l is computed from the "rest" sums, never as lse - E[s] (which
    would cancel to noise of the size of the scores)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 24, 32, generator=gen)
    k = torch.randn(1, 2, 48, 32, generator=gen) * 0.1
    k[:, :, 7] = q[:, :, 0] * 3.0  # key 7 stands out for every query like query 0
    k[:, :, 9] = q.mean(2) * 2.0
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(1, 2, 48, 8, generator=gen).to(dtype)
    for scale in (4.0, 60.0):
        fast, eager = _kernel_and_eager(q, k, v, scale=scale)
        ref = reference_attention(q, k, v, torch.ones(1, 2, 24, 48, dtype=torch.bool), scale=scale)
        rows = reference_rows(ref, scale=scale)
        assert fast.row_stats is not None
        assert eager.row_stats is not None
        got = fast.row_stats.entropy.double().numpy()
        assert (got >= 0).all()
        np.testing.assert_allclose(got, rows.entropy, atol=1e-6, rtol=1e-3)
        np.testing.assert_allclose(
            fast.row_stats.grad_health.double().numpy(), rows.grad_health, atol=1e-9, rtol=1e-3
        )
        assert rows.entropy.min() < 1e-4  # the case is the near-one-hot one
        torch.testing.assert_close(fast.row_stats.entropy, eager.row_stats.entropy)


@st.composite
def _problems(draw: st.DrawFn) -> dict[str, Any]:
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 3]))
    b = draw(st.integers(1, 2))
    n_q = draw(st.integers(2, 40))
    n_kv = draw(st.integers(2, 50))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    std = draw(st.sampled_from([0.1, 1.0, 6.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    q = (torch.randn(b, h, n_q, 8, generator=gen) * std).to(dtype)
    k = (torch.randn(b, h_kv, n_kv, 8, generator=gen) * std).to(dtype)
    v = torch.randn(b, h_kv, n_kv, 5, generator=gen).to(dtype)
    kw: dict[str, Any] = {"causal": draw(st.sampled_from([False, "top_left", "bottom_right"]))}
    if draw(st.booleans()):
        kw["key_lengths"] = torch.tensor([draw(st.integers(0, n_kv)) for _ in range(b)])
    if draw(st.booleans()):
        kw["key_padding_mask"] = torch.rand(b, n_kv, generator=gen) < 0.3
    mask = draw(st.sampled_from(["none", "bool", "float"]))
    if mask == "bool":
        kw["attn_mask"] = torch.rand(n_q, n_kv, generator=gen) < 0.7
    elif mask == "float":
        kw["attn_mask"] = torch.randn(n_q, n_kv, generator=gen).to(dtype)
    kw["scale"] = draw(st.sampled_from([None, 1.0, -0.5, 3e-6, 8.0]))
    kw["block_size"] = draw(st.integers(2, 24))
    kw["sink_tokens"] = draw(st.integers(0, 5))
    return {"q": q, "k": k, "v": v, "kw": kw}


@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(_problems())
def test_property_kernel_equals_the_eager_loop(problem: dict[str, Any]) -> None:
    q, k, v, kw = problem["q"], problem["k"], problem["v"], problem["kw"]
    fast, eager = _kernel_and_eager(q, k, v, must_run=False, **kw)
    # The output comes back in the input dtype: one rounding apart at most.
    dt = q.dtype
    torch.testing.assert_close(
        fast.output, eager.output, rtol=max(1e-4, RTOL[dt]), atol=max(1e-5, ATOL[dt])
    )
    assert fast.row_stats is not None
    assert eager.row_stats is not None
    for name, got in fast.row_stats.as_dict().items():
        want = getattr(eager.row_stats, name)
        if name == "visible_keys":
            assert torch.equal(got, want)
        elif name == "score_m2_raw":  # a sum of squares: relative to its own size
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.max()) + 1e-6)
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)
    assert fast.diagnostics is not None
    assert eager.diagnostics is not None
    for name, val in eager.diagnostics.summary.as_dict().items():
        got_val = fast.diagnostics.summary.as_dict()[name]
        assert got_val == pytest.approx(val, rel=1e-4, abs=1e-5), name


def test_sink_share_when_a_sink_key_holds_the_row_max() -> None:
    """At a huge scale one rounding step of a score is a sizeable share of e^(s - m): the sink's
    exponentials must be the very ones the softmax summed (a review found 0.61 for 1.0 when
    they were recomputed apart)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 96, 16, generator=gen)
    k = torch.randn(1, 2, 96, 16, generator=gen)
    k[:, :, 0] = q.mean(2) * 4.0  # key 0, a sink key, is every row's favourite
    v = torch.randn(1, 2, 96, 8, generator=gen)
    for scale in (1.0, 1e3, 1e6):
        fast, eager = _kernel_and_eager(q, k, v, scale=scale, causal=True, block_size=32)
        assert fast.row_stats is not None
        assert eager.row_stats is not None
        torch.testing.assert_close(fast.row_stats.sink_share, eager.row_stats.sink_share)


def test_threads_share_the_kernel_without_compiling_or_changing_torch_settings() -> None:
    gen = torch.Generator().manual_seed(4)
    problems = [
        tuple(torch.randn(1, 2, 40 + 8 * i, 16, generator=gen) for _ in range(3)) for i in range(3)
    ]
    with kernel_mode("off"):
        want = [attention(*p, diagnostics="summary").diagnostics for p in problems]
    assert all(d is not None for d in want)
    graphs = _unique_graphs()
    got: dict[int, list[Any]] = {}

    def work(i: int) -> None:
        with kernel_mode("always"):
            got[i] = [attention(*problems[i], diagnostics="summary").diagnostics for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert _unique_graphs() == graphs
    for i, diagnostics in got.items():
        for d in diagnostics:
            wanted = want[i]
            assert wanted is not None
            assert d.summary.entropy == pytest.approx(wanted.summary.entropy, rel=1e-5)
    assert len(got) == 3
    # Nothing of torch's global state is left changed: another function still compiles.
    assert torch.compile(lambda x: x * 2 + 1)(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]


def test_inference_mode_runs_the_eager_loop() -> None:
    """The graphs were compiled outside inference_mode: inside it every call would miss them,
    so the eager loop runs (same numbers) rather than a slower eager run of the kernel."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    calls = kernel_stats().calls
    with torch.inference_mode(), kernel_mode("always"):
        inside = attention(q, k, v, diagnostics="summary")
    assert kernel_stats().calls == calls
    with kernel_mode("off"):
        eager = attention(q, k, v, diagnostics="summary")
    assert inside.diagnostics is not None
    assert eager.diagnostics is not None
    assert inside.diagnostics.summary == eager.diagnostics.summary


def test_a_nan_bias_reaches_its_rows_on_both_routes() -> None:
    """allow_nonfinite: a NaN in a float attn_mask is a visible entry whose NaN reaches the
    rows that see it, on the kernel's route as on the eager loop's."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(3))
    bias = torch.zeros(32, 32)
    bias[5, 3] = math.nan
    bias[:, 30:] = -math.inf
    fast, eager = _kernel_and_eager(q, k, v, attn_mask=bias, allow_nonfinite=True)
    assert fast.row_stats is not None
    assert eager.row_stats is not None
    assert torch.equal(fast.row_stats.visible_keys, eager.row_stats.visible_keys)
    assert torch.equal(fast.output.isnan(), eager.output.isnan())
    assert bool(fast.output[0, :, 5].isnan().all())
