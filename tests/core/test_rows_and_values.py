"""Fully masked rows, hand-computed values, large logits and the non-finite policy."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sdpa_core import AttentionOptions, AttentionRun, Masks, NonFiniteError, ShapeError, attention
from tests.core.reference import (
    assert_matches_golden,
    lowp_reference,
    reference_attention,
    visibility,
)

PATHS = ("fused", "dense", "chunked")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, path: str, **kw: Any) -> Any:
    return attention(
        q,
        k,
        v,
        path=path,
        return_weights=path == "dense",
        diagnostics="none" if path == "fused" else "full",
        block_size=2,
        **kw,
    )


def _masked_row_cases() -> list[tuple[str, dict[str, Any], list[int]]]:
    """(name, kwargs, fully masked query rows) for q of shape [1, 2, 4, 8], k/v [.., 3, 8]."""
    all_false = torch.ones(4, 3, dtype=torch.bool)
    all_false[1] = False  # an explicit all-False row
    left_pad = torch.tensor([[True, True, False]])  # keys 0, 1 are (left) padding
    return [
        ("all_false_row", {"attn_mask": all_false}, [1]),
        # causal top_left: query 0 sees key 0 only, query 1 keys 0..1: both are padding.
        ("left_padding_with_causal", {"causal": True, "key_padding_mask": left_pad}, [0, 1]),
        # bottom_right with N_q = 4 > N_kv = 3: query 0 sees keys j <= -1, i.e. none.
        ("bottom_right_more_queries", {"causal": "bottom_right"}, [0]),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", _masked_row_cases(), ids=lambda c: c[0])
def test_fully_masked_rows(
    case: tuple[str, dict[str, Any], list[int]], path: str, dtype: torch.dtype
) -> None:
    _, kwargs, empty = case
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=gen).to(dtype)
    k = torch.randn(1, 2, 3, 8, generator=gen).to(dtype)
    v = torch.randn(1, 2, 3, 8, generator=gen).to(dtype)
    res = _run(q, k, v, path, **kwargs)
    assert not torch.isnan(res.output).any()
    assert torch.all(res.output[:, :, empty] == 0)
    others = [i for i in range(4) if i not in empty]
    assert torch.all(res.output[:, :, others].abs().sum(-1) > 0)
    if res.weights is not None:
        assert torch.all(res.weights[:, :, empty] == 0)
        assert not torch.isnan(res.weights).any()
    if res.diagnostics is not None:
        pr = res.diagnostics.per_row
        assert pr is not None
        assert res.diagnostics.summary.masked_rows == 2 * len(empty)  # two heads
        for name in ("entropy", "max_weight", "effective_keys", "normalized_entropy"):
            assert torch.all(getattr(pr, name)[:, :, empty] == 0), name
        assert torch.all(pr.lse[:, :, empty] == -math.inf)
        assert torch.all(pr.visible_keys[:, :, empty] == 0)
        summary = res.diagnostics.summary.as_dict()
        assert all(math.isfinite(x) for x in summary.values())


@pytest.mark.parametrize("path", PATHS)
def test_every_row_masked_summary_is_zero(path: str) -> None:
    q = torch.randn(2, 3, 4)
    res = attention(
        q,
        q,
        q,
        key_lengths=0,
        path=path,
        diagnostics="none" if path == "fused" else "summary",
    )
    assert torch.all(res.output == 0)
    if res.diagnostics is not None:
        s = res.diagnostics.summary
        assert s.masked_rows == 6
        assert {k: v for k, v in s.as_dict().items() if k != "masked_rows"} == dict.fromkeys(
            [f for f in s.as_dict() if f != "masked_rows"], 0.0
        )


@pytest.mark.parametrize("path", PATHS)
def test_hand_computed_causal_example(path: str) -> None:
    """Q = K = V = [[1,0],[2,0],[3,0]], d_k = 2, causal. Row 2's scores are
    [3, 6, 9] / sqrt(2) = [2.121, 4.243, 6.364] -> softmax [0.0127, 0.1057, 0.8816], output
    0.0127*1 + 0.1057*2 + 0.8816*3 = 2.869 (not the 2.612 some texts print)."""
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    res = attention(
        x,
        x,
        x,
        causal=True,
        path=path,
        return_weights=path == "dense",
        diagnostics="none" if path == "fused" else "summary",
    )
    expected = torch.tensor([[1.0, 0.0], [1.804, 0.0], [2.869, 0.0]])
    assert torch.allclose(res.output, expected, atol=5e-4)
    if res.weights is not None:
        assert torch.allclose(res.weights[2], torch.tensor([0.0127, 0.1057, 0.8816]), atol=5e-5)
        assert torch.allclose(res.weights[1], torch.tensor([0.1956, 0.8044, 0.0]), atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("path", PATHS)
def test_large_logits_half(path: str, dtype: torch.dtype) -> None:
    """Scores q.k of about 50-60 (scale 1) stay finite and match the reference."""
    gen = torch.Generator().manual_seed(1)
    d = 16
    base = torch.full((d,), math.sqrt(55.0 / d))
    q = (base + 0.05 * torch.randn(1, 2, 6, d, generator=gen)).to(dtype)
    k = (base + 0.05 * torch.randn(1, 2, 7, d, generator=gen)).to(dtype)
    v = torch.randn(1, 2, 7, d, generator=gen).to(dtype)
    raw = q.double() @ k.double().transpose(-1, -2)
    assert float(raw.min()) > 45
    assert float(raw.max()) < 65
    res = _run(q, k, v, path, scale=1.0, causal="bottom_right")
    assert torch.isfinite(res.output).all()
    vis = visibility(b=1, h=2, n_q=6, n_kv=7, causal="bottom_right")
    ref = reference_attention(q, k, v, vis, scale=1.0)
    assert_matches_golden(res.output, ref.out, lowp_reference(q, k, v, vis, scale=1.0))
    if res.diagnostics is not None:
        assert all(math.isfinite(x) for x in res.diagnostics.summary.as_dict().values())


@pytest.mark.parametrize("path", ["dense", "chunked"])
def test_entropy_with_large_common_offset(path: str) -> None:
    """Scores sharing a large offset (kernel-anchors pitfall 24): the shifted streaming form
    keeps the entropy accurate in float32."""
    gen = torch.Generator().manual_seed(2)
    d = 8
    q = torch.zeros(1, 1, 4, d)
    q[..., 0] = 100.0
    k = torch.randn(1, 1, 64, d, generator=gen) * 0.02
    k[..., 0] += 100.0  # raw scores ~ 1e4 + small spread
    v = torch.randn(1, 1, 64, d, generator=gen)
    res = attention(q, k, v, path=path, diagnostics="full", scale=0.3, block_size=10)
    vis = torch.ones(1, 1, 4, 64, dtype=torch.bool)
    ref = reference_attention(q, k, v, vis, scale=0.3)
    p = ref.weights
    ent = -(p * torch.log(p)).sum(-1)
    assert res.diagnostics is not None
    assert res.diagnostics.per_row is not None
    got = res.diagnostics.per_row.entropy.double()
    # fp32 q.k at 1e4 is itself rounded by ~1e-3, times scale 0.3: the input floor.
    assert torch.allclose(got, ent, atol=2e-3)


# ---- non-finite inputs --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_nonfinite_rejected_by_default(name: str) -> None:
    t = {n: torch.randn(1, 2, 3, 4) for n in ("q", "k", "v")}
    t[name][0, 1, 2, 3] = math.nan
    with pytest.raises(NonFiniteError) as info:
        attention(t["q"], t["k"], t["v"])
    assert info.value.param == name
    t[name][0, 1, 2, 3] = math.inf
    with pytest.raises(NonFiniteError):
        attention(t["q"], t["k"], t["v"])


@pytest.mark.parametrize("path", PATHS)
def test_check_finite_false_skips_only_the_input_scan(path: str) -> None:
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=gen) for _ in range(3))
    bias = torch.randn(5, 5, generator=gen)
    bias[:, 0] = -math.inf
    diagnostics = "none" if path == "fused" else "summary"
    options: dict[str, Any] = {"path": path, "diagnostics": diagnostics, "attn_mask": bias}
    # Finite inputs: the same result, bit for bit, with or without the scan.
    checked = attention(q, k, v, **options)
    trusted = attention(q, k, v, check_finite=False, **options)
    assert torch.equal(checked.output, trusted.output)
    # The shapes are still checked...
    with pytest.raises(ShapeError):
        attention(q, k[..., :3], v, check_finite=False, **options)
    # ...and a caller that broke its promise still never gets a silent NaN back.
    q_nan = q.clone()
    q_nan[0, 1, 2, 3] = math.nan
    with pytest.raises(NonFiniteError):
        attention(q_nan, k, v, check_finite=False, **options)


@pytest.mark.parametrize("path", PATHS)
def test_finite_inputs_overflowing_the_scores_raise_instead_of_nan(path: str) -> None:
    # q·k = 2e40 overflows float32 although every input is finite.
    q = torch.full((1, 1, 2, 2), 1e20)
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    diagnostics = "none" if path == "fused" else "summary"
    with pytest.raises(NonFiniteError) as info:
        attention(q, q, v, path=path, diagnostics=diagnostics)
    assert info.value.param == "scale"
    # With allow_nonfinite the caller asked for IEEE semantics: the NaN comes back.
    out = attention(q, q, v, path=path, diagnostics=diagnostics, allow_nonfinite=True)
    assert not bool(torch.isfinite(out.output).all())


@pytest.mark.parametrize("path", PATHS)
def test_a_run_told_to_leave_the_overflow_check_to_its_caller_returns_the_nan(path: str) -> None:
    """check_overflow=False (the service on a GPU, which checks the host copy): the same
    overflowing scores come back NaN, unrefused; the default run refuses them."""
    q = torch.full((1, 1, 2, 2), 1e20)
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    diagnostics = "none" if path == "fused" else "summary"
    options = AttentionOptions(path=path, diagnostics=diagnostics)
    with pytest.raises(NonFiniteError):
        AttentionRun(q, q, v, Masks(), options).run()
    left = AttentionOptions(path=path, diagnostics=diagnostics, check_overflow=False)
    out = AttentionRun(q, q, v, Masks(), left).run()
    assert torch.isnan(out.output).all()


@pytest.mark.parametrize("path", PATHS)
def test_a_huge_scale_never_returns_nan(path: str) -> None:
    # Scores 6e38 overflow float32 to +inf; a path may resolve the row or refuse it, never NaN.
    q = torch.ones(1, 1, 2, 2)
    k = torch.tensor([[[[1.0, 1.0], [0.0, 0.0]]]])
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    diagnostics = "none" if path == "fused" else "summary"
    refused: NonFiniteError | None = None
    try:
        out = attention(q, k, v, scale=3e38, path=path, diagnostics=diagnostics)
    except NonFiniteError as err:
        refused = err
    if refused is not None:
        assert refused.param == "scale"
    else:
        assert bool(torch.isfinite(out.output).all())
        # Key 0 scores +inf, key 1 scores 0: all the weight goes to key 0.
        torch.testing.assert_close(out.output, v[..., :1, :].expand(1, 1, 2, 2))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        # -1e308 is -inf in float32: every score -inf, and the fused path answered zeros.
        (torch.float32, -1e308),
        (torch.float32, 1e39),
        (torch.float16, -3.5e38),  # half inputs accumulate in float32
        (torch.bfloat16, 3.5e38),
        (torch.float64, -math.inf),
    ],
)
def test_a_scale_beyond_the_accumulation_dtype_is_refused_on_every_path(
    path: str, dtype: torch.dtype, scale: float
) -> None:
    q = torch.tensor([[[[1.0, 0.0], [2.0, 0.0]]]], dtype=dtype)
    diagnostics = "none" if path == "fused" else "summary"
    with pytest.raises(NonFiniteError) as info:
        attention(q, q, q, scale=scale, path=path, diagnostics=diagnostics)
    assert info.value.param == "scale"


@pytest.mark.parametrize("path", PATHS)
def test_the_largest_float32_scale_is_legal(path: str) -> None:
    # The bound is the accumulation dtype's own largest value, not a margin below it: with
    # q = 0 every score is 0 whatever the scale, and the weights are uniform.
    q = torch.zeros(1, 1, 2, 2)
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    diagnostics = "none" if path == "fused" else "summary"
    scale = float(torch.finfo(torch.float32).max)
    out = attention(q, q, v, scale=-scale, path=path, diagnostics=diagnostics)
    torch.testing.assert_close(out.output, torch.tensor([[[[2.0, 3.0], [2.0, 3.0]]]]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_in_masked_keys_does_not_leak(path: str, bad: float) -> None:
    """allow_nonfinite: garbage in padded keys/values never reaches any row
    (torch itself gives 0 * NaN = NaN here, pytorch#101967)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 3, 4, generator=gen)
    k = torch.randn(2, 2, 5, 4, generator=gen)
    v = torch.randn(2, 2, 5, 4, generator=gen)
    kl = torch.tensor([3, 5])
    k[0, :, 3:] = bad
    v[0, :, 4] = bad
    res = _run(q, k, v, path, key_lengths=kl, allow_nonfinite=True)
    assert torch.isfinite(res.output).all()
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[0, :, 3:] = 0.0
    clean_v[0, :, 4] = 0.0
    vis = visibility(b=2, h=2, n_q=3, n_kv=5, causal="none", key_lengths=[3, 5])
    ref = reference_attention(q, clean_k, clean_v, vis)
    assert_matches_golden(res.output, ref.out, None)
    if res.diagnostics is not None:
        assert all(math.isfinite(x) for x in res.diagnostics.summary.as_dict().values())


@pytest.mark.parametrize("path", PATHS)
def test_nonfinite_visible_value_poisons_only_its_rows(path: str) -> None:
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 1, 4, 4, generator=gen)
    k = torch.randn(1, 1, 4, 4, generator=gen)
    v = torch.randn(1, 1, 4, 4, generator=gen)
    v[0, 0, 2, 1] = math.nan  # key 2: visible to causal rows 2 and 3 only
    res = _run(q, k, v, path, causal=True, allow_nonfinite=True)
    assert torch.isfinite(res.output[0, 0, :2]).all()
    assert torch.isnan(res.output[0, 0, 2:]).all()
    vis = visibility(b=1, h=1, n_q=4, n_kv=4, causal="top_left")
    ref = reference_attention(q, k, v.nan_to_num(0.0), vis)
    assert_matches_golden(res.output[0, 0, :2], ref.out[0, 0, :2], None)


@pytest.mark.parametrize("path", PATHS)
def test_nonfinite_query_of_a_fully_masked_row_still_gives_zero(path: str) -> None:
    q = torch.randn(1, 1, 3, 4)
    q[0, 0, 0] = math.nan  # row 0 sees no key: it must still be 0
    q[0, 0, 1] = math.inf  # row 1 sees keys: NaN
    k = torch.randn(1, 1, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[0] = False
    res = _run(q, k, k, path, attn_mask=mask, allow_nonfinite=True)
    assert torch.all(res.output[0, 0, 0] == 0)
    assert torch.isnan(res.output[0, 0, 1]).all()
    assert torch.isfinite(res.output[0, 0, 2]).all()


def test_dropout_free_and_deterministic() -> None:
    q = torch.randn(2, 4, 16, 8)
    a = attention(q, q, q).output
    b = attention(q, q, q).output
    assert torch.equal(a, b)


def test_float_mask_nan_rejected_unless_allowed() -> None:
    q = torch.randn(1, 1, 2, 4)
    mask = torch.zeros(2, 2)
    mask[0, 0] = math.nan
    with pytest.raises(NonFiniteError) as info:
        attention(q, q, q, attn_mask=mask)
    assert info.value.param == "attn_mask"
    mask[0, 0] = -math.inf  # -inf is the additive "not visible": legal
    out = attention(q, q, q, attn_mask=mask, path="dense", return_weights=True)
    assert out.weights is not None
    assert float(out.weights[0, 0, 0, 0]) == 0.0


@pytest.mark.parametrize("path", PATHS)
def test_float64_inputs_with_a_float32_bias_match_the_reference(path: str) -> None:
    """A float32 attn_mask beside float64 q, k, v is legal; every path must add it as the
    float64 reference does (torch 2.13's CPU SDPA kernel got it wrong at N_kv >= 16)."""
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(1, 3, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 40, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 40, 8, generator=gen, dtype=torch.float64)
    bias = torch.randn(3, 40, generator=gen) * 2.0  # float32, [N_q, N_kv]
    ref = reference_attention(
        q, k, v, torch.ones(1, 1, 3, 40, dtype=torch.bool), bias=bias.to(torch.float64)
    )
    res = _run(q, k, v, path, attn_mask=bias)
    assert res.path == path
    torch.testing.assert_close(res.output, ref.out[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("path", ["dense", "chunked"])
def test_a_mask_without_a_key_dim_counts_every_key_of_a_visible_row(path: str) -> None:
    """attn_mask [N_q, 1] hides whole rows: the other rows see all 6 keys, and their
    diagnostics (visible keys, normalized entropy, grad health) are those of 6 keys, computed
    here by hand from the float64 weights."""
    gen = torch.Generator().manual_seed(32)
    q, k, v = (torch.randn(1, 1, n, 8, generator=gen) for n in (4, 6, 6))
    rows = torch.tensor([[True], [False], [True], [True]])  # [N_q, 1]
    res = _run(q, k, v, path, attn_mask=rows)
    visible = rows.expand(4, 6)[None, None]
    ref = reference_attention(q, k, v, visible)
    assert res.row_stats is not None
    assert res.row_stats.visible_keys[0, 0].tolist() == [6, 0, 6, 6]
    p = ref.weights[0, 0]  # [N_q, N_kv] float64
    entropy = -(p * torch.where(p > 0, p.log(), 0.0)).sum(-1)
    diagnostics = res.diagnostics
    assert diagnostics is not None
    assert diagnostics.per_row is not None
    want_normalized = entropy / math.log(6)
    want_normalized[1] = 0.0  # the hidden row
    torch.testing.assert_close(
        diagnostics.per_row.normalized_entropy[0, 0].double(), want_normalized, atol=1e-5, rtol=1e-5
    )
    grad_health = (p * (1 - p)).sum(-1) / 6  # mean over the 6 visible keys
    want = float(grad_health[[0, 2, 3]].mean())
    assert math.isclose(diagnostics.summary.grad_health, want, rel_tol=1e-5)
    assert diagnostics.summary.grad_health <= 0.25
