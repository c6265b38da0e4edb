"""Tensors to and from the v1 wire format, written with numpy and base64 only: independent of
service.wire.codec, which the tests check with them."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

_NUMPY = {
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.bool: "u1",
}
_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
}


def to_wire(t: torch.Tensor, encoding: str) -> Any:
    """A tensor as the wire format: "list" (bare), "data" or "b64"."""
    t = t.contiguous()
    if encoding == "list":
        return t.float().tolist() if t.dtype == torch.bfloat16 else t.tolist()
    name = _NAMES[t.dtype]
    if encoding == "data":
        data = t.float().tolist() if t.dtype == torch.bfloat16 else t.tolist()
        return {"dtype": name, "shape": list(t.shape), "data": data}
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
    else:
        raw = t.numpy().astype(_NUMPY[t.dtype]).tobytes()
    return {"dtype": name, "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}


def from_wire(obj: dict[str, Any]) -> torch.Tensor:
    """A response tensor back to torch, in its wire dtype."""
    name, shape = obj["dtype"], obj["shape"]
    dtype = next(d for d, n in _NAMES.items() if n == name)
    if "b64" in obj:
        raw = base64.b64decode(obj["b64"], validate=True)
        if dtype == torch.bfloat16:
            bits = np.frombuffer(raw, dtype="<i2").astype(np.int16).reshape(shape)
            return torch.from_numpy(bits.copy()).view(torch.bfloat16)
        arr = np.frombuffer(raw, dtype=_NUMPY[dtype]).reshape(shape)
        return torch.from_numpy(arr.astype(_NUMPY[dtype][1:]))
    # JSON lists: null stands for a non-finite value.
    arr = np.asarray(obj["data"], dtype=np.float64 if dtype != torch.bool else np.bool_)
    return torch.from_numpy(arr.reshape(shape)).to(dtype)
