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
    ("unknown_path", (Q, K, V), {"path": "flash"}, SdpaError, "path"),
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
    # diagnostics without weights: chunked, even without any budget
    assert attention(q, q, q, diagnostics="summary").path == "chunked"
    # the weights fit the budget exactly (1*2*4*4 fp32 = 128 bytes)
    assert attention(q, q, q, return_weights=True, memory_budget_bytes=128).path == "dense"
    with pytest.raises(LimitError):
        attention(q, q, q, return_weights=True, memory_budget_bytes=127)
    # beyond the budget, diagnostics still come (chunked never holds the weights)
    assert attention(q, q, q, diagnostics="summary", memory_budget_bytes=1).path == "chunked"
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
