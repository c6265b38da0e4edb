"""The gRPC codec on its own (service.wire.grpc_codec), against tritonclient as the truth.

Requests are built by tritonclient.grpc's own request builder (what `client.infer` sends) and by
its service_pb2; each must decode to the same tensors, bit for bit, as the same request built by
tritonclient.http and decoded by the REST door's codec. Answers are read back by
tritonclient.grpc's InferResult. Each malformed request is refused with a ServiceError that
names what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from service.errors import InvalidRequest, ServiceError
from service.wire.grpc_codec import (
    RawOutput,
    UnknownModel,
    decode_infer_request,
    encode_infer_response,
    infer_payload,
)
from service.wire.v2_codec import decode_inputs, split_header
from service.wire.v2_models import parse_infer_request

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
grpc_utils = pytest.importorskip("tritonclient.grpc._utils")
http_utils = pytest.importorskip("tritonclient.http._utils")
ml_dtypes = pytest.importorskip("ml_dtypes")

LIMIT = 1 << 20
NUMPY = {
    "FP16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "FP32": np.float32,
    "FP64": np.float64,
}

Inputs = list[tuple[str, np.ndarray, str]]


def _inputs(datatype: str, *, seed: int = 0) -> Inputs:
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((2, 3, 4, 8)).astype(NUMPY[datatype]) for _ in range(3)
    )  # [B, H, N, D]
    mask = rng.standard_normal((4, 4)).astype(NUMPY[datatype])
    return [
        ("q", q, datatype),
        ("k", k, datatype),
        ("v", v, datatype),
        ("key_lengths", np.array([3, 4], dtype=np.int32), "INT32"),
        ("key_padding_mask", np.array([[0, 0, 0, 1], [0, 0, 0, 0]], dtype=np.bool_), "BOOL"),
        ("attn_mask", mask, datatype),
    ]


def _grpc_request(
    inputs: Inputs,
    *,
    outputs: tuple[str, ...] = (),
    parameters: dict[str, Any] | None = None,
    request_id: str = "",
    priority: int = 0,
    timeout: int | None = None,
    model_version: str = "",
) -> Any:
    """The ModelInferRequest tritonclient.grpc's client.infer would send."""
    tensors = []
    for name, arr, datatype in inputs:
        tensor = grpcclient.InferInput(name, list(arr.shape), datatype)
        tensor.set_data_from_numpy(arr)
        tensors.append(tensor)
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs] or None
    return grpc_utils._get_inference_request(
        model_name="attention", inputs=tensors, model_version=model_version,
        request_id=request_id, outputs=requested, sequence_id=0, sequence_start=False,
        sequence_end=False, priority=priority, timeout=timeout, parameters=parameters,
    )  # fmt: skip


def _http_request(
    inputs: Inputs, *, parameters: dict[str, Any] | None = None, **kw: Any
) -> tuple[bytes, str | None]:
    """The body tritonclient.http's client.infer would send (binary data), and its
    Inference-Header-Content-Length."""
    tensors = []
    for name, arr, datatype in inputs:
        tensor = httpclient.InferInput(name, list(arr.shape), datatype)
        tensor.set_data_from_numpy(arr, binary_data=True)
        tensors.append(tensor)
    body, json_size = http_utils._get_inference_request(
        inputs=tensors, request_id=kw.get("request_id", ""), outputs=None, sequence_id=0,
        sequence_start=False, sequence_end=False, priority=kw.get("priority", 0),
        timeout=kw.get("timeout"), custom_parameters=parameters,
    )  # fmt: skip
    return body, None if json_size is None else str(json_size)


def _grpc_decode(raw: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    decoded = infer_payload(decode_infer_request(raw))
    request = parse_infer_request(decoded.payload)
    return decoded.payload, decode_inputs(request, decoded.body, 0, max_elements=LIMIT)


def _rest_decode(body: bytes, length: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    header, offset = split_header(body, length)
    payload = json.loads(header)
    request = parse_infer_request(payload)
    return payload, decode_inputs(request, body, offset, max_elements=LIMIT)


def _same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        # Bit for bit: the same bytes (NaN-safe, and -0.0 is not 0.0).
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


# ---- requests: the same tensors as the REST door ------------------------------------------


@pytest.mark.parametrize("datatype", sorted(NUMPY))
def test_raw_input_contents_decode_as_the_rest_doors_binary_data(datatype: str) -> None:
    inputs = _inputs(datatype)
    raw = _grpc_request(inputs).SerializeToString()
    _, got = _grpc_decode(raw)
    _, want = _rest_decode(*_http_request(inputs))
    _same_tensors(got, want)
    np.testing.assert_array_equal(got["q"].view(torch.uint8).numpy(), inputs[0][1].view(np.uint8))
    assert got["key_lengths"].tolist() == [3, 4]


def test_int64_key_lengths_and_a_bool_attn_mask() -> None:
    inputs = [
        *_inputs("FP32")[:3],
        ("key_lengths", np.array([[1, 2, 3], [4, 3, 2]], dtype=np.int64), "INT64"),
        ("attn_mask", np.tril(np.ones((4, 4), dtype=np.bool_)), "BOOL"),
    ]
    _, got = _grpc_decode(_grpc_request(inputs).SerializeToString())
    _, want = _rest_decode(*_http_request(inputs))
    _same_tensors(got, want)
    assert got["attn_mask"].dtype == torch.bool


@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
def test_typed_contents_decode_as_raw_input_contents(datatype: str) -> None:
    """Another client's typed lists (contents.fp32_contents, int_contents, bool_contents...)
    give the same tensors as tritonclient's raw bytes."""
    inputs = _inputs(datatype)
    fields = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT32": "int_contents",
              "BOOL": "bool_contents"}  # fmt: skip
    request = service_pb2.ModelInferRequest(model_name="attention")
    for name, arr, dt in inputs:
        tensor = request.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
        getattr(tensor.contents, fields[dt]).extend(arr.ravel().tolist())
    _, got = _grpc_decode(request.SerializeToString())
    _, want = _grpc_decode(_grpc_request(inputs).SerializeToString())
    _same_tensors(got, want)


def test_parameters_id_timeout_and_priority_as_the_rest_door_reads_them() -> None:
    inputs = _inputs("FP32")[:3]
    params = {"causal": "bottom_right", "scale": 0.25, "diagnostics": "summary", "tag": "a/b"}
    raw = _grpc_request(
        inputs, parameters=params, request_id="req-7", priority=2, timeout=5_000_000,
        model_version="1",
    ).SerializeToString()  # fmt: skip
    payload, _ = _grpc_decode(raw)
    rest, _ = _rest_decode(
        *_http_request(inputs, parameters=params, request_id="req-7", priority=2,
                       timeout=5_000_000)
    )  # fmt: skip
    assert payload["id"] == rest["id"] == "req-7"
    # Every output goes back raw: REST's binary_data_output, set by the codec.
    assert payload["parameters"] == {**rest["parameters"], "binary_data_output": True}
    request = parse_infer_request(payload)
    assert request.parameters is not None
    assert (request.parameters.timeout, request.parameters.priority) == (5_000_000, 2)
    assert request.parameters.causal == "bottom_right"


def test_requested_outputs_keep_their_order() -> None:
    raw = _grpc_request(_inputs("FP32")[:3], outputs=("lse", "output", "weights"))
    payload, _ = _grpc_decode(raw.SerializeToString())
    assert [out["name"] for out in payload["outputs"]] == ["lse", "output", "weights"]


def test_raw_input_contents_are_read_without_a_copy_and_as_protobuf_reads_them() -> None:
    request = _grpc_request(_inputs("FP32"), parameters={"causal": True}, request_id="r")
    raw = request.SerializeToString()
    decoded = decode_infer_request(raw)
    assert all(isinstance(entry, memoryview) for entry in decoded.raw_contents)
    assert [bytes(e) for e in decoded.raw_contents] == list(request.raw_input_contents)
    assert not decoded.message.raw_input_contents
    whole = service_pb2.ModelInferRequest.FromString(raw)
    whole.ClearField("raw_input_contents")
    assert service_pb2.ModelInferRequest.FromString(decoded.message.SerializeToString()) == whole
    # Fields in any order (raw entries first, the rest after) read the same.
    shuffled = (
        b"".join(
            service_pb2.ModelInferRequest(raw_input_contents=[entry]).SerializeToString()
            for entry in request.raw_input_contents
        )
        + whole.SerializeToString()
    )
    _same_tensors(_grpc_decode(shuffled)[1], _grpc_decode(raw)[1])


def test_a_message_the_quick_reader_leaves_to_protobuf() -> None:
    """A group (wire type 3) or a length past the end: protobuf's parser judges the message,
    with protobuf's words."""
    raw = _good().SerializeToString()
    for broken in (raw + bytes([(9 << 3) | 3]), raw + bytes([(7 << 3) | 2, 0x7F])):
        error = _refused(broken)
        assert "not a valid inference.ModelInferRequest" in error.detail


# ---- bad requests ----------------------------------------------------------------------------


def _refused(raw: bytes) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        _grpc_decode(raw)
    return info.value


def _detail(request: Any) -> str:
    """The message a request built with service_pb2 is refused with."""
    return _refused(request.SerializeToString()).detail


def _good() -> Any:
    return _grpc_request(_inputs("FP32")[:3])


def test_bytes_that_are_no_model_infer_request() -> None:
    error = _refused(b"\xff\xff\xff\xff garbage")
    assert isinstance(error, InvalidRequest)
    assert "not a valid inference.ModelInferRequest" in error.detail


def test_another_model_or_version_is_not_found() -> None:
    for name, version in (("bert", ""), ("attention", "2")):
        request = _good()
        request.model_name, request.model_version = name, version
        error = _refused(request.SerializeToString())
        assert isinstance(error, UnknownModel)
        assert error.status == 404
        assert "'attention'" in error.detail


def test_raw_input_contents_for_some_inputs_only() -> None:
    request = _good()
    del request.raw_input_contents[2]
    error = _refused(request.SerializeToString())
    assert error.status == 422
    assert "raw_input_contents holds 2 entries for 3 inputs" in error.detail


def test_raw_input_contents_of_the_wrong_size_names_the_input() -> None:
    request = _good()
    request.raw_input_contents[1] = request.raw_input_contents[1][:-4]
    error = _refused(request.SerializeToString())
    assert "input 'k': raw_input_contents[1] holds 764 bytes" in error.detail
    assert "needs 768" in error.detail


def test_contents_beside_raw_input_contents() -> None:
    request = _good()
    request.inputs[0].contents.fp32_contents.extend([1.0])
    assert "input 'q' carries both contents and raw_input_contents[0]" in _detail(request)


def test_contents_in_the_field_of_another_datatype() -> None:
    request = service_pb2.ModelInferRequest(model_name="attention")
    for name in ("q", "k", "v"):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[1, 2])
        tensor.contents.fp64_contents.extend([0.5, 0.5])
    error = _refused(request.SerializeToString())
    assert "input 'q': FP32 contents go in fp32_contents, not fp64_contents" in error.detail


def test_fp16_contents_are_refused_as_in_triton() -> None:
    request = service_pb2.ModelInferRequest(model_name="attention")
    for name in ("q", "k", "v"):
        tensor = request.inputs.add(name=name, datatype="FP16", shape=[1, 1])
        tensor.contents.fp32_contents.append(0.5)
    assert "input 'q': FP16 travels only in raw_input_contents" in _detail(request)


def test_an_input_without_data() -> None:
    request = service_pb2.ModelInferRequest(model_name="attention")
    request.inputs.add(name="q", datatype="FP32", shape=[1, 1])
    assert "input 'q' has neither contents nor an entry in raw_input_contents" in _detail(request)


def test_contents_that_do_not_fill_the_shape() -> None:
    request = service_pb2.ModelInferRequest(model_name="attention")
    for name in ("q", "k", "v"):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[2, 2])
        tensor.contents.fp32_contents.extend([0.5] * (3 if name == "v" else 4))
    assert "input 'v': data holds 3 values; shape [2, 2] needs 4" in _detail(request)


def test_rest_binary_parameters_are_refused_over_grpc() -> None:
    request = _good()
    request.parameters["binary_data_output"].bool_param = True
    assert "parameter 'binary_data_output' is REST's binary" in _detail(request)
    request = _good()
    request.outputs.add(name="output").parameters["binary_data"].bool_param = True
    assert "output 'output': parameter 'binary_data'" in _detail(request)


def test_binary_data_size_saying_the_raw_entrys_length_is_taken() -> None:
    """KServe's SDK (kserve 0.21's InferRequest.to_grpc) keeps REST's binary_data_size on an
    input whose bytes travel in raw_input_contents: taken when it is that entry's length."""
    request = _good()
    size = len(request.raw_input_contents[0])  # [2, 3, 4, 8] FP32: 768 bytes
    assert size == 2 * 3 * 4 * 8 * 4
    request.inputs[0].parameters["binary_data_size"].int64_param = size
    payload, tensors = _grpc_decode(request.SerializeToString())
    assert payload["inputs"][0]["parameters"] == {"binary_data_size": size}
    assert tensors["q"].shape == (2, 3, 4, 8)
    request.inputs[0].parameters["binary_data_size"].int64_param = 4
    assert (
        "input 'q': parameter 'binary_data_size' is 4 but raw_input_contents holds 768 bytes"
        in _detail(request)
    )
    contents = _grpc_request(_inputs("FP32")[:3])
    del contents.raw_input_contents[:]
    for tensor, (_, arr, _) in zip(contents.inputs, _inputs("FP32")[:3], strict=True):
        tensor.contents.fp32_contents.extend(arr.ravel().tolist())
    contents.inputs[1].parameters["binary_data_size"].int64_param = 768
    assert "input 'k': parameter 'binary_data_size' is 768 but raw_input_contents holds no" in (
        _detail(contents)
    )


def test_a_parameter_without_a_value() -> None:
    request = _good()
    request.parameters["scale"].SetInParent()  # present, its oneof unset
    assert "parameter 'scale': the InferParameter holds no value" in _detail(request)


def test_parameters_as_the_rest_models_judge_them() -> None:
    cases = {
        "casual": (True, "unknown parameter 'casual'"),
        "temperature": (-1.0, "parameter 'temperature'"),
        "diagnostics": ("all", "parameter 'diagnostics'"),
    }
    for key, (value, words) in cases.items():
        raw = _grpc_request(_inputs("FP32")[:3], parameters={key: value}).SerializeToString()
        assert words in _refused(raw).detail, key
    # tritonclient sends timeout itself, as an int64: another client's string is refused.
    request = _good()
    request.parameters["timeout"].string_param = "soon"
    assert "parameter 'timeout'" in _refused(request.SerializeToString()).detail


def test_unknown_inputs_and_datatypes_get_the_rest_doors_messages() -> None:
    inputs = [*_inputs("FP32")[:3], ("mask", np.ones((1, 4), dtype=np.bool_), "BOOL")]
    assert "unknown input 'mask'" in _refused(_grpc_request(inputs).SerializeToString()).detail
    inputs = [*_inputs("FP32")[:3], ("key_padding_mask", np.ones((2, 4), np.float32), "FP32")]
    error = _refused(_grpc_request(inputs).SerializeToString())
    assert "input 'key_padding_mask': datatype 'FP32' is not one of BOOL" in error.detail


# ---- answers ------------------------------------------------------------------------------


def _raw_output(name: str, arr: np.ndarray, datatype: str) -> RawOutput:
    data = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    return RawOutput(name, datatype, arr.shape, memoryview(data))


def test_an_answer_reads_back_through_tritonclient() -> None:
    rng = np.random.default_rng(3)
    output = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    lse = np.array([[[-np.inf, 0.5, 1.5]] * 2], dtype=np.float32)
    visible = np.arange(6, dtype=np.int64).reshape(1, 2, 3)
    bf16 = rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16)
    params = {"path": "fused", "batch_size": 3, "compute_ms": 0.25, "masked_rows": 0,
              "flag": True}  # fmt: skip
    raw = encode_infer_response(
        request_id="req-1",
        parameters=params,
        outputs=[
            _raw_output("output", output, "FP32"),
            _raw_output("lse", lse, "FP32"),
            _raw_output("visible_keys", visible, "INT64"),
            _raw_output("weights", bf16, "BF16"),
        ],
    )
    response = service_pb2.ModelInferResponse.FromString(raw)
    result = grpcclient.InferResult(response)
    assert (response.model_name, response.model_version, response.id) == ("attention", "1", "req-1")
    np.testing.assert_array_equal(result.as_numpy("output"), output)
    np.testing.assert_array_equal(result.as_numpy("lse"), lse)  # -inf travels as itself
    np.testing.assert_array_equal(result.as_numpy("visible_keys"), visible)
    np.testing.assert_array_equal(result.as_numpy("weights"), bf16)
    assert [o.name for o in response.outputs] == ["output", "lse", "visible_keys", "weights"]
    got = {k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in response.parameters.items()}
    assert got == params
    assert response.parameters["batch_size"].WhichOneof("parameter_choice") == "int64_param"
    assert response.parameters["flag"].WhichOneof("parameter_choice") == "bool_param"
    # The same message as protobuf writes it whole.
    whole = service_pb2.ModelInferResponse()
    whole.CopyFrom(response)
    assert service_pb2.ModelInferResponse.FromString(whole.SerializeToString()) == response


def test_an_answer_without_id_or_outputs() -> None:
    response = service_pb2.ModelInferResponse.FromString(
        encode_infer_response(request_id=None, parameters={}, outputs=[])
    )
    assert response.id == ""
    assert not response.outputs
    assert not response.raw_output_contents


def test_a_large_output_length_is_a_multi_byte_varint() -> None:
    big = np.arange(300_000, dtype=np.float32)  # 1.2 MB: a 3-byte length
    response = service_pb2.ModelInferResponse.FromString(
        encode_infer_response(
            request_id=None, parameters={}, outputs=[_raw_output("output", big, "FP32")]
        )
    )
    np.testing.assert_array_equal(grpcclient.InferResult(response).as_numpy("output"), big)


# ---- the whole preparation: the same PreparedInfer as the REST door's ----------------------


def _settings() -> Any:
    from tests.support.app import small_settings

    return small_settings()


def _prepared_pair(inputs: Inputs, **kw: Any) -> tuple[Any, Any]:
    from service.runtime.policy import CostModel
    from service.serving.prepare_grpc import prepare_grpc_infer
    from service.serving.prepare_v2 import prepare_infer

    settings, cost = _settings(), CostModel.uncalibrated()
    outputs = kw.pop("outputs", ())
    grpc_raw = _grpc_request(inputs, outputs=outputs, **kw).SerializeToString()
    body, length = _http_request(inputs, **kw)
    if outputs:  # name the same outputs, as binary data, in REST's header
        header, offset = split_header(body, length)
        payload = json.loads(header)
        payload["outputs"] = [{"name": n, "parameters": {"binary_data": True}} for n in outputs]
        new_header = json.dumps(payload).encode()
        body, length = new_header + body[offset:], str(len(new_header))
    return (
        prepare_grpc_infer(grpc_raw, settings, cost),
        prepare_infer(body, length, settings, cost),
    )


@pytest.mark.parametrize("datatype", sorted(NUMPY))
def test_prepare_grpc_infer_makes_the_rest_doors_prepared_request(datatype: str) -> None:
    params = {"causal": "bottom_right", "diagnostics": "summary", "tag": "t/1"}
    got, want = _prepared_pair(
        _inputs(datatype), parameters=params, request_id="r-9", priority=1, timeout=7_000_000,
        outputs=("lse", "output", "entropy_per_head"),
    )  # fmt: skip
    assert (got.id, got.summary, got.outputs) == (want.id, want.summary, want.outputs)
    assert got.outputs == (("lse", True), ("output", True), ("entropy_per_head", True))
    g, w = got.request, want.request
    assert (g.encoding, g.timeout_ms, g.tag, g.priority, g.return_output) == (
        w.encoding, w.timeout_ms, w.tag, w.priority, w.return_output,
    )  # fmt: skip
    assert (g.response_bytes, g.working_bytes) == (w.response_bytes, w.working_bytes)
    assert g.prepared.spec == w.prepared.spec
    gj, wj = g.prepared.job, w.prepared.job
    for name in ("q", "k", "v"):
        assert torch.equal(getattr(gj, name).view(torch.uint8), getattr(wj, name).view(torch.uint8))
    assert (gj.scale, gj.return_weights, gj.diagnostics) == (
        wj.scale,
        wj.return_weights,
        wj.diagnostics,
    )
    for name in ("key_lengths", "key_padding_mask", "attn_mask"):
        assert torch.equal(getattr(gj.masks, name), getattr(wj.masks, name)), name
    assert gj.masks.causal == wj.masks.causal


def test_prepare_grpc_infer_refuses_only_with_client_errors() -> None:
    """Damaged messages (bytes flipped, cut, garbage) give a ServiceError or an SdpaError, never
    another exception: a bounded sweep over one good message."""
    from sdpa_core import SdpaError
    from service.runtime.policy import CostModel
    from service.serving.prepare_grpc import prepare_grpc_infer

    settings, cost = _settings(), CostModel.uncalibrated()
    good = _grpc_request(_inputs("FP16"), parameters={"diagnostics": "full"}).SerializeToString()
    rng = np.random.default_rng(27)
    damaged = [good[:cut] for cut in rng.integers(0, len(good), size=40)]
    for _ in range(120):
        raw = bytearray(good)
        for at in rng.integers(0, min(len(raw), 400), size=int(rng.integers(1, 4))):
            raw[at] = int(rng.integers(0, 256))
        damaged.append(bytes(raw))
    damaged += [rng.bytes(int(n)) for n in rng.integers(0, 300, size=40)]
    outcomes = {"ok": 0, "refused": 0}
    for raw in damaged:
        try:
            prepare_grpc_infer(raw, settings, cost)
        except (ServiceError, SdpaError):
            outcomes["refused"] += 1
        else:
            outcomes["ok"] += 1
    assert outcomes["refused"] > 100, outcomes


# ---- counts, read from the wire before protobuf parses the message -------------------------


def _field(number: int, payload: bytes = b"") -> bytes:
    """A length-delimited field, as protobuf writes it (lengths under 128 here)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_two_and_a_half_million_empty_inputs_are_refused_by_their_count() -> None:
    raw = _good().SerializeToString() + _field(5) * 2_500_000  # 12.5 MB of empty inputs
    error = _refused(raw)
    assert isinstance(error, InvalidRequest)
    assert error.detail == (
        "the request holds more than 6 inputs: a request of this model has at most 6"
    )


@pytest.mark.parametrize(
    ("number", "payload", "words"),
    [
        (6, b"", "more than 64 outputs"),
        (7, b"", "more than 6 raw_input_contents"),
        (4, _field(1, b"x"), "more than 32 parameters"),
        (3, b"id", "more than 1 id"),
        (1, b"attention", "more than 1 model_name"),
    ],
)
def test_each_repeated_field_has_a_count(number: int, payload: bytes, words: str) -> None:
    raw = _good().SerializeToString() + _field(number, payload) * 100
    assert words in _refused(raw).detail


def test_up_to_eight_unknown_fields_are_ignored_and_nine_refused() -> None:
    good = _good().SerializeToString()
    payload, _ = _grpc_decode(good + _field(15, b"?") * 8)  # field 15: none in the message
    assert [entry["name"] for entry in payload["inputs"]] == ["q", "k", "v"]
    detail = _refused(good + _field(15, b"?") * 5 + _field(12, b"") * 4).detail
    assert detail == (
        "the request holds more than 8 fields of numbers ModelInferRequest does not have: a "
        "request of this model has at most 8"
    )


def test_a_group_is_refused_before_protobuf_skips_it() -> None:
    # A start-group tag of field 20 (wire type 3), then what protobuf would skip and parse on.
    tag = 20 << 3 | 3  # 163: a two-byte varint
    raw = bytes([tag & 0x7F | 0x80, tag >> 7]) + _good().SerializeToString()
    detail = _refused(raw).detail
    assert "field 20 is a protobuf group, which this message has none of" in detail


def test_an_inputs_parameters_and_shape_and_an_outputs_parameters_are_counted() -> None:
    request = _good()
    for index in range(33):
        request.inputs[1].parameters[f"p{index}"].int64_param = index
    assert _detail(request).startswith("the request holds more than 32 parameters")
    request = _good()
    request.inputs[0].shape.extend([1] * 7)
    assert "more than 6 dimensions in a shape" in _detail(request)
    request = _good()
    output = request.outputs.add(name="output")
    for index in range(33):
        output.parameters[f"p{index}"].bool_param = True
    assert "more than 32 parameters" in _detail(request)
