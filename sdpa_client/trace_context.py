"""The caller's trace context, as the headers that carry it to sdpa-service.

When opentelemetry is installed in the caller's process, every request of the clients
(SDPAClient, AsyncSDPAClient), of the load tester and of the tap carries the context that is
current where the request is made: W3C `traceparent` (and `tracestate`, baggage...), as the
caller's configured propagators write it (opentelemetry.propagate.inject). The service continues
that trace: its span for the request is a child of the caller's span. With no span current,
nothing is added.

opentelemetry is not a dependency: it is looked for once, at the first request, through
importlib (the client imports nothing beyond numpy and httpx), and its absence costs a call
that returns an empty dict.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, MutableMapping

_Inject = Callable[[MutableMapping[str, str]], None]

# None: not looked for yet; False: not installed; else opentelemetry.propagate.inject.
_inject: _Inject | bool | None = None


def _injector() -> _Inject | None:
    global _inject
    if _inject is None:
        try:
            _inject = importlib.import_module("opentelemetry.propagate").inject
        except ImportError:
            _inject = False
    return None if isinstance(_inject, bool) else _inject


def trace_headers() -> dict[str, str]:
    """The current trace context as headers ({} without opentelemetry or a current span)."""
    headers: dict[str, str] = {}
    inject = _injector()
    if inject is not None:
        inject(headers)
    return headers
