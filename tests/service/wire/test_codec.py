"""service.wire.codec: wire tensors <-> torch, checked against bytes and values built with numpy."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.errors import InvalidRequest
from service.wire.codec import decode_int_list, decode_tensor, dumps, encode_tensor, loads, to_numpy
from service.wire.models import WireTensor

LOC = ("body", "q")
BIG = 1 << 20


def wire(**fields: Any) -> WireTensor:
    return WireTensor.model_validate(fields)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (independent of torch)."""
    bits = values.astype("<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2")


def error_of(fn: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(InvalidRequest) as info:
        fn(*args, **kwargs)
    (err,) = info.value.errors
    return err.loc, err.msg


@pytest.mark.parametrize(
    ("name", "np_dtype", "torch_dtype"),
    [("float16", "<f2", torch.float16), ("float32", "<f4", torch.float32),
     ("float64", "<f8", torch.float64)],
)  # fmt: skip
def test_b64_decodes_little_endian_bytes(name: str, np_dtype: str, torch_dtype: Any) -> None:
    values = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np_dtype)
    b64 = base64.b64encode(values.tobytes()).decode()
    decoded = decode_tensor(
        wire(dtype=name, shape=[2, 3, 4], b64=b64), loc=LOC, role="float", max_elements=BIG
    )
    assert decoded.encoding == "base64"
    assert decoded.tensor.dtype == torch_dtype
    assert torch.equal(decoded.tensor, torch.from_numpy(values.astype(np_dtype[1:])))
    # And back: the same bytes.
    assert encode_tensor(decoded.tensor, encoding="base64")["b64"] == b64


def test_bfloat16_b64_carries_raw_two_byte_values() -> None:
    values = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0], dtype=np.float32)
    bits = bf16_bits(values)
    b64 = base64.b64encode(bits.tobytes()).decode()
    decoded = decode_tensor(
        wire(dtype="bfloat16", shape=[5], b64=b64), loc=LOC, role="float", max_elements=BIG
    ).tensor
    assert decoded.dtype == torch.bfloat16
    # The bf16 value whose bits are `bits` is the float32 with those bits in its high half.
    expected = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(decoded.float().numpy(), expected)
    encoded = encode_tensor(decoded, encoding="base64")
    assert encoded == {"dtype": "bfloat16", "shape": [5], "b64": b64}
    # Lists carry the values as numbers (the shortest text that reads back as the same float32).
    listed = json.loads(dumps(encode_tensor(decoded, encoding="json")))
    np.testing.assert_array_equal(np.asarray(listed["data"], dtype=np.float32), expected)


def test_lists_decode_to_the_declared_dtype() -> None:
    data = [[[0.5, -1.0], [2.0, 3.0]]]
    for name, dtype in (("float16", torch.float16), ("float64", torch.float64),
                        ("bfloat16", torch.bfloat16), ("float32", torch.float32)):  # fmt: skip
        t = decode_tensor(wire(dtype=name, data=data), loc=LOC, role="float", max_elements=BIG)
        assert t.encoding == "json"
        assert torch.equal(t.tensor, torch.tensor(data, dtype=dtype))


def test_bare_lists_are_float32_or_bool() -> None:
    numbers = decode_tensor([[1, 2.5]], loc=LOC, role="mask", max_elements=BIG).tensor
    assert numbers.dtype == torch.float32
    assert numbers.tolist() == [[1.0, 2.5]]
    flags = decode_tensor([[True, False]], loc=LOC, role="mask", max_elements=BIG).tensor
    assert flags.dtype == torch.bool
    assert flags.tolist() == [[True, False]]


def test_bool_masks_from_b64_and_lists() -> None:
    mask = np.array([[1, 0, 1]], dtype=np.uint8)
    b64 = base64.b64encode(mask.tobytes()).decode()
    t = decode_tensor(
        wire(dtype="bool", shape=[1, 3], b64=b64), loc=LOC, role="bool_mask", max_elements=BIG
    ).tensor
    assert t.tolist() == [[True, False, True]]
    bad = base64.b64encode(bytes([0, 2, 1])).decode()
    loc, msg = error_of(decode_tensor, wire(dtype="bool", shape=[3], b64=bad), loc=LOC,
                        role="mask", max_elements=BIG)  # fmt: skip
    assert loc == (*LOC, "b64")
    assert "0 or 1" in msg


def test_an_empty_bare_key_padding_mask_is_bool_as_documented() -> None:
    # An empty list has no leaves to tell its dtype: as a key padding mask it is bool (its
    # documented dtype), so it is never refused for being "float32"; as q it is float32.
    assert decode_tensor([], loc=LOC, role="bool_mask", max_elements=BIG).tensor.dtype == torch.bool
    assert decode_tensor([[]], loc=LOC, role="bool_mask", max_elements=BIG).tensor.shape == (1, 0)
    assert decode_tensor([], loc=LOC, role="float", max_elements=BIG).tensor.dtype == torch.float32


@pytest.mark.parametrize(
    ("value", "role", "loc_tail", "needle"),
    [
        ([[1.0, 2.0], [3.0]], "float", (), "ragged"),
        ({"dtype": "float32", "data": [[1.0], [2.0, 3.0]]}, "float", ("data",), "ragged"),
        ({"dtype": "float32", "shape": [2], "b64": "AAAA"}, "float", ("b64",), "needs 8"),
        ({"dtype": "float32", "shape": [1], "b64": "AA$A"}, "float", ("b64",), "base64"),
        ({"dtype": "float32", "shape": [1], "b64": "AACAPw"}, "float", ("b64",), "base64"),
        ({"dtype": "float32", "shape": [1], "b64": "\U0001f33bAAA"}, "float", ("b64",), "base64"),
        ({"dtype": "float32", "shape": [1], "b64": "AAC\u00e9"}, "float", ("b64",), "base64"),
        ({"dtype": "float32", "shape": [3], "data": [1.0, 2.0]}, "float", ("shape",), "[2]"),
        ({"dtype": "float32", "data": [["a", "b"]]}, "float", ("data",), "numbers"),
        ({"dtype": "float32", "data": [True, False]}, "float", ("data",), "booleans"),
        ({"dtype": "bool", "data": [1, 0]}, "mask", ("data",), "true/false"),
        ({"dtype": "bool", "data": [True]}, "float", ("dtype",), "floating-point"),
        ({"dtype": "float32", "data": [0.0]}, "bool_mask", ("dtype",), "bool"),
        ([[True]], "float", (), "floating-point"),
        ({"dtype": "float32", "shape": [11, 10], "b64": "AA=="}, "float", ("shape",), "limit"),
        ([list(range(11)) for _ in range(10)], "float", (), "limit"),
        ([[[[[[[1.0]]]]]]], "float", (), "rank"),
    ],
)
def test_bad_tensors_name_their_field(
    value: Any, role: Any, loc_tail: tuple[str, ...], needle: str
) -> None:
    parsed = wire(**value) if isinstance(value, dict) else value
    loc, msg = error_of(decode_tensor, parsed, loc=LOC, role=role, max_elements=100)
    assert loc == (*LOC, *loc_tail)
    assert needle in msg


def test_key_lengths_are_integers() -> None:
    t = decode_int_list([[3, 1], [0, 2]], loc=("body", "key_lengths"), max_elements=BIG)
    assert t.dtype == torch.int64
    assert t.tolist() == [[3, 1], [0, 2]]
    for bad in ([1.5, 2], [True, False], ["3"], [2**64]):
        loc, _ = error_of(decode_int_list, bad, loc=("body", "key_lengths"), max_elements=BIG)
        assert loc == ("body", "key_lengths")


def test_malformed_json_is_a_422_at_body() -> None:
    for body in (b"{", b"", b'{"a": NaN}', b"\xff\xfe"):
        loc, _ = error_of(loads, body)
        assert loc == ("body",)
    assert loads(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}


def test_json_output_writes_non_finite_values_as_null() -> None:
    t = torch.tensor([[1.5, float("-inf")], [float("nan"), 0.25]])
    assert json.loads(dumps(encode_tensor(t, encoding="json"))) == {
        "dtype": "float32",
        "shape": [2, 2],
        "data": [[1.5, None], [None, 0.25]],
    }


_DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])


@settings(max_examples=40, deadline=None)
@given(
    dtype=_DTYPES,
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
    encoding=st.sampled_from(["json", "base64"]),
)
def test_encode_then_decode_is_exact(
    dtype: torch.dtype, shape: list[int], seed: int, encoding: Any
) -> None:
    gen = torch.Generator().manual_seed(seed)
    original = (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    wire_json = json.loads(dumps(encode_tensor(original, encoding=encoding)))
    decoded = decode_tensor(wire(**wire_json), loc=LOC, role="float", max_elements=BIG).tensor
    assert decoded.dtype == dtype
    assert list(decoded.shape) == shape
    assert torch.equal(decoded, original)


def test_zero_dim_tensors_stay_scalars_in_json() -> None:
    # A 2-D request's per-head statistics are 0-d tensors: they must not become [x].
    assert json.loads(
        dumps({"x": to_numpy(torch.tensor(2.5)), "n": to_numpy(torch.tensor(3))})
    ) == {
        "x": 2.5,
        "n": 3,
    }
    assert json.loads(dumps(to_numpy(torch.tensor(float("-inf"))))) is None
