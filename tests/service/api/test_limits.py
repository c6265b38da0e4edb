"""The work and response-size limits through the app (in process): refused with a 422 that
names the limit before anything is queued (the compute counter does not move), and reported in
/v1/info with the cost model the warm-up measured."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.support.app import in_process_client, small_settings
from tests.support.wire import to_wire


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    settings = small_settings(max_request_flops=1e6, max_response_bytes=64 * 1024)
    with in_process_client(settings) as c:
        yield c


def computed(client: httpx.Client) -> float:
    """How many device calls the engine has timed so far (every path)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == "sdpa_compute_seconds_count"
    )


def qkv(n: int, d: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(n)
    return {name: to_wire(torch.randn(1, 1, n, d, generator=gen), "b64") for name in "qkv"}


def test_work_over_the_limit_is_refused_before_it_is_queued(client: httpx.Client) -> None:
    before = computed(client)
    # [1, 1, 128, 64]: 2·128·128·(64 + 64) = 4.2M FLOPs at least, over 10^6.
    response = client.post("/v1/attention", json={**qkv(128, 64), "diagnostics": "none"})
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error["loc"] == ["body", "q"]
    assert error["type"] == "work_limit"
    assert "SDPA_MAX_REQUEST_FLOPS = 1e+06" in error["msg"]
    assert computed(client) == before  # never reached the device
    # A small request fits: [1, 1, 4, 4] is 2·4·4·(2·256) = 16,384 FLOPs at most.
    assert client.post("/v1/attention", json={**qkv(4, 4), "diagnostics": "none"}).is_success
    assert computed(client) == before + 1


def test_a_synthetic_analysis_over_the_limit_is_refused(client: httpx.Client) -> None:
    before = computed(client)
    body = {"synthetic": {"n_q": 128, "n_k": 128, "d_k": 64}}
    response = client.post("/v1/analyze", json=body)
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "synthetic"]
    assert computed(client) == before


def test_a_response_over_the_limit_is_refused_with_base64_suggested() -> None:
    # The work limit is "auto" here: a tight one could refuse this request first, whatever the
    # warm-up measured for the dense path. Weights [1, 1, 64, 64] as JSON lists: 4,096 + 64·4
    # numbers, up to 16 bytes each, with the 4 KiB envelope about 74 KB, over 64 KiB; in
    # base64 about 27 KB.
    body = {**qkv(64, 4), "return_weights": True, "response_encoding": "json",
            "diagnostics": "none"}  # fmt: skip
    with in_process_client(small_settings(max_response_bytes=64 * 1024)) as client:
        response = client.post("/v1/attention", json=body)
        as_base64 = client.post("/v1/attention", json={**body, "response_encoding": "base64"})
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error["loc"] == ["body", "return_weights"]
    assert "SDPA_MAX_RESPONSE_BYTES" in error["msg"]
    assert 'response_encoding "base64"' in error["msg"]
    assert as_base64.status_code == 200
    assert len(as_base64.content) <= 64 * 1024


def test_an_output_not_asked_for_counts_nothing_against_the_response_limit() -> None:
    """Output [1, 1, 64, 64] as JSON lists: 4,096 numbers of up to 16 bytes, with the 4 KiB
    envelope about 70 KB, over 64 KiB: refused naming the limit. Without return_output the
    answer is the envelope alone, and served."""
    body = {**qkv(64, 64), "response_encoding": "json", "diagnostics": "none"}
    with in_process_client(small_settings(max_response_bytes=64 * 1024)) as client:
        whole = client.post("/v1/attention", json=body)
        bare = client.post("/v1/attention", json={**body, "return_output": False})
    assert whole.status_code == 422, whole.text
    assert "SDPA_MAX_RESPONSE_BYTES" in whole.json()["errors"][0]["msg"]
    assert bare.status_code == 200, bare.text
    assert bare.json()["output"] is None


def test_info_reports_the_limits_and_the_measured_cost_model(client: httpx.Client) -> None:
    info = client.get("/v1/info").json()
    assert info["limits"]["max_request_flops"] == 1e6
    assert info["limits"]["max_response_bytes"] == 64 * 1024
    assert info["limits"]["max_compute_s"] == 10.0
    model = info["cost_model"]
    assert model["calibrated"] is True  # measured at warm-up, before /readyz turned ready
    assert set(model["paths"]) == {"fused", "dense", "chunked", "analyze"}
    for cost in model["paths"].values():
        assert cost["gflops_per_second"] > 0
        assert 1 <= cost["d_floor"] <= 256
    assert np.isfinite(model["paths"]["fused"]["gflops_per_second"])
