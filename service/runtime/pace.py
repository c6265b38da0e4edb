"""The device's measured pace, and the backlog and Retry-After it gives.

Each item carries its estimated work (the runtime's cost model, in estimated device seconds; one
unit per item without it). The backlog is the queued work plus what is left of the batch on the
device and of the long items running (each one's estimate times the share of its run not yet
done, which the run itself reports: its steps may outnumber the tiles it planned), divided by
the measured throughput: the estimated work done per second the device was busy, both summed
with a half-life of THROUGHPUT_HALF_LIFE_S of device time and starting from THROUGHPUT_PRIOR_S
of the model's own pace. Weighing batches by their time, a stream of tiny requests (whose fixed
costs the model under-counts) cannot make a queue of large ones look long or short, and a model
off by a constant factor is corrected.

Retry-After (a full queue, a drain) is that backlog in whole seconds, within [1, 60]; a tenant
over its share of the queue is told its own backlog at its fair share of the device; a long item
refused by its deadline has its own (service.runtime.turns).
"""

from __future__ import annotations

import math
from collections.abc import Callable

# Retry-After before any batch has run (no throughput measured yet).
DEFAULT_RETRY_AFTER_S = 1.0
# A client told to come back later than this would rather try another replica.
MAX_RETRY_AFTER_S = 60.0
# The measured throughput (module docstring): the model weighs as much as a quarter second of
# measured device time; measurements older than the half-life of device time weigh half. (With
# a whole second, a model calibrated while the machine was busy kept Retry-After about 1.5x too
# long through the first second of long requests; a tile of a long request is measured every
# slice, so the pace soon rests on measurements.)
THROUGHPUT_PRIOR_S = 0.25
THROUGHPUT_HALF_LIFE_S = 30.0
# How far the measured pace may move a long item's planned tiles from the model's count
# (plan_tiles; how many slices it counts as, for joining and admission, is not bounded).
# Unbounded, it fed back: under a soak's load small batches' fixed costs made the pace read
# 50x slow, long items were planned in 50x more tiles, tiles that small are mostly fixed cost
# too, and the pace read slower still (80 tiles, then 4,256, each request ending 504). On a
# CPU a step stops at its slice whatever the plan, so fewer, larger tiles cost nothing there.
MAX_TILING_CORRECTION = 4.0


def retry_after(seconds: float) -> float:
    """A Retry-After within [DEFAULT_RETRY_AFTER_S, MAX_RETRY_AFTER_S]."""
    return min(MAX_RETRY_AFTER_S, max(DEFAULT_RETRY_AFTER_S, seconds))


class Pace:
    """Estimated work done per device second, measured (module docstring), and the work on the
    device now. Time from `clock`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        # Estimated work done, and device seconds it took: decayed sums.
        self.done_work = THROUGHPUT_PRIOR_S
        self.busy_s = THROUGHPUT_PRIOR_S
        self.measured = False
        # The batch or tile on the device: its estimated work, and since when.
        self.running_work = 0.0
        self.running_since = 0.0

    def note(self, work: float, seconds: float) -> None:
        """`work` estimated seconds took `seconds` of device time."""
        keep = 0.5 ** (seconds / THROUGHPUT_HALF_LIFE_S)
        self.done_work = self.done_work * keep + work
        self.busy_s = self.busy_s * keep + seconds
        self.measured = True

    def seconds_per_work(self) -> float:
        """Device seconds per estimated second, at the measured pace."""
        return self.busy_s / self.done_work

    def tiles_for(self, work: float, slice_s: float | None) -> int:
        """0 for a short item; else about how many slices it takes: its estimated work in
        device seconds at the measured pace (a model that under-counts this device's time
        would otherwise give tiles longer than a slice)."""
        if slice_s is None:
            return 0
        seconds = work * self.seconds_per_work()
        if seconds <= slice_s:
            return 0
        return math.ceil(seconds / slice_s)

    def plan_tiles(self, work: float, slice_s: float) -> int:
        """How many tiles a long item's run is planned in (start_long): its slices at the
        measured pace, that pace's correction of the model bounded by MAX_TILING_CORRECTION
        either way; at least 1."""
        correction = self.seconds_per_work()
        correction = min(MAX_TILING_CORRECTION, max(1.0 / MAX_TILING_CORRECTION, correction))
        return max(1, math.ceil(work * correction / slice_s))

    def start_running(self, work: float) -> None:
        self.running_work, self.running_since = work, self._clock()

    def stop_running(self) -> float:
        """The work that was on the device (0 once taken)."""
        work, self.running_work = self.running_work, 0.0
        return work

    def in_flight_s(self, now: float) -> float:
        """Device seconds likely left of the batch or tile on the device."""
        if not self.running_work:
            return 0.0
        elapsed = now - self.running_since
        return max(0.0, self.running_work * self.seconds_per_work() - elapsed)

    def backlog_seconds(self, work: float) -> float:
        """Seconds until `work` (estimated) and the batch on the device are done."""
        return work * self.seconds_per_work() + self.in_flight_s(self._clock())
