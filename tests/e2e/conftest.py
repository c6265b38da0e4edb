"""Shared e2e fixtures: one real `sdpa-service serve` per worker for the API tests, and wire
helpers written with numpy and base64 only (independent of service.codec, which they check).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.support.live_server import LiveServer, live_server

# Small limits so that the limit cases (and schema-generated requests) stay cheap.
API_SERVER_ENV: dict[str, str] = {
    "SDPA_DEVICE": "cpu",
    "SDPA_MAX_BODY_BYTES": str(1 << 20),
    "SDPA_MAX_ELEMENTS": str(1 << 16),
    "SDPA_MAX_WEIGHTS_ELEMENTS": str(1 << 16),
    "SDPA_LOG_LEVEL": "warning",
}

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


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real server on a free loopback port with the small limits of API_SERVER_ENV."""
    with live_server(API_SERVER_ENV, tmp_path=tmp_path_factory.mktemp("api_server")) as server:
        yield server


@pytest.fixture
def client(api_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_server.url, timeout=60.0) as c:
        yield c


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
