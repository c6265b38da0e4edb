"""DynamicBatcher: a bounded queue in front of one device worker.

How a batch forms
-----------------
Requests wait in one bounded queue (``max_queue``). A single worker task takes batches off it:
as soon as the device is free it takes the *oldest* queued request (of the tenant served next,
at its highest priority: service.runtime.queue), and with it every queued request of the same
group (``group_key``), oldest first, up to ``max_batch_size``. So no request waits for a batch
while the device is idle, and no group can starve another: whatever group holds the oldest
request runs next (with one tenant and one priority, exactly first come, first served by
group). ``max_batch_delay_s`` only bounds an optional wait for a
partial batch to grow (0, the default, never waits; the wait is counted from the oldest
request's arrival, so a request that already queued behind a busy device never waits more).
Nothing polls: the worker sleeps on an ``asyncio.Event`` that every arrival sets (with a batch
delay, every departure from the queue too: the oldest item may have changed).

The batch runs ``run_batch`` on a dedicated single-thread executor (the device thread), so the
event loop keeps serving HTTP while the device computes. ``run_batch`` returns one result or
exception per item, so one bad item fails alone; if ``run_batch`` itself raises, that is our
bug: every item of that batch gets the exception (a 500) and the worker lives on.

With ``batch_cost`` and ``max_batch_cost`` a batch is also cut by size: it grows while its
items' costs add up to at most ``max_batch_cost`` (the engine's cost is the padded score
matrix; on a CPU its budget is cache-sized), the first item always going.

Grouping and length buckets
---------------------------
The group key comes from the batching policy (``service.runtime.policy.BatchPolicy``): it
covers everything that changes the math (device, dtype, head dims, head counts, causal
alignment, scale, mask kinds, outputs asked for) plus a *length bucket* of N_q and of N_kv;
``length_bucket`` there gives the rule and why it bounds padding waste.

Answers
-------
An item refused at submit (503: QueueFull, the queue is full; ShuttingDown, the batcher
drains; DeadlineUnreachable, a long item that would not finish by its deadline; 429:
TenantQueueFull, its tenant holds its share of the queue, or the places left are kept for
tenants that hold none; 504: DeadlineExceeded, its
deadline already passed) never enters the queue. Every accepted item gets exactly one answer:
its result, its own exception, DeadlineExceeded (its deadline passed while it was queued: never
computed; or while a long item ran), ShuttingDown (still queued, or a long item running, when a
drain timed out), or nothing at all when its awaiting task was cancelled (the client went away;
it is dropped before compute if still queued, at its next tile if long). The queue
(service.runtime.queue) owns the items' states and answers them, each exactly once.

The rooms
---------
- service.runtime.queue: the items, their groups, tenants and priorities, and their answers;
- service.runtime.turns: the turns of long items, run in slices, and their admission by deadline;
- service.runtime.long_runs: the long items running, one tile a turn with the short batches
  before it;
- service.runtime.pace: the measured pace, the backlog and Retry-After;
- service.runtime.device_thread: the one thread that drives the device;
- here: submit, the deadline timers, the worker that takes short batches and turns, the drain,
  and the backlog gauges.

Time (deadlines, the pace, the projections) comes from one ``clock``, time.monotonic unless
another is given; the deadline timers run on the event loop's clock (the same one by default)
unless ``call_at`` schedules them on the injected clock (tests step a fake one: no sleeps).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import Gauge

from service.errors import (
    DeadlineExceeded,
    DeadlineUnreachable,
    QueueFull,
    ShuttingDown,
    TenantQueueFull,
)
from service.metrics import Metrics
from service.runtime.device_thread import DeviceThread
from service.runtime.long_runs import Around, LongRuns, shut_down_while_running
from service.runtime.pace import DEFAULT_RETRY_AFTER_S, Pace, retry_after
from service.runtime.queue import FEW_SLICES, BatchResult, Item, WorkQueue
from service.runtime.turns import MAX_RUNNING_LONG, LongTurns, Resumable
from service.tenants import ANONYMOUS, MAX_WEIGHT, MIN_WEIGHT

__all__ = [
    "FEW_SLICES",
    "MAX_RUNNING_LONG",
    "BatchResult",
    "BatcherConfig",
    "BatcherPolicy",
    "DynamicBatcher",
    "Resumable",
]

T = TypeVar("T")
R = TypeVar("R")
V = TypeVar("V")
RunT = TypeVar("RunT", bound=Resumable[Any])

logger = logging.getLogger("sdpa.batcher")


class Cancellable(Protocol):
    """A scheduled call that can be called off (asyncio.TimerHandle is one)."""

    def cancel(self) -> None: ...


def _twin(error: Exception) -> BaseException:
    """A new exception of the same type, args and attributes, caused by `error`: each item of a
    failed batch gets its own (one object raised in several tasks would gather all their
    tracebacks, and its handlers would log one another's frames). Built without calling
    __init__, which may take keyword-only arguments (SdpaError's param, a 503's retry_after_s):
    the type is what the app maps to a status. Should even that fail, a RuntimeError (a 500)
    caused by it; never an exception here, or the batch would go unanswered."""
    try:
        twin = type(error).__new__(type(error), *error.args)
        twin.__dict__.update(error.__dict__)
        twin.__cause__ = error
        return twin
    except BaseException:
        fallback = RuntimeError(f"run_batch failed with {type(error).__name__}")
        fallback.__cause__ = error
        return fallback


def _queued_too_long() -> DeadlineExceeded:
    return DeadlineExceeded(
        "the request's deadline passed while it was queued; it was not computed"
    )


@dataclass(frozen=True, slots=True)
class BatcherPolicy(Generic[T, R, RunT]):
    """How the batcher reads an item (the engine's BatchPolicy and cost model give these):
    its group (items of one group may share a batch), its cost (a batch grows while its items'
    costs add up to at most max_batch_cost: Ray Serve's batch_size_fn; BentoML #3859, a count
    alone lets a batch of large requests exhaust memory), its estimated device seconds (the
    backlog, Retry-After, and which items are long: service.runtime.pace; one unit each
    without it), and how a long item starts its run of about `tiles` tiles on the device
    thread (without it, every item is short): its run, of type RunT (sdpa_core's TiledRun, as
    it is: service.runtime.turns.Resumable)."""

    group_key: Callable[[T], Hashable]
    batch_cost: Callable[[T], float] | None = None
    work_seconds: Callable[[T], float] | None = None
    start_long: Callable[[T, int], RunT] | None = None
    # The item's answer of its finished run's result and the device seconds its tiles took,
    # on the device thread (None: the result itself); and what is noted of each tile of a run
    # with its seconds (the engine's compute metric). An error of either is the item's answer.
    finish_long: Callable[[T, Any, float], R] | None = None
    note_tile: Callable[[RunT, float], None] | None = None


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    """The batcher's bounds (service.settings gives them). max_batch_cost: in the
    policy's batch_cost units (None: no bound); slice_s: a long item's tile and the most short
    work between two tiles (None: every item is short); tenant_weights: the configured
    tenants (each finds room in the queue) and their fair-share weights; tenant_queue_share:
    the share of max_queue one tenant may hold."""

    max_batch_size: int
    max_queue: int
    max_batch_delay_s: float = 0.0
    max_batch_cost: float | None = None
    slice_s: float | None = None
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    tenant_queue_share: float = 1.0

    def __post_init__(self) -> None:
        if self.slice_s is not None and self.slice_s <= 0:
            raise ValueError(f"slice_s must be > 0, got {self.slice_s}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.max_batch_delay_s < 0:
            raise ValueError(f"max_batch_delay_s must be >= 0, got {self.max_batch_delay_s}")
        if not 0.0 < self.tenant_queue_share <= 1.0:
            raise ValueError(f"tenant_queue_share must be in (0, 1], got {self.tenant_queue_share}")
        if any(not (MIN_WEIGHT <= w <= MAX_WEIGHT) for w in self.tenant_weights.values()):
            raise ValueError(f"tenant weights must be within [{MIN_WEIGHT}, {MAX_WEIGHT}]")


class DynamicBatcher(Generic[T, R]):
    """Groups submitted items into batches and runs them one batch at a time on one thread."""

    def __init__(
        self,
        run_batch: Callable[[Sequence[T]], Sequence[R | BaseException]],
        policy: BatcherPolicy[T, R, Any],
        config: BatcherConfig,
        *,
        metrics: Metrics | None = None,
        idle_work: Callable[[], Callable[[], None] | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        call_at: Callable[[float, Callable[[], None]], Cancellable] | None = None,
    ) -> None:
        self._run_batch = run_batch
        # The one time source: deadlines are its instants, and the pace, the backlog and the
        # long items' projections are measured on it (a test injects a clock it steps).
        self._clock = clock
        # Schedules fn at an instant of that clock (the deadline timers): by default on the
        # event loop, whose clock may run apart from `clock`; a test's fake clock fires them
        # itself as it steps.
        self._call_at = call_at
        self._group_key = policy.group_key
        self._max_batch_size = config.max_batch_size
        self._max_batch_delay_s = config.max_batch_delay_s
        self._max_queue = config.max_queue
        self._tenant_queue_share = config.tenant_queue_share
        # The configured tenants (each finds room in the queue: _tenant_refusal).
        self._tenant_names = frozenset(config.tenant_weights)
        self._metrics = metrics
        # A batch grows while its items' costs add up to at most max_batch_cost (BatcherPolicy);
        # its first item always goes.
        self._batch_cost = policy.batch_cost
        self._max_batch_cost = math.inf if config.max_batch_cost is None else config.max_batch_cost
        # Work that runs on the device thread only while nothing is queued (the health
        # monitor's sampled summaries): asked for one call at a time, each awaited before the
        # queue is looked at again, so it delays a new arrival by one call at most.
        self._idle_work = idle_work
        # An item's estimated device seconds, for the backlog (service.runtime.pace).
        self._work_seconds = policy.work_seconds
        # Long items run in slices (service.runtime.turns); without both, every item is short.
        self._slice_s = config.slice_s if policy.start_long is not None else None

        self._queue: WorkQueue[T, R] = WorkQueue(
            weights=config.tenant_weights, on_change=self._queue_changed
        )
        for name in self._tenant_names:  # known from the start: the long shares count them
            self._queue.tenant(name)
        self._pace = Pace(clock)
        self._device = DeviceThread()
        self._turns: LongTurns[T, R] = LongTurns(self._queue, self._pace, clock)
        # The driving of the long items (service.runtime.long_runs), turn by turn.
        self._longs: LongRuns[T, R] | None = None
        if policy.start_long is not None and config.slice_s is not None:
            around = Around(
                take_batch=self._take_batch, execute=self._execute,
                drop_expired=self._drop_expired, expire=self._expire, changed=self._set_depth,
            )  # fmt: skip
            self._longs = LongRuns(
                self._turns, self._queue, self._pace, self._device, around,
                slice_s=config.slice_s, start_long=policy.start_long,
                finish_long=policy.finish_long, note_tile=policy.note_tile, clock=clock,
                metrics=metrics,
            )  # fmt: skip
        # What the worker took off the queue and has not answered yet: its error path answers
        # these, so that nothing taken is ever left unanswered.
        self._in_flight: list[Item[T, R]] = []

        self._arrival: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._draining = False
        self._tenant_gauges: dict[str, Gauge] = {}  # sdpa_tenant_backlog_seconds{tenant}

    # -- properties ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the worker task is alive."""
        return self._worker is not None and not self._worker.done()

    @property
    def draining(self) -> bool:
        """True once drain() was called: new items are refused."""
        return self._draining

    @property
    def device_busy(self) -> bool:
        """True while a batch computes on the device thread (after a drain timed out, too)."""
        return self._device.busy

    @property
    def depth(self) -> int:
        """Items waiting in the queue (not counting the batch on the device)."""
        return len(self._queue)

    @property
    def tenant_max_queue(self) -> int:
        """How many queued items one tenant may hold (service.runtime.queue: Tenants)."""
        return max(1, math.floor(self._max_queue * self._tenant_queue_share))

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the worker and its device thread. Idempotent while running."""
        if self.running:
            return
        if self._draining:
            raise RuntimeError("a drained batcher cannot be restarted")
        self._arrival = asyncio.Event()
        self._device.start()
        self._worker = asyncio.create_task(self._work(), name="sdpa-batcher")

    def wake(self) -> None:
        """Tell an idle worker that idle work may be waiting (the health monitor calls it)."""
        if self._arrival is not None:
            self._arrival.set()

    async def run_on_device(self, fn: Callable[[], V]) -> V:
        """fn() on the device thread, in turn with the batches (the warm-up, the cost model's
        calibration: the device is only ever driven from that one thread)."""
        if not self._device.started:
            raise RuntimeError("the batcher is not started")
        return await self._device.run(fn, compute=False)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new items, finish queued and in-flight work within timeout_s, stop the worker.

        Items still queued at the timeout get ShuttingDown; so does the batch on the device,
        which cannot be interrupted (its thread finishes in the background, unanswered), and
        the long item running, whose run stops after the tile on the device.
        Idempotent: a second call waits for the same worker.
        """
        self._draining = True
        if self._arrival is not None:
            self._arrival.set()  # wake an idle worker so that it sees the empty queue and exits
        worker = self._worker
        if worker is not None and not worker.done():
            done, _ = await asyncio.wait({worker}, timeout=max(0.0, timeout_s))
            if not done:
                logger.warning("drain timed out after %.1f s with %d queued", timeout_s, self.depth)
                self._fail_queued()
                worker.cancel()
                await asyncio.wait({worker})
        self._fail_queued()  # nothing should be left; a worker that died leaves its queue here
        self._device.shutdown()

    # -- submit ----------------------------------------------------------------------------

    async def submit(
        self, item: T, *, deadline: float, tenant: str = ANONYMOUS, priority: int = 1
    ) -> BatchResult[R]:
        """Queue `item` and wait for its answer. `deadline` is an instant of the batcher's
        clock (time.monotonic unless another was given); `tenant` is whose it is, `priority`
        its level among that tenant's items (1 the highest: service.runtime.queue).

        Raises QueueFull, ShuttingDown or DeadlineUnreachable (503; the last for a long item
        that would not finish by its deadline: service.runtime.turns), TenantQueueFull (429:
        the tenant holds its share of the queue), DeadlineExceeded (504: never computed), or
        the item's own exception. Cancelling the awaiting task drops a queued item before
        compute.
        """
        if self._draining or not self.running or self._arrival is None:
            self._reject("shutting_down")
            raise ShuttingDown(
                "the service is shutting down", retry_after_s=self._retry_after_s(item)
            )
        if len(self._queue) >= self._max_queue:
            self._reject("queue_full")
            raise QueueFull(
                f"the queue is full ({self._max_queue} requests waiting)",
                retry_after_s=self._retry_after_s(item),
            )
        if (refused := self._tenant_refusal(tenant)) is not None:
            self._reject("tenant_queue_full")
            raise TenantQueueFull(
                f"{refused}; retry after its own backlog (Retry-After), or send fewer requests "
                "at once",
                retry_after_s=self._tenant_retry_after_s(tenant, item),
            )
        now = self._clock()
        remaining = deadline - now
        if remaining <= 0:
            self._reject("deadline")
            raise DeadlineExceeded("the request's deadline passed before it was queued")

        work = self._work_of(item)
        pending: Item[T, R] = Item(
            item=item, key=self._group_key(item),
            cost=0.0 if self._batch_cost is None else self._batch_cost(item),
            work=work, seq=self._queue.next_seq(), deadline=deadline, enqueued=now,
            future=asyncio.get_running_loop().create_future(),
            tiles=self._pace.tiles_for(work, self._slice_s), tenant=tenant, priority=priority,
        )  # fmt: skip
        if pending.tiles and (refusal := self._turns.refusal(pending, now)) is not None:
            self._reject("deadline_unreachable")
            if refusal.by_share:  # its tenant's own long work holds its share: a 429
                raise TenantQueueFull(refusal.detail, retry_after_s=refusal.retry_after_s)
            raise DeadlineUnreachable(refusal.detail, retry_after_s=refusal.retry_after_s)
        self._queue.enqueue(pending)
        # The deadline bounds the queue wait and a long item's compute: a timer fails the item
        # while it is queued, or while a long one runs (dropped at its next tile); a short
        # batch (one slice at most) runs to its end. Awaiting the future itself (rather than
        # asyncio.wait) saves an event-loop round trip per request, which costs milliseconds
        # when the loop is saturated.
        future = pending.future
        expire = functools.partial(self._expire, pending)
        if self._call_at is None:
            timer: Cancellable = asyncio.get_running_loop().call_later(remaining, expire)
        else:
            timer = self._call_at(deadline, expire)
        try:
            return await future
        except asyncio.CancelledError:
            if self._queue.withdraw(pending):
                self._reject("disconnected")
            # A TAKEN short item runs to the end, a long one to its next tile; cancelling its
            # future tells the worker that nobody is listening, so it neither answers it nor
            # leaves an unretrieved exception.
            if not future.cancel() and not future.cancelled():
                future.exception()  # answered just before the cancel: mark it retrieved
            raise
        finally:
            timer.cancel()

    def _expire(self, pending: Item[T, R]) -> None:
        """The deadline timer: fail the item if it has not left the queue, or if it is a
        long item running (the worker drops its run at the next tile)."""
        if self._queue.withdraw(pending):
            self._reject("deadline")
            self._break(pending, _queued_too_long())
        elif pending.seq in self._turns.longs:  # (answered once: answer() skips a DONE one)
            progress = self._turns.longs[pending.seq].progress()
            self._break(
                pending,
                DeadlineExceeded(
                    f"the request's deadline passed while it ran ({progress}); it was abandoned"
                ),
            )

    def _drop_expired(self, pending: Item[T, R]) -> None:
        """A queued item whose deadline passed (the worker came to it before its timer): out
        of the queue, never computed, 504."""
        self._queue.remove(pending)
        self._reject("deadline")
        self._break(pending, _queued_too_long())

    def _break(self, pending: Item[T, R], error: DeadlineExceeded) -> None:
        """Answer an admitted item 504: a promise broken, counted by tenant
        (sdpa_broken_admissions_total; not when nobody was listening)."""
        if self._queue.answer(pending, error) and self._metrics is not None:
            self._metrics.broken_admissions_total.labels(tenant=pending.tenant).inc()

    def _tenant_refusal(self, tenant: str) -> str | None:
        """Why `tenant` may not queue one more item (429), or None: it holds its share of the
        queue; or it holds some, and the places left are kept for the configured tenants that
        hold none (one each), so that every tenant always finds room."""
        held = self._queue.queued_of(tenant)
        if held >= self.tenant_max_queue:
            return (
                f"tenant {tenant!r} holds {held} queued requests, its share of the queue "
                f"(SDPA_TENANT_MAX_QUEUE_SHARE {self._tenant_queue_share:g} of SDPA_MAX_QUEUE "
                f"{self._max_queue})"
            )
        if not held:
            return None
        waiting_for_room = sum(
            1 for name in self._tenant_names if name != tenant and not self._queue.queued_of(name)
        )
        free = self._max_queue - len(self._queue)
        if waiting_for_room and free <= waiting_for_room:
            return (
                f"tenant {tenant!r} holds {held} queued requests, and the last {free} places of "
                f"the queue are kept for the {waiting_for_room} other tenants that hold none"
            )
        return None

    def _queue_changed(self, added: bool) -> None:
        self._set_depth()
        # An arrival wakes the worker; so does a departure when it waits for a batch to grow:
        # the oldest item may have left (client gone, deadline), and the new oldest group may
        # be full.
        if self._arrival is not None and (added or self._max_batch_delay_s > 0):
            self._arrival.set()

    def _fail_queued(self) -> None:
        for pending in self._queue:
            self._queue.remove(pending)
            self._reject("shutting_down")
            self._queue.answer(
                pending,
                ShuttingDown(
                    "the service shut down before the request ran",
                    retry_after_s=DEFAULT_RETRY_AFTER_S,
                ),
            )

    # -- short batches ---------------------------------------------------------------------

    def _take_batch(self, max_work: float | None = None) -> list[Item[T, R]]:
        """The batch formed around the next short item (service.runtime.queue: the tenant
        served next, its highest priority's oldest), its group's items in the queue's order
        (long items stay queued), up to max_batch_size, max_batch_cost and max_work of
        estimated work (default one slice; the first item always goes); expired ones fail."""
        first = self._queue.next_short()
        if first is None:
            return []
        now = self._clock()
        # The worker's error path answers self._in_flight: should anything below raise, the
        # items already taken out of the queue are there, not lost with a local list.
        batch: list[Item[T, R]] = []
        self._in_flight = batch
        cost = work = 0.0
        if max_work is None:
            max_work = math.inf if self._slice_s is None else self._slice_s
        for pending in self._queue.batch_order(first):
            if len(batch) >= self._max_batch_size:
                break
            if batch and (
                cost + pending.cost > self._max_batch_cost or work + pending.work > max_work
            ):
                break
            if pending.deadline <= now:
                self._drop_expired(pending)
                continue
            self._queue.take(pending, now)
            batch.append(pending)
            cost += pending.cost
            work += pending.work
        return batch

    async def _wait_for_batch_to_grow(self) -> None:
        """With max_batch_delay_s > 0: wait (bounded) for the next batch's group to fill up."""
        assert self._arrival is not None
        while (first := self._queue.next_short(peek=True)) is not None and not self._draining:
            group = self._queue.group(first.key)
            if len(group) >= self._max_batch_size:
                return
            if sum(p.cost for p in group) >= self._max_batch_cost:
                return
            remaining = first.enqueued + self._max_batch_delay_s - self._clock()
            if remaining <= 0:
                return
            self._arrival.clear()
            try:
                await asyncio.wait_for(self._arrival.wait(), timeout=remaining)
            except TimeoutError:
                return

    # -- the worker ------------------------------------------------------------------------

    async def _work(self) -> None:
        assert self._arrival is not None
        while True:
            if not self._turns.longs and not len(self._queue):
                if self._draining:
                    return
                idle = None if self._idle_work is None else self._idle_work()
                if idle is not None:
                    await self._run_idle(idle)
                    continue
                self._arrival.clear()
                await self._arrival.wait()
                continue
            try:
                if self._longs is not None and self._longs.due():
                    await self._longs.turn()
                    continue
                if self._max_batch_delay_s > 0:
                    await self._wait_for_batch_to_grow()
                batch = self._take_batch()
                if batch:
                    await self._execute(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug of ours: log it, keep serving the others
                logger.exception("batcher worker error")
                # Whatever was taken must still get its one answer.
                for pending in self._in_flight:
                    self._queue.answer(pending, exc)
                self._in_flight = []
                if self._longs is not None:
                    self._longs.end_all(functools.partial(_twin, exc))

    async def _run_idle(self, fn: Callable[[], None]) -> None:
        """One piece of idle work on the device thread; its failure is logged, never raised."""
        try:
            await self._device.run(fn, compute=False)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("idle work failed on the device thread")

    async def _execute(self, batch: list[Item[T, R]]) -> float:
        """Run one batch on the device and answer its items; -> the device seconds it took."""
        loop = asyncio.get_running_loop()
        items = [pending.item for pending in batch]  # batch is self._in_flight (_take_batch)
        if self._metrics is not None:
            self._metrics.batch_size.observe(len(batch))
            for pending in batch:
                self._metrics.queue_wait_seconds.observe(pending.queue_s)
        # The device thread hands its results straight to _answer_batch on the loop, which
        # answers every item at once: each item's awaiting task wakes one loop step after the
        # device finished. (run_in_executor would first wake this worker, which would then wake
        # the items: two more steps per batch, a measurable share of a small request's latency.)
        device_done: asyncio.Future[float] = loop.create_future()
        started = self._clock()

        def on_device() -> tuple[Sequence[R | BaseException], float]:
            try:
                results: Sequence[R | BaseException] = self._run_batch(items)
                if len(results) != len(batch):
                    raise RuntimeError(
                        f"run_batch returned {len(results)} results for {len(batch)} items"
                    )
            except BaseException as exc:  # run_batch itself failed: our bug, a 500 for each item
                # BaseException too: whatever escaped here would leave the batch unanswered and
                # the worker waiting forever. Handed to the awaiting tasks, a KeyboardInterrupt
                # or SystemExit would stop the event loop and a CancelledError would pass for a
                # cancellation: those travel wrapped.
                logger.exception("run_batch failed for a batch of %d", len(batch))
                error = exc if isinstance(exc, Exception) else RuntimeError(f"run_batch: {exc!r}")
                results = [_twin(error) for _ in batch]
            return results, self._clock() - started

        def hand_back(
            done: concurrent.futures.Future[tuple[Sequence[R | BaseException], float]],
        ) -> None:
            # On the device thread, once the future is done (so the device reads as idle when
            # the items wake).
            results, seconds = done.result()
            # RuntimeError: the loop is closed, nobody is left to answer.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._answer_batch, batch, results, seconds, device_done)

        self._pace.start_running(sum(pending.work for pending in batch))
        self._device.submit(on_device).add_done_callback(hand_back)
        try:
            seconds = await device_done
        except asyncio.CancelledError:
            # drain() timed out while this batch was on the device: its items get ShuttingDown
            # now; _answer_batch, should it still come, finds them answered.
            for pending in batch:
                if self._queue.answer(pending, shut_down_while_running()):
                    self._reject("shutting_down")
            self._in_flight = []
            raise
        self._in_flight = []
        return seconds

    def _answer_batch(
        self,
        batch: list[Item[T, R]],
        results: Sequence[R | BaseException],
        seconds: float,
        device_done: asyncio.Future[float],
    ) -> None:
        """On the loop, once the device finished a batch: answer its items, free the worker."""
        try:
            self._note_throughput(self._pace.stop_running(), seconds)
            self._turns.stream.note_short(seconds)
            for pending, result in zip(batch, results, strict=True):
                # (one answered already, ShuttingDown after a drain timeout, is not again)
                self._queue.answer(pending, result, batch_size=len(batch))
        except Exception as exc:  # a bug of ours; the worker must go on all the same
            # _execute raises it, and the worker's error path answers what is left unanswered.
            if not device_done.done():
                device_done.set_exception(exc)
            return
        if not device_done.done():
            device_done.set_result(seconds)

    # -- throughput, Retry-After, metrics --------------------------------------------------

    def _work_of(self, item: T) -> float:
        return 1.0 if self._work_seconds is None else max(0.0, self._work_seconds(item))

    def _note_throughput(self, work: float, seconds: float) -> None:
        self._pace.note(work, seconds)
        self._set_depth()

    def _running_long_work(self, tenant: str | None = None) -> float:
        return sum(
            long.left_work
            for long in self._turns.longs.values()
            if tenant is None or long.pending.tenant == tenant
        )

    def backlog_seconds(self, extra_work: float = 0.0) -> float:
        """Estimated seconds until the queue, the batch on the device and `extra_work` are done:
        estimated work over the measured throughput (service.runtime.pace)."""
        return self._pace.backlog_seconds(self._queue.work + self._running_long_work() + extra_work)

    def tenant_backlog_seconds(
        self, tenant: str, extra_work: float = 0.0, *, backlogged_weight: float | None = None
    ) -> float:
        """Estimated seconds until the tenant's queued and running work and `extra_work` are
        done at its fair share of the device now (service.runtime.queue)."""
        state = self._queue.tenant(tenant)
        work = state.queued_work + self._running_long_work(tenant) + extra_work
        share = self._queue.share_of(state, backlogged_weight)
        return work * self._pace.seconds_per_work() / share

    def _retry_after_s(self, item: T) -> float:
        """Seconds until the backlog and this item are likely worked off, within [1, 60]."""
        if not self._pace.measured and self._work_seconds is None:
            return DEFAULT_RETRY_AFTER_S  # nothing measured, nothing estimated
        return retry_after(self.backlog_seconds(self._work_of(item)))

    def _tenant_retry_after_s(self, tenant: str, item: T) -> float:
        if not self._pace.measured and self._work_seconds is None:
            return DEFAULT_RETRY_AFTER_S
        return retry_after(self.tenant_backlog_seconds(tenant, self._work_of(item)))

    def _reject(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.rejected_total.labels(reason=reason).inc()

    def _set_depth(self) -> None:
        metrics = self._metrics
        if metrics is None:
            return
        metrics.queue_depth.set(len(self._queue))
        metrics.backlog_seconds.set(self.backlog_seconds())
        # Every tenant's: one tenant's arrival moves the others' shares. (Tenants are the
        # configured names: few; their gauges are looked up once.)
        weight = self._queue.backlogged_weight()
        for tenant in self._queue.tenants():
            gauge = self._tenant_gauges.get(tenant.name)
            if gauge is None:
                gauge = metrics.tenant_backlog_seconds.labels(tenant=tenant.name)
                self._tenant_gauges[tenant.name] = gauge
            gauge.set(self.tenant_backlog_seconds(tenant.name, backlogged_weight=weight))
