"""Optional API-key authentication: a pure ASGI middleware.

Keys come from SDPA_API_KEYS / SDPA_API_KEYS_FILE (Settings.resolved_api_keys()); create_app
installs this middleware only when at least one key is configured. A caller presents its key as
`Authorization: Bearer <key>` or `X-API-Key: <key>`. Health endpoints stay open so that
orchestrator probes (Docker HEALTHCHECK, kubelet) never need a secret. The explorer page (GET /)
and its static assets stay open too: they are public code and hold no data, a browser cannot
attach a key when it opens a page, and every API call the page makes carries the key the user
typed into it.

A request presents exactly one key: several (two X-API-Key headers, or a Bearer token beside
an X-API-Key) are refused without trying any, so that one request is one guess and the refusal
count in sdpa_rejected_total{reason="unauthorized"} counts guesses.

A request whose key matched belongs to that key's tenant (service.tenants): its name goes into
the request's Exchange (service.serving.exchange), where serving (the queue's fair shares) and
the recorder (sdpa_requests_total{tenant}, the log, the span) read it; a refused request stays
"anonymous", and is marked refused, so that nothing of its trace context is read.

Keys are compared in constant time (service.tenants.Keyring), as the gRPC door compares them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from service.http_errors import service_error_response
from service.metrics import Metrics
from service.routes import is_open, route_path
from service.serving.exchange import exchange_of
from service.tenants import Keyring, presented_keys, refusal


class ApiKeyMiddleware:
    """Reject HTTP requests without a valid API key with 401 (in the path's error envelope).

    `keys` maps each key to its tenant's name. The open paths (service.routes) pass without
    one, as do non-HTTP scopes (lifespan). `metrics`, when given, counts refusals as
    sdpa_rejected_total{reason="unauthorized"}.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: Mapping[str, str],
        metrics: Metrics | None = None,
        guarded_elsewhere: Collection[str] = (),
    ) -> None:
        self.app = app
        # Paths another key guards (/metrics: service.middleware.metrics_key).
        self.guarded_elsewhere = frozenset(guarded_elsewhere)
        self.keyring = Keyring(keys)
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or is_open(route_path(scope))
            or route_path(scope) in self.guarded_elsewhere
        ):
            await self.app(scope, receive, send)
            return
        # Header values are Latin-1 on the wire; a configured key is printable ASCII.
        presented = presented_keys(
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in scope.get("headers", ())
        )
        tenant = self.keyring.tenant_of(presented)
        exchange = exchange_of(scope)
        if tenant is not None:
            exchange.tenant = tenant
            await self.app(scope, receive, send)
            return
        exchange.key_refused = True
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="unauthorized").inc()
        await service_error_response(refusal(presented))(scope, receive, send)
