"""Every SdpaError case carries param, expected and got; path choice and the memory budget."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sdpa_core import (
    DTypeError,
    LimitError,
    MaskError,
    Masks,
    NonFiniteError,
    SdpaError,
    ShapeError,
    attention,
    flash_unavailable,
    validate_inputs,
)


def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(*shape, dtype=dtype)


Q, K, V = t(2, 4, 5, 8), t(2, 2, 6, 8), t(2, 2, 6, 3)

ERROR_CASES: list[tuple[str, tuple[Any, ...], dict[str, Any], type[SdpaError], str]] = [
    ("rank_1", (t(8), t(8), t(8)), {}, ShapeError, "q"),
    ("k_rank", (Q, t(2, 6, 8), V), {}, ShapeError, "k"),
    ("v_rank", (Q, K, t(2, 6, 3)), {}, ShapeError, "v"),
    ("d_mismatch", (Q, t(2, 2, 6, 7), V), {}, ShapeError, "k"),
    ("n_kv_mismatch", (Q, K, t(2, 2, 5, 3)), {}, ShapeError, "v"),
    ("v_heads", (Q, K, t(2, 1, 6, 3)), {}, ShapeError, "v"),
    ("heads_not_multiple", (Q, t(2, 3, 6, 8), t(2, 3, 6, 3)), {}, ShapeError, "k"),
    ("batch_mismatch", (Q, t(3, 2, 6, 8), t(3, 2, 6, 3)), {}, ShapeError, "k"),
    ("empty_n_q", (t(2, 4, 0, 8), K, V), {}, ShapeError, "q"),
    ("empty_n_kv", (Q, t(2, 2, 0, 8), t(2, 2, 0, 3)), {}, ShapeError, "k"),
    ("empty_d", (t(2, 4, 5, 0), t(2, 2, 6, 0), V), {}, ShapeError, "q"),
    ("empty_d_v", (Q, K, t(2, 2, 6, 0)), {}, ShapeError, "v"),
    ("empty_batch", (t(0, 4, 5, 8), t(0, 2, 6, 8), t(0, 2, 6, 3)), {}, ShapeError, "q"),
    ("mixed_dtypes", (Q, K.half(), V), {}, DTypeError, "k"),
    ("mixed_v_dtype", (Q, K, V.double()), {}, DTypeError, "v"),
    ("unsupported_dtype", (Q.int(), K.int(), V.int()), {}, DTypeError, "q"),
    ("not_a_tensor", ([[1.0]], K, V), {}, DTypeError, "q"),
    (
        "mask_not_broadcast",
        (Q, K, V),
        {"attn_mask": t(5, 5, dtype=torch.bool)},
        MaskError,
        "attn_mask",
    ),
    (
        "mask_too_many_dims",
        (Q, K, V),
        {"attn_mask": t(1, 2, 4, 5, 6, dtype=torch.bool)},
        MaskError,
        "attn_mask",
    ),
    (
        "mask_int_dtype",
        (Q, K, V),
        {"attn_mask": t(5, 6, dtype=torch.int64)},
        DTypeError,
        "attn_mask",
    ),
    (
        "mask_other_float",
        (Q.half(), K.half(), V.half()),
        {"attn_mask": t(5, 6).double()},
        DTypeError,
        "attn_mask",
    ),
    (
        "mask_nan",
        (Q, K, V),
        {"attn_mask": torch.full((5, 6), math.nan)},
        NonFiniteError,
        "attn_mask",
    ),
    ("kpm_dtype", (Q, K, V), {"key_padding_mask": t(2, 6)}, DTypeError, "key_padding_mask"),
    (
        "kpm_shape",
        (Q, K, V),
        {"key_padding_mask": t(2, 5, dtype=torch.bool)},
        MaskError,
        "key_padding_mask",
    ),
    (
        "key_lengths_count",
        (Q, K, V),
        {"key_lengths": torch.tensor([1, 2, 3])},
        MaskError,
        "key_lengths",
    ),
    (
        "key_lengths_above",
        (Q, K, V),
        {"key_lengths": torch.tensor([6, 7])},
        MaskError,
        "key_lengths",
    ),
    ("key_lengths_negative", (Q, K, V), {"key_lengths": [-1, 2]}, MaskError, "key_lengths"),
    (
        "key_lengths_float",
        (Q, K, V),
        {"key_lengths": torch.tensor([1.0, 2.0])},
        MaskError,
        "key_lengths",
    ),
    ("causal_unknown", (Q, K, V), {"causal": "bottom_left"}, MaskError, "causal"),
    ("q_nan", (Q * math.nan, K, V), {}, NonFiniteError, "q"),
    ("k_inf", (Q, K * math.inf, V), {}, NonFiniteError, "k"),
    ("scale_nan", (Q, K, V), {"scale": math.nan}, NonFiniteError, "scale"),
    ("scale_str", (Q, K, V), {"scale": "0.1"}, SdpaError, "scale"),
    (
        "weights_over_budget",
        (Q, K, V),
        {"return_weights": True, "memory_budget_bytes": 100},
        LimitError,
        "return_weights",
    ),
    (
        "dense_over_budget",
        (Q, K, V),
        {"path": "dense", "memory_budget_bytes": 100},
        LimitError,
        "path",
    ),
    ("fused_with_weights", (Q, K, V), {"path": "fused", "return_weights": True}, SdpaError, "path"),
    (
        "fused_with_diagnostics",
        (Q, K, V),
        {"path": "fused", "diagnostics": "summary"},
        SdpaError,
        "path",
    ),
    (
        "chunked_with_weights",
        (Q, K, V),
        {"path": "chunked", "return_weights": True},
        SdpaError,
        "path",
    ),
    ("unknown_path", (Q, K, V), {"path": "sparse"}, SdpaError, "path"),
    ("unknown_level", (Q, K, V), {"diagnostics": "all"}, SdpaError, "diagnostics"),
    ("bad_block_size", (Q, K, V), {"block_size": 0}, SdpaError, "block_size"),
    ("bad_budget", (Q, K, V), {"memory_budget_bytes": -1}, SdpaError, "memory_budget_bytes"),
]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "param"),
    [c[1:] for c in ERROR_CASES],
    ids=[c[0] for c in ERROR_CASES],
)
def test_error_carries_context(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[SdpaError], param: str
) -> None:
    with pytest.raises(error) as info:
        attention(*args, **kwargs)
    exc = info.value
    assert type(exc) is error  # the precise class, not a parent
    assert exc.param == param
    assert exc.expected is not None
    assert exc.got is not None
    assert param in str(exc)


def test_validate_inputs_spec() -> None:
    spec = validate_inputs(Q, K, V, Masks(causal=True))
    assert spec.batch_shape == (2,)
    assert (spec.heads, spec.kv_heads, spec.n_q, spec.n_kv, spec.d, spec.d_v) == (4, 2, 5, 6, 8, 3)
    assert spec.dtype == torch.float32
    assert spec.causal == "top_left"
    assert validate_inputs(t(5, 8), t(6, 8), t(6, 3)).heads == 1
    five = validate_inputs(
        t(3, 2, 4, 5, 8), t(3, 2, 1, 6, 8), t(3, 2, 1, 6, 3), Masks(causal="bottom_right")
    )
    assert five.batch_shape == (3, 2)
    assert five.causal == "bottom_right"
    assert validate_inputs(Q, K, V, Masks(causal=False)).causal == "none"


def test_float_mask_in_float32_or_q_dtype() -> None:
    q = t(1, 1, 2, 4, dtype=torch.bfloat16)
    for mask in (torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bfloat16)):
        validate_inputs(q, q, q, Masks(attn_mask=mask))


def test_automatic_path_choice() -> None:
    q = torch.randn(1, 2, 4, 8)
    assert attention(q, q, q).path == "fused"
    assert attention(q, q, q, return_weights=True).path == "dense"
    assert attention(q, q, q, return_weights=True, diagnostics="full").path == "dense"
    # diagnostics without weights: flash where a kernel runs them, else chunked, even
    # without any budget
    stats_path = "chunked" if flash_unavailable(validate_inputs(q, q, q), q.device) else "flash"
    assert attention(q, q, q, diagnostics="summary").path == stats_path
    # the weights fit the budget exactly (1*2*4*4 fp32 = 128 bytes)
    assert attention(q, q, q, return_weights=True, memory_budget_bytes=128).path == "dense"
    with pytest.raises(LimitError):
        attention(q, q, q, return_weights=True, memory_budget_bytes=127)
    # beyond the budget, diagnostics still come (neither path holds the weights)
    assert attention(q, q, q, diagnostics="summary", memory_budget_bytes=1).path == stats_path
    # float64 accumulates in float64: 8-byte weights
    q64 = q.double()
    with pytest.raises(LimitError) as info:
        attention(q64, q64, q64, return_weights=True, memory_budget_bytes=128)
    assert info.value.got == "256 bytes"


def test_key_lengths_accepts_lists_ints_and_per_head() -> None:
    q = torch.randn(2, 3, 4, 5)
    a = attention(q, q, q, key_lengths=[2, 4]).output
    b = attention(q, q, q, key_lengths=torch.tensor([[2, 2, 2], [4, 4, 4]])).output
    c = attention(q, q, q, key_lengths=torch.tensor([2, 4], dtype=torch.int32)).output
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    d = attention(q, q, q, key_lengths=3).output  # one length for every sequence
    torch.testing.assert_close(d, attention(q, q, q, key_lengths=[3, 3]).output)


# ---- the NaN/Inf scan: a sum per tensor first, the element scan only when it is not finite ----

NONFINITE_MESSAGE = "contains NaN or Inf (pass allow_nonfinite=True to accept them)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_entry_in_each_input_is_named(
    name: str, dtype: torch.dtype, bad: float
) -> None:
    gen = torch.Generator().manual_seed(3)
    t = {n: torch.randn(2, 2, 3, 4, generator=gen).to(dtype) for n in ("q", "k", "v")}
    t[name][1, 0, 2, 3] = bad
    with pytest.raises(NonFiniteError) as info:
        attention(t["q"], t["k"], t["v"])
    exc = info.value
    assert (exc.param, exc.message) == (name, NONFINITE_MESSAGE)
    assert (exc.expected, exc.got) == ("finite values", "1 non-finite of 48")


def test_the_first_nonfinite_input_is_named() -> None:
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    k[0, 0, 0, 0] = math.nan
    v[..., 1] = math.inf
    with pytest.raises(NonFiniteError) as info:
        attention(q, k, v)
    assert (info.value.param, info.value.got) == ("k", "1 non-finite of 24")
    k[0, 0, 0, 0] = 0.0
    with pytest.raises(NonFiniteError) as info:
        attention(q, k, v)
    assert (info.value.param, info.value.got) == ("v", "6 non-finite of 24")


@pytest.mark.parametrize("path", ["fused", "dense", "chunked"])
def test_large_finite_float16_whose_float16_sum_overflows_is_accepted(path: str) -> None:
    """float16 sums accumulate in float32: 64 x 60000 is no false alarm."""
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, 4, 8, generator=gen).half() for _ in range(2))
    v = torch.full((1, 2, 4, 8), 60000.0, dtype=torch.float16)  # the float16 max is 65504
    assert torch.isinf(v.sum())
    res = attention(q, k, v, path=path, diagnostics="none" if path == "fused" else "summary")
    assert torch.isfinite(res.output).all()
    torch.testing.assert_close(res.output, v)  # every row averages copies of 60000


@pytest.mark.parametrize("path", ["fused", "dense", "chunked"])
def test_finite_input_whose_float32_sum_overflows_falls_back_to_the_scan(path: str) -> None:
    q = k = torch.zeros(1, 1, 4, 2)  # uniform weights: every output row is v's mean
    v = torch.ones(1, 1, 4, 2)
    v[0, 0, 0, 0] = v[0, 0, 1, 1] = 3e38  # finite, but their sum is not
    assert torch.isinf(v.sum())
    res = attention(q, k, v, path=path, diagnostics="none" if path == "fused" else "summary")
    assert torch.isfinite(res.output).all()  # the output's own sum overflows too: accepted
    want = v.double().mean(-2, keepdim=True).expand(1, 1, 4, 2)
    torch.testing.assert_close(res.output.double(), want, rtol=1e-6, atol=0.0)


def test_float_mask_may_hold_minus_inf_and_large_finite_values() -> None:
    q = t(1, 2, 3, 4)
    bias = torch.zeros(3, 5)
    bias[0, 1] = -math.inf  # the sum is -inf: no NaN and no +inf
    validate_inputs(q, t(1, 2, 5, 4), t(1, 2, 5, 4), Masks(attn_mask=bias))
    bias[1] = 3e38  # the sum is now NaN (+inf overflow beside -inf): the scan accepts it
    assert torch.isnan(bias.sum())
    validate_inputs(q, t(1, 2, 5, 4), t(1, 2, 5, 4), Masks(attn_mask=bias))
    half = torch.full((3, 5), 60000.0, dtype=torch.float16)  # sums in float32: no overflow
    validate_inputs(q.half(), t(1, 2, 5, 4).half(), t(1, 2, 5, 4).half(), Masks(attn_mask=half))


@pytest.mark.parametrize(
    ("entries", "got"),
    [
        ({(0, 0): math.nan}, "1 NaN/+inf entries"),
        ({(0, 0): math.inf}, "1 NaN/+inf entries"),
        ({(0, 0): math.inf, (1, 1): -math.inf}, "1 NaN/+inf entries"),  # the sum is NaN
        ({(0, 0): math.nan, (1, 1): math.inf, (2, 2): -math.inf}, "2 NaN/+inf entries"),
    ],
)
def test_float_mask_with_nan_or_plus_inf_is_refused(
    entries: dict[tuple[int, int], float], got: str
) -> None:
    q = t(1, 2, 3, 4)
    bias = torch.zeros(3, 5)
    for at, value in entries.items():
        bias[at] = value
    with pytest.raises(NonFiniteError) as info:
        attention(q, t(1, 2, 5, 4), t(1, 2, 5, 4), attn_mask=bias)
    exc = info.value
    assert exc.message == "float attn_mask may hold -inf (not visible) but not NaN or +inf"
    assert (exc.param, exc.expected, exc.got) == ("attn_mask", "finite values or -inf", got)
