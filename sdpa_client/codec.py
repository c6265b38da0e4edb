"""Tensors on the wire: numpy arrays (or torch tensors) to JSON objects and back.

A tensor travels as {"dtype", "shape", "b64"} (little-endian row-major bytes, base64) or
{"dtype", "shape", "data"} (nested lists); dtype is float16 | bfloat16 | float32 | float64, or
bool for masks. This module needs numpy only. It never imports torch: a torch tensor is
recognized through ``sys.modules["torch"]``, so only a caller who already imported torch can pass
one, and a numpy-only caller does not pay for it. numpy has no bfloat16: a bfloat16 torch tensor
travels as its raw 16-bit patterns, and a bfloat16 answer is decoded to float32 (every bfloat16
value is exactly a float32 value). Arrays decoded from base64 are read-only views of the answer's
bytes (``np.array(a)`` gives a writable copy).
"""

from __future__ import annotations

import base64
import importlib
import json
import math
import sys
import uuid
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from sdpa_client.errors import SDPAProtocolError

try:  # SIMD base64 (the server's own dependency), 20-30x the standard library's speed on tensors
    # of megabytes: what a tap sending every layer of a model spends most of its time on. Optional:
    # the standard library gives the same bytes.
    _simd_base64: Any = importlib.import_module("pybase64")
except ImportError:
    _simd_base64 = None


def _b64encode(raw: bytes) -> str:
    if _simd_base64 is not None:
        return str(_simd_base64.b64encode_as_string(raw))
    return base64.b64encode(raw).decode("ascii")


def _b64decode(data: str) -> bytes:
    """Strict: a character outside the alphabet is a ValueError (binascii.Error)."""
    if _simd_base64 is not None:
        return bytes(_simd_base64.b64decode(data, validate=True))
    return base64.b64decode(data, validate=True)


Encoding: TypeAlias = Literal["base64", "json"]
AnyArray: TypeAlias = npt.NDArray[Any]

# Wire dtype name -> little-endian numpy dtype. bfloat16 is handled apart (numpy has none).
_WIRE_TO_NUMPY: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bool": np.dtype("|b1"),
}


def torch_module() -> Any | None:
    """torch, when the caller already imported it; importing it here would cost seconds."""
    return sys.modules.get("torch")


def is_torch_tensor(x: object) -> bool:
    """Whether `x` is a torch tensor (False whenever torch was never imported)."""
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(x: object, *, param: str) -> tuple[str, AnyArray]:
    """(wire dtype, numpy array) for a tensor argument; for "bfloat16" the raw uint16 bits.

    Raises:
        TypeError: a dtype the wire cannot carry.
    """
    if is_torch_tensor(x):
        torch = torch_module()
        assert torch is not None
        t = x.detach()  # type: ignore[attr-defined]
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            # Reinterpret, not convert: the bits of each bfloat16 are sent unchanged.
            return "bfloat16", t.view(torch.int16).numpy().view(np.uint16)
        arr = t.resolve_conj().resolve_neg().numpy()
    elif isinstance(x, np.ndarray):
        arr = x
    else:
        # Plain (nested) lists or scalars: numbers as float32 and booleans as bool, as the
        # server reads a bare list.
        arr = np.asarray(x)
        if arr.dtype != np.bool_:
            arr = arr.astype("float32")
    if arr.dtype.name not in _WIRE_TO_NUMPY:
        raise TypeError(
            f"{param}: dtype {arr.dtype} cannot be sent; use float16, float32, float64 "
            "(or bool for masks), or a bfloat16 torch tensor"
        )
    return arr.dtype.name, arr


def encode_tensor(
    x: object, *, encoding: Encoding = "base64", param: str = "tensor"
) -> dict[str, Any]:
    """The wire object of one tensor.

    Args:
        x: a numpy array, a torch tensor (when torch is imported) or nested lists.
        encoding: "base64" for {"dtype", "shape", "b64"}, "json" for {"dtype", "shape", "data"}.
        param: the argument's name, for error messages.

    Returns:
        The JSON-ready object.

    Raises:
        TypeError: a dtype the wire cannot carry (integers, complex, ...).
        ValueError: an unknown encoding.
    """
    wire, arr = to_numpy(x, param=param)
    shape = [int(s) for s in arr.shape]
    if encoding == "base64":
        little_endian = np.dtype("<u2") if wire == "bfloat16" else _WIRE_TO_NUMPY[wire]
        raw = np.ascontiguousarray(arr, dtype=little_endian).tobytes()
        return {"dtype": wire, "shape": shape, "b64": _b64encode(raw)}
    if encoding == "json":
        floats = _bf16_bits_to_float32(arr) if wire == "bfloat16" else arr
        if floats.dtype.kind == "f" and np.isneginf(floats).any():
            # JSON has no -inf (json.dumps would write -Infinity, which the server refuses): the
            # server reads null as -inf, "not visible" in a float mask.
            obj = floats.astype(object)
            obj[np.isneginf(floats)] = None
            return {"dtype": wire, "shape": shape, "data": obj.tolist()}
        return {"dtype": wire, "shape": shape, "data": floats.tolist()}
    raise ValueError(f"encoding must be 'base64' or 'json', got {encoding!r}")


def _bf16_bits_to_float32(bits: AnyArray) -> npt.NDArray[np.float32]:
    # A bfloat16 is the top half of a float32: shift the 16 bits into place.
    widened = bits.astype(np.uint32) << np.uint32(16)
    return widened.view(np.float32)


def decode_tensor(obj: object, *, param: str = "tensor", null_as: float = math.nan) -> AnyArray:
    """A numpy array from a wire tensor.

    Args:
        obj: a {"dtype", "shape", "b64"} or {"dtype", "shape", "data"} object, or bare lists.
        param: the field's name, for error messages.
        null_as: the value of a JSON null in lists (the lists encoding of a non-finite number).

    Returns:
        The array; bfloat16 comes back as float32, and base64 gives a read-only view.

    Raises:
        SDPAProtocolError: the object is not a tensor this client can read.
    """
    arr: AnyArray
    if isinstance(obj, list):
        return _replace_nan(np.array(obj, dtype=np.float64), null_as)
    if not isinstance(obj, dict):
        raise SDPAProtocolError(None, "Malformed response", f"{param}: not a tensor object")
    try:
        dtype = str(obj["dtype"])
        shape = tuple(int(s) for s in obj["shape"]) if obj.get("shape") is not None else None
        if "b64" in obj:
            raw = _b64decode(obj["b64"])
            if dtype == "bfloat16":
                arr = _bf16_bits_to_float32(np.frombuffer(raw, dtype="<u2"))
            else:
                arr = np.frombuffer(raw, dtype=_WIRE_TO_NUMPY[dtype])
            if shape is None:
                raise KeyError("shape")
            return arr.reshape(shape)
        np_dtype: Any = np.float32 if dtype == "bfloat16" else _WIRE_TO_NUMPY[dtype]
        arr = np.array(obj["data"], dtype=np_dtype)
        if shape is not None:
            arr = arr.reshape(shape)
        return _replace_nan(arr, null_as)
    except (KeyError, ValueError, TypeError) as exc:
        raise SDPAProtocolError(
            None, "Malformed response", f"{param}: cannot decode tensor ({exc!r})"
        ) from exc


def _replace_nan(arr: AnyArray, value: float) -> AnyArray:
    if not math.isnan(value) and arr.dtype.kind == "f":
        arr = np.where(np.isnan(arr), np.asarray(value, dtype=arr.dtype), arr)
    return arr


# Below this, a b64 string goes through json.dumps like any other value.
_SPLICE_MIN_CHARS = 4096


def encode_body(body: Mapping[str, Any]) -> bytes:
    """A request body as compact JSON bytes, exactly as ``json.dumps(body, separators=(",", ":"))``.

    NaN and Infinity pass through, so that the server answers them with its 422. Large base64
    strings are spliced in as bytes instead of going through json.dumps, which scans every
    character for escapes (base64 has none): for an 8 MiB body that is about two thirds of the
    encoding time.

    Args:
        body: the JSON object (tensors already encoded by `encode_tensor`).

    Returns:
        UTF-8 JSON bytes.
    """
    blobs: list[bytes] = []
    marker = f"@splice-{uuid.uuid4().hex}@"

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            b64 = value.get("b64")
            if isinstance(b64, str) and len(b64) >= _SPLICE_MIN_CHARS:
                blobs.append(b64.encode("ascii"))
                return {**value, "b64": f"{marker}{len(blobs) - 1}{marker}"}
            return {k: swap(v) for k, v in value.items()}
        return value

    skeleton = json.dumps({k: swap(v) for k, v in body.items()}, separators=(",", ":"))
    if not blobs:
        return skeleton.encode("utf-8")
    # "text@m@0@m@text@m@1@m@text": even parts are JSON text, odd parts blob indices.
    parts = skeleton.split(marker)
    return b"".join(blobs[int(p)] if i % 2 else p.encode("utf-8") for i, p in enumerate(parts))
