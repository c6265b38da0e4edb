"""The service in this process: create_app() behind starlette's TestClient (an httpx.Client
whose transport calls the ASGI app directly, lifespan included), with small limits."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.app import create_app
from service.runtime.device import resolve_device
from service.runtime.engine import Engine
from service.runtime.policy import CostModel
from service.settings import Settings

# Small limits so that the limit cases (and schema-generated requests) stay cheap. The same
# values configure the real server of the e2e tests (as SDPA_* variables).
API_SERVER_ENV: dict[str, str] = {
    "SDPA_DEVICE": "cpu",
    "SDPA_MAX_BODY_BYTES": str(1 << 20),
    "SDPA_MAX_ELEMENTS": str(1 << 16),
    "SDPA_MAX_WEIGHTS_ELEMENTS": str(1 << 16),
    "SDPA_LOG_LEVEL": "warning",
    # The statistics kernel compiles at warm-up for seconds (over a minute on a cold cache of a
    # 16-core GPU machine, past in_process_client's readiness wait); tests/e2e/test_kernel.py
    # and tests/core/test_stats_kernel.py test it. The eager loop computes the same numbers.
    "SDPA_COMPILE_KERNELS": "false",
}


def small_settings(**overrides: object) -> Settings:
    """Settings with API_SERVER_ENV's limits (and `overrides`), read from no environment."""
    values: dict[str, object] = {
        name.removeprefix("SDPA_").lower(): value for name, value in API_SERVER_ENV.items()
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]  # validated (and converted) by pydantic


# The cost model each device measured, once per test process (ReadyEngine).
_COST_MODELS: dict[str, CostModel] = {}


class ReadyEngine(Engine):
    """The engine the app would build, whose warm-up takes the cost model this process
    already measured on the device (the first app's calibration, 48 timed calls): the model
    is the real one, measured once rather than at every app's start."""

    def calibrate(self) -> CostModel:
        model = _COST_MODELS.get(str(self.device))
        if model is None:
            model = _COST_MODELS[str(self.device)] = super().calibrate()
        return model


def ready_engine(settings: Settings) -> Engine:
    """The engine create_app(settings) would build, with the cost model ready: measured here,
    in the caller's thread, when this process has not measured it yet, so that no app's
    warm-up pays it (nor a test that profiles or times the app)."""
    engine = ReadyEngine(resolve_device(settings.device))
    engine.calibrate()
    return engine


@contextmanager
def in_process_client(
    settings: Settings,
    *,
    engine: Engine | None = None,
    headers: Mapping[str, str] | None = None,
    ready_timeout_s: float = 60.0,
) -> Iterator[TestClient]:
    """A client of create_app(settings, engine=engine), once its warm-up made it ready
    (without `engine`, the engine the app would build, its cost model measured once per
    process: ReadyEngine)."""
    app = create_app(settings, engine=engine if engine is not None else ready_engine(settings))
    with TestClient(app, raise_server_exceptions=False, headers=dict(headers or {})) as client:
        deadline = time.monotonic() + ready_timeout_s
        while client.get("/readyz").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the app was not ready within {ready_timeout_s} s")
            time.sleep(0.02)
        yield client


def asgi_scope(method: str, path: str, *, content_length: int = 0) -> dict[str, Any]:
    """The HTTP scope uvicorn gives the app for a JSON request (for tests that drive the ASGI
    app message by message: a stalled or abandoned body, concurrent requests)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(content_length).encode()),
    ]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
        "headers": headers,
    }  # fmt: skip


# Headers that describe the bytes as they travelled, not as the test client hands them over.
_FRAMING = frozenset({"content-encoding", "content-length", "transfer-encoding"})


def app_transport(app_client: TestClient) -> httpx.MockTransport:
    """The app as an httpx transport. starlette's TestClient is built on httpx2 when that is
    installed (its preference; huggingface_hub, which transformers needs, installs it), and an
    httpx.Client cannot use httpx2's transport: each request goes through the test client
    instead, whichever package it is built on."""

    def handle(request: httpx.Request) -> httpx.Response:
        answer = app_client.request(
            request.method,
            request.url.raw_path.decode("ascii"),
            content=request.content,
            headers=dict(request.headers),
        )
        headers = [(k, v) for k, v in answer.headers.multi_items() if k.lower() not in _FRAMING]
        return httpx.Response(answer.status_code, headers=headers, content=answer.content)

    return httpx.MockTransport(handle)


def requests_total(metrics_text: str) -> dict[tuple[str, str], float]:
    """sdpa_requests_total by (route, status), from a /metrics page's text."""
    return {
        (sample.labels["route"], sample.labels["status"]): sample.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "sdpa_requests"
        for sample in family.samples
        if sample.name == "sdpa_requests_total"
    }
