"""The gRPC door in process: create_app()'s state and the door's grpc.aio server on a loopback
port in one event loop (on a thread of this process, as `serve` runs them in its loop), called
by tritonclient.grpc (the independent client) and by a raw grpc.aio channel where a test reads
trailing metadata or cancels a call. No subprocess.

The truth: the float64 reference (tests.support.v2_cases) and the REST door's own answer to the
same request in the same app; statuses as DESIGN.md fixes them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import httpx
import numpy as np
import pytest
import torch
from grpc import aio

from sdpa_core.kernels import flash_kernel
from service.api.deps import state_of
from service.api.grpc import build_server
from service.api.v2 import MODEL_METADATA
from service.app import create_app
from service.runtime.engine import Engine
from service.runtime.jobs import Outcome, PreparedJob
from service.serving.state import AppState
from service.settings import Settings
from service.wire.grpc import grpc_predict_v2_pb2 as pb
from tests.support.app import ReadyEngine, ready_engine, small_settings
from tests.support.v2_cases import Case, assert_close, expected, make_case, mask_cases

tritongrpc = pytest.importorskip("tritonclient.grpc")
tritonhttp = pytest.importorskip("tritonclient.http")
service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
tritonutils = pytest.importorskip("tritonclient.utils")

T = TypeVar("T")
KEY = "grpc-servicer-key"
AUTH = {"authorization": f"Bearer {KEY}"}
INFER = "/inference.GRPCInferenceService/ModelInfer"


class InProcessDoor:
    """An app and its gRPC door, serving on 127.0.0.1 from an event loop on a thread."""

    def __init__(self, settings: Settings, *, engine: Engine | None = None) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.failed: BaseException | None = None
        self.port = 0
        self.state: AppState | None = None
        self.app = create_app(
            settings, engine=engine if engine is not None else ready_engine(settings)
        )
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="grpc-door", daemon=True)

    def __enter__(self) -> InProcessDoor:
        self._thread.start()
        if not self.started.wait(120):
            raise TimeoutError("the in-process door did not start within 120 s")
        if self.failed is not None:
            raise self.failed
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            async with self.app.router.lifespan_context(self.app):
                state = self.state = state_of(self.app)
                deadline = time.monotonic() + 90
                while state.not_ready_reason() is not None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(state.not_ready_reason())
                    await asyncio.sleep(0.02)
                server, self.port = build_server(state, host="127.0.0.1", port=0)
                await server.start()
                self.started.set()
                await self._stop.wait()
                await server.stop(None)
        except BaseException as exc:
            self.failed = exc
            self.started.set()

    def run(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float = 60.0) -> T:
        """make() run in the door's loop (grpc.aio channels and the app's ASGI live there)."""
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> Any:
        return tritongrpc.InferenceServerClient(self.target)

    def sample(self, name: str, **labels: str) -> float:
        assert self.state is not None
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)


@pytest.fixture(scope="module")
def door() -> Iterator[InProcessDoor]:
    with InProcessDoor(small_settings(api_keys=f"team-a={KEY}")) as d:
        yield d


def triton_inputs(case: Case) -> list[Any]:
    inputs = []
    for name, array, datatype in case.inputs():
        inp = tritongrpc.InferInput(name, list(array.shape), datatype)
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return inputs


def infer(client: Any, case: Case, *, outputs: tuple[str, ...] = (), **kw: Any) -> Any:
    requested = [tritongrpc.InferRequestedOutput(name) for name in outputs] or None
    return client.infer(
        "attention",
        triton_inputs(case),
        outputs=requested,
        parameters=case.request_parameters() or None,
        headers=kw.pop("headers", AUTH),
        **kw,
    )


def refused(call: Callable[[], object]) -> Any:
    with pytest.raises(tritonutils.InferenceServerException) as info:
        call()
    return info.value


def raw_request(case: Case) -> bytes:
    """The ModelInferRequest tritonclient sends for `case`, serialized."""
    from tritonclient.grpc._utils import _get_inference_request

    request = _get_inference_request(
        model_name="attention", inputs=triton_inputs(case), model_version="", request_id="",
        outputs=None, sequence_id=0, sequence_start=False, sequence_end=False, priority=0,
        timeout=None, parameters=case.request_parameters() or None,
    )  # fmt: skip
    return bytes(request.SerializeToString())


# ---- metadata and readiness -----------------------------------------------------------------


def test_metadata_and_readiness_as_tritonclient_reads_them(door: InProcessDoor) -> None:
    client = door.client()
    # The probes are open, as the HTTP probes are.
    assert client.is_server_live()
    assert client.is_server_ready()
    # The rest needs the key.
    assert client.is_model_ready("attention", headers=AUTH)
    assert client.is_model_ready("attention", "1", headers=AUTH)
    assert not client.is_model_ready("bert", headers=AUTH)
    assert not client.is_model_ready("attention", "2", headers=AUTH)
    error = refused(lambda: client.is_model_ready("attention"))
    assert error.status() == "StatusCode.UNAUTHENTICATED"
    assert "missing API key" in error.message()
    server = client.get_server_metadata(headers=AUTH, as_json=True)
    assert server["name"] == "sdpa-service"
    assert "binary_tensor_data" in server["extensions"]
    # The model's metadata is the REST door's (the same app, over its ASGI interface), field
    # for field.
    model = client.get_model_metadata("attention", headers=AUTH, as_json=True)

    async def rest_metadata() -> Any:
        transport = httpx.ASGITransport(app=door.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            response = await http.get("/v2/models/attention", headers=AUTH)
            return response.json()

    want = door.run(rest_metadata)
    assert want == MODEL_METADATA
    assert model["name"] == want["name"]
    assert model["versions"] == want["versions"]
    assert model["platform"] == want["platform"]
    for side in ("inputs", "outputs"):
        got = [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in model[side]]
        assert got == [(t["name"], t["datatype"], t["shape"]) for t in want[side]], side
    error = refused(lambda: client.get_model_metadata("bert", headers=AUTH))
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "'attention'" in error.message()
    client.close()


# ---- answers --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["key_lengths_int32", "attn_mask_float", "bottom_right", "gqa"])
def test_answers_against_float64_and_the_rest_door(door: InProcessDoor, name: str) -> None:
    case = mask_cases()[name]
    client = door.client()
    result = infer(client, case, outputs=("output", "lse"))
    want = expected(case)
    got = result.as_numpy("output")
    assert_close(got, want.output, "FP32")
    np.testing.assert_allclose(
        result.as_numpy("lse")[want.rows.visible_keys > 0],
        want.rows.lse[want.rows.visible_keys > 0],
        rtol=1e-5,
        atol=1e-4,
    )
    client.close()

    # The REST door's answer to the same request, in the same app: the same bytes.
    async def rest_answer() -> Any:
        http_inputs = []
        for input_name, array, datatype in case.inputs():
            inp = tritonhttp.InferInput(input_name, list(array.shape), datatype)
            inp.set_data_from_numpy(array, binary_data=True)
            http_inputs.append(inp)
        from tritonclient.http._utils import _get_inference_request

        outputs = [  # the same outputs: the same path (lse asks for the chunked one)
            tritonhttp.InferRequestedOutput(out, binary_data=True) for out in ("output", "lse")
        ]
        body, json_size = _get_inference_request(
            inputs=http_inputs, request_id="", outputs=outputs, sequence_id=0,
            sequence_start=False, sequence_end=False, priority=0, timeout=None,
            custom_parameters=case.request_parameters() or None,
        )  # fmt: skip
        headers = {**AUTH, "Inference-Header-Content-Length": str(json_size)}
        transport = httpx.ASGITransport(app=door.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            response = await http.post("/v2/models/attention/infer", content=body, headers=headers)
        assert response.status_code == 200, response.text
        result = tritonhttp.InferResult.from_response_body(
            response.content, header_length=int(response.headers["Inference-Header-Content-Length"])
        )
        return result.as_numpy("output")

    rest = door.run(rest_answer)
    np.testing.assert_array_equal(got, rest)


def test_response_parameters_carry_meta_and_summary(door: InProcessDoor) -> None:
    case = make_case(
        (2, 2, 6, 8), key_lengths=np.array([6, 0], dtype=np.int64),
        parameters={"diagnostics": "summary"},
    )  # fmt: skip
    client = door.client()
    result = infer(client, case, request_id="req-42")
    response = result.get_response()
    assert response.id == "req-42"
    assert (response.model_name, response.model_version) == ("attention", "1")
    params = {
        k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.parameters.items()
    }
    # Statistics without weights: flash where this process has built a flash kernel (a test
    # before this one may have: compile_kernels() is process-wide), else chunked.
    flash = flash_kernel(torch.device("cpu")).tile is not None
    assert params["path"] == ("flash" if flash else "chunked")
    assert params["batch_size"] >= 1
    assert response.parameters["batch_size"].WhichOneof("parameter_choice") == "int64_param"
    assert {"device", "queue_ms", "compute_ms", "request_id"} <= set(params)
    rows = expected(case).rows
    active = rows.visible_keys > 0
    assert params["masked_rows"] == int((~active).sum()) == 12
    assert params["entropy"] == pytest.approx(rows.entropy[active].mean(), abs=1e-5)
    client.close()


# ---- statuses, the log line and the metrics -------------------------------------------------


def test_bad_requests_are_invalid_argument_naming_what_is_wrong(door: InProcessDoor) -> None:
    client = door.client()
    before = door.sample(
        "sdpa_requests_total", route="grpc:ModelInfer", status="400", tenant="team-a"
    )
    cases = [
        (make_case((1, 2, 4, 8), (1, 2, 4, 4)), {}, "input 'k'"),
        (make_case((1, 2, 4, 8), parameters={"casual": True}), {}, "unknown parameter 'casual'"),
        (make_case((1, 2, 4, 8), parameters={"diagnostics": "all"}), {}, "parameter 'diagnostics'"),
        (make_case((1, 2, 4, 8)), {"outputs": ("attention_probs",)}, "unknown output"),
    ]
    for case, kw, words in cases:
        error = refused(lambda case=case, kw=kw: infer(client, case, **kw))
        assert error.status() == "StatusCode.INVALID_ARGUMENT", error.message()
        assert words in error.message()
    nan_case = make_case((1, 2, 4, 8))
    nan_case.q[0, 0, 0, 0] = np.nan
    error = refused(lambda: infer(client, nan_case))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'q'" in error.message()
    after = door.sample(
        "sdpa_requests_total", route="grpc:ModelInfer", status="400", tenant="team-a"
    )
    assert after - before == len(cases) + 1
    # ...and the door still serves.
    good = make_case((1, 2, 4, 8))
    assert_close(infer(client, good).as_numpy("output"), expected(good).output, "FP32")
    client.close()


def test_api_keys_in_metadata(door: InProcessDoor) -> None:
    client = door.client()
    case = make_case((1, 1, 3, 4))
    for headers, words in (
        ({}, "missing API key"),
        ({"authorization": "Bearer wrong"}, "invalid API key"),
        ({"x-api-key": "wrong"}, "invalid API key"),
        ({"authorization": f"Bearer {KEY}", "x-api-key": KEY}, "2 API keys presented"),
    ):
        error = refused(lambda headers=headers: infer(client, case, headers=headers))
        assert error.status() == "StatusCode.UNAUTHENTICATED"
        assert words in error.message()
    assert infer(client, case, headers={"x-api-key": KEY}).as_numpy("output").shape == (1, 1, 3, 4)
    unauthorized = door.sample(
        "sdpa_requests_total", route="grpc:ModelInfer", status="401", tenant="anonymous"
    )
    assert unauthorized >= 4
    assert door.sample("sdpa_rejected_total", reason="unauthorized") >= 4
    client.close()


def test_access_log_line_and_request_id(
    door: InProcessDoor, caplog: pytest.LogCaptureFixture
) -> None:
    case = make_case((1, 1, 3, 4))
    raw = raw_request(case)

    async def call(metadata: tuple[tuple[str, str], ...]) -> tuple[Any, Any, Any]:
        async with aio.insecure_channel(door.target) as channel:
            rpc = channel.unary_unary(INFER)(raw, metadata=metadata)
            try:
                answer = await rpc
                return answer, dict(await rpc.trailing_metadata()), None
            except grpc.aio.AioRpcError as exc:
                return None, None, exc

    with caplog.at_level(logging.INFO, logger="sdpa.access"):
        answer, trailing, _ = door.run(
            lambda: call((*AUTH.items(), ("x-request-id", "trace-me-1")))
        )
        _, _, error = door.run(lambda: call((("x-request-id", "trace-me-2"),)))
    # The answer's trailing metadata: its id, and where its time went (as REST's Server-Timing).
    assert trailing["x-request-id"] == "trace-me-1"
    phases = dict(part.strip().split(";dur=") for part in trailing["server-timing"].split(","))
    assert set(phases) == {"read", "decode", "queue", "compute", "dispatch", "encode"}
    assert all(float(ms) >= 0 for ms in phases.values())
    assert (
        service_pb2.ModelInferResponse.FromString(answer).parameters["request_id"].string_param
        == "trace-me-1"
    )
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ("x-request-id", "trace-me-2") in tuple(error.trailing_metadata())
    lines = {
        r.json_fields["request_id"]: r.json_fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "sdpa.access"
    }
    ok, refused_line = lines["trace-me-1"], lines["trace-me-2"]
    assert ok["route"] == "grpc:ModelInfer"
    assert (ok["status"], ok["grpc_status"], ok["tenant"]) == (200, "OK", "team-a")
    assert ok["batch_size"] == 1
    assert ok["client"] == "127.0.0.1"
    assert (refused_line["status"], refused_line["grpc_status"]) == (401, "UNAUTHENTICATED")
    assert door.sample("sdpa_request_duration_seconds_count", route="grpc:ModelInfer") >= 2


def test_a_message_over_the_body_limit_is_resource_exhausted(door: InProcessDoor) -> None:
    """SDPA_MAX_BODY_BYTES (1 MiB here) bounds a message as it bounds a body: gRPC refuses it
    before it is read whole, and tritonclient sees RESOURCE_EXHAUSTED."""
    client = door.client()
    big = make_case((1, 4, 1024, 64))  # 3 MiB of FP32
    error = refused(lambda: infer(client, big))
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert str(door.settings.max_body_bytes) in error.message()
    small = make_case((1, 1, 3, 4))
    assert_close(infer(client, small).as_numpy("output"), expected(small).output, "FP32")
    client.close()


def test_a_passed_timeout_parameter_is_deadline_exceeded(door: InProcessDoor) -> None:
    client = door.client()
    error = refused(lambda: infer(client, make_case((1, 1, 3, 4)), timeout=1))  # 1 µs
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert (
        door.sample("sdpa_requests_total", route="grpc:ModelInfer", status="504", tenant="team-a")
        >= 1
    )
    client.close()


# ---- deadlines, cancellation and a full queue: jobs that wait --------------------------------


@pytest.fixture(scope="module")
def slow_door() -> Iterator[InProcessDoor]:
    """Jobs wait 2 s in the queue for company (SDPA_MAX_BATCH_DELAY_MS); one place in it."""
    with InProcessDoor(small_settings(max_batch_delay_ms=2000, max_queue=1)) as d:
        yield d


async def _queued(door: InProcessDoor, count: int) -> None:
    assert door.state is not None
    deadline = time.monotonic() + 10
    while door.sample("sdpa_queue_depth") != count:
        assert time.monotonic() < deadline, "the queue never reached the expected depth"
        await asyncio.sleep(0.005)


def _computed(door: InProcessDoor) -> float:
    return door.sample("sdpa_batch_size_count")


def test_a_cancelled_call_leaves_the_queue_uncomputed(slow_door: InProcessDoor) -> None:
    raw = raw_request(make_case((1, 1, 3, 4)))
    computed_before = _computed(slow_door)
    dropped_before = slow_door.sample("sdpa_rejected_total", reason="disconnected")

    async def scenario() -> grpc.StatusCode:
        async with aio.insecure_channel(slow_door.target) as channel:
            call = channel.unary_unary(INFER)(raw)
            await _queued(slow_door, 1)
            call.cancel()
            await _queued(slow_door, 0)
            return await call.code()

    assert slow_door.run(scenario) == grpc.StatusCode.CANCELLED
    # Counted only for a job taken out while still queued (DynamicBatcher.submit): it was never
    # handed to the device.
    assert slow_door.sample("sdpa_rejected_total", reason="disconnected") == dropped_before + 1
    assert _computed(slow_door) == computed_before


def test_a_grpc_deadline_drops_the_queued_job(slow_door: InProcessDoor) -> None:
    """The client's 0.3 s deadline passes while the job waits for company: the queue's own
    timer (the gRPC deadline, earlier than SDPA_REQUEST_TIMEOUT_MS) or the call's cancellation
    takes it out, whichever comes first; either way it is never computed."""
    client = slow_door.client()
    computed_before = _computed(slow_door)

    def dropped() -> float:
        return sum(
            slow_door.sample("sdpa_rejected_total", reason=reason)
            for reason in ("deadline", "disconnected")
        )

    dropped_before = dropped()
    error = refused(lambda: infer(client, make_case((1, 1, 3, 4)), headers={}, client_timeout=0.3))
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    slow_door.run(lambda: _queued(slow_door, 0))
    assert dropped() == dropped_before + 1
    assert _computed(slow_door) == computed_before
    client.close()


def test_a_full_queue_is_resource_exhausted_with_retry_after(slow_door: InProcessDoor) -> None:
    raw = raw_request(make_case((1, 1, 3, 4)))

    async def scenario() -> tuple[Any, grpc.aio.AioRpcError]:
        async with aio.insecure_channel(slow_door.target) as channel:
            method = channel.unary_unary(INFER)
            first = asyncio.ensure_future(method(raw))
            await _queued(slow_door, 1)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await method(raw)
            return await first, info.value

    answered, error = slow_door.run(scenario)
    assert service_pb2.ModelInferResponse.FromString(answered).outputs[0].name == "output"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in error.details()
    assert "retry after" in error.details()
    retry = dict(error.trailing_metadata())["retry-after"]
    assert int(retry) >= 1


def test_draining_answers_unavailable(slow_door: InProcessDoor) -> None:
    """Last in this module: the batcher drains, as SIGTERM makes it (tests/e2e/test_grpc_live.py
    sends the signal itself)."""
    client = slow_door.client()
    assert slow_door.state is not None
    assert slow_door.state.batcher is not None
    batcher = slow_door.state.batcher
    slow_door.run(lambda: batcher.drain(5.0))
    assert not client.is_server_ready()
    assert not client.is_model_ready("attention")
    error = refused(lambda: infer(client, make_case((1, 1, 3, 4)), headers={}))
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert "shutting down" in error.message()
    client.close()


# ---- tracing --------------------------------------------------------------------------------


def test_a_call_with_a_traceparent_is_one_server_span_with_its_phases(door: InProcessDoor) -> None:
    """Tracing on (an in-memory exporter given to the app's Tracing and its recorder, which
    the door hands each finished call): ModelInfer continues the caller's trace from its
    metadata; its phases are children; a refusal is the caller's error, not the server's."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from service.tracing import Tracing

    exporter = InMemorySpanExporter()
    tracing = Tracing(exporters=[exporter])
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traceparent = f"00-{trace_id}-{parent_id}-01"
    assert door.state is not None
    door.state.tracing = door.state.recorder.tracing = tracing
    try:
        client = door.client()
        case = make_case((1, 2, 4, 8))
        infer(client, case, headers={**AUTH, "traceparent": traceparent})
        refused(lambda: infer(client, make_case((1, 2, 4, 8), (1, 2, 4, 4))))
        client.close()
        assert tracing.force_flush(timeout_s=10)
    finally:
        door.state.tracing = door.state.recorder.tracing = None
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.name == "inference.GRPCInferenceService/ModelInfer"]
    assert len(servers) == 2
    ok = next(s for s in servers if s.attributes["rpc.grpc.status_code"] == 0)
    bad = next(s for s in servers if s.attributes["rpc.grpc.status_code"] == 3)
    assert f"{ok.context.trace_id:032x}" == trace_id
    assert f"{ok.parent.span_id:016x}" == parent_id
    assert ok.attributes["rpc.method"] == "ModelInfer"
    assert ok.attributes["sdpa.batch_size"] == 1
    children = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == ok.context.span_id),
        key=lambda s: s.start_time,
    )
    assert [s.name for s in children] == ["read", "decode", "queue", "compute", "encode"]
    assert all(ok.start_time <= s.start_time <= s.end_time <= ok.end_time for s in children)
    assert bad.status.is_unset  # INVALID_ARGUMENT: the caller's error
    assert f"{bad.context.trace_id:032x}" != trace_id  # no traceparent: a trace of its own
    tracing.shutdown()


# ---- a bug of ours --------------------------------------------------------------------------


class EngineWithABug(ReadyEngine):
    """A CPU engine that fails (a RuntimeError, as a bug would) every batch holding a job whose
    head dim is 7; every other batch it runs as the real engine does."""

    def run_batch(self, jobs: Sequence[PreparedJob]) -> list[Outcome | BaseException]:
        if any(job.spec.d == 7 for job in jobs):
            return [RuntimeError("a bug of ours (injected)") for _ in jobs]
        return super().run_batch(jobs)


def test_a_bug_is_internal_with_the_request_id_and_the_door_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with InProcessDoor(small_settings(), engine=EngineWithABug(torch.device("cpu"))) as door:
        client = door.client()
        with caplog.at_level(logging.ERROR, logger="sdpa.grpc"):
            error = refused(
                lambda: infer(client, make_case((1, 1, 3, 7)), headers={}, request_id="r")
            )
        assert error.status() == "StatusCode.INTERNAL"
        assert "internal server error; request id" in error.message()
        assert "injected" not in error.message()  # the traceback goes to the log only
        logged = [r for r in caplog.records if r.name == "sdpa.grpc"]
        assert logged
        assert logged[0].exc_info is not None
        assert "a bug of ours (injected)" in str(logged[0].exc_info[1])
        assert door.sample("sdpa_requests_total", route="grpc:ModelInfer", status="500",
                           tenant="anonymous") == 1  # fmt: skip
        good = make_case((1, 1, 3, 4))
        assert_close(infer(client, good, headers={}).as_numpy("output"), expected(good).output,
                     "FP32")  # fmt: skip
        client.close()


# ---- a malformed deadline -------------------------------------------------------------------


def raw_infer_status(port: int, grpc_timeout: str) -> tuple[str | None, str | None]:
    """A ModelInfer of a message with no inputs by hand (h2 on a socket: grpc's client sends no
    malformed grpc-timeout) -> (grpc-status, grpc-message) of its answer."""
    import socket
    import struct

    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    conn.initiate_connection()
    headers = [
        (":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"),
        (":path", "/inference.GRPCInferenceService/ModelInfer"),
        ("content-type", "application/grpc"), ("te", "trailers"),
        ("grpc-timeout", grpc_timeout), *AUTH.items(),
    ]  # fmt: skip
    conn.send_headers(1, headers)
    message = pb.ModelInferRequest(model_name="attention").SerializeToString()
    conn.send_data(1, struct.pack(">?I", False, len(message)) + message, end_stream=True)
    answer: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(conn.data_to_send())
        while "grpc-status" not in answer:
            data = sock.recv(1 << 16)
            assert data, "the server closed the connection without a status"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    answer.update(dict(event.headers))
            sock.sendall(conn.data_to_send())
    return answer.get("grpc-status"), answer.get("grpc-message")


def test_grpc_core_itself_answers_a_grpc_timeout_it_cannot_parse(door: InProcessDoor) -> None:
    """The contract this door lives with (grpcio 1.85): grpc-core's HPACK parser refuses a
    grpc-timeout it cannot parse ("abc", no unit, a sign) and ends the call INTERNAL before any
    Python runs, and it keeps grpc-timeout out of the metadata a handler sees: no handler of
    ours can answer it INVALID_ARGUMENT. Should an upgrade change that, this fails. A
    well-formed one reaches the request's validation (no inputs: INVALID_ARGUMENT)."""
    for value in ("abc", "5", "-1S"):
        status, message = raw_infer_status(door.port, value)
        assert status == str(grpc.StatusCode.INTERNAL.value[0]), value
        assert message == "Error parsing 'grpc-timeout' metadata", value
    status, message = raw_infer_status(door.port, "10S")
    assert status == str(grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert message is not None
    assert "inputs" in message
