"""service.runtime.long_runs on a fake clock: a turn of the long items' driving, alone.

The real queue, pace, turns and device thread; the batcher around it (``Around``) is a record
of what the driving asks of it, its short batches answered by hand. Every expected value below
is counted by hand from the tiles' work and the clock's steps (the batcher's own tests cover
the same driving inside the worker: test_long_requests.py, test_tenants.py, test_admission.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from service.errors import DeadlineExceeded, ShuttingDown
from service.metrics import Metrics
from service.runtime.device_thread import DeviceThread
from service.runtime.long_runs import Around, LongRuns
from service.runtime.pace import Pace
from service.runtime.queue import BatchResult, Item, WorkQueue
from service.runtime.turns import LongTurns
from tests.support.fake_clock import FakeClock

SLICE = 0.1


class Run:
    """A long item's run of `tiles` tiles; each step takes one slice on the fake clock. An
    item named 'Lstep...' fails at its second step, 'Lresult...' in result()."""

    def __init__(self, clock: FakeClock, name: str, tiles: int) -> None:
        self.clock, self.name, self.tiles_total, self.tiles_done = clock, name, tiles, 0

    @property
    def share_done(self) -> float:
        return self.tiles_done / self.tiles_total

    def step(self, budget_s: float) -> bool:
        self.clock.now += SLICE  # (the loop awaits the device thread meanwhile)
        if self.name.startswith("Lstep") and self.tiles_done == 1:
            raise ValueError(f"{self.name}'s tile failed")
        self.tiles_done += 1
        return self.tiles_done == self.tiles_total

    def result(self) -> str:
        if self.name.startswith("Lresult"):
            raise ValueError(f"{self.name}'s result overflowed")
        return self.name.upper()


class Driving:
    """LongRuns over a real queue, pace and turns, and a recording Around."""

    def __init__(self, metrics: Metrics | None = None, *, finishing: bool = False) -> None:
        self.clock = FakeClock()
        self.queue: WorkQueue[str, str] = WorkQueue()
        self.pace = Pace(self.clock)
        self.turns: LongTurns[str, str] = LongTurns(self.queue, self.pace, self.clock)
        self.device = DeviceThread()
        self.runs: dict[str, Run] = {}
        self.shorts: list[list[str]] = []
        self.dropped: list[str] = []
        self.expired: list[str] = []
        self.noted: list[tuple[str, float]] = []
        around: Around[str, str] = Around(
            take_batch=self.take_batch, execute=self.execute, drop_expired=self.drop,
            expire=self.expire, changed=lambda: None,
        )  # fmt: skip
        self.longs = LongRuns(
            self.turns, self.queue, self.pace, self.device, around, slice_s=SLICE,
            start_long=self.start_long, clock=self.clock, metrics=metrics,
            finish_long=self.finish if finishing else None,
            note_tile=self.note if finishing else None,
        )  # fmt: skip
        self.loop = asyncio.get_running_loop()

    def start_long(self, item: str, tiles: int) -> Run:
        if item.startswith("Lstart"):
            raise MemoryError(f"{item} does not fit on the device")
        run = self.runs[item] = Run(self.clock, item, tiles)
        return run

    def finish(self, item: str, result: str, seconds: float) -> str:
        return f"{result} in {seconds:.2f} s"

    def note(self, run: Run, seconds: float) -> None:
        self.noted.append((run.name, seconds))

    def add(self, name: str, work: float, deadline: float, tenant: str = "A") -> Item[str, str]:
        item: Item[str, str] = Item(
            item=name, key=name[0], cost=0.0, work=work, seq=self.queue.next_seq(),
            deadline=self.clock.now + deadline, enqueued=self.clock.now,
            future=self.loop.create_future(), tiles=self.pace.tiles_for(work, SLICE),
            tenant=tenant,
        )  # fmt: skip
        self.queue.enqueue(item)
        return item

    def take_batch(self, max_work: float) -> list[Item[str, str]]:
        first = self.queue.next_short()
        assert first is not None
        self.queue.take(first, self.clock.now)
        return [first]

    async def execute(self, batch: list[Item[str, str]]) -> float:
        self.shorts.append([p.item for p in batch])
        self.clock.now += 0.01
        for pending in batch:
            self.queue.answer(pending, pending.item.upper())
        return 0.01

    def drop(self, pending: Item[str, str]) -> None:
        self.dropped.append(pending.item)
        self.queue.remove(pending)
        self.queue.answer(pending, DeadlineExceeded("queued too long"))

    def expire(self, pending: Item[str, str]) -> None:
        self.expired.append(pending.item)
        self.queue.answer(pending, DeadlineExceeded("ran too long"))


def run(main: Coroutine[Any, Any, None]) -> None:
    asyncio.run(main)


def test_a_turn_starts_a_long_item_runs_the_short_work_first_and_charges_each_tile() -> None:
    """A long item of 3 slices (0.3 s of work, the prior pace of 1 s per unit) and a short one
    queued: the first turn starts the long item, runs the short batch, then one tile. By hand,
    after turns 1, 2, 3: work left 0.2, 0.1, 0; tenant A charged 0.01 + 0.1 per tile (weight
    1); the third answers the run's outcome and frees A's place."""

    async def main() -> None:
        d = Driving()
        d.device.start()
        try:
            long = d.add("L1", 0.3, deadline=60.0)
            d.add("s1", 0.01, deadline=60.0)
            assert long.tiles == 3
            assert d.longs.due()
            lefts, vtimes = [], []
            for _ in range(3):
                await d.longs.turn()
                lefts.append(sum(x.left_work for x in d.turns.longs.values()))
                vtimes.append(d.queue.tenant("A").vtime)
            assert d.shorts == [["s1"]]  # before the first tile, once
            assert lefts == pytest.approx([0.2, 0.1, 0.0])
            assert vtimes == pytest.approx([0.11, 0.21, 0.31])
            assert d.runs["L1"].tiles_done == 3
            result = long.future.result()
            assert isinstance(result, BatchResult)
            assert result.value == "L1"
            assert not d.turns.longs
            assert d.queue.tenant("A").running == 0
            assert not d.longs.due()
        finally:
            d.device.shutdown()

    run(main())


def test_a_long_item_past_its_deadline_is_dropped_at_its_next_turn_with_no_tile_more() -> None:
    """Deadline 0.15 s, tiles of 0.1 s: one tile by 0.1 s, then at the second turn (0.1 s in)
    a second tile (0.2 s); the third turn finds the deadline past: expired (the timer's
    answer), counted abandoned, its place freed, no third tile."""
    metrics = Metrics()

    async def main() -> None:
        d = Driving(metrics)
        d.device.start()
        try:
            long = d.add("L1", 0.5, deadline=0.15)
            await d.longs.turn()
            await d.longs.turn()
            assert d.runs["L1"].tiles_done == 2
            await d.longs.turn()
            assert d.runs["L1"].tiles_done == 2
            assert d.expired == ["L1"]
            assert isinstance(long.future.exception(), DeadlineExceeded)
            assert not d.turns.longs
            assert d.queue.tenant("A").running == 0
        finally:
            d.device.shutdown()

    run(main())
    abandoned = metrics.registry.get_sample_value("sdpa_abandoned_total", {"reason": "deadline"})
    assert abandoned == 1.0


def test_a_queued_long_item_past_its_deadline_never_starts() -> None:
    async def main() -> None:
        d = Driving()
        d.device.start()
        try:
            d.add("L1", 0.5, deadline=0.05)
            d.clock.now += 0.1  # (no timer on this clock: the driving comes to it first)
            await d.longs.turn()
            assert d.dropped == ["L1"]
            assert d.runs == {}
            assert not d.turns.longs
        finally:
            d.device.shutdown()

    run(main())


def test_a_drain_that_cancels_a_turn_answers_the_running_items_shutting_down() -> None:
    """Two long items running, the turn cancelled while a tile is on the device: both are
    answered ShuttingDown and counted as rejected (shutting_down), once each."""
    metrics = Metrics()

    async def main() -> None:
        d = Driving(metrics)
        d.device.start()
        try:
            first, second = d.add("L1", 0.5, 60.0), d.add("L2", 0.5, 60.0)
            await d.longs.turn()  # both start, L1 (the oldest on the tie) takes a tile
            assert len(d.turns.longs) == 2
            turn = asyncio.create_task(d.longs.turn())
            await asyncio.sleep(0)
            turn.cancel()
            with pytest.raises(asyncio.CancelledError):
                await turn
            for item in (first, second):
                assert isinstance(item.future.exception(), ShuttingDown)
            assert not d.turns.longs
        finally:
            d.device.shutdown()

    run(main())
    rejected = metrics.registry.get_sample_value("sdpa_rejected_total", {"reason": "shutting_down"})
    assert rejected == 2.0


def test_the_run_is_stepped_as_it_is_each_tile_noted_and_finish_makes_the_answer() -> None:
    """finish_long gets the run's result and its tiles' seconds summed (3 tiles of 0.1 s on
    the fake clock: 0.30 s), note_tile each tile's seconds (0.1, three times)."""

    async def main() -> None:
        d = Driving(finishing=True)
        d.device.start()
        try:
            long = d.add("L1", 0.3, deadline=60.0)
            for _ in range(3):
                await d.longs.turn()
            assert long.future.result().value == "L1 in 0.30 s"
            assert [name for name, _ in d.noted] == ["L1"] * 3
            assert [seconds for _, seconds in d.noted] == pytest.approx([SLICE] * 3)
        finally:
            d.device.shutdown()

    run(main())


@pytest.mark.parametrize(
    ("name", "error", "tiles"),
    [("Lstart", MemoryError, 0), ("Lstep", ValueError, 1), ("Lresult", ValueError, 3)],
)
def test_an_error_of_a_runs_start_tile_or_result_is_the_items_own_answer(
    name: str, error: type[Exception], tiles: int
) -> None:
    """The run is stepped as it is, so its errors come out of it: whichever of its start, a
    tile or its result raises, that error is the item's answer, its place is freed, and the
    turns go on (the next item is answered too)."""

    async def main() -> None:
        d = Driving(finishing=True)
        d.device.start()
        try:
            failing = d.add(name, 0.3, deadline=60.0)
            after = d.add("L2", 0.3, deadline=60.0)
            for _ in range(8):
                if not d.longs.due():
                    break
                await d.longs.turn()
            assert type(failing.future.exception()) is error
            assert (d.runs[name].tiles_done if name in d.runs else 0) == tiles
            assert after.future.result().value == "L2 in 0.30 s"
            assert not d.turns.longs
            assert d.queue.tenant("A").running == 0
        finally:
            d.device.shutdown()

    run(main())


def test_a_run_that_fails_teaches_the_pace_only_the_work_it_did() -> None:
    """A run of 10 tiles (work 1.0) whose second tile fails: the pace learns the first tile's
    0.1 of work in 0.1 s and nothing done in the failed tile's 0.1 s, not the 0.9 left over
    as if done in that 0.1 s (which read the pace 3.6x fast and let admission promise what
    the device cannot do). By hand, from the prior (0.25 of work in 0.25 s) and each note's
    decay k = 0.5 ** (0.1 / 30): seconds per work (0.25 k^2 + 0.1 k + 0.1) / (0.25 k^2 +
    0.1 k) = 1.287; the tenant is charged the 0.1 done."""

    async def main() -> None:
        d = Driving()
        d.device.start()
        try:
            long = d.add("Lstep", 1.0, deadline=60.0)
            await d.longs.turn()
            await d.longs.turn()
            assert isinstance(long.future.exception(), ValueError)
            k = 0.5 ** (SLICE / 30.0)
            want = (0.25 * k * k + 0.1 * k + 0.1) / (0.25 * k * k + 0.1 * k)
            assert want == pytest.approx(1.287, abs=1e-3)
            assert d.pace.seconds_per_work() == pytest.approx(want, rel=1e-9)
            assert d.queue.tenant("A").vtime == pytest.approx(0.1)
        finally:
            d.device.shutdown()

    run(main())
