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
from service.runtime.policy import CostModel, PathCost
from service.serving.prepare import prepare_analyze, prepare_attention
from tests.support.app import small_settings

SETTINGS = small_settings()
# A device that does 100 GFLOP/s on the fused path (head dims below 32 cost as much as 32) and
# ten times less per FLOP with weights or diagnostics, a hundred times less in the analysis.
COST = CostModel(
    {
        "fused": PathCost(1e-11, 32),
        "dense": PathCost(1e-10, 32),
        "chunked": PathCost(1e-10, 32),
        "analyze": PathCost(1e-9, 32),
    },
    calibrated=True,
)


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
        COST,
    )  # fmt: skip
    job = request.prepared.job
    assert isinstance(job, AttentionJob)
    for got, want in ((job.q, q), (job.k, k), (job.v, v)):
        assert got.dtype == torch.float32
        assert np.array_equal(got.numpy(), want)
    lengths = job.masks.key_lengths
    assert isinstance(lengths, torch.Tensor)
    assert lengths.tolist() == [5, 3]
    assert (job.masks.causal, job.scale, job.diagnostics) == ("bottom_right", 0.25, "full")
    spec = request.prepared.spec
    assert (spec.batch, spec.heads, spec.n_q, spec.n_kv, spec.d) == (2, 3, 5, 5, 4)
    assert spec.causal == "bottom_right"
    assert request.encoding == "base64"  # the encoding q came in
    assert request.timeout_ms == 250


def test_lists_answer_in_json_unless_asked_otherwise() -> None:
    q = [[1.0, 0.0], [0.0, 1.0]]
    assert prepare_attention(body(q=q, k=q, v=q), SETTINGS, COST).encoding == "json"
    asked = prepare_attention(body(q=q, k=q, v=q, response_encoding="base64"), SETTINGS, COST)
    assert asked.encoding == "base64"


def test_a_bad_tensor_is_refused_before_it_is_queued_naming_its_field() -> None:
    q = [[1.0, 0.0], [0.0, 1.0]]
    with pytest.raises(SdpaError) as raised:
        prepare_attention(body(q=q, k=[[1.0, 0.0, 0.0]], v=q), SETTINGS, COST)
    assert raised.value.param == "k"
    nan_q = b64_tensor(np.array([[np.nan, 0.0]], dtype=np.float32))
    with pytest.raises(SdpaError) as raised:
        prepare_attention(body(q=nan_q, k=q, v=q), SETTINGS, COST)
    assert raised.value.param == "q"


def test_weights_over_the_limit_are_a_422_that_says_how_to_stay_under() -> None:
    n = 257  # 257 x 257 = 66,049 weights > 2^16 (small_settings)
    x = np.zeros((n, 1), dtype=np.float32)
    request = body(q=b64_tensor(x), k=b64_tensor(x), v=b64_tensor(x), return_weights=True)
    with pytest.raises(InvalidRequest) as raised:
        prepare_attention(request, SETTINGS, COST)
    (error,) = raised.value.errors
    assert error.loc == ("body", "return_weights")
    assert "66049" in error.msg
    assert "diagnostics without weights" in error.msg
    # The same request without weights fits: diagnostics stream in O(N) memory.
    without = body(q=b64_tensor(x), k=b64_tensor(x), v=b64_tensor(x), diagnostics="full")
    assert prepare_attention(without, SETTINGS, COST).prepared.spec.n_kv == n


def test_synthetic_sizes_are_refused_by_the_limits_before_any_drawing() -> None:
    with pytest.raises(InvalidRequest) as raised:
        prepare_analyze(body(synthetic={"n_q": 512, "n_k": 512, "d_k": 4}), SETTINGS, COST)
    assert raised.value.errors[0].loc == ("body", "synthetic")
    with pytest.raises(InvalidRequest) as raised:
        prepare_analyze(body(synthetic={"n_q": 4, "n_k": 4, "d_k": 1 << 15}), SETTINGS, COST)
    assert raised.value.errors[0].loc == ("body", "synthetic", "n_q")


def test_an_analysis_gets_its_strategies_and_masks() -> None:
    q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    request = prepare_analyze(
        body(q=q, k=q, strategies=["dk", {"name": "mine", "divisor": 3.0}], key_lengths=2),
        SETTINGS,
        COST,
    )
    job = request.prepared.job
    assert isinstance(job, AnalyzeJob)
    assert job.strategies == ("dk", ("mine", 3.0))
    lengths = job.masks.key_lengths
    assert isinstance(lengths, torch.Tensor)
    assert lengths.tolist() == 2
    assert request.encoding == "json"


def test_work_over_the_limit_is_refused_with_the_estimate_and_the_way_out() -> None:
    """[1, 2, 64, 8] with summary diagnostics (chunked): 2·1·2·64·64·(32 + 32) FLOPs by the
    model (D = 8 counts as the floor, 32) = 1,048,576, times 10 for the chunked path =
    10,485,760 fused-equivalent FLOPs: over a limit of 10^7, under one of 2·10^7."""
    x = b64_tensor(np.zeros((1, 2, 64, 8), dtype=np.float32))
    request = body(q=x, k=x, v=x, diagnostics="summary")
    tight = small_settings(max_request_flops=1e7)
    with pytest.raises(InvalidRequest) as raised:
        prepare_attention(request, tight, COST)
    (error,) = raised.value.errors
    assert error.loc == ("body", "q")
    assert error.type == "work_limit"
    assert "1.05e+07 FLOPs" in error.msg
    assert "chunked path" in error.msg
    assert "SDPA_MAX_REQUEST_FLOPS = 1e+07" in error.msg
    assert 'diagnostics "none"' in error.msg
    assert "split it" in error.msg
    assert prepare_attention(request, small_settings(max_request_flops=2e7), COST)
    # The fused path (diagnostics "none") costs a tenth: 1,048,576 < 10^7.
    fused = body(q=x, k=x, v=x, diagnostics="none")
    assert prepare_attention(fused, tight, COST).prepared.spec.d == 8


def test_auto_limit_is_max_compute_s_of_the_fused_path() -> None:
    """auto: 10^-4 s at 10^-11 s per FLOP = 10^7 FLOPs, the same refusal as above."""
    x = b64_tensor(np.zeros((1, 2, 64, 8), dtype=np.float32))
    request = body(q=x, k=x, v=x, diagnostics="summary")
    with pytest.raises(InvalidRequest, match="above SDPA_MAX_REQUEST_FLOPS = 1e\\+07"):
        prepare_attention(request, small_settings(max_compute_s=1e-4), COST)


def test_analysis_counts_its_strategies_and_refuses_synthetic_sizes_before_drawing() -> None:
    """Synthetic 1 x 64 x 64, d_k 64: 4,096 scores x (2·64 + 16·strategies) analysis FLOPs, at
    100 times the fused cost per FLOP. Five standard strategies: 4096·208·100 = 85.2M; with
    three custom ones after them (eight): 4096·256·100 = 104.9M. Refused before any value is
    drawn: the synthetic check runs first."""
    synthetic = {"n_q": 64, "n_k": 64, "d_k": 64}
    limit = small_settings(max_request_flops=1e8)
    assert prepare_analyze(body(synthetic=synthetic), limit, COST)
    custom = [{"name": f"c{i}", "divisor": 2.0 + i} for i in range(3)]
    with pytest.raises(InvalidRequest) as raised:
        prepare_analyze(body(synthetic=synthetic, strategies=custom), limit, COST)
    (error,) = raised.value.errors
    assert error.loc == ("body", "synthetic")
    assert "1.05e+08 FLOPs" in error.msg
    assert "fewer strategies" in error.msg


def test_a_response_over_the_limit_is_refused_with_the_cheaper_encodings() -> None:
    """Weights [1, 1, 200, 200] in JSON lists: 40,000 + 200·8 numbers at up to 16 bytes each,
    plus 4 KiB of envelope: about 0.67 MB, over a 0.5 MB limit; in base64 (4/3 of 4 bytes a
    number) about 0.226 MB, under it."""
    x = b64_tensor(np.zeros((1, 1, 200, 8), dtype=np.float32))
    limit = small_settings(max_response_bytes=500_000)
    request = body(q=x, k=x, v=x, return_weights=True, response_encoding="json")
    with pytest.raises(InvalidRequest) as raised:
        prepare_attention(request, limit, COST)
    (error,) = raised.value.errors
    assert error.loc == ("body", "return_weights")
    assert error.type == "response_limit"
    assert "about 0.67 MB in json" in error.msg
    assert 'response_encoding "base64" (about 0.226 MB)' in error.msg
    assert "no weights" in error.msg
    as_base64 = body(q=x, k=x, v=x, return_weights=True, response_encoding="base64")
    assert prepare_attention(as_base64, limit, COST).encoding == "base64"


def test_an_output_not_asked_for_is_neither_sized_nor_held_for_its_encoding() -> None:
    """Output [1, 2, 16, 8] as JSON lists: 256 numbers at up to 16 bytes each, 4,096 bytes of
    the answer's estimate. Without return_output the estimate drops by exactly that, and the
    in-flight reservation by twice that (the encoder's copy and the finished answer); the
    output tensor itself still counts: the compute makes it either way."""
    x = b64_tensor(np.zeros((1, 2, 16, 8), dtype=np.float32))
    fields = {"q": x, "k": x, "v": x, "response_encoding": "json", "diagnostics": "none"}
    whole = prepare_attention(body(**fields), SETTINGS, COST)
    bare = prepare_attention(body(**fields, return_output=False), SETTINGS, COST)
    assert (whole.return_output, bare.return_output) == (True, False)
    assert whole.response_bytes - bare.response_bytes == 256 * 16
    assert bare.response_bytes == 4096  # the envelope alone
    assert whole.working_bytes - bare.working_bytes == 2 * 256 * 16
