"""The bytes that requests in flight hold, every door together, against SDPA_MAX_INFLIGHT_BYTES.

One ledger per application (AppState.inflight). The HTTP door's middleware
(service.middleware.inflight) counts a body as it streams in, what parsing it will hold, and the
answer until it is sent; the gRPC door (service.api.grpc) gets its message whole, so it holds
the message's bytes from the call's start and its answer's reservation (`Holding`). Either way a
request that would take all of them past the limit is refused before its work starts (503
MemoryBusy, RESOURCE_EXHAUSTED on gRPC; a request too big for the limit alone: 422).
"""

from __future__ import annotations

from typing import Final

from service.errors import FieldError, InvalidRequest, MemoryBusy
from service.metrics import Metrics

MB: Final = 1e6


def memory_busy(in_flight: int, max_bytes: int) -> MemoryBusy:
    """503: the requests in flight, every door's, would hold more than the limit."""
    return MemoryBusy(
        f"requests in flight hold {in_flight} bytes of bodies, their parsing and answers, "
        f"above SDPA_MAX_INFLIGHT_BYTES = {max_bytes}; retry shortly",
        retry_after_s=1,
    )


def too_big_alone(nbytes: int, max_bytes: int, *, holds: str, advice: str) -> InvalidRequest:
    """400: one request would hold more than the limit by itself, whatever else is in flight.
    `holds`: what its peak is made of, at this door; `advice`: how to send it under the limit."""
    msg = (
        f"this request alone would hold about {nbytes / MB:.3g} MB at its peak ({holds}), "
        f"above SDPA_MAX_INFLIGHT_BYTES = {max_bytes / MB:.3g} MB for all requests together; "
        f"{advice}"
    )
    return InvalidRequest(msg, errors=[FieldError(loc=("body",), msg=msg, type="inflight_limit")])


class InflightBytes:
    """What all requests in flight hold now (`held`), and the limit."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0


class Holding:
    """What one request that arrived whole holds: its message, then also its answer (reserved
    before compute, shrunk to the encoded answer). `release()` gives it all back."""

    def __init__(self, ledger: InflightBytes, nbytes: int, *, metrics: Metrics | None) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.body = nbytes
        self.answer = 0
        if nbytes > ledger.max_bytes:
            raise self._too_big(nbytes)
        if ledger.held + nbytes > ledger.max_bytes:
            raise self._busy(ledger.held + nbytes)
        ledger.held += nbytes
        self.counted = nbytes

    def reserve_answer(self, nbytes: int) -> None:
        """The serving pipeline's reserve_answer: only growth is checked."""
        if self.body + nbytes > self.ledger.max_bytes:
            raise self._too_big(self.body + nbytes)
        growth = nbytes - self.answer
        if growth > 0 and self.ledger.held + growth > self.ledger.max_bytes:
            raise self._busy(self.ledger.held + growth)
        self.answer = nbytes
        self._hold()

    def release(self) -> None:
        self.ledger.held -= self.counted
        self.counted = 0

    def _hold(self) -> None:
        total = self.body + self.answer
        self.ledger.held += total - self.counted
        self.counted = total

    def _refused(self) -> None:
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="inflight_bytes").inc()

    def _busy(self, in_flight: int) -> MemoryBusy:
        self._refused()
        return memory_busy(in_flight, self.ledger.max_bytes)

    def _too_big(self, nbytes: int) -> InvalidRequest:
        self._refused()
        return too_big_alone(
            nbytes,
            self.ledger.max_bytes,
            holds="its message, results and encoded answer",
            advice="send fewer queries per request, or no weights",
        )
