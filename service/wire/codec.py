"""Wire tensors <-> torch tensors, and JSON bytes <-> Python objects.

Nothing here loops in Python over a tensor's elements:
- request bodies are parsed by pydantic_core.from_json (jiter): it materializes a multi-megabyte
  base64 string at memory speed, 15-20x faster than orjson or json on such bodies;
- nested lists go through one np.asarray call (numpy finds the shape, and refuses ragged lists);
  in a body too costly to decode on the event loop, big lists of numbers are parsed in pieces
  straight into numpy (NumberArray: service.wire.json_arrays) and read by the same rules;
- base64 goes through pybase64 (SIMD; binascii when it is missing, about 50x slower) and
  np.frombuffer, little-endian as the wire format says;
- JSON lists in responses are numpy arrays serialized by orjson (OPT_SERIALIZE_NUMPY), which
  writes float32 values in their shortest float32 form ("0.1", not "0.10000000149011612");
  without orjson, ndarray.tolist() and the json module.

bfloat16 has no numpy dtype: base64 carries its raw 2-byte values (read as int16 and viewed as
bfloat16 by torch), lists carry ordinary numbers (rounded to bfloat16 on the way in).

Every client mistake raises InvalidRequest (422) with the loc of the offending field.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
import torch

from sdpa_core import SUPPORTED_DTYPES
from service.errors import FieldError, InvalidRequest
from service.wire.bytecount import occurrences as occurrences
from service.wire.json_arrays import PIECES, Pieces, SlotOf, loads_in_pieces, parse_whole
from service.wire.models import MAX_RANK, WireTensor
from service.wire.number_lists import NumberArray, leaf_types, minus_inf_of

try:  # orjson writes numpy arrays directly, several times faster than tolist() + json.
    import orjson
except ImportError:  # pragma: no cover - exercised only where orjson is missing
    orjson = None  # type: ignore[assignment]

try:  # pybase64: SIMD base64, ~1 ms for 8 MB where binascii takes ~50 ms.
    import pybase64
except ImportError:  # pragma: no cover - exercised only where pybase64 is missing
    pybase64 = None  # type: ignore[assignment]

Loc = tuple[str | int, ...]
Role = Literal["float", "bool_mask", "mask"]
EncodingName = Literal["json", "base64"]


@dataclass(frozen=True, slots=True)
class _DType:
    name: str
    torch: torch.dtype
    wire: np.dtype[Any]  # layout of one element in b64 (little-endian)


_DTYPES: Final[dict[str, _DType]] = {
    d.name: d
    for d in (
        _DType("float16", torch.float16, np.dtype("<f2")),
        _DType("bfloat16", torch.bfloat16, np.dtype("<i2")),  # raw bits, viewed by torch
        _DType("float32", torch.float32, np.dtype("<f4")),
        _DType("float64", torch.float64, np.dtype("<f8")),
        _DType("bool", torch.bool, np.dtype("u1")),
    )
}
_BY_TORCH: Final[dict[torch.dtype, _DType]] = {d.torch: d for d in _DTYPES.values()}
# The float dtypes q, k and v may have (sdpa_core's), by their wire names.
FLOAT_DTYPE_NAMES: Final = tuple(_BY_TORCH[dtype].name for dtype in SUPPORTED_DTYPES)
_FLOAT_NAMES: Final = frozenset(FLOAT_DTYPE_NAMES)
_INT64_MAX: Final = np.iinfo(np.int64).max


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded tensor and the encoding it came in (the default for the response)."""

    tensor: torch.Tensor
    encoding: EncodingName


def _invalid(loc: Loc, msg: str, kind: str) -> InvalidRequest:
    where = ".".join(str(p) for p in loc[1:])
    return InvalidRequest(f"{where}: {msg}", errors=[FieldError(loc=loc, msg=msg, type=kind)])


def wire_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("float32", ...)."""
    return _BY_TORCH[dtype].name


def _check_elements(count: int, *, loc: Loc, max_elements: int) -> None:
    if count > max_elements:
        raise _invalid(
            loc,
            f"{count} elements exceed the limit of {max_elements} per tensor "
            "(SDPA_MAX_ELEMENTS); split the request into smaller ones (fewer sequences or heads "
            "per call)",
            "limit.elements",
        )


def _check_role(name: str, *, role: Role, loc: Loc) -> None:
    if role == "float" and name not in _FLOAT_NAMES:
        raise _invalid(loc, f"must be a floating-point tensor, not {name}", "dtype")
    if role == "bool_mask" and name != "bool":
        raise _invalid(loc, f"must be a bool tensor (true = padding), not {name}", "dtype")


def decode_tensor(
    value: WireTensor | list[Any] | NumberArray, *, loc: Loc, role: Role, max_elements: int
) -> Decoded:
    """A wire tensor (object or bare nested list) as a CPU torch tensor.

    role "float": q, k, v (float dtypes); "bool_mask": key_padding_mask; "mask": attn_mask
    (bool, or float for an additive bias). A nested list parsed in pieces (a NumberArray:
    service.wire.json_arrays) is read as the list itself would be.
    """
    if isinstance(value, list | NumberArray):
        return Decoded(_from_list(value, None, None, loc=loc, role=role, max_elements=max_elements),
                       "json")  # fmt: skip
    if value.b64 is not None:
        assert value.shape is not None  # WireTensor guarantees shape with b64
        _check_role(value.dtype, role=role, loc=(*loc, "dtype"))
        tensor = _from_b64(value.b64, value.dtype, value.shape, loc=loc, max_elements=max_elements)
        return Decoded(tensor, "base64")
    _check_role(value.dtype, role=role, loc=(*loc, "dtype"))
    if value.shape is not None:
        _check_elements(math.prod(value.shape), loc=(*loc, "shape"), max_elements=max_elements)
    tensor = _from_list(
        value.data, value.dtype, value.shape, loc=loc, role=role, max_elements=max_elements
    )
    return Decoded(tensor, "json")


def _as_array(data: Any, *, loc: Loc) -> npt.NDArray[Any]:
    try:
        arr = data.as_array() if isinstance(data, NumberArray) else np.asarray(data)
    except ValueError:
        # numpy refuses inhomogeneous nested sequences with ValueError (and so does a
        # NumberArray read from one); nothing else in a parsed JSON value can make it raise it.
        raise _invalid(
            loc, "ragged nested list: every row must have the same length", "ragged"
        ) from None
    if arr.ndim > MAX_RANK:
        raise _invalid(loc, f"rank {arr.ndim} exceeds the maximum of {MAX_RANK}", "rank")
    return arr


def _leaves(data: list[Any], ndim: int) -> Iterator[Any]:
    """The leaves of a regular nested list of `ndim` levels, row-major."""
    leaves: Iterator[Any] = iter(data)
    for _ in range(ndim - 1):
        leaves = chain.from_iterable(leaves)
    return leaves


def refuse_booleans_among_numbers(
    data: Any, arr: npt.NDArray[Any], *, error: Callable[[], InvalidRequest]
) -> None:
    """Raise error() when the nested list `data`, which numpy read as the numbers `arr`, holds a
    boolean. numpy reads [1.0, true] as [1.0, 1.0] (and [1, true] as [1, 1]), but JSON's true
    is no number: v1 and v2 both refuse it in numeric data, as they refuse a list of booleans
    alone. Costs a look at each leaf's type; only numeric arrays read from lists pay it (a
    NumberArray knows whether it holds one)."""
    if not (arr.size and arr.dtype.kind in "iuf"):
        return
    if isinstance(data, NumberArray):
        booleans = data.booleans
    elif isinstance(data, list):
        booleans = bool in leaf_types(_leaves(data, arr.ndim))
    else:
        return
    if booleans:
        raise error()


def _from_list(
    data: Any,
    dtype: str | None,
    shape: Sequence[int] | None,
    *,
    loc: Loc,
    role: Role,
    max_elements: int,
) -> torch.Tensor:
    data_loc = loc if dtype is None else (*loc, "data")
    arr = _as_array(data, loc=data_loc)
    _check_elements(arr.size, loc=data_loc, max_elements=max_elements)
    kind = arr.dtype.kind
    if dtype is None:  # a bare list: bool leaves make a bool tensor, numbers float32
        # An empty list has no leaves to tell: it takes the role's own dtype (a key padding
        # mask's is bool, as documented), and is refused later for being empty, not for a dtype.
        bool_leaves = kind == "b" or (arr.size == 0 and role == "bool_mask")
        dtype = "bool" if bool_leaves else "float32"
        _check_role(dtype, role=role, loc=loc)
    if role == "mask" and dtype != "bool" and kind == "O":
        arr = nulls_as_minus_inf(data, arr, loc=data_loc)
        kind = arr.dtype.kind
    if arr.size and dtype == "bool" and kind != "b":
        raise _invalid(data_loc, "a bool tensor's data must hold only true/false", "type")
    if arr.size and dtype != "bool" and kind not in "iuf":
        what = "booleans" if kind == "b" else "non-numbers"
        raise _invalid(data_loc, f"data must hold only numbers, found {what}", "type")
    if dtype != "bool":
        refuse_booleans_among_numbers(
            data,
            arr,
            error=lambda: _invalid(data_loc, "data must hold only numbers, found booleans", "type"),
        )
    if shape is not None and tuple(shape) != arr.shape:
        raise _invalid(
            (*loc, "shape"),
            f"shape {list(shape)} does not match the data's shape {list(arr.shape)}",
            "shape",
        )
    if dtype == "bool":
        return torch.from_numpy(arr.astype(np.bool_, copy=False))
    # A number past the dtype's range becomes ±inf, which the finiteness check refuses (a 422
    # naming the field): numpy's "overflow encountered in cast" would only add a warning to the
    # server's log for a client's bad input.
    with np.errstate(over="ignore"):
        if dtype == "bfloat16":
            return torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(arr.astype(_DTYPES[dtype].wire.newbyteorder("="), copy=False))


def nulls_as_minus_inf(data: Any, arr: npt.NDArray[Any], *, loc: Loc) -> npt.NDArray[Any]:
    """A float attn_mask's null entries as -inf (JSON has no infinity; responses write -inf as
    null too): `arr` is np.asarray(data), an object array. Only numbers may sit beside them:
    anything else is refused as such."""
    values = data.minus_inf() if isinstance(data, NumberArray) else minus_inf_of(arr)
    if isinstance(values, str) and values == "types":
        raise _invalid(
            loc, "a float mask's data holds numbers, and null for -inf (not visible)", "type"
        )
    if isinstance(values, str):  # an integer beyond float64's range
        raise _invalid(loc, "a number in the mask is beyond the float64 range", "type")
    return values


def _from_b64(
    b64: str, dtype: str, shape: Sequence[int], *, loc: Loc, max_elements: int
) -> torch.Tensor:
    count = math.prod(shape)
    # Bound the shape's extent, not just its element count: [0, 2**70] holds no element but
    # numpy cannot even describe it. Zero dimensions count as 1 here; empty tensors are refused
    # later with their own message.
    _check_elements(
        math.prod(max(dim, 1) for dim in shape), loc=(*loc, "shape"), max_elements=max_elements
    )
    spec = _DTYPES[dtype]
    try:
        raw = _b64decode(b64)
    except binascii.Error:
        raise _invalid((*loc, "b64"), "not valid base64 (RFC 4648, with padding)", "b64") from None
    expected = count * spec.wire.itemsize
    if len(raw) != expected:
        raise _invalid(
            (*loc, "b64"),
            f"decodes to {len(raw)} bytes; shape {list(shape)} of {dtype} needs {expected}",
            "b64.length",
        )
    arr = np.frombuffer(raw, dtype=spec.wire).reshape(shape)
    arr = arr.astype(spec.wire.newbyteorder("="), copy=False)  # a no-op on little-endian hosts
    if dtype == "bool":
        if arr.size and int(arr.max()) > 1:
            raise _invalid((*loc, "b64"), "bool bytes must be 0 or 1", "b64.bool")
        return torch.from_numpy(arr.view(np.bool_))
    tensor = torch.from_numpy(arr)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def _b64decode(text: str) -> bytearray:
    """Strict base64 (no whitespace, padding required) into a writable buffer, which torch may
    own without a copy (torch.from_numpy warns on read-only memory)."""
    if not text.isascii():
        # Checked first: decoders differ in how they refuse other characters (pybase64 1.5
        # raises a bare ValueError for some), and base64 is ASCII by definition.
        raise binascii.Error("non-ASCII character")
    if pybase64 is not None:
        return pybase64.b64decode_as_bytearray(text, validate=True)
    return bytearray(binascii.a2b_base64(text, strict_mode=True))


def _b64encode(buffer: memoryview) -> str:
    if pybase64 is not None:
        return pybase64.b64encode(buffer).decode("ascii")
    return base64.b64encode(buffer).decode("ascii")


def decode_int_list(
    value: list[Any] | NumberArray | int, *, loc: Loc, max_elements: int
) -> torch.Tensor:
    """key_lengths: a nested list of integers (or one integer) as int64."""
    arr = _as_array(value, loc=loc)
    _check_elements(arr.size, loc=loc, max_elements=max_elements)
    kind = arr.dtype.kind
    if arr.size and kind not in "iu":
        raise _invalid(loc, "must hold only integers", "type")
    refuse_booleans_among_numbers(
        value, arr, error=lambda: _invalid(loc, "must hold only integers, found booleans", "type")
    )
    if kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        raise _invalid(loc, "integers must fit in int64", "type")
    return torch.from_numpy(arr.astype(np.int64))


# ---- encoding ------------------------------------------------------------------------------


def encode_tensor(tensor: torch.Tensor, *, encoding: EncodingName) -> dict[str, Any]:
    """A CPU tensor as {"dtype", "shape", "data" | "b64"}, in the tensor's own dtype.

    "data" holds a numpy array; dumps() writes it as nested lists.
    """
    tensor = tensor.detach().cpu().contiguous()
    spec = _BY_TORCH[tensor.dtype]
    out: dict[str, Any] = {"dtype": spec.name, "shape": list(tensor.shape)}
    if encoding == "json":
        out["data"] = to_numpy(tensor)
        return out
    bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    arr = bits.numpy().astype(spec.wire, copy=False)  # little-endian on the wire
    out["b64"] = _b64encode(arr.reshape(-1).view(np.uint8).data)
    return out


def to_numpy(tensor: torch.Tensor) -> npt.NDArray[Any] | float | int | bool:
    """A tensor as something dumps() writes as JSON: a C-contiguous numpy array (bfloat16
    widened to float32), or a Python scalar for a 0-d tensor (orjson refuses 0-d arrays, and
    np.ascontiguousarray would make them 1-d)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    if tensor.dim() == 0:
        return tensor.item()
    return np.ascontiguousarray(tensor.numpy())


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN or infinity: they travel as null."""
    return value if math.isfinite(value) else None


# ---- JSON ----------------------------------------------------------------------------------

# A request holds at most this many ':' before it is parsed. Its keys number about a hundred
# at most (v1 analyze: 9 top-level fields, 4 in each tensor object, 7 in synthetic, 2 in each
# of 32 strategies; v2: 4 top-level, 9 parameters, 6 fields in each input, 2 in each output),
# and the strings that may hold a ':' are short (32 strategy names of 64 characters, a tag of
# 64, a v2 id of 256): 2,500 at most, with margin. Parsing a body of 1,000,000 unknown fields
# (12 MB) held the GIL, and so the event loop, for 1.4 s; counted, it is refused in
# milliseconds. (Objects without keys, [{}, {}, ...], cost what nested lists cost: the decode
# estimate counts their ",".)
MAX_KEYS: Final = 4096
_KEY: Final = ord(":")


def loads_request(
    body: bytes,
    *,
    allow_inf_nan: bool = False,
    slot_of: SlotOf | None = None,
    pieces: Pieces = PIECES,
) -> Any:
    """loads() for a request body (or v2's JSON header), refused before parsing when it holds
    more than MAX_KEYS ':' (InvalidRequest, loc ["body"]). With `slot_of` (a body too costly to
    decode on the event loop: service.serving.offload), its big arrays of numbers are parsed in
    pieces, as NumberArrays where `slot_of` says a tensor stands (service.wire.json_arrays):
    the same answers, without holding the GIL for long."""
    refuse_many_keys(body)
    if slot_of is not None:
        return loads_in_pieces(body, slot_of=slot_of, allow_inf_nan=allow_inf_nan, pieces=pieces)
    return loads(body, allow_inf_nan=allow_inf_nan)


def refuse_many_keys(body: bytes) -> None:
    """Raise InvalidRequest (loc ["body"]) when `body` holds more than MAX_KEYS ':'."""
    if occurrences(body, _KEY, past=MAX_KEYS) > MAX_KEYS:
        msg = (
            f"request body holds more than {MAX_KEYS:,} ':' (its keys, or text in its strings), "
            "more than any request of this API: it carries fields that no endpoint takes"
        )
        raise InvalidRequest(msg, errors=[FieldError(loc=("body",), msg=msg, type="too_many_keys")])


def loads(body: bytes, *, allow_inf_nan: bool = False) -> Any:
    """Parse a JSON body; raises InvalidRequest (422, loc ["body"]) when it is not JSON.

    NaN and Infinity literals are refused (they are not JSON) unless `allow_inf_nan`: v2 takes
    them, since tritonclient writes a float mask's -inf that way (Python's json module does).
    Either way a non-finite number (1e999 parses as inf) is refused later where its field
    forbids it: in q, k and v as NaN/Inf, in a mask as anything but -inf.
    """
    return parse_whole(body, allow_inf_nan=allow_inf_nan)


def dumps(obj: Any) -> bytes:
    """Serialize a response body; numpy arrays become nested lists, non-finite floats null."""
    if orjson is not None:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(obj, default=_json_default, allow_nan=False, separators=(",", ":")).encode()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "f" and not np.isfinite(obj).all():
            boxed = obj.astype(object)
            boxed[~np.isfinite(obj)] = None
            return boxed.tolist()
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
