"""POST /v1/health/observe during a drain: refused 503 with Retry-After, as a compute request is,
rather than recorded into series the last scrape may never read."""

from __future__ import annotations

import copy
import time

from fastapi.testclient import TestClient

from service.app import create_app
from service.wire.observe import OBSERVE_EXAMPLE
from tests.support.app import ready_engine, small_settings


def test_an_observation_during_the_drain_is_refused_503() -> None:
    settings = small_settings()
    app = create_app(settings, engine=ready_engine(settings))
    with TestClient(app, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "not ready within 60 s"
            time.sleep(0.02)
        body = copy.deepcopy(OBSERVE_EXAMPLE)
        before = client.post("/v1/health/observe", json=body)
        assert before.status_code == 200, before.text
        assert before.json() == {"recorded": 1, "tags": ["minilm/layer0"]}

        batcher = app.state.sdpa.batcher
        assert client.portal is not None
        client.portal.call(batcher.drain, 1.0)
        during = client.post("/v1/health/observe", json=body)
        assert during.status_code == 503, during.text
        assert "shutting down" in during.json()["detail"]
        assert float(during.headers["retry-after"]) > 0
