"""The long items running: started at their first tile, stepped one tile a turn on the device
thread with the short batches that run before it, and ended (answered, or dropped when nobody
waits for them any more).

service.runtime.turns decides (which running item gets the next tile, which queued one joins,
whether a new one is admitted); this module does what it decides, turn by turn, for the
batcher's worker (service.runtime.batcher), which keeps admission, the short batches and the
drain and lends them through ``Around``. A turn:

- drops the long items nobody waits for: their deadline passed (the timer answered them, or
  the worker does now: a timer runs late on a busy loop) or their client left;
- starts every queued long item that may join (as in the projections);
- runs the short batches waiting, up to one slice of their estimated work and of their
  measured device time (another tenant's by the tenants' shares: ``_run_short_batches``);
- runs one tile of the long item whose turn it is, timed on the device thread, and charges
  its tenant the work it did; a finished run is answered with its outcome.

A drain that times out cancels a turn: every long item running is answered ShuttingDown.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.errors import ShuttingDown
from service.metrics import Metrics
from service.runtime.device_thread import DeviceThread
from service.runtime.pace import DEFAULT_RETRY_AFTER_S, Pace
from service.runtime.queue import Item, Tenant, WorkQueue
from service.runtime.turns import Long, LongTurns, Resumable

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger("sdpa.batcher")


def shut_down_while_running() -> ShuttingDown:
    return ShuttingDown(
        "the service shut down while the request ran", retry_after_s=DEFAULT_RETRY_AFTER_S
    )


@dataclass(frozen=True, slots=True)
class Around(Generic[T, R]):
    """What the driving asks of the batcher around it."""

    # The next short batch, of at most that much estimated work (its first item always goes),
    # taken off the queue; and running it on the device, its items answered: -> its seconds.
    take_batch: Callable[[float], list[Item[T, R]]]
    execute: Callable[[list[Item[T, R]]], Awaitable[float]]
    # A queued item whose deadline passed: out of the queue, answered 504 and counted.
    drop_expired: Callable[[Item[T, R]], None]
    # A running item's deadline passed: its deadline timer's answer (504, counted once).
    expire: Callable[[Item[T, R]], None]
    # The work queued or running moved: the backlog gauges.
    changed: Callable[[], None]


class LongRuns(Generic[T, R]):
    """The driving of the long items (module docstring), over the turns' decisions."""

    def __init__(
        self,
        turns: LongTurns[T, R],
        queue: WorkQueue[T, R],
        pace: Pace,
        device: DeviceThread,
        around: Around[T, R],
        *,
        slice_s: float,
        start_long: Callable[[T, int], Resumable[Any]],
        finish_long: Callable[[T, Any, float], R] | None = None,
        note_tile: Callable[[Any, float], None] | None = None,
        clock: Callable[[], float],
        metrics: Metrics | None,
    ) -> None:
        """start_long, finish_long, note_tile: BatcherPolicy's (service.runtime.batcher)."""
        self._turns = turns
        self._queue = queue
        self._pace = pace
        self._device = device
        self._around = around
        self._slice_s = slice_s
        self._start_long = start_long
        self._finish_long = finish_long
        self._note_tile = note_tile
        self._clock = clock
        self._metrics = metrics

    def due(self) -> bool:
        """Whether a turn is due: a long item runs, or a queued one may start."""
        return bool(self._turns.longs) or self._turns.next_long() is not None

    async def turn(self) -> None:
        """One turn (module docstring). A drain that times out (cancellation) answers every
        long item running with ShuttingDown."""
        try:
            await self._take_turn()
        except asyncio.CancelledError:
            self.end_all(shut_down_while_running, rejected="shutting_down")
            raise

    def end_all(self, error: Callable[[], BaseException], *, rejected: str = "") -> None:
        """Answer every long item still running with error() and forget them all; each answer
        that reaches its client is counted as rejected for that reason, if one is given."""
        for long in list(self._turns.longs.values()):
            # (not one answered already: answer() answers nothing DONE)
            if self._queue.answer(long.pending, error()) and rejected and self._metrics:
                self._metrics.rejected_total.labels(reason=rejected).inc()
            self._end(long)

    # -- starting and ending -----------------------------------------------------------------

    def _begin(self, pending: Item[T, R]) -> None:
        """Take a queued long item off the queue; it runs beside those running."""
        now = self._clock()
        if pending.deadline <= now:
            self._around.drop_expired(pending)
            return
        self._queue.take(pending, now)
        # The pace may have moved while it waited: its tiles are counted at this one.
        pending.tiles = max(1, self._pace.tiles_for(pending.work, self._slice_s))
        if self._metrics is not None:
            self._metrics.batch_size.observe(1)
            self._metrics.queue_wait_seconds.observe(pending.queue_s)
        planned = self._pace.plan_tiles(pending.work, self._slice_s)
        self._turns.longs[pending.seq] = Long(pending, planned)
        self._queue.tenant(pending.tenant).running += 1

    def _end(self, long: Long[T, R]) -> None:
        """Forget a long item and its run (what it held on the device goes with it)."""
        if self._turns.longs.pop(long.pending.seq, None) is not None:
            self._queue.tenant(long.pending.tenant).running -= 1
        self._around.changed()

    def _left_alone(self, long: Long[T, R]) -> bool:
        """Whether a running long item lost its reason to run: its deadline passed (the timer
        answered it, or answers it now: a timer runs late on a busy loop, and on the loop's
        clock, which need not be the batcher's) or its client left. Then its run is dropped
        and counted."""
        pending = long.pending
        if pending.future.cancelled():
            reason = "disconnected"
        elif not self._queue.awaited(pending) or pending.deadline <= self._clock():
            self._around.expire(pending)  # (it answers nothing the timer answered already)
            reason = "deadline"
        else:
            return False
        if self._metrics is not None:
            self._metrics.abandoned_total.labels(reason=reason).inc()
        self._queue.close_unheard(pending)
        self._end(long)
        return True

    # -- a turn ------------------------------------------------------------------------------

    async def _take_turn(self) -> None:
        # Those nobody waits for leave first: their places are free for the next to join.
        for running in list(self._turns.longs.values()):
            self._left_alone(running)
        # Every queued long item that may start joins now, as in the projections (one a turn
        # let an item that cannot finish, alone for a turn, take a tile from one that can).
        while (queued := self._turns.next_long()) is not None:
            self._begin(queued)
        short_s = await self._run_short_batches()
        long = self._turns.whose_turn()
        if long is None or self._left_alone(long):
            return

        # What this tile will likely do, for the backlog while it runs: the mean share of a
        # step so far, or a planned tile's before the first step.
        run, work = long.run, long.pending.work
        if run is None or run.tiles_done == 0:
            tile_work = work / max(1, long.planned_tiles)
        else:
            tile_work = work * long.share_done() / run.tiles_done
        tile_work = min(tile_work, long.left_work)
        long.left_work -= tile_work
        self._pace.start_running(tile_work)
        try:
            finished, seconds = await asyncio.wrap_future(
                self._device.submit(functools.partial(self._step, long))
            )
        except Exception as exc:  # a bug of ours (_step answers the run's own errors): a 500
            logger.exception("a long item's tile failed")
            self._queue.answer(long.pending, exc)
            self._end(long)
            return
        finally:
            self._pace.stop_running()
        # What the tile did, by the run's own measure of its progress; once finished, all
        # the estimate left over is done too (the pace learns from it either way), unless
        # the run ended in an error: then only what it did (a start or a tile that failed at
        # once, counted as all its work done in milliseconds, would make the pace read fast,
        # and admission promise what the device cannot do).
        left_before = long.left_work + tile_work
        left_now = work * (1.0 - long.share_done())
        completed = finished and not isinstance(long.outcome, BaseException)
        long.left_work = 0.0 if completed else min(left_before, left_now)  # never grows
        if not finished:
            # A run not finished has a tile left at least, whatever its share_done says (the
            # chunked path's reports 1 before its last tile): counted as done, such an item
            # read as finished in the projections, and a soak's long requests ended 504 one
            # tile short of their end while analyses admitted beside them took the device.
            assert long.run is not None  # (a run that did not start has ended)
            tile = min(left_before, work / max(1, long.run.tiles_total))
            long.left_work = max(long.left_work, tile)
        done = left_before - long.left_work
        self._queue.charge(self._queue.tenant(long.pending.tenant), done)
        self._pace.note(done, seconds)
        self._around.changed()
        if not finished:  # (a last tile counts all the estimate left over: no pace of its own)
            self._pace.note_tile(done, seconds)
        self._turns.stream.note_turn(short_s, seconds)
        if not finished:
            return  # its next turn looks at its deadline and client first
        outcome = long.outcome
        assert outcome is not None  # (_step sets it as the run ends)
        self._end(long)
        # (not one answered just after its deadline's 504, or whose client left: answer()
        # answers nothing DONE)
        self._queue.answer(long.pending, outcome)

    async def _run_short_batches(self) -> float:
        """The short batches that run before the next tile: up to one slice of their
        estimated work and of the device's measured time, so a stream of them leaves the long
        items at least half the device; those of another tenant than the next tile's, by the
        tenants' shares instead (while their tenant's virtual time is not past the tile's
        tenant's), up to the measured time the tile's tenant's share leaves the others: its
        weight's slice, times the other known tenants' weights over its own. -> the device
        seconds they took.

        The measured bounds: small batches' fixed costs are what the cost model counts worst
        (a soak's small requests took many times their estimate), and a slice of their
        estimated work ran for seconds between two tiles: long requests starved to 504."""
        slice_s = self._slice_s
        budget = slice_s
        spent_s = rival_s = 0.0
        rival: Tenant | None = None
        rival_most = 0.0
        if self._queue.tenant_count() > 1:
            rival = self._turns.next_tile_tenant()
            if rival is not None:
                others = max(0.0, self._queue.total_weight() - rival.weight)
                rival_most = slice_s * others / rival.weight
        take_batch, execute = self._around.take_batch, self._around.execute
        while (first := self._queue.next_short(peek=True)) is not None:
            if rival is not None and first.tenant != rival.name:
                if self._queue.tenant(first.tenant).vtime > rival.vtime:
                    return spent_s + rival_s  # the tile's tenant is owed the device
                if rival_s >= rival_most:
                    return spent_s + rival_s
                batch = take_batch(slice_s)
                if batch:
                    rival_s += await execute(batch)
                continue
            # (a tolerance: summed floats may leave a crumb of the slice, not worth a batch)
            if budget <= 1e-6 * slice_s or spent_s >= slice_s:
                return spent_s + rival_s
            batch = take_batch(budget)
            budget -= sum(p.work for p in batch)
            if batch:  # (empty when every item of its group had passed its deadline)
                spent_s += await execute(batch)
        return spent_s + rival_s

    def _step(self, long: Long[T, R]) -> tuple[bool, float]:
        """One tile of a long item, on the device thread (its run starts at the first).
        -> (done, its seconds), timed here: on the loop the time would also hold however long
        the loop took to come back to it (a busy loop made the pace look several times slow).

        The run is stepped as it is (sdpa_core's TiledRun: no wrapper): an error of its start,
        of a tile or of its result ends it, and is the item's own answer (a bad option, the
        whole result's overflow check, the device out of memory), never an exception out of
        here. Once done, finish_long makes the answer on this thread (a copy back to the host
        belongs here), with the seconds its tiles took; note_tile is told each tile's."""
        started = self._clock()
        try:
            if long.run is None:
                long.run = self._start_long(long.pending.item, long.planned_tiles)
            run = long.run
            done = run.step(self._slice_s)
        except Exception as exc:
            long.outcome = exc
            return True, self._clock() - started
        seconds = self._clock() - started
        long.compute_s += seconds
        if self._note_tile is not None:
            self._note_tile(run, seconds)
        if done:
            try:
                result = run.result()
                finish = self._finish_long
                long.outcome = (
                    result if finish is None else finish(long.pending.item, result, long.compute_s)
                )
            except Exception as exc:
                long.outcome = exc
        return done, self._clock() - started
