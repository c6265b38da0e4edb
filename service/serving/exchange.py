"""One request, whichever door it came by: the `Exchange`.

The edge makes one per request (the HTTP stack's outermost middleware, the gRPC servicer), the
rooms it walks through fill it in (the API key check names the tenant, the in-flight bytes put
the request's holding in it, serving its deadline, priority and phases), and once the answer is
sent the one recorder (service.access_log) turns it into the access-log line, the metrics and
the span. Nothing else carries a request's state between rooms, and nothing is called back up
the stack: serving reads and writes this record, it calls nobody above it.

Over HTTP the Exchange travels in the request's ASGI scope under one key, set by the edge and
read through `exchange_of` (typed): the scope is the record ASGI hands every layer of one
request explicitly, so the Exchange goes where the request goes and nowhere else. (A ContextVar
would be implicit, inherited by every task the request starts, and would outlive the request in
the caller's context under an in-process client.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from service.tenants import ANONYMOUS

if TYPE_CHECKING:
    from service.serving.inflight import Holding
    from service.serving.pipeline import Phases

# The one key of ours in an HTTP request's ASGI scope (exchange_of).
_SCOPE_KEY: Final = "sdpa.exchange"


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready; nobody gets a response."""


@dataclass(eq=False, slots=True)
class Exchange:
    """One request and what it came to (module docstring). The edge fills in who asked and when;
    the rooms the rest; the recorder reads it once the answer is sent."""

    # Made by the edge.
    door: str  # "http" or "grpc"
    method: str  # the HTTP method, or the gRPC method's name ("ModelInfer")
    path: str  # the HTTP path, or the gRPC method's full path
    request_id: str  # the caller's X-Request-ID / x-request-id when sane, else a fresh one
    started: float  # time.monotonic() when the request began
    client: str | None = None  # the peer's address
    scheme: str = "http"  # HTTP's URL scheme, and its version ("1.1")
    http_version: str | None = None
    # The caller's W3C trace context (traceparent, tracestate), as received; the recorder reads
    # it only for a caller the API key check did not refuse (`key_refused`).
    trace_context: Sequence[tuple[str, str | bytes]] = ()
    traced: bool = True  # False: no span (the probes and the metrics scrape)
    # The API key check: who asked (ANONYMOUS without keys, or refused), and whether it refused
    # the caller.
    tenant: str = ANONYMOUS
    key_refused: bool = False
    # The in-flight bytes it holds (service.serving.inflight): set by the edge, the answer's
    # reservation by serving; None for requests that hold none (probes).
    holding: Holding | None = None
    # The door's own deadline (time.monotonic(), gRPC's), and what serving made of it with the
    # request's `timeout` and SDPA_REQUEST_TIMEOUT_MS; the priority level the job was queued at.
    deadline: float | None = None
    priority: int | None = None
    received: float | None = None  # time.monotonic() once its body was read
    phases: Phases | None = None  # where a computed request's time went (serving)
    # Registered with the drain until its job reaches the batcher (service.serving.frame).
    queued: Callable[[], None] = field(default=lambda: None)
    # Its client: gone (told by the door's disconnect watch), and whether its job waits in the
    # queue now (set by serving: only then does the watch cancel the request's task).
    client_gone: bool = False
    waiting: bool = False
    # What it came to: the route that served it ("/v1/attention", "grpc:ModelInfer"), its
    # status (HTTP's, or the one REST would answer for a gRPC call), gRPC's own code (name and
    # number), and the exception that escaped, if one did.
    route: str = ""
    status: int | None = None
    grpc_code: tuple[int, str] | None = None
    error: BaseException | None = None

    @property
    def batch_size(self) -> int | None:
        """The batch its job ran in, if it was computed."""
        return None if self.phases is None else self.phases.batch_size


def attach(scope: MutableMapping[str, Any], exchange: Exchange) -> None:
    """Put `exchange` in an HTTP request's scope (the edge, once)."""
    scope[_SCOPE_KEY] = exchange


def exchange_of(scope: Mapping[str, Any]) -> Exchange:
    """The Exchange the edge put in this request's scope. Raises LookupError when there is none:
    an app not built by create_app (our bug)."""
    exchange = scope.get(_SCOPE_KEY)
    if not isinstance(exchange, Exchange):
        raise LookupError("no Exchange in this request's scope: build the app with create_app()")
    return exchange
