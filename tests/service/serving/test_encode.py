"""serving.encode: outcomes -> response bodies, read back with numpy and base64 (independently
of the codec) and compared with the result they came from."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import torch

from sdpa_core import PER_HEAD_FIELDS, analyze_scaling, attention
from service.runtime.batcher import BatchResult
from service.runtime.jobs import AnalyzeOutcome, AttentionOutcome, Outcome
from service.serving.encode import attention_numbers, encode_analyze, encode_attention
from service.serving.meta import response_meta
from service.serving.pipeline import Phases


def meta_of(outcome: Outcome) -> dict[str, object]:
    batch: BatchResult[Outcome] = BatchResult(value=outcome, batch_size=3, queue_ms=0.12345)
    return response_meta(
        batch, device="cpu", dtype=torch.float32, compute_ms=1.23456, request_id="r1"
    )


def test_an_attention_outcome_in_base64_and_its_diagnostics() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen) for _ in range(3))
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[2] = False  # query 2 sees nothing: output 0, lse -inf
    result = attention(q, k, v, attn_mask=mask, return_weights=True, diagnostics="full")
    outcome = AttentionOutcome(result=result, compute_ms=1.0, device="cpu")
    payload = json.loads(encode_attention(outcome, encoding="base64", meta=meta_of(outcome)))

    out = payload["output"]
    raw = np.frombuffer(base64.b64decode(out["b64"]), dtype="<f4").reshape(out["shape"])
    assert np.array_equal(raw, result.output.numpy())
    weights = payload["weights"]
    assert weights["shape"] == [1, 2, 3, 3]
    assert payload["meta"] == {
        "path": result.path, "backend": result.backend, "device": "cpu", "dtype": "float32",
        "batch_size": 3, "queue_ms": 0.123, "compute_ms": 1.235, "request_id": "r1",
    }  # fmt: skip
    diagnostics = result.diagnostics
    assert diagnostics is not None
    summary = payload["diagnostics"]["summary"]
    assert summary["masked_rows"] == 2  # query 2 of each head
    assert math.isclose(summary["entropy"], diagnostics.summary.entropy)
    lse = payload["diagnostics"]["per_row"]["lse"]
    assert lse[0][0][2] is None  # -inf is null in JSON
    assert result.row_stats is not None
    assert np.float32(lse[0][0][0]) == result.row_stats.lse[0, 0, 0].numpy()


def test_an_output_not_asked_for_is_null_and_counts_no_numbers() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 4, 5, generator=gen) for _ in range(3))
    result = attention(q, k, v, return_weights=True, diagnostics="summary")
    outcome = AttentionOutcome(result=result, compute_ms=1.0, device="cpu")
    meta = meta_of(outcome)
    whole = json.loads(encode_attention(outcome, encoding="json", meta=meta))
    bare = json.loads(encode_attention(outcome, encoding="json", meta=meta, return_output=False))
    assert bare["output"] is None
    assert whole["output"]["shape"] == [2, 3, 4, 5]
    assert {**bare, "output": whole["output"]} == whole
    # The weights [2, 3, 4, 4] are the only tensor left; the per-head statistics [2, 3] stay.
    statistics = len(PER_HEAD_FIELDS) * 2 * 3
    assert attention_numbers(outcome, return_output=False) == (2 * 3 * 4 * 4, statistics)
    assert attention_numbers(outcome, return_output=True) == (2 * 3 * 4 * (4 + 5), statistics)


def test_an_analysis_outcome_lists_every_strategy_statistic() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    report = analyze_scaling(q, k, strategies=["none", ("tiny", 1e-40)])
    outcome = AnalyzeOutcome(report=report, compute_ms=1.0, device="cpu")
    payload = json.loads(encode_analyze(outcome, meta=meta_of(outcome)))
    assert payload["d_k"] == 16
    names = [s["name"] for s in payload["strategies"]]
    assert names == ["none", "tiny"]
    first = payload["strategies"][0]
    assert set(first) == {
        "name", "divisor", "score_variance", "entropy", "normalized_entropy", "max_weight",
        "saturated_fraction", "grad_health",
    }  # fmt: skip
    assert math.isclose(first["entropy"], report.strategies[0].entropy)
    assert payload["meta"]["request_id"] == "r1"


def test_server_timing_names_each_phase_in_milliseconds() -> None:
    # Read 1 ms, decode 2 ms, a wait of 10 ms of which 3 queued and 5 computed (2 dispatch),
    # encode 0.5 ms: times in seconds, phases in milliseconds.
    phases = Phases(
        started=100.0,
        received=100.001,
        decoded=100.003,
        computed=100.013,
        encoded=100.0135,
        queue_ms=3.0,
        compute_ms=5.0,
        batch_size=1,
        path="fused",
        backend=None,
    )
    assert phases.server_timing() == (
        "read;dur=1.000, decode;dur=2.000, queue;dur=3.000, compute;dur=5.000, "
        "dispatch;dur=2.000, encode;dur=0.500"
    )
