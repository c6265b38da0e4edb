"""The client against the service's own app, in process (the client's httpx transport is the
app's ASGI test transport): what it reads back equals sdpa_core called directly."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from sdpa_client import SDPAClient
from sdpa_core import attention
from tests.support.app import in_process_client, small_settings


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    with in_process_client(small_settings()) as client:
        yield client


@pytest.mark.parametrize("encoding", ["json", "base64"])
def test_a_2d_request_reads_back_its_per_head_statistics(
    app_client: TestClient, encoding: str
) -> None:
    """A 2-D q is one head with no head dim: the server sends each per-head statistic as a
    number, and the client gives it back as a 0-d array."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((5, 4)).astype(np.float32) for _ in range(3))
    with SDPAClient("http://testserver", transport=app_client._transport) as client:
        got = client.attention(q, k, v, causal=True, diagnostics="full", encoding=encoding)
    want = attention(*(torch.from_numpy(x) for x in (q, k, v)), causal=True, diagnostics="full")
    assert want.diagnostics is not None
    assert got.diagnostics is not None
    np.testing.assert_allclose(got.output, want.output.numpy(), rtol=1e-5, atol=1e-6)
    for name, tensor in want.diagnostics.per_head.as_dict().items():
        value = got.diagnostics.per_head[name]
        assert value.shape == (), name
        assert math.isclose(float(value), float(tensor), rel_tol=1e-5, abs_tol=1e-6), name
    assert got.diagnostics.per_row is not None
    assert got.diagnostics.per_row["entropy"].shape == (5,)
