"""SDPA_MAX_INFLIGHT_BYTES: the bytes all requests hold together, bounded.

A request holds the body it has read and the answer bytes it hands to the server until the app
is done with it; after that, what its client has not taken yet waits in the connection's write
buffer (service.middleware.connections counts those of clients that fell behind; the send
timeout frees a client that reads nothing). A new request reserves its declared body
(Content-Length, at most SDPA_MAX_BODY_BYTES) at once; when that does not fit beside the bytes
held, it gets 503 with Retry-After before any of its body is read. Once a request is parsed,
its answer's working set is reserved before it is computed, or the request gets that 503.
Probes and metrics are never refused for it: an orchestrator must still see the process alive,
and an operator why it refuses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import service_error_response
from service.errors import FieldError, InvalidRequest, MemoryBusy, PayloadTooLarge
from service.metrics import Metrics
from service.middleware.body_limit import declared_length
from service.middleware.connections import unsent_bytes

MB: Final = 1e6
# The probes of both protocols (orchestrators and KServe probe v2's) and the metrics.
EXEMPT_PATHS: Final = frozenset(
    {
        "/healthz",
        "/readyz",
        "/metrics",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/attention/ready",
        "/v2/models/attention/versions/1/ready",
    }
)
# The request-state key of a request's reserve_answer(nbytes): it raises MemoryBusy (503) when
# the answer's estimated size would take the bytes in flight over the limit.
RESERVE_ANSWER: Final = "reserve_answer"
# cgroup v2, then v1: the memory the container may use ("max" or a huge number: no limit).
_CGROUP_LIMITS: Final = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def process_memory_limit() -> int:
    """The memory this process may use: its cgroup's limit, else the machine's RAM."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            return int(text)
    return physical


def default_inflight_bytes() -> int:
    """A quarter of the memory the process may use."""
    return process_memory_limit() // 4


class InflightBytesMiddleware:
    """503 for new requests while the requests in flight hold more than `max_bytes`."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        max_body_bytes: int,
        metrics: Metrics | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_body_bytes = max_body_bytes  # SDPA_MAX_BODY_BYTES: no body reads past it
        self.metrics = metrics
        self.held = 0  # bytes all requests in flight hold now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        # The declared body is reserved at once: clients that send their headers together
        # would otherwise all be admitted while nothing is held yet, and read past the limit.
        declared = min(declared_length(scope) or 0, self.max_body_bytes)
        if declared > self.max_bytes:
            await service_error_response(self._body_too_big(declared))(scope, receive, send)
            return
        if self.held + unsent_bytes() + declared > self.max_bytes:
            await self._refuse(scope, receive, send, declared)
            return

        body = 0  # bytes of the body held: declared (reserved), or read (whichever is more)
        answer = 0  # the answer's bytes: reserved, or handed over (whichever is more)
        sent = 0
        received = 0  # bytes of the body read

        def hold(body_now: int, answer_now: int) -> None:
            nonlocal body, answer
            self.held += (body_now - body) + (answer_now - answer)
            body, answer = body_now, answer_now

        def reserve_answer(nbytes: int) -> None:
            # The app reserves what its answer will take before computing it (so a burst of
            # requests admitted together cannot pass the limit together), then shrinks the
            # reservation to the encoded answer. Only growth is checked.
            if body + nbytes > self.max_bytes:
                raise self._too_big(body + nbytes)  # no retry would help: a 422, not a 503
            growth = nbytes - answer
            if growth > 0 and self.held + unsent_bytes() + growth > self.max_bytes:
                raise self._busy(self.held + unsent_bytes() + growth)
            hold(body, max(nbytes, sent))

        scope.setdefault("state", {})[RESERVE_ANSWER] = reserve_answer
        hold(declared, 0)

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                hold(max(declared, received), answer)
            return message

        async def counting_send(message: Message) -> None:
            nonlocal sent
            if message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
                hold(body, max(answer, sent))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            hold(0, 0)

    def _busy(self, in_flight: int) -> MemoryBusy:
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="inflight_bytes").inc()
        return MemoryBusy(
            f"requests in flight hold {in_flight} bytes of bodies and answers, above "
            f"SDPA_MAX_INFLIGHT_BYTES = {self.max_bytes}; retry shortly",
            retry_after_s=1,
        )

    def _too_big(self, nbytes: int) -> InvalidRequest:
        msg = (
            f"this request alone would hold about {nbytes / MB:.3g} MB at its peak (its body, "
            f"inputs, results and encoded answer), above SDPA_MAX_INFLIGHT_BYTES = "
            f"{self.max_bytes / MB:.3g} MB for all requests together; ask for base64, no "
            'weights, diagnostics other than "full", or fewer queries per request'
        )
        return InvalidRequest(
            msg, errors=[FieldError(loc=("body",), msg=msg, type="inflight_limit")]
        )

    def _body_too_big(self, declared: int) -> PayloadTooLarge:
        msg = (
            f"the body ({declared} bytes, Content-Length) is larger than SDPA_MAX_INFLIGHT_BYTES "
            f"= {self.max_bytes} allows all requests together; split the request or send "
            "base64 tensors"
        )
        return PayloadTooLarge(
            msg, errors=[FieldError(loc=("header", "content-length"), msg=msg, type="inflight")]
        )

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, declared: int) -> None:
        error = self._busy(self.held + unsent_bytes() + declared)
        await service_error_response(error)(scope, receive, send)
