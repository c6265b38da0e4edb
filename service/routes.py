"""Which path is which: the one owner of the open paths (no API key), the unmetered ones (no
in-flight bytes, no span), and the Open Inference Protocol's. (What a request carries between
the rooms is its Exchange: service.serving.exchange.)

The middlewares (service.middleware), the routes (service.api), the error envelopes
(service.http_errors) and the OpenAPI document read these; none of them keeps a list of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any, Final

from service.wire.v2_models import MODEL_NAME, MODEL_VERSION

# The probes of both protocols: orchestrators, and KServe's and Triton's, probe v2's.
PROBE_PATHS: Final = frozenset(
    {
        "/healthz",
        "/readyz",
        "/v2/health/live",
        "/v2/health/ready",
        f"/v2/models/{MODEL_NAME}/ready",
        f"/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/ready",
    }
)
# Open without an API key (when keys are configured): the server's own probes and the explorer
# page with its assets. The model's readiness stays behind the key, as its metadata does.
OPEN_PATHS: Final = frozenset({"/healthz", "/readyz", "/", "/v2/health/live", "/v2/health/ready"})
OPEN_PREFIXES: Final = ("/static/",)
# Exempt from the in-flight bytes (service.middleware.inflight): the probes and the metrics
# scrape must answer however full the server is.
UNMETERED_PATHS: Final = PROBE_PATHS | {"/metrics"}


def route_path(scope: Mapping[str, Any]) -> str:
    """The path the app's router matches: scope["path"] less the scope's root_path (an app
    mounted under a prefix, or behind Ray's route prefix, sees the whole path in "path").
    Every rule of this module is about routes, so a middleware asks with this, never with
    scope["path"] itself: otherwise /prefix/metrics would pass a check made for /metrics.
    The same rule as Starlette's router (starlette._utils.get_route_path, 0.4x)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


def is_open(path: str) -> bool:
    """Whether `path` is served without an API key."""
    # Static asset paths are normalized by the UI route, which 404s anything leaving static/.
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class Envelope(Enum):
    """How a door words its errors over HTTP."""

    PROBLEM = "problem+json"  # v1 and everything not v2: RFC 9457
    V2 = "v2"  # the Open Inference Protocol: {"error": "..."}, as its clients parse it


def is_v2_path(path: str) -> bool:
    """Whether `path` is served by the Open Inference Protocol (v2 REST)."""
    return path == "/v2" or path.startswith("/v2/")


def envelope_of(path: str) -> Envelope:
    """The error envelope of the door that serves `path`: chosen here, once."""
    return Envelope.V2 if is_v2_path(path) else Envelope.PROBLEM
