"""Our grpc_predict_v2.proto against an independent truth: tritonclient.grpc's own service_pb2
(Triton's grpc_service.proto, a superset of KServe's with the same messages and field numbers).

Every message and field we declare must exist there with the same number, type, label, message
type and oneof, and every call with the same request and response types: then what tritonclient
sends, we parse, and what we answer, it reads. And the generated module must be what
scripts/generate-proto.sh makes of the .proto (checked by the script itself, here only that the
module loads into its private pool beside tritonclient's).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from service.wire.grpc import grpc_predict_v2_pb2 as ours

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")


def _messages(descriptor: Any) -> Iterator[Any]:
    """Every message of a file or message descriptor, nested ones included (map entries too)."""
    for message in descriptor.message_types_by_name.values():
        yield message
        yield from _nested(message)


def _nested(message: Any) -> Iterator[Any]:
    for inner in message.nested_types:
        yield inner
        yield from _nested(inner)


def _triton_message(full_name: str) -> Any:
    return service_pb2.DESCRIPTOR.pool.FindMessageTypeByName(full_name)


OUR_MESSAGES = list(_messages(ours.DESCRIPTOR))


def test_both_modules_load_in_one_process_in_their_own_pools() -> None:
    assert ours.DESCRIPTOR.package == service_pb2.DESCRIPTOR.package == "inference"
    assert ours.DESCRIPTOR.pool is not service_pb2.DESCRIPTOR.pool


@pytest.mark.parametrize("message", OUR_MESSAGES, ids=[m.full_name for m in OUR_MESSAGES])
def test_every_field_matches_tritonclient(message: Any) -> None:
    theirs = _triton_message(message.full_name)
    for field in message.fields:
        other = theirs.fields_by_name.get(field.name)
        assert other is not None, f"{message.full_name}.{field.name} is not in Triton's proto"
        assert field.number == other.number, field.full_name
        assert field.type == other.type, field.full_name
        assert field.is_repeated == other.is_repeated, field.full_name
        if field.message_type is not None:
            assert field.message_type.full_name == other.message_type.full_name, field.full_name
        ours_oneof = field.containing_oneof
        theirs_oneof = other.containing_oneof
        assert (ours_oneof and ours_oneof.name) == (theirs_oneof and theirs_oneof.name)
    assert message.GetOptions().map_entry == theirs.GetOptions().map_entry


def test_every_call_matches_tritonclient() -> None:
    ours_service = ours.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs_service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours_service.full_name == theirs_service.full_name == "inference.GRPCInferenceService"
    names = [method.name for method in ours_service.methods]
    assert names == [
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
    ]  # fmt: skip
    for method in ours_service.methods:
        other = theirs_service.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name
        assert method.output_type.full_name == other.output_type.full_name
        assert not method.client_streaming
        assert not method.server_streaming


def test_a_message_crosses_between_the_two_unchanged() -> None:
    """Bytes tritonclient writes parse with ours to the same fields, and back."""
    request = service_pb2.ModelInferRequest(model_name="attention", model_version="1", id="r1")
    request.parameters["timeout"].int64_param = 5_000_000
    request.parameters["priority"].uint64_param = 2
    request.parameters["causal"].string_param = "bottom_right"
    tensor = request.inputs.add(name="q", datatype="FP32", shape=[1, 2, 3, 4])
    tensor.contents.fp32_contents.extend([0.5] * 24)
    request.outputs.add(name="output")
    request.raw_input_contents.append(b"\x01\x02")
    parsed = ours.ModelInferRequest.FromString(request.SerializeToString())
    assert parsed.id == "r1"
    assert parsed.parameters["priority"].uint64_param == 2
    assert parsed.parameters["causal"].WhichOneof("parameter_choice") == "string_param"
    assert list(parsed.inputs[0].shape) == [1, 2, 3, 4]
    assert list(parsed.inputs[0].contents.fp32_contents) == [0.5] * 24
    assert list(parsed.raw_input_contents) == [b"\x01\x02"]
    back = service_pb2.ModelInferRequest.FromString(parsed.SerializeToString())
    assert back == request
