"""tritonclient.grpc (unchanged) against a real `sdpa-service serve` on loopback, over the Open
Inference Protocol's gRPC door (SDPA_GRPC_PORT, a free port here).

The truth: the float64 reference of tests/core/reference.py (tests.support.v2_cases), and for
the batched calls each request's answer computed alone, bit for bit. API keys are configured:
every call but the probes carries one in its metadata.

Bounded: every wait has a deadline, every loop a count; loopback only.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.test_v2_sdpa_client import per_head_mean
from tests.support.app import API_SERVER_ENV
from tests.support.live_server import LiveServer, free_port, live_server
from tests.support.v2_cases import (
    FLOAT_DATATYPES,
    Case,
    assert_close,
    expected,
    make_case,
    mask_cases,
)

grpcclient = pytest.importorskip("tritonclient.grpc")
grpcaio = pytest.importorskip("tritonclient.grpc.aio")
httpaio = pytest.importorskip("tritonclient.http.aio")
httpclient = pytest.importorskip("tritonclient.http")
utils = pytest.importorskip("tritonclient.utils")

pytestmark = pytest.mark.xdist_group("grpc-live")

API_KEY = "grpc-live-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
PER_ROW = ("entropy", "max_weight", "effective_keys", "lse", "visible_keys")


class GrpcServer:
    """A live server and the address of its gRPC door."""

    def __init__(self, server: LiveServer, grpc_port: int, *, key: str | None = None) -> None:
        self.server = server
        self.target = f"127.0.0.1:{grpc_port}"
        self.http_headers = {} if key is None else {"Authorization": f"Bearer {key}"}

    def metric(self, name: str, **labels: str) -> float:
        """The sum of /metrics samples of `name` whose labels include `labels`."""
        text = httpx.get(f"{self.server.url}/metrics", timeout=10, headers=self.http_headers).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            sample, _, value = line.rpartition(" ")
            if sample.split("{")[0] != name:
                continue
            if all(f'{key}="{val}"' in sample for key, val in labels.items()):
                total += float(value)
        return total


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    port = free_port()
    env = {**API_SERVER_ENV, "SDPA_API_KEYS": API_KEY, "SDPA_GRPC_PORT": str(port)}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("grpc-live")) as server:
        yield GrpcServer(server, port, key=API_KEY)


@pytest.fixture(scope="module")
def client(door: GrpcServer) -> Iterator[Any]:
    c = grpcclient.InferenceServerClient(door.target)
    yield c
    c.close()


def grpc_inputs(case: Case) -> list[Any]:
    inputs = []
    for name, array, datatype in case.inputs():
        inp = grpcclient.InferInput(name, list(array.shape), datatype)
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return inputs


def infer(client: Any, case: Case, *, outputs: tuple[str, ...] = (), **kw: Any) -> Any:
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs] or None
    return client.infer(
        "attention",
        grpc_inputs(case),
        outputs=requested,
        parameters=case.request_parameters() or None,
        headers=kw.pop("headers", AUTH),
        **kw,
    )


def refused(call: Any) -> Any:
    with pytest.raises(utils.InferenceServerException) as info:
        call()
    return info.value


# ---- metadata and health -------------------------------------------------------------------


def test_server_and_model_metadata_and_readiness(client: Any, door: GrpcServer) -> None:
    assert client.is_server_live()  # the probes need no key
    assert client.is_server_ready()
    assert client.is_model_ready("attention", headers=AUTH)
    assert client.is_model_ready("attention", "1", headers=AUTH)
    assert not client.is_model_ready("other-model", headers=AUTH)
    meta = client.get_server_metadata(headers=AUTH, as_json=True)
    assert meta["name"] == "sdpa-service"
    assert "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("attention", "1", headers=AUTH, as_json=True)
    rest = httpx.get(
        f"{door.server.url}/v2/models/attention", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()
    assert (model["name"], model["versions"], model["platform"]) == (
        rest["name"], rest["versions"], rest["platform"],
    )  # fmt: skip
    for side in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in model[side]] == [
            (t["name"], t["datatype"], t["shape"]) for t in rest[side]
        ]
    error = refused(lambda: client.get_model_metadata("attention"))
    assert error.status() == "StatusCode.UNAUTHENTICATED"


# ---- every datatype, every mask ------------------------------------------------------------


@pytest.mark.parametrize("datatype", FLOAT_DATATYPES)
def test_every_datatype(client: Any, datatype: str) -> None:
    case = make_case((2, 2, 5, 8), datatype=datatype, causal=True)
    result = infer(client, case, outputs=("output", "lse"))
    want = expected(case)
    out = result.get_output("output")
    assert out.datatype == datatype
    got = result.as_numpy("output")
    assert got.dtype == case.q.dtype
    assert_close(got, want.output, datatype)
    lse = result.as_numpy("lse")
    assert lse.dtype == (np.float64 if datatype == "FP64" else np.float32)
    np.testing.assert_allclose(lse, want.rows.lse, rtol=1e-4, atol=1e-3)


MASK_CASES = mask_cases()


@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_mask_options(client: Any, name: str) -> None:
    """Every mask option (INT32 and INT64 key_lengths, BOOL masks, a float mask with -inf),
    GQA and fully masked rows; weights and the per-row statistics by name."""
    case = MASK_CASES[name]
    result = infer(client, case, outputs=("output", "weights", *PER_ROW))
    names = [o.name for o in result.get_response().outputs]
    assert names == ["output", "weights", *PER_ROW]
    want = expected(case)
    assert_close(result.as_numpy("output"), want.output, "FP32")
    assert_close(result.as_numpy("weights"), want.weights, "FP32")
    np.testing.assert_array_equal(result.as_numpy("visible_keys"), want.rows.visible_keys)
    np.testing.assert_allclose(result.as_numpy("entropy"), want.rows.entropy, atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("max_weight"), want.rows.max_weight, atol=1e-5)
    lse = result.as_numpy("lse")
    masked = want.rows.visible_keys == 0
    assert np.isneginf(lse[masked]).all()  # -inf travels as itself in raw bytes
    np.testing.assert_allclose(lse[~masked], want.rows.lse[~masked], rtol=1e-5, atol=1e-4)
    if name == "fully_masked":
        assert masked.sum() == 4 * 6
        assert not result.as_numpy("output")[1].any()


# ---- diagnostics as parameters, outputs by name --------------------------------------------


def _params(result: Any) -> dict[str, Any]:
    return {
        key: getattr(value, value.WhichOneof("parameter_choice"))
        for key, value in result.get_response().parameters.items()
    }


def test_no_outputs_named_means_output_only(client: Any) -> None:
    result = infer(client, make_case((1, 2, 4, 8)))
    assert [o.name for o in result.get_response().outputs] == ["output"]
    params = _params(result)
    assert params["path"] == "fused"
    assert {"device", "batch_size", "queue_ms", "compute_ms"} <= set(params)
    assert "entropy" not in params


def test_summary_statistics_are_response_parameters(client: Any) -> None:
    case = make_case((2, 2, 6, 8), key_lengths=np.array([6, 0], dtype=np.int64),
                     parameters={"diagnostics": "summary"})  # fmt: skip
    params = _params(infer(client, case))
    rows = expected(case).rows
    active = rows.visible_keys > 0
    assert params["masked_rows"] == int((~active).sum()) == 12
    assert params["entropy"] == pytest.approx(rows.entropy[active].mean(), abs=1e-5)
    assert params["max_weight"] == pytest.approx(rows.max_weight[active].mean(), abs=1e-5)
    assert params["path"] == "chunked"


def test_diagnostics_full_and_per_head_outputs(client: Any) -> None:
    case = make_case((2, 3, 6, 8), (2, 3, 7, 8), key_lengths=np.array([5, 0], dtype=np.int64),
                     causal="bottom_right", parameters={"diagnostics": "full"})  # fmt: skip
    full = infer(client, case)
    names = [o.name for o in full.get_response().outputs]
    assert names[0] == "output"
    assert "weights" not in names
    assert set(names[1:]) >= {"entropy", "lse", "visible_keys", "sink_share"}
    per_head = infer(client, case, outputs=("entropy_per_head", "masked_rows_per_head"))
    rows = expected(case).rows
    np.testing.assert_allclose(
        per_head.as_numpy("entropy_per_head"),
        per_head_mean(rows.entropy, rows.visible_keys),
        rtol=1e-5,
        atol=1e-6,
    )
    assert per_head.as_numpy("masked_rows_per_head").dtype == np.int64
    assert per_head.as_numpy("output") is None


def test_request_id_priority_timeout_and_compression(client: Any) -> None:
    case = make_case((1, 2, 4, 8), causal="bottom_right")
    want = expected(case).output
    for algorithm in (None, "gzip", "deflate"):
        result = infer(
            client, case, request_id=f"req-{algorithm}", priority=1, timeout=5_000_000,
            compression_algorithm=algorithm,
        )  # fmt: skip
        assert result.get_response().id == f"req-{algorithm}"
        assert_close(result.as_numpy("output"), want, "FP32")


# ---- bad requests, each with its status ----------------------------------------------------


def test_bad_requests_with_their_status_codes(client: Any, door: GrpcServer) -> None:
    good = make_case((1, 2, 4, 8))
    invalid: list[tuple[Case, dict[str, Any], tuple[str, ...]]] = [
        (make_case((1, 2, 4, 8), (1, 2, 4, 4)), {}, ("input 'k'", "head dim")),
        (good, {"parameters": {"casual": True}}, ("unknown parameter 'casual'", "'causal'")),
        (good, {"parameters": {"causal": "diagonal"}}, ("parameter 'causal'",)),
        (good, {"parameters": {"scale": 0.1, "temperature": 2.0}}, ("'temperature'",)),
        (good, {"parameters": {"tag": "bad tag!"}}, ("parameter 'tag'",)),
        (make_case((1, 2, 4, 8), key_lengths=np.array([9], dtype=np.int64)), {},
         ("input 'key_lengths'",)),
    ]  # fmt: skip
    for case, kw, words in invalid:
        params = {**case.request_parameters(), **kw.get("parameters", {})}
        error = refused(
            lambda case=case, params=params: client.infer(
                "attention", grpc_inputs(case), parameters=params, headers=AUTH
            )
        )
        assert error.status() == "StatusCode.INVALID_ARGUMENT", error.message()
        for word in words:
            assert word in error.message(), error.message()
    error = refused(lambda: infer(client, good, outputs=("attention_probs",)))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unknown output 'attention_probs'" in error.message()
    # Another model: NOT_FOUND.
    error = refused(lambda: client.infer("bert", grpc_inputs(good), headers=AUTH))
    assert error.status() == "StatusCode.NOT_FOUND"
    # A passed deadline (1 µs): DEADLINE_EXCEEDED, never computed.
    error = refused(lambda: infer(client, good, timeout=1))
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    # Over SDPA_MAX_ELEMENTS (65536 here): INVALID_ARGUMENT naming the limit.
    error = refused(lambda: infer(client, make_case((1, 1, 300, 256))))  # 0.9 MB of inputs
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "SDPA_MAX_ELEMENTS" in error.message()
    # A message over SDPA_MAX_BODY_BYTES (1 MiB here): RESOURCE_EXHAUSTED from gRPC itself.
    error = refused(lambda: infer(client, make_case((1, 4, 1024, 64))))
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"
    # No key, a wrong one: UNAUTHENTICATED.
    for headers in ({}, {"x-api-key": "nope"}):
        error = refused(lambda headers=headers: infer(client, good, headers=headers))
        assert error.status() == "StatusCode.UNAUTHENTICATED"
    # The key as x-api-key works as the Bearer token does.
    assert_close(
        infer(client, good, headers={"x-api-key": API_KEY}).as_numpy("output"),
        expected(good).output,
        "FP32",
    )
    # Counted under the gRPC route, by the REST door's status, for the key's tenant.
    assert door.metric("sdpa_requests_total", route="grpc:ModelInfer", status="400") >= 8
    assert door.metric("sdpa_requests_total", route="grpc:ModelInfer", status="504") >= 1
    assert door.metric("sdpa_requests_total", route="grpc:ModelInfer", status="401") >= 2
    log = door.server.log()
    assert '"route":"grpc:ModelInfer"' in log
    assert '"grpc_status":"INVALID_ARGUMENT"' in log
    assert "Traceback" not in log


# ---- calls that wait: cancel, deadline, batching with REST ---------------------------------


@pytest.fixture(scope="module")
def holding(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    """A server whose worker waits up to 1.5 s for a batch to grow: calls sent together share a
    batch, and a call stays queued long enough to be cancelled there."""
    port = free_port()
    env = {
        **API_SERVER_ENV,
        "SDPA_GRPC_PORT": str(port),
        "SDPA_MAX_BATCH_DELAY_MS": "1500",
        "SDPA_MAX_BATCH_SIZE": "64",
    }
    with live_server(env, tmp_path=tmp_path_factory.mktemp("grpc-holding")) as server:
        yield GrpcServer(server, port)


def _wait_for(check: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s} s")
        time.sleep(0.01)


def test_a_cancelled_call_is_dropped_before_compute(holding: GrpcServer) -> None:
    client = grpcclient.InferenceServerClient(holding.target)
    dropped = holding.metric("sdpa_rejected_total", reason="disconnected")
    computed = holding.metric("sdpa_batch_size_sum")
    answers: list[Any] = []
    context = client.async_infer(
        "attention", grpc_inputs(make_case((1, 2, 4, 8))),
        callback=lambda result, error: answers.append((result, error)),
    )  # fmt: skip
    _wait_for(lambda: holding.metric("sdpa_queue_depth") == 1, "the call was never queued")
    context.cancel()
    _wait_for(lambda: holding.metric("sdpa_queue_depth") == 0, "the call never left the queue")
    _wait_for(lambda: bool(answers), "the client never heard of its cancellation")
    result, error = answers[0]
    assert result is None
    assert "CANCELLED" in error.status()
    # Counted as dropped while queued: never handed to the device.
    assert holding.metric("sdpa_rejected_total", reason="disconnected") == dropped + 1
    assert holding.metric("sdpa_batch_size_sum") == computed
    client.close()


def test_a_client_deadline_drops_the_queued_call(holding: GrpcServer) -> None:
    client = grpcclient.InferenceServerClient(holding.target)
    computed = holding.metric("sdpa_batch_size_sum")
    error = refused(lambda: infer(client, make_case((1, 2, 4, 8)), headers={}, client_timeout=0.4))
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    _wait_for(lambda: holding.metric("sdpa_queue_depth") == 0, "the call never left the queue")
    assert holding.metric("sdpa_batch_size_sum") == computed
    client.close()


def test_grpc_and_rest_calls_share_batches(holding: GrpcServer) -> None:
    """Waves of 3 gRPC and 3 REST v2 calls of one shape sent together, nothing else in flight:
    every answer of a wave says batch_size 6, so each batch held both doors' calls."""
    cases = [make_case((1, 2, 6, 8), seed=100 + i) for i in range(6)]

    async def wave() -> list[tuple[str, Any]]:
        grpc_c = grpcaio.InferenceServerClient(holding.target)
        http_c = httpaio.InferenceServerClient(holding.server.url.removeprefix("http://"))
        try:

            async def by_grpc(case: Case) -> tuple[str, Any]:
                return "grpc", await grpc_c.infer("attention", grpc_inputs(case))

            async def by_rest(case: Case) -> tuple[str, Any]:
                inputs = []
                for name, array, datatype in case.inputs():
                    inp = httpclient.InferInput(name, list(array.shape), datatype)
                    inp.set_data_from_numpy(array, binary_data=True)
                    inputs.append(inp)
                return "rest", await http_c.infer("attention", inputs)

            calls = [by_grpc(c) for c in cases[:3]] + [by_rest(c) for c in cases[3:]]
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=60)
        finally:
            await grpc_c.close()
            await http_c.close()

    for _ in range(3):
        answers = asyncio.run(wave())
        sizes = []
        for (door, result), case in zip(answers, cases, strict=True):
            assert_close(result.as_numpy("output"), expected(case).output, "FP32")
            if door == "grpc":
                sizes.append(_params(result)["batch_size"])
            else:
                sizes.append(result.get_response()["parameters"]["batch_size"])
        assert sizes == [6] * 6


@pytest.fixture(scope="module")
def batching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    port = free_port()
    env = {**API_SERVER_ENV, "SDPA_GRPC_PORT": str(port), "SDPA_MAX_BATCH_DELAY_MS": "20"}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("grpc-batching")) as server:
        yield GrpcServer(server, port)


def test_200_concurrent_mixed_length_grpc_calls_beside_rest_equal_their_solo_answers(
    batching: GrpcServer,
) -> None:
    """200 gRPC calls of mixed lengths and options and 50 REST v2 calls at once: every answer
    right against float64; every gRPC answer what the same call gets alone (bit for bit when it
    ran alone here too; within float32 rounding, as tests/e2e/test_batching.py holds v1 to,
    when it shared a batch: a batch pads and stacks its items, and the kernels' sums then run
    in another order, 2e-7 apart at most seen); some gRPC calls batched; every call computed
    exactly once."""
    rng = np.random.default_rng(2027)
    cases = []
    for i in range(200):
        n_q, n_kv = (int(x) for x in rng.integers(1, 17, size=2))
        options: dict[str, Any] = {}
        if i % 3 == 0:
            options["causal"] = "bottom_right"
        if i % 5 == 0:
            options["key_lengths"] = np.array([int(rng.integers(0, n_kv + 1))], dtype=np.int64)
        cases.append(make_case((1, 2, n_q, 8), (1, 2, n_kv, 8), seed=i, **options))
    rest_cases = [make_case((1, 2, 8, 8), seed=1000 + i) for i in range(50)]
    computed = batching.metric("sdpa_batch_size_sum")

    async def run_all() -> tuple[list[Any], list[Any]]:
        grpc_c = grpcaio.InferenceServerClient(batching.target)
        http_c = httpaio.InferenceServerClient(
            batching.server.url.removeprefix("http://"), conn_limit=50
        )
        try:

            async def by_grpc(case: Case) -> Any:
                return await grpc_c.infer(
                    "attention", grpc_inputs(case), parameters=case.request_parameters() or None
                )

            async def by_rest(case: Case) -> Any:
                inputs = []
                for name, array, datatype in case.inputs():
                    inp = httpclient.InferInput(name, list(array.shape), datatype)
                    inp.set_data_from_numpy(array, binary_data=True)
                    inputs.append(inp)
                return await http_c.infer("attention", inputs)

            grpc_all = asyncio.gather(*(by_grpc(c) for c in cases))
            rest_all = asyncio.gather(*(by_rest(c) for c in rest_cases))
            return await asyncio.wait_for(asyncio.gather(grpc_all, rest_all), timeout=180)
        finally:
            await grpc_c.close()
            await http_c.close()

    grpc_results, rest_results = asyncio.run(run_all())
    for case, result in zip(rest_cases, rest_results, strict=True):
        assert_close(result.as_numpy("output"), expected(case).output, "FP32")
    sizes = [_params(result)["batch_size"] for result in grpc_results]
    assert max(sizes) > 1, "no gRPC call was batched"
    assert batching.metric("sdpa_batch_size_sum") - computed == len(cases) + len(rest_cases)
    # Alone, one at a time: the same bits.
    solo = grpcclient.InferenceServerClient(batching.target)
    try:
        for case, result in zip(cases, grpc_results, strict=True):
            got = result.as_numpy("output")
            assert_close(got, expected(case).output, "FP32")
            alone = solo.infer(
                "attention", grpc_inputs(case), parameters=case.request_parameters() or None
            )
            assert _params(alone)["batch_size"] == 1
            if _params(result)["batch_size"] == 1:
                np.testing.assert_array_equal(got, alone.as_numpy("output"))
            else:
                np.testing.assert_allclose(got, alone.as_numpy("output"), atol=2e-6, rtol=2e-5)
    finally:
        solo.close()


# ---- SIGTERM with calls in flight ----------------------------------------------------------

HEADS, N, D = 8, 2048, 32  # [H, N, D]: about 0.1 s of CPU each, run alone (tests/e2e/test_shutdown)
IN_FLIGHT = 6


def _big_case(seed: int) -> tuple[Case, np.ndarray]:
    """A 6 MiB call and the float64 reference for query row 0 of every head."""
    case = make_case((HEADS, N, D), seed=seed)
    q, k, v = (x.astype(np.float64) for x in (case.q, case.k, case.v))
    scores = np.einsum("hd,hnd->hn", q[:, 0], k) / np.sqrt(D)  # [H, N_kv]
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return case, np.einsum("hn,hnd->hd", p, v)  # [H, D_v]


class _Call(threading.Thread):
    """One gRPC call on its own channel; keeps the result or the error."""

    def __init__(self, target: str, case: Case) -> None:
        super().__init__(daemon=True)
        self.target, self.case = target, case
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        client = grpcclient.InferenceServerClient(self.target)
        try:
            self.result = client.infer("attention", grpc_inputs(self.case), client_timeout=120)
        except BaseException as exc:
            self.error = exc
        finally:
            client.close()


def _admitted(server: GrpcServer) -> float:
    """Calls the batcher holds or has started: queued plus one per batch (each runs alone)."""
    return server.metric("sdpa_queue_depth") + server.metric("sdpa_batch_size_count")


def test_sigterm_answers_every_call_in_flight_refuses_new_ones_and_exits_0(
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {"SDPA_DRAIN_TIMEOUT_S": "120", "SDPA_GRPC_PORT": str(port)}
    with live_server(env, tmp_path=tmp_path) as live:
        server = GrpcServer(live, port)
        calls = [_big_case(seed) for seed in range(IN_FLIGHT)]
        threads = [_Call(server.target, case) for case, _ in calls]
        for thread in threads:
            thread.start()
        _wait_for(lambda: _admitted(server) >= IN_FLIGHT, "the calls were never admitted", 60)

        live.process.send_signal(signal.SIGTERM)

        # New calls while it drains and until its gRPC port closes (bounded).
        late: list[str] = []
        probe = grpcclient.InferenceServerClient(server.target)
        small = make_case((1, 2, 4, 8))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(late) < 200 and live.process.poll() is None:
            try:
                probe.infer("attention", grpc_inputs(small), client_timeout=10)
                late.append("OK")
            except utils.InferenceServerException as exc:
                late.append(str(exc.status()))
            time.sleep(0.02)
        probe.close()

        for thread in threads:
            thread.join(timeout=120)
        code = live.process.wait(timeout=60)

    assert code == 0, live.log()[-3000:]
    for thread, (_, want) in zip(threads, calls, strict=True):
        assert thread.error is None, repr(thread.error)
        output = thread.result.as_numpy("output")
        assert output.shape == (HEADS, N, D)
        np.testing.assert_allclose(output[:, 0], want, rtol=1e-4, atol=1e-5)
    # Everything sent after the signal was refused: UNAVAILABLE (draining, or no listener).
    assert late, "no call was attempted after the signal"
    assert set(late) <= {"StatusCode.UNAVAILABLE"}, late
    messages = re.findall(r'"msg":"([^"]*)"', live.log())
    assert "draining" in messages
    assert "drained" in messages
