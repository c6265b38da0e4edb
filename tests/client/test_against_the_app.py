"""The client against the service's own app, in process (the client's httpx transport hands each
request to the app's test client): what it reads back equals sdpa_core called directly, and the
two protocols give the same result."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from sdpa_client import SDPAClient
from sdpa_client.calls import Protocol
from sdpa_client.fields import PER_HEAD_STAT_NAMES
from sdpa_core import attention
from tests.support.app import app_transport, in_process_client, small_settings


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    with in_process_client(small_settings()) as client:
        yield client


def sdpa_client(app_client: TestClient, protocol: Protocol = "v1") -> SDPAClient:
    return SDPAClient("http://testserver", transport=app_transport(app_client), protocol=protocol)


@pytest.mark.parametrize("encoding", ["json", "base64"])
def test_a_2d_request_reads_back_its_per_head_statistics(
    app_client: TestClient, encoding: str
) -> None:
    """A 2-D q is one head with no head dim: the server sends each per-head statistic as a
    number, and the client gives it back as a 0-d array."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((5, 4)).astype(np.float32) for _ in range(3))
    with sdpa_client(app_client) as client:
        got = client.attention(q, k, v, causal=True, diagnostics="full", encoding=encoding)
    want = attention(*(torch.from_numpy(x) for x in (q, k, v)), causal=True, diagnostics="full")
    assert want.diagnostics is not None
    assert got.diagnostics is not None
    assert got.output is not None
    np.testing.assert_allclose(got.output, want.output.numpy(), rtol=1e-5, atol=1e-6)
    for name, tensor in want.diagnostics.per_head.as_dict().items():
        value = got.diagnostics.per_head[name]
        assert value.shape == (), name
        assert math.isclose(float(value), float(tensor), rel_tol=1e-5, abs_tol=1e-6), name
    assert got.diagnostics.per_row is not None
    assert got.diagnostics.per_row["entropy"].shape == (5,)


@pytest.mark.parametrize("encoding", ["json", "base64"], ids=["json", "binary"])
@pytest.mark.parametrize("diagnostics", ["summary", "full"])
def test_v2_reads_back_the_per_head_statistics_v1_does(
    app_client: TestClient, diagnostics: str, encoding: str
) -> None:
    """The same request on both protocols: v2's per_head (from its "<stat>_per_head" outputs,
    float32) equals v1's (JSON numbers of float64 statistics) to float32 rounding, name for name
    and shape for shape; without return_output neither answer has an output, and the
    diagnostics are those of the answer that has one."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 3, 7, 8)).astype(np.float32) for _ in range(2))
    options = {"key_lengths": [7, 0], "diagnostics": diagnostics, "encoding": encoding}
    with sdpa_client(app_client) as v1, sdpa_client(app_client, "v2") as v2:
        whole = v1.attention(q, k, v, **options)  # type: ignore[arg-type]
        by_v1 = v1.attention(q, k, v, return_output=False, **options)  # type: ignore[arg-type]
        by_v2 = v2.attention(q, k, v, return_output=False, **options)  # type: ignore[arg-type]
    assert whole.output is not None
    assert by_v1.output is None
    assert by_v2.output is None
    for got in (by_v1, by_v2):
        assert whole.diagnostics is not None
        assert got.diagnostics is not None
        assert dict(got.diagnostics.summary) == pytest.approx(dict(whole.diagnostics.summary))
        assert set(got.diagnostics.per_head) == set(PER_HEAD_STAT_NAMES)
        for name, want in whole.diagnostics.per_head.items():
            value = got.diagnostics.per_head[name]
            assert value.shape == (2, 3), name
            if name == "masked_rows":
                assert value.dtype == np.int64
                np.testing.assert_array_equal(value, want)
                np.testing.assert_array_equal(value, [[0, 0, 0], [6, 6, 6]])  # sequence 1: none
            else:
                np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-6, err_msg=name)
        assert (got.diagnostics.per_row is None) == (diagnostics == "summary")


def test_a_float_mask_with_minus_infinity_travels_as_json_too(app_client: TestClient) -> None:
    """JSON has no -inf: the client writes null, which the server reads as -inf (not visible);
    the answer equals the base64 one, and a row that sees one key puts all its weight there."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 4, 8)).astype(np.float32) for _ in range(3))
    mask = np.zeros((4, 4), dtype=np.float32)
    mask[0, 1:] = -np.inf
    with sdpa_client(app_client) as client:
        as_json = client.attention(q, k, v, attn_mask=mask, encoding="json", return_weights=True)
        as_b64 = client.attention(q, k, v, attn_mask=mask, encoding="base64", return_weights=True)
    assert as_json.weights is not None
    assert as_b64.weights is not None
    np.testing.assert_allclose(as_json.weights, as_b64.weights, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(as_json.weights[0, :, 0], [[1, 0, 0, 0]] * 2)
