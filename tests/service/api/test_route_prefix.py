"""An app served under a route prefix (mounted, or behind Ray's route prefix: the scope's
root_path) applies every route rule to the route, not to the whole path: /sdpa/metrics is
/metrics to the metrics key, /sdpa/readyz is a probe open without a key, and /sdpa/v2/... is
answered in v2's envelope."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.routes import route_path
from tests.support.app import ready_engine, small_settings

PREFIX = "/sdpa"
TENANT_KEY = "tenant-a-key-0123456789"
METRICS_KEY = "metrics-key-0123456789"


@pytest.fixture(scope="module")
def prefixed() -> Iterator[TestClient]:
    settings = small_settings(api_keys=f"a={TENANT_KEY}", metrics_key=METRICS_KEY)
    app = create_app(settings, engine=ready_engine(settings))
    with TestClient(app, root_path=PREFIX, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while client.get(f"{PREFIX}/readyz").status_code != 200:
            assert time.monotonic() < deadline, "not ready within 60 s"
            time.sleep(0.02)
        yield client


@pytest.mark.parametrize(
    ("path", "root", "route"),
    [
        ("/metrics", "", "/metrics"),
        ("/sdpa/metrics", "/sdpa", "/metrics"),
        ("/sdpa", "/sdpa", ""),
        ("/sdpametrics", "/sdpa", "/sdpametrics"),  # not under the prefix: the whole path
        ("/other/metrics", "/sdpa", "/other/metrics"),
    ],
)
def test_route_path_is_the_path_less_the_root_path(path: str, root: str, route: str) -> None:
    assert route_path({"path": path, "root_path": root}) == route


def test_a_tenants_key_reads_no_metrics_under_a_prefix(prefixed: TestClient) -> None:
    refused = prefixed.get(f"{PREFIX}/metrics", headers={"X-API-Key": TENANT_KEY})
    assert refused.status_code == 401
    assert "SDPA_METRICS_KEY" in refused.json()["detail"]
    assert prefixed.get(f"{PREFIX}/metrics").status_code == 401
    allowed = prefixed.get(f"{PREFIX}/metrics", headers={"X-API-Key": METRICS_KEY})
    assert allowed.status_code == 200
    assert "sdpa_requests_total" in allowed.text


def test_the_probes_stay_open_under_a_prefix(prefixed: TestClient) -> None:
    assert prefixed.get(f"{PREFIX}/healthz").status_code == 200
    assert prefixed.get(f"{PREFIX}/readyz").status_code == 200
    assert prefixed.get(f"{PREFIX}/v2/health/live").status_code == 200


def test_v2_errors_keep_their_envelope_under_a_prefix(prefixed: TestClient) -> None:
    answer = prefixed.post(
        f"{PREFIX}/v2/models/attention/infer",
        content=b"{not json",
        headers={"X-API-Key": TENANT_KEY, "content-type": "application/json"},
    )
    assert answer.status_code == 400
    assert set(answer.json()) == {"error"}
