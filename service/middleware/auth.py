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

A request whose key matched belongs to that key's tenant (service.tenants): its name goes to
scope["state"]["tenant"], where the routes, the queue's fair shares and the access log's
sdpa_requests_total{tenant} read it; a refused request stays "anonymous".

Comparison is constant time in the key's content and length: both sides are hashed to a fixed
32-byte SHA-256 digest and compared with hmac.compare_digest against every configured key,
accumulating the result without an early exit, so neither timing nor the order of keys reveals
which key (or which prefix of a key) matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.errors import service_error_response
from service.errors import Unauthorized
from service.metrics import Metrics

DEFAULT_OPEN_PATHS: frozenset[str] = frozenset({"/healthz", "/readyz", "/"})
DEFAULT_OPEN_PREFIXES: tuple[str, ...] = ("/static/",)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


class ApiKeyMiddleware:
    """Reject HTTP requests without a valid API key with 401 problem+json.

    `keys` maps each key to its tenant's name. `open_paths` are matched exactly against the
    request path, `open_prefixes` as prefixes. Non-HTTP scopes (lifespan) pass.
    `metrics`, when given, counts refusals as sdpa_rejected_total{reason="unauthorized"}.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: Mapping[str, str],
        open_paths: frozenset[str] = DEFAULT_OPEN_PATHS,
        open_prefixes: tuple[str, ...] = DEFAULT_OPEN_PREFIXES,
        metrics: Metrics | None = None,
    ) -> None:
        if not keys:
            # An empty key set would lock everyone out; create_app skips the middleware instead.
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes
        self.metrics = metrics
        self._key_digests: tuple[tuple[bytes, str], ...] = tuple(
            (_digest(key), keys[key]) for key in sorted(keys)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        presented = _presented_keys(scope)
        tenant = self._tenant_of(presented[0]) if len(presented) == 1 else None
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, send)
            return
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="unauthorized").inc()
        if len(presented) > 1:
            detail = f"{len(presented)} API keys presented, none tried: send exactly one"
        else:
            detail = "invalid API key" if presented else "missing API key"
        error = Unauthorized(f"{detail}, as 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
        await service_error_response(error)(scope, receive, send)

    def _is_open(self, path: str) -> bool:
        # Static asset paths are normalized by the UI route, which 404s anything leaving static/.
        return path in self.open_paths or path.startswith(self.open_prefixes)

    def _tenant_of(self, candidate: str) -> str | None:
        """The tenant of the configured key equal to `candidate`, None when none is."""
        candidate_digest = _digest(candidate)
        tenant = None
        for key_digest, name in self._key_digests:
            # Every comparison runs, whatever matched before; the names are no secret.
            if hmac.compare_digest(candidate_digest, key_digest):
                tenant = name
        return tenant


def _presented_keys(scope: Scope) -> list[str]:
    """The non-empty keys the request carries (Bearer token and/or X-API-Key)."""
    keys: list[str] = []
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.lower()
        if name == b"authorization":
            scheme, _, token = raw_value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                keys.append(token.strip())
        elif name == b"x-api-key":
            value = raw_value.decode("latin-1").strip()
            if value:
                keys.append(value)
    return keys
