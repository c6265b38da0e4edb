"""sdpa_client with protocol="v2" (the Open Inference Protocol, binary tensor data by default)
against a real `sdpa-service serve` on loopback: the cases of the tritonclient tests
(tests.support.v2_cases), checked against the float64 reference, through the blocking and the
asyncio client. An API key is configured, so every call also goes through auth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sdpa_client import AsyncSDPAClient, SDPAClient, SDPAValidationError
from tests.support.app import API_SERVER_ENV
from tests.support.live_server import LiveServer, live_server
from tests.support.v2_cases import (
    FLOAT_DATATYPES,
    Case,
    assert_close,
    expected,
    make_case,
    mask_cases,
)

pytestmark = pytest.mark.xdist_group("v2-sdpa-client")

API_KEY = "v2-sdpa-client-key"
MASK_CASES = mask_cases()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {**API_SERVER_ENV, "SDPA_API_KEYS": API_KEY}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("v2-client")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[SDPAClient]:
    with SDPAClient(server.url, api_key=API_KEY, protocol="v2") as c:
        yield c


def call(client: SDPAClient, case: Case, **kw: Any) -> Any:
    options = {
        "causal": case.causal,
        "key_lengths": case.key_lengths,
        "key_padding_mask": case.key_padding_mask,
        "attn_mask": case.attn_mask,
        "scale": case.scale,
        "temperature": case.temperature,
        **kw,
    }
    return client.attention(case.q, case.k, case.v, **options)


def _as_torch_bf16(case: Case) -> Case:
    # sdpa_client sends BF16 from torch tensors only (numpy has no bfloat16): the test turns
    # ml_dtypes' bfloat16 arrays into torch bfloat16 tensors of the same bits.
    torch = pytest.importorskip("torch")
    for name in ("q", "k", "v"):
        bits = getattr(case, name).view(np.int16)
        setattr(case, name, torch.from_numpy(bits.copy()).view(torch.bfloat16))
    return case


@pytest.mark.parametrize("encoding", ["base64", "json"], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", FLOAT_DATATYPES)
def test_every_datatype(client: SDPAClient, datatype: str, encoding: str) -> None:
    case = make_case((2, 2, 5, 8), datatype=datatype, causal=True)
    want = expected(case)  # from the arrays before any conversion to torch
    if datatype == "BF16":
        case = _as_torch_bf16(case)
        if encoding == "json":  # BF16 travels only as binary data: refused before sending
            with pytest.raises(TypeError, match="binary"):
                call(client, case, encoding=encoding)
            return
    result = call(client, case, diagnostics="full", encoding=encoding)
    assert_close(result.output, want.output, datatype)
    assert result.meta.path == "chunked"
    np.testing.assert_allclose(result.diagnostics.per_row["lse"], want.rows.lse, atol=1e-3)


@pytest.mark.parametrize("encoding", ["base64", "json"], ids=["binary", "json"])
@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_mask_options(client: SDPAClient, name: str, encoding: str) -> None:
    case = MASK_CASES[name]
    # A float mask's -inf travels as null in JSON: the client writes it so.
    result = call(client, case, return_weights=True, diagnostics="full", encoding=encoding)
    want = expected(case)
    assert_close(result.output, want.output, "FP32")
    assert result.weights is not None
    assert_close(result.weights, want.weights, "FP32")
    rows = result.diagnostics.per_row
    np.testing.assert_array_equal(rows["visible_keys"], want.rows.visible_keys)
    assert rows["visible_keys"].dtype == np.int64
    np.testing.assert_allclose(rows["entropy"], want.rows.entropy, atol=1e-4)
    masked = want.rows.visible_keys == 0
    assert np.isneginf(rows["lse"][masked]).all()  # -inf in binary, null in JSON: both -inf
    np.testing.assert_allclose(rows["lse"][~masked], want.rows.lse[~masked], atol=1e-4)
    summary = result.diagnostics.summary
    assert summary.masked_rows == int(masked.sum())
    active = ~masked
    if active.any():
        assert summary.entropy == pytest.approx(want.rows.entropy[active].mean(), abs=1e-5)


def per_head_mean(rows: np.ndarray, visible_keys: np.ndarray) -> np.ndarray:
    """The mean of a per-row statistic [B, H, N_q] over each head's rows that see a key (0 for
    a head that sees none): the per-head statistic, from the float64 reference."""
    active = visible_keys > 0
    count = active.sum(-1)
    return np.where(count > 0, (rows * active).sum(-1) / np.maximum(count, 1), 0.0)


@pytest.mark.parametrize("encoding", ["base64", "json"], ids=["binary", "json"])
@pytest.mark.parametrize("name", ["fully_masked", "gqa", "attn_mask_float"])
def test_diagnostics_alone_with_the_per_head_statistics(
    client: SDPAClient, server: LiveServer, name: str, encoding: str
) -> None:
    """return_output=False with diagnostics "summary": no output comes back; per_head holds
    every per-head statistic [B, H], the float64 reference's where it is written in the test
    (mean row entropy and max weight, masked rows per head), and the v1 client's for the same
    request to float32 rounding."""
    case = MASK_CASES[name]
    result = call(client, case, diagnostics="summary", return_output=False, encoding=encoding)
    assert result.output is None
    assert result.diagnostics is not None
    per_head = result.diagnostics.per_head
    rows = expected(case).rows
    b, h = rows.visible_keys.shape[:2]
    assert {value.shape for value in per_head.values()} == {(b, h)}
    np.testing.assert_allclose(
        per_head["entropy"], per_head_mean(rows.entropy, rows.visible_keys), atol=1e-5
    )
    np.testing.assert_allclose(
        per_head["max_weight"], per_head_mean(rows.max_weight, rows.visible_keys), atol=1e-5
    )
    assert per_head["masked_rows"].dtype == np.int64
    np.testing.assert_array_equal(per_head["masked_rows"], (rows.visible_keys == 0).sum(-1))
    with SDPAClient(server.url, api_key=API_KEY) as v1:
        # base64: the v1 client writes a float mask's -inf in JSON lists as -Infinity, which
        # the server refuses (JSON has none); v1's lists want null there.
        by_v1 = call(v1, case, diagnostics="summary", return_output=False, encoding="base64")
    assert by_v1.output is None
    assert by_v1.diagnostics is not None
    assert set(by_v1.diagnostics.per_head) == set(per_head)
    for stat, want in by_v1.diagnostics.per_head.items():
        np.testing.assert_allclose(per_head[stat], want, rtol=1e-6, atol=1e-6, err_msg=stat)


def test_bad_requests_name_the_input(client: SDPAClient) -> None:
    for case, words in [
        (make_case((1, 2, 4, 8), (1, 2, 4, 4)), "input 'k'"),
        (make_case((1, 2, 4, 8), key_lengths=np.array([9])), "input 'key_lengths'"),
        (make_case((1, 2, 4, 8), scale=0.1, temperature=2.0), "'temperature'"),
    ]:
        with pytest.raises(SDPAValidationError) as info:
            call(client, case)
        assert info.value.status == 400
        assert words in str(info.value)
    ok = make_case((1, 2, 4, 8))
    assert_close(call(client, ok).output, expected(ok).output, "FP32")


def test_concurrent_mixed_lengths_through_the_async_client(server: LiveServer) -> None:
    rng = np.random.default_rng(99)
    cases = [
        make_case(
            (1, 2, int(rng.integers(1, 17)), 8), (1, 2, int(rng.integers(1, 17)), 8), seed=i,
            causal="bottom_right" if i % 2 else False,
        )
        for i in range(100)
    ]  # fmt: skip

    async def run_all() -> list[Any]:
        async with AsyncSDPAClient(server.url, api_key=API_KEY, protocol="v2") as c:
            return await asyncio.gather(
                *(c.attention(x.q, x.k, x.v, causal=x.causal, diagnostics="none") for x in cases)
            )

    results = asyncio.run(run_all())
    for case, result in zip(cases, results, strict=True):
        assert_close(result.output, expected(case).output, "FP32")
        assert result.diagnostics is None
