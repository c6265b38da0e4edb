"""DynamicBatcher: a bounded queue in front of one device worker.

How a batch forms
-----------------
Requests wait in one bounded queue (``max_queue``). A single worker task takes batches off it:
as soon as the device is free it takes the *oldest* queued request, and with it every queued
request of the same group (``group_key``), oldest first, up to ``max_batch_size``. So no request
waits for a batch while the device is idle, and no group can starve another: whatever group
holds the oldest request runs next. ``max_batch_delay_s`` only bounds an optional wait for a
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
drains; DeadlineUnreachable, a long item that would not finish by its deadline; 504:
DeadlineExceeded, its deadline already passed) never enters the queue. Every accepted item
gets exactly one answer: its result, its own exception, DeadlineExceeded (its deadline passed
while it was queued: never computed; or while a long item ran), ShuttingDown (still queued,
or a long item running, when a drain timed out), or nothing at all when its awaiting task was
cancelled (the client went away; it is dropped before compute if still queued, at its next
tile if long). An item's state moves QUEUED -> TAKEN -> DONE or QUEUED -> DROPPED, and only
the side that moves it out of QUEUED may answer it (for a long item running, the deadline
timer too, which the worker then sees between tiles), and whoever answers marks it DONE
first, so no two sides ever answer one item.

Long requests run in slices
---------------------------
With ``slice_s`` and ``start_long``, an item whose estimated work exceeds one slice (at the
measured pace, below) is *long*: it runs alone, as a resumable run of about that many tiles
(``start_long(item, tiles)``, called on the device thread; each ``step()`` computes one tile).
Up to MAX_RUNNING_LONG long items run at once and share the device tile by tile, the queued
one with the earliest deadline joining when one finishes (one of at most FEW_SLICES slices
joins at once, up to twice as many running). Each tile goes to the running item with the
least estimated work left (below: Deadlines of long items), so a long item of a few slices
is not stuck behind one of hundreds. Before each tile the worker

- drops the long items nobody waits for: their deadline passed (the timer answers
  DeadlineExceeded at once, naming how many tiles were done; or, should the timer be late,
  the worker) or their client left (cancelled), freeing what they held;
- starts every queued long item that may join;
- runs the short batches waiting (the oldest short item's group first), up to one slice of
  their estimated work, so a short request waits about one tile behind long ones and a
  stream of short ones still leaves the long ones at least half the device.

Short batches are cut at one slice of estimated work too (their first item always goes).
sdpa_abandoned_total{reason} counts the runs dropped, and sdpa_compute_seconds (one
observation per tile) shows that no further tile of theirs ran.

Deadlines of long items
-----------------------
Long items that shared the device in round robin, one tile each, all progressed together and
all missed a deadline they shared (8 analyzes of 0.38 s with 1.5 s to go: none finished,
where 3 would have one after the other). So the tiles go by work and deadline, queued items
join by deadline, and long items are admitted by deadline:

- The next tile goes to the running item with the least estimated work left (the oldest
  first on ties): it finishes items rather than spreading the device over them. Of items
  running together, each finishes no later than in round robin; a long item of a few slices
  beside ones of hundreds goes first; and items of one size run one after the other, so an
  estimate that was short costs the last of them its deadline, not all of them. The price: a
  long item may wait for smaller ones that arrive after it, as long as its deadline allows
  (the admission below keeps it).
- Unless that order would make an admitted item miss a deadline it can still meet alone,
  running or queued (a projection of the tiles, ``_Turns``, at the measured pace; the queued
  ones count, since that order frees places at other times): then the tile goes to the
  earliest deadline among those that can (earliest deadline first meets every deadline that
  any order could). Earliest deadline first throughout would not do: with the default
  deadline, 30 s from each request's start, it is first come first served, and a few slices
  would wait for the hundreds again.
- Queued long items join by deadline, the earliest first (the oldest on ties), those of few
  slices past the cap likewise among themselves. In arrival order, one client's long
  requests with far deadlines (timeout_ms may be an hour) queued ahead of a request with the
  default deadline made it wait for all of them: behind 24 analyzes of 3.5 s with an hour to
  go, every later one with the default deadline was refused until all but its deadline's
  worth of them were done, where going first it would have cost none of them its deadline.
  A running item keeps its place (it holds its inputs and partial results on the device:
  nothing is preempted), so an earlier deadline waits for a place at most, or joins past
  the cap if it is of few slices.
- At submit, a long item is refused, DeadlineUnreachable (503) counted as
  sdpa_rejected_total{reason="deadline_unreachable"}, if a projection of the running and
  queued long items by earliest deadline first (after the short work queued and the tile on
  the device) says it would miss a deadline it could meet alone on an idle device, or make an
  admitted long item miss a deadline it would meet without it, judged against what the
  worker does without it (the least work left first while that meets every deadline, else
  the earliest deadline first). The projections follow the worker: the same join order, the
  same caps, the tile on the device finished first. On random workloads with exact
  estimates, every item admitted finished by its deadline (before these rules, 294 of 400
  workloads of forty items broke a promise: tests/service/runtime/test_long_requests.py).
- No projection runs where none is needed: when all the long work and the short work queued
  would be done by the earliest deadline in any order, or when the item is last in line (its
  deadline the latest, and not of few slices while others wait to join) with time for all
  the admitted work: it joins after all the others and has the device only when none of
  theirs is due, so it harms nobody. Requests with the default deadline arriving in order
  are both.
- The event loop pays for the projections (4 to 10 us an item taken into one, on a shared
  2-core machine), so a submit's are bounded: a projection ends as soon as all the work left
  would be done by the earliest deadline left (every item then finishes, whatever the
  order), and gives up after _PROJECTED_LONGS items, the item then refused (its deadline
  falls among those of more than that many long items at stake: whether it would finish was
  not worked out). An item that cannot finish by its deadline from where it joins only holds
  a place, and counts as _HOLDER_SHARE of one: a flood of hopeless requests does not make
  the projections give up. A thousand long items queued with an hour to go cost a refusal a
  handful of them, where each refusal projected them all twice (12 ms, and 30 refusals a
  second held a bystander up to 0.45 s).
- Its Retry-After is the first whole second at which the same request would be admitted as the
  projection goes on without it (probes at 1, 2, 4... s, then bisection), its probes taking at
  most _SEARCHED_LONGS items in all; else when a fast path above would admit it (last in line, or
  all the admitted work done); at most 60. Every second below 60 it names is one at which it would
  be admitted (an upper bound of the first); 60 says none sooner was found, and where the
  projection gave up, no search is made (when the admitted long work would be done, at most 60).
  It is recomputed at each refusal from the pace measured then, so the instants named move as the
  pace does, by its change times the work ahead: the 60, 39 and 29 a review saw 2 s apart were the
  cap (with 60 s of work ahead in arrival order), then a pace falling as the first tiles were
  measured (1.22 to 1.02 device seconds per estimated second in the first 12 s here, a 3072^2
  warm-up and the early tiles of 8192^2 analyzes, whose share_done lags then races, weighing less
  and less). With the estimates right, it falls exactly as time passes.
- An item that cannot finish by its deadline even alone is admitted as before (the estimate
  may be wrong) and abandoned at its deadline (504, naming the tiles done), but it gets a
  tile only while no running item that can still finish is there: it costs nobody their
  deadline (the projections give it a place and never the device).

Time (deadlines, the pace, the projections) comes from one ``clock``, time.monotonic unless
another is given; the deadline timer runs on the event loop's clock, the same one by default.

Retry-After and the backlog
---------------------------
Each item carries its estimated work (``work_seconds``: the runtime's cost model, in estimated
device seconds; one unit per item without it). The backlog is the queued work plus what is left
of the batch on the device and of the long items running (each one's estimate times the share
of its run not yet done, which the run itself reports: its steps may outnumber the tiles it
planned), divided by the measured throughput:
the estimated work done per second the device was busy, both summed with a half-life of
THROUGHPUT_HALF_LIFE_S of device time and starting from THROUGHPUT_PRIOR_S of the model's own
pace. Weighing batches by their time, a stream of tiny requests (whose fixed costs the model
under-counts) cannot make a queue of large ones look long or short, and a model off by a
constant factor is corrected.
Retry-After (a full queue, a drain) is that backlog in whole seconds, within [1, 60] (a long
item refused by its deadline has its own: Deadlines of long items, above);
``backlog_seconds()`` and the gauge sdpa_backlog_seconds report it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import heapq
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from service.errors import DeadlineExceeded, DeadlineUnreachable, QueueFull, ShuttingDown
from service.metrics import Metrics

T = TypeVar("T")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
V = TypeVar("V")

logger = logging.getLogger("sdpa.batcher")

# Retry-After before any batch has run (no throughput measured yet).
_DEFAULT_RETRY_AFTER_S = 1.0
# A client told to come back later than this would rather try another replica.
_MAX_RETRY_AFTER_S = 60.0
# The measured throughput (module docstring): the model weighs as much as a quarter second of
# measured device time; measurements older than the half-life of device time weigh half. (With
# a whole second, a model calibrated while the machine was busy kept Retry-After about 1.5x too
# long through the first second of long requests; a tile of a long request is measured every
# slice, so the pace soon rests on measurements.)
THROUGHPUT_PRIOR_S = 0.25
THROUGHPUT_HALF_LIFE_S = 30.0
# Long items running at once, which share the device tile by tile: a long item of a few
# slices need not wait for a long one of hundreds. Each holds its inputs and partial results
# on the device until it is done (their bytes were reserved at admission:
# service.middleware.inflight).
MAX_RUNNING_LONG = 4
# The admission of a long item projects the long items admitted (module docstring), on the
# event loop, at about 4 us an item taken into a projection: a projection ends once every
# item left would finish whatever the order, and gives up after this many items (the item is
# then refused: whether it would finish was not worked out). So a submit costs at most two
# projections of this many items, however many are queued (a refusal with a thousand long
# items queued projected them all twice, about 12 ms, and a bystander waited 0.45 s behind
# 30 refusals a second).
_PROJECTED_LONGS = 128
# An item taken into a projection that cannot finish by its deadline from there (hopeless, or
# its deadline passed while it waited) costs a heap push and pop: it counts as this share of an
# item against the bounds: a projection gives up behind 1,024 of them (the default
# SDPA_MAX_QUEUE), not 128.
_HOLDER_SHARE = 1 / 8
# A refused long item is told to come back at the first second a projection would admit it,
# probes at 1, 2, 4... s, then bisection below the first that fits: the probes take at most
# this many items into their projections all together (a probe that would take more counts as
# not fitting, so the second found still fits; without one found, when the admitted long work
# is done).
_SEARCHED_LONGS = 128
# A long item of at most this many slices joins the running ones at once even past
# MAX_RUNNING_LONG (up to twice as many running in all): it is done after a few tiles, rather
# than waiting for a long item of hundreds to finish. The bound keeps a flood of them from
# each holding its inputs and results on the device at once.
FEW_SLICES = 4


class Resumable(Protocol[R_co]):
    """A long item's run: step(budget_s) computes one tile (about budget_s seconds where the
    run can tell) on the device thread and says whether the run is done (it never raises: a
    failure ends the run with outcome() that error)."""

    @property
    def tiles_total(self) -> int: ...

    @property
    def tiles_done(self) -> int: ...

    @property
    def share_done(self) -> float:
        """About how much of the run's work is done, from 0 to 1 (its steps may outnumber
        tiles_total's plan: a step that stops at a time budget does less than a tile)."""
        ...

    def step(self, budget_s: float) -> bool: ...

    def outcome(self) -> R_co | BaseException: ...


@dataclass(frozen=True, slots=True)
class BatchResult(Generic[R]):
    """One item's answer: the value and how it ran (for the response's meta)."""

    value: R
    batch_size: int
    queue_ms: float


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


class _State(enum.Enum):
    QUEUED = enum.auto()
    TAKEN = enum.auto()  # in a batch that runs (or ran) on the device
    DONE = enum.auto()
    DROPPED = enum.auto()  # left the queue without being computed


class _Pending(Generic[T, R]):
    __slots__ = (
        "cost", "deadline", "enqueued", "future", "item", "key", "queue_s", "seq", "state",
        "tiles", "work",
    )  # fmt: skip

    def __init__(
        self,
        *,
        item: T,
        key: Hashable,
        cost: float,
        work: float,
        seq: int,
        deadline: float,
        enqueued: float,
        future: asyncio.Future[BatchResult[R]],
        tiles: int = 0,
    ) -> None:
        self.item = item
        self.tiles = tiles  # > 0: a long item, run in about this many tiles
        self.key = key
        self.cost = cost
        self.work = work  # estimated device seconds (one unit without a cost model)
        self.seq = seq
        self.deadline = deadline
        self.enqueued = enqueued
        self.future = future
        self.state = _State.QUEUED
        self.queue_s = 0.0


class _Long(Generic[T, R]):
    """A long item taken off the queue: its run (started at its first tile) and its estimated
    work not yet done, beyond the tile on the device."""

    __slots__ = ("left_work", "pending", "run")

    def __init__(self, pending: _Pending[T, R]) -> None:
        self.pending = pending
        self.run: Resumable[R] | None = None
        self.left_work = pending.work

    def share_done(self) -> float:
        """The run's share_done, trusted within [0, 1] only (NaN reads as nothing done)."""
        share = 0.0 if self.run is None else self.run.share_done
        return 0.0 if math.isnan(share) else min(1.0, max(0.0, share))

    def progress(self) -> str:
        done = 0 if self.run is None else self.run.tiles_done
        total = self.pending.tiles if self.run is None else self.run.tiles_total
        return f"{done} of {total} tiles done"


class _Share(NamedTuple):
    """A long item in a projection of the tiles: device seconds of work left, its deadline in
    seconds from the projection's start, and whether it is of few slices (joins past the cap).
    (A tuple: a projection makes one per item it takes in, and a dataclass's are slower.)
    """

    seq: int
    left: float
    deadline: float
    few: bool = False


# A queued long item as the worker and the projections order it: (deadline, seq, item), the
# earliest deadline first and the oldest on ties.
_Entry = tuple[float, int, "_Pending[Any, Any]"]


class _Waiting:
    """The queued long items as one projection sees them: copies of the batcher's heaps of
    entries (all of them, and those of few slices), whose items are taken in the order the
    worker's _next_long takes them; entries of items no longer queued are skipped, as the
    worker skips them. Work in device seconds at per_work, deadlines in seconds from origin.
    """

    __slots__ = ("_count", "_every", "_few", "_joined", "left_s", "origin", "per_work")

    def __init__(
        self,
        every: Sequence[_Entry],
        few: Sequence[_Entry],
        *,
        origin: float,
        per_work: float,
        work: float,
        count: int,
    ) -> None:
        self._every, self._few = list(every), list(few)  # heaps still: copies of heaps
        self._joined: set[int] = set()
        self.origin, self.per_work = origin, per_work
        self._count = count  # items not taken yet, and their work in device seconds
        self.left_s = work * per_work

    def add(self, entry: _Entry) -> None:
        heapq.heappush(self._every, entry)
        if entry[2].tiles <= FEW_SLICES:
            heapq.heappush(self._few, entry)
        self._count += 1
        self.left_s += entry[2].work * self.per_work

    def _first(self, heap: list[_Entry]) -> _Entry | None:
        joined = self._joined
        while heap and (heap[0][1] in joined or heap[0][2].state is not _State.QUEUED):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def first_deadline(self) -> float:
        entry = self._first(self._every)
        return math.inf if entry is None else entry[0] - self.origin

    def take(self, *, few_only: bool) -> _Share | None:
        """The item that joins next, taken out: the earliest deadline (of those of few
        slices only)."""
        heap = self._few if few_only else self._every
        if self._first(heap) is None:
            return None
        deadline, seq, pending = heapq.heappop(heap)
        self._joined.add(seq)
        left = pending.work * self.per_work
        self._count -= 1
        # (summed floats drift: once none is left, exactly nothing is)
        self.left_s = max(0.0, self.left_s - left) if self._count > 0 else 0.0
        return _Share(seq, left, deadline - self.origin, pending.tiles <= FEW_SLICES)


class _Turns:
    """A projection of the long items' tiles (module docstring), for their admission and for
    the choice of a tile. One running item has the device at a time: the earliest deadline
    (``by_deadline``) or the least work left, the oldest first on ties; the queued items join
    as the worker's _next_long takes them (the earliest deadline, the oldest on ties, while
    fewer than MAX_RUNNING_LONG run, else the earliest of few slices while fewer than twice as
    many), and may then take the device; each item stops at its deadline (abandoned, or
    dropped while queued). An item that cannot finish by its deadline even alone, when it
    joins, holds its place until its deadline and never has the device. Tiles are taken as
    fluid.

    Its cost is bounded: once all the work left would be done by the earliest deadline left
    (the device is never idle while no item holds a place it cannot use), every item left
    finishes whatever the order, and the projection ends there (``rest_finish``); and after
    ``most`` items taken it gives up (``exhausted``: what it would have found past them is
    unknown). Each step ends an item, frees a place or ends the projection, at O(log n):
    a whole run costs O(min(most, items) x log n), n the items queued.

    Times are seconds from now (no rounding of a large clock value can stall it).
    """

    def __init__(
        self,
        start: float,
        running: Iterable[_Share],
        waiting: _Waiting | None,
        *,
        by_deadline: bool,
        most: float = math.inf,
    ) -> None:
        self.now = start
        self._by_deadline = by_deadline
        self._left: dict[int, float] = {}  # the items that may have the device: work left
        self._deadline: dict[int, float] = {}
        # Heaps (entries no longer true are skipped) by priority and by deadline: one and the
        # same when the priority is the deadline.
        self._order: list[tuple[float, int]] = []
        self._deadlines = self._order if by_deadline else []
        self._priorities = self._deadline if by_deadline else self._left
        self._holding: list[float] = []  # a heap of the deadlines of those that never run
        self._waiting = waiting
        self._most = most
        # Items taken into the projection (running, then joined), those that only hold a
        # place counted as _HOLDER_SHARE of one.
        self.examined: float = 0
        self.exhausted = False
        self.rest_finish = False
        # The items that finished by their deadline, and when; those that did not, and of them
        # those that could not even alone on an idle device from the projection's start.
        self.finished: dict[int, float] = {}
        self.missed: set[int] = set()
        self.hopeless: set[int] = set()
        for share in running:
            self.examined += 1
            self._start(share)
        self._join()

    def finishes(self, seq: int) -> bool:
        """Whether the item finishes by its deadline (False where the projection gave up)."""
        return seq in self.finished or (self.rest_finish and seq not in self.missed)

    def add(self, entry: _Entry) -> None:
        """Queue one more item (it joins at once if a place is free and no queued item with
        an earlier deadline is waiting for it)."""
        assert self._waiting is not None
        self._waiting.add(entry)
        self._join()

    def run(self, until: float = math.inf) -> None:
        """Project the tiles up to `until` (to the end by default)."""
        left, order, deadlines, holding = self._left, self._order, self._deadlines, self._holding
        priorities = self._priorities
        while (left or holding) and self.now < until and not self.exhausted:
            done_at = deadline = math.inf
            if left:
                while order[0][1] not in left or order[0][0] != priorities[order[0][1]]:
                    heapq.heappop(order)
                while deadlines[0][1] not in left:
                    heapq.heappop(deadlines)
                (_, first), (deadline, due) = order[0], deadlines[0]
                done_at = self.now + left[first]
            if until == math.inf and not holding and self._rest_finishes(deadline):
                return
            released = holding[0] if holding else math.inf
            at = min(done_at, deadline, released, until)
            if left and at > self.now:
                left[first] -= at - self.now
            self.now = max(self.now, at)
            if at == done_at:  # done at its deadline still counts (rounding aside)
                del left[first]
                self.finished[first] = self.now
            elif at == deadline:
                del left[due]  # abandoned at its deadline
                self.missed.add(due)
            elif at == released:
                heapq.heappop(holding)
            if left and first in left and not self._by_deadline:
                heapq.heappush(order, (left[first], first))  # its priority moved
            if at == until:
                return
            self._join()

    def _rest_finishes(self, first_running_deadline: float) -> bool:
        """Whether everything left, running and queued, is done by the earliest deadline
        among them (then whatever the order, every one of them finishes: end here)."""
        rest = sum(self._left.values())
        first_deadline = first_running_deadline
        if self._waiting is not None:
            rest += self._waiting.left_s
            first_deadline = min(first_deadline, self._waiting.first_deadline())
        if self.now + rest > first_deadline:
            return False
        self.now += rest
        self.rest_finish = True
        return True

    def _start(self, share: _Share) -> None:
        if share.left <= 0.0:  # its last tile is the one on the device: done as it ends
            if share.deadline >= self.now:
                self.finished[share.seq] = self.now
            else:
                self.missed.add(share.seq)
            return
        if share.left > share.deadline - self.now:
            heapq.heappush(self._holding, share.deadline)
            self.missed.add(share.seq)
            if share.left > share.deadline:
                self.hopeless.add(share.seq)
            return
        self._left[share.seq] = share.left
        self._deadline[share.seq] = share.deadline
        heapq.heappush(self._order, (self._priorities[share.seq], share.seq))
        if self._deadlines is not self._order:
            heapq.heappush(self._deadlines, (share.deadline, share.seq))

    def _join(self) -> None:
        waiting = self._waiting
        if waiting is None:
            return
        while (places := len(self._left) + len(self._holding)) < 2 * MAX_RUNNING_LONG:
            share = waiting.take(few_only=places >= MAX_RUNNING_LONG)
            if share is None:
                return
            if self.examined >= self._most:
                self.exhausted = True  # (the projection ends here: `share` is not needed)
                return
            # One that cannot finish by its deadline from here only holds a place until then
            # (or none, past it): a push and a pop, a fraction of what an item at stake costs.
            # Counted as a whole item, a flood of such cheap hopeless requests made every
            # projection give up, and every long request behind them was refused.
            at_stake = share.left <= share.deadline - self.now
            self.examined += 1 if at_stake else _HOLDER_SHARE
            if share.deadline > self.now:
                self._start(share)
            else:  # its deadline passed while it was queued (a 504, never computed)
                self.missed.add(share.seq)


@dataclass(frozen=True, slots=True)
class _Refusal:
    detail: str
    retry_after_s: float


class DynamicBatcher(Generic[T, R]):
    """Groups submitted items into batches and runs them one batch at a time on one thread."""

    def __init__(
        self,
        run_batch: Callable[[Sequence[T]], Sequence[R | BaseException]],
        *,
        group_key: Callable[[T], Hashable],
        max_batch_size: int,
        max_batch_delay_s: float,
        max_queue: int,
        metrics: Metrics | None = None,
        batch_cost: Callable[[T], float] | None = None,
        max_batch_cost: float | None = None,
        idle_work: Callable[[], Callable[[], None] | None] | None = None,
        work_seconds: Callable[[T], float] | None = None,
        slice_s: float | None = None,
        start_long: Callable[[T, int], Resumable[R]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if slice_s is not None and slice_s <= 0:
            raise ValueError(f"slice_s must be > 0, got {slice_s}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_batch_delay_s < 0:
            raise ValueError(f"max_batch_delay_s must be >= 0, got {max_batch_delay_s}")
        self._run_batch = run_batch
        # The one time source: deadlines are its instants, and the pace, the backlog and the
        # long items' projections are measured on it (a test injects a clock it steps).
        self._clock = clock
        self._group_key = group_key
        self._max_batch_size = max_batch_size
        self._max_batch_delay_s = max_batch_delay_s
        self._max_queue = max_queue
        self._metrics = metrics
        # Optional size accounting beyond the count (Ray Serve's batch_size_fn; BentoML #3859:
        # a count alone lets a batch of large requests exhaust memory): a batch grows while the
        # sum of its items' costs stays within max_batch_cost; its first item always goes.
        self._batch_cost = batch_cost
        self._max_batch_cost = math.inf if max_batch_cost is None else max_batch_cost
        # Work that runs on the device thread only while nothing is queued (the health
        # monitor's sampled summaries): asked for one call at a time, each awaited before the
        # queue is looked at again, so it delays a new arrival by one call at most.
        self._idle_work = idle_work
        # An item's estimated device seconds, for the backlog (module docstring).
        self._work_seconds = work_seconds
        # Long items run in slices (module docstring); without both, every item is short.
        self._slice_s = slice_s if start_long is not None else None
        self._start_long = start_long
        # The long items running, in the order they started.
        self._longs: OrderedDict[int, _Long[T, R]] = OrderedDict()

        # Every queued item in arrival order, and the same items per group (arrival order).
        # OrderedDicts: O(1) removal from the middle (cancel, deadline) and O(1) oldest.
        self._queue: OrderedDict[int, _Pending[T, R]] = OrderedDict()
        self._groups: dict[Hashable, OrderedDict[int, _Pending[T, R]]] = {}
        self._seq = itertools.count()
        self._in_flight: list[_Pending[T, R]] = []
        self._queued_work = 0.0  # the sum of the queued items' work
        self._queued_longs = 0  # how many queued items are long, and their work
        self._queued_long_work = 0.0
        # The queued long items by deadline (the order they join in), all of them and those of
        # few slices: heaps of _Entry, whose items that left the queue are skipped when they
        # surface (and swept out once they outnumber the queued ones).
        self._long_heap: list[_Entry] = []
        self._few_heap: list[_Entry] = []
        # No queued long item's deadline is later (the latest enqueued since the queue of long
        # items was last empty: an item that left may have had it).
        self._latest_long_deadline = -math.inf
        self._running_work = 0.0  # the batch on the device: its work, and since when
        self._running_since = 0.0

        self._arrival: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        # True from the moment a batch is handed to the device thread until run_batch returned
        # there; written by both threads (a bool assignment is atomic under the GIL).
        self._device_busy = False
        self._draining = False
        # Estimated work done, and device seconds it took: decayed sums (module docstring).
        self._done_work = THROUGHPUT_PRIOR_S
        self._busy_s = THROUGHPUT_PRIOR_S
        self._measured = False

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
        return self._device_busy

    @property
    def depth(self) -> int:
        """Items waiting in the queue (not counting the batch on the device)."""
        return len(self._queue)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the worker and its device thread. Idempotent while running."""
        if self.running:
            return
        if self._draining:
            raise RuntimeError("a drained batcher cannot be restarted")
        self._arrival = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdpa-device")
        self._worker = asyncio.create_task(self._work(), name="sdpa-batcher")

    def wake(self) -> None:
        """Tell an idle worker that idle work may be waiting (the health monitor calls it)."""
        if self._arrival is not None:
            self._arrival.set()

    async def run_on_device(self, fn: Callable[[], V]) -> V:
        """fn() on the device thread, in turn with the batches (the warm-up, the cost model's
        calibration: the device is only ever driven from that one thread)."""
        if self._executor is None:
            raise RuntimeError("the batcher is not started")
        return await asyncio.wrap_future(self._executor.submit(fn))

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
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    # -- submit ----------------------------------------------------------------------------

    async def submit(self, item: T, *, deadline: float) -> BatchResult[R]:
        """Queue `item` and wait for its answer. `deadline` is an instant of the batcher's
        clock (time.monotonic unless another was given).

        Raises QueueFull, ShuttingDown or DeadlineUnreachable (503; the last for a long item
        that would not finish by its deadline: module docstring), DeadlineExceeded (504: never
        computed), or the item's own exception. Cancelling the awaiting task drops a queued
        item before compute.
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
        now = self._clock()
        remaining = deadline - now
        if remaining <= 0:
            self._reject("deadline")
            raise DeadlineExceeded("the request's deadline passed before it was queued")

        key = self._group_key(item)
        cost = 0.0 if self._batch_cost is None else self._batch_cost(item)
        future: asyncio.Future[BatchResult[R]] = asyncio.get_running_loop().create_future()
        work = self._work_of(item)
        pending = _Pending(
            item=item, key=key, cost=cost, work=work, seq=next(self._seq),
            deadline=deadline, enqueued=now, future=future, tiles=self._tiles_for(work),
        )  # fmt: skip
        if pending.tiles and (refusal := self._refusal(pending, now)) is not None:
            self._reject("deadline_unreachable")
            raise DeadlineUnreachable(refusal.detail, retry_after_s=refusal.retry_after_s)
        self._enqueue(pending)
        # The deadline bounds the queue wait and a long item's compute: a timer fails the item
        # while it is queued, or while a long one runs (dropped at its next tile); a short
        # batch (one slice at most) runs to its end. Awaiting the future itself (rather than
        # asyncio.wait) saves an event-loop round trip per request, which costs milliseconds
        # when the loop is saturated.
        timer = asyncio.get_running_loop().call_later(remaining, self._expire, pending)
        try:
            return await future
        except asyncio.CancelledError:
            if pending.state is _State.QUEUED:
                self._remove(pending)
                self._reject("disconnected")
            # A TAKEN short item runs to the end, a long one to its next tile; cancelling its
            # future tells the worker that nobody is listening, so it neither answers it nor
            # leaves an unretrieved exception.
            if not future.cancel() and not future.cancelled():
                future.exception()  # answered just before the cancel: mark it retrieved
            raise
        finally:
            timer.cancel()

    def _expire(self, pending: _Pending[T, R]) -> None:
        """The deadline timer: fail the item if it has not left the queue, or if it is the
        long item running (the worker drops its run at the next tile)."""
        if pending.state is _State.QUEUED:
            self._remove(pending)
            self._reject("deadline")
            self._answer_error(pending, _queued_too_long())
        elif pending.state is _State.TAKEN and pending.seq in self._longs:
            progress = self._longs[pending.seq].progress()
            self._answer_error(
                pending,
                DeadlineExceeded(
                    f"the request's deadline passed while it ran ({progress}); it was abandoned"
                ),
            )

    # -- queue bookkeeping -----------------------------------------------------------------

    def _enqueue(self, pending: _Pending[T, R]) -> None:
        self._queue[pending.seq] = pending
        self._queued_work += pending.work
        if pending.tiles:
            self._queued_longs += 1
            self._queued_long_work += pending.work
            self._latest_long_deadline = max(self._latest_long_deadline, pending.deadline)
            entry = (pending.deadline, pending.seq, pending)
            heapq.heappush(self._long_heap, entry)
            if pending.tiles <= FEW_SLICES:
                heapq.heappush(self._few_heap, entry)
            self._sweep_long_heaps()
        self._groups.setdefault(pending.key, OrderedDict())[pending.seq] = pending
        self._set_depth()
        assert self._arrival is not None
        self._arrival.set()

    def _remove(self, pending: _Pending[T, R]) -> None:
        """Take a QUEUED item out of the queue without computing it."""
        pending.state = _State.DROPPED
        del self._queue[pending.seq]
        # Summed floats drift: an empty queue holds exactly no work.
        self._queued_work = self._queued_work - pending.work if self._queue else 0.0
        if pending.tiles:
            self._queued_longs -= 1
            if self._queued_longs:
                self._queued_long_work -= pending.work
                self._sweep_long_heaps()
            else:
                self._queued_long_work = 0.0
                self._latest_long_deadline = -math.inf
                self._long_heap.clear()
                self._few_heap.clear()
        group = self._groups[pending.key]
        del group[pending.seq]
        if not group:
            del self._groups[pending.key]
        self._set_depth()
        if self._arrival is not None and self._max_batch_delay_s > 0:
            # A worker waiting for the oldest item's group to grow must look again: the oldest
            # may have left (client gone, deadline), and the new oldest group may be full.
            self._arrival.set()

    def _sweep_long_heaps(self) -> None:
        """Drop the entries of items no longer queued once they outnumber the queued ones:
        each heap stays within twice the long items queued (amortized O(1) an item)."""
        most = 2 * self._queued_longs + 64
        if len(self._long_heap) > most or len(self._few_heap) > most:
            for heap in (self._long_heap, self._few_heap):
                heap[:] = [entry for entry in heap if entry[2].state is _State.QUEUED]
                heapq.heapify(heap)

    def _first_queued(self, heap: list[_Entry]) -> _Pending[T, R] | None:
        """The queued item of `heap` with the earliest deadline (the oldest on ties)."""
        while heap and heap[0][2].state is not _State.QUEUED:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _fail_queued(self) -> None:
        for pending in list(self._queue.values()):
            self._remove(pending)
            self._reject("shutting_down")
            self._answer_error(
                pending,
                ShuttingDown(
                    "the service shut down before the request ran",
                    retry_after_s=_DEFAULT_RETRY_AFTER_S,
                ),
            )

    def _take_batch(self, max_work: float | None = None) -> list[_Pending[T, R]]:
        """The oldest short item's group, oldest first (its long items stay queued), up to
        max_batch_size, max_batch_cost and max_work of estimated work (default one slice;
        the first item always goes); expired ones fail."""
        first = next((p for p in self._queue.values() if not p.tiles), None)
        if first is None:
            return []
        now = self._clock()
        # The worker's error path answers self._in_flight: should anything below raise, the
        # items already taken out of the queue are there, not lost with a local list.
        batch: list[_Pending[T, R]] = []
        self._in_flight = batch
        cost = work = 0.0
        if max_work is None:
            max_work = math.inf if self._slice_s is None else self._slice_s
        for pending in list(self._groups[first.key].values()):
            if len(batch) >= self._max_batch_size:
                break
            if pending.tiles:
                continue
            if batch and (
                cost + pending.cost > self._max_batch_cost or work + pending.work > max_work
            ):
                break
            self._remove(pending)
            if pending.deadline <= now:
                self._reject("deadline")
                self._answer_error(pending, _queued_too_long())
                continue
            pending.state = _State.TAKEN
            pending.queue_s = now - pending.enqueued
            batch.append(pending)
            cost += pending.cost
            work += pending.work
        return batch

    async def _wait_for_batch_to_grow(self) -> None:
        """With max_batch_delay_s > 0: wait (bounded) for the oldest item's group to fill up."""
        assert self._arrival is not None
        while self._queue and not self._draining:
            oldest = next(iter(self._queue.values()))
            group = self._groups[oldest.key]
            if len(group) >= self._max_batch_size:
                return
            if sum(p.cost for p in group.values()) >= self._max_batch_cost:
                return
            remaining = oldest.enqueued + self._max_batch_delay_s - self._clock()
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
            if not self._longs and not self._queue:
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
                if self._longs or self._next_long() is not None:
                    await self._advance_longs()
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
                    self._answer_error(pending, exc)
                self._in_flight = []
                self._end_longs(functools.partial(_twin, exc))

    # -- long items ------------------------------------------------------------------------

    def _tiles_for(self, work: float) -> int:
        """0 for a short item; else about how many slices it takes: its estimated work in
        device seconds at the measured pace (a model that under-counts this device's time
        would otherwise give tiles longer than a slice)."""
        if self._slice_s is None:
            return 0
        seconds = work * self._busy_s / self._done_work
        if seconds <= self._slice_s:
            return 0
        return math.ceil(seconds / self._slice_s)

    def _next_long(self) -> _Pending[T, R] | None:
        """The queued long item that starts next, the earliest deadline first (the oldest on
        ties): any while fewer than MAX_RUNNING_LONG run, else one of at most FEW_SLICES
        slices while fewer than twice as many run (None when none may)."""
        if not self._queued_longs or len(self._longs) >= 2 * MAX_RUNNING_LONG:
            return None
        if len(self._longs) < MAX_RUNNING_LONG:
            return self._first_queued(self._long_heap)
        return self._first_queued(self._few_heap)

    def _seconds_per_work(self) -> float:
        """Device seconds per estimated second, at the measured pace."""
        return self._busy_s / self._done_work

    def _running_shares(self, now: float) -> dict[int, _Share]:
        """The running long items still waited for, by seq, as a projection starts from
        them (beyond the tile on the device, which the projection's start counts: a tile is
        never interrupted)."""
        per_work = self._seconds_per_work()
        shares = {}
        for long in self._longs.values():
            pending = long.pending
            if pending.state is not _State.TAKEN or pending.future.cancelled():
                continue  # dropped at its next turn
            left = long.left_work * per_work
            shares[pending.seq] = _Share(pending.seq, left, pending.deadline - now)
        return shares

    def _in_flight_s(self, now: float) -> float:
        """Device seconds likely left of the batch or tile on the device."""
        if not self._running_work:
            return 0.0
        return max(0.0, self._running_work * self._seconds_per_work() - (now - self._running_since))

    def _refusal(self, pending: _Pending[T, R], now: float) -> _Refusal | None:
        """Whether a long item may be queued (None) or is refused (module docstring:
        Deadlines of long items): projected with the long items admitted before it, it would
        miss a deadline it could meet alone on an idle device, or make one of them miss a
        deadline it would meet without it, or the projection gave up before it could tell.
        The refusal's Retry-After is the first whole second at which the same request would
        be admitted as the projection goes on without it, or a second at which it would be
        (an upper bound of the first), or when the admitted long work is done; at most
        _MAX_RETRY_AFTER_S."""
        per_work = self._seconds_per_work()
        left, timeout = pending.work * per_work, pending.deadline - now
        if left > timeout:
            # It cannot finish in time even alone, yet the estimate may be wrong: it runs, and
            # is abandoned at its deadline, getting tiles only while no item that can finish
            # runs, so it costs nobody their deadline.
            return None
        running = list(self._running_shares(now).values())
        # Before the next tile: the rest of the batch or tile on the device (a tile is never
        # interrupted), then the short work queued.
        short_work = max(0.0, self._queued_work - self._queued_long_work)
        start = self._in_flight_s(now) + short_work * per_work
        admitted_s = start + sum(share.left for share in running)
        admitted_s += self._queued_long_work * per_work
        first_queued = self._first_queued(self._long_heap)
        first_deadline = min(
            timeout,
            min((share.deadline for share in running), default=math.inf),
            math.inf if first_queued is None else first_queued.deadline - now,
        )
        # All done by the earliest deadline whatever the order: nobody's deadline is at stake
        # (the common case, spared the projections).
        if admitted_s + left <= first_deadline:
            return None
        # Last in line: its deadline is the latest (the newest last on ties), so it joins
        # after every queued item and has the device only when no other running item is
        # there; it harms nobody, and it finishes once all the admitted work is done. (Not one
        # of few slices while others wait: joining past the cap, it would hold a place they
        # wait for.) The common case again: requests with the default deadline, in order.
        latest = max(
            max((share.deadline for share in running), default=-math.inf),
            self._latest_long_deadline - now,
        )
        few = pending.tiles <= FEW_SLICES
        if admitted_s + left <= timeout and timeout >= latest and not (few and self._queued_longs):
            return None

        baseline: _Turns | None = None

        def project(at: float | None, most: float, *, by_deadline: bool = True) -> _Turns:
            """The projection with this item arriving `at` seconds from now (None: without)."""
            waiting = self._waiting(now, per_work)
            arrival: _Entry = (pending.deadline + (at or 0.0), pending.seq, pending)
            if at is not None and at <= start:
                waiting.add(arrival)  # queued beside the others, it joins in its turn
            turns = _Turns(start, running, waiting, by_deadline=by_deadline, most=most)
            if at is not None and at > start:
                turns.run(until=at)
                turns.now = max(turns.now, at)  # (an idle device waits for it)
                turns.add(arrival)
            turns.run()
            return turns

        spent: float = 0  # items taken into the projections, for the search's bound

        def fits(at: float, most: float) -> bool | None:
            """Whether arriving `at` seconds from now it would be admitted (None: the
            projection gave up after `most` items)."""
            nonlocal baseline, spent
            turns = project(at, most)
            spent += turns.examined
            if turns.exhausted:
                return None
            if not turns.finishes(pending.seq):
                return False
            if turns.missed <= turns.hopeless:
                return True  # (those could not finish even alone: missed without it too)
            if baseline is None:
                # What the worker does without it (_whose_turn): the least work left first
                # while that meets every deadline that can be met alone, else the earliest
                # deadline first. (Against the latter alone, an item only the former saves
                # was lost already, and a new one could take the places that saved it.)
                baseline = project(None, _PROJECTED_LONGS, by_deadline=False)
                if baseline.exhausted or baseline.missed - baseline.hopeless:
                    baseline = project(None, _PROJECTED_LONGS)
            # Those it would miss miss without it too: it harms nobody. (Where the projection
            # without it gave up before one of them, that one counts as harmed.)
            return turns.missed <= baseline.missed

        verdict = fits(0.0, _PROJECTED_LONGS)
        if verdict:
            return None
        if verdict is None:
            detail = (
                f"more than {_PROJECTED_LONGS} long requests with deadlines at stake are ahead "
                "of this one: whether it would finish by its deadline was not worked out"
            )
        elif baseline is None:
            detail = (
                "the long requests admitted before this one would not let it finish by its "
                "deadline (it could alone)"
            )
        else:
            detail = "it would make a long request admitted before it miss its deadline"
        # Retry-After. As things stand, the fast paths above admit it once the admitted work
        # is done (it fits alone), or, of more than few slices, once its deadline is the
        # latest with time for the admitted work left (last in line): from `ready` seconds.
        # Below that, the first second at which a projection admits it (arriving later, it
        # finds less work ahead and has a later deadline): probes at 1, 2, 4... s until one
        # fits, then bisection below it. A probe past what is left of _SEARCHED_LONGS counts
        # as not fitting (the early ones cost least: less is projected before the arrival).
        # The second found is always one at which it is admitted, so where whether it fits is
        # not monotonic in the arrival (the order in which items join), or the bound cut the
        # search short, an upper bound of the first.
        ready = admitted_s
        if not few:
            ready = min(ready, max(latest - timeout, admitted_s + left - timeout))
        spent = 0

        def probe(at: int) -> bool:
            return spent < _SEARCHED_LONGS and bool(fits(at, _SEARCHED_LONGS - spent))

        # (Where the decision's projection gave up, so would the probes: no search.)
        cap = int(_MAX_RETRY_AFTER_S)
        high = max(1, math.ceil(ready))
        # (and at the cap, where no fast path admits it by then)
        probes = [2**k for k in range(6) if 2**k < min(high, cap)] + [cap] * (high > cap)
        low = high = min(high, cap)
        if verdict is not None:
            low = 1
            for at in probes:
                if probe(at):
                    high = at
                    break
                low = at + 1
            else:  # nothing fitted: at `high`, by a fast path, or the most we say
                low = high
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if probe(middle) else (middle + 1, high)
        return _Refusal(
            f"{detail}; retry later, or with a longer timeout", retry_after_s=float(high)
        )

    def _whose_turn(self) -> _Long[T, R] | None:
        """The running long item that gets the next tile (module docstring: Deadlines of long
        items): of those that can still finish by their deadline alone (of all, when none
        can), the one with the least work left, unless that order would make an admitted item
        that could finish alone, running or queued, miss its deadline (or its projection gave
        up): then the earliest deadline. The oldest first on ties."""
        longs = list(self._longs.values())
        if len(longs) < 2:
            return next(iter(longs), None)
        now = self._clock()
        shares = self._running_shares(now)
        can_finish = [share for share in shares.values() if share.left <= share.deadline]
        if not shares:
            return longs[0]  # nobody waits for them: dropped at this turn
        chosen = min(can_finish or shares.values(), key=lambda share: (share.left, share.seq))
        if can_finish and (len(can_finish) > 1 or self._queued_longs):
            # The queued items count too: that order frees places at other times than the
            # admission's projection has them (a small item with a late deadline first, and
            # a queued item's place came too late for it).
            turns = _Turns(
                0.0, shares.values(), self._waiting(now, self._seconds_per_work()),
                by_deadline=False, most=_PROJECTED_LONGS,
            )  # fmt: skip
            turns.run()
            if turns.exhausted or turns.missed - turns.hopeless:
                chosen = min(can_finish, key=lambda share: (share.deadline, share.seq))
        return self._longs[chosen.seq]

    def _waiting(self, now: float, per_work: float) -> _Waiting:
        """The queued long items, for a projection from `now`."""
        return _Waiting(
            self._long_heap, self._few_heap, origin=now, per_work=per_work,
            work=self._queued_long_work, count=self._queued_longs,
        )  # fmt: skip

    def _begin_long(self, pending: _Pending[T, R]) -> None:
        """Take a queued long item off the queue; it runs beside those running."""
        self._remove(pending)
        now = self._clock()
        if pending.deadline <= now:
            self._reject("deadline")
            self._answer_error(pending, _queued_too_long())
            return
        pending.state = _State.TAKEN
        pending.queue_s = now - pending.enqueued
        # The pace may have moved while it waited: its tiles are counted at this one.
        pending.tiles = max(1, self._tiles_for(pending.work))
        if self._metrics is not None:
            self._metrics.batch_size.observe(1)
            self._metrics.queue_wait_seconds.observe(pending.queue_s)
        self._longs[pending.seq] = _Long(pending)

    def _end_long(self, long: _Long[T, R]) -> None:
        """Forget a long item and its run (what it held on the device goes with it)."""
        self._longs.pop(long.pending.seq, None)
        self._set_depth()

    def _end_longs(self, error: Callable[[], BaseException]) -> None:
        """Answer every long item still running with error() and forget them all."""
        for long in list(self._longs.values()):
            if long.pending.state is _State.TAKEN:
                self._answer_error(long.pending, error())
            self._end_long(long)

    def _left_alone(self, long: _Long[T, R]) -> bool:
        """Whether a running long item lost its reason to run: its deadline passed (the timer
        answered it, or answers it now: a timer runs late on a busy loop, and on the loop's
        clock, which need not be the batcher's) or its client left. Then its run is dropped
        and counted."""
        pending = long.pending
        if pending.future.cancelled():
            reason = "disconnected"
        elif pending.state is not _State.TAKEN:
            reason = "deadline"
        elif pending.deadline <= self._clock():
            self._expire(pending)
            reason = "deadline"
        else:
            return False
        if self._metrics is not None:
            self._metrics.abandoned_total.labels(reason=reason).inc()
        pending.state = _State.DONE
        self._end_long(long)
        return True

    async def _advance_longs(self) -> None:
        """One turn: drop the long items nobody waits for, start the queued ones that may
        join (the earliest deadline first), run the short batches waiting (up to one slice of
        their work), then one tile of the long item whose turn it is. A drain that times out
        (cancellation) answers every long item running with ShuttingDown."""
        try:
            await self._take_turn()
        except asyncio.CancelledError:
            self._in_flight = []
            for long in self._longs.values():
                if long.pending.state is _State.TAKEN:
                    self._reject("shutting_down")
            self._end_longs(
                lambda: ShuttingDown(
                    "the service shut down while the request ran",
                    retry_after_s=_DEFAULT_RETRY_AFTER_S,
                )
            )
            raise

    async def _take_turn(self) -> None:
        assert self._executor is not None
        # Those nobody waits for leave first: their places are free for the next to join.
        for running in list(self._longs.values()):
            self._left_alone(running)
        # Every queued long item that may start joins now, as in the projections (one a turn
        # let an item that cannot finish, alone for a turn, take a tile from one that can).
        while (queued := self._next_long()) is not None:
            self._begin_long(queued)
        budget = self._slice_s or 0.0
        # (a tolerance: summed floats may leave a crumb of the slice, not worth a batch)
        while budget > 1e-6 * (self._slice_s or 0.0) and (batch := self._take_batch(budget)):
            budget -= sum(p.work for p in batch)
            await self._execute(batch)
        long = self._whose_turn()
        if long is None or self._left_alone(long):
            return

        # What this tile will likely do, for the backlog while it runs: the mean share of a
        # step so far, or a planned tile's before the first step.
        run, work = long.run, long.pending.work
        if run is None or run.tiles_done == 0:
            tile_work = work / max(1, long.pending.tiles)
        else:
            tile_work = work * long.share_done() / run.tiles_done
        tile_work = min(tile_work, long.left_work)
        long.left_work -= tile_work
        self._running_work, self._running_since = tile_work, self._clock()
        self._in_flight = [long.pending]
        self._device_busy = True
        try:
            finished, seconds = await asyncio.wrap_future(
                self._executor.submit(self._long_step, long)
            )
        except Exception as exc:  # start_long or step() raised: a bug of ours, this item's 500
            logger.exception("a long item's tile failed")
            self._in_flight = []
            self._answer_error(long.pending, exc)
            self._end_long(long)
            return
        finally:
            self._running_work = 0.0
        self._in_flight = []
        # What the tile did, by the run's own measure of its progress; once finished, all
        # the estimate left over is done too (the pace learns from it either way).
        assert long.run is not None
        left_before = long.left_work + tile_work
        left_now = work * (1.0 - long.share_done())
        long.left_work = 0.0 if finished else min(left_before, left_now)  # never grows
        self._note_throughput(left_before - long.left_work, seconds)
        if not finished:
            return  # its next turn looks at its deadline and client first
        outcome = long.run.outcome()
        self._end_long(long)
        pending = long.pending
        if pending.state is not _State.TAKEN or pending.future.done():
            return  # it finished just after its deadline's 504, or its client left
        if isinstance(outcome, BaseException):
            self._answer_error(pending, outcome)
            return
        pending.state = _State.DONE
        pending.future.set_result(
            BatchResult(value=outcome, batch_size=1, queue_ms=pending.queue_s * 1e3)
        )

    def _long_step(self, long: _Long[T, R]) -> tuple[bool, float]:
        """One tile of a long item, on the device thread (its run starts at the first).
        -> (done, its seconds), timed here: on the loop the time would also hold however long
        the loop took to come back to it (a busy loop made the pace look several times slow)."""
        started = self._clock()
        try:
            if long.run is None:
                assert self._start_long is not None
                long.run = self._start_long(long.pending.item, long.pending.tiles)
            assert self._slice_s is not None  # long items exist only with a slice
            return long.run.step(self._slice_s), self._clock() - started
        finally:
            self._device_busy = False

    async def _run_idle(self, fn: Callable[[], None]) -> None:
        """One piece of idle work on the device thread; its failure is logged, never raised."""
        assert self._executor is not None
        try:
            await asyncio.wrap_future(self._executor.submit(fn))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("idle work failed on the device thread")

    async def _execute(self, batch: list[_Pending[T, R]]) -> None:
        assert self._executor is not None
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
        device_done: asyncio.Future[None] = loop.create_future()
        started = self._clock()

        def on_device() -> None:
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
            finally:
                self._device_busy = False
            seconds = self._clock() - started
            # RuntimeError: the loop is closed, nobody is left to answer.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._answer_batch, batch, results, seconds, device_done)

        self._running_work = sum(pending.work for pending in batch)
        self._running_since = self._clock()
        self._device_busy = True
        self._executor.submit(on_device)
        try:
            await device_done
        except asyncio.CancelledError:
            # drain() timed out while this batch was on the device: its items get ShuttingDown
            # now; _answer_batch, should it still come, finds them answered.
            for pending in batch:
                if pending.state is _State.TAKEN:
                    self._reject("shutting_down")
                    self._answer_error(
                        pending,
                        ShuttingDown(
                            "the service shut down while the request ran",
                            retry_after_s=_DEFAULT_RETRY_AFTER_S,
                        ),
                    )
            self._in_flight = []
            raise
        self._in_flight = []

    def _answer_batch(
        self,
        batch: list[_Pending[T, R]],
        results: Sequence[R | BaseException],
        seconds: float,
        device_done: asyncio.Future[None],
    ) -> None:
        """On the loop, once the device finished a batch: answer its items, free the worker."""
        try:
            work, self._running_work = self._running_work, 0.0
            self._note_throughput(work, seconds)
            for pending, result in zip(batch, results, strict=True):
                if pending.state is not _State.TAKEN:
                    continue  # answered already (ShuttingDown after a drain timeout)
                if isinstance(result, BaseException):
                    self._answer_error(pending, result)
                else:
                    pending.state = _State.DONE
                    if not pending.future.done():
                        pending.future.set_result(
                            BatchResult(
                                value=result, batch_size=len(batch), queue_ms=pending.queue_s * 1e3
                            )
                        )
        except Exception as exc:  # a bug of ours; the worker must go on all the same
            # _execute raises it, and the worker's error path answers what is left unanswered.
            if not device_done.done():
                device_done.set_exception(exc)
            return
        if not device_done.done():
            device_done.set_result(None)

    def _answer_error(self, pending: _Pending[T, R], exc: BaseException) -> None:
        if pending.state is not _State.DROPPED:
            pending.state = _State.DONE
        if not pending.future.done():
            pending.future.set_exception(exc)

    # -- throughput, Retry-After, metrics --------------------------------------------------

    def _work_of(self, item: T) -> float:
        return 1.0 if self._work_seconds is None else max(0.0, self._work_seconds(item))

    def _note_throughput(self, work: float, seconds: float) -> None:
        keep = 0.5 ** (seconds / THROUGHPUT_HALF_LIFE_S)
        self._done_work = self._done_work * keep + work
        self._busy_s = self._busy_s * keep + seconds
        self._measured = True
        self._set_depth()

    def backlog_seconds(self, extra_work: float = 0.0) -> float:
        """Estimated seconds until the queue, the batch on the device and `extra_work` are done:
        estimated work over the measured throughput (module docstring)."""
        rate = self._done_work / self._busy_s
        running_left = 0.0
        if self._running_work:
            running_left = max(
                0.0, self._running_work / rate - (self._clock() - self._running_since)
            )
        running_longs = sum(long.left_work for long in self._longs.values())
        queued = self._queued_work + running_longs + extra_work
        return queued / rate + running_left

    def _retry_after_s(self, item: T) -> float:
        """Seconds until the backlog and this item are likely worked off, within [1, 60]."""
        if not self._measured and self._work_seconds is None:
            return _DEFAULT_RETRY_AFTER_S  # nothing measured, nothing estimated
        backlog = self.backlog_seconds(self._work_of(item))
        return min(_MAX_RETRY_AFTER_S, max(_DEFAULT_RETRY_AFTER_S, backlog))

    def _reject(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.rejected_total.labels(reason=reason).inc()

    def _set_depth(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth.set(len(self._queue))
            self._metrics.backlog_seconds.set(self.backlog_seconds())
