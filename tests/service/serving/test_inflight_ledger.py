"""serving.inflight: one ledger of the bytes in flight for every door; a request that arrived
whole (gRPC) holds its message and its answer, refused past the limit before its work."""

from __future__ import annotations

import pytest

from service.errors import InvalidRequest, MemoryBusy
from service.metrics import Metrics
from service.serving.inflight import Holding, InflightBytes


def refusals(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("sdpa_rejected_total", {"reason": "inflight_bytes"})
    return value or 0.0


def test_a_whole_request_holds_its_message_then_its_answer_and_gives_them_back() -> None:
    ledger = InflightBytes(1000)
    ledger.held = 100  # the HTTP door's requests
    holding = Holding(ledger, 300, metrics=None)
    assert ledger.held == 400
    holding.reserve_answer(500)  # the working set before compute
    assert ledger.held == 900
    holding.reserve_answer(50)  # shrunk to the encoded answer
    assert ledger.held == 450
    holding.release()
    assert ledger.held == 100


def test_refused_when_all_doors_together_would_pass_the_limit() -> None:
    metrics = Metrics()
    ledger = InflightBytes(1000)
    ledger.held = 800
    with pytest.raises(MemoryBusy, match="SDPA_MAX_INFLIGHT_BYTES = 1000") as busy:
        Holding(ledger, 300, metrics=metrics)
    assert busy.value.status == 503
    assert busy.value.headers == {"Retry-After": "1"}
    assert ledger.held == 800  # nothing held by the refused request
    holding = Holding(ledger, 100, metrics=metrics)
    with pytest.raises(MemoryBusy):
        holding.reserve_answer(200)  # 900 + 200 > 1000
    assert ledger.held == 900
    assert refusals(metrics) == 2


def test_a_request_too_big_for_the_limit_alone_is_a_422() -> None:
    ledger = InflightBytes(1000)
    with pytest.raises(InvalidRequest, match="this request alone"):
        Holding(ledger, 1001, metrics=None)
    holding = Holding(ledger, 600, metrics=None)
    with pytest.raises(InvalidRequest, match="this request alone"):
        holding.reserve_answer(500)
    holding.release()
    assert ledger.held == 0
