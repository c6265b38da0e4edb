"""The client side of tracing: every request of the clients, the load tester and the tap carries
the caller's current trace context (W3C traceparent), as OpenTelemetry's SDK itself writes it,
read from the requests an httpx.MockTransport receives; and without opentelemetry, nothing is
sent and nothing fails.

The spans come from a TracerProvider of the test's own, never the process's global one: the
propagator reads the current span from the context, whichever provider made it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, Tracer

from sdpa_client import AsyncSDPAClient, SDPAClient
from sdpa_client.errors import SDPARequestError
from sdpa_client.loadgen import PRESETS, HttpSender, LoadPlan, Payload, run_load
from sdpa_client.retry import RetryPolicy

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tracer() -> Iterator[Tracer]:
    provider = TracerProvider(shutdown_on_exit=False)  # no processor: nothing is exported
    yield provider.get_tracer("tests.client")
    provider.shutdown()


def traceparent_of(span: Span) -> str:
    """What W3C Trace Context says a request made inside `span` carries."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


class Recorder:
    """A transport's handler: keeps each request, answers `status` with `body`."""

    def __init__(self, status: int = 200, body: object = None) -> None:
        self.requests: list[httpx.Request] = []
        self.status = status
        self.body = {"version": "test"} if body is None else body

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(self.status, json=self.body, headers={"retry-after": "0"})

    async def handle_async(self, request: httpx.Request) -> httpx.Response:
        return self(request)

    def traceparents(self) -> list[str | None]:
        return [request.headers.get("traceparent") for request in self.requests]


def test_the_sync_client_sends_the_current_span_as_traceparent(tracer: Tracer) -> None:
    recorder = Recorder()
    with SDPAClient("http://sdpa.test", transport=httpx.MockTransport(recorder)) as client:
        with tracer.start_as_current_span("caller") as span:
            client.info()
            assert client.readyz()
            expected = traceparent_of(span)
        client.info()  # no span current: no context
    assert recorder.traceparents() == [expected, expected, None]
    assert int(expected[-2:], 16) & 1  # sampled (the SDK's default sampler decided)


def test_the_async_client_sends_the_span_current_in_its_task(tracer: Tracer) -> None:
    recorder = Recorder()

    async def main() -> list[str]:
        transport = httpx.MockTransport(recorder.handle_async)
        async with AsyncSDPAClient("http://sdpa.test", transport=transport) as client:

            async def in_span(name: str) -> str:
                with tracer.start_as_current_span(name) as span:
                    await client.info()
                    return traceparent_of(span)

            # Two tasks at once, each with its own current span.
            return list(await asyncio.gather(in_span("a"), in_span("b")))

    expected = asyncio.run(main())
    assert expected[0] != expected[1]
    assert sorted(recorder.traceparents(), key=str) == sorted(expected)


def test_a_retry_repeats_the_same_traceparent(tracer: Tracer) -> None:
    """The attempts of one call are one operation of the caller's: the same context."""
    recorder = Recorder(status=503, body={"title": "Service Unavailable", "detail": "full"})
    q = np.ones((1, 2, 4), dtype=np.float32)
    with (
        SDPAClient(
            "http://sdpa.test",
            transport=httpx.MockTransport(recorder),
            retry=RetryPolicy(max_attempts=3, backoff_initial_s=0.0, max_total_s=10.0),
            sleep=lambda _: None,
        ) as client,
        tracer.start_as_current_span("caller") as span,
        pytest.raises(SDPARequestError),
    ):
        client.attention(q, q, q)
    assert recorder.traceparents() == [traceparent_of(span)] * 3


def test_the_load_tester_sends_the_context_it_was_run_in(tracer: Tracer) -> None:
    recorder = Recorder()
    payload = Payload.from_preset(PRESETS["small"])

    async def main() -> tuple[str, int]:
        transport = httpx.MockTransport(recorder.handle_async)
        async with HttpSender("http://sdpa.test", payload, transport=transport) as send:
            with tracer.start_as_current_span("load") as span:
                await run_load(send, LoadPlan(concurrency=2, requests=4))
            await run_load(send, LoadPlan(concurrency=1, requests=2))  # none current
            return traceparent_of(span), send.connections

    expected, _ = asyncio.run(main())
    assert recorder.traceparents() == [expected] * 4 + [None] * 2
    # The payload's own headers travel beside it.
    assert {r.headers["content-type"] for r in recorder.requests} == {"application/json"}


def test_the_tap_sends_the_context_of_the_forward_it_sampled(tracer: Tracer) -> None:
    torch = pytest.importorskip("torch")
    from sdpa_client.tap import AttentionTap

    class OneLayer(torch.nn.Module):  # type: ignore[misc,name-defined]
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[name-defined]
            return torch.nn.functional.scaled_dot_product_attention(x, x, x)

    recorder = Recorder(status=503, body={"detail": "busy"})
    model, x = OneLayer(), torch.randn(1, 2, 4, 8)
    with AttentionTap(
        "http://sdpa.test", model="traced", every=1, transport=httpx.MockTransport(recorder)
    ) as tap:
        with tap.attach(model), torch.no_grad():
            with tracer.start_as_current_span("forward") as span:
                model(x)
            model(x)  # outside the span
        assert tap.flush(timeout_s=30)
    # Sent from the tap's own thread, with the context of the forward that was sampled.
    assert recorder.traceparents() == [traceparent_of(span), None]


@pytest.mark.slow  # a fresh interpreter
def test_without_opentelemetry_nothing_is_sent_and_nothing_fails() -> None:
    """A fresh interpreter where opentelemetry cannot be imported (as where it is not
    installed): the requests carry no trace context; and importing the client, or opening
    one, never imports opentelemetry where it is installed: the first request does."""
    code = """
import json, sys
import httpx
import sdpa_client
from sdpa_client import SDPAClient
seen = []
def answer(request):
    seen.append(dict(request.headers))
    return httpx.Response(200, json={"version": "x"})
client = SDPAClient("http://sdpa.test", transport=httpx.MockTransport(answer))
before = "opentelemetry" in sys.modules
if sys.argv[1] == "blocked":
    sys.modules["opentelemetry"] = None  # import opentelemetry.propagate: ImportError
client.info()
client.info()
after = "opentelemetry.propagate" in sys.modules
print(json.dumps({"before": before, "after": after, "headers": seen}))
"""
    results = {}
    for mode in ("blocked", "installed"):
        done = subprocess.run(
            [sys.executable, "-c", code, mode],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        results[mode] = json.loads(done.stdout)
    blocked, installed = results["blocked"], results["installed"]
    assert not blocked["before"]
    assert not installed["before"]
    assert installed["after"]  # looked for at the first request
    for headers in blocked["headers"] + installed["headers"]:
        assert "traceparent" not in headers  # no span current, or no opentelemetry
