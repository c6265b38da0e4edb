"""analyze_scaling and make_synthetic_qk."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sdpa_core import SdpaError, analysis_passes, analyze_scaling, make_synthetic_qk
from tests.core.reference import reference_attention, reference_rows, visibility


@pytest.mark.parametrize("d_k", [4, 64, 512])
def test_synthetic_variance_is_dk_raw_and_one_scaled(d_k: int) -> None:
    """q, k ~ N(0, 1): Var(q.k) = d_k; dividing by sqrt(d_k) brings it to 1. With 128 x 128
    scores the sample variance is within a few percent (fixed seed)."""
    q, k = make_synthetic_qk(n_q=128, n_k=128, d_k=d_k, seed=0)
    report = analyze_scaling(q, k)
    assert report.d_k == d_k
    assert report.raw_score_variance == pytest.approx(d_k, rel=0.1)
    by_name = {s.name: s for s in report.strategies}
    assert [s.name for s in report.strategies] == [
        "none",
        "sqrt_dk",
        "dk",
        "dk_quarter",
        "two_sqrt_dk",
    ]
    assert by_name["sqrt_dk"].score_variance == pytest.approx(1.0, rel=0.1)
    assert by_name["sqrt_dk"].divisor == pytest.approx(math.sqrt(d_k))
    assert by_name["dk"].score_variance == pytest.approx(1.0 / d_k, rel=0.1)
    assert report.recommended_divisor == pytest.approx(math.sqrt(report.raw_score_variance))
    assert report.recommended_divisor == pytest.approx(math.sqrt(d_k), rel=0.05)
    # larger divisors flatten the softmax
    ents = [by_name[n].entropy for n in ("none", "dk_quarter", "sqrt_dk", "two_sqrt_dk", "dk")]
    assert ents == sorted(ents)


def test_strategy_statistics_match_reference() -> None:
    q, k = make_synthetic_qk(n_q=9, n_k=11, d_k=16, seed=3, heads=2)
    kl = torch.tensor([7, 11])
    report = analyze_scaling(
        q, k, strategies=["sqrt_dk", ("t3", 3.0)], causal="bottom_right", key_lengths=kl
    )
    assert [s.name for s in report.strategies] == ["sqrt_dk", "t3"]
    vis = visibility(b=1, h=2, n_q=9, n_kv=11, causal="bottom_right", key_lengths=[[7, 11]])
    for strat in report.strategies:
        ref = reference_attention(q, k, k, vis, scale=1.0 / strat.divisor)
        rows = reference_rows(ref, scale=1.0 / strat.divisor)
        act = rows.visible_keys > 0
        assert strat.score_variance == pytest.approx(
            rows.pooled_var_raw / strat.divisor**2, rel=1e-5
        )
        assert strat.entropy == pytest.approx(rows.entropy[act].mean(), rel=1e-5)
        assert strat.normalized_entropy == pytest.approx(
            rows.normalized_entropy[act].mean(), rel=1e-5
        )
        assert strat.max_weight == pytest.approx(rows.max_weight[act].mean(), rel=1e-5)
        assert strat.saturated_fraction == pytest.approx((rows.max_weight[act] >= 0.99).mean())
        assert strat.grad_health == pytest.approx(rows.grad_health[act].mean(), rel=1e-5)
    assert report.raw_score_variance == pytest.approx(
        reference_rows(reference_attention(q, k, k, vis), scale=1.0).pooled_var_raw, rel=1e-5
    )


def test_custom_only_strategies_follow_the_standard_five() -> None:
    q, k = make_synthetic_qk(n_q=4, n_k=4, d_k=8)
    report = analyze_scaling(q, k, strategies=[("temp2", 2.0 * math.sqrt(8))])
    assert [s.name for s in report.strategies] == [
        "none",
        "sqrt_dk",
        "dk",
        "dk_quarter",
        "two_sqrt_dk",
        "temp2",
    ]
    two, temp2 = report.strategies[4], report.strategies[5]
    assert temp2.entropy == pytest.approx(two.entropy)


@pytest.mark.parametrize(
    "strategies",
    [
        ["nope"],
        [("x", 0.0)],
        [("x", math.inf)],
        ["dk", "dk"],
        [("a", 1.0), ("a", 2.0)],
        "dk",
        [("x", "2")],
    ],
)
def test_bad_strategies(strategies: object) -> None:
    q, k = make_synthetic_qk(n_q=2, n_k=2, d_k=4)
    with pytest.raises(SdpaError) as info:
        analyze_scaling(q, k, strategies=strategies)  # type: ignore[arg-type]
    assert info.value.param == "strategies"


def test_synthetic_is_seeded_and_shaped() -> None:
    q1, k1 = make_synthetic_qk(n_q=3, n_k=5, d_k=7, seed=42, heads=2, std=2.0)
    q2, k2 = make_synthetic_qk(n_q=3, n_k=5, d_k=7, seed=42, heads=2, std=2.0)
    q3, _ = make_synthetic_qk(n_q=3, n_k=5, d_k=7, seed=43, heads=2, std=2.0)
    assert q1.shape == (2, 3, 7)
    assert k1.shape == (2, 5, 7)
    assert torch.equal(q1, q2)
    assert torch.equal(k1, k2)
    assert not torch.equal(q1, q3)
    big, _ = make_synthetic_qk(n_q=200, n_k=1, d_k=200, std=2.0, dtype=torch.float64)
    assert big.dtype == torch.float64
    assert float(np.std(big.numpy())) == pytest.approx(2.0, rel=0.02)
    with pytest.raises(SdpaError):
        make_synthetic_qk(n_q=0, n_k=1, d_k=1)


@pytest.mark.parametrize(
    "strategies",
    [None, ["dk"], ["sqrt_dk", ("tiny", 1e-40)], [("huge", 1e30)], [("tiny", 1e-40), "none"]],
)
def test_raw_statistics_do_not_depend_on_the_strategies(strategies: object) -> None:
    """The raw score variance (and recommended divisor) equal the float64 reference whatever
    the strategies, even a divisor of 1e-40 whose scaled scores overflow float32."""
    q, k = make_synthetic_qk(n_q=16, n_k=16, d_k=8, seed=5, heads=2)
    report = analyze_scaling(q, k, strategies=strategies)  # type: ignore[arg-type]
    vis = visibility(b=1, h=2, n_q=16, n_kv=16, causal="none")
    expected = reference_rows(reference_attention(q, k, k, vis), scale=1.0).pooled_var_raw
    assert report.raw_score_variance == pytest.approx(expected, rel=1e-5)
    assert report.recommended_divisor == pytest.approx(math.sqrt(expected), rel=1e-5)


@pytest.mark.parametrize(
    ("strategies", "passes"),
    [
        (None, 5),  # the standard five include "none" (divisor 1)
        (["sqrt_dk"], 2),  # one more pass at scale 1 for the raw statistics
        (["none", "dk"], 2),
        ([("t", 2.0)], 6),  # custom alone: after the standard five
        ([("one", 1.0), "dk"], 2),
    ],
)
def test_analysis_passes_counts_the_raw_pass(strategies: object, passes: int) -> None:
    assert analysis_passes(strategies, 16) == passes  # type: ignore[arg-type]
