"""The public owners of the rules other packages must not re-derive: the default scale, the
accumulation dtype, causal normalization, key padding and the diagnostics levels (the one
list of diagnostic fields is tested in test_diagnostics.py)."""

from __future__ import annotations

import math

import pytest
import torch

from sdpa_core import (
    DIAGNOSTICS_LEVELS,
    PATHS,
    MaskError,
    Masks,
    SdpaError,
    accumulation_dtype,
    attention,
    attn_mask_4d,
    check_diagnostics_level,
    default_scale,
    flash_unavailable,
    key_lengths_by_head,
    key_padding,
    key_padding_from_lengths,
    normalize_causal,
    resolve_scale,
    score_matrix_nbytes,
    validate_inputs,
    weights_nbytes,
)


@pytest.mark.parametrize("d", [1, 2, 3, 8, 64, 80, 128, 4096])
def test_default_scale_is_one_over_sqrt_d(d: int) -> None:
    assert default_scale(d) == 1.0 / math.sqrt(d)
    assert resolve_scale(None, d) == 1.0 / math.sqrt(d)
    assert resolve_scale(0.25, d) == 0.25
    assert resolve_scale(-3, d) == -3.0
    assert isinstance(resolve_scale(-3, d), float)


def test_attention_uses_the_default_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 6, generator=gen) for _ in range(3))
    for path in PATHS:
        if path == "flash" and flash_unavailable(validate_inputs(q, k, v), q.device):
            continue  # no flash kernel in this process: tests/core/test_flash_path.py's
        kw = {"diagnostics": "summary"} if path in ("chunked", "flash") else {}
        implicit = attention(q, k, v, path=path, **kw)
        explicit = attention(q, k, v, path=path, scale=1.0 / math.sqrt(6), **kw)
        assert torch.equal(implicit.output, explicit.output), path


@pytest.mark.parametrize(
    ("dtype", "accum"),
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_accumulation_dtype(dtype: torch.dtype, accum: torch.dtype) -> None:
    assert accumulation_dtype(dtype) == accum
    q = torch.ones(2, 3, 4, 5, dtype=dtype)
    k = torch.ones(2, 3, 7, 5, dtype=dtype)
    spec = validate_inputs(q, k, k)
    assert spec.accum_dtype == accum
    # 2 x 3 x 4 x 7 elements, each as wide as the accumulation dtype (never the input's).
    item = 8 if dtype == torch.float64 else 4
    assert weights_nbytes(spec) == 2 * 3 * 4 * 7 * item
    assert score_matrix_nbytes(batch=2, heads=3, n_q=4, n_kv=7, dtype=dtype) == 168 * item
    res = attention(q, k, k, diagnostics="full", return_weights=True)
    assert res.row_stats is not None
    assert res.row_stats.entropy.dtype == accum
    assert res.diagnostics is not None
    assert res.diagnostics.per_row is not None
    assert res.diagnostics.per_row.entropy.dtype == accum


def test_normalize_causal() -> None:
    assert normalize_causal(False) == "none"
    assert normalize_causal(None) == "none"
    assert normalize_causal("none") == "none"
    assert normalize_causal(True) == "top_left"
    assert normalize_causal("top_left") == "top_left"
    assert normalize_causal("bottom_right") == "bottom_right"
    for bad in ("causal", "TOP_LEFT", 1, 0.0):
        with pytest.raises(MaskError) as info:
            normalize_causal(bad)  # type: ignore[arg-type]
        assert info.value.param == "causal"


def test_diagnostics_levels_and_paths() -> None:
    assert DIAGNOSTICS_LEVELS == ("none", "summary", "full")
    assert PATHS == ("fused", "dense", "chunked", "flash")
    for level in DIAGNOSTICS_LEVELS:
        assert check_diagnostics_level(level) == level
    for bad in ("Summary", "", None, 1):
        with pytest.raises(SdpaError) as info:
            check_diagnostics_level(bad)
        assert info.value.param == "diagnostics"
    q = torch.ones(1, 1, 2, 4)
    with pytest.raises(SdpaError) as info:
        attention(q, q, q, diagnostics="verbose")
    assert info.value.param == "diagnostics"
    assert info.value.expected == "none | summary | full"


def test_key_padding_from_lengths_by_hand() -> None:
    lengths = torch.tensor([[3, 0], [5, 1]])
    want = torch.tensor(
        [
            [[False, False, False, True, True], [True, True, True, True, True]],
            [[False, False, False, False, False], [False, True, True, True, True]],
        ]
    )
    got = key_padding_from_lengths(lengths, 5)
    assert got.dtype == torch.bool
    assert torch.equal(got, want)


def test_key_padding_per_sequence_per_head_and_combined() -> None:
    spec = validate_inputs(torch.ones(2, 3, 2, 5), torch.ones(2, 3, 4, 5), torch.ones(2, 3, 4, 5))
    per_seq = key_padding(spec, key_lengths=torch.tensor([1, 4]))
    assert per_seq is not None
    assert torch.equal(
        per_seq,
        torch.tensor([[[False, True, True, True]], [[False, False, False, False]]]),
    )  # [B, 1, N_kv]
    per_head = key_padding(spec, key_lengths=[[4, 3, 2], [0, 4, 4]])
    assert per_head is not None
    want = torch.tensor(
        [
            [[False] * 4, [False, False, False, True], [False, False, True, True]],
            [[True] * 4, [False] * 4, [False] * 4],
        ]
    )
    assert torch.equal(per_head, want)  # [B, H, N_kv]
    kpm = torch.tensor([[False, False, True, False], [True, False, False, False]])
    combined = key_padding(spec, key_lengths=torch.tensor([1, 4]), key_padding_mask=kpm)
    assert combined is not None
    assert torch.equal(combined, per_seq | kpm[:, None, :])
    only_mask = key_padding(spec, key_padding_mask=kpm)
    assert only_mask is not None
    assert torch.equal(only_mask, kpm[:, None, :])
    # A single length for every sequence broadcasts: [1, 1, N_kv].
    scalar = key_padding(spec, key_lengths=2)
    assert scalar is not None
    assert torch.equal(scalar, torch.tensor([[[False, False, True, True]]]))
    # No key is padding: None, and nothing at all given: None.
    assert key_padding(spec, key_lengths=torch.tensor([4, 4])) is None
    assert key_padding(spec) is None


def test_key_lengths_by_head_and_attn_mask_4d_shapes() -> None:
    spec = validate_inputs(
        torch.ones(2, 2, 3, 2, 5), torch.ones(2, 2, 3, 4, 5), torch.ones(2, 2, 3, 4, 5)
    )  # batch dims (2, 2): B = 4
    assert key_lengths_by_head(spec, torch.ones(2, 2, dtype=torch.int64)).shape == (4, 1)
    assert key_lengths_by_head(spec, torch.ones(2, 2, 3, dtype=torch.int64)).shape == (4, 3)
    assert key_lengths_by_head(spec, 3).shape == (1, 1)
    assert key_lengths_by_head(spec, [[1, 2], [3, 4]]).dtype == torch.int64
    assert attn_mask_4d(torch.ones(2, 4, dtype=torch.bool), spec).shape == (1, 1, 2, 4)
    assert attn_mask_4d(torch.ones(3, 1, 4), spec).shape == (1, 3, 1, 4)
    assert attn_mask_4d(torch.ones(2, 1, 1, 2, 4), spec).shape == (4, 1, 2, 4)


def test_key_padding_matches_attention() -> None:
    """Padding from key_padding(), passed as key_padding_mask, gives attention()'s own result
    for the key_lengths it came from."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 5, 4, generator=gen)
    k, v = torch.randn(3, 2, 6, 4, generator=gen), torch.randn(3, 2, 6, 4, generator=gen)
    lengths = torch.tensor([[6, 2], [0, 5], [3, 1]])
    spec = validate_inputs(q, k, v, Masks(key_lengths=lengths))
    pad = key_padding(spec, key_lengths=lengths)
    assert pad is not None
    by_lengths = attention(q, k, v, key_lengths=lengths)
    by_mask = attention(q, k, v, key_padding_mask=pad.expand(3, 2, 6))
    torch.testing.assert_close(by_mask.output, by_lengths.output)
