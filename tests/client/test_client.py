"""sdpa_client against httpx.MockTransport: wire encoding, retries, error mapping.

The fake server in these tests decodes and encodes the wire format with its own few lines of
numpy (not the client's helpers), and computes attention in float64, so a round trip checks the
client against an independent reading of DESIGN.md "HTTP API (v1)".
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import pickle
import random
import struct
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from sdpa_client import (
    AsyncSDPAClient,
    FieldProblem,
    RetryPolicy,
    SDPAAuthError,
    SDPAClient,
    SDPAClientError,
    SDPAConnectionError,
    SDPAPayloadTooLarge,
    SDPARateLimited,
    SDPAReadTimeout,
    SDPARequestError,
    SDPAServerError,
    SDPATimeout,
    SDPAUnavailable,
    SDPAUnsupportedMediaType,
    SDPAValidationError,
    SummaryStats,
    decode_tensor,
    encode_body,
    encode_tensor,
    parse_attention_response,
    parse_retry_after,
)
from sdpa_client.calls import RequestBuilder
from sdpa_client.errors import SDPAProtocolError
from sdpa_client.fields import PER_HEAD_STAT_NAMES, PER_ROW_STAT_NAMES
from sdpa_client.v2 import build_infer_request

Handler = Callable[[httpx.Request], httpx.Response]
LE = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "bool": "u1"}

# ---- an independent fake server --------------------------------------------------------------


def wire_to_array(t: dict[str, Any]) -> np.ndarray:
    if "b64" in t:
        return np.frombuffer(base64.b64decode(t["b64"]), dtype=LE[t["dtype"]]).reshape(t["shape"])
    return np.asarray(t["data"], dtype=np.float64)


def array_to_wire(a: np.ndarray, encoding: str) -> dict[str, Any]:
    if encoding == "json":
        return {"dtype": "float32", "shape": list(a.shape), "data": a.tolist()}
    raw = a.astype("<f4").tobytes()
    return {"dtype": "float32", "shape": list(a.shape), "b64": base64.b64encode(raw).decode()}


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool = False):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # [B, H, N_q, N_kv]
    if causal:
        n_q, n_kv = scores.shape[-2:]
        scores = np.where(np.tril(np.ones((n_q, n_kv), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights @ v, weights  # [B, H, N_q, D_v], [B, H, N_q, N_kv]


SUMMARY = {
    "entropy": 1.5, "normalized_entropy": 0.75, "effective_keys": 4.48, "max_weight": 0.4,
    "saturated_fraction": 0.0, "sink_share": 0.2, "score_mean_raw": 0.01, "score_variance_raw": 2.0,
    "score_variance_scaled": 1.0, "score_abs_max_scaled": 3.1, "grad_health": 0.1,
    "jacobian_fro": 0.5, "masked_rows": 1,
}  # fmt: skip


def attention_server(seen: list[dict[str, Any]]) -> Handler:
    """/v1/attention computed in float64 from the decoded request."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append({"body": body, "headers": dict(request.headers)})
        q, k, v = (wire_to_array(body[n]) for n in ("q", "k", "v"))
        out, weights = reference_attention(q, k, v, causal=bool(body["causal"]))
        enc = body["response_encoding"]
        heads = q.shape[-3]
        payload = {
            "output": array_to_wire(out, enc) if body.get("return_output", True) else None,
            "weights": array_to_wire(weights, enc) if body["return_weights"] else None,
            "diagnostics": {
                "summary": SUMMARY,
                "per_head": {"entropy": [[0.5] * heads]},
                "per_row": {"lse": [[[1.0, None]]], "visible_keys": [[[2, 0]]]},
            },
            "meta": {"path": "dense", "backend": None, "device": "cpu", "dtype": "float32",
                     "batch_size": 3, "queue_ms": 0.5, "compute_ms": 1.25, "request_id": "r-1"},
        }  # fmt: skip
        return httpx.Response(200, json=payload)

    return handle


def problem(status: int, title: str, *, headers: dict[str, str] | None = None, errors=()):
    body = {"type": "about:blank", "title": title, "status": status, "detail": f"{title}!",
            "errors": [{"loc": list(loc), "msg": msg, "type": "value_error"}
                       for loc, msg in errors]}  # fmt: skip
    return httpx.Response(
        status,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/problem+json", **(headers or {})},
    )


def sequence(*responses: httpx.Response | Exception, calls: list[httpx.Request]) -> Handler:
    """A handler answering with `responses` in order (an exception is raised)."""
    pending = list(responses)

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        item = pending.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    return handle


def small_qkv(seed: int = 0, shape=(1, 2, 3, 4)) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(3))


def ok_attention(calls: list[httpx.Request]) -> httpx.Response:
    q, k, v = small_qkv()
    out, _ = reference_attention(q, k, v)
    return httpx.Response(
        200, json={"output": array_to_wire(out, "base64"), "weights": None, "diagnostics": None,
                   "meta": {"path": "fused", "device": "cpu"}},
    )  # fmt: skip


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def client_for(handler: Handler, **kwargs: Any) -> SDPAClient:
    kwargs.setdefault("sleep", Sleeps())
    return SDPAClient("http://sdpa.test", transport=httpx.MockTransport(handler), **kwargs)


# ---- tensors on the wire ----------------------------------------------------------------------


def test_base64_is_little_endian_row_major_bytes() -> None:
    # Big-endian input must still travel little-endian, in row-major order.
    a = np.array([[1.0, -2.0], [0.5, 3.0]], dtype=">f4")
    wire = encode_tensor(a)
    assert wire["dtype"] == "float32"
    assert wire["shape"] == [2, 2]
    assert base64.b64decode(wire["b64"]) == struct.pack("<4f", 1.0, -2.0, 0.5, 3.0)
    mask = encode_tensor(np.array([True, False, True]))
    assert mask["dtype"] == "bool"
    assert base64.b64decode(mask["b64"]) == b"\x01\x00\x01"


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bool"])
@pytest.mark.parametrize("encoding", ["base64", "json"])
def test_numpy_round_trip_every_dtype(dtype: str, encoding: str) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3, 5)) > 0 if dtype == "bool" else rng.standard_normal((2, 3, 5))
    a = a.astype(dtype)
    wire = encode_tensor(a, encoding=encoding)  # type: ignore[arg-type]
    assert wire["dtype"] == dtype
    assert wire["shape"] == [2, 3, 5]
    back = decode_tensor(json.loads(json.dumps(wire)))
    assert back.dtype == a.dtype
    assert back.shape == a.shape
    np.testing.assert_array_equal(back, a)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bool])
def test_torch_tensors_encode_like_numpy(dtype: torch.dtype) -> None:
    t = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    t = (t > 0) if dtype == torch.bool else t.to(dtype)
    assert encode_tensor(t) == encode_tensor(t.numpy())


@pytest.mark.parametrize("encoding", ["base64", "json"])
def test_bfloat16_travels_as_raw_bits_and_returns_float32(encoding: str) -> None:
    t = torch.tensor([[1.0, -2.5, 3.140625], [1e-3, 65280.0, -0.0]], dtype=torch.bfloat16)
    wire = encode_tensor(t, encoding=encoding)  # type: ignore[arg-type]
    assert wire["dtype"] == "bfloat16"
    assert wire["shape"] == [2, 3]
    if encoding == "base64":
        # The 16-bit patterns themselves, little-endian: what torch holds in memory.
        expected = t.view(torch.int16).numpy().astype("<i2").tobytes()
        assert base64.b64decode(wire["b64"]) == expected
    back = decode_tensor(wire)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, t.float().numpy())


def test_unsupported_dtype_is_refused_locally() -> None:
    with pytest.raises(TypeError, match="int64"):
        encode_tensor(np.arange(4), param="q")


def test_null_in_lists_becomes_nan_or_minus_inf() -> None:
    assert np.isnan(decode_tensor([1.0, None])[1])
    assert decode_tensor([1.0, None], null_as=-math.inf)[1] == -math.inf


def test_encode_body_is_exactly_compact_json() -> None:
    # Large base64 strings are spliced in as bytes: the result must still be the bytes that
    # json.dumps writes, with tensors both above and below the splicing threshold.
    rng = np.random.default_rng(2)
    body = {
        "q": encode_tensor(rng.standard_normal((4, 64, 64)).astype(np.float32)),
        "k": encode_tensor(rng.standard_normal((2, 3)).astype(np.float32)),
        "v": encode_tensor(rng.standard_normal((4, 64, 64)).astype(np.float16)),
        "key_padding_mask": encode_tensor(np.ones((2, 5000), dtype=bool)),
        "causal": "bottom_right",
        "key_lengths": [[1, 2]],
        "scale": None,
    }
    assert encode_body(body) == json.dumps(body, separators=(",", ":")).encode()


# ---- a full call ------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["base64", "json"])
def test_attention_round_trip_matches_float64_reference(encoding: str) -> None:
    seen: list[dict[str, Any]] = []
    q, k, v = small_qkv()
    with client_for(attention_server(seen), api_key="s3cret") as client:
        result = client.attention(
            q, k, v, causal=True, return_weights=True, encoding=encoding,  # type: ignore[arg-type]
            key_lengths=[3], key_padding_mask=np.array([[False, False, True]]), request_id="abc",
        )  # fmt: skip
    ref_out, ref_w = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(result.output, ref_out, rtol=1e-5, atol=1e-6)
    assert result.weights is not None
    np.testing.assert_allclose(result.weights, ref_w, rtol=1e-5, atol=1e-6)

    sent = seen[0]
    assert sent["headers"]["authorization"] == "Bearer s3cret"
    assert sent["headers"]["content-type"] == "application/json"
    assert sent["headers"]["x-request-id"] == "abc"
    body = sent["body"]
    assert body["response_encoding"] == encoding
    assert body["diagnostics"] == "summary"
    assert body["causal"] is True
    assert body["key_lengths"] == [3]
    assert body["scale"] is None
    assert ("b64" in body["q"]) == (encoding == "base64")
    np.testing.assert_array_equal(wire_to_array(body["key_padding_mask"]), [[0, 0, 1]])

    diag = result.diagnostics
    assert diag is not None
    assert isinstance(diag.summary, SummaryStats)
    assert diag.summary.masked_rows == 1
    assert diag.summary.entropy == 1.5
    np.testing.assert_array_equal(diag.per_head["entropy"], [[0.5, 0.5]])
    assert diag.per_row is not None
    np.testing.assert_array_equal(diag.per_row["lse"], [[[1.0, -math.inf]]])
    assert diag.per_row["visible_keys"].dtype == np.int64
    meta = result.meta
    assert (meta.path, meta.device, meta.batch_size, meta.compute_ms, meta.request_id) == (
        "dense", "cpu", 3, 1.25, "r-1",
    )  # fmt: skip


def test_analyze_body_and_report() -> None:
    seen: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        strategies = [
            {"name": n, "divisor": d, "score_variance": 512.0 / d**2, "entropy": 1.0,
             "normalized_entropy": 0.5, "max_weight": 0.9, "saturated_fraction": None,
             "grad_health": 0.01}
            for n, d in (("none", 1.0), ("t8", 8.0))
        ]  # fmt: skip
        return httpx.Response(
            200, json={"d_k": 512, "raw_score_variance": 512.0, "recommended_divisor": 22.6,
                       "strategies": strategies, "meta": {"device": "cpu", "batch_size": 1}},
        )  # fmt: skip

    with client_for(handle) as client:
        report = client.analyze(
            synthetic={"n_q": 8, "n_k": 8, "d_k": 512}, strategies=["none", ("t8", 8.0)]
        )
    assert seen[0]["synthetic"] == {"n_q": 8, "n_k": 8, "d_k": 512}
    assert seen[0]["strategies"] == ["none", {"name": "t8", "divisor": 8.0}]
    assert "q" not in seen[0]
    assert report.d_k == 512
    assert report.recommended_divisor == 22.6
    assert [s.name for s in report.strategies] == ["none", "t8"]
    assert report.strategies[1].score_variance == 8.0
    assert math.isnan(report.strategies[0].saturated_fraction)  # null -> NaN
    assert report.meta.batch_size == 1
    assert report.meta.path is None


def test_probes_and_info() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return problem(503, "Not ready", headers={"retry-after": "1"})
        if request.url.path == "/healthz":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json={"version": "0.1.0", "device": "cpu"})

    sleeps = Sleeps()
    with client_for(handle, sleep=sleeps) as client:
        assert client.healthz() is True
        assert client.readyz() is False
        assert client.info()["device"] == "cpu"
    assert sleeps.delays == []  # a probe reports the state now: never retried


def test_timeout_ms_widens_the_read_timeout() -> None:
    timeouts: list[dict[str, float]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return ok_attention([])

    with client_for(handle, timeout=httpx.Timeout(10.0)) as client:
        q, k, v = small_qkv()
        client.attention(q, k, v)
        client.attention(q, k, v, timeout_ms=120_000)
    assert timeouts[0]["read"] == 10.0
    assert timeouts[1]["read"] == 125.0  # the server's own 504 must arrive before ours


# ---- retries ----------------------------------------------------------------------------------


def test_503_retried_after_retry_after_seconds() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(
        problem(503, "Queue full", headers={"retry-after": "2"}),
        problem(503, "Queue full", headers={"retry-after": "3"}),
        ok_attention(calls),
        calls=calls,
    )
    sleeps = Sleeps()
    policy = RetryPolicy(retry_after_spread=0.0)
    with client_for(handler, sleep=sleeps, retry=policy, rng=random.Random(0)) as client:
        result = client.attention(*small_qkv())
    assert len(calls) == 3
    assert sleeps.delays == [2.0, 3.0]
    q, k, v = small_qkv()
    np.testing.assert_allclose(result.output, reference_attention(q, k, v)[0], rtol=1e-5)
    # The same bytes each time: a retry repeats the request, it does not rebuild it.
    assert calls[0].content == calls[2].content


def test_retry_after_http_date_and_spread() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_retry_after(format_datetime(now + timedelta(seconds=7), usegmt=True), now=now) == 7
    assert parse_retry_after(format_datetime(now - timedelta(seconds=7), usegmt=True), now=now) == 0
    assert parse_retry_after("1.5") == 1.5
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None
    # The spread lifts a Retry-After by at most 10 % (clients told "1" do not return together).
    rng = random.Random(3)
    delays = [RetryPolicy().delay_s(1, 1.0, rng) for _ in range(200)]
    assert min(delays) >= 1.0
    assert max(delays) <= 1.1
    assert len(set(delays)) > 100


def test_http_date_retry_after_is_honoured_by_the_client() -> None:
    calls: list[httpx.Request] = []
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    handler = sequence(
        problem(503, "Queue full", headers={"retry-after": when}), ok_attention(calls), calls=calls
    )
    sleeps = Sleeps()
    with client_for(handler, sleep=sleeps, retry=RetryPolicy(retry_after_spread=0.0)) as client:
        client.attention(*small_qkv())
    assert len(sleeps.delays) == 1
    assert 28.0 <= sleeps.delays[0] <= 30.0


def test_exponential_backoff_without_retry_after_then_give_up() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(*(problem(504, "Deadline exceeded") for _ in range(4)), calls=calls)
    sleeps = Sleeps()
    policy = RetryPolicy(max_attempts=4, backoff_initial_s=0.1, jitter=0.0)
    with (
        client_for(handler, sleep=sleeps, retry=policy) as client,
        pytest.raises(SDPATimeout) as ei,
    ):
        client.attention(*small_qkv())
    assert len(calls) == 4
    assert sleeps.delays == pytest.approx([0.1, 0.2, 0.4])
    assert ei.value.attempts == 4
    assert ei.value.status == 504


def test_full_jitter_stays_within_the_exponential_envelope() -> None:
    policy = RetryPolicy(backoff_initial_s=0.1, backoff_max_s=0.5, jitter=1.0)
    rng = random.Random(0)
    for n, cap in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (9, 0.5)):
        delays = [policy.delay_s(n, None, rng) for _ in range(100)]
        assert min(delays) >= 0.0
        assert max(delays) <= cap
        assert max(delays) > 0.8 * cap  # full range used, not a constant


def test_retry_after_beyond_the_total_budget_fails_at_once() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(problem(503, "Queue full", headers={"retry-after": "120"}), calls=calls)
    sleeps = Sleeps()
    with (
        client_for(handler, sleep=sleeps, retry=RetryPolicy(max_total_s=30.0)) as client,
        pytest.raises(SDPAUnavailable) as ei,
    ):
        client.attention(*small_qkv())
    assert len(calls) == 1
    assert sleeps.delays == []
    assert ei.value.retry_after_s == 120.0
    assert ei.value.title == "Queue full"


def test_total_time_budget_counts_time_already_spent() -> None:
    clock = [0.0]
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        clock[0] += 4.0  # each attempt takes 4 s
        return problem(503, "Queue full", headers={"retry-after": "1"})

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    policy = RetryPolicy(max_attempts=10, max_total_s=12.0, retry_after_spread=0.0)
    with (
        client_for(handler, sleep=sleep, clock=lambda: clock[0], retry=policy) as client,
        pytest.raises(SDPAUnavailable),
    ):
        client.attention(*small_qkv())
    # t=4 sleep 1 -> t=9 sleep 1 -> t=14 > 12 - 1: three attempts, far fewer than 10.
    assert len(calls) == 3


def test_connection_errors_are_retried_read_timeouts_are_not() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(httpx.ConnectError("refused"), ok_attention(calls), calls=calls)
    sleeps = Sleeps()
    with client_for(handler, sleep=sleeps) as client:
        client.attention(*small_qkv())
    assert len(calls) == 2
    assert len(sleeps.delays) == 1

    calls.clear()
    handler = sequence(httpx.ReadTimeout("slow"), calls=calls)
    with client_for(handler) as client, pytest.raises(SDPAReadTimeout) as ei:
        client.attention(*small_qkv())
    assert len(calls) == 1
    assert ei.value.status is None
    assert isinstance(ei.value, SDPAConnectionError)
    assert isinstance(ei.value.__cause__, httpx.ReadTimeout)


def test_persistent_connection_failure_raises_after_max_attempts() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(*(httpx.ConnectError("refused") for _ in range(3)), calls=calls)
    with (
        client_for(handler, retry=RetryPolicy(max_attempts=3)) as client,
        pytest.raises(SDPAConnectionError, match="refused") as ei,
    ):
        client.attention(*small_qkv())
    assert len(calls) == 3
    assert ei.value.attempts == 3


# ---- error mapping ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls", "family"),
    [
        (401, SDPAAuthError, SDPAClientError),
        (413, SDPAPayloadTooLarge, SDPAClientError),
        (415, SDPAUnsupportedMediaType, SDPAClientError),
        (422, SDPAValidationError, SDPAClientError),
        (429, SDPARateLimited, SDPAClientError),
        (503, SDPAUnavailable, SDPAServerError),
        (504, SDPATimeout, SDPAServerError),
        (500, SDPAServerError, SDPAServerError),
        (409, SDPAClientError, SDPAClientError),
    ],
)
def test_problem_json_maps_to_typed_errors(status: int, cls: type, family: type) -> None:
    calls: list[httpx.Request] = []
    errors = [(("body", "k", "shape"), "k has D=5, q has D=4"), (("body", "causal"), "bad")]
    handler = sequence(
        problem(status, f"Title {status}", errors=errors, headers={"x-request-id": "rid-9"}),
        calls=calls,
    )
    with (
        client_for(handler, retry=RetryPolicy(max_attempts=1)) as client,
        pytest.raises(SDPARequestError) as ei,
    ):
        client.attention(*small_qkv())
    err = ei.value
    assert type(err) is cls
    assert isinstance(err, family)
    assert (err.status, err.title, err.detail) == (status, f"Title {status}", f"Title {status}!")
    assert [(e.loc, e.msg) for e in err.errors] == errors
    assert err.request_id == "rid-9"
    assert "body.k.shape: k has D=5, q has D=4" in str(err)


def test_client_errors_are_not_retried() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(problem(422, "Invalid request"), calls=calls)
    sleeps = Sleeps()
    with client_for(handler, sleep=sleeps) as client, pytest.raises(SDPAValidationError):
        client.attention(*small_qkv())
    assert len(calls) == 1
    assert sleeps.delays == []


def test_a_proxys_502_is_retried_a_4xx_never() -> None:
    # A proxy answers 502 when the replica it tried died: the computation is pure, so the
    # client sends it again (to whichever replica the proxy picks next).
    calls: list[httpx.Request] = []
    handler = sequence(
        httpx.Response(502, text="<html>bad gateway</html>"), ok_attention(calls), calls=calls
    )
    sleeps = Sleeps()
    with client_for(handler, sleep=sleeps) as client:
        client.attention(*small_qkv())
    assert len(calls) == 2
    assert len(sleeps.delays) == 1
    for status in (400, 401, 404, 413, 415, 422):
        calls.clear()
        handler = sequence(problem(status, f"Title {status}"), calls=calls)
        with client_for(handler, sleep=sleeps) as client, pytest.raises(SDPAClientError):
            client.attention(*small_qkv())
        assert len(calls) == 1, status


def test_an_infrastructure_500_is_retried_the_services_own_never() -> None:
    # Ray Serve's proxy answers a request whose replica died with it "500 Internal Server
    # Error" in plain text (ray-project/ray#47219): no envelope of this service, so not our bug,
    # and the computation is pure: sent again. The service's own 500 (problem+json, or v2's
    # {"error"}) is a bug of ours: never.
    for infrastructure in (
        httpx.Response(500, text="Internal Server Error"),
        httpx.Response(500, text="<html><body>500</body></html>"),
        httpx.Response(500, json=["not", "ours"]),
    ):
        calls: list[httpx.Request] = []
        handler = sequence(infrastructure, ok_attention(calls), calls=calls)
        sleeps = Sleeps()
        with client_for(handler, sleep=sleeps) as client:
            client.attention(*small_qkv())
        assert len(calls) == 2
        assert len(sleeps.delays) == 1
    ours = (
        problem(500, "Internal server error"),
        httpx.Response(500, json={"error": "internal server error; request id 7"}),
    )
    for answer in ours:
        calls = []
        handler = sequence(answer, calls=calls)
        with client_for(handler, sleep=Sleeps()) as client, pytest.raises(SDPAServerError):
            client.attention(*small_qkv())
        assert len(calls) == 1
    # A policy may turn it off.
    calls = []
    handler = sequence(httpx.Response(500, text="Internal Server Error"), calls=calls)
    policy = RetryPolicy(retry_infrastructure_500=False)
    with (
        client_for(handler, sleep=Sleeps(), retry=policy) as client,
        pytest.raises(SDPAServerError),
    ):
        client.attention(*small_qkv())
    assert len(calls) == 1


def test_no_retry_once_the_requests_own_deadline_has_passed() -> None:
    clock = [0.0]
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        clock[0] += 1.5  # each attempt takes 1.5 s
        return problem(503, "Queue full", headers={"retry-after": "1"})

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    policy = RetryPolicy(max_attempts=10, max_total_s=60.0, retry_after_spread=0.0)
    with client_for(handler, sleep=sleep, clock=lambda: clock[0], retry=policy) as client:
        # timeout_ms 4000: sent at 0, again at 2.5 (1.5 + 1), then 5 >= 4: given up.
        with pytest.raises(SDPAUnavailable):
            client.attention(*small_qkv(), timeout_ms=4000)
        assert len(calls) == 2
        calls.clear()
        clock[0] = 0.0
        # Without a deadline of its own, the total budget alone bounds it.
        with pytest.raises(SDPAUnavailable):
            client.attention(*small_qkv())
        assert len(calls) == 10


def test_non_json_error_body() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(httpx.Response(502, text="<html>bad gateway</html>"), calls=calls)
    with (
        client_for(handler, retry=RetryPolicy(max_attempts=1)) as client,
        pytest.raises(SDPAServerError) as ei,
    ):
        client.attention(*small_qkv())
    assert ei.value.status == 502
    assert "bad gateway" in ei.value.detail
    assert ei.value.errors == []


# ---- only what was asked for: return_output, v2's per-head outputs ----------------------------


def test_v1_sends_return_output_only_when_false_and_reads_a_null_output() -> None:
    seen: list[dict[str, Any]] = []
    with client_for(attention_server(seen)) as client:
        whole = client.attention(*small_qkv())
        bare = client.attention(*small_qkv(), return_output=False)
    assert "return_output" not in seen[0]["body"]  # a server older than the field takes it
    assert seen[1]["body"]["return_output"] is False
    assert whole.output is not None
    assert bare.output is None
    assert bare.diagnostics is not None
    np.testing.assert_array_equal(bare.diagnostics.per_head["entropy"], [[0.5, 0.5]])


def test_a_missing_output_is_malformed_only_when_it_was_asked_for() -> None:
    for payload in ({"output": None, "weights": None, "diagnostics": None}, {"weights": None}):
        with pytest.raises(SDPAProtocolError, match="no 'output'"):
            parse_attention_response(payload)
        assert parse_attention_response(payload, return_output=False).output is None
    q, k, v = small_qkv()

    def no_output(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"output": None, "weights": None, "diagnostics": None})

    with client_for(no_output) as client, pytest.raises(SDPAProtocolError):
        client.attention(q, k, v)


def v2_server(seen: list[dict[str, Any]]) -> Handler:
    """/v2/models/attention/infer answering each named output with binary data: "output" the
    float64 reference, a per-head statistic [B, H] filled with its position in the list (FP32;
    masked_rows INT64), the summary as parameters."""

    def handle(request: httpx.Request) -> httpx.Response:
        length = int(request.headers["inference-header-content-length"])
        header = json.loads(request.content[:length])
        seen.append(header)
        shapes = {inp["name"]: inp["shape"] for inp in header["inputs"]}
        b, h = shapes["q"][:2]
        entries, chunks = [], []
        for i, out in enumerate(header["outputs"]):
            name = out["name"]
            if name == "output":
                q, k, v = small_qkv()
                array, datatype = reference_attention(q, k, v)[0].astype("<f4"), "FP32"
            elif name == "masked_rows_per_head":
                array, datatype = np.full((b, h), i, dtype="<i8"), "INT64"
            else:
                array, datatype = np.full((b, h), i + 0.5, dtype="<f4"), "FP32"
            raw = array.tobytes()
            entries.append({"name": name, "datatype": datatype, "shape": list(array.shape),
                            "parameters": {"binary_data_size": len(raw)}})  # fmt: skip
            chunks.append(raw)
        params = {**SUMMARY, "path": "chunked", "device": "cpu"}
        reply = json.dumps({"model_name": "attention", "model_version": "1",
                            "parameters": params, "outputs": entries}).encode()  # fmt: skip
        return httpx.Response(
            200,
            content=reply + b"".join(chunks),
            headers={"inference-header-content-length": str(len(reply))},
        )

    return handle


@pytest.mark.parametrize("return_output", [True, False])
@pytest.mark.parametrize("diagnostics", ["none", "summary", "full"])
def test_v2_names_the_outputs_asked_for_and_reads_the_per_head_ones(
    diagnostics: str, return_output: bool
) -> None:
    seen: list[dict[str, Any]] = []
    with client_for(v2_server(seen), protocol="v2") as client:
        level: Any = diagnostics
        result = client.attention(*small_qkv(), diagnostics=level, return_output=return_output)
    names = [out["name"] for out in seen[0]["outputs"]]
    per_head_names = [f"{stat}_per_head" for stat in PER_HEAD_STAT_NAMES]
    expected = [
        *(["output"] if return_output else []),
        *(PER_ROW_STAT_NAMES if diagnostics == "full" else ()),
        *(per_head_names if diagnostics != "none" else ()),
    ]
    assert names == expected
    assert (result.output is not None) == return_output
    if diagnostics == "none":
        return
    diag = result.diagnostics
    assert diag is not None
    assert list(diag.per_head) == list(PER_HEAD_STAT_NAMES)
    for stat in PER_HEAD_STAT_NAMES:
        value = diag.per_head[stat]
        assert value.shape == (1, 2), stat
        at = names.index(f"{stat}_per_head")
        if stat == "masked_rows":
            assert value.dtype == np.int64
            np.testing.assert_array_equal(value, [[at, at]])
        else:
            np.testing.assert_array_equal(value, [[at + 0.5, at + 0.5]])
    assert (diag.per_row is None) == (diagnostics == "summary")
    assert isinstance(diag.summary, SummaryStats)


def test_v2_reads_an_answer_without_output_only_when_it_was_not_asked_for() -> None:
    def without_output(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"model_name": "attention", "outputs": []})

    with client_for(without_output, protocol="v2") as client:
        assert client.attention(*small_qkv(), return_output=False).output is None
        with pytest.raises(SDPAProtocolError, match="no 'output'"):
            client.attention(*small_qkv())


def test_the_request_builder_carries_return_output_on_either_protocol() -> None:
    q, k, v = small_qkv()
    v1 = RequestBuilder().attention(q, k, v, return_output=False)
    assert v1.body is not None
    assert v1.body["return_output"] is False
    assert "return_output" not in (RequestBuilder().attention(q, k, v).body or {})
    body, headers = build_infer_request(q, k, v, diagnostics="none", return_output=False,
                                        return_weights=True)  # fmt: skip
    header = json.loads(body[: int(headers["Inference-Header-Content-Length"])])
    assert [out["name"] for out in header["outputs"]] == ["weights"]


# ---- async ------------------------------------------------------------------------------------


def test_async_client_retries_and_computes() -> None:
    calls: list[httpx.Request] = []
    seen: list[dict[str, Any]] = []
    compute = attention_server(seen)
    pending = [problem(503, "Queue full", headers={"retry-after": "1"})]

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return pending.pop(0) if pending else compute(request)

    delays: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        delays.append(seconds)

    async def run() -> Any:
        async with AsyncSDPAClient(
            "http://sdpa.test", transport=httpx.MockTransport(handler), sleep=fake_sleep,
            retry=RetryPolicy(retry_after_spread=0.0),
        ) as client:  # fmt: skip
            return await client.attention(*small_qkv(), diagnostics="full")

    result = asyncio.run(run())
    assert len(calls) == 2
    assert delays == [1.0]
    assert seen[0]["body"]["diagnostics"] == "full"
    q, k, v = small_qkv()
    np.testing.assert_allclose(result.output, reference_attention(q, k, v)[0], rtol=1e-5)


def test_errors_survive_pickling() -> None:
    err = SDPAUnavailable(
        503, "Queue full", "try later", errors=[FieldProblem(("body", "q"), "x")], retry_after_s=2.0
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SDPAUnavailable
    expected = (503, "Queue full", "try later", 2.0)
    assert (back.status, back.title, back.detail, back.retry_after_s) == expected
    assert back.errors == err.errors
    assert str(back) == str(err)


@pytest.mark.parametrize("base_url", ["localhost:8000", "http://[::1", "ftp://host", "/v1"])
def test_a_base_url_that_is_not_http_is_refused_at_once(base_url: str) -> None:
    with pytest.raises(ValueError, match="base_url"):
        SDPAClient(base_url)
    with pytest.raises(ValueError, match="base_url"):
        AsyncSDPAClient(base_url)
