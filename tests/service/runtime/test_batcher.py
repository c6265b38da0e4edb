"""DynamicBatcher (and cancel_on_disconnect) against a fake run_batch (the injected device).

The fake device records every batch it was given and can be held busy (a threading gate), so
each test controls exactly what is queued when the device becomes free.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any, TypeVar

import pytest
from starlette.requests import Request

from service.api.disconnect import ClientDisconnected, cancel_on_disconnect
from service.errors import DeadlineExceeded, QueueFull, ShuttingDown
from service.metrics import Metrics
from service.runtime.batcher import BatcherConfig, BatcherPolicy, BatchResult, DynamicBatcher

R = TypeVar("R")
FAR = 3600.0  # a deadline that never passes in a test


def run(coro: Coroutine[Any, Any, R]) -> R:
    return asyncio.run(coro)


class ItemError(Exception):
    """An item's own failure (like an SdpaError for one request)."""


class KeywordError(Exception):
    """An exception whose constructor takes a keyword-only argument (as SdpaError's param)."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


class UncopyableError(Exception):
    """An exception that cannot even be allocated without its keyword argument."""

    def __new__(cls, *args: object, code: int) -> UncopyableError:
        return super().__new__(cls, *args)

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


class FakeDevice:
    """run_batch for string items: 'name' -> 'NAME'; 'err:*' items fail alone; 'block' holds
    the device until release(); 'boom' makes the whole call raise, 'interrupt' raise a
    KeyboardInterrupt (a BaseException that is not an Exception)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    async def wait_busy(self) -> None:
        """Until a batch is on the device (the worker thread signals it)."""
        ok = await asyncio.to_thread(self.entered.wait, 10.0)
        assert ok, "the device never received a batch"

    def __call__(self, items: Sequence[str]) -> list[str | BaseException]:
        with self.lock:
            self.batches.append(list(items))
        self.entered.set()
        if not self.gate.wait(30.0):
            raise RuntimeError("test gate never released")
        if "boom" in items:
            raise RuntimeError("run_batch itself failed")
        if "interrupt" in items:
            raise KeyboardInterrupt
        if "kwboom" in items:
            raise KeywordError("run_batch failed", code=7)
        if "uncopyable" in items:
            raise UncopyableError("run_batch failed", code=8)
        return [ItemError(item) if item.startswith("err:") else item.upper() for item in items]

    def computed(self) -> list[str]:
        return [item for batch in self.batches for item in batch]


def group_of(item: str) -> Hashable:
    """Items 'a1', 'a2' share group 'a'; the first character is the group."""
    return item[0]


def make(
    device: Callable[[Sequence[str]], Sequence[str | BaseException]],
    *,
    max_batch_size: int = 8,
    max_batch_delay_s: float = 0.0,
    max_queue: int = 64,
    metrics: Metrics | None = None,
) -> DynamicBatcher[str, str]:
    return DynamicBatcher(
        device,
        BatcherPolicy(group_key=group_of),
        BatcherConfig(
            max_batch_size=max_batch_size, max_queue=max_queue, max_batch_delay_s=max_batch_delay_s
        ),
        metrics=metrics,
    )


def deadline_in(seconds: float) -> float:
    return time.monotonic() + seconds


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until predicate() holds (bounded: fails the test after ~5 s)."""
    for _ in range(5000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def submit(
    b: DynamicBatcher[str, str], item: str, *, timeout: float = FAR
) -> asyncio.Task[BatchResult[str]]:
    return asyncio.create_task(b.submit(item, deadline=deadline_in(timeout)))


def rejected(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("sdpa_rejected_total", {"reason": reason})
    return 0.0 if value is None else value


async def held_device(
    device: FakeDevice, b: DynamicBatcher[str, str], first: str = "x0"
) -> asyncio.Task[BatchResult[str]]:
    """Start the batcher and put `first` on a held device, so later items queue up."""
    device.hold()
    await b.start()
    task = submit(b, first)
    await device.wait_busy()
    return task


def test_idle_device_runs_a_single_request_at_once() -> None:
    device = FakeDevice()

    async def main() -> BatchResult[str]:
        b = make(device, max_batch_delay_s=0.0)
        await b.start()
        result = await b.submit("a1", deadline=deadline_in(FAR))
        await b.drain(5)
        return result

    result = run(main())
    assert result.value == "A1"
    assert result.batch_size == 1
    assert result.queue_ms >= 0.0
    assert device.batches == [["a1"]]


def test_size_cut_takes_up_to_max_batch_size_in_arrival_order() -> None:
    device = FakeDevice()

    async def main() -> list[BatchResult[str]]:
        b = make(device, max_batch_size=3)
        first = await held_device(device, b, "a0")
        tasks = [submit(b, f"a{i}") for i in range(1, 8)]
        await until(lambda: b.depth == 7)
        device.release()
        results = await asyncio.gather(first, *tasks)
        await b.drain(5)
        return results

    results = run(main())
    assert device.batches == [["a0"], ["a1", "a2", "a3"], ["a4", "a5", "a6"], ["a7"]]
    assert [r.value for r in results] == [f"A{i}" for i in range(8)]
    assert [r.batch_size for r in results] == [1, 3, 3, 3, 3, 3, 3, 1]


def test_cost_cut_bounds_a_batch_by_size_and_a_large_item_goes_alone() -> None:
    """Item 'aN:C' costs C; a batch grows while costs add up to <= 10, first item always."""
    device = FakeDevice()

    def cost(item: str) -> float:
        return float(item.split(":")[1]) if ":" in item else 0.0

    async def main() -> None:
        b = DynamicBatcher(
            device,
            BatcherPolicy(group_key=group_of, batch_cost=cost),
            BatcherConfig(max_batch_size=8, max_queue=64, max_batch_cost=10.0),
        )
        first = await held_device(device, b, "x0")
        items = ["a1:4", "a2:4", "a3:4", "a4:25", "a5:1", "a6:9", "a7:1"]
        tasks = [submit(b, item) for item in items]
        await until(lambda: b.depth == len(items))
        device.release()
        results = await asyncio.gather(first, *tasks)
        assert [r.value for r in results] == ["X0", *(i.upper() for i in items)]
        await b.drain(5)

    run(main())
    # 4+4 fits, +4 would not; 25 alone is over budget but a batch always takes its first item.
    assert device.batches == [["x0"], ["a1:4", "a2:4"], ["a3:4"], ["a4:25"], ["a5:1", "a6:9"],
                              ["a7:1"]]  # fmt: skip


def test_batch_delay_lets_a_partial_batch_grow_and_a_full_one_go_at_once() -> None:
    device = FakeDevice()

    async def main() -> list[BatchResult[str]]:
        # A delay far longer than the test: if the full batch waited for it, the test would
        # hit its timeout; if the worker did not wait at all, a1 would run alone.
        b = make(device, max_batch_size=3, max_batch_delay_s=60.0)
        await b.start()
        t1 = submit(b, "a1")
        for _ in range(20):
            await asyncio.sleep(0)
        t2, t3 = submit(b, "a2"), submit(b, "a3")
        results = await asyncio.wait_for(asyncio.gather(t1, t2, t3), timeout=30)
        await b.drain(5)
        return list(results)

    results = run(main())
    assert device.batches == [["a1", "a2", "a3"]]
    assert {r.batch_size for r in results} == {3}


def test_a_full_group_goes_at_once_when_the_oldest_item_it_waited_behind_leaves() -> None:
    device = FakeDevice()

    async def main() -> list[BatchResult[str]]:
        # a1 is the oldest, so the worker waits (up to 60 s) for its group to grow; the b group
        # fills meanwhile. When a1's client goes away, b is the oldest group and full: it must
        # run at once, not after a1's delay (the test would hit its timeout).
        b = make(device, max_batch_size=2, max_batch_delay_s=60.0)
        await b.start()
        a1 = submit(b, "a1")
        for _ in range(20):
            await asyncio.sleep(0)
        bs = [submit(b, "b1"), submit(b, "b2")]
        await until(lambda: b.depth == 3)
        a1.cancel()
        results = await asyncio.wait_for(asyncio.gather(*bs), timeout=30)
        await b.drain(5)
        return list(results)

    results = run(main())
    assert device.batches == [["b1", "b2"]]
    assert [r.batch_size for r in results] == [2, 2]


def test_batch_delay_is_bounded_for_a_batch_that_never_fills() -> None:
    device = FakeDevice()

    async def main() -> BatchResult[str]:
        b = make(device, max_batch_size=8, max_batch_delay_s=0.05)
        await b.start()
        result = await asyncio.wait_for(b.submit("a1", deadline=deadline_in(FAR)), timeout=30)
        await b.drain(5)
        return result

    assert run(main()).batch_size == 1


def test_grouping_and_oldest_group_first() -> None:
    device = FakeDevice()

    async def main() -> None:
        b = make(device, max_batch_size=2)
        first = await held_device(device, b, "x0")
        order = ["a1", "b1", "a2", "a3", "a4", "b2", "c1", "b3"]
        tasks = [submit(b, item) for item in order]
        await until(lambda: b.depth == len(order))
        device.release()
        results = await asyncio.gather(first, *tasks)
        assert [r.value for r in results] == ["X0", *(item.upper() for item in order)]
        await b.drain(5)

    run(main())
    # Each batch is one group; the group of the oldest queued item always goes next, so b1
    # (queued second) runs before a3 and a4, and c1 before b3.
    assert device.batches == [["x0"], ["a1", "a2"], ["b1", "b2"], ["a3", "a4"], ["c1"], ["b3"]]


def test_one_failing_item_fails_alone() -> None:
    device = FakeDevice()

    async def main() -> list[Any]:
        b = make(device)
        first = await held_device(device, b, "a0")
        tasks = [submit(b, item) for item in ("a1", "a:err", "err:1", "e2")]
        await until(lambda: b.depth == 4)
        device.release()
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        await b.drain(5)
        return results

    results = run(main())
    assert device.batches == [["a0"], ["a1", "a:err"], ["err:1", "e2"]]
    assert [r.value for r in results if isinstance(r, BatchResult)] == ["A0", "A1", "A:ERR", "E2"]
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1
    assert isinstance(errors[0], ItemError)
    assert errors[0].args == ("err:1",)


def test_run_batch_raising_fails_that_batch_and_the_worker_lives_on() -> None:
    device = FakeDevice()

    async def main() -> tuple[list[Any], BatchResult[str]]:
        b = make(device)
        first = await held_device(device, b, "a0")
        tasks = [submit(b, item) for item in ("boom", "b1", "c1")]
        await until(lambda: b.depth == 3)
        device.release()
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        later = await b.submit("d1", deadline=deadline_in(FAR))
        assert b.running
        await b.drain(5)
        return results, later

    results, later = run(main())
    assert device.batches == [["a0"], ["boom", "b1"], ["c1"], ["d1"]]
    assert results[0].value == "A0"
    # Every item of the failing batch gets the batch's exception, as its own object (raised in
    # its own task, it collects only its own traceback); other batches are untouched.
    boom, b1 = results[1], results[2]
    assert type(boom) is RuntimeError
    assert type(b1) is RuntimeError
    assert str(boom) == str(b1) == "run_batch itself failed"
    assert boom is not b1
    assert isinstance(boom.__cause__, RuntimeError)
    assert boom.__cause__ is b1.__cause__
    assert boom.__cause__ not in (boom, b1)
    assert results[3].value == "C1"
    assert later.value == "D1"


@pytest.mark.parametrize(("item", "kind"), [("kwboom", KeywordError), ("uncopyable", RuntimeError)])
def test_each_item_of_a_failed_batch_gets_its_own_error_of_the_same_type(
    item: str, kind: type[Exception]
) -> None:
    """The app maps an error to a status by its type (a 422, a 503...): the per-item twins keep
    it even when the constructor takes keyword-only arguments; only an exception that cannot be
    allocated without them becomes a RuntimeError. Either way every item is answered."""
    device = FakeDevice()

    async def main() -> list[Any]:
        b = make(device)
        first = await held_device(device, b, "x0")
        tasks = [submit(b, name) for name in (item, f"{item[0]}2")]
        await until(lambda: b.depth == 2)
        device.release()
        results = await asyncio.wait_for(
            asyncio.gather(first, *tasks, return_exceptions=True), timeout=30
        )
        await b.drain(5)
        return list(results)

    _, one, two = run(main())
    assert type(one) is kind
    assert type(two) is kind
    assert one is not two
    assert type(one.__cause__) in (KeywordError, UncopyableError)
    assert one.__cause__ is two.__cause__
    if isinstance(one, KeywordError) and isinstance(two, KeywordError):
        assert str(one) == "run_batch failed"
        assert one.code == two.code == 7
    else:
        assert "UncopyableError" in str(one)


def test_a_base_exception_from_run_batch_reaches_the_items_wrapped() -> None:
    # A KeyboardInterrupt handed to the awaiting tasks as-is would stop the event loop.
    device = FakeDevice()

    async def main() -> tuple[list[Any], BatchResult[str]]:
        b = make(device)
        tasks = [submit(b, "interrupt")]
        await b.start()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        later = await b.submit("d1", deadline=deadline_in(FAR))
        await b.drain(5)
        return results, later

    results, later = run(main())
    assert type(results[0]) is RuntimeError
    assert "KeyboardInterrupt" in str(results[0])
    assert later.value == "D1"


def test_a_failure_while_answering_a_batch_still_answers_it_and_the_worker_lives_on() -> None:
    device = FakeDevice()

    async def main() -> tuple[list[Any], BatchResult[str]]:
        b = make(device)
        first = await held_device(device, b, "a0")
        tasks = [submit(b, item) for item in ("b1", "b2")]
        await until(lambda: b.depth == 2)
        failures = iter([RuntimeError("bookkeeping failed")])

        def note_throughput(work: float, seconds: float) -> None:
            failure = next(failures, None)
            if failure is not None:
                raise failure

        b._note_throughput = note_throughput  # type: ignore[method-assign]  # fault injection
        device.release()
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        later = await b.submit("c1", deadline=deadline_in(FAR))
        await b.drain(5)
        return results, later

    results, later = run(main())
    # The first batch's answering failed: its item gets that error (a 500), once; the next
    # batch and the next request are served as usual.
    assert isinstance(results[0], RuntimeError)
    assert str(results[0]) == "bookkeeping failed"
    assert [r.value for r in results[1:]] == ["B1", "B2"]
    assert later.value == "C1"


def test_device_busy_holds_while_a_batch_computes() -> None:
    device = FakeDevice()

    async def main() -> tuple[bool, bool, bool]:
        b = make(device)
        assert not b.device_busy
        first = await held_device(device, b, "a0")
        busy = b.device_busy
        device.release()
        await first
        idle_after = b.device_busy
        await b.drain(5)
        return busy, idle_after, b.device_busy

    busy, idle_after, idle_at_end = run(main())
    assert busy is True
    assert idle_after is False
    assert idle_at_end is False


def test_run_on_device_uses_the_thread_that_runs_the_batches() -> None:
    threads: list[int] = []

    def device(items: Sequence[str]) -> list[str | BaseException]:
        threads.append(threading.get_ident())
        return [item.upper() for item in items]

    async def main() -> None:
        b = make(device)
        await b.start()
        await b.run_on_device(lambda: threads.append(threading.get_ident()))
        await b.submit("a1", deadline=deadline_in(FAR))
        await b.drain(5)

    run(main())
    assert len(threads) == 2
    assert threads[0] == threads[1] != threading.get_ident()


def test_deadline_passed_while_queued_is_504_and_never_computed() -> None:
    device = FakeDevice()
    metrics = Metrics()

    async def main() -> list[Any]:
        b = make(device, metrics=metrics)
        first = await held_device(device, b, "a0")
        doomed = submit(b, "a1", timeout=0.05)
        kept = submit(b, "a2")
        with pytest.raises(DeadlineExceeded):
            await doomed  # answered while the device is still held
        assert b.depth == 1
        device.release()
        results = await asyncio.gather(first, kept)
        await b.drain(5)
        return list(results)

    results = run(main())
    assert [r.value for r in results] == ["A0", "A2"]
    assert "a1" not in device.computed()
    assert rejected(metrics, "deadline") == 1


def test_deadline_already_passed_at_submit() -> None:
    device = FakeDevice()
    metrics = Metrics()

    async def main() -> None:
        b = make(device, metrics=metrics)
        await b.start()
        with pytest.raises(DeadlineExceeded):
            await b.submit("a1", deadline=time.monotonic() - 1.0)
        await b.drain(5)

    run(main())
    assert device.batches == []
    assert rejected(metrics, "deadline") == 1


def test_deadlines_are_instants_of_the_injected_clock() -> None:
    """With a clock of its own, a batcher reads deadlines on it: an item whose deadline
    passes on that clock while it waits is never computed (the deadline timer, on the
    event loop's clock, is an hour away), and the batch time that the pace learns from is
    that clock's too."""
    device = FakeDevice()
    metrics = Metrics()
    clock = {"now": 500.0}

    def held_for_ten_seconds(items: Sequence[str]) -> list[str | BaseException]:
        result = device(items)
        clock["now"] += 10.0  # the batch takes 10 s on the injected clock
        return result

    async def main() -> list[BatchResult[str] | BaseException]:
        b: DynamicBatcher[str, str] = DynamicBatcher(
            held_for_ten_seconds, BatcherPolicy(group_key=group_of),
            BatcherConfig(max_batch_size=1, max_queue=8), metrics=metrics,
            clock=lambda: clock["now"],
        )  # fmt: skip
        device.hold()
        await b.start()
        first = asyncio.create_task(b.submit("a0", deadline=500.0 + FAR))
        await device.wait_busy()
        doomed = asyncio.create_task(b.submit("a1", deadline=505.0))  # passes during a0
        kept = asyncio.create_task(b.submit("a2", deadline=500.0 + FAR))
        await until(lambda: b.depth == 2)
        device.release()
        answers = list(await asyncio.gather(first, doomed, kept, return_exceptions=True))
        # 10 s a batch, one unit of work each (no cost model): the pace says so, after the
        # prior of one second per unit; timed on the real clock, it would say ~0 s.
        pace = b._pace.seconds_per_work()
        await b.drain(5)
        assert 5.0 < pace < 10.0
        return answers

    first, doomed, kept = run(main())
    assert isinstance(first, BatchResult)
    assert first.value == "A0"
    assert isinstance(doomed, DeadlineExceeded)
    assert isinstance(kept, BatchResult)
    assert kept.value == "A2"
    assert kept.queue_ms == pytest.approx(10_000.0)
    assert device.computed() == ["a0", "a2"]
    assert rejected(metrics, "deadline") == 1


def test_cancelled_request_is_dropped_before_compute_and_counted() -> None:
    device = FakeDevice()
    metrics = Metrics()

    async def main() -> BatchResult[str]:
        b = make(device, metrics=metrics)
        first = await held_device(device, b, "a0")
        gone = submit(b, "a1")
        kept = submit(b, "a2")
        await until(lambda: b.depth == 2)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert b.depth == 1
        device.release()
        await first
        result = await kept
        await b.drain(5)
        return result

    assert run(main()).value == "A2"
    assert device.batches == [["a0"], ["a2"]]
    assert rejected(metrics, "disconnected") == 1


def test_cancelling_a_request_on_the_device_leaves_the_batch_intact() -> None:
    device = FakeDevice()
    metrics = Metrics()

    async def main() -> BatchResult[str]:
        b = make(device, metrics=metrics)
        device.hold()
        await b.start()
        gone = submit(b, "err:gone")  # would fail: its exception must not leak unretrieved
        await device.wait_busy()
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        device.release()
        result = await b.submit("a1", deadline=deadline_in(FAR))
        await b.drain(5)
        return result

    assert run(main()).value == "A1"
    assert device.batches == [["err:gone"], ["a1"]]
    assert rejected(metrics, "disconnected") == 0  # it was computed, not dropped


def test_full_queue_is_queue_full_with_retry_after() -> None:
    device = FakeDevice()
    metrics = Metrics()

    async def main() -> QueueFull:
        b = make(device, max_batch_size=1, max_queue=3, metrics=metrics)
        first = await held_device(device, b, "x0")
        queued = [submit(b, f"x{i}") for i in (1, 2, 3)]
        await until(lambda: b.depth == 3)
        with pytest.raises(QueueFull) as full:
            await b.submit("x4", deadline=deadline_in(FAR))
        device.release()
        await asyncio.gather(first, *queued)
        await b.drain(5)
        return full.value

    full = run(main())
    assert full.status == 503
    # No throughput measured yet: the floor of 1 s (never 0).
    assert full.retry_after_s == 1
    assert full.headers == {"Retry-After": "1"}
    assert rejected(metrics, "queue_full") == 1
    assert device.computed() == ["x0", "x1", "x2", "x3"]


def test_retry_after_is_backlog_over_measured_throughput() -> None:
    per_batch = 0.25
    gate = FakeDevice()

    def device(items: Sequence[str]) -> list[str | BaseException]:
        time.sleep(per_batch)
        if items[0].startswith("x"):
            return list(gate(items))
        return [item.upper() for item in items]

    async def main() -> int:
        b = make(device, max_batch_size=1, max_queue=8)
        await b.start()
        await b.submit("w1", deadline=deadline_in(FAR))  # one measured batch: <= 4 items/s
        gate.hold()
        busy = submit(b, "x0")
        await gate.wait_busy()
        tasks = [submit(b, f"a{i}") for i in range(8)]
        await until(lambda: b.depth == 8)
        with pytest.raises(QueueFull) as full:
            await b.submit("a9", deadline=deadline_in(FAR))
        gate.release()
        await asyncio.gather(busy, *tasks)
        await b.drain(5)
        return full.value.retry_after_s

    # 8 queued + 1 on the device + the new one = 10 items at <= 4 items/s: >= 2.5 s, rounded up.
    # (sleep bounds each batch's time from below, so the estimate is bounded from below.)
    assert run(main()) >= 3


def test_retry_after_follows_the_queued_work_not_the_count_of_requests() -> None:
    """Items named "s" take 5 ms of device time, "L" items 150 ms; the cost model estimates
    three quarters of each (off by a constant factor, which the measured throughput corrects as
    device time accrues). After a warm-up of 20 tiny items (a count-based estimate would say
    about 0.05 s per item), four large items are queued behind a fifth on the device:
    Retry-After and backlog_seconds follow their work, within a factor of 2 of the queue's real
    drain time."""
    seconds = {"s": 0.005, "L": 0.15}
    metrics = Metrics()

    def device(items: Sequence[str]) -> list[str | BaseException]:
        time.sleep(sum(seconds[item[0]] for item in items))
        return [item.upper() for item in items]

    async def main() -> tuple[float, float, float, float, float]:
        b: DynamicBatcher[str, str] = DynamicBatcher(
            device,
            BatcherPolicy(
                group_key=lambda item: item, work_seconds=lambda item: seconds[item[0]] * 0.75
            ),
            BatcherConfig(max_batch_size=1, max_queue=4), metrics=metrics,
        )  # fmt: skip
        await b.start()
        for i in range(20):
            await b.submit(f"s{i}", deadline=deadline_in(FAR))
        large = [submit(b, "L0")]
        await until(lambda: b.device_busy)
        large += [submit(b, f"L{i}") for i in range(1, 5)]
        await until(lambda: b.depth == 4)  # one on the device, four queued
        with pytest.raises(QueueFull) as full:
            await b.submit("L9", deadline=deadline_in(FAR))
        backlog, with_own = b.backlog_seconds(), b.backlog_seconds(0.1125)
        gauge = metrics.registry.get_sample_value("sdpa_backlog_seconds")
        assert gauge is not None
        refused_at = time.monotonic()
        await asyncio.gather(*large)
        drained_s = time.monotonic() - refused_at
        await b.drain(5)
        return full.value.retry_after_s, backlog, with_own, gauge, drained_s

    retry_after, backlog, with_own, gauge, drained_s = run(main())
    # At least the four queued large items' estimate (0.45 s): every item takes longer than
    # its estimate, so the throughput (estimated work per busy second) is at most 1.
    assert backlog >= 0.45
    assert gauge == pytest.approx(backlog, abs=0.2)
    assert drained_s / 2 <= backlog + 0.15 <= drained_s * 2  # the new item's own work included
    # Retry-After is the backlog with the refused item's own work, in whole seconds (it was
    # computed a moment before `with_own`, with slightly more left on the device).
    assert math.ceil(with_own) <= retry_after <= math.ceil(with_own) + 1
    assert with_own >= backlog + 0.1125  # its own estimate, at a throughput of at most 1


def test_retry_after_is_clamped_to_a_minute() -> None:
    device = FakeDevice()

    async def main() -> int:
        b: DynamicBatcher[str, str] = DynamicBatcher(
            device, BatcherPolicy(group_key=group_of, work_seconds=lambda item: 100.0),
            BatcherConfig(max_batch_size=1, max_queue=2),
        )  # fmt: skip
        first = await held_device(device, b)
        queued = [submit(b, "a1"), submit(b, "a2")]
        await until(lambda: b.depth == 2)
        with pytest.raises(QueueFull) as full:
            await b.submit("a3", deadline=deadline_in(FAR))
        device.release()
        await asyncio.gather(first, *queued)
        await b.drain(5)
        return full.value.retry_after_s

    # Nothing measured yet: the model's 300 s of work, told as at most 60.
    assert run(main()) == 60


def test_drain_finishes_queued_work_and_refuses_new_requests() -> None:
    device = FakeDevice()
    metrics = Metrics()

    async def main() -> list[BatchResult[str]]:
        b = make(device, max_batch_size=2, metrics=metrics)
        first = await held_device(device, b, "a0")
        queued = [submit(b, f"a{i}") for i in range(1, 6)]
        await until(lambda: b.depth == 5)
        drain = asyncio.create_task(b.drain(30))
        await until(lambda: b.draining)
        with pytest.raises(ShuttingDown) as refused:
            await b.submit("a9", deadline=deadline_in(FAR))
        assert refused.value.retry_after_s >= 1
        assert b.running  # still working off the queue
        device.release()
        results = await asyncio.gather(first, *queued)
        await drain
        assert not b.running
        await b.drain(30)  # idempotent
        with pytest.raises(ShuttingDown):
            await b.submit("a10", deadline=deadline_in(FAR))
        return results

    results = run(main())
    assert [r.value for r in results] == [f"A{i}" for i in range(6)]
    assert device.computed() == [f"a{i}" for i in range(6)]
    assert rejected(metrics, "shutting_down") == 2


def test_drain_timeout_answers_queued_and_in_flight_with_shutting_down() -> None:
    device = FakeDevice()

    async def main() -> list[Any]:
        b = make(device)
        first = await held_device(device, b, "a0")
        queued = [submit(b, f"b{i}") for i in range(3)]
        await until(lambda: b.depth == 3)
        await b.drain(0.05)
        assert not b.running
        # The batch still computes: service.server exits without waiting for it.
        assert b.device_busy
        results = await asyncio.gather(first, *queued, return_exceptions=True)
        device.release()  # let the device thread finish in the background
        await until(lambda: not b.device_busy)
        return results

    results = run(main())
    assert all(isinstance(r, ShuttingDown) for r in results)
    assert device.computed() == ["a0"]


def test_exactly_one_answer_under_concurrency() -> None:
    """Hundreds of concurrent submits with cancellations, tight deadlines, failing items and a
    failing batch: each ends in exactly one outcome, each item is computed at most once, and
    an item is computed iff it was not dropped (deadline or cancel while queued)."""
    rng = random.Random(1234)
    metrics = Metrics()
    seen: list[str] = []
    seen_lock = threading.Lock()

    def device(items: Sequence[str]) -> list[str | BaseException]:
        with seen_lock:
            seen.extend(items)
        time.sleep(0.0005 * len(items))
        if any(item.endswith("!") for item in items) and rng.random() < 0.5:
            raise RuntimeError("batch failure")
        return [ItemError(i) if i.startswith("e") else i.upper() for i in items]

    async def main() -> dict[str, str]:
        b = make(device, max_batch_size=5, max_queue=120, metrics=metrics)
        await b.start()
        outcomes: dict[str, str] = {}

        async def client(item: str, budget_s: float, cancel_after: float | None) -> None:
            task = asyncio.create_task(b.submit(item, deadline=deadline_in(budget_s)))
            if cancel_after is not None:
                await asyncio.sleep(cancel_after)
                task.cancel()
            try:
                result = await task
            except asyncio.CancelledError:
                outcome = "cancelled"
            except DeadlineExceeded:
                outcome = "deadline"
            except QueueFull:
                outcome = "full"
            except ItemError:
                outcome = "item_error"
            except RuntimeError:
                outcome = "batch_error"
            else:
                assert result.value == item.upper()
                assert 1 <= result.batch_size <= 5
                outcome = "ok"
            assert item not in outcomes, f"{item} answered twice"
            outcomes[item] = outcome

        clients: list[Awaitable[None]] = []
        for i in range(400):
            group = rng.choice("abcde")
            item = f"{group}{i}" + ("!" if rng.random() < 0.05 else "")
            timeout = rng.choice([FAR, FAR, FAR, 0.001, 0.01, 0.05])
            cancel_after = rng.choice([None, None, None, None, 0.0, 0.002, 0.01])
            clients.append(client(item, timeout, cancel_after))
        await asyncio.wait_for(asyncio.gather(*clients), timeout=60)
        await b.drain(10)
        return outcomes

    outcomes = run(main())
    assert len(outcomes) == 400
    assert len(seen) == len(set(seen)), "an item was computed twice"
    computed = set(seen)
    for item, outcome in outcomes.items():
        if outcome in ("ok", "item_error", "batch_error"):
            assert item in computed, (item, outcome)
        elif outcome in ("deadline", "full"):
            assert item not in computed, (item, outcome)
    # Cancelled items were either dropped before compute (counted) or had already started.
    # (A task cancelled just after the worker failed its item for its deadline reports
    # "cancelled" but was counted as a deadline: compare the two reasons together.)
    dropped_cancelled = sum(1 for i, o in outcomes.items() if o == "cancelled" and i not in seen)
    deadlines = sum(1 for o in outcomes.values() if o == "deadline")
    dropped = rejected(metrics, "disconnected") + rejected(metrics, "deadline")
    assert dropped == dropped_cancelled + deadlines
    assert rejected(metrics, "queue_full") == sum(1 for o in outcomes.values() if o == "full")
    assert set(outcomes.values()) >= {"ok", "cancelled", "deadline", "item_error"}
    depth = metrics.registry.get_sample_value("sdpa_queue_depth")
    assert depth == 0


# ---- cancel_on_disconnect (service.api.disconnect) with an ASGI receive channel ------------


def asgi_request(disconnected: asyncio.Event) -> Request:
    """A Starlette request whose body was read; receive() says http.disconnect once
    `disconnected` is set (what uvicorn does when the client closes the connection)."""

    async def receive() -> dict[str, Any]:
        await disconnected.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/attention", "headers": []}
    return Request(scope, receive)


def test_cancel_on_disconnect_drops_the_queued_item() -> None:
    device = FakeDevice()
    metrics = Metrics()

    async def main() -> None:
        b = make(device, metrics=metrics)
        first = await held_device(device, b, "a0")
        gone = asyncio.Event()
        request = asgi_request(gone)
        waiting = asyncio.create_task(
            cancel_on_disconnect(request, b.submit("a1", deadline=deadline_in(FAR)))
        )
        await until(lambda: b.depth == 1)
        gone.set()
        with pytest.raises(ClientDisconnected):
            await waiting
        assert b.depth == 0  # dropped before cancel_on_disconnect returned
        device.release()
        await first
        await b.drain(5)

    run(main())
    assert device.computed() == ["a0"]
    assert rejected(metrics, "disconnected") == 1


def test_cancel_on_disconnect_returns_the_answer_of_a_connected_client() -> None:
    device = FakeDevice()

    async def main() -> BatchResult[str]:
        b = make(device)
        await b.start()
        request = asgi_request(asyncio.Event())  # never disconnects
        result = await cancel_on_disconnect(request, b.submit("a1", deadline=deadline_in(FAR)))
        await b.drain(5)
        return result

    assert run(main()).value == "A1"
