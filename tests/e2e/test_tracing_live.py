"""Tracing end to end: a real `sdpa-service serve` exporting over OTLP/HTTP to a real receiver in
this test (tests/support/otlp_receiver.py decodes what arrives with opentelemetry.proto).

- A request with a W3C traceparent is one SERVER span whose parent is the caller's span, in the
  caller's trace, with children read, decode, queue, compute and encode inside it.
- sdpa_client called inside a span of this process: the server's span continues it; so does
  a gRPC call (tritonclient.grpc) whose metadata carries a traceparent.
- The lifespan's end flushes what the batch processor still holds.
- Off (OTEL_TRACES_EXPORTER unset), the receiver gets nothing, and building the app imports
  neither OpenTelemetry's SDK nor an exporter.
- An OTLP protocol this service cannot speak (grpc) fails start-up, naming the variable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider

from sdpa_client import SDPAClient
from tests.support.app import API_SERVER_ENV
from tests.support.live_server import REPO_ROOT, LiveServer, free_port, live_server
from tests.support.otlp_receiver import (
    SPAN_KIND_INTERNAL,
    SPAN_KIND_SERVER,
    STATUS_UNSET,
    OtlpReceiver,
    ReceivedSpan,
)

PHASES = ["read", "decode", "queue", "compute", "encode"]
SMALL = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0], [0.0, 1.0]], "v": [[1.0, 2.0], [3.0, 4.0]]}
# Spans leave the server's batch processor this often (ms): the tests wait a few of these.
SCHEDULE_DELAY_MS = "100"
WAIT_S = 30.0


def caller_traceparent(trace: int, span: int) -> str:
    return f"00-{trace:032x}-{span:016x}-01"


def tracing_env(receiver: OtlpReceiver, **more: str) -> dict[str, str]:
    return {
        **API_SERVER_ENV,
        "SDPA_GRPC_PORT": "0",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": SCHEDULE_DELAY_MS,
        **more,
    }


def of_trace(trace_id: str) -> Callable[[list[ReceivedSpan]], bool]:
    """wait_for's test: the server span of `trace_id` and its five children have arrived."""

    def done(spans: list[ReceivedSpan]) -> bool:
        return len([s for s in spans if s.trace_id == trace_id]) >= 1 + len(PHASES)

    return done


def request_tree(
    spans: list[ReceivedSpan], trace_id: str
) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The trace's one server span and its children, by start."""
    ours = [s for s in spans if s.trace_id == trace_id]
    (server,) = [s for s in ours if s.kind == SPAN_KIND_SERVER]
    children = sorted(
        (s for s in ours if s.parent_span_id == server.span_id), key=lambda s: s.start_ns
    )
    assert len(ours) == 1 + len(children), [s.name for s in ours]
    return server, children


def assert_phases_inside(server: ReceivedSpan, children: list[ReceivedSpan]) -> None:
    assert [child.name for child in children] == PHASES
    for child in children:
        assert child.kind == SPAN_KIND_INTERNAL
        assert child.trace_id == server.trace_id
        assert server.start_ns <= child.start_ns <= child.end_ns <= server.end_ns, child.name


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def traced_server(
    receiver: OtlpReceiver, grpc_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """A server exporting to `receiver`, its gRPC door on `grpc_port`."""
    with pytest.MonkeyPatch.context() as env:
        for name in [n for n in os.environ if n.startswith("OTEL_")]:
            env.delenv(name)  # only what tracing_env says
        with live_server(
            tracing_env(receiver, SDPA_GRPC_PORT=str(grpc_port)),
            tmp_path=tmp_path_factory.mktemp("traced"),
        ) as server:
            yield server


def test_a_request_with_a_traceparent_is_one_server_span_with_its_phases(
    traced_server: LiveServer, receiver: OtlpReceiver
) -> None:
    trace, parent = 0x5B8AA5A2D2C872E8321CF37308D69DF2, 0x051581BF3CB55C13
    response = httpx.post(
        f"{traced_server.url}/v1/attention",
        json={**SMALL, "diagnostics": "summary"},
        headers={"traceparent": caller_traceparent(trace, parent), "tracestate": "acme=1"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    trace_id = f"{trace:032x}"
    spans = receiver.wait_for(of_trace(trace_id), timeout_s=WAIT_S)
    server, children = request_tree(spans, trace_id)

    assert server.parent_span_id == f"{parent:016x}"
    assert server.name == "POST /v1/attention"
    assert server.status_code == STATUS_UNSET
    assert server.trace_state == "acme=1"
    assert server.attributes["http.route"] == "/v1/attention"
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["sdpa.request_id"] == response.headers["x-request-id"]
    assert server.attributes["sdpa.tenant"] == "anonymous"
    meta = response.json()["meta"]
    assert server.attributes["sdpa.batch_size"] == meta["batch_size"]
    assert server.resource["service.name"] == "sdpa-service"
    assert "service.version" in server.resource

    assert_phases_inside(server, children)
    compute = children[PHASES.index("compute")]
    assert compute.attributes["sdpa.batch_size"] == meta["batch_size"]
    assert compute.attributes["sdpa.path"] == meta["path"]
    # Server-Timing and the trace tell the same story: compute's span lasts compute's dur.
    timing = {
        part.split(";dur=")[0].strip(): float(part.split(";dur=")[1])
        for part in response.headers["server-timing"].split(",")
    }
    assert (compute.end_ns - compute.start_ns) / 1e6 == pytest.approx(timing["compute"], abs=0.01)


def test_sdpa_client_inside_a_span_is_continued_by_the_server(
    traced_server: LiveServer, receiver: OtlpReceiver
) -> None:
    provider = TracerProvider(shutdown_on_exit=False)  # this process's; nothing exported
    tracer = provider.get_tracer("tests.e2e")
    q = np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)
    with SDPAClient(traced_server.url) as client, tracer.start_as_current_span("caller") as span:
        client.attention(q, q, q)
    context = span.get_span_context()
    trace_id = f"{context.trace_id:032x}"
    spans = receiver.wait_for(of_trace(trace_id), timeout_s=WAIT_S)
    server, children = request_tree(spans, trace_id)
    assert server.parent_span_id == f"{context.span_id:016x}"
    assert_phases_inside(server, children)


def test_a_grpc_call_with_a_traceparent_in_its_metadata_is_continued(
    traced_server: LiveServer, receiver: OtlpReceiver, grpc_port: int
) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    trace, parent = 0x6E0C63257DE34C926F9EFCD03927272E, 0x00F067AA0BA902B7
    q = np.random.default_rng(1).standard_normal((1, 2, 4, 8)).astype(np.float32)
    inputs = []
    for name in ("q", "k", "v"):
        tensor = grpcclient.InferInput(name, list(q.shape), "FP32")
        tensor.set_data_from_numpy(q)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        result = client.infer(
            "attention", inputs, headers={"traceparent": caller_traceparent(trace, parent)}
        )
    finally:
        client.close()
    assert result.as_numpy("output") is not None
    trace_id = f"{trace:032x}"
    spans = receiver.wait_for(of_trace(trace_id), timeout_s=WAIT_S)
    server, children = request_tree(spans, trace_id)
    assert server.parent_span_id == f"{parent:016x}"
    assert server.name == "inference.GRPCInferenceService/ModelInfer"
    assert server.attributes["rpc.system"] == "grpc"
    assert server.attributes["rpc.method"] == "ModelInfer"
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert server.status_code == STATUS_UNSET
    assert_phases_inside(server, children)


def test_a_refused_request_is_a_span_without_phases_and_probes_none(
    traced_server: LiveServer, receiver: OtlpReceiver
) -> None:
    trace = 0x0C0FFEE0C0FFEE0C0FFEE0C0FFEE0C0F
    headers = {"traceparent": caller_traceparent(trace, 0x1234)}
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{traced_server.url}{path}", headers=headers).status_code == 200
    invalid = httpx.post(
        f"{traced_server.url}/v1/attention", json={"q": [1.0]}, headers=headers, timeout=30
    )
    assert invalid.status_code == 422
    trace_id = f"{trace:032x}"
    spans = receiver.wait_for(
        lambda spans: any(s.trace_id == trace_id for s in spans), timeout_s=WAIT_S
    )
    time.sleep(3 * int(SCHEDULE_DELAY_MS) / 1000)  # anything else of this trace has come too
    ours = [s for s in receiver.spans() if s.trace_id == trace_id]
    assert [s.name for s in ours] == ["POST /v1/attention"], spans
    assert ours[0].attributes["http.response.status_code"] == 422
    assert ours[0].status_code == STATUS_UNSET  # the caller's error, not the server's


def test_the_end_of_the_lifespan_flushes_the_spans_still_held(
    receiver: OtlpReceiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    env = tracing_env(receiver, OTEL_BSP_SCHEDULE_DELAY="600000")  # never on schedule
    trace = 0x7E57F1A5E7E57F1A5E7E57F1A5E7E57F
    with live_server(env, tmp_path=tmp_path) as server:
        response = httpx.post(
            f"{server.url}/v1/attention",
            json=SMALL,
            headers={"traceparent": caller_traceparent(trace, 0x42)},
            timeout=30,
        )
        assert response.status_code == 200
        time.sleep(0.5)
        assert not any(s.trace_id == f"{trace:032x}" for s in receiver.spans())
        assert server.stop(signal.SIGTERM) == 0
    spans = receiver.wait_for(of_trace(f"{trace:032x}"), timeout_s=WAIT_S)
    server_span, children = request_tree(spans, f"{trace:032x}")
    assert_phases_inside(server_span, children)


def test_off_nothing_is_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_TRACES_EXPORTER unset, everything else pointing at a receiver of this test's own."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    with OtlpReceiver() as receiver:
        env = tracing_env(receiver)
        del env["OTEL_TRACES_EXPORTER"]
        with live_server(env, tmp_path=tmp_path) as server:
            headers = {"traceparent": caller_traceparent(0xABC, 0xDEF)}
            for _ in range(5):
                response = httpx.post(
                    f"{server.url}/v1/attention", json=SMALL, headers=headers, timeout=30
                )
                assert response.status_code == 200
            time.sleep(5 * int(SCHEDULE_DELAY_MS) / 1000)
            assert server.stop(signal.SIGTERM) == 0  # the lifespan's end would flush too
        assert receiver.exports == 0
        assert receiver.refused == 0
        assert receiver.spans() == []


def test_off_building_the_app_imports_no_opentelemetry_sdk() -> None:
    """A fresh interpreter builds the app with tracing off: neither OpenTelemetry's SDK nor an
    exporter is loaded, so no request can reach one. (The API is: FastAPI 0.165 imports it for
    its own telemetry, which stays off while no global provider is set, and we set none.)"""
    code = (
        "import sys\n"
        "from service.app import create_app\n"
        "from service.settings import Settings\n"
        "create_app(Settings())\n"
        "print(sorted(m for m in sys.modules if m.startswith(\n"
        "    ('opentelemetry.sdk', 'opentelemetry.exporter', 'opentelemetry.proto'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SDPA_"))}
    env["SDPA_GRPC_PORT"] = "0"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        check=True, timeout=120,
    )  # fmt: skip
    assert done.stdout.strip() == "[]"


def test_an_otlp_protocol_other_than_http_fails_start_up(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SDPA_"))}
    env.update(
        {**API_SERVER_ENV, "SDPA_GRPC_PORT": "0", "OTEL_TRACES_EXPORTER": "otlp",
         "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
         "--port", str(free_port())],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'" in output
    assert "http/protobuf" in output
