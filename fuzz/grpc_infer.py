"""Fuzz the gRPC door's request decoding: a serialized inference.ModelInferRequest -> a
prepared job (service.serving.prepare_grpc.prepare_grpc_infer): a job or a client error.

An input is the message's bytes, as grpcio hands them to the servicer. Half the mutations are
libFuzzer's bytes (protobuf's wire format: tags, varints, lengths); half parse the message
(tritonclient.grpc's own ModelInferRequest, uninstrumented) and change one field as a client
might (an input's name, datatype or shape; a parameter of any type; raw_input_contents fitted
to the shapes, cut, added or dropped; typed contents in the datatype's field or another;
outputs; the model's name), then serialize it again.

    .venv/bin/python -m fuzz.grpc_infer [libFuzzer flags] [corpus dirs]
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any, Final

from fuzz.mutate import NUMBERS, STRINGS
from fuzz.support import Check, Finding, answer, cost_model, fuzz_main, fuzz_mutate, settings
from fuzz.v2_framing import cases

NAME: Final = "grpc_infer"
MAX_LEN: Final = 4096
INPUTS: Final = ("q", "k", "v", "key_lengths", "key_padding_mask", "attn_mask")
DATATYPES: Final = ("FP16", "BF16", "FP32", "FP64", "BOOL", "INT32", "INT64")
OUTPUTS: Final = ("output", "weights", "entropy", "lse", "visible_keys", "entropy_per_head")
PARAMETERS: Final = (
    "causal", "scale", "temperature", "diagnostics", "tag", "timeout", "priority",
    "binary_data_output", "binary_data_size", "binary_data", "sequence_id",
)  # fmt: skip
VALUES: Final = ("top_left", "bottom_right", "none", "summary", "full", "attention", "1", "")
WORDS: Final = (*INPUTS, *DATATYPES, *OUTPUTS, *PARAMETERS, *VALUES)
_ITEMSIZE: Final = {"FP16": 2, "BF16": 2, "FP32": 4, "FP64": 8, "BOOL": 1, "INT32": 4, "INT64": 8}
_CONTENTS: Final = {"BOOL": "bool_contents", "INT32": "int_contents", "INT64": "int64_contents",
                    "FP32": "fp32_contents", "FP64": "fp64_contents"}  # fmt: skip
_ALL_CONTENTS: Final = (*_CONTENTS.values(), "uint_contents", "uint64_contents", "bytes_contents")
_INT64: Final = (-(2**63), 2**63 - 1)


def load() -> Check:
    """The check of one input: the gRPC door's prepare, and its reading of the message against
    protobuf's own (decode_infer_request splits raw_input_contents off by the top-level tags
    and lengths, as views, and lets protobuf parse the rest: the message and the entries must
    be protobuf's, and a message protobuf refuses must be refused)."""
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]

    from service.errors import InvalidRequest
    from service.serving.prepare_grpc import prepare_grpc_infer
    from service.wire.grpc import grpc_predict_v2_pb2 as pb
    from service.wire.grpc_codec import BEYOND_PROTOBUF, decode_infer_request

    config, cost = settings(), cost_model()

    def check(data: bytes) -> None:
        answer(lambda: prepare_grpc_infer(data, config, cost))
        try:
            whole = pb.ModelInferRequest.FromString(data)
        except DecodeError:
            whole = None
        try:
            decoded = decode_infer_request(data)
        except InvalidRequest as exc:
            if whole is not None and exc.errors and exc.errors[0].type in BEYOND_PROTOBUF:
                return  # counts (or a group) that protobuf would parse and the door refuses
            decoded = None
        if (whole is None) != (decoded is None):
            raise Finding(
                "decode_infer_request and protobuf disagree on whether the message parses: "
                f"protobuf {'refuses' if whole is None else 'parses'} it"
            )
        if whole is None or decoded is None:
            return
        entries = [bytes(entry) for entry in decoded.raw_contents]
        if entries != list(whole.raw_input_contents):
            raise Finding("decode_infer_request's raw_input_contents are not protobuf's")
        rest = pb.ModelInferRequest()
        rest.CopyFrom(whole)
        del rest.raw_input_contents[:]
        del decoded.message.raw_input_contents[:]  # an entry split off: none left in it
        if decoded.message.SerializeToString(deterministic=True) != rest.SerializeToString(
            deterministic=True
        ):
            raise Finding("decode_infer_request's message is not protobuf's")

    return check


# ---- mutations ---------------------------------------------------------------------------


def _text(rng: random.Random, words: tuple[str, ...]) -> str:
    """One of `words`, or now and then an odd string: protobuf's strings are UTF-8, so a lone
    surrogate becomes U+FFFD (a message cannot carry one)."""
    text = rng.choice(words) if rng.random() < 0.85 else rng.choice(STRINGS)
    return text.encode("utf-8", "replace").decode("utf-8")


def _set_text(message: Any, field: str, value: str) -> None:
    setattr(message, field, value)


def _parameter(target: Any, rng: random.Random) -> None:
    """`target` (an InferParameter) given a value of any of its types, or left without one."""
    pick = rng.randrange(6)
    if pick == 0:
        target.bool_param = rng.random() < 0.5
    elif pick == 1:
        target.int64_param = max(_INT64[0], min(_INT64[1], int(rng.choice(NUMBERS[:22]))))
    elif pick == 2:
        _set_text(target, "string_param", _text(rng, VALUES))
    elif pick == 3:
        target.double_param = float(rng.choice(NUMBERS))
    elif pick == 4:
        target.uint64_param = rng.choice((0, 1, 2, 3, 2**32, 2**63, 2**64 - 1))
    else:
        target.Clear()


def _fit(request: Any, rng: random.Random) -> None:
    """raw_input_contents made one entry per input, each of the bytes its shape and datatype
    need (random, zeros, or 0/1 for BOOL); typed contents cleared."""
    del request.raw_input_contents[:]
    for tensor in request.inputs:
        tensor.ClearField("contents")
        try:
            size = math.prod(tensor.shape) * _ITEMSIZE.get(tensor.datatype, 4)
        except OverflowError:  # pragma: no cover - int arithmetic does not overflow
            size = 0
        size = max(0, min(size, 1 << 13))
        if tensor.datatype == "BOOL":
            raw = bytes(rng.randrange(2) for _ in range(size))
        else:
            raw = rng.randbytes(size) if rng.random() < 0.7 else bytes(size)
        request.raw_input_contents.append(raw)


def _contents(tensor: Any, rng: random.Random) -> None:
    """The input's typed contents filled, in its datatype's field (mostly) or another."""
    tensor.ClearField("contents")
    field = _CONTENTS.get(tensor.datatype) if rng.random() < 0.8 else None
    field = field or rng.choice(_ALL_CONTENTS)
    count = max(0, min(math.prod(tensor.shape) if rng.random() < 0.8 else rng.randrange(9), 512))
    values: list[Any]
    if field == "bool_contents":
        values = [rng.random() < 0.5 for _ in range(count)]
    elif field in ("fp32_contents", "fp64_contents"):
        values = [rng.choice((rng.gauss(0, 1), *NUMBERS[25:])) for _ in range(count)]
        values = [float(v) for v in values]
    elif field == "bytes_contents":
        values = [rng.randbytes(rng.randrange(4)) for _ in range(count)]
    else:
        bound = {"int_contents": 2**31, "uint_contents": 2**32}.get(field, 2**63)
        low = 0 if field.startswith("uint") else -bound
        high = (2 * bound if field.startswith("uint") else bound) - 1
        values = [max(low, min(high, rng.choice((0, 1, 2, 5, -1, 2**31, 2**63))))
                  for _ in range(count)]  # fmt: skip
    try:
        getattr(tensor.contents, field).extend(values)
    except (ValueError, TypeError, OverflowError):  # a float32 field refuses what it cannot hold
        tensor.ClearField("contents")


def _shape(tensor: Any, rng: random.Random) -> None:
    dims = list(tensor.shape)
    pick = rng.randrange(4)
    if pick == 0 and dims:
        dims[rng.randrange(len(dims))] = rng.choice((0, 1, 2, 3, 5, -1, 4096, 2**31, 2**62))
    elif pick == 1 and dims:
        del dims[rng.randrange(len(dims))]
    elif pick == 2:
        dims.insert(rng.randrange(len(dims) + 1), rng.choice((1, 2, 3)))
    else:
        dims = [rng.choice((1, 2, 3, 4)) for _ in range(rng.randrange(7))]
    del tensor.shape[:]
    tensor.shape.extend(dims)


def mutate_message(raw: bytes, rng: random.Random) -> bytes | None:
    """The serialized ModelInferRequest with one field changed; None when `raw` is not one."""
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]
    from tritonclient.grpc import service_pb2 as pb  # type: ignore[import-untyped, unused-ignore]

    try:
        request = pb.ModelInferRequest.FromString(raw)
    except DecodeError:
        return None
    if not request.inputs:
        request.inputs.add(name=rng.choice(INPUTS), datatype="FP32", shape=[1, 2])
    tensor = rng.choice(request.inputs)
    pick = rng.randrange(14)
    if pick == 0:
        _set_text(tensor, "name", _text(rng, INPUTS))
    elif pick == 1:
        _set_text(tensor, "datatype", _text(rng, DATATYPES))
    elif pick in (2, 3):
        _shape(tensor, rng)
        if rng.random() < 0.6:
            _fit(request, rng)
    elif pick == 4:
        _fit(request, rng)
    elif pick == 5:
        raws = request.raw_input_contents
        if raws and rng.random() < 0.5:
            del raws[rng.randrange(len(raws))]
        else:
            raws.append(rng.randbytes(rng.randrange(17)))
    elif pick == 6:
        _contents(tensor, rng)
        if rng.random() < 0.7:
            del request.raw_input_contents[:]
    elif pick == 7:
        _parameter(request.parameters[_text(rng, PARAMETERS)], rng)
    elif pick == 8:
        _parameter(tensor.parameters[_text(rng, PARAMETERS)], rng)
    elif pick == 9:
        if request.outputs and rng.random() < 0.4:
            del request.outputs[rng.randrange(len(request.outputs))]
        else:
            output = request.outputs.add()
            _set_text(output, "name", _text(rng, OUTPUTS))
            if rng.random() < 0.3:
                _parameter(output.parameters[_text(rng, PARAMETERS)], rng)
    elif pick == 10:
        _set_text(request, rng.choice(("model_name", "model_version", "id")), _text(rng, VALUES))
    elif pick == 11 and len(request.inputs) > 1:
        index = rng.randrange(len(request.inputs))
        del request.inputs[index]
        if index < len(request.raw_input_contents):
            del request.raw_input_contents[index]
    elif pick == 12:
        request.inputs.add().CopyFrom(tensor)
    else:
        for other in rng.sample(list(request.inputs), k=len(request.inputs)):
            _set_text(other, "datatype", rng.choice(DATATYPES))
        _fit(request, rng)
    return bytes(request.SerializeToString())


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.5:
        out = mutate_message(data, rng)
        if out is not None and len(out) <= max_size:
            return out
    return fuzz_mutate(data, max_size)


# ---- seeds -------------------------------------------------------------------------------


def seeds() -> Iterator[tuple[str, bytes]]:
    """tritonclient.grpc's own requests (raw_input_contents) for every case of v2_framing, and
    the same with typed contents where a datatype has a field for them."""
    import numpy as np
    import tritonclient.grpc as grpcclient  # type: ignore[import-untyped, unused-ignore]
    from tritonclient.grpc import _utils

    for name, inputs, parameters, outputs in cases():
        infer_inputs = []
        for input_name, array, datatype in inputs:
            inp = grpcclient.InferInput(input_name, list(array.shape), datatype)
            inp.set_data_from_numpy(array)
            infer_inputs.append(inp)
        requested = [grpcclient.InferRequestedOutput(o) for o in outputs] or None
        options = {"priority": 1, "timeout": 1000} if name == "options" else {}
        request = _utils._get_inference_request(
            model_name="attention", inputs=infer_inputs, model_version="", request_id="fuzz",
            outputs=requested, sequence_id=0, sequence_start=False, sequence_end=False,
            priority=options.get("priority", 0), timeout=options.get("timeout"),
            parameters=parameters or None,
        )  # fmt: skip
        yield f"{name}-raw", request.SerializeToString()
        if all(dt in _CONTENTS for _, _, dt in inputs):
            del request.raw_input_contents[:]
            for tensor, (_, array, datatype) in zip(request.inputs, inputs, strict=True):
                values = np.asarray(array).reshape(-1).tolist()
                getattr(tensor.contents, _CONTENTS[datatype]).extend(values)
            yield f"{name}-contents", request.SerializeToString()
    yield "empty", b""
    yield "truncated", b"\x0a\x09attention\x1a\x10"


def main() -> None:
    fuzz_main(load, mutator=mutate)


if __name__ == "__main__":
    main()
