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

The short stream
----------------
Long items share the device with the short work that keeps arriving, not only with the short
work queued now: a closed loop of small requests took about half the device from the long ones
in the soak, and projections that counted only the queue admitted long requests that then ended
504. ``ShortStream`` measures that share on the clock: the device seconds of short batches per
second of the clock (decayed sums, half-life SHORT_STREAM_HALF_LIFE_S), bounded by what the
worker lets short batches take between two tiles (half the device by its rule; more where the
batches overran it, measured as their device seconds over theirs and the tiles'), and by
MAX_SHORT_SHARE. The projections count a
long item's work at the device left to long work (``long_fraction``).
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


# The short stream's share of the device (module docstring): measurements older than this many
# seconds of the clock weigh half; before any, the stream counts as one second without short
# work (so one early batch does not read as a flood).
SHORT_STREAM_HALF_LIFE_S = 10.0
SHORT_STREAM_PRIOR_S = 0.25
# A stream's next seconds bring more or less than its measured rate (a Poisson stream of 15
# small requests a second varies by a tenth over 6 s, and the measure lags a change): the
# projections count it at this multiple of its rate, within the bounds below.
SHORT_STREAM_MARGIN = 1.5
# The worker runs up to one slice of short batches of measured time between two tiles of its
# own tenant: short work takes about half the device beside long work, the prior here; its
# measure moves it, with the throughput's half-life of device time.
BETWEEN_TILES_PRIOR = 0.5
# Whatever the measures say, the projections leave long work at least this share of the device
# (a projection at a vanishing share would refuse every long request for a momentary flood).
MAX_SHORT_SHARE = 0.9


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
        # The tiles' pace (device seconds per estimated second) one by one: its decayed mean
        # and mean square, weighted by device time (spread()).
        self._tiles_s = 0.0
        self._tile_pace = 0.0
        self._tile_pace_sq = 0.0

    def note(self, work: float, seconds: float) -> None:
        """`work` estimated seconds took `seconds` of device time."""
        keep = 0.5 ** (seconds / THROUGHPUT_HALF_LIFE_S)
        self.done_work = self.done_work * keep + work
        self.busy_s = self.busy_s * keep + seconds
        self.measured = True

    def note_tile(self, work: float, seconds: float) -> None:
        """A long item's tile: `work` estimated seconds took `seconds` (its pace's spread)."""
        if work <= 0.0 or seconds <= 0.0:
            return
        pace = seconds / work
        keep = 0.5 ** (seconds / THROUGHPUT_HALF_LIFE_S)
        self._tiles_s = self._tiles_s * keep + seconds
        self._tile_pace = self._tile_pace * keep + seconds * pace
        self._tile_pace_sq = self._tile_pace_sq * keep + seconds * pace * pace

    def spread(self) -> float:
        """How far the tiles' pace strays from its mean, relative to it: two standard
        deviations over the mean (0 where every tile kept the same pace; at most 1). On a
        machine whose cores other work shares, a tile's pace swings by several times from one
        second to the next, and a projection at the mean pace promised what it then missed."""
        if self._tiles_s <= 0.0:
            return 0.0
        mean = self._tile_pace / self._tiles_s
        variance = max(0.0, self._tile_pace_sq / self._tiles_s - mean * mean)
        return min(1.0, 2.0 * math.sqrt(variance) / mean) if mean > 0.0 else 0.0

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


class ShortStream:
    """The share of the device that short work keeps taking (module docstring: The short
    stream), measured on `clock`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._since = clock()
        # Short batches' device seconds (and their squares) and the clock's seconds, decayed.
        self._busy_s = 0.0
        self._squares = 0.0
        self._span_s = SHORT_STREAM_PRIOR_S
        # Device seconds of short batches run between two tiles, and of the tiles: decayed.
        self._between_s = BETWEEN_TILES_PRIOR * THROUGHPUT_PRIOR_S
        self._tiles_s = (1.0 - BETWEEN_TILES_PRIOR) * THROUGHPUT_PRIOR_S

    def _decay_to(self, now: float) -> None:
        elapsed = now - self._since
        if elapsed <= 0.0:
            return
        keep = 0.5 ** (elapsed / SHORT_STREAM_HALF_LIFE_S)
        # The clock's seconds, each weighing as the decay says by now: its integral.
        self._span_s = self._span_s * keep + SHORT_STREAM_HALF_LIFE_S / math.log(2) * (1 - keep)
        self._busy_s *= keep
        self._squares *= keep
        self._since = now

    def note_short(self, seconds: float) -> None:
        """A short batch took `seconds` of device time (it ended now)."""
        self._decay_to(self._clock())
        seconds = max(0.0, seconds)
        self._busy_s += seconds
        self._squares += seconds * seconds

    def note_turn(self, short_s: float, tile_s: float) -> None:
        """Between two tiles short batches took `short_s`, then the tile `tile_s`."""
        seconds = short_s + tile_s
        if seconds <= 0.0:
            return
        keep = 0.5 ** (seconds / THROUGHPUT_HALF_LIFE_S)
        self._between_s = self._between_s * keep + short_s
        self._tiles_s = self._tiles_s * keep + tile_s

    def rate(self) -> float:
        """Short batches' device seconds per second of the clock, lately."""
        self._decay_to(self._clock())
        return self._busy_s / self._span_s

    def rate_bound(self) -> float:
        """The rate with room for what its measure cannot tell: SHORT_STREAM_MARGIN times
        it, plus two standard deviations of a Poisson stream of such batches over the span
        measured (wide while little is measured, narrowing as the span grows)."""
        rate = self.rate()
        return SHORT_STREAM_MARGIN * rate + 2.0 * math.sqrt(self._squares) / self._span_s

    def between_tiles(self) -> float:
        """The share of the device short batches took between tiles, lately."""
        return self._between_s / (self._between_s + self._tiles_s)

    def share(self) -> float:
        """The share of the device the projections count the short stream as taking from long
        work: its rate with a margin (rate_bound), at most what the worker lets it take
        between tiles (half the device
        by its rule, more where batches overran it: the larger), at most MAX_SHORT_SHARE."""
        bound = max(BETWEEN_TILES_PRIOR, self.between_tiles())
        return min(self.rate_bound(), bound, MAX_SHORT_SHARE)

    def long_fraction(self) -> float:
        """The share of the device left to long work."""
        return 1.0 - self.share()
