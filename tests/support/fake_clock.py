"""A clock a test steps by hand, with timers on it: the runtime's injected time (its deadlines,
its pace) without sleeping."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class FakeTimer:
    __slots__ = ("cancelled", "fn", "when")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """clock() reads `now`; call_at(when, fn) schedules fn at that instant; advance(seconds)
    moves `now` and runs the timers now due, earliest first (call it on the event loop's
    thread: the runtime's timers touch its futures)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._order = itertools.count()

    def __call__(self) -> float:
        return self.now

    def call_at(self, when: float, fn: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(when, fn)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self._timers and self._timers[0][0] <= self.now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.fn()
