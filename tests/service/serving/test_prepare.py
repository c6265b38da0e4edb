"""serving.prepare: body bytes -> a PreparedJob whose tensors are the request's, checked against
values written here with numpy; every limit refused with a 422 naming the field."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from sdpa_core import SdpaError
from service.errors import InvalidRequest
from service.runtime.jobs import AnalyzeJob, AttentionJob
from service.serving.prepare import prepare_analyze, prepare_attention
from tests.support.app import small_settings

SETTINGS = small_settings()


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def b64_tensor(array: np.ndarray) -> dict[str, object]:
    raw = array.astype("<f4").tobytes()
    return {"dtype": "float32", "shape": list(array.shape), "b64": base64.b64encode(raw).decode()}


def test_a_b64_request_becomes_its_tensors_and_options() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)).astype(np.float32) for _ in range(3))
    request = prepare_attention(
        body(q=b64_tensor(q), k=b64_tensor(k), v=b64_tensor(v), causal="bottom_right",
             key_lengths=[5, 3], scale=0.25, diagnostics="full", timeout_ms=250),
        SETTINGS,
    )  # fmt: skip
    job = request.prepared.job
    assert isinstance(job, AttentionJob)
    for got, want in ((job.q, q), (job.k, k), (job.v, v)):
        assert got.dtype == torch.float32
        assert np.array_equal(got.numpy(), want)
    assert job.key_lengths is not None
    assert job.key_lengths.tolist() == [5, 3]
    assert (job.causal, job.scale, job.diagnostics) == ("bottom_right", 0.25, "full")
    spec = request.prepared.spec
    assert (spec.batch, spec.heads, spec.n_q, spec.n_kv, spec.d) == (2, 3, 5, 5, 4)
    assert spec.causal == "bottom_right"
    assert request.encoding == "base64"  # the encoding q came in
    assert request.timeout_ms == 250


def test_lists_answer_in_json_unless_asked_otherwise() -> None:
    q = [[1.0, 0.0], [0.0, 1.0]]
    assert prepare_attention(body(q=q, k=q, v=q), SETTINGS).encoding == "json"
    asked = prepare_attention(body(q=q, k=q, v=q, response_encoding="base64"), SETTINGS)
    assert asked.encoding == "base64"


def test_a_bad_tensor_is_refused_before_it_is_queued_naming_its_field() -> None:
    q = [[1.0, 0.0], [0.0, 1.0]]
    with pytest.raises(SdpaError) as raised:
        prepare_attention(body(q=q, k=[[1.0, 0.0, 0.0]], v=q), SETTINGS)
    assert raised.value.param == "k"
    nan_q = b64_tensor(np.array([[np.nan, 0.0]], dtype=np.float32))
    with pytest.raises(SdpaError) as raised:
        prepare_attention(body(q=nan_q, k=q, v=q), SETTINGS)
    assert raised.value.param == "q"


def test_weights_over_the_limit_are_a_422_that_says_how_to_stay_under() -> None:
    n = 257  # 257 x 257 = 66,049 weights > 2^16 (small_settings)
    x = np.zeros((n, 1), dtype=np.float32)
    request = body(q=b64_tensor(x), k=b64_tensor(x), v=b64_tensor(x), return_weights=True)
    with pytest.raises(InvalidRequest) as raised:
        prepare_attention(request, SETTINGS)
    (error,) = raised.value.errors
    assert error.loc == ("body", "return_weights")
    assert "66049" in error.msg
    assert "diagnostics without weights" in error.msg
    # The same request without weights fits: diagnostics stream in O(N) memory.
    without = body(q=b64_tensor(x), k=b64_tensor(x), v=b64_tensor(x), diagnostics="full")
    assert prepare_attention(without, SETTINGS).prepared.spec.n_kv == n


def test_synthetic_sizes_are_refused_by_the_limits_before_any_drawing() -> None:
    with pytest.raises(InvalidRequest) as raised:
        prepare_analyze(body(synthetic={"n_q": 512, "n_k": 512, "d_k": 4}), SETTINGS)
    assert raised.value.errors[0].loc == ("body", "synthetic")
    with pytest.raises(InvalidRequest) as raised:
        prepare_analyze(body(synthetic={"n_q": 4, "n_k": 4, "d_k": 1 << 15}), SETTINGS)
    assert raised.value.errors[0].loc == ("body", "synthetic", "n_q")


def test_an_analysis_gets_its_strategies_and_masks() -> None:
    q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    request = prepare_analyze(
        body(q=q, k=q, strategies=["dk", {"name": "mine", "divisor": 3.0}], key_lengths=2),
        SETTINGS,
    )
    job = request.prepared.job
    assert isinstance(job, AnalyzeJob)
    assert job.strategies == ("dk", ("mine", 3.0))
    assert job.key_lengths is not None
    assert job.key_lengths.tolist() == 2
    assert request.encoding == "json"
