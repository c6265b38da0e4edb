"""sdpa_client against a real `sdpa-service serve` on loopback.

The truth is sdpa_core itself, called in the test on the same inputs: the client's decoded
numpy arrays must equal what the library computes in-process (and both are checked against a
float64 formula in tests/core). An API key is configured, so every call also goes through auth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from sdpa_client import (
    AsyncSDPAClient,
    SDPAAuthError,
    SDPAClient,
    SDPAValidationError,
    SummaryStats,
)
from sdpa_core import analyze_scaling, attention, make_synthetic_qk
from tests.support.live_server import LiveServer, live_server

pytestmark = pytest.mark.xdist_group("client-live")

API_KEY = "client-live-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_API_KEYS": API_KEY}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("client-live")) as srv:
        yield srv


@pytest.fixture
def client(server: LiveServer) -> Iterator[SDPAClient]:
    with SDPAClient(server.url, api_key=API_KEY) as c:
        yield c


def qkv(shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    return q, k, v


def torch_of(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(a) for a in arrays]


@pytest.mark.parametrize("encoding", ["base64", "json"])
def test_attention_equals_sdpa_core(client: SDPAClient, encoding: str) -> None:
    q, k, v = qkv((2, 4, 16, 8))
    # The second sequence has no visible key at all: output 0, lse -inf, counted masked rows.
    lengths = [11, 0]
    result = client.attention(
        q, k, v, causal=True, key_lengths=lengths, return_weights=True, diagnostics="full",
        encoding=encoding,  # type: ignore[arg-type]
    )  # fmt: skip
    ref = attention(
        *torch_of(q, k, v), causal=True, key_lengths=torch.tensor(lengths), return_weights=True,
        diagnostics="full",
    )  # fmt: skip
    assert result.output.dtype == np.float32
    # Same library, same inputs, a batch of one on the same device: the same float32 values.
    np.testing.assert_allclose(result.output, ref.output.numpy(), rtol=1e-6, atol=1e-7)
    assert result.weights is not None
    assert ref.weights is not None
    np.testing.assert_allclose(result.weights, ref.weights.numpy(), rtol=1e-6, atol=1e-7)
    assert not result.output[1].any()

    assert result.diagnostics is not None
    assert ref.diagnostics is not None
    summary = result.diagnostics.summary
    assert isinstance(summary, SummaryStats)
    for name, expected in ref.diagnostics.summary.as_dict().items():
        assert getattr(summary, name) == pytest.approx(expected, rel=1e-6, abs=1e-9), name
    assert summary.masked_rows == 4 * 16
    per_row = result.diagnostics.per_row
    assert per_row is not None
    assert ref.diagnostics.per_row is not None
    for name, expected in ref.diagnostics.per_row.as_dict().items():
        np.testing.assert_allclose(per_row[name], np.asarray(expected), rtol=1e-6, err_msg=name)
    assert np.all(per_row["lse"][1] == -np.inf)
    for name, expected in ref.diagnostics.per_head.as_dict().items():
        np.testing.assert_allclose(
            result.diagnostics.per_head[name], np.asarray(expected), rtol=1e-6, err_msg=name
        )
    assert result.meta.path == ref.path
    assert result.meta.dtype == "float32"
    assert result.meta.device == "cpu"
    assert result.meta.request_id


@pytest.mark.parametrize("encoding", ["base64", "json"])
def test_diagnostics_without_the_output(client: SDPAClient, encoding: str) -> None:
    """return_output=False: the answer has no output, and its diagnostics are sdpa_core's."""
    q, k, v = qkv((2, 3, 12, 8), seed=4)
    result = client.attention(
        q, k, v, causal="bottom_right", diagnostics="summary", return_output=False,
        encoding=encoding,  # type: ignore[arg-type]
    )  # fmt: skip
    ref = attention(*torch_of(q, k, v), causal="bottom_right", diagnostics="summary")
    assert result.output is None
    assert result.diagnostics is not None
    assert ref.diagnostics is not None
    assert result.diagnostics.per_row is None
    # The server may run another path than this process (the flash kernel, which its warm-up
    # built): float32 sums in another order. A mean of O(1) scores near 0 (0.036) then differs
    # by a few float32 ulps of the scores, so the tolerance is absolute as well as relative.
    for name, expected in ref.diagnostics.summary.as_dict().items():
        assert result.diagnostics.summary[name] == pytest.approx(expected, rel=1e-6, abs=1e-6), name
    for name, expected in ref.diagnostics.per_head.as_dict().items():
        np.testing.assert_allclose(
            result.diagnostics.per_head[name],
            np.asarray(expected),
            rtol=1e-6,
            atol=1e-6,
            err_msg=name,
        )


def test_torch_bfloat16_in_float32_out(client: SDPAClient) -> None:
    q, k, v = (t.to(torch.bfloat16) for t in torch_of(*qkv((1, 2, 8, 16), seed=3)))
    result = client.attention(q, k, v, diagnostics="none")
    ref = attention(q, k, v)
    assert result.meta.dtype == "bfloat16"
    assert result.output.dtype == np.float32
    np.testing.assert_array_equal(result.output, ref.output.float().numpy())


def test_analyze_synthetic_equals_sdpa_core(client: SDPAClient) -> None:
    report = client.analyze(
        synthetic={"n_q": 32, "n_k": 48, "d_k": 256, "std": 1.0, "seed": 5},
        strategies=["none", "sqrt_dk", ("temp_4", 4.0)],
    )
    q, k = make_synthetic_qk(n_q=32, n_k=48, d_k=256, std=1.0, seed=5)
    ref = analyze_scaling(q, k, strategies=["none", "sqrt_dk", ("temp_4", 4.0)])
    assert report.d_k == ref.d_k == 256
    assert report.recommended_divisor == pytest.approx(ref.recommended_divisor, rel=1e-9)
    assert [s.name for s in report.strategies] == [s.name for s in ref.strategies]
    for got, want in zip(report.strategies, ref.strategies, strict=True):
        assert got.divisor == pytest.approx(want.divisor)
        assert got.entropy == pytest.approx(want.entropy, rel=1e-9)
        assert got.score_variance == pytest.approx(want.score_variance, rel=1e-9)


def test_async_client_concurrent_calls(server: LiveServer) -> None:
    inputs = [qkv((1, 2, 8 + i, 8), seed=i) for i in range(6)]

    async def run() -> list[np.ndarray]:
        async with AsyncSDPAClient(server.url, api_key=API_KEY) as c:
            results = await asyncio.gather(*(c.attention(*x, diagnostics="none") for x in inputs))
        return [r.output for r in results]

    for out, x in zip(asyncio.run(run()), inputs, strict=True):
        ref = attention(*torch_of(*x)).output.numpy()
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_errors_and_probes(server: LiveServer, client: SDPAClient) -> None:
    q, k, v = qkv((1, 2, 4, 8))
    with pytest.raises(SDPAValidationError) as ei:
        client.attention(q, k[..., :4], v)
    err = ei.value
    assert err.status == 422
    assert err.errors
    assert err.errors[0].loc[:2] == ("body", "k")
    assert err.attempts == 1

    with SDPAClient(server.url) as anonymous:
        assert anonymous.healthz() is True  # probes stay open without a key
        assert anonymous.readyz() is True
        with pytest.raises(SDPAAuthError) as auth:
            anonymous.attention(q, k, v)
    assert auth.value.status == 401

    info = client.info()
    assert info["device"] == "cpu"
    assert info["auth"] is True
