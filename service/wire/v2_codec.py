"""The Open Inference Protocol's tensors (v2): request bodies -> torch tensors, results ->
response parts, with Triton's binary tensor data extension.

A binary request is a JSON header (its length in the Inference-Header-Content-Length header)
followed by the inputs' raw little-endian row-major bytes, in the order of the inputs. The
binary data is read with np.frombuffer straight off the body and copied once, all inputs
together, into memory torch owns (the body's bytes are immutable, and an input's offset after a
JSON header of any length is rarely aligned to its element size); each input's tensor is a view
of that copy. Binary outputs are written from the result
tensors' own buffers (memoryviews), never joined into one string.

Without binary data, tensors are JSON lists (flat or nested, row-major), decoded by one
np.asarray call each (or, in a body parsed in pieces, read as NumberArrays:
service.wire.json_arrays). BF16 travels only as binary data, as in Triton (numpy has no
bfloat16: its raw 2-byte values are read as int16 and viewed as bfloat16 by torch).

Every client mistake raises InvalidRequest (a 400 on v2) whose message names the input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from service.errors import MAX_LOC_TEXT, FieldError, InvalidRequest, clip
from service.wire.codec import nulls_as_minus_inf, refuse_booleans_among_numbers, to_numpy
from service.wire.lengths import parse_length
from service.wire.number_lists import NumberArray
from service.wire.v2_models import (
    FLOAT_DATATYPES,
    INPUT_DATATYPES,
    REQUIRED_INPUTS,
    InferInput,
    InferRequest,
)


@dataclass(frozen=True, slots=True)
class _Datatype:
    name: str
    wire: np.dtype[Any]  # one element in binary data (little-endian)
    torch: torch.dtype


_DATATYPES: Final[dict[str, _Datatype]] = {
    d.name: d
    for d in (
        _Datatype("FP16", np.dtype("<f2"), torch.float16),
        _Datatype("BF16", np.dtype("<i2"), torch.bfloat16),  # raw bits, viewed by torch
        _Datatype("FP32", np.dtype("<f4"), torch.float32),
        _Datatype("FP64", np.dtype("<f8"), torch.float64),
        _Datatype("BOOL", np.dtype("u1"), torch.bool),
        _Datatype("INT32", np.dtype("<i4"), torch.int32),
        _Datatype("INT64", np.dtype("<i8"), torch.int64),
    )
}
_BY_TORCH: Final[dict[torch.dtype, _Datatype]] = {d.torch: d for d in _DATATYPES.values()}
_INT32: Final = np.iinfo(np.int32)
_INT64: Final = np.iinfo(np.int64)


def datatype_name(dtype: torch.dtype) -> str:
    """The v2 datatype of a torch dtype ("FP32", ...)."""
    return _BY_TORCH[dtype].name


def _invalid(message: str, *where: str | int, kind: str = "value_error") -> InvalidRequest:
    # loc ["v2", ...]: the message is already in v2's words (service.api.errors).
    return InvalidRequest(message, errors=[FieldError(loc=("v2", *where), msg=message, type=kind)])


def split_header(body: bytes, header_length: str | None) -> tuple[bytes, int]:
    """(the JSON header, the offset where binary data starts) of a request body."""
    if header_length is None:
        return body, len(body)
    size = parse_length(header_length)
    if size is None or not 0 < size <= len(body):
        raise _invalid(
            f"header Inference-Header-Content-Length: {header_length[:32]!r} is not the length "
            f"of a JSON header within the body's {len(body)} bytes (in ASCII digits)",
            "header",
            kind="header_length",
        )
    return body[:size], size


# ---- inputs --------------------------------------------------------------------------------


def decode_inputs(
    request: InferRequest, body: bytes, offset: int, *, max_elements: int
) -> dict[str, torch.Tensor]:
    """The request's inputs as CPU tensors by name (key_lengths as int64). `offset`: where
    binary data starts in `body`; every byte after it must belong to an input."""
    names = [inp.name for inp in request.inputs]
    for inp in request.inputs:
        if inp.name not in INPUT_DATATYPES:
            name = clip(inp.name, MAX_LOC_TEXT)
            raise _invalid(
                f"unknown input {name!r}: the model takes {', '.join(INPUT_DATATYPES)}",
                "inputs",
                name,
            )
        if names.count(inp.name) > 1:
            raise _invalid(f"input {inp.name!r} is given twice", "inputs", inp.name)
    missing = [name for name in REQUIRED_INPUTS if name not in names]
    if missing:
        raise _invalid(f"input {missing[0]!r} is required (q, k and v)", "inputs", missing[0])

    # First every input's metadata (datatype, size, where its bytes lie), then one copy of all
    # the binary data, then the tensors as views of that copy.
    plans = []
    cursor = offset
    for inp in request.inputs:
        plan = _plan_input(inp, body, cursor, max_elements=max_elements)
        plans.append(plan)
        cursor += plan.size
    if cursor != len(body):
        raise _invalid(
            f"the body carries {len(body) - cursor} bytes of binary data that no input "
            "declares (binary_data_size)",
            "inputs",
        )
    # The one copy, into memory torch will own: writable, and aligned (numpy aligns a fresh
    # array for any element size), where a view of the body would be neither. Binary inputs
    # that hold no element (a 0 in their shape, binary_data_size 0) have no bytes at all.
    binary = (
        np.frombuffer(body, dtype=np.uint8, offset=offset).copy()
        if cursor > offset
        else np.empty(0, dtype=np.uint8)
    )
    tensors: dict[str, torch.Tensor] = {}
    for plan in plans:
        inp = plan.input
        if plan.start is None:
            data = [] if inp.data is None else inp.data
            tensors[inp.name] = _from_json(inp.name, plan.spec, plan.shape, data)
        else:
            raw = binary[plan.start - offset : plan.start - offset + plan.size]
            tensors[inp.name] = _from_binary(inp.name, plan.spec, plan.shape, raw)
    return tensors


@dataclass(frozen=True, slots=True)
class _Plan:
    """One input, checked: its datatype, shape, and where its binary data lies (None: JSON)."""

    input: InferInput
    spec: _Datatype
    shape: tuple[int, ...]
    start: int | None  # offset of its binary data in the body
    size: int  # bytes of binary data (0 for JSON data)


def _plan_input(inp: InferInput, body: bytes, offset: int, *, max_elements: int) -> _Plan:
    """Check one input's metadata against the limits and the body; its bytes start at
    `offset` when it carries binary data."""
    name, shape = inp.name, tuple(inp.shape)
    allowed = INPUT_DATATYPES[name]
    if inp.datatype not in allowed:
        raise _invalid(
            f"input {name!r}: datatype {inp.datatype!r} is not one of {', '.join(allowed)}",
            "inputs",
            name,
            kind="dtype",
        )
    spec = _DATATYPES[inp.datatype]
    # Bound the shape's extent, not only its element count: [0, 2**70] holds no element, but
    # numpy cannot even describe it.
    extent = math.prod(max(dim, 1) for dim in shape)
    if extent > max_elements:
        raise _invalid(
            f"input {name!r}: shape {list(shape)} holds {math.prod(shape)} elements, above the "
            f"limit of {max_elements} per tensor (SDPA_MAX_ELEMENTS); split the request into "
            "smaller ones",
            "inputs",
            name,
            kind="limit.elements",
        )
    size = None if inp.parameters is None else inp.parameters.binary_data_size
    if size is None:
        if inp.data is None:
            raise _invalid(
                f"input {name!r} has neither data nor parameters.binary_data_size",
                "inputs",
                name,
            )
        if spec.name == "BF16":
            raise _invalid(
                f"input {name!r}: BF16 travels only as binary data (as in Triton): send it "
                "with binary_data_size",
                "inputs",
                name,
                kind="dtype",
            )
        return _Plan(inp, spec, shape, None, 0)
    if inp.data is not None:
        raise _invalid(f"input {name!r} carries both data and binary_data_size", "inputs", name)
    expected = math.prod(shape) * spec.wire.itemsize
    if size != expected:
        raise _invalid(
            f"input {name!r}: binary_data_size is {size}; shape {list(shape)} of {spec.name} "
            f"needs {expected} bytes",
            "inputs",
            name,
            kind="binary_data_size",
        )
    if offset + size > len(body):
        raise _invalid(
            f"input {name!r}: the body ends {offset + size - len(body)} bytes before its binary "
            "data does",
            "inputs",
            name,
            kind="binary_data_size",
        )
    return _Plan(inp, spec, shape, offset, size)


def _from_binary(
    name: str, spec: _Datatype, shape: tuple[int, ...], raw: npt.NDArray[np.uint8]
) -> torch.Tensor:
    """A tensor viewing `raw`, its bytes in the request's one copy of the binary data."""
    if raw.ctypes.data % spec.wire.itemsize:
        # Misaligned behind an input of another element size (an odd-length BOOL mask before
        # an FP32 one): this input alone is copied again, to an aligned buffer.
        raw = raw.copy()
    arr = raw.view(spec.wire).reshape(shape)
    if not arr.dtype.isnative:  # a big-endian host: the wire is little-endian
        arr = arr.astype(spec.wire.newbyteorder("="))
    if spec.name == "BOOL":
        if arr.size and int(arr.max()) > 1:
            raise _invalid(f"input {name!r}: BOOL bytes must be 0 or 1", "inputs", name)
        return torch.from_numpy(arr.view(np.bool_))
    tensor = torch.from_numpy(arr)
    if spec.name == "BF16":
        return tensor.view(torch.bfloat16)
    return tensor.to(torch.int64) if spec.name == "INT32" else tensor


def _from_json(
    name: str, spec: _Datatype, shape: tuple[int, ...], data: list[Any] | NumberArray
) -> torch.Tensor:
    try:
        arr: npt.NDArray[Any] = (
            data.as_array() if isinstance(data, NumberArray) else np.asarray(data)
        )
    except ValueError:
        # numpy refuses inhomogeneous nested lists with ValueError, and so does a NumberArray
        # read from one (nothing else can raise it).
        raise _invalid(
            f"input {name!r}: ragged data: every row must have the same length", "inputs", name
        ) from None
    kind = arr.dtype.kind
    if name == "attn_mask" and spec.name in FLOAT_DATATYPES and kind == "O":
        # JSON has no infinity: null in a float mask is -inf (not visible), as in v1.
        arr = nulls_as_minus_inf(data, arr, loc=("v2", "inputs", name))
        kind = arr.dtype.kind
    if arr.size:
        wanted = {"BOOL": "b", "INT32": "iu", "INT64": "iu"}.get(spec.name, "iuf")
        what = {"b": "true/false", "iu": "integers", "iuf": "numbers"}[wanted]
        if kind not in wanted:
            raise _invalid(
                f"input {name!r}: {spec.name} data must hold only {what}",
                "inputs",
                name,
                kind="type",
            )
        refuse_booleans_among_numbers(
            data,
            arr,
            error=lambda: _invalid(
                f"input {name!r}: {spec.name} data must hold only {what}, found booleans",
                "inputs",
                name,
                kind="type",
            ),
        )
    count = math.prod(shape)
    if arr.size != count:
        raise _invalid(
            f"input {name!r}: data holds {arr.size} values; shape {list(shape)} needs {count}",
            "inputs",
            name,
            kind="shape",
        )
    arr = arr.reshape(shape)
    if spec.name in ("INT32", "INT64"):
        bounds = _INT32 if spec.name == "INT32" else _INT64
        if arr.size and (int(arr.min()) < bounds.min or int(arr.max()) > bounds.max):
            raise _invalid(
                f"input {name!r}: values must fit in {spec.name}", "inputs", name, kind="type"
            )
        return torch.from_numpy(arr.astype(np.int64))
    if spec.name == "BOOL":
        return torch.from_numpy(arr.astype(np.bool_, copy=False))
    return torch.from_numpy(arr.astype(spec.wire.newbyteorder("=")))


# ---- outputs -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodedOutput:
    """One output: its entry in the response's JSON, and its binary data (None as JSON)."""

    entry: dict[str, Any]
    data: memoryview | None


def encode_output(name: str, tensor: torch.Tensor, *, binary: bool) -> EncodedOutput:
    """A result tensor as a v2 output: binary data from the tensor's own buffer, or a flat
    JSON list (numpy; non-finite values become null when written)."""
    tensor = tensor.detach().cpu().contiguous()
    spec = _BY_TORCH[tensor.dtype]
    entry: dict[str, Any] = {"name": name, "datatype": spec.name, "shape": list(tensor.shape)}
    if not binary:
        values = to_numpy(tensor)
        entry["data"] = values.reshape(-1) if isinstance(values, np.ndarray) else [values]
        return EncodedOutput(entry, None)
    bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    arr = bits.numpy()
    # A view, never a copy: bool bytes are 0/1 as they are; the others are already
    # little-endian on a little-endian host (astype copies only on a big-endian one).
    arr = arr.view(np.uint8) if arr.dtype == np.bool_ else arr.astype(spec.wire, copy=False)
    data = memoryview(arr.reshape(-1).view(np.uint8).data)
    entry["parameters"] = {"binary_data_size": data.nbytes}
    return EncodedOutput(entry, data)


def binary_size(outputs: Sequence[EncodedOutput]) -> int:
    """Bytes of binary data after the JSON header."""
    return sum(out.data.nbytes for out in outputs if out.data is not None)
