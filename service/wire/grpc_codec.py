"""The Open Inference Protocol over gRPC (KServe's grpc_predict_v2.proto, as tritonclient.grpc
speaks it): a serialized ModelInferRequest -> the REST door's request payload, and an answer's
parts -> a serialized ModelInferResponse.

A request becomes what its REST twin would parse to, so that one validation (the pydantic
models of service.wire.v2_models) and one tensor decoder (service.wire.v2_codec) serve both
doors with the same messages:
- the inputs' name, datatype, shape and parameters as they are; an InferParameter's oneof as
  the JSON value it holds;
- raw_input_contents (what tritonclient.grpc sends) as Triton's binary data: each input's
  binary_data_size is its entry's length, and the entries joined in order are the body after
  an empty JSON header;
- `contents` (typed lists, from other clients) as an input's data, read by numpy from the
  field its datatype uses (FP32 fp32_contents, INT32 int_contents, ...), never from another;
- every output in raw_output_contents: the REST door's binary_data_output is set, so the
  sizing, and BF16's rule (binary only), are REST's binary ones.
REST's own binary extension (binary_data_size, binary_data, binary_data_output) is refused
where a gRPC client sends it: over gRPC the bytes travel in raw_input_contents.

The answer is written without copying the result tensors twice: the response's fields
without raw_output_contents are serialized by protobuf, and each output's bytes follow as
field 6 entries written here (protobuf parses concatenated fields as one message, and the
order of fields is free).

Every client mistake raises a ServiceError whose message names the input, parameter or
field (INVALID_ARGUMENT, or NOT_FOUND for another model). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

# No stubs for protobuf's runtime in the dev dependencies (types-protobuf): the generated .pyi
# types the messages; the runtime is only caught from here.
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]

from service.errors import MAX_LOC_TEXT, FieldError, InvalidRequest, ServiceError, clip
from service.wire.grpc import grpc_predict_v2_pb2 as pb
from service.wire.models import MAX_RANK, MAX_UNKNOWN_FIELDS
from service.wire.number_lists import NumberArray
from service.wire.v2_models import INPUT_DATATYPES, MAX_OUTPUTS, MODEL_NAME, MODEL_VERSION

SERVICE_NAME: Final = "inference.GRPCInferenceService"

# The typed list of `contents` each datatype reads (the protocol's table), and its numpy dtype.
# FP16 and BF16 have none: they travel in raw_input_contents only, as in Triton.
CONTENTS_FIELDS: Final[dict[str, tuple[str, type[np.generic]]]] = {
    "BOOL": ("bool_contents", np.bool_),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
}
_ALL_CONTENTS: Final = tuple(field.name for field in pb.InferTensorContents.DESCRIPTOR.fields)
# Bytes per element in raw_input_contents (little-endian, row-major), by datatype.
ITEM_BYTES: Final[dict[str, int]] = {
    "FP16": 2,
    "BF16": 2,
    "FP32": 4,
    "FP64": 8,
    "BOOL": 1,
    "INT32": 4,
    "INT64": 8,
}
# ModelInferResponse.raw_output_contents: field 6, length-delimited (wire type 2).
_RAW_OUTPUT_TAG: Final = bytes([6 << 3 | 2])
# REST's binary extension, which gRPC replaces with raw_input_contents / raw_output_contents.
_REST_ONLY: Final = "REST's binary tensor data extension; over gRPC the bytes travel in"


class UnknownModel(ServiceError):
    """404 (gRPC NOT_FOUND): the request names another model, or another version."""

    status = 404
    title = "Not found"


def _invalid(message: str, *where: str | int, kind: str = "value_error") -> InvalidRequest:
    # loc ["v2", ...]: the message is in the protocol's words already (service.wire.v2_errors).
    return InvalidRequest(message, errors=[FieldError(loc=("v2", *where), msg=message, type=kind)])


def _name(text: str) -> str:
    """A client's name, bounded for a message."""
    return clip(text, MAX_LOC_TEXT)


# ---- requests ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodedRequest:
    """A parsed ModelInferRequest and its raw_input_contents, in order. The entries are views
    of the serialized message where they could be split off before parsing (the message then
    holds none): protobuf would copy every tensor's bytes into a new object of its own."""

    message: pb.ModelInferRequest
    raw_contents: tuple[bytes | memoryview, ...]


def decode_infer_request(raw: bytes) -> DecodedRequest:
    """The serialized ModelInferRequest, or InvalidRequest when protobuf cannot parse it or it
    holds more entries than a request can use (`_Counts`, `_check_nested_counts`): the counts
    are read from the wire before protobuf builds a message and before any Python walks one."""
    split = _split_raw_contents(raw)
    try:
        if split is None:  # anything unusual: protobuf parses it all, and judges it
            message: pb.ModelInferRequest = pb.ModelInferRequest.FromString(raw)
            decoded = DecodedRequest(message, tuple(message.raw_input_contents))
        else:
            rest, contents = split
            decoded = DecodedRequest(pb.ModelInferRequest.FromString(rest), contents)
    except DecodeError as exc:
        raise _invalid(
            f"the request is not a valid inference.ModelInferRequest (protobuf): {exc}",
            "request",
            kind="protobuf",
        ) from None
    _check_nested_counts(decoded.message)
    return decoded


# The most entries each repeated field of a ModelInferRequest may hold (on the wire, before
# protobuf parses it): an input or raw entry per input the model has, MAX_OUTPUTS outputs,
# MAX_PARAMETERS parameters in any parameters map (the models refuse a request past its known
# parameters and MAX_UNKNOWN_FIELDS unknown ones anyway), one of each singular field (a client's
# serializer writes each once), MAX_UNKNOWN_FIELDS fields of numbers the message does not have
# (REST's rule for unknown fields; fewer are ignored, as protobuf ignores them). A message of
# 2.5 million empty inputs (12.6 MB) cost 18 s of CPU and 1.6 GB before it was refused.
MAX_PARAMETERS: Final = 32
# The kinds of the refusals of messages protobuf would parse (fuzz/grpc_infer.py allows them).
BEYOND_PROTOBUF: Final = ("too_many_entries", "protobuf_group")
_REPEATS: Final[dict[int, tuple[str, int]]] = {
    1: ("model_name", 1),
    2: ("model_version", 1),
    3: ("id", 1),
    4: ("parameters", MAX_PARAMETERS),
    5: ("inputs", len(INPUT_DATATYPES)),
    6: ("outputs", MAX_OUTPUTS),
    7: ("raw_input_contents", len(INPUT_DATATYPES)),
}


def _too_many(field: str, limit: int, *where: str | int) -> InvalidRequest:
    what = "fields of numbers ModelInferRequest does not have" if field == "unknown" else field
    return _invalid(
        f"the request holds more than {limit} {what}: a request of this model has at most {limit}",
        *(where or (field,)),
        kind="too_many_entries",
    )


class _Counts:
    """How many of each top-level field a message has held so far; refuses one too many."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def add(self, field: int) -> None:
        count = self.seen.get(field, 0) + 1
        self.seen[field] = count
        name, limit = _REPEATS.get(field, ("unknown", 0))
        if name == "unknown":
            unknown = sum(n for f, n in self.seen.items() if f not in _REPEATS)
            if unknown > MAX_UNKNOWN_FIELDS:
                raise _too_many("unknown", MAX_UNKNOWN_FIELDS, "request")
        elif count > limit:
            raise _too_many(name, limit)


def _check_nested_counts(message: pb.ModelInferRequest) -> None:
    """Each input's and output's parameters and shape, counted (len() of protobuf's containers:
    no walk) before the codec reads them in Python."""
    for index, tensor in enumerate(message.inputs):
        if len(tensor.parameters) > MAX_PARAMETERS:
            raise _too_many("parameters", MAX_PARAMETERS, "inputs", index, "parameters")
        if len(tensor.shape) > MAX_RANK:
            raise _too_many("dimensions in a shape", MAX_RANK, "inputs", index, "shape")
    for index, output in enumerate(message.outputs):
        if len(output.parameters) > MAX_PARAMETERS:
            raise _too_many("parameters", MAX_PARAMETERS, "outputs", index, "parameters")


# ModelInferRequest.raw_input_contents: field 7, length-delimited.
_RAW_INPUT_FIELD: Final = 7
_LENGTH_DELIMITED: Final = 2
# Bytes a fixed-size field's value takes, by wire type (1: 64-bit, 5: 32-bit).
_FIXED_BYTES: Final = {1: 8, 5: 4}
# A group's start and end (wire types 3 and 4).
_GROUP: Final = (3, 4)


def _read_varint(raw: bytes, at: int) -> tuple[int, int] | None:
    """The varint at raw[at:] and where it ends; None when it runs past the end or 10 bytes."""
    value = shift = 0
    for end in range(at, min(at + 10, len(raw))):
        byte = raw[end]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, end + 1
        shift += 7
    return None


def _split_raw_contents(raw: bytes) -> tuple[bytes, tuple[memoryview, ...]] | None:
    """(the message's other fields, its raw_input_contents as views of `raw`), read from the
    top-level fields' tags and lengths alone; None for anything but plain well-formed fields
    (groups, truncation, a bad varint), which protobuf's parser then judges. Raises
    InvalidRequest at the first field past its count (_Counts), so the walk is bounded by
    the counts, whatever the message's size."""
    view = memoryview(raw)
    others: list[memoryview] = []
    contents: list[memoryview] = []
    counts = _Counts()
    at, size = 0, len(raw)
    while at < size:
        start = at
        key = _read_varint(raw, at)
        if key is None:
            return None
        tag, at = key
        field, wire = tag >> 3, tag & 7
        counts.add(field)
        if wire == 0:
            value = _read_varint(raw, at)
            if value is None:
                return None
            at = value[1]
        elif wire == _LENGTH_DELIMITED:
            length = _read_varint(raw, at)
            if length is None or length[1] + length[0] > size:
                return None
            at = length[1] + length[0]
            if field == _RAW_INPUT_FIELD:
                contents.append(view[length[1] : at])
                continue
        elif wire in _FIXED_BYTES:
            at += _FIXED_BYTES[wire]
            if at > size:
                return None
        elif wire in _GROUP:
            # proto3 has none, and protobuf would skip an unknown one and parse on, past the
            # counts above.
            raise _invalid(
                f"the request is not a valid inference.ModelInferRequest: field {field} is a "
                "protobuf group, which this message has none of",
                "request",
                kind="protobuf_group",
            )
        else:  # no wire type at all: protobuf's parser stops there, with its own message
            return None
        others.append(view[start:at])
    return b"".join(others), tuple(contents)


def check_model(name: str, version: str) -> None:
    """Raise UnknownModel unless `name` (and `version`, when given) is this server's model."""
    if name != MODEL_NAME or version not in ("", MODEL_VERSION):
        what = f"{_name(name)!r}" + (f" version {_name(version)!r}" if version else "")
        raise UnknownModel(
            f"no model {what}: this server serves the model {MODEL_NAME!r}, version "
            f"{MODEL_VERSION!r}"
        )


def parameter_value(param: pb.InferParameter, *, where: str) -> bool | int | float | str:
    """The value an InferParameter holds, as its JSON twin would hold it."""
    choice = param.WhichOneof("parameter_choice")
    if choice is None:
        raise _invalid(f"{where}: the InferParameter holds no value (parameter_choice is unset)")
    value: bool | int | float | str = getattr(param, choice)
    return value


def _parameters(
    params: Mapping[str, pb.InferParameter], *, label: str, rest_only: str | None = None
) -> dict[str, Any]:
    """A parameters map as a JSON object. `label` words a parameter in a message ("parameter",
    "input 'q': parameter"); `rest_only` names the one REST binary parameter refused here."""
    values: dict[str, Any] = {}
    for key, param in params.items():
        if key == rest_only:
            raise _invalid(
                f"{label} {key!r} is {_REST_ONLY} raw_input_contents and raw_output_contents",
                "parameters",
                key,
            )
        values[key] = parameter_value(param, where=f"{label} {_name(key)!r}")
    return values


@dataclass(frozen=True, slots=True)
class InferPayload:
    """A ModelInferRequest as its REST twin: the parsed JSON header and the binary data after it
    (offset 0: the header is not in the body)."""

    payload: dict[str, Any]
    body: bytes


def infer_payload(decoded: DecodedRequest) -> InferPayload:
    """The REST payload and binary data of a ModelInferRequest (module docstring). Checks only
    what REST cannot see (raw_input_contents' count and sizes, contents' fields); the models
    and the tensor codec check the rest."""
    request = decoded.message
    check_model(request.model_name, request.model_version)
    raws = decoded.raw_contents
    inputs = request.inputs
    if raws and len(raws) != len(inputs):
        raise _invalid(
            f"raw_input_contents holds {len(raws)} entries for {len(inputs)} inputs: give one "
            "per input, in the order of `inputs` (or none, and every input's contents)",
            "raw_input_contents",
        )
    entries = [
        _input_entry(tensor, index, raws[index] if raws else None)
        for index, tensor in enumerate(inputs)
    ]
    payload: dict[str, Any] = {"inputs": entries}
    if request.id:
        payload["id"] = request.id
    parameters = _parameters(request.parameters, label="parameter", rest_only="binary_data_output")
    # Every output goes back in raw_output_contents: REST's binary outputs, sized as such.
    parameters["binary_data_output"] = True
    payload["parameters"] = parameters
    if request.outputs:
        payload["outputs"] = [_output_entry(output) for output in request.outputs]
    return InferPayload(payload=payload, body=b"".join(raws))


def _input_entry(
    tensor: pb.ModelInferRequest.InferInputTensor, index: int, raw: bytes | memoryview | None
) -> dict[str, Any]:
    name = tensor.name
    label = f"input {_name(name)!r}"
    entry: dict[str, Any] = {
        "name": name,
        "datatype": tensor.datatype,
        "shape": list(tensor.shape),
    }
    parameters = _parameters(tensor.parameters, label=f"{label}: parameter")
    # KServe's SDK (InferRequest.to_grpc, kserve 0.21) keeps REST's binary_data_size on an input
    # whose bytes it sends in raw_input_contents: taken when it says that entry's length.
    said = parameters.pop("binary_data_size", None)
    has_contents = any(len(getattr(tensor.contents, field)) for field in _ALL_CONTENTS)
    if said is not None and (raw is None or said != len(raw)):
        where = "no entry" if raw is None else f"{len(raw)} bytes"
        raise _invalid(
            f"{label}: parameter 'binary_data_size' is {said!r} but raw_input_contents holds "
            f"{where} for it; over gRPC the bytes travel in raw_input_contents (the parameter "
            "may be left out)",
            "inputs",
            name,
            "parameters",
            "binary_data_size",
        )
    if raw is not None:
        if has_contents:
            raise _invalid(
                f"{label} carries both contents and raw_input_contents[{index}]: give one",
                "inputs",
                name,
            )
        _check_raw_size(tensor, index, len(raw))
        parameters["binary_data_size"] = len(raw)
    elif has_contents or tensor.HasField("contents"):
        entry["data"] = _contents_data(tensor)
    elif name in INPUT_DATATYPES:  # (an unknown input is refused as such by the codec)
        raise _invalid(
            f"{label} has neither contents nor an entry in raw_input_contents", "inputs", name
        )
    if parameters:
        entry["parameters"] = parameters
    return entry


def _check_raw_size(tensor: pb.ModelInferRequest.InferInputTensor, index: int, size: int) -> None:
    """raw_input_contents[index] must hold the input's shape in its datatype, said in gRPC's
    words (REST's would name binary_data_size). Inputs, datatypes and shapes the models and
    the codec refuse anyway are left to them, with their messages."""
    allowed = INPUT_DATATYPES.get(tensor.name)
    if allowed is None or tensor.datatype not in allowed:
        return
    shape = list(tensor.shape)
    if any(dim < 0 for dim in shape):
        return
    needed = math.prod(shape) * ITEM_BYTES[tensor.datatype]
    if size != needed:
        raise _invalid(
            f"input {tensor.name!r}: raw_input_contents[{index}] holds {size} bytes; shape "
            f"{shape} of {tensor.datatype} needs {needed}",
            "inputs",
            tensor.name,
            kind="raw_input_contents",
        )


def _contents_data(tensor: pb.ModelInferRequest.InferInputTensor) -> NumberArray | list[Any]:
    """An input's typed contents as the data of its REST twin (a flat list, as numpy reads it)."""
    name, datatype = tensor.name, tensor.datatype
    label = f"input {_name(name)!r}"
    contents = tensor.contents
    filled = [field for field in _ALL_CONTENTS if len(getattr(contents, field))]
    known = CONTENTS_FIELDS.get(datatype)
    if known is None:
        if datatype in ITEM_BYTES:  # FP16, BF16
            raise _invalid(
                f"{label}: {datatype} travels only in raw_input_contents (contents has no "
                "field for it, as in Triton)",
                "inputs",
                name,
                kind="dtype",
            )
        # An unknown datatype: the codec refuses it, naming the datatypes the input takes.
        return []
    field, dtype = known
    others = [other for other in filled if other != field]
    if others:
        raise _invalid(
            f"{label}: {datatype} contents go in {field}, not {', '.join(others)}",
            "inputs",
            name,
            kind="contents",
        )
    values = np.array(getattr(contents, field), dtype=dtype)
    return NumberArray(
        shape=values.shape, kind=values.dtype.kind, booleans=dtype is np.bool_, values=values
    )


def _output_entry(output: pb.ModelInferRequest.InferRequestedOutputTensor) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": output.name}
    parameters = _parameters(
        output.parameters,
        label=f"output {_name(output.name)!r}: parameter",
        rest_only="binary_data",
    )
    if parameters:
        entry["parameters"] = parameters
    return entry


# ---- responses -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RawOutput:
    """One output of an answer: its metadata and its bytes (little-endian, row-major)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: memoryview


def set_parameter(target: pb.InferParameter, value: bool | int | float | str) -> None:
    """Write `value` into the InferParameter's oneof by its type (bool before int: a bool is
    an int in Python)."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    elif isinstance(value, str):
        target.string_param = value
    else:  # our own parameters are scalars: anything else is our bug, a 500
        raise TypeError(f"a response parameter of type {type(value).__name__}")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_infer_response(
    *,
    request_id: str | None,
    parameters: Mapping[str, bool | int | float | str],
    outputs: Sequence[RawOutput],
) -> bytes:
    """A serialized ModelInferResponse: the model, the request's id, the parameters, and the
    outputs with their bytes in raw_output_contents, in the order of `outputs`."""
    response = pb.ModelInferResponse(model_name=MODEL_NAME, model_version=MODEL_VERSION)
    if request_id:
        response.id = request_id
    for key, value in parameters.items():
        set_parameter(response.parameters[key], value)
    for output in outputs:
        response.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
    parts: list[bytes | memoryview] = [response.SerializeToString()]
    for output in outputs:
        parts += [_RAW_OUTPUT_TAG, _encode_varint(output.data.nbytes), output.data]
    return b"".join(parts)
