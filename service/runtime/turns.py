"""The turns of long requests: which running long item gets the next tile, which queued one
joins next, and whether a new one is admitted by its deadline.

Long requests run in slices
---------------------------
With ``slice_s`` and ``start_long``, an item whose estimated work exceeds one slice (at the
measured pace, below) is *long*: it runs alone, as a resumable run of about that many tiles
(``start_long(item, tiles)``, called on the device thread; each ``step()`` computes one tile;
``finish_long`` makes the item's answer of the finished run),
the pace's correction of the cost model bounded to 4x either way for the plan
(service.runtime.pace.plan_tiles: unbounded, small tiles' fixed costs fed back into the pace).
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
  their estimated work and of their measured device time, so a short request waits about one
  tile behind long ones and a stream of short ones still leaves the long ones at least half
  the device (the measured bound: small batches' fixed costs, which the model under-counts,
  made a slice of their estimated work seconds of device time).

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

Admission keeps its word: the projections count the short work that keeps
arriving, not only the short work queued now. Long work is projected on the device the short
stream leaves (service.runtime.pace.ShortStream: its measured share, with a margin, at most
what the worker lets it take between two tiles); an item behind that projection that can still
finish alone on the device is served by earliest deadline, in the worker and in the
projections alike (``Share.alone``), and a new item due before it is refused (it would take its
time first). On random workloads of short streams, analyses and long requests of several
tenants (tests/service/runtime/test_admission.py), every item admitted finished by its
deadline: a sweep of 200 workloads, 5,582 admitted and 1,893 refused, broke none, where
projections of the queue alone broke a promise in most of them.

Tenants: the long places and the projections are divided by tenant weight, as the short queue
is. A tenant's long items hold at most its share of MAX_RUNNING_LONG places (``places``: its
weight over every known tenant's, at least one; twice as many of few slices), and a long item
is admitted by a projection of its own tenant's long items alone, at the tenant's share of the
device the short stream leaves (``per_work``), as if every known tenant were busy: another
tenant's long items never hold its places nor its share, and a tight deadline buys no more than
the tenant's share (refused for its own tenant's long work, a 429; else 503). The next tile goes
to the tenant whose virtual time is least (service.runtime.queue: the same shares as the short
batches; tiles charge it), and among that tenant's items by the rules above; the short batches
of another tenant run before the tile while their tenant's virtual time is not past the tile's
tenant's, up to the measured time the tile tenant's share leaves them
(service.runtime.long_runs). (Before, the shares gave way wherever they would cost a running
item its deadline: a tenant keeping tight deadlines held another's short requests to 1.0 s and
its long ones to 3 completions in 57 s.)
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from service.runtime.pace import MAX_RETRY_AFTER_S, Pace, ShortStream
from service.runtime.queue import FEW_SLICES, Entry, Item, Tenant, WorkQueue

T = TypeVar("T")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

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


class Resumable(Protocol[R_co]):
    """A long item's run, as the runtime steps it (sdpa_core's TiledRun, AttentionRun or
    AnalysisRun, is one as it is: no wrapper between). step(budget_s) computes one tile (about
    budget_s seconds where the run can tell) on the device thread and says whether the run is
    done; result() is its result once done. An error either raises ends the run: it is the
    item's own answer (service.runtime.long_runs)."""

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

    def result(self) -> R_co: ...


class Long(Generic[T, R]):
    """A long item taken off the queue: its run (started at its first tile), its estimated
    work not yet done beyond the tile on the device, the device seconds its tiles took, and
    its answer once its run ended (its result, or the error that ended it)."""

    __slots__ = ("compute_s", "left_work", "outcome", "pending", "planned_tiles", "run")

    def __init__(self, pending: Item[T, R], planned_tiles: int | None = None) -> None:
        self.pending = pending
        self.run: Resumable[Any] | None = None
        self.outcome: R | BaseException | None = None
        self.compute_s = 0.0
        self.left_work = pending.work
        # The tiles its run is planned in (Pace.plan_tiles); its slices, pending.tiles, count
        # for joining and admission.
        self.planned_tiles = pending.tiles if planned_tiles is None else planned_tiles

    def share_done(self) -> float:
        """The run's share_done, trusted within [0, 1] only (NaN reads as nothing done)."""
        share = 0.0 if self.run is None else self.run.share_done
        return 0.0 if math.isnan(share) else min(1.0, max(0.0, share))

    def progress(self) -> str:
        done = 0 if self.run is None else self.run.tiles_done
        total = self.planned_tiles if self.run is None else self.run.tiles_total
        return f"{done} of {total} tiles done"


class Share(NamedTuple):
    """A long item in a projection of the tiles: device seconds of work left, its deadline in
    seconds from the projection's start, and whether it is of few slices (joins past the cap).
    (A tuple: a projection makes one per item it takes in, and a dataclass's are slower.)
    """

    seq: int
    left: float
    deadline: float
    few: bool = False
    # Its work left alone on the device, at the measured pace (`left` is at its tenant's
    # share of what the short stream leaves): whether it can still finish at all. (-1: as
    # `left`.)
    alone: float = -1.0


class Waiting:
    """The queued long items as one projection sees them: copies of the batcher's heaps of
    entries (all of them, and those of few slices), whose items are taken in the order the
    worker takes them (LongTurns.next_long); entries of items no longer queued are skipped, as
    the worker skips them. Work in device seconds at per_work, deadlines in seconds from origin.
    """

    __slots__ = (
        "_count", "_every", "_few", "_joined", "alone_per_work", "left_s", "origin", "per_work"
    )  # fmt: skip

    def __init__(
        self,
        every: Sequence[Entry],
        few: Sequence[Entry],
        *,
        origin: float,
        per_work: float,
        work: float,
        count: int,
        alone_per_work: float | None = None,
    ) -> None:
        self._every, self._few = list(every), list(few)  # heaps still: copies of heaps
        self._joined: set[int] = set()
        self.origin, self.per_work = origin, per_work
        self.alone_per_work = per_work if alone_per_work is None else alone_per_work
        self._count = count  # items not taken yet, and their work in device seconds
        self.left_s = work * per_work

    def add(self, entry: Entry) -> None:
        heapq.heappush(self._every, entry)
        if entry[2].tiles <= FEW_SLICES:
            heapq.heappush(self._few, entry)
        self._count += 1
        self.left_s += entry[2].work * self.per_work

    def _first(self, heap: list[Entry]) -> Entry | None:
        joined, queued = self._joined, WorkQueue.is_queued
        while heap and (heap[0][1] in joined or not queued(heap[0][2])):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def first_deadline(self) -> float:
        entry = self._first(self._every)
        return math.inf if entry is None else entry[0] - self.origin

    def take(self, *, few_only: bool) -> Share | None:
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
        few = pending.tiles <= FEW_SLICES
        return Share(seq, left, deadline - self.origin, few, pending.work * self.alone_per_work)


class Turns:
    """A projection of the long items' tiles (module docstring), for their admission and for
    the choice of a tile. One running item has the device at a time: the earliest deadline
    (``by_deadline``) or the least work left, the oldest first on ties; the queued items join
    as the worker takes them (LongTurns.next_long: the earliest deadline, the oldest on ties,
    while fewer than MAX_RUNNING_LONG run, else the earliest of few slices while fewer than twice as
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
        running: Iterable[Share],
        waiting: Waiting | None,
        *,
        by_deadline: bool,
        most: float = math.inf,
        places: int = MAX_RUNNING_LONG,
    ) -> None:
        self.now = start
        self._places = places  # the long places (MAX_RUNNING_LONG, or a tenant's of them)
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
        # The deadline of every item taken in.
        self.deadlines: dict[int, float] = {}
        for share in running:
            self.examined += 1
            self._start(share)
        self._join()

    def finishes(self, seq: int) -> bool:
        """Whether the item finishes by its deadline (False where the projection gave up)."""
        return seq in self.finished or (self.rest_finish and seq not in self.missed)

    def add(self, entry: Entry) -> None:
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

    def _start(self, share: Share) -> None:
        self.deadlines[share.seq] = share.deadline
        if share.left <= 0.0:  # its last tile is the one on the device: done as it ends
            if share.deadline >= self.now:
                self.finished[share.seq] = self.now
            else:
                self.missed.add(share.seq)
            return
        # One that cannot finish even alone on the device (at the measured pace) holds its
        # place and never runs, as the worker has it (LongTurns.whose_turn); one that could
        # runs, at its share, and may miss.
        alone = share.left if share.alone < 0 else share.alone
        if alone > share.deadline - self.now:
            heapq.heappush(self._holding, share.deadline)
            self.missed.add(share.seq)
            if alone > share.deadline:
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
        while (places := len(self._left) + len(self._holding)) < 2 * self._places:
            share = waiting.take(few_only=places >= self._places)
            if share is None:
                return
            if self.examined >= self._most:
                self.exhausted = True  # (the projection ends here: `share` is not needed)
                return
            # One that cannot finish by its deadline from here only holds a place until then
            # (or none, past it): a push and a pop, a fraction of what an item at stake costs.
            # Counted as a whole item, a flood of such cheap hopeless requests made every
            # projection give up, and every long request behind them was refused.
            at_stake = (share.left if share.alone < 0 else share.alone) <= share.deadline - self.now
            self.examined += 1 if at_stake else _HOLDER_SHARE
            if share.deadline > self.now:
                self._start(share)
            else:  # its deadline passed while it was queued (a 504, never computed)
                self.missed.add(share.seq)
                self.deadlines[share.seq] = share.deadline


@dataclass(frozen=True, slots=True)
class Refusal:
    detail: str
    retry_after_s: float
    # Refused for its tenant's own long work at the tenant's share (a 429), not the service's.
    by_share: bool = False


class LongTurns(Generic[T, R]):
    """The long items running (in the order they started) and the rules of their turns
    (module docstring), over the queue's long items and the measured pace."""

    def __init__(
        self, queue: WorkQueue[T, R], pace: Pace, clock: Callable[[], float],
        stream: ShortStream | None = None,
    ) -> None:  # fmt: skip
        self._queue = queue
        self._pace = pace
        self._clock = clock
        self.stream = ShortStream(clock) if stream is None else stream
        self.longs: OrderedDict[int, Long[T, R]] = OrderedDict()

    # -- the tenants' shares ---------------------------------------------------------------

    def long_share(self, tenant: Tenant) -> float:
        """The share of the long work's device a tenant's long items are projected at: its
        weight over every known tenant's (the configured ones, and any other seen), as if all
        of them were busy: what the tenants' shares leave it whoever comes later (module
        docstring: Tenants)."""
        return tenant.weight / max(tenant.weight, self._queue.total_weight())

    def places(self, tenant: Tenant) -> int:
        """The long places of a tenant: MAX_RUNNING_LONG by its long share, at least one
        (twice as many for items of few slices)."""
        return max(1, round(MAX_RUNNING_LONG * self.long_share(tenant)))

    def per_work(self, tenant: Tenant) -> float:
        """Seconds of the clock per estimated second of a tenant's long work: at the measured
        pace with room for its spread (Pace.spread), on the device the short stream leaves
        (service.runtime.pace: ShortStream), at the tenant's long share."""
        fraction = self.stream.long_fraction() * self.long_share(tenant)
        return self._pace.seconds_per_work() * (1.0 + self._pace.spread()) / fraction

    def _running_of(self, name: str) -> int:
        return self._queue.tenant(name).running

    def next_long(self) -> Item[T, R] | None:
        """The queued long item that starts next, the earliest deadline first (the oldest on
        ties) among the tenants with a place free: any of a tenant's while fewer than its
        places (``places``) of its run, else one of at most FEW_SLICES slices while fewer than
        twice as many do (None when none may)."""
        if not self._queue.longs:
            return None
        chosen: Item[T, R] | None = None
        for tenant in self._queue.tenants():
            if not tenant.longs:
                continue
            places = self.places(tenant)
            if tenant.running >= 2 * places:
                continue
            heap = tenant.long_heap if tenant.running < places else tenant.few_heap
            first = self._queue.first_queued(heap)
            if first is not None and (
                chosen is None or (first.deadline, first.seq) < (chosen.deadline, chosen.seq)
            ):
                chosen = first
        return chosen

    def running_shares(self, now: float, tenant: Tenant | None = None) -> dict[int, Share]:
        """The running long items still waited for (of `tenant`, or of every tenant), by seq,
        as a projection starts from them (beyond the tile on the device, which the
        projection's start counts: a tile is never interrupted), their work at their tenant's
        per_work."""
        per_work: dict[str, float] = {}
        shares = {}
        for long in self.longs.values():
            pending = long.pending
            if tenant is not None and pending.tenant != tenant.name:
                continue
            if not self._queue.awaited(pending):
                continue  # dropped at its next turn
            rate = per_work.get(pending.tenant)
            if rate is None:
                rate = per_work[pending.tenant] = self.per_work(self._queue.tenant(pending.tenant))
            left = long.left_work * rate
            alone = long.left_work * self._pace.seconds_per_work()
            shares[pending.seq] = Share(pending.seq, left, pending.deadline - now, False, alone)
        return shares

    def refusal(self, pending: Item[T, R], now: float) -> Refusal | None:
        """Whether a long item may be queued (None) or is refused (module docstring:
        Deadlines of long items): projected with the long items admitted before it, it would
        miss a deadline it could meet alone on an idle device, or make one of them miss a
        deadline it would meet without it, or the projection gave up before it could tell.
        The refusal's Retry-After is the first whole second at which the same request would
        be admitted as the projection goes on without it, or a second at which it would be
        (an upper bound of the first), or when the admitted long work is done; at most
        MAX_RETRY_AFTER_S.

        All of it among the long items of the item's own tenant, at its tenant's long share
        and places, on the device the short stream leaves (per_work): another tenant's long
        items never hold its places nor its share."""
        tenant = self._queue.tenant(pending.tenant)
        if pending.work * self._pace.seconds_per_work() > pending.deadline - now:
            # It cannot finish in time even alone on an idle device, yet the estimate may be
            # wrong: it runs, and is abandoned at its deadline, getting tiles only while no
            # item that can finish runs, so it costs nobody their deadline.
            return None
        per_work = self.per_work(tenant)
        places = self.places(tenant)
        left, timeout = pending.work * per_work, pending.deadline - now
        running = list(self.running_shares(now, tenant).values())
        # Before the next tile: the rest of the batch or tile on the device (a tile is never
        # interrupted), then the short work queued.
        short_work = max(0.0, self._queue.work - self._queue.long_work)
        start = self._pace.in_flight_s(now) + short_work * self._pace.seconds_per_work()
        admitted_s = start + sum(share.left for share in running)
        admitted_s += tenant.long_work * per_work
        first_queued = self._queue.first_queued(tenant.long_heap)
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
            tenant.latest_long_deadline - now,
        )
        few = pending.tiles <= FEW_SLICES
        if admitted_s + left <= timeout and timeout >= latest and not (few and tenant.longs):
            return None

        baseline: Turns | None = None

        def project(at: float | None, most: float, *, by_deadline: bool = True) -> Turns:
            """The projection with this item arriving `at` seconds from now (None: without)."""
            waiting = self.waiting(now, per_work, tenant)
            arrival: Entry = (pending.deadline + (at or 0.0), pending.seq, pending)
            if at is not None and at <= start:
                waiting.add(arrival)  # queued beside the others, it joins in its turn
            turns = Turns(
                start, running, waiting, by_deadline=by_deadline, most=most, places=places
            )
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
                # What the worker does without it (LongTurns.whose_turn): the least work left
                # first while that meets every deadline that can be met alone, else the
                # earliest deadline first. (Against the latter alone, an item only the former saves
                # was lost already, and a new one could take the places that saved it.)
                baseline = project(None, _PROJECTED_LONGS, by_deadline=False)
                if baseline.exhausted or baseline.missed - baseline.hopeless:
                    baseline = project(None, _PROJECTED_LONGS)
            # Those it would miss miss without it too: it harms nobody. (Where the projection
            # without it gave up before one of them, that one counts as harmed.)
            if not turns.missed <= baseline.missed:
                return False
            # Those missed without it too that could still finish alone are behind their
            # projection (the short stream took more than its share for a while): the worker
            # serves them by earliest deadline, and an item due before one of them would take
            # its time first. (Without this, one admitted item a hair behind let every later
            # one of an earlier deadline in, and missed.)
            due = timeout + at
            behind = baseline.missed - baseline.hopeless
            return all(baseline.deadlines.get(seq, math.inf) < due for seq in behind)

        verdict = fits(0.0, _PROJECTED_LONGS)
        if verdict:
            return None
        if verdict is None:
            detail = (
                f"more than {_PROJECTED_LONGS} long requests with deadlines at stake are ahead "
                "of this one: whether it would finish by its deadline was not worked out"
            )
        elif baseline is None and not (running or tenant.longs):
            detail = (
                "it would not finish by its deadline on the share of the device that long "
                "requests of its tenant are counted at (it could alone on an idle device)"
            )
        elif baseline is None:
            detail = (
                "the long requests admitted before this one would not let it finish by its "
                "deadline (it could alone)"
            )
        else:
            detail = "it would make a long request admitted before it miss its deadline"
        short_share = self.stream.share()
        detail += (
            f" (projected at {self.long_share(tenant) * (1 - short_share):.2g} of the device: "
            f"its tenant's share of the long work {self.long_share(tenant):.2g}, less the "
            f"short requests' measured {short_share:.2g}; at the measured pace with "
            f"{self._pace.spread():.0%} more for its spread)"
        )
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
        cap = int(MAX_RETRY_AFTER_S)
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
        # Its tenant's own long work at its share refused it, where tenants share (a 429:
        # the tenant is past its share), else the service's (503).
        by_share = self.long_share(tenant) < 1.0 and bool(running or tenant.longs)
        if by_share:
            detail += (
                f" at tenant {tenant.name!r}'s share of the long work ({places} places, "
                f"{self.long_share(tenant):.2g} of the device)"
            )
        return Refusal(
            f"{detail}; retry later, or with a longer timeout", retry_after_s=float(high),
            by_share=by_share,
        )  # fmt: skip

    def whose_turn(self) -> Long[T, R] | None:
        """The running long item that gets the next tile (module docstring: Deadlines of long
        items, Tenants): of the tenant served next (the least virtual time among those with
        running items still waited for), of its items that can still finish by their deadline
        (of all, when none can), the one with the least work left, unless that order would
        make an admitted item of that tenant that could finish, running or queued, miss its
        deadline (or its projection gave up): then the earliest deadline. The oldest first on
        ties."""
        longs = list(self.longs.values())
        if len(longs) < 2:
            return next(iter(longs), None)
        now = self._clock()
        tenant = self.next_tile_tenant()
        if tenant is None:
            return longs[0]  # nobody waits for them: dropped at this turn
        self._queue.choose([tenant], lambda t: 0)  # (where returning tenants start)
        shares = self.running_shares(now, tenant)
        # Those that could still finish alone on the device (at the measured pace): the short
        # stream may have taken more than its projected share for a while, and such an item
        # is then the one to save (earliest deadline first, below), not one to give up on.
        can_finish = [share for share in shares.values() if share.alone <= share.deadline]
        chosen = min(can_finish or shares.values(), key=lambda share: (share.left, share.seq))
        behind = [share for share in can_finish if share.left > share.deadline]
        if behind:
            # One is behind its projection already: the earliest deadline first saves what
            # any order could.
            chosen = min(can_finish, key=lambda share: (share.deadline, share.seq))
        elif can_finish and (len(can_finish) > 1 or tenant.longs):
            # The queued items count too: that order frees places at other times than the
            # admission's projection has them (a small item with a late deadline first, and
            # a queued item's place came too late for it).
            turns = Turns(
                0.0, shares.values(), self.waiting(now, self.per_work(tenant), tenant),
                by_deadline=False, most=_PROJECTED_LONGS, places=self.places(tenant),
            )  # fmt: skip
            turns.run()
            if turns.exhausted or turns.missed - turns.hopeless:
                # (earliest deadline first meets every deadline that any order could)
                chosen = min(can_finish, key=lambda share: (share.deadline, share.seq))
        return self.longs[chosen.seq]

    def next_tile_tenant(self) -> Tenant | None:
        """The tenant whose running long item gets the next tile by the tenants' shares (the
        least virtual time, the one whose item started first on ties; None without running
        items still waited for)."""
        names: dict[str, int] = {}
        for seq, long in self.longs.items():
            pending = long.pending
            if self._queue.awaited(pending):
                names.setdefault(pending.tenant, seq)
        if not names:
            return None
        tenants = [self._queue.tenant(name) for name in names]
        return self._queue.least(tenants, lambda t: names[t.name])

    def waiting(self, now: float, per_work: float, tenant: Tenant) -> Waiting:
        """A tenant's queued long items, for a projection from `now`."""
        return Waiting(
            tenant.long_heap, tenant.few_heap, origin=now, per_work=per_work,
            work=tenant.long_work, count=tenant.longs,
            alone_per_work=self._pace.seconds_per_work(),
        )  # fmt: skip
