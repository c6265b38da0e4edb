"""Every endpoint of the app (in process, through create_app and its lifespan), both encodings in
and out, every mask option.

Each attention result is compared with sdpa_core called directly, in the same dtype; each
analysis with sdpa_core.analyze_scaling. Tensors are written and read with numpy and base64
(tests/support/wire.py), independently of the service's codec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sdpa_core import analyze_scaling, attention, make_synthetic_qk
from service.wire.models import LimitsOut
from tests.support.app import API_SERVER_ENV
from tests.support.wire import from_wire, to_wire


def randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


@dataclass(frozen=True)
class Case:
    id: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    encoding: str = "data"  # how q, k, v travel: list | data | b64
    response_encoding: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # plain JSON options
    masks: dict[str, Any] = field(default_factory=dict)  # name -> (tensor, encoding)


KPM = torch.zeros(2, 16, dtype=torch.bool)
KPM[0, 11:] = True
KPM_PER_HEAD = torch.rand(2, 4, 16, generator=torch.Generator().manual_seed(3)) > 0.6
BOOL_MASK = torch.rand(8, 16, generator=torch.Generator().manual_seed(4)) > 0.3
FLOAT_MASK = randn((2, 4, 8, 16), torch.float32, 5)

CASES = [
    Case("bare-lists-json", (4, 16, 8), (4, 16, 8), (4, 16, 8), encoding="list"),
    Case("float64-data-to-b64-causal-weights-full", (2, 3, 8, 8), (2, 3, 8, 8), (2, 3, 8, 4),
         torch.float64, response_encoding="base64",
         options={"causal": True, "return_weights": True, "diagnostics": "full"}),
    Case("b64-bottom-right-gqa", (2, 4, 8, 16), (2, 2, 16, 16), (2, 2, 16, 8),
         encoding="b64", options={"causal": "bottom_right"}),
    Case("float16-b64-to-json-top-left-lengths", (2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8),
         torch.float16, encoding="b64", response_encoding="json",
         options={"causal": "top_left", "key_lengths": [5, 16]}),
    Case("bfloat16-b64-per-head-lengths-weights", (2, 4, 8, 16), (2, 4, 16, 16), (2, 4, 16, 16),
         torch.bfloat16, encoding="b64",
         options={"key_lengths": [[1, 2, 3, 4], [16, 9, 8, 0]], "return_weights": True,
                  "diagnostics": "full"}),
    Case("bfloat16-lists", (4, 8, 8), (4, 8, 8), (4, 8, 8), torch.bfloat16, encoding="data"),
    Case("key-padding-mask-b64", (2, 4, 8, 8), (2, 4, 16, 8), (2, 4, 16, 8),
         options={"return_weights": True}, masks={"key_padding_mask": (KPM, "b64")}),
    Case("key-padding-mask-per-head-list", (2, 4, 8, 8), (2, 4, 16, 8), (2, 4, 16, 8),
         encoding="b64", response_encoding="json", options={"diagnostics": "full"},
         masks={"key_padding_mask": (KPM_PER_HEAD, "list")}),
    Case("bool-attn-mask-broadcast", (2, 4, 8, 8), (2, 4, 16, 8), (2, 4, 16, 8),
         options={"return_weights": True}, masks={"attn_mask": (BOOL_MASK, "data")}),
    Case("float-attn-mask-b64", (2, 4, 8, 8), (2, 4, 16, 8), (2, 4, 16, 8), encoding="b64",
         options={"causal": True, "diagnostics": "full"},
         masks={"attn_mask": (FLOAT_MASK, "b64")}),
    Case("scale-no-diagnostics", (1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8), encoding="b64",
         options={"scale": 0.3, "diagnostics": "none"}),
    Case("two-d-single-head", (6, 4), (9, 4), (9, 3), encoding="list",
         response_encoding="base64", options={"return_weights": True}),
]  # fmt: skip


def build(case: Case, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request body, kwargs for sdpa_core.attention)."""
    q = randn(case.q, case.dtype, seed)
    k = randn(case.k, case.dtype, seed + 1)
    v = randn(case.v, case.dtype, seed + 2)
    body: dict[str, Any] = {
        name: to_wire(t, case.encoding) for name, t in zip("qkv", (q, k, v), strict=True)
    }
    direct: dict[str, Any] = {"q": q, "k": k, "v": v, "diagnostics": "summary"}
    body.update(case.options)
    direct.update(case.options)
    if "key_lengths" in case.options:
        direct["key_lengths"] = torch.tensor(case.options["key_lengths"])
    if case.response_encoding is not None:
        body["response_encoding"] = case.response_encoding
    for name, (mask, encoding) in case.masks.items():
        body[name] = to_wire(mask, encoding)
        direct[name] = mask
    return body, direct


def as_float64(values: Any) -> torch.Tensor:
    """A JSON nested list (null = non-finite) as float64, nulls as NaN."""
    return torch.from_numpy(np.asarray(values, dtype=np.float64))


def assert_diagnostics_equal(got: dict[str, Any], expected: Any) -> None:
    for name, value in expected.summary.as_dict().items():
        assert got["summary"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    for section in ("per_head", "per_row"):
        want = getattr(expected, section)
        if want is None:
            assert got[section] is None
            continue
        for name, tensor in want.as_dict().items():
            t = tensor.double()
            t[~torch.isfinite(t)] = math.nan  # JSON writes -inf (masked rows' lse) as null
            torch.testing.assert_close(as_float64(got[section][name]), t, equal_nan=True)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_attention_matches_sdpa_core(client: httpx.Client, case: Case) -> None:
    body, direct_kwargs = build(case, seed=len(case.id))
    response = client.post("/v1/attention", json=body)
    assert response.status_code == 200, response.text
    got = response.json()
    expected = attention(**direct_kwargs)

    out_encoding = case.response_encoding or ("base64" if case.encoding == "b64" else "json")
    assert ("b64" in got["output"]) == (out_encoding == "base64")
    output = from_wire(got["output"])
    assert output.dtype == case.dtype
    torch.testing.assert_close(output, expected.output)
    if expected.weights is None:
        assert got["weights"] is None
    else:
        weights = from_wire(got["weights"])
        assert weights.dtype == case.dtype
        torch.testing.assert_close(weights, expected.weights)
    if expected.diagnostics is None:
        assert got["diagnostics"] is None
    else:
        assert_diagnostics_equal(got["diagnostics"], expected.diagnostics)

    meta = got["meta"]
    assert meta["path"] == expected.path
    assert meta["dtype"] == str(case.dtype).removeprefix("torch.")
    assert meta["device"] == "cpu"
    assert meta["batch_size"] >= 1
    assert meta["request_id"] == response.headers["x-request-id"]


def test_fully_masked_rows_are_zero_and_counted(client: httpx.Client) -> None:
    q, k, v = (randn((2, 2, 4, 8), torch.float32, s) for s in (1, 2, 3))
    body = {"q": to_wire(q, "b64"), "k": to_wire(k, "b64"), "v": to_wire(v, "b64"),
            "key_lengths": [0, 3], "diagnostics": "full", "response_encoding": "json"}  # fmt: skip
    got = client.post("/v1/attention", json=body).json()
    output = from_wire(got["output"])
    assert torch.count_nonzero(output[0]) == 0
    assert got["diagnostics"]["summary"]["masked_rows"] == 2 * 4
    assert got["diagnostics"]["per_row"]["lse"][0] == [[None] * 4] * 2  # -inf travels as null
    direct = attention(q, k, v, key_lengths=torch.tensor([0, 3]))
    torch.testing.assert_close(output, direct.output)


def test_alias_route_gives_the_same_answer(client: httpx.Client) -> None:
    body, _ = build(CASES[2], seed=11)
    first = client.post("/v1/attention", json=body).json()
    second = client.post("/attention", json=body).json()
    assert first["output"] == second["output"]
    assert first["diagnostics"] == second["diagnostics"]


@pytest.mark.parametrize("route", ["/v1/attention", "/attention"])
def test_without_return_output_the_output_is_null_and_the_rest_unchanged(
    client: httpx.Client, route: str
) -> None:
    """return_output false: "output" is null; the weights and diagnostics are those of the same
    request with its output, and those of sdpa_core called directly."""
    case = CASES[1]  # float64, causal, weights, diagnostics "full", base64 answer
    body, direct_kwargs = build(case, seed=7)
    whole = client.post(route, json=body)
    bare = client.post(route, json={**body, "return_output": False})
    assert whole.status_code == bare.status_code == 200, bare.text
    got = bare.json()
    assert set(got) == {"output", "weights", "diagnostics", "meta"}
    assert got["output"] is None
    assert whole.json()["output"] is not None
    assert got["weights"] == whole.json()["weights"]
    assert got["diagnostics"] == whole.json()["diagnostics"]
    expected = attention(**direct_kwargs)
    torch.testing.assert_close(from_wire(got["weights"]), expected.weights)
    assert_diagnostics_equal(got["diagnostics"], expected.diagnostics)
    assert len(bare.content) < len(whole.content)


def test_return_output_must_be_a_boolean(client: httpx.Client) -> None:
    body, _ = build(CASES[0], seed=3)
    response = client.post("/v1/attention", json={**body, "return_output": "no"})
    assert response.status_code == 422
    (error,) = response.json()["errors"]
    assert error["loc"] == ["body", "return_output"]


def test_server_timing_and_request_id(client: httpx.Client) -> None:
    body, _ = build(CASES[0], seed=5)
    response = client.post("/v1/attention", json=body, headers={"X-Request-ID": "req-42"})
    assert response.json()["meta"]["request_id"] == "req-42"
    timing = dict(
        part.strip().split(";dur=") for part in response.headers["server-timing"].split(",")
    )
    assert {"decode", "queue", "compute", "encode"} <= set(timing)
    assert all(float(ms) >= 0 for ms in timing.values())


@pytest.mark.parametrize("encoding", ["list", "b64"])
def test_analyze_given_q_and_k_matches_sdpa_core(client: httpx.Client, encoding: str) -> None:
    q, k = randn((2, 2, 12, 16), torch.float32, 7), randn((2, 2, 20, 16), torch.float32, 8)
    body = {
        "q": to_wire(q, encoding),
        "k": to_wire(k, encoding),
        "strategies": ["none", "sqrt_dk", {"name": "eight", "divisor": 8.0}],
        "causal": "bottom_right",
        "key_lengths": [20, 13],
    }
    response = client.post("/v1/analyze", json=body)
    assert response.status_code == 200, response.text
    expected = analyze_scaling(
        q, k, strategies=["none", "sqrt_dk", ("eight", 8.0)], causal="bottom_right",
        key_lengths=torch.tensor([20, 13]),
    )  # fmt: skip
    assert_report_equal(response.json(), expected)


def test_analyze_synthetic_matches_sdpa_core(client: httpx.Client) -> None:
    syn: dict[str, Any] = {"n_q": 32, "n_k": 48, "d_k": 64, "std": 2.0, "seed": 3, "heads": 2}
    response = client.post("/v1/analyze", json={"synthetic": syn})
    assert response.status_code == 200, response.text
    got = response.json()
    assert got["meta"]["dtype"] == "float32"
    assert_report_equal(got, analyze_scaling(*make_synthetic_qk(**syn)))


def assert_report_equal(got: dict[str, Any], expected: Any) -> None:
    assert got["d_k"] == expected.d_k
    approx: dict[str, Any] = {"rel": 1e-6, "abs": 1e-9}
    assert got["raw_score_variance"] == pytest.approx(expected.raw_score_variance, **approx)
    assert got["recommended_divisor"] == pytest.approx(expected.recommended_divisor, **approx)
    assert [s["name"] for s in got["strategies"]] == [s.name for s in expected.strategies]
    for mine, theirs in zip(got["strategies"], expected.strategies, strict=True):
        for name, value in mine.items():
            if name != "name":
                assert value == pytest.approx(getattr(theirs, name), **approx), name


def test_health_and_readiness(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}


def test_info_reports_the_running_configuration(client: httpx.Client) -> None:
    info = client.get("/v1/info").json()
    assert info["device"] == "cpu"
    assert info["torch_version"] == torch.__version__
    assert info["dtypes"] == ["float16", "bfloat16", "float32", "float64"]
    assert info["limits"]["max_body_bytes"] == int(API_SERVER_ENV["SDPA_MAX_BODY_BYTES"])
    assert info["limits"]["max_elements"] == int(API_SERVER_ENV["SDPA_MAX_ELEMENTS"])
    assert info["batching"] == {
        "max_batch_size": 32,
        "max_batch_delay_ms": 0.0,
        "max_queue": 1024,
        "slice_ms": 50.0,
        "backlog_seconds": 0.0,  # nothing queued
    }
    assert info["auth"] is False


def test_metrics_count_requests(client: httpx.Client) -> None:
    def attention_200s() -> float:
        text = client.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if (sample.name == "sdpa_requests_total"
                        and labels.get("route") == "/v1/attention"
                        and labels.get("status") == "200"):  # fmt: skip
                    return sample.value
        return 0.0

    before = attention_200s()
    body, _ = build(CASES[0], seed=9)
    for _ in range(3):
        assert client.post("/v1/attention", json=body).status_code == 200
    assert attention_200s() == before + 3


def test_openapi_documents_every_endpoint_with_an_example(client: httpx.Client) -> None:
    doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    assert set(paths) >= {"/v1/attention", "/attention", "/v1/analyze", "/healthz", "/readyz",
                          "/v1/info", "/metrics"}  # fmt: skip
    for path in ("/v1/attention", "/v1/analyze"):
        post = paths[path]["post"]
        example = post["requestBody"]["content"]["application/json"]["example"]
        response = client.post(path, json=example)  # the documented example works
        assert response.status_code == 200, response.text
        for status in ("413", "415", "422", "503", "504"):
            assert "application/problem+json" in post["responses"][status]["content"]


def test_the_info_limits_are_the_documented_ones(client: httpx.Client) -> None:
    # /v1/info's limits and the OpenAPI document's LimitsOut list the same settings: a limit
    # added to one and not the other fails here.
    limits = client.get("/v1/info").json()["limits"]
    assert set(limits) == set(LimitsOut.model_fields)
    LimitsOut.model_validate(limits)
