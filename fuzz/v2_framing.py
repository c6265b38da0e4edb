"""Fuzz the v2 binary framing: POST /v2/models/attention/infer's body and its
Inference-Header-Content-Length -> a prepared job (service.serving.prepare_v2), the JSON header
parsed whole and in pieces (as v1_body does): a job or a client error, the same one both ways.

An input is a frame that holds both the header's value and the body:

    byte 0       how the header is written: FORMS[byte % len(FORMS)] (absent, the JSON's length,
                 the length off by one, with spaces, leading zeros, a sign, digits of another
                 script, 5,000 zeros...)
    bytes 1-2    n, the JSON header's length (little-endian; cut to what follows)
    n bytes      the JSON header
    the rest     the binary data after it

The custom mutator keeps that frame: it changes the header's JSON bytes (libFuzzer's
mutations) or one of its values (fuzz.mutate, with the protocol's words), the binary data, the
header's form, or fits the binary data to what the JSON declares (each binary input's
binary_data_size made its shape's bytes, the data made that long), so that the fuzzer gets past
the framing to the tensors and the checks after them.

    .venv/bin/python -m fuzz.v2_framing [libFuzzer flags] [corpus dirs]
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from typing import Any, Final

from fuzz.mutate import attention_shapes, mutate_json
from fuzz.support import (
    Check,
    answer,
    cost_model,
    fuzz_main,
    fuzz_mutate,
    pieces_for,
    same_answers,
    settings,
)

NAME: Final = "v2_framing"
MAX_LEN: Final = 4096
WORDS: Final = (
    "id", "parameters", "inputs", "outputs", "name", "shape", "datatype", "data",
    "binary_data_size", "binary_data", "binary_data_output", "causal", "scale", "temperature",
    "diagnostics", "tag", "timeout", "priority", "q", "k", "v", "key_lengths",
    "key_padding_mask", "attn_mask", "output", "weights", "entropy", "lse", "visible_keys",
    "entropy_per_head", "masked_rows_per_head", "FP16", "BF16", "FP32", "FP64", "BOOL", "INT32",
    "INT64", "top_left", "bottom_right", "none", "summary", "full",
)  # fmt: skip
_ITEMSIZE: Final = {"FP16": 2, "BF16": 2, "FP32": 4, "FP64": 8, "BOOL": 1, "INT32": 4, "INT64": 8}

# How Inference-Header-Content-Length is written, from n (the JSON header's length) and the
# body's length: None, the header is absent. HTTP hands header values over as latin-1 text.
FORMS: Final[tuple[Callable[[int, int], str | None], ...]] = (
    lambda n, size: None,
    lambda n, size: str(n),
    lambda n, size: str(n),
    lambda n, size: str(n),
    lambda n, size: str(n + 1),
    lambda n, size: str(n - 1),
    lambda n, size: f" {n}\t",
    lambda n, size: f"000{n}",
    lambda n, size: "0" * 5000 + str(n),
    lambda n, size: f"+{n}",
    lambda n, size: f"-{n}",
    lambda n, size: f"{n}.0",
    lambda n, size: f"{n:_}",
    lambda n, size: (
        str(n).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")).encode().decode("latin-1")
    ),
    lambda n, size: "",
    lambda n, size: "0",
    lambda n, size: str(size),
    lambda n, size: str(size + 1),
    lambda n, size: "9" * 30,
    lambda n, size: f"{n}, {n}",
    lambda n, size: f"0x{n:x}",
    lambda n, size: f"{n}\x00",
)


def unframe(data: bytes) -> tuple[int, bytes, bytes]:
    """(the header's form, the JSON header, the binary data) of a frame."""
    if len(data) < 3:
        return 0, data, b""
    n = int.from_bytes(data[1:3], "little")
    return data[0], data[3 : 3 + n], data[3 + n :]


def frame(form: int, header: bytes, tail: bytes) -> bytes:
    header = header[:0xFFFF]
    return bytes([form % 256]) + len(header).to_bytes(2, "little") + header + tail


def request_of(data: bytes) -> tuple[bytes, str | None]:
    """(the body, its Inference-Header-Content-Length) that a frame stands for."""
    form, header, tail = unframe(data)
    body = header + tail
    return body, FORMS[form % len(FORMS)](len(header), len(body))


def load() -> Check:
    """The check of one input: prepare_infer, its JSON header parsed whole and in pieces."""
    from service.serving.prepare_v2 import prepare_infer

    config, cost = settings(), cost_model()

    def check(data: bytes) -> None:
        body, length = request_of(data)
        whole = answer(lambda: prepare_infer(body, length, config, cost))
        cut = answer(lambda: prepare_infer(body, length, config, cost, pieces=pieces_for(body)))
        same_answers(whole, cut, what="/v2/models/attention/infer")

    return check


# ---- mutations ---------------------------------------------------------------------------


def _fit(header: bytes, rng: random.Random) -> tuple[bytes, bytes] | None:
    """The header with each binary input's binary_data_size made what its shape and datatype
    need, and binary data of that length: None when the header is not such JSON."""
    try:
        request = json.loads(header)
        inputs = request["inputs"]
        sizes = []
        for inp in inputs:
            params = inp.get("parameters")
            if not isinstance(params, dict) or "binary_data_size" not in params:
                continue
            size = math.prod(int(d) for d in inp["shape"]) * _ITEMSIZE.get(inp["datatype"], 4)
            if not 0 <= size <= 1 << 14:
                return None
            params["binary_data_size"] = size
            sizes.append((inp["datatype"], size))
        header = json.dumps(request).encode()
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError):
        return None
    tail = bytearray()
    for datatype, size in sizes:
        pick = rng.randrange(4)
        if datatype == "BOOL" or pick == 0:
            tail += bytes(rng.randrange(2) for _ in range(size))
        elif pick == 1:
            tail += bytes(size)
        elif pick == 2 and datatype in ("FP32", "FP64", "FP16", "BF16"):
            one = {"FP32": b"\x00\x00\x80\x3f", "FP64": b"\x00" * 6 + b"\xf0\x3f",
                   "FP16": b"\x00\x3c", "BF16": b"\x80\x3f"}[datatype]  # fmt: skip
            tail += one * (size // len(one))
        else:
            tail += rng.randbytes(size)
    return header, bytes(tail)


def regenerate(header: bytes, rng: random.Random) -> tuple[bytes, bytes]:
    """The request's inputs written anew, of shapes that (mostly) fit together
    (fuzz.mutate.attention_shapes), each as binary data (its binary_data_size right) or a JSON
    list, in a datatype it takes; its parameters and outputs stay."""
    try:
        request = json.loads(header)
    except (ValueError, RecursionError):
        request = {}
    if not isinstance(request, dict):
        request = {}
    shapes = attention_shapes(rng)
    datatype = rng.choice(("FP16", "BF16", "FP32", "FP64"))
    inputs, tail = [], bytearray()
    order = list(shapes.items())
    rng.shuffle(order)  # the inputs in any order, their binary data in theirs
    for name, shape in order:
        if name == "key_lengths":
            shape = shape or [1]
            kind = rng.choice(("INT32", "INT64"))
        elif name in ("q", "k", "v"):
            kind = datatype
        else:
            kind = "BOOL" if name == "key_padding_mask" or rng.random() < 0.5 else datatype
        count = math.prod(shape)
        entry: dict[str, Any] = {"name": name, "shape": shape, "datatype": kind}
        if kind == "BF16" or rng.random() < 0.6:
            size = count * _ITEMSIZE[kind]
            if kind == "BOOL":
                tail += bytes(rng.randrange(2) for _ in range(size))
            elif kind.startswith("INT"):
                tail += b"".join(rng.randrange(7).to_bytes(_ITEMSIZE[kind], "little")
                                 for _ in range(count))  # fmt: skip
            else:
                tail += rng.randbytes(size)
            entry["parameters"] = {"binary_data_size": size}
        elif kind == "BOOL":
            entry["data"] = [rng.random() < 0.5 for _ in range(count)]
        elif kind.startswith("INT"):
            entry["data"] = [rng.randrange(7) for _ in range(count)]
        else:
            entry["data"] = [round(rng.uniform(-3, 3), 2) for _ in range(count)]
        inputs.append(entry)
    request["inputs"] = inputs
    return json.dumps(request).encode(), bytes(tail)


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    form, header, tail = unframe(data)
    pick = rng.randrange(18)
    if pick >= 16:
        header, tail = regenerate(header, rng)
        form = 1 if tail or rng.random() < 0.5 else 0
    elif pick < 5:
        header = fuzz_mutate(header, max(len(header) * 2, 64))
    elif pick < 10:
        header = mutate_json(header, rng, WORDS) or fuzz_mutate(header, len(header) + 64)
        if rng.random() < 0.5:
            header, tail = _fit(header, rng) or (header, tail)
    elif pick < 12:
        header, tail = _fit(header, rng) or (header, tail)
    elif pick < 14:
        tail = fuzz_mutate(tail, max(len(tail) * 2, 16))
    else:
        form = rng.randrange(256)
    out = frame(form, header, tail)
    return out if len(out) <= max_size else out[:max_size]


# ---- seeds -------------------------------------------------------------------------------


def cases() -> Iterator[tuple[str, list[tuple[str, Any, str]], dict[str, Any], list[str]]]:
    """(name, inputs as (name, array, datatype), parameters, outputs) of requests."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(2)

    def qkv(datatype: str, shape_q: tuple[int, ...] = (1, 2, 3, 4), n_kv: int = 5) -> list[Any]:
        dtype = {"FP16": np.float16, "BF16": ml_dtypes.bfloat16, "FP32": np.float32,
                 "FP64": np.float64}[datatype]  # fmt: skip
        shape_kv = (*shape_q[:-2], n_kv, shape_q[-1])
        return [
            ("q", rng.standard_normal(shape_q).astype(dtype), datatype),
            ("k", rng.standard_normal(shape_kv).astype(dtype), datatype),
            ("v", rng.standard_normal(shape_kv).astype(dtype), datatype),
        ]

    for datatype in ("FP16", "BF16", "FP32", "FP64"):
        yield f"{datatype}", qkv(datatype), {}, []
    base = qkv("FP32")
    yield "causal", base, {"causal": "bottom_right"}, []
    yield "scale", base, {"scale": 0.3, "diagnostics": "summary"}, ["output", "weights"]
    yield "temperature", base, {"temperature": 2.0, "diagnostics": "full"}, []
    yield "per-row", base, {}, ["entropy", "lse", "visible_keys"]
    yield "per-head", base, {"diagnostics": "summary"}, ["entropy_per_head", "output"]
    # timeout and priority: given to tritonclient as its own arguments (seeds()).
    yield "options", base, {"tag": "fuzz"}, ["weights"]
    yield "key-lengths-int32", [*base, ("key_lengths", np.array([3], np.int32), "INT32")], {}, []
    lengths = np.array([[2, 5]], np.int64)
    yield "key-lengths-int64", [*base, ("key_lengths", lengths, "INT64")], {}, []
    padding = rng.random((1, 5)) < 0.3
    yield "key-padding", [*base, ("key_padding_mask", padding, "BOOL")], {}, []
    visible = rng.random((3, 5)) < 0.7
    yield "mask-bool", [*base, ("attn_mask", visible, "BOOL")], {}, []
    bias = np.where(rng.random((3, 5)) < 0.3, -np.inf, rng.standard_normal((3, 5)))
    yield "mask-float", [*base, ("attn_mask", bias.astype(np.float32), "FP32")], {}, []
    yield "gqa", qkv("FP16", (1, 4, 2, 2), 3)[:1] + qkv("FP16", (1, 2, 2, 2), 3)[1:], {}, []
    yield "2d", qkv("FP64", (3, 2), 4), {"causal": True}, []


def seeds() -> Iterator[tuple[str, bytes]]:
    """Frames of tritonclient.http's own requests (InferenceServerClient.generate_request_body):
    every case with binary data, and as JSON (but BF16, which travels only as binary data)."""
    import tritonclient.http as httpclient  # type: ignore[import-untyped, unused-ignore]

    for name, inputs, parameters, outputs in cases():
        for binary in (True, False):
            if not binary and any(dt == "BF16" for _, _, dt in inputs):
                continue
            infer_inputs = []
            for input_name, array, datatype in inputs:
                inp = httpclient.InferInput(input_name, list(array.shape), datatype)
                inp.set_data_from_numpy(array, binary_data=binary)
                infer_inputs.append(inp)
            requested = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs]
            body, json_size = httpclient.InferenceServerClient.generate_request_body(
                infer_inputs,
                outputs=requested or None,
                parameters=parameters or None,
                **({"priority": 1, "timeout": 1000} if name == "options" else {}),
            )
            kind = "binary" if binary else "json"
            if json_size is None:  # all JSON: sent without the header
                yield f"{name}-{kind}", frame(0, body, b"")
            else:
                yield f"{name}-{kind}", frame(1, body[:json_size], body[json_size:])
    yield "not-json", frame(1, b'{"inputs": [', b"\x00\x01")
    both = {"name": "q", "shape": [1], "datatype": "FP32", "data": [1.0],
            "parameters": {"binary_data_size": 4}}  # fmt: skip
    yield "data-and-binary", frame(1, json.dumps({"inputs": [both]}).encode(), bytes(4))
    yield "length-zeros", frame(8, b'{"inputs": []}', b"")


def main() -> None:
    fuzz_main(load, mutator=mutate)


if __name__ == "__main__":
    main()
