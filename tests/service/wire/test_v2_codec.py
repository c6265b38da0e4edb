"""The v2 tensor codec on its own: binary and JSON inputs of every datatype decode to the bytes
numpy wrote (little-endian, row-major), binary outputs are views of the result tensors (no
copy), and each malformed input is refused naming it."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from service.errors import InvalidRequest
from service.wire.v2_codec import decode_inputs, encode_output, split_header
from service.wire.v2_models import parse_infer_request

LIMIT = 1 << 20
DTYPES = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


def _body(inputs: list[tuple[str, np.ndarray, str]], *, binary: bool) -> tuple[bytes, str | None]:
    entries: list[dict[str, Any]] = []
    raw = b""
    for name, arr, datatype in inputs:
        entry: dict[str, Any] = {"name": name, "shape": list(arr.shape), "datatype": datatype}
        if binary:
            data = arr.tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            raw += data
        else:
            entry["data"] = arr.ravel().tolist()
        entries.append(entry)
    header = json.dumps({"inputs": entries}).encode()
    return header + raw, (str(len(header)) if binary else None)


def _decode(body: bytes, length: str | None) -> dict[str, torch.Tensor]:
    header, offset = split_header(body, length)
    return decode_inputs(parse_infer_request(json.loads(header)), body, offset, max_elements=LIMIT)


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("datatype", sorted(DTYPES))
def test_every_datatype_decodes_exactly(datatype: str, binary: bool) -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 5)).astype(DTYPES[datatype]) for _ in range(3))
    lengths = np.array([3, 5], dtype=np.int32)
    pad = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=np.bool_)
    body, length = _body(
        [("q", q, datatype), ("k", k, datatype), ("v", v, datatype),
         ("key_lengths", lengths, "INT32"), ("key_padding_mask", pad, "BOOL")],
        binary=binary,
    )  # fmt: skip
    tensors = _decode(body, length)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        np.testing.assert_array_equal(tensors[name].numpy(), arr)
        assert tensors[name].numpy().flags.writeable  # torch owns a writable copy
    assert tensors["key_lengths"].dtype == torch.int64
    assert tensors["key_lengths"].tolist() == [3, 5]
    assert tensors["key_padding_mask"].dtype == torch.bool
    np.testing.assert_array_equal(tensors["key_padding_mask"].numpy(), pad)


def test_bf16_binary_keeps_its_bits() -> None:
    values = torch.randn(2, 3, 4).to(torch.bfloat16)
    bits = values.view(torch.int16).numpy()
    body, length = _body([(n, bits, "BF16") for n in ("q", "k", "v")], binary=True)
    tensors = _decode(body, length)
    assert tensors["q"].dtype == torch.bfloat16
    assert torch.equal(tensors["q"], values)


@pytest.mark.parametrize("datatype", ["FP32", "BF16", "FP64", "INT64", "BOOL"])
def test_binary_output_is_a_view_of_the_tensor(datatype: str) -> None:
    dtype = {"FP32": torch.float32, "BF16": torch.bfloat16, "FP64": torch.float64,
             "INT64": torch.int64, "BOOL": torch.bool}[datatype]  # fmt: skip
    tensor = (torch.arange(24).reshape(2, 3, 4) % 2).to(dtype)
    out = encode_output("output", tensor, binary=True)
    assert out.entry == {
        "name": "output", "datatype": datatype, "shape": [2, 3, 4],
        "parameters": {"binary_data_size": 24 * tensor.element_size()},
    }  # fmt: skip
    assert out.data is not None
    view = np.frombuffer(out.data, dtype=np.uint8)
    plain = tensor.view(torch.int16) if dtype == torch.bfloat16 else tensor
    assert np.shares_memory(view, plain.numpy())  # written from the tensor's own buffer
    assert bytes(out.data) == plain.numpy().tobytes()


def test_json_output_is_flat_with_null_for_minus_inf() -> None:
    tensor = torch.tensor([[0.5, -float("inf")], [1.0, 2.0]])
    out = encode_output("lse", tensor, binary=False)
    assert out.data is None
    assert out.entry["data"].tolist()[:2] == [0.5, -np.inf]  # orjson writes it as null


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda e: e[0].update(datatype="INT8"), "input 'q': datatype 'INT8'"),
        (lambda e: e[1].update(shape=[2, 3, 6]), "input 'k': binary_data_size"),
        (lambda e: e[2]["parameters"].update(binary_data_size=10**6), "input 'v'"),
        (lambda e: e.append(dict(e[0])), "input 'q' is given twice"),
        (lambda e: e[0].update(name="query"), "unknown input 'query'"),
        (lambda e: e[0].update(shape=[1 << 30, 2]), "SDPA_MAX_ELEMENTS"),
    ],
)
def test_malformed_inputs_name_the_input(change: Any, words: str) -> None:
    arr = np.zeros((2, 3, 5), dtype="<f4")
    body, length = _body([(n, arr, "FP32") for n in ("q", "k", "v")], binary=True)
    assert length is not None
    header = json.loads(body[: int(length)])
    change(header["inputs"])
    new_header = json.dumps(header).encode()
    with pytest.raises(InvalidRequest) as info:
        _decode(new_header + body[int(length) :], str(len(new_header)))
    assert words in info.value.detail


def test_inputs_behind_an_odd_length_mask_are_aligned_and_exact() -> None:
    rng = np.random.default_rng(3)
    pad = np.array([[0, 0, 1, 1, 1]], dtype=np.bool_)  # 5 bytes: q's bytes start misaligned
    q, k, v = (rng.standard_normal((1, 2, 3, 5)).astype("<f8") for _ in range(3))
    body, length = _body(
        [("key_padding_mask", pad, "BOOL"), ("q", q, "FP64"), ("k", k, "FP64"), ("v", v, "FP64")],
        binary=True,
    )
    tensors = _decode(body, length)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        assert tensors[name].data_ptr() % 8 == 0
        np.testing.assert_array_equal(tensors[name].numpy(), arr)
    np.testing.assert_array_equal(tensors["key_padding_mask"].numpy(), pad)


@pytest.mark.parametrize("length", ["\u00b2", "-1", "1e3", " ", "99999999999999999999"])
def test_a_malformed_header_length_is_refused_by_name(length: str) -> None:
    """Inference-Header-Content-Length must be ASCII digits within the body ("²" passes
    str.isdigit() but not int(): it was a 500)."""
    with pytest.raises(InvalidRequest) as info:
        split_header(b"{}" * 8, length)
    assert "Inference-Header-Content-Length" in info.value.detail
