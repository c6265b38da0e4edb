"""The bytes that requests in flight hold, every door together, against SDPA_MAX_INFLIGHT_BYTES.

One ledger per application (AppState.inflight), one `Holding` per request (its Exchange's). The
HTTP door's middleware (service.middleware.inflight) counts a body as it streams in and what
parsing it will hold; the gRPC door (service.api.grpc) gets its message whole, so it holds the
message's bytes from the call's start. Serving reserves the answer before compute, and the
answer stays counted until it is sent. Either way a
request that would take all of them past the limit is refused before its work starts (503
MemoryBusy, RESOURCE_EXHAUSTED on gRPC; a request too big for the limit alone: 422).
"""

from __future__ import annotations

from collections.abc import Callable
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
    """What all requests in flight hold now (`held`), and the limit. `unsent()`: the bytes of
    answers handed to the server that clients have not taken yet (the HTTP protocol layer's write
    buffers), which count against the limit too; create_app gives it."""

    def __init__(self, max_bytes: int, *, unsent: Callable[[], int] = lambda: 0) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self.unsent = unsent

    def in_flight(self, growth: int = 0) -> int:
        """What requests and write buffers would hold with `growth` more bytes."""
        return self.held + self.unsent() + growth

    def fits(self, growth: int) -> bool:
        """Whether `growth` more bytes fit beside what requests and write buffers hold."""
        return self.in_flight(growth) <= self.max_bytes


class Holding:
    """What one request holds against the ledger: its body, what parsing it will hold until it
    is decoded, and its answer (reserved before compute, shrunk to the encoded answer, or what
    was handed over if more). `release()` gives it all back.

    The door's edge sets `body` and `parse` as they grow and calls `hold()` (the HTTP door
    counts a body as it streams in; the gRPC door's message arrives whole, given here); serving
    reserves the answer (`reserve_answer`). `holds` and `advice` word the refusal of a request
    too big for the limit alone, as each door's peak is made.
    """

    def __init__(
        self,
        ledger: InflightBytes,
        nbytes: int = 0,
        *,
        metrics: Metrics | None,
        holds: str = "its message, results and encoded answer",
        advice: str = "send fewer queries per request, or no weights",
    ) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.holds = holds
        self.advice = advice
        self.body = nbytes
        self.parse = 0  # the parse estimate, until decoded
        self.decoded = False  # the request is decoded: its parse estimate is gone
        self.answer = 0  # the answer's bytes: reserved, or handed over (whichever is more)
        self.sent = 0
        self.counted = 0  # what this request adds to ledger.held now
        if nbytes > ledger.max_bytes:
            raise self.too_big(nbytes)
        if not ledger.fits(nbytes):
            raise self.busy(ledger.in_flight(nbytes))
        self.hold()

    def total(self) -> int:
        """What the request holds now, by its parts."""
        return self.body + (0 if self.decoded else self.parse) + self.answer

    def hold(self) -> None:
        """Count what the parts add up to now (unchecked: the caller checked the growth)."""
        total = self.total()
        self.ledger.held += total - self.counted
        self.counted = total

    def reserve_answer(self, nbytes: int) -> None:
        """Serving reserves what the answer will take before computing it (so a burst of
        requests admitted together cannot pass the limit together), then shrinks it to the
        encoded answer. Only growth is checked. The first call also says that the request is
        decoded: its parse estimate is dropped."""
        if not self.decoded:
            self.decoded = True
            self.hold()
        if self.body + nbytes > self.ledger.max_bytes:
            raise self.too_big(self.body + nbytes)  # no retry would help: a 422
        growth = nbytes - self.answer
        if growth > 0 and not self.ledger.fits(growth):
            raise self.busy(self.ledger.in_flight(growth))
        self.answer = max(nbytes, self.sent)
        self.hold()

    def handed_over(self, nbytes: int) -> None:
        """Answer bytes went to the server: held until the request is done."""
        self.sent += nbytes
        self.answer = max(self.answer, self.sent)
        self.hold()

    def release(self) -> None:
        """The request ended (its answer sent): everything it held comes back."""
        self.ledger.held -= self.counted
        self.counted = 0

    def refused(self) -> None:
        """Count a refusal for the in-flight bytes (sdpa_rejected_total{reason})."""
        if self.metrics is not None:
            self.metrics.rejected_total.labels(reason="inflight_bytes").inc()

    def busy(self, in_flight: int) -> MemoryBusy:
        self.refused()
        return memory_busy(in_flight, self.ledger.max_bytes)

    def too_big(self, nbytes: int) -> InvalidRequest:
        self.refused()
        return too_big_alone(nbytes, self.ledger.max_bytes, holds=self.holds, advice=self.advice)
