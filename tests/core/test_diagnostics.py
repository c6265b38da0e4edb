"""Diagnostics: degenerate rows, chunked == dense, slicing RowStats, hypothesis properties."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdpa_core import (
    PER_HEAD_FIELDS,
    PER_ROW_FIELDS,
    ROW_STATS_FIELDS,
    SUMMARY_FIELDS,
    DiagnosticsSummary,
    PerHeadStats,
    PerRowStats,
    RowStats,
    SdpaError,
    attention,
    diagnostics,
    summarize,
)
from tests.core.reference import reference_attention, reference_rows, visibility

STAT_PATHS = ("dense", "chunked")


@pytest.mark.parametrize("path", STAT_PATHS)
def test_single_visible_key(path: str) -> None:
    """One visible key: H = 0, max p = 1, ||J||_F = 0, grad health 0."""
    q = torch.randn(1, 1, 3, 4)
    k = torch.randn(1, 1, 5, 4)
    res = attention(q, k, k, key_lengths=1, path=path, diagnostics="full")
    assert res.diagnostics is not None
    assert res.diagnostics.per_row is not None
    pr, rs = res.diagnostics.per_row, res.row_stats
    assert rs is not None
    assert torch.all(pr.entropy == 0)
    assert torch.all(pr.normalized_entropy == 0)
    assert torch.all(pr.max_weight == 1)
    assert torch.all(pr.effective_keys == 1)
    assert torch.all(rs.jacobian_fro == 0)
    assert torch.all(rs.grad_health == 0)
    assert torch.all(rs.score_m2_raw == 0)
    assert res.diagnostics.summary.saturated_fraction == 1.0


@pytest.mark.parametrize("path", STAT_PATHS)
@pytest.mark.parametrize("n", [2, 7, 64])
def test_uniform_row(path: str, n: int) -> None:
    """Equal scores (q = 0): H = log n, normalized 1, max p = 1/n, effective keys n,
    grad health (1 - 1/n)/n, ||J||_F^2 = 1/n - 1/n^2."""
    q = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    k = torch.randn(1, 2, n, 4, dtype=torch.float64)
    res = attention(q, k, k, path=path, diagnostics="full", block_size=5)
    assert res.diagnostics is not None
    assert res.diagnostics.per_row is not None
    pr, rs = res.diagnostics.per_row, res.row_stats
    assert rs is not None
    torch.testing.assert_close(pr.entropy, torch.full_like(pr.entropy, math.log(n)))
    torch.testing.assert_close(pr.normalized_entropy, torch.ones_like(pr.entropy))
    torch.testing.assert_close(pr.max_weight, torch.full_like(pr.entropy, 1 / n))
    torch.testing.assert_close(pr.effective_keys, torch.full_like(pr.entropy, float(n)))
    torch.testing.assert_close(rs.grad_health, torch.full_like(pr.entropy, (1 - 1 / n) / n))
    jac = math.sqrt(1 / n - 1 / n**2)
    torch.testing.assert_close(rs.jacobian_fro, torch.full_like(pr.entropy, jac))
    assert res.diagnostics.summary.saturated_fraction == 0.0


@pytest.mark.parametrize("gap", [12.0, 20.0, 40.0])
def test_saturated_row_jacobian_is_accurate_in_float32(gap: float) -> None:
    """p_max -> 1: S2 - 2 S3 + S2^2 and 1 - S2 cancel in fp32; the formulas used must not."""
    q = torch.zeros(1, 1, 1, 2)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 6, 2)
    k[0, 0, 3, 0] = gap  # one key far ahead of the rest, in the middle block
    for path in STAT_PATHS:
        res = attention(q, k, k, scale=1.0, path=path, diagnostics="full", block_size=4)
        rs = res.row_stats
        assert rs is not None
        ref = reference_attention(q, k, k, torch.ones(1, 1, 1, 6, dtype=torch.bool), scale=1.0)
        rows = reference_rows(ref, scale=1.0)
        assert float(rs.jacobian_fro) == pytest.approx(float(rows.jacobian_fro[0, 0, 0]), rel=1e-4)
        assert float(rs.grad_health) == pytest.approx(float(rows.grad_health[0, 0, 0]), rel=1e-4)
        assert float(rs.entropy) == pytest.approx(float(rows.entropy[0, 0, 0]), rel=1e-4)


def _row_stats_close(a: RowStats, b: RowStats, *, rtol: float, atol: float) -> None:
    for f in fields(RowStats):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "visible_keys":
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(
                x.double(), y.double(), rtol=rtol, atol=atol, msg=f"{f.name} differs"
            )


def _masked_inputs(seed: int, n_q: int = 13, n_kv: int = 37) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, n_q, 8, generator=gen)
    k = torch.randn(2, 2, n_kv, 8, generator=gen)
    v = torch.randn(2, 2, n_kv, 5, generator=gen)
    bias = torch.randn(n_q, n_kv, generator=gen)
    bias[bias > 1.2] = -math.inf
    kl = torch.tensor([[30, 37, 1, 0], [12, 5, 37, 36]])
    return q, k, v, {"causal": "bottom_right", "key_lengths": kl, "attn_mask": bias}


@pytest.mark.parametrize("block_size", [1, 5, 8, 36, 37, 100])
def test_chunked_equals_dense_for_every_diagnostic(block_size: int) -> None:
    """Block sizes that do and do not divide N_kv = 37 (and a last partial block)."""
    q, k, v, kw = _masked_inputs(3)
    dense = attention(q, k, v, path="dense", diagnostics="full", **kw)
    chunk = attention(q, k, v, path="chunked", diagnostics="full", block_size=block_size, **kw)
    assert dense.row_stats is not None
    assert chunk.row_stats is not None
    _row_stats_close(dense.row_stats, chunk.row_stats, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(chunk.output, dense.output, rtol=1e-5, atol=1e-5)
    assert dense.diagnostics is not None
    assert chunk.diagnostics is not None
    ds, cs = dense.diagnostics.summary.as_dict(), chunk.diagnostics.summary.as_dict()
    for name, val in ds.items():
        assert cs[name] == pytest.approx(val, rel=1e-5, abs=1e-6), name


def test_diagnostics_match_reference_with_every_mask() -> None:
    q, k, v, kw = _masked_inputs(5)
    res = attention(q, k, v, path="chunked", diagnostics="full", block_size=6, **kw)
    kl = kw["key_lengths"].tolist()
    vis = visibility(
        b=2, h=4, n_q=13, n_kv=37, causal="bottom_right", key_lengths=kl, attn_mask=kw["attn_mask"]
    )
    ref = reference_attention(q, k, v, vis, bias=kw["attn_mask"])
    rows = reference_rows(ref, scale=8**-0.5, bias=kw["attn_mask"])
    assert res.diagnostics is not None
    s = res.diagnostics.summary
    active = rows.visible_keys > 0
    assert s.masked_rows == rows.masked_rows
    assert s.entropy == pytest.approx(rows.entropy[active].mean(), rel=1e-5)
    assert s.normalized_entropy == pytest.approx(rows.normalized_entropy[active].mean(), rel=1e-5)
    assert s.effective_keys == pytest.approx(rows.effective_keys[active].mean(), rel=1e-5)
    assert s.max_weight == pytest.approx(rows.max_weight[active].mean(), rel=1e-5)
    assert s.saturated_fraction == pytest.approx((rows.max_weight[active] >= 0.99).mean())
    assert s.grad_health == pytest.approx(rows.grad_health[active].mean(), rel=1e-5)
    assert s.jacobian_fro == pytest.approx(rows.jacobian_fro[active].mean(), rel=1e-5)
    assert s.score_mean_raw == pytest.approx(rows.pooled_mean_raw, rel=1e-5, abs=1e-6)
    assert s.score_variance_raw == pytest.approx(rows.pooled_var_raw, rel=1e-5)
    assert s.score_variance_scaled == pytest.approx(rows.pooled_var_raw / 8, rel=1e-5)
    assert s.score_abs_max_scaled == pytest.approx(rows.abs_max_raw / math.sqrt(8), rel=1e-6)
    # per head: head 3 of sequence 0 has key length 0 -> every row masked
    ph = res.diagnostics.per_head
    assert ph.entropy.shape == (2, 4)
    assert int(ph.masked_rows[0, 3]) == 13
    assert float(ph.entropy[0, 3]) == 0.0
    for bi in range(2):
        for hi in range(4):
            act = active[bi, hi]
            if not act.any():
                continue
            assert float(ph.entropy[bi, hi]) == pytest.approx(
                rows.entropy[bi, hi][act].mean(), rel=1e-5
            )
            raws = np.concatenate([ref.raw[bi, hi, i][vis[bi, hi, i]].numpy() for i in range(13)])
            assert float(ph.score_variance_raw[bi, hi]) == pytest.approx(raws.var(), rel=1e-5)


def test_row_stats_index_then_summarize_equals_solo_call() -> None:
    """What the batching engine does: one batched call, then per-request slices."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 2, 6, 8, generator=gen)
    k = torch.randn(3, 2, 10, 8, generator=gen)
    v = torch.randn(3, 2, 10, 8, generator=gen)
    kl = torch.tensor([10, 4, 7])
    batch = attention(q, k, v, key_lengths=kl, causal="bottom_right", diagnostics="full")
    assert batch.row_stats is not None
    c = 1.0 / math.sqrt(8)  # what attention() uses for scale=None
    for b in range(3):
        sliced = batch.row_stats.index((b, slice(None), slice(0, 6)))
        # Exactly the same numbers as summarizing the same rows held on their own.
        own = RowStats(**{n: t.clone() for n, t in sliced.as_dict().items()})
        d_slice, d_own = (
            summarize(sliced, scale=c, level="full"),
            summarize(own, scale=c, level="full"),
        )
        assert d_slice.summary == d_own.summary
        for name, t in d_slice.per_head.as_dict().items():
            assert torch.equal(t, d_own.per_head.as_dict()[name])
        # A solo call on the unpadded request agrees with the slice of the batch.
        n = int(kl[b])
        solo = attention(q[b], k[b, :, :n], v[b, :, :n], causal="bottom_right", diagnostics="full")
        assert solo.diagnostics is not None
        assert solo.row_stats is not None
        if n == 10:  # the same keys, the same tiles: the same bits
            assert d_slice.summary == solo.diagnostics.summary
        else:  # bottom_right of a padded batch aligns to N_kv = 10, the solo call to n
            pass
        batch_again = attention(
            q[b : b + 1],
            k[b : b + 1],
            v[b : b + 1],
            key_lengths=kl[b : b + 1],
            causal="bottom_right",
            diagnostics="full",
        )
        assert batch_again.diagnostics is not None
        assert d_slice.summary == batch_again.diagnostics.summary


def test_summarize_pools_variance_by_chan_merge() -> None:
    """Two requests' rows summarized together give the variance of all their entries."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, 1, 5, 4, generator=gen) + 3.0
    k = torch.randn(1, 1, 6, 4, generator=gen)
    res = attention(q, k, k, key_lengths=4, diagnostics="summary")
    assert res.row_stats is not None
    assert res.diagnostics is not None
    raws = (q.double() @ k.double().transpose(-1, -2))[..., :4].flatten().numpy()
    assert res.diagnostics.summary.score_variance_raw == pytest.approx(raws.var(), rel=1e-5)
    assert res.diagnostics.summary.score_mean_raw == pytest.approx(raws.mean(), rel=1e-5)


# ---- hypothesis properties ----------------------------------------------------------------


@st.composite
def attention_problems(draw: st.DrawFn) -> dict[str, Any]:
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    n_q = draw(st.integers(1, 7))
    n_kv = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    std = draw(st.sampled_from([0.1, 1.0, 4.0]))
    q = torch.randn(2, h, n_q, 4, generator=gen) * std
    k = torch.randn(2, h_kv, n_kv, 4, generator=gen) * std
    v = torch.randn(2, h_kv, n_kv, 3, generator=gen)
    kw: dict[str, Any] = {"causal": draw(st.sampled_from([False, "top_left", "bottom_right"]))}
    if draw(st.booleans()):
        kw["key_lengths"] = torch.tensor([draw(st.integers(0, n_kv)) for _ in range(2)])
    if draw(st.booleans()):
        kw["attn_mask"] = torch.rand(n_q, n_kv, generator=gen) < 0.7
    kw["scale"] = draw(st.sampled_from([None, 1.0, -0.5]))
    kw["block_size"] = draw(st.integers(1, 10))
    return {"q": q, "k": k, "v": v, "kw": kw}


_SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@_SETTINGS
@given(attention_problems())
def test_property_weights_and_entropy(problem: dict[str, Any]) -> None:
    q, k, v, kw = problem["q"], problem["k"], problem["v"], problem["kw"]
    dense = attention(q, k, v, path="dense", return_weights=True, diagnostics="full", **kw)
    w = dense.weights
    assert w is not None
    kl = kw.get("key_lengths")
    vis = visibility(
        b=2,
        h=q.shape[1],
        n_q=q.shape[2],
        n_kv=k.shape[2],
        causal={False: "none"}.get(kw["causal"], kw["causal"]),
        key_lengths=None if kl is None else kl.tolist(),
        attn_mask=kw.get("attn_mask"),
    )
    active = vis.any(-1)
    sums = w.double().sum(-1)
    assert torch.allclose(sums[active], torch.ones_like(sums[active]), atol=1e-5)
    assert torch.all(w[~vis] == 0)  # invisible weights are exactly 0
    assert torch.all(sums[~active] == 0)
    assert torch.isfinite(dense.output).all()
    diag = dense.diagnostics
    assert diag is not None
    assert diag.per_row is not None
    ne = diag.per_row.normalized_entropy
    assert torch.all((ne >= 0) & (ne <= 1 + 1e-6))
    mw, ent = diag.per_row.max_weight.double(), diag.per_row.entropy.double()
    assert torch.all(mw[active] >= torch.exp(-ent[active]) - 1e-6)


@_SETTINGS
@given(attention_problems())
def test_property_chunked_equals_dense(problem: dict[str, Any]) -> None:
    q, k, v, kw = problem["q"], problem["k"], problem["v"], problem["kw"]
    dense = attention(q, k, v, path="dense", diagnostics="full", **kw)
    chunk = attention(q, k, v, path="chunked", diagnostics="full", **kw)
    fused = attention(q, k, v, path="fused", **{n: x for n, x in kw.items() if n != "block_size"})
    for r in (dense, chunk, fused):
        assert torch.isfinite(r.output).all()
    torch.testing.assert_close(chunk.output, dense.output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.output, dense.output, rtol=1e-5, atol=2e-5)
    assert dense.row_stats is not None
    assert chunk.row_stats is not None
    _row_stats_close(dense.row_stats, chunk.row_stats, rtol=1e-4, atol=1e-4)
    assert dense.diagnostics is not None
    assert chunk.diagnostics is not None
    for name, val in dense.diagnostics.summary.as_dict().items():
        assert chunk.diagnostics.summary.as_dict()[name] == pytest.approx(val, rel=1e-4, abs=1e-5)


# The diagnostic fields written out by hand: the API's contract, checked against the code.
SUMMARY_BY_HAND = [
    "entropy",
    "normalized_entropy",
    "effective_keys",
    "max_weight",
    "saturated_fraction",
    "sink_share",
    "score_mean_raw",
    "score_variance_raw",
    "score_variance_scaled",
    "score_abs_max_scaled",
    "grad_health",
    "jacobian_fro",
    "masked_rows",
]
PER_ROW_BY_HAND = [
    "entropy",
    "normalized_entropy",
    "max_weight",
    "effective_keys",
    "sink_share",
    "lse",
    "visible_keys",
]


def test_field_lists_are_the_dataclasses() -> None:
    """The exported field tuples (what wire models, clients and the explorer are checked
    against) are the contract's names, in order, and the dataclasses' own fields."""
    assert list(SUMMARY_FIELDS) == SUMMARY_BY_HAND
    assert PER_HEAD_FIELDS == SUMMARY_FIELDS
    assert list(PER_ROW_FIELDS) == PER_ROW_BY_HAND
    assert tuple(f.name for f in fields(DiagnosticsSummary)) == SUMMARY_FIELDS
    assert tuple(f.name for f in fields(PerHeadStats)) == PER_HEAD_FIELDS
    assert tuple(f.name for f in fields(PerRowStats)) == PER_ROW_FIELDS
    assert tuple(f.name for f in fields(RowStats)) == ROW_STATS_FIELDS
    for names in (SUMMARY_FIELDS, PER_HEAD_FIELDS, PER_ROW_FIELDS, ROW_STATS_FIELDS):
        assert isinstance(names, tuple)
        assert all(isinstance(n, str) for n in names)


def test_summary_fields_and_as_dict_order() -> None:
    q = torch.randn(2, 3, 4)
    res = attention(q, q, q, diagnostics="full")
    assert res.diagnostics is not None
    assert res.diagnostics.per_row is not None
    assert list(res.diagnostics.summary.as_dict()) == SUMMARY_BY_HAND
    assert list(res.diagnostics.per_head.as_dict()) == list(res.diagnostics.summary.as_dict())
    assert list(res.diagnostics.per_row.as_dict()) == PER_ROW_BY_HAND
    assert isinstance(res.diagnostics.summary.masked_rows, int)
    assert res.diagnostics.per_head.entropy.shape == (2,)
    assert res.diagnostics.per_row.entropy.shape == (2, 3)
    summary_only = attention(q, q, q, diagnostics="summary")
    assert summary_only.diagnostics is not None
    assert summary_only.diagnostics.per_row is None
    assert summary_only.row_stats is not None


# ---- sink_share ---------------------------------------------------------------------------


def _reference_sink(ref_weights: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """float64 share of each row's weights on key positions [0, sink_tokens)."""
    return ref_weights[..., :sink_tokens].sum(-1)


@pytest.mark.parametrize("path", STAT_PATHS)
@pytest.mark.parametrize("sink_tokens", [0, 1, 3, 5, 37, 50])
@pytest.mark.parametrize("block_size", [1, 4, 36, 100])
def test_sink_share_matches_float64_reference_with_every_mask(
    path: str, sink_tokens: int, block_size: int
) -> None:
    """Per row, per head and summary, against float64 weights; masks, GQA, padding, a float
    bias with -inf, key blocks that end inside and beyond the sink."""
    q, k, v, kw = _masked_inputs(7)
    res = attention(
        q, k, v, path=path, diagnostics="full", block_size=block_size, sink_tokens=sink_tokens, **kw
    )
    vis = visibility(
        b=2,
        h=4,
        n_q=13,
        n_kv=37,
        causal="bottom_right",
        key_lengths=kw["key_lengths"].tolist(),
        attn_mask=kw["attn_mask"],
    )
    ref = reference_attention(q, k, v, vis, bias=kw["attn_mask"])
    want = _reference_sink(ref.weights, sink_tokens)  # [2, 4, 13]; masked rows 0
    assert res.diagnostics is not None
    assert res.diagnostics.per_row is not None
    got = res.diagnostics.per_row.sink_share.double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    active = vis.any(-1)
    assert res.diagnostics.summary.sink_share == pytest.approx(
        float(want[active].mean()), rel=1e-5, abs=1e-7
    )
    per_head = res.diagnostics.per_head.sink_share
    for bi in range(2):
        for hi in range(4):
            act = active[bi, hi]
            expected = float(want[bi, hi][act].mean()) if act.any() else 0.0
            assert float(per_head[bi, hi]) == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("path", STAT_PATHS)
def test_sink_share_by_hand(path: str) -> None:
    """Uniform rows over n keys put sink_tokens / n on the sink; a row whose one hot key is
    the first puts (almost) all of it there; one hot on the last key, (almost) none."""
    n = 8
    q = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    k = torch.zeros(1, 1, n, 2, dtype=torch.float64)
    res = attention(q, k, k, path=path, diagnostics="full", sink_tokens=3, block_size=2)
    assert res.diagnostics is not None
    assert res.diagnostics.summary.sink_share == pytest.approx(3 / n, rel=1e-12)
    q[..., 0] = 1.0
    k[0, 0, 0, 0] = 100.0  # row 0 and 1: key 0 far ahead: p_0 = 1 / (1 + 7 e^-100)
    res = attention(q, k, k, scale=1.0, path=path, diagnostics="full", sink_tokens=1)
    assert res.diagnostics is not None
    p0 = 1.0 / (1.0 + 7.0 * math.exp(-100.0))
    assert res.diagnostics.summary.sink_share == pytest.approx(p0, rel=1e-12)
    k[0, 0, 0, 0], k[0, 0, n - 1, 0] = 0.0, 100.0
    res = attention(q, k, k, scale=1.0, path=path, diagnostics="full", sink_tokens=4)
    assert res.diagnostics is not None
    assert res.diagnostics.summary.sink_share == pytest.approx(4.0 * math.exp(-100.0), rel=1e-9)


def test_sink_share_float32_saturated_row_and_batch_slices() -> None:
    """float32 with the one hot key inside the sink (a saturated row), and the row slices of
    a batched call (what the service's engine does) equal a solo call's."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(3, 2, 6, 8, generator=gen)
    k = torch.randn(3, 2, 10, 8, generator=gen)
    q = q[:, :, :1] + 0.1 * q  # rows close to one another
    k[:, :, 1] = q[:, :, 0] * 12.0  # key 1 dominates every row
    batch = attention(q, k, k, diagnostics="full", sink_tokens=2)
    assert batch.diagnostics is not None
    assert batch.diagnostics.summary.saturated_fraction == 1.0
    ref = reference_attention(q, k, k, torch.ones(3, 2, 6, 10, dtype=torch.bool))
    assert batch.diagnostics is not None
    assert batch.diagnostics.per_row is not None
    torch.testing.assert_close(
        batch.diagnostics.per_row.sink_share.double(),
        _reference_sink(ref.weights, 2),
        rtol=1e-5,
        atol=1e-6,
    )
    assert batch.row_stats is not None
    for b in range(3):
        solo = attention(q[b], k[b], k[b], diagnostics="summary", sink_tokens=2)
        assert solo.diagnostics is not None
        sliced = summarize(batch.row_stats.index(b), scale=8**-0.5)
        assert sliced.summary.sink_share == pytest.approx(
            solo.diagnostics.summary.sink_share, rel=1e-6
        )


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_sink_tokens_must_be_a_non_negative_int(bad: object) -> None:
    q = torch.randn(1, 2, 3)
    with pytest.raises(SdpaError) as info:
        attention(q, q, q, diagnostics="summary", sink_tokens=bad)  # type: ignore[arg-type]
    assert info.value.param == "sink_tokens"


@pytest.mark.parametrize("path", STAT_PATHS)
def test_sink_share_skips_key_padding(path: str) -> None:
    """Left padding (key_padding_mask True at the front, as batched decoding pads): the sink
    is the first sink_tokens real keys, found here by a plain loop over each sequence."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 5, 4, generator=gen)
    k = torch.randn(3, 2, 11, 4, generator=gen)
    kpm = torch.zeros(3, 11, dtype=torch.bool)
    kpm[0, :4] = True  # four pads, then real keys
    kpm[1, [0, 2, 3, 7]] = True  # scattered padding
    kpm[2, :] = True  # every key padding: every row masked
    res = attention(
        q, k, k, key_padding_mask=kpm, path=path, diagnostics="full", sink_tokens=3, block_size=4
    )
    vis = ~kpm[:, None, None, :].expand(3, 2, 5, 11)
    ref = reference_attention(q, k, k, vis)
    want = torch.zeros(3, 2, 5, dtype=torch.float64)
    for b in range(3):
        real = [j for j in range(11) if not kpm[b, j]][:3]
        if real:
            want[b] = ref.weights[b][..., real].sum(-1)
    assert res.diagnostics is not None
    assert res.diagnostics.per_row is not None
    torch.testing.assert_close(
        res.diagnostics.per_row.sink_share.double(), want, rtol=1e-5, atol=1e-6
    )
    assert res.diagnostics.summary.sink_share == pytest.approx(float(want[:2].mean()), rel=1e-5)


def _summary_by_hand(rows: list[dict[str, float]], scale: float) -> dict[str, float]:
    """The summary's definitions, row by row in Python floats (float64)."""
    act = [r for r in rows if r["visible_keys"] > 0]
    out: dict[str, float] = {"masked_rows": len(rows) - len(act)}
    per_row = {
        "entropy": lambda r: r["entropy"],
        "normalized_entropy": lambda r: (
            min(1.0, r["entropy"] / math.log(r["visible_keys"])) if r["visible_keys"] > 1 else 0.0
        ),
        "effective_keys": lambda r: math.exp(r["entropy"]),
        "max_weight": lambda r: r["max_weight"],
        "saturated_fraction": lambda r: float(r["max_weight"] >= 0.99),
        "sink_share": lambda r: r["sink_share"],
        "grad_health": lambda r: r["grad_health"],
        "jacobian_fro": lambda r: r["jacobian_fro"],
    }
    for name, of in per_row.items():
        out[name] = sum(of(r) for r in act) / max(len(act), 1)
    n = sum(r["visible_keys"] for r in act)
    mean = sum(r["visible_keys"] * r["score_mean_raw"] for r in act) / max(n, 1)
    m2 = sum(r["score_m2_raw"] + r["visible_keys"] * (r["score_mean_raw"] - mean) ** 2 for r in act)
    out["score_mean_raw"] = mean
    out["score_variance_raw"] = m2 / max(n, 1)
    out["score_variance_scaled"] = scale**2 * m2 / max(n, 1)
    out["score_abs_max_scaled"] = abs(scale) * max((r["score_abs_max_raw"] for r in act), default=0)
    return out


@pytest.fixture(params=["torch", "cpu_flash"])
def head_table(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """summarize()'s per-head table: torch's calls, or the CPU flash kernel's one C++ call
    (built here, as a service's warm-up does; skipped where it cannot be built)."""
    if request.param == "torch":
        monkeypatch.setattr(diagnostics, "_native", [])
    else:
        from sdpa_core.kernels import cpu_flash

        ok, why = cpu_flash.build()
        if not ok:
            pytest.skip(why)
        monkeypatch.setattr(diagnostics, "_native", [cpu_flash.head_table])
    return str(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_summarize_matches_its_definitions_row_by_row(dtype: torch.dtype, head_table: str) -> None:
    """Hand-made RowStats: fully masked rows holding garbage (NaN) count only in masked_rows,
    one visible key has normalized entropy 0, a head whose every row is masked gives 0s;
    the summary and every head against a plain Python loop."""
    gen = torch.Generator().manual_seed(8)
    vis = torch.tensor([[[0, 1, 5, 9], [3, 0, 2, 1]], [[0, 0, 0, 0], [7, 7, 2, 4]]])
    shape = tuple(vis.shape)  # [B, H, N_q]
    fields_ = {
        name: torch.rand(shape, generator=gen, dtype=torch.float64).to(dtype)
        for name in ROW_STATS_FIELDS
        if name != "visible_keys"
    }
    fields_["max_weight"][0, 0, 2] = 0.995  # saturated
    fields_["score_mean_raw"] = fields_["score_mean_raw"] * 40 - 10
    for t in fields_.values():
        t[vis == 0] = math.nan  # must not leak into anything
    rs = RowStats(visible_keys=vis, **fields_)
    scale = -0.7
    diag = summarize(rs, scale=scale, level="full")

    def rows_of(index: tuple[int, ...]) -> list[dict[str, float]]:
        flat = {n: t[index].reshape(-1).tolist() for n, t in rs.as_dict().items()}
        return [{n: v[i] for n, v in flat.items()} for i in range(len(flat["visible_keys"]))]

    want = _summary_by_hand(rows_of(()), scale)
    got = diag.summary.as_dict()
    assert got["masked_rows"] == want["masked_rows"] == 6
    for name in SUMMARY_FIELDS:
        assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-15), name
    for b in range(2):
        for h in range(2):
            want_h = _summary_by_hand(rows_of((b, h)), scale)
            for name, tensor in diag.per_head.as_dict().items():
                assert float(tensor[b, h]) == pytest.approx(want_h[name], rel=1e-12, abs=1e-15)
    assert diag.per_row is not None
    assert float(diag.per_row.normalized_entropy[0, 0, 1]) == 0.0  # one visible key
    for name in ("entropy", "max_weight", "effective_keys", "sink_share"):
        per_row = getattr(diag.per_row, name)
        assert per_row.dtype == dtype
        assert bool((per_row[vis == 0] == 0).all()), name
    assert bool(torch.isinf(diag.per_row.lse[vis == 0]).all())


def _hand_made_rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> RowStats:
    """RowStats with fully masked rows holding NaN, one-key rows, saturated rows and one
    poisoned row (NaN statistics on an active row, as allow_nonfinite gives)."""
    gen = torch.Generator().manual_seed(seed)
    vis = torch.randint(0, 4, shape, generator=gen) * torch.randint(0, 50, shape, generator=gen)
    vis.view(-1)[:3] = torch.tensor([0, 1, 2])
    fields_ = {
        name: torch.rand(shape, generator=gen, dtype=torch.float64).to(dtype)
        for name in ROW_STATS_FIELDS
        if name != "visible_keys"
    }
    fields_["max_weight"].view(-1)[5:9] = 0.995
    fields_["score_mean_raw"] = fields_["score_mean_raw"] * 1e4 - 3e3
    for t in fields_.values():
        t[vis == 0] = math.nan
    return RowStats(visible_keys=vis, **fields_)


@pytest.mark.parametrize("shape", [(40,), (3, 17), (2, 3, 64), (2, 1, 3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("poisoned", [False, True])
def test_native_head_table_equals_torchs(
    shape: tuple[int, ...], dtype: torch.dtype, poisoned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU flash kernel's head table gives summarize() the numbers torch's calls give
    (float64 sums in another order: equal to 1e-12), NaN where they give NaN."""
    from sdpa_core.kernels import cpu_flash

    ok, why = cpu_flash.build()
    if not ok:
        pytest.skip(why)
    rs = _hand_made_rows(shape, dtype, seed=len(shape))
    if poisoned:
        active = (rs.visible_keys > 1).nonzero()[0]
        for name in ("entropy", "score_mean_raw", "score_abs_max_raw"):
            getattr(rs, name)[tuple(active)] = math.nan
    native = cpu_flash.head_table(rs)
    assert native is not None
    monkeypatch.setattr(diagnostics, "_native", [])
    want = summarize(rs, scale=0.3, level="full")
    monkeypatch.setattr(diagnostics, "_native", [cpu_flash.head_table])
    got = summarize(rs, scale=0.3, level="full")
    for name in SUMMARY_FIELDS:
        w, g = getattr(want.summary, name), getattr(got.summary, name)
        assert g == pytest.approx(w, rel=1e-12, abs=1e-12, nan_ok=True), name
    for name, w_t in want.per_head.as_dict().items():
        g_t = getattr(got.per_head, name)
        assert g_t.shape == w_t.shape, name
        assert g_t.dtype == w_t.dtype, name
        torch.testing.assert_close(g_t, w_t, rtol=1e-12, atol=1e-12, equal_nan=True)
    if poisoned:
        assert math.isnan(got.summary.entropy)
        assert math.isnan(got.summary.score_mean_raw)
    assert got.per_row is not None
    assert want.per_row is not None
    for name, w_t in want.per_row.as_dict().items():
        torch.testing.assert_close(getattr(got.per_row, name), w_t, equal_nan=True)
