"""JSON's true is no number: v1 and v2 refuse a boolean among the numbers of numeric data (numpy
reads [1.0, true] as [1.0, 1.0]), in every tensor that holds numbers, as they refuse a list of
booleans alone; bool tensors keep their booleans."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from service.errors import InvalidRequest
from service.wire.codec import decode_int_list, decode_tensor
from service.wire.models import WireTensor
from service.wire.number_lists import TYPE_CHUNK, leaf_types
from service.wire.v2_codec import decode_inputs, split_header
from service.wire.v2_models import parse_infer_request

BIG = 1 << 20


def refused(fn: Any, *args: Any, **kwargs: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        fn(*args, **kwargs)
    return raised.value


@pytest.mark.parametrize("role", ["float", "mask"])
@pytest.mark.parametrize(
    "data", [[[1.0, True]], [[False, 2.0]], [[1, True]], [[[0.5]], [[True]]]], ids=str
)
def test_a_bare_list_of_numbers_with_a_boolean_is_refused(role: Any, data: Any) -> None:
    exc = refused(decode_tensor, data, loc=("body", "q"), role=role, max_elements=BIG)
    (error,) = exc.errors
    assert error.loc == ("body", "q")
    assert error.msg == "data must hold only numbers, found booleans"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_tensor_objects_numbers_with_a_boolean_are_refused(dtype: str) -> None:
    tensor = WireTensor.model_validate({"dtype": dtype, "data": [[0.0, True]]})
    exc = refused(decode_tensor, tensor, loc=("body", "attn_mask"), role="mask", max_elements=BIG)
    assert exc.errors[0].loc == ("body", "attn_mask", "data")


def test_a_float_mask_with_nulls_and_a_boolean_is_refused() -> None:
    exc = refused(
        decode_tensor, [[None, True]], loc=("body", "attn_mask"), role="mask", max_elements=BIG
    )
    assert "null for -inf" in exc.errors[0].msg


def test_key_lengths_with_a_boolean_are_refused() -> None:
    exc = refused(decode_int_list, [[3, True]], loc=("body", "key_lengths"), max_elements=BIG)
    assert exc.errors[0].msg == "must hold only integers, found booleans"


def test_all_booleans_stay_a_bool_mask_and_numbers_stay_numbers() -> None:
    mask = decode_tensor([[True, False]], loc=("body", "m"), role="mask", max_elements=BIG)
    assert mask.tensor.dtype == torch.bool
    assert mask.tensor.tolist() == [[True, False]]
    numbers = decode_tensor([[1, 2.5]], loc=("body", "q"), role="float", max_elements=BIG)
    assert numbers.tensor.tolist() == [[1.0, 2.5]]


def test_a_boolean_past_the_first_chunk_of_leaves_is_found() -> None:
    # Leaves are read TYPE_CHUNK at a time: the boolean sits in the third chunk.
    rows = 2 * TYPE_CHUNK // 64 + 1
    data = np.zeros((rows, 64)).tolist()
    data[-1][-1] = True
    assert bool in leaf_types(x for row in data for x in row)
    exc = refused(decode_tensor, data, loc=("body", "v"), role="float", max_elements=BIG)
    assert exc.errors[0].msg == "data must hold only numbers, found booleans"


def v2_decode(inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    body = json.dumps({"inputs": inputs}).encode()
    header, offset = split_header(body, None)
    request = parse_infer_request(json.loads(header))
    return decode_inputs(request, body, offset, max_elements=BIG)


def v2_input(name: str, datatype: str, data: list[Any]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": [1, len(data)], "data": data}


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_v2_float_data_with_a_boolean_is_refused_as_v1_refuses_it(datatype: str) -> None:
    inputs = [v2_input(n, "FP32", [1.0, 2.0]) for n in ("q", "k", "v")]
    inputs[1] = v2_input("k", datatype, [1.0, True])
    exc = refused(v2_decode, inputs)
    assert exc.detail == f"input 'k': {datatype} data must hold only numbers, found booleans"


@pytest.mark.parametrize("datatype", ["INT32", "INT64"])
def test_v2_integer_data_with_a_boolean_is_refused(datatype: str) -> None:
    inputs = [v2_input(n, "FP32", [1.0, 2.0]) for n in ("q", "k", "v")]
    inputs.append({"name": "key_lengths", "datatype": datatype, "shape": [2], "data": [1, True]})
    exc = refused(v2_decode, inputs)
    assert exc.detail == (
        f"input 'key_lengths': {datatype} data must hold only integers, found booleans"
    )


def test_v2_float_mask_with_a_boolean_and_bool_mask_with_a_number_are_refused() -> None:
    inputs = [v2_input(n, "FP32", [1.0, 2.0]) for n in ("q", "k", "v")]
    exc = refused(v2_decode, [*inputs, v2_input("attn_mask", "FP32", [0.0, True])])
    assert "found booleans" in exc.detail
    exc = refused(v2_decode, [*inputs, v2_input("attn_mask", "BOOL", [True, 1])])
    assert exc.detail == "input 'attn_mask': BOOL data must hold only true/false"
