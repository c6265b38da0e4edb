"""SDPA_METRICS_KEY: GET /metrics answers only that key, never a tenant's.

The metrics name every tenant, every tag (model and layer names) and every count: no tenant's
key may read them. With SDPA_METRICS_KEY set, create_app installs this middleware, and the
tenants' key check (service.middleware.auth) leaves METRICS_PATHS to it. One key is presented,
as on every route (X-API-Key or Authorization: Bearer), and compared in constant time; a
refusal is a 401 counted in sdpa_rejected_total{reason="unauthorized"}.
"""

from __future__ import annotations

from typing import Final

from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import Unauthorized
from service.http_errors import service_error_response
from service.metrics import Metrics
from service.routes import route_path
from service.tenants import Keyring, presented_keys

METRICS_PATHS: Final = frozenset({"/metrics"})


class MetricsKeyMiddleware:
    """Refuse /metrics without the metrics key (401); every other path passes untouched."""

    def __init__(self, app: ASGIApp, *, key: str, metrics: Metrics | None = None) -> None:
        self.app = app
        self.keyring = Keyring({key: "metrics"})
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in METRICS_PATHS:
            await self.app(scope, receive, send)
            return
        presented = presented_keys(
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in scope.get("headers", ())
        )
        if self.keyring.tenant_of(presented) is not None:
            await self.app(scope, receive, send)
            return
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="unauthorized").inc()
        if len(presented) > 1:
            detail = f"{len(presented)} API keys presented, none tried: send exactly one"
        else:
            detail = "invalid metrics key" if presented else "missing metrics key"
        refusal = Unauthorized(
            f"{detail}: /metrics answers SDPA_METRICS_KEY only, as 'Authorization: Bearer <key>' "
            "or 'X-API-Key: <key>'"
        )
        await service_error_response(refusal)(scope, receive, send)
