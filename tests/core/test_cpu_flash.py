"""The CPU flash kernel (sdpa_core.kernels.cpu_flash) on its own, against the float64 reference:
the output and every RowStats field for every mask option the kernel contract takes, GQA,
D_v != D, odd sizes, extreme scales, the three input dtypes, empty and one-hot rows.

Building the extension takes a minute on a cold cache (once for the module; torch's extension
cache keeps it afterwards): slow. Without a C++ compiler the module skips.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from decimal import Decimal, getcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdpa_core import attention
from sdpa_core.kernels import cpu_flash
from tests.core.reference import assert_matches_golden, lowp_reference, reference_attention

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the CPU flash kernel cannot be built")
    ok, why = cpu_flash.build()
    assert ok, why
    assert cpu_flash.available() == (True, "")


@dataclass(frozen=True)
class Case:
    """One call of flash_tile and what the float64 reference needs to check it."""

    q: torch.Tensor  # [B, H, N_q, D]: the whole query sequence
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    causal_shift: int | None = None
    key_lengths: torch.Tensor | None = None  # int64 [B] or [B, H]
    visible: torch.Tensor | None = None  # bool, broadcastable to [B, H, N_q, N_kv]
    bias: torch.Tensor | None = None  # float, broadcastable to [B, H, N_q, N_kv]
    sink_tokens: int = 4


def _expanded(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return x.reshape((1,) * (len(shape) - x.dim()) + tuple(x.shape)).expand(shape)


def _visible(c: Case) -> torch.Tensor:
    """The visibility matrix [B, H, N_q, N_kv], from the definitions (index by index)."""
    b, h, n_q, _ = c.q.shape
    n_kv = c.k.shape[2]
    i = torch.arange(n_q).view(-1, 1)
    j = torch.arange(n_kv).view(1, -1)
    vis = torch.ones(b, h, n_q, n_kv, dtype=torch.bool)
    if c.causal_shift is not None:
        vis &= j <= i + c.causal_shift
    if c.key_lengths is not None:
        lengths = c.key_lengths.reshape(b, -1).expand(b, h)
        vis &= j.view(1, 1, 1, -1) < lengths.view(b, h, 1, 1)
    if c.visible is not None:
        vis &= _expanded(c.visible, (b, h, n_q, n_kv))
    return vis


def _run(c: Case, q0: int = 0, q1: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """flash_tile on query rows [q0, q1), the masks as the contract passes them (expanded
    views)."""
    b, h, n_q, _ = c.q.shape
    q1 = n_q if q1 is None else q1
    n_kv = c.k.shape[2]
    tile = (b, h, q1 - q0, n_kv)

    def rows(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else _expanded(x, (b, h, n_q, n_kv))[:, :, q0:q1].expand(tile)

    lengths = None
    if c.key_lengths is not None:
        lengths = c.key_lengths.reshape(b, -1).expand(b, h)
    return cpu_flash.flash_tile(
        c.q[:, :, q0:q1],
        c.k,
        c.v,
        scale=c.scale,
        q_start=q0,
        causal_shift=c.causal_shift,
        key_lengths=lengths,
        visible=rows(c.visible),
        bias=rows(c.bias),
        sink_tokens=c.sink_tokens,
    )


@dataclass(frozen=True)
class Expected:
    out: torch.Tensor  # float64
    stats: dict[str, np.ndarray]  # float64 [B, H, N_q] per RowStats field
    score_max: float  # max |scaled score + bias| over visible entries (the error's scale)


def _expected(c: Case) -> Expected:
    """Every RowStats field from the float64 weight matrix, row by row from the definitions."""
    vis = _visible(c)
    bias = None if c.bias is None else c.bias.to(torch.float64)
    ref = reference_attention(c.q, c.k, c.v, vis, scale=c.scale, bias=bias)
    w = ref.weights.numpy()
    raw = ref.raw.numpy()
    s = raw * c.scale
    if bias is not None:
        s = s + _expanded(bias, tuple(vis.shape)).numpy()
    vis_np = vis.numpy()
    shape = vis_np.shape[:-1]
    names = (
        "entropy",
        "max_weight",
        "sink_share",
        "lse",
        "grad_health",
        "jacobian_fro",
        "score_mean_raw",
        "score_m2_raw",
        "score_abs_max_raw",
    )
    out = {name: np.zeros(shape) for name in names}
    out["lse"][:] = -np.inf
    out["visible_keys"] = vis_np.sum(-1)
    score_max = 0.0
    for idx in np.ndindex(*shape):
        sel = vis_np[idx]
        if not sel.any():
            continue
        p = w[idx][sel]
        r = raw[idx][sel]
        row_s = s[idx][sel]
        pos = p[p > 0]
        out["entropy"][idx] = -(pos * np.log(pos)).sum()
        out["max_weight"][idx] = p.max()
        keys = np.nonzero(sel)[0]
        out["sink_share"][idx] = p[keys < c.sink_tokens].sum()
        mx = row_s.max()
        out["lse"][idx] = mx + math.log(np.exp(row_s - mx).sum())
        out["grad_health"][idx] = (p * (1 - p)).mean()
        jac = np.diag(p) - np.outer(p, p)
        out["jacobian_fro"][idx] = math.sqrt((jac * jac).sum())
        out["score_mean_raw"][idx] = r.mean()
        out["score_m2_raw"][idx] = ((r - r.mean()) ** 2).sum()
        out["score_abs_max_raw"][idx] = np.abs(r).max()
        score_max = max(score_max, float(np.abs(row_s).max()))
    return Expected(ref.out, out, score_max)


def _check(c: Case, got: tuple[torch.Tensor, dict[str, Any]], q0: int = 0) -> None:
    """The tile's output and statistics against the float64 reference's rows [q0, ...)."""
    out, stats = got
    exp = _expected(c)
    n = out.shape[2]
    rows = slice(q0, q0 + n)
    assert out.dtype == c.q.dtype
    assert set(stats) == set(exp.stats)
    # kernel-anchors §4.4: within 5x the error of the same formula in q's dtype
    lowp = lowp_reference(c.q, c.k, c.v, _visible(c), scale=c.scale, bias=c.bias)
    assert_matches_golden(out, exp.out[:, :, rows], lowp[:, :, rows])
    for name, value in stats.items():
        assert value.shape == out.shape[:3], name
        assert value.dtype == (torch.int64 if name == "visible_keys" else torch.float32), name
        assert not torch.isnan(value).any(), name
    np.testing.assert_array_equal(
        stats["visible_keys"].numpy(), exp.stats["visible_keys"][..., rows]
    )
    # fp32 scores carry an absolute error of about eps x |score|, which the softmax turns into
    # the same absolute error on the weights: the tolerance grows with the largest score.
    atol = 2e-5 + 4e-7 * exp.score_max
    for name in ("entropy", "max_weight", "sink_share", "grad_health", "jacobian_fro"):
        np.testing.assert_allclose(
            stats[name].double().numpy(),
            exp.stats[name][..., rows],
            atol=atol,
            rtol=1e-4,
            err_msg=name,
        )
    np.testing.assert_allclose(
        stats["lse"].double().numpy(), exp.stats["lse"][..., rows], atol=5 * atol, rtol=1e-5
    )
    raw_scale = float(np.abs(exp.stats["score_abs_max_raw"]).max()) + 1.0
    keys = exp.stats["visible_keys"][..., rows]
    for name, tol in (("score_mean_raw", 1e-5), ("score_abs_max_raw", 1e-6)):
        np.testing.assert_allclose(
            stats[name].double().numpy(),
            exp.stats[name][..., rows],
            atol=tol * raw_scale,
            rtol=1e-5,
            err_msg=name,
        )
    # M2 sums a square per key: its absolute error grows with the row's keys.
    m2_err = np.abs(stats["score_m2_raw"].double().numpy() - exp.stats["score_m2_raw"][..., rows])
    m2_tol = 1e-4 * exp.stats["score_m2_raw"][..., rows] + 1e-6 * raw_scale**2 * (keys + 1)
    assert (m2_err <= m2_tol).all(), f"score_m2_raw: max error {m2_err.max():.3g}"


def _qkv(
    b: int,
    h: int,
    h_kv: int,
    n_q: int,
    n_kv: int,
    d: int,
    d_v: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=gen) * std
    k = torch.randn(b, h_kv, n_kv, d, generator=gen) * std
    v = torch.randn(b, h_kv, n_kv, d_v, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _masks(n_q: int, n_kv: int, b: int, h: int) -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(3)
    bool_mask = torch.rand(n_q, n_kv, generator=gen) < 0.6
    bias = torch.randn(n_q, n_kv, generator=gen)
    per_head = torch.randint(0, n_kv + 1, (b, h), generator=gen)
    per_head[0, 0] = 0  # a sequence-head with no key at all
    return {
        "none": {},
        "top_left": {"causal_shift": 0},
        "bottom_right": {"causal_shift": n_kv - n_q},
        "key_lengths_per_sequence": {"key_lengths": torch.tensor([n_kv // 3, n_kv][:b])},
        "key_lengths_per_head": {"key_lengths": per_head},
        "visible": {"visible": bool_mask},
        "visible_per_head": {"visible": torch.rand(b, h, 1, n_kv, generator=gen) < 0.5},
        "bias": {"bias": bias},
        "combined": {
            "causal_shift": n_kv - n_q,
            "key_lengths": torch.tensor([n_kv - 5, n_kv // 2][:b]),
            "visible": bool_mask,
            "bias": bias.masked_fill(~bool_mask, 0.0),
        },
    }


_SHAPES = {
    # b, h, h_kv, n_q, n_kv, d, d_v: GQA and D_v != D throughout; sizes off the blocks (32 /
    # 64 / 256 query rows, 512 keys), N_q != N_kv both ways
    "small": (2, 4, 2, 37, 45, 16, 8),
    "keys_over_two_blocks": (1, 2, 1, 70, 1100, 8, 12),
    "rows_over_blocks": (2, 2, 2, 200, 130, 16, 16),
}


@pytest.mark.parametrize("mask", list(_masks(1, 2, 1, 1)))
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_every_mask_option_matches_the_float64_reference(mask: str, shape: str) -> None:
    b, h, h_kv, n_q, n_kv, d, d_v = _SHAPES[shape]
    q, k, v = _qkv(b, h, h_kv, n_q, n_kv, d, d_v, seed=len(mask))
    c = Case(q, k, v, scale=d**-0.5, **_masks(n_q, n_kv, b, h)[mask])
    _check(c, _run(c))


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_a_tile_in_the_middle_of_the_queries(causal: str | None) -> None:
    """q_start places the tile: its causal edge and statistics are those of rows [q0, q1) of
    the whole attention."""
    q, k, v = _qkv(1, 2, 2, 300, 260, 16, 16, seed=9)
    shift = {None: None, "top_left": 0, "bottom_right": 260 - 300}[causal]
    c = Case(q, k, v, scale=0.3, causal_shift=shift, bias=torch.randn(300, 260))
    _check(c, _run(c, 110, 230), q0=110)


def test_any_strides_and_large_query_tiles() -> None:
    """Transposed (non-contiguous) inputs, and a tile of more than 768 rows (256-row query
    blocks) over several key blocks."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 800, 2, 16, generator=gen).transpose(1, 2)
    k = torch.randn(1, 600, 2, 16, generator=gen).transpose(1, 2)
    v = torch.randn(1, 2, 24, 600, generator=gen).transpose(2, 3)
    assert not q.is_contiguous()
    c = Case(q, k, v, scale=0.25, causal_shift=600 - 800)
    _check(c, _run(c))


@pytest.mark.parametrize("scale", [-0.7, 1e-30, 2e-5, 30.0, 400.0])
def test_negative_tiny_and_huge_scales(scale: float) -> None:
    q, k, v = _qkv(1, 4, 2, 40, 530, 16, 8, seed=2)
    c = Case(q, k, v, scale=scale, causal_shift=530 - 40)
    _check(c, _run(c))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "combined"])
def test_half_precision_inputs(dtype: torch.dtype, mask: str) -> None:
    """fp16 and bf16 inputs: the output in their dtype, the statistics accumulated in fp32."""
    q, k, v = _qkv(2, 4, 2, 70, 600, 16, 24, seed=6, dtype=dtype)
    kw = _masks(70, 600, 2, 4)[mask]
    if "bias" in kw:
        kw = {**kw, "bias": kw["bias"].to(dtype)}
    c = Case(q, k, v, scale=0.25, **kw)
    _check(c, _run(c))


def test_fully_masked_rows_give_zero_and_lse_minus_infinity() -> None:
    """Rows with no visible key (a causal edge before the first key, a key length of 0, a
    bool mask row all False): output 0, every statistic 0, lse -inf, never NaN."""
    q, k, v = _qkv(2, 2, 1, 20, 30, 8, 8, seed=7)
    visible = torch.ones(20, 30, dtype=torch.bool)
    visible[5] = False
    c = Case(
        q, k, v, scale=0.5, causal_shift=-3, key_lengths=torch.tensor([0, 30]), visible=visible
    )
    out, stats = _run(c)
    _check(c, (out, stats))
    empty = ~_visible(c).any(-1)  # [B, H, N_q]
    assert int(empty.sum()) == 2 * 20 + 2 * (3 + 1)  # sequence 0, rows 0-2 and row 5 of 1
    assert (out[empty] == 0).all()
    assert (stats["lse"][empty] == -math.inf).all()
    for name, value in stats.items():
        if name != "lse":
            assert (value[empty] == 0).all(), name


def _exact_rows(s: np.ndarray) -> dict[str, np.ndarray]:
    """entropy, grad_health, jacobian_fro and 1 - max weight of rows of scores [..., N] in
    80-digit decimal arithmetic: float64 cannot be the reference for near-one-hot rows (1 -
    p_max rounds to 0 there, and with it the max's own term of each statistic; ||J||^2 = S2 -
    2 S3 + S2^2 cancels to 1e-60 here)."""
    getcontext().prec = 80
    names = ("entropy", "grad_health", "jacobian_fro", "one_minus_max_weight")
    out = {name: np.zeros(s.shape[:-1]) for name in names}
    for idx in np.ndindex(*s.shape[:-1]):
        row = [Decimal(float(x)) for x in s[idx]]
        top = max(row)
        e = [(x - top).exp() for x in row]
        total = sum(e, Decimal(0))
        p = [x / total for x in e]
        s2 = sum((x * x for x in p), Decimal(0))
        s3 = sum((x * x * x for x in p), Decimal(0))
        out["entropy"][idx] = float(-sum((x * x.ln() for x in p if x > 0), Decimal(0)))
        out["grad_health"][idx] = float(sum((x * (1 - x) for x in p), Decimal(0)) / len(p))
        out["jacobian_fro"][idx] = float((s2 - 2 * s3 + s2 * s2).sqrt())
        out["one_minus_max_weight"][idx] = float(1 - max(p))
    return out


def test_key_lengths_below_zero_or_past_the_keys_are_clamped() -> None:
    q, k, v = _qkv(1, 2, 2, 3, 5, 8, 4, seed=10)
    c = Case(q, k, v, scale=1.0, key_lengths=torch.tensor([[-1, 99]]))
    _check(c, _run(c))


def test_degenerate_sizes_by_hand() -> None:
    """An empty tile, no keys, and D = 0 (every score 0: uniform weights over the keys), with
    the values computed by hand (the reference's helpers take no empty dimension)."""
    kw: dict[str, Any] = {
        "scale": 1.0,
        "q_start": 0,
        "causal_shift": None,
        "key_lengths": None,
        "visible": None,
        "bias": None,
    }
    out, stats = cpu_flash.flash_tile(*_qkv(1, 2, 2, 0, 5, 8, 4), sink_tokens=4, **kw)
    assert out.shape == (1, 2, 0, 4)
    assert all(value.shape == (1, 2, 0) for value in stats.values())

    out, stats = cpu_flash.flash_tile(*_qkv(1, 2, 2, 3, 0, 8, 4), sink_tokens=4, **kw)
    assert (out == 0).all()
    assert (stats.pop("lse") == -math.inf).all()
    assert all((value == 0).all() for value in stats.values())

    q, k, v = _qkv(1, 2, 2, 3, 5, 0, 4)
    out, stats = cpu_flash.flash_tile(q, k, v, sink_tokens=4, **kw)
    torch.testing.assert_close(out, v.mean(2, keepdim=True).expand(1, 2, 3, 4))
    # p = 1/5 each: sum p^2 = 1/5, sum p^3 = 1/25, ||J||^2 = 1/5 - 2/25 + 1/25
    expected = {
        "visible_keys": 5,
        "entropy": math.log(5),
        "max_weight": 0.2,
        "sink_share": 0.8,
        "lse": math.log(5),
        "grad_health": 0.2 * 0.8,
        "jacobian_fro": math.sqrt(0.2 - 2 / 25 + 1 / 25),
        "score_mean_raw": 0.0,
        "score_m2_raw": 0.0,
        "score_abs_max_raw": 0.0,
    }
    for name, value in expected.items():
        torch.testing.assert_close(
            stats[name], torch.full((1, 2, 3), value, dtype=stats[name].dtype), msg=name
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_near_one_hot_rows_keep_their_small_statistics(dtype: torch.dtype) -> None:
    """The cancellation case: rows where one key takes almost all the weight (entropy, 1 -
    sum p^2 and the Jacobian's norm near 0). They are computed from the "rest" sums that leave
    the max out, so they keep relative accuracy where log l - A / l or 1 - sum p^2 would be
    rounding noise (in fp32 about 1e-7 absolute; these are down to 1e-30)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 10, 32, generator=gen)
    k = torch.randn(1, 2, 700, 32, generator=gen) * 0.1
    k[:, :, 7] = q[:, :, 0] * 3.0  # key 7 stands out for every query like query 0
    k[:, :, 600] = q.mean(2) * 2.0  # and key 600, in the second key block
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(1, 2, 700, 8, generator=gen).to(dtype)
    raw = q.double() @ k.double().mT
    # The scores' own fp32 error (an fp32 GEMM's q.k against float64's), times the scale:
    # the relative error a tiny weight e^(s_j - s_max) carries whatever the kernel does.
    raw_err = float((q.float() @ k.float().mT - raw).abs().max())
    for scale in (4.0, 60.0):
        c = Case(q, k, v, scale=scale)
        _, stats = _run(c)
        exact = _exact_rows((raw * scale).numpy())
        assert exact["entropy"].min() < 1e-20  # the near-one-hot case indeed
        got = {name: stats[name].double().numpy() for name in exact if name in stats}
        got["one_minus_max_weight"] = 1 - stats["max_weight"].double().numpy()
        rtol = 1e-4 + 4 * scale * raw_err
        for name, value in got.items():
            assert (value >= 0).all(), name
            # relative, down to fp32's smallest normal numbers; the Jacobian sums squares of
            # weights (scaled by 2^32 in the kernel), normal down to weights of about 1e-30;
            # 1 - max weight: to fp32's resolution near 1
            atol = {"one_minus_max_weight": 1e-7, "jacobian_fro": 1e-30}.get(name, 1e-37)
            np.testing.assert_allclose(value, exact[name], rtol=rtol, atol=atol, err_msg=name)


def test_exactly_one_hot_rows_have_zero_entropy() -> None:
    """A row with a single visible key: weight 1, entropy, gradient health and Jacobian 0."""
    q, k, v = _qkv(1, 1, 1, 8, 40, 8, 8, seed=8)
    c = Case(q, k, v, scale=1.0, key_lengths=torch.tensor([1]))
    out, stats = _run(c)
    torch.testing.assert_close(out, v[:, :, :1].expand(1, 1, 8, 8))
    assert (stats["max_weight"] == 1).all()
    for name in ("entropy", "grad_health", "jacobian_fro", "score_m2_raw"):
        assert (stats[name] == 0).all(), name


def test_ties_of_the_row_max_across_blocks() -> None:
    """Equal scores at the row max, in one block and in two: the "rest" sums count every tie
    but one (uniform rows: entropy log N exactly, max weight 1 / N)."""
    q = torch.ones(1, 1, 3, 4)
    k = torch.ones(1, 1, 1030, 4)
    v = torch.randn(1, 1, 1030, 4, generator=torch.Generator().manual_seed(1))
    c = Case(q, k, v, scale=0.5, key_lengths=torch.tensor([1030]))
    out, stats = _run(c)
    _check(c, (out, stats))
    torch.testing.assert_close(stats["entropy"], torch.full((1, 1, 3), math.log(1030)))
    torch.testing.assert_close(stats["max_weight"], torch.full((1, 1, 3), 1 / 1030))


@st.composite
def _problems(draw: st.DrawFn) -> Case:
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 3]))
    b = draw(st.integers(1, 2))
    n_q = draw(st.integers(1, 90))
    n_kv = draw(st.integers(1, 600))
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    std = draw(st.sampled_from([0.1, 1.0, 4.0]))
    q, k, v = _qkv(
        b, h, h_kv, n_q, n_kv, 8, draw(st.sampled_from([4, 8, 13])), seed=seed, dtype=dtype, std=std
    )
    gen = torch.Generator().manual_seed(seed)
    kw: dict[str, Any] = {}
    causal = draw(st.sampled_from([None, 0, n_kv - n_q]))
    if causal is not None:
        kw["causal_shift"] = causal
    if draw(st.booleans()):
        kw["key_lengths"] = torch.randint(
            0, n_kv + 1, (b, draw(st.sampled_from([1, h]))), generator=gen
        )
    if draw(st.booleans()):
        kw["visible"] = torch.rand(n_q, n_kv, generator=gen) < draw(st.sampled_from([0.1, 0.7]))
    if draw(st.booleans()):
        kw["bias"] = torch.randn(n_q, n_kv, generator=gen).to(dtype)
    scale = draw(st.sampled_from([0.35, -1.0, 1e-4, 12.0]))
    return Case(q, k, v, scale=scale, sink_tokens=draw(st.integers(0, 6)), **kw)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_problems())
def test_property_every_field_matches_the_float64_reference(c: Case) -> None:
    _check(c, _run(c))


def test_not_available_without_a_compiler_and_loaded_prebuilt(tmp_path: Path) -> None:
    """In a fresh process: without a compiler, available() and build() say why; with a
    prebuilt library (what the container image carries) build() loads it, compiler or not."""
    path = cpu_flash.prebuild(tmp_path)
    assert path.parent == tmp_path
    assert path.name.startswith(cpu_flash.library_name())
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        import torch
        from sdpa_core.kernels import cpu_flash
        print(cpu_flash.available())
        print(cpu_flash.build(Path("{tmp_path}") / "nowhere"))
        print(cpu_flash.build(Path("{tmp_path}")))
        q = torch.randn(1, 2, 5, 4)
        out, stats = cpu_flash.flash_tile(q, q, q, scale=1.0, q_start=0, causal_shift=0,
            key_lengths=None, visible=None, bias=None, sink_tokens=1)
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True,
            scale=1.0)
        print(float((out - ref).abs().max()) < 1e-6, cpu_flash.loaded_from())
        """
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler")}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "(False, 'not built yet: build() was not called')"
    assert lines[1] == f"(False, 'no C++ compiler ({tmp_path}/no-such-compiler not found)')"
    assert lines[2:] == ["(True, '')", "True prebuilt"]


def test_the_parallel_regions_give_the_same_bits_on_any_number_of_threads() -> None:
    """The test workers run torch on one thread each (tests/support/worker_threads.py), which
    would leave the kernel's at::parallel_for regions (tiles over batch x head x query block;
    the summary's table over heads) untested: here the same call on 1 and on 3 threads gives
    the same bits (each task owns its rows and sums them in order), and matches float64."""
    gen = torch.Generator().manual_seed(41)
    q = torch.randn(2, 3, 300, 16, generator=gen)
    k = torch.randn(2, 3, 200, 16, generator=gen)
    v = torch.randn(2, 3, 200, 16, generator=gen)
    padding = torch.zeros(2, 200, dtype=torch.bool)
    padding[1, 150:] = True
    # Rows enough that the summary table's grain (about 32k rows a task) splits its 4 heads
    # into two tasks: 16,384 rows a head.
    long_q = torch.randn(1, 4, 16384, 8, generator=gen)
    long_kv = torch.randn(1, 4, 64, 8, generator=gen)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results.append(
                (
                    attention(q, k, v, key_padding_mask=padding, diagnostics="full"),
                    attention(long_q, long_kv, long_kv, diagnostics="summary"),
                )
            )
    finally:
        torch.set_num_threads(before)
    (one, long_one), (three, long_three) = results
    for a, b in ((one, three), (long_one, long_three)):
        assert a.path == b.path == "flash"
        assert torch.equal(a.output, b.output)
        assert a.row_stats is not None
        assert b.row_stats is not None
        for name, x in a.row_stats.as_dict().items():
            assert torch.equal(x, getattr(b.row_stats, name)), name
        assert a.diagnostics is not None
        assert b.diagnostics is not None
        assert a.diagnostics.summary == b.diagnostics.summary
    want = reference_attention(q, k, v, ~padding[:, None, None, :])
    torch.testing.assert_close(one.output.double(), want.out, rtol=1e-5, atol=1e-5)
