"""The Triton flash kernel (sdpa_core/kernels/triton_flash.py) against the float64 reference.

With CUDA these tests run the compiled kernel on the device (test_triton_flash_gpu.py adds the
large shapes). Without it they run on CPU tensors through Triton's interpreter, which a process
chooses once: triton.language wraps its own @jit helpers (tl.zeros among them) when it is
imported, by TRITON_INTERPRET (triton/runtime/jit.py reads knobs.runtime.interpret in the
decorator). Setting it here, for the rest of a pytest session, would reach every later test
and every process they start (a live server would then serve diagnostics from the
interpreter), so this module runs only in a process started with it:
test_triton_flash_processes.py starts a child pytest on it (or run
`TRITON_INTERPRET=1 pytest tests/core/test_triton_flash.py`). Shapes stay tiny: the
interpreter is about 500x slower than torch.
"""

from __future__ import annotations

import decimal
import math
import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
    pytest.skip(
        "runs under Triton's interpreter, in the child pytest with TRITON_INTERPRET=1 that "
        "tests/core/test_triton_flash_processes.py starts",
        allow_module_level=True,
    )
pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdpa_core.diagnostics import ROW_STATS_FIELDS
from sdpa_core.kernels import triton_flash
from tests.core.flash_tiles import (
    Tile,
    check_tile,
    expected,
    tile_inputs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _kernel_runs_here() -> None:
    ok, why = triton_flash.available()
    assert ok, why


def _dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


# ---- every mask option, alignment and shape class -------------------------------------------

MASK_CASES = {
    "plain": Tile(),
    "causal_top_left": Tile(causal="top_left", n_q=24, n_kv=24),
    "causal_top_left_more_queries": Tile(causal="top_left", n_q=36, n_kv=20),
    "causal_bottom_right_fewer_queries": Tile(causal="bottom_right", n_q=12, n_kv=40),
    # query i sees keys j <= i - 20: the first 20 rows see nothing
    "causal_bottom_right_more_queries": Tile(causal="bottom_right", n_q=40, n_kv=20),
    "key_lengths_per_sequence": Tile(lengths=[40, 17]),
    "key_lengths_per_head": Tile(lengths=[[40, 5], [0, 23]]),
    "key_padding_in_visible": Tile(pad=[[True] * 3 + [False] * 37, [False] * 30 + [True] * 10]),
    "bool_mask": Tile(mask=True, n_q=8),
    "float_mask": Tile(bias=True),
    "float_mask_with_neg_inf": Tile(bias=True, mask=True),
    "causal_and_lengths": Tile(causal="bottom_right", n_q=16, n_kv=40, lengths=[[33, 9], [40, 1]]),
    "everything": Tile(
        h=4,
        h_kv=2,
        causal="bottom_right",
        n_q=18,
        n_kv=34,
        lengths=[[34, 30, 12, 0], [20, 34, 34, 7]],
        pad=[[True, True] + [False] * 32, [False] * 33 + [True]],
        mask=True,
        bias=True,
    ),
    "tile_rows_top_left": Tile(causal="top_left", n_q=40, n_kv=40, rows=(17, 37)),
    "tile_rows_bottom_right": Tile(causal="bottom_right", n_q=30, n_kv=40, rows=(5, 21), mask=True),
    "contiguous_inputs": Tile(strided=False, causal="top_left"),
}


@pytest.mark.parametrize("case", MASK_CASES.values(), ids=MASK_CASES.keys())
def test_mask_options_match_float64(case: Tile) -> None:
    check_tile(triton_flash.flash_tile, case, DEVICE)


SHAPE_CASES = {
    "gqa_4_to_1": Tile(h=4, h_kv=1, causal="top_left", n_q=20, n_kv=20),
    "gqa_4_to_2_masked": Tile(h=4, h_kv=2, lengths=[[40, 3, 22, 40], [9, 40, 40, 31]]),
    "dv_below_d": Tile(d=24, d_v=12),
    "dv_above_d": Tile(d=8, d_v=20),
    "d_not_a_power_of_two": Tile(d=5, d_v=3, n_q=9, n_kv=21),
    "head_dim_one": Tile(d=1, d_v=1, n_q=3, n_kv=5),
    "head_dim_over_16": Tile(d=40, d_v=33, n_q=9, n_kv=19),
    "one_query_one_key": Tile(n_q=1, n_kv=1),
    "one_query_many_keys": Tile(n_q=1, n_kv=50, causal="bottom_right"),
}


@pytest.mark.parametrize("case", SHAPE_CASES.values(), ids=SHAPE_CASES.keys())
def test_shapes_match_float64(case: Tile) -> None:
    check_tile(triton_flash.flash_tile, case, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_dtypes_match_float64(dtype: torch.dtype, causal: str) -> None:
    check_tile(
        triton_flash.flash_tile,
        Tile(dtype=dtype, causal=causal, n_q=16, n_kv=36, lengths=[36, 21], bias=True),
        DEVICE,
    )


@pytest.mark.parametrize(
    "scale",
    [-0.7, -3.0, 0.0, 1e-30, 1e-7, 25.0, 1e3],
    ids=["negative", "negative_large", "zero", "tiny", "small", "large", "huge"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_scales_match_float64(scale: float, dtype: torch.dtype) -> None:
    # lse is scale x q.k + log l: its float32 rounding grows with the scores' size
    lse_atol = 2e-5 * max(1.0, abs(scale) * 10.0)
    check_tile(
        triton_flash.flash_tile,
        Tile(scale=scale, dtype=dtype, n_q=12, n_kv=36, causal="top_left", mask=True),
        DEVICE,
        tolerance={"lse": (lse_atol, 2e-5)},
    )


# ---- rows the statistics find hard --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_fully_masked_rows_give_zero_and_lse_minus_inf(dtype: torch.dtype) -> None:
    """Rows without a visible key, each way a row can lose all its keys (causal limit, key
    length 0, an all-False mask row, a whole block of them): 0 output, every statistic 0,
    lse -inf, no NaN."""
    case = Tile(
        dtype=dtype,
        causal="bottom_right",
        n_q=24,
        n_kv=20,
        lengths=[[20, 0], [13, 20]],
        mask=True,
    )
    stats = check_tile(triton_flash.flash_tile, case, DEVICE)
    empty = stats["visible_keys"] == 0
    assert int(empty.sum()) > 24  # head (0, 1) and the first four rows of every head at least
    assert bool((stats["lse"][empty] == -math.inf).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("gap", [12.0, 40.0, 60.0, 200.0])
def test_one_hot_rows_keep_entropy_near_zero(dtype: torch.dtype, gap: float) -> None:
    """Each row's score on one key (in the second key block) beats the rest by `gap`: p_max
    -> 1 and 1 + tiny rounds to 1 in float32. The rest sums keep entropy, gradient health and
    the Jacobian norm relatively accurate (a naive 1 - sum p^2 keeps none of their digits);
    at gap 60 the squared weights (e^-120) are below float32's range unless scaled, and the
    rescale of the first block's sums by alpha^2 = e^-120 as well. At gap 200 every weight
    but the max is below float32's range: those statistics are 0."""
    n_q, n_kv, d = 6, 40, 16
    q = torch.zeros(1, 2, n_q, d)
    k = torch.zeros(1, 2, n_kv, d)
    for i in range(n_q):
        q[:, :, i, i] = 1.0
        k[:, :, 17 + i, i] = 1.0  # key 17 + i scores 1, every other key 0
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(1, 2, n_kv, d, generator=gen)
    q, k, v = (x.to(dtype).to(DEVICE) for x in (q, k, v))
    out, stats = triton_flash.flash_tile(
        q,
        k,
        v,
        scale=gap,
        q_start=0,
        causal_shift=None,
        key_lengths=None,
        visible=None,
        bias=None,
        sink_tokens=4,
    )
    # The definitions in 80-digit decimals (float64 itself cancels here: 1 + 39 e^-40 is 1).
    with decimal.localcontext(prec=80) as ctx:
        exps = [ctx.exp(decimal.Decimal(gap))] + [decimal.Decimal(1)] * (n_kv - 1)
        total = sum(exps, decimal.Decimal(0))
        p = [e / total for e in exps]
        entropy = -sum((x * x.ln() for x in p), decimal.Decimal(0))
        grad_health = sum((x * (1 - x) for x in p), decimal.Decimal(0)) / n_kv
        jac_sq = sum(
            (
                ((p[i] if i == j else 0) - p[i] * p[j]) ** 2
                for i in range(n_kv)
                for j in range(n_kv)
            ),
            decimal.Decimal(0),
        )
        want = {
            "entropy": float(entropy),
            "grad_health": float(grad_health),
            "jacobian_fro": float(jac_sq.sqrt()),
            "max_weight": float(p[0]),
            "lse": float(total.ln()),
        }
    for name, value in want.items():
        got = stats[name].double().cpu()
        # atol: what is below float32's range is 0 there
        close = torch.allclose(got, torch.full_like(got, value), rtol=1e-4, atol=1e-37)
        assert close, f"{name}: {got.flatten()[:3].tolist()} vs {value}"
    assert float(stats["entropy"].min()) >= 0.0
    one_hot = v.float().cpu()[:, :, 17 : 17 + n_q]
    torch.testing.assert_close(out.float().cpu(), one_hot, rtol=0, atol=2e-2 if gap < 20 else 1e-3)


def test_entropy_with_large_common_offset() -> None:
    """Raw scores ~1e4 with a small spread (kernel-anchors pitfall 24): scores relative to the
    running max keep the entropy to the input's own floor (fp32 q.k at 1e4 rounds by ~1e-3,
    times the scale 0.3)."""
    gen = torch.Generator().manual_seed(2)
    d = 16
    q = torch.zeros(1, 1, 4, d)
    q[..., 0] = 100.0
    k = torch.randn(1, 1, 64, d, generator=gen) * 0.02
    k[..., 0] += 100.0
    v = torch.randn(1, 1, 64, d, generator=gen)
    _, stats = triton_flash.flash_tile(
        q.to(DEVICE),
        k.to(DEVICE),
        v.to(DEVICE),
        scale=0.3,
        q_start=0,
        causal_shift=None,
        key_lengths=None,
        visible=None,
        bias=None,
        sink_tokens=4,
    )
    p = torch.softmax(0.3 * (q.double() @ k.double().transpose(-1, -2)), -1)
    ent = -(p * p.log()).sum(-1)
    assert torch.allclose(stats["entropy"].double().cpu(), ent, atol=2e-3)


@pytest.mark.parametrize(
    "case",
    [
        Tile(sink_tokens=3),
        Tile(sink_tokens=0),
        Tile(sink_tokens=100),  # more than the keys: the whole row
        Tile(sink_tokens=20, n_kv=40),  # the sink spans two key blocks
        Tile(sink_tokens=4, lengths=[[2, 40], [0, 40]], pad=[[False, True] + [False] * 38] * 2),
        Tile(sink_tokens=5, causal="top_left", n_q=8, n_kv=8),
    ],
    ids=["three", "none", "all", "two_blocks", "hidden_sink_keys", "causal"],
)
def test_sink_share_matches_float64(case: Tile) -> None:
    check_tile(triton_flash.flash_tile, case, DEVICE)


# The interpreter's numpy warns about the IEEE arithmetic a GPU does silently (scale x q.k
# overflowing to inf, inf - inf in the branch a select then drops).
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_score_overflowing_to_inf_takes_the_whole_weight() -> None:
    """scale x q.k = 6e38 overflows float32 to +inf (key 0; key 1 scores 0): the row puts
    its whole weight on key 0 rather than computing inf - inf (the other paths' answer)."""
    q = torch.ones(1, 1, 2, 2)
    k = torch.tensor([[[[1.0, 1.0], [0.0, 0.0]]]])
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    out, stats = triton_flash.flash_tile(
        q.to(DEVICE),
        k.to(DEVICE),
        v.to(DEVICE),
        scale=3e38,
        q_start=0,
        causal_shift=None,
        key_lengths=None,
        visible=None,
        bias=None,
        sink_tokens=1,
    )
    torch.testing.assert_close(out.cpu(), v[..., :1, :].expand(1, 1, 2, 2))
    for name in ROW_STATS_FIELDS:
        assert not torch.isnan(stats[name]).any(), name
    assert torch.equal(stats["max_weight"].cpu(), torch.ones(1, 1, 2))
    assert torch.equal(stats["sink_share"].cpu(), torch.ones(1, 1, 2))


def test_keys_past_the_length_are_never_read() -> None:
    """NaN in keys and values past each sequence's length changes nothing (they are cut from
    the loop and masked in its last block, never multiplied by a zero weight)."""
    case = Tile(lengths=[[23, 40], [5, 17]], n_q=8)
    inp = tile_inputs(case, DEVICE)
    k, v = inp.k.clone(), inp.v.clone()
    k[0, 0, 23:] = math.nan
    v[0, 0, 23:] = math.inf
    k[1, :, 17:] = math.nan
    v[1, 0, 5:] = math.nan
    out, stats = triton_flash.flash_tile(inp.q, k, v, **inp.kwargs)
    want_out, want = expected(inp)
    assert torch.allclose(out.double().cpu(), want_out, atol=1e-5)
    assert torch.allclose(stats["entropy"].double().cpu(), want["entropy"], atol=2e-5)


# ---- the contract's edges -----------------------------------------------------------------


def test_returns_every_row_stats_field() -> None:
    inp = tile_inputs(Tile(n_q=4, n_kv=8), DEVICE)
    _, stats = triton_flash.flash_tile(inp.q, inp.k, inp.v, **inp.kwargs)
    assert set(stats) == set(ROW_STATS_FIELDS)


def test_no_keys_at_all() -> None:
    q = torch.randn(1, 2, 3, 8, device=DEVICE)
    kv = torch.empty(1, 1, 0, 8, device=DEVICE)
    out, stats = triton_flash.flash_tile(
        q,
        kv,
        kv,
        scale=1.0,
        q_start=0,
        causal_shift=None,
        key_lengths=None,
        visible=None,
        bias=None,
        sink_tokens=4,
    )
    assert torch.equal(out.cpu(), torch.zeros(1, 2, 3, 8))
    assert bool((stats["lse"] == -math.inf).all())
    assert bool((stats["visible_keys"] == 0).all())


def test_refuses_float64_and_mixed_dtypes() -> None:
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    kw: dict[str, Any] = {
        "scale": 1.0,
        "q_start": 0,
        "causal_shift": None,
        "key_lengths": None,
        "visible": None,
        "bias": None,
        "sink_tokens": 0,
    }
    with pytest.raises(TypeError, match="float32, float16, bfloat16"):
        triton_flash.flash_tile(q, q, q, **kw)
    with pytest.raises(TypeError, match="one dtype"):
        triton_flash.flash_tile(q.float(), q.half(), q.float(), **kw)
    with pytest.raises(ValueError, match="H_kv"):
        triton_flash.flash_tile(q.float(), q.float().expand(1, 3, 2, 4), q.float(), **kw)


# ---- a property against the float64 reference ---------------------------------------------


@st.composite
def tiles(draw: st.DrawFn) -> Tile:
    h_kv = draw(st.sampled_from([1, 2]))
    n_q = draw(st.integers(1, 20))
    n_kv = draw(st.integers(1, 40))
    b = 2
    h = h_kv * draw(st.sampled_from([1, 2]))
    q0 = draw(st.integers(0, n_q - 1))
    q1 = draw(st.integers(q0 + 1, n_q))
    lengths = None
    if draw(st.booleans()):
        lengths = [[draw(st.integers(0, n_kv)) for _ in range(h)] for _ in range(b)]
    return Tile(
        b=b,
        h=h,
        h_kv=h_kv,
        n_q=n_q,
        n_kv=n_kv,
        d=draw(st.sampled_from([3, 8, 16, 20])),
        d_v=draw(st.sampled_from([2, 8, 17])),
        causal=draw(st.sampled_from(["none", "top_left", "bottom_right"])),
        lengths=lengths,
        mask=draw(st.booleans()),
        bias=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 1.0, -0.5, 4.0])),
        dtype=draw(st.sampled_from(DTYPES)),
        rows=(q0, q1),
        sink_tokens=draw(st.integers(0, 6)),
        std=draw(st.sampled_from([0.1, 1.0, 3.0])),
        seed=draw(st.integers(0, 2**16)),
        strided=draw(st.booleans()),
    )


@settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(tiles())
def test_property_every_field_matches_float64(case: Tile) -> None:
    # scores up to |4 x 3^2 x 20| = 720: lse's float32 rounding at that size
    check_tile(triton_flash.flash_tile, case, DEVICE, tolerance={"lse": (2e-4, 2e-5)})
