"""The runtime's queue: the waiting items, their groups, their tenants, and the one owner of the
answer state machine.

Answers
-------
An item's state moves QUEUED -> TAKEN -> DONE or QUEUED -> DROPPED (-> DONE), and only this
module moves it or reads it: the others ask (``awaited``, ``is_queued``) and act through its
calls, never on a state they read. Only the side that moves an item out of QUEUED may answer it,
and every answer goes through ``WorkQueue.answer``, which marks the item DONE first, answers
nothing already DONE and says whether its answer reached someone: so no item is ever answered
twice, whatever the order in which the worker, a deadline timer or a drain come to it, and what
is counted of an answer is counted by what ``answer`` returns. An item whose client left (its
future cancelled) is closed without an answer (``close_unheard``): nobody is listening.

Groups
------
Items that may share a batch share a group key (service.runtime.policy: everything that changes
the math, and a length bucket of N_q and of N_kv). A batch is the items of one group, taken from
the queue in the order below, up to the batch's bounds (count, cost, estimated work).

Tenants, fair shares and priority
---------------------------------
Every item belongs to a tenant (the name of the API key it came with; "anonymous" without
keys). Waiting work is served across tenants in proportion to their weights, measured in
estimated device seconds (the cost model), not in requests: start-time fair queueing. Each
tenant has a virtual time, the device seconds it was served divided by its weight; the next
batch is formed for the tenant with waiting short work whose virtual time is least (the one
with the oldest item on ties), and every item taken is charged to its own tenant. A tenant
that had no short work waiting starts again from the virtual time of the last tenant chosen,
never from its own past, and so does one whose long item starts: idleness banks no credit, so
a tenant that was quiet an hour cannot then hold the device for an hour. Its virtual time
follows the work it is served, not whether it has something waiting: a long request parked
with an hour to go (queued, or running without tiles) keeps no place in the past for a burst
of short ones to spend later. So one tenant's flood delays another tenant's request by the
batch on the device and the other tenants' fair shares, not by the flood.

Within one tenant, ``priority`` orders its own waiting items (Triton's convention: 1 the
highest level, larger values lower), the oldest first within a level; it never puts one
tenant before another. A batch takes the chosen tenant's items of its first item's group by
priority, then the same group's items of other tenants by priority and arrival (each charged to
its own tenant: riding along costs their shares what they use). With one tenant and one priority
level this is exactly first come, first served by group.

Each tenant may hold at most its share of the queue (``tenant_limit``); the batcher answers a
tenant past it 429, with its own backlog as Retry-After, while others still find room.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.tenants import ANONYMOUS

T = TypeVar("T")
R = TypeVar("R")

# A long item of at most this many slices joins the running ones at once even past
# MAX_RUNNING_LONG (service.runtime.turns): its own heap keeps finding the next one O(log n).
FEW_SLICES = 4


@dataclass(frozen=True, slots=True)
class BatchResult(Generic[R]):
    """One item's answer: the value and how it ran (for the response's meta)."""

    value: R
    batch_size: int
    queue_ms: float


class State(enum.Enum):
    QUEUED = enum.auto()
    TAKEN = enum.auto()  # in a batch that runs (or ran) on the device, or a long item running
    DONE = enum.auto()  # answered, or closed with nobody to answer
    DROPPED = enum.auto()  # left the queue without being computed, not answered yet


class Item(Generic[T, R]):
    """A submitted item and what the runtime knows of it."""

    __slots__ = (
        "cost", "deadline", "enqueued", "future", "item", "key", "priority", "queue_s", "seq",
        "state", "tenant", "tiles", "work",
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
        tenant: str = ANONYMOUS,
        priority: int = 1,
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
        self.tenant = tenant
        self.priority = priority  # 1 the highest level
        self.state = State.QUEUED
        self.queue_s = 0.0


# A queued long item as the worker and the projections order it: (deadline, seq, item), the
# earliest deadline first and the oldest on ties.
Entry = tuple[float, int, Item[Any, Any]]


class Tenant:
    """One tenant's place in the queue: its weight, its virtual time (device seconds served
    over its weight), and what it has waiting and running."""

    __slots__ = (
        "few_heap", "latest_long_deadline", "levels", "long_heap", "long_work", "longs", "name",
        "queued", "queued_work", "running", "vtime", "weight",
    )  # fmt: skip

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        self.vtime = 0.0
        self.queued = 0  # items queued, long ones too
        self.queued_work = 0.0
        self.running = 0  # long items running
        # The short items queued, per priority level, oldest first.
        self.levels: dict[int, OrderedDict[int, Item[Any, Any]]] = {}
        # Its queued long items (how many, their work) by deadline, the order they join in: all
        # of them and those of few slices, heaps of Entry whose items that left the queue are
        # skipped when they surface (and swept out once they outnumber the queued ones).
        self.longs = 0
        self.long_work = 0.0
        self.long_heap: list[Entry] = []
        self.few_heap: list[Entry] = []
        # No queued long item of its has a later deadline (the latest enqueued since it last
        # had none queued: an item that left may have had it).
        self.latest_long_deadline = -math.inf

    @property
    def backlogged(self) -> bool:
        return self.queued > 0 or self.running > 0

    def first_short(self) -> Item[Any, Any] | None:
        """Its next short item: the highest priority level's oldest."""
        if not self.levels:
            return None
        return next(iter(self.levels[min(self.levels)].values()))


class WorkQueue(Generic[T, R]):
    """The queued items: in arrival order, by group, by tenant and priority, and the long ones
    by deadline (module docstring). ``on_change(added)`` runs after every arrival (True) and
    departure (False)."""

    def __init__(
        self,
        *,
        weights: Mapping[str, float] | None = None,
        on_change: Callable[[bool], None] = lambda added: None,
    ) -> None:
        self._weights = dict(weights or {})
        self._on_change = on_change
        self._seq = itertools.count()
        # Every queued item in arrival order, and the same items per group (arrival order).
        # OrderedDicts: O(1) removal from the middle (cancel, deadline) and O(1) oldest.
        self._items: OrderedDict[int, Item[T, R]] = OrderedDict()
        self._groups: dict[Hashable, OrderedDict[int, Item[T, R]]] = {}
        self._tenants: dict[str, Tenant] = {}
        self._shorts = 0
        # The virtual time of the tenant chosen last: where a tenant that had nothing waiting
        # starts again.
        self._virtual_now = 0.0
        self.work = 0.0  # the sum of the queued items' work
        self.longs = 0  # how many queued items are long, and their work (each tenant's: Tenant)
        self.long_work = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item[T, R]]:
        return iter(list(self._items.values()))

    def next_seq(self) -> int:
        return next(self._seq)

    # -- tenants ---------------------------------------------------------------------------

    def tenant(self, name: str) -> Tenant:
        """The tenant of that name (made on first use, with its configured weight or 1)."""
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = Tenant(name, self._weights.get(name, 1.0))
        return tenant

    def total_weight(self) -> float:
        """The weights of every tenant known (configured, or seen), summed."""
        return sum(t.weight for t in self._tenants.values())

    def tenants(self) -> list[Tenant]:
        return list(self._tenants.values())

    def tenant_count(self) -> int:
        """How many tenants have work waiting or running."""
        return sum(1 for t in self._tenants.values() if t.backlogged)

    def activate(self, tenant: Tenant) -> None:
        """A tenant with no short work waiting gets work, or a long item of its starts: it
        starts from the virtual time of the last tenant chosen, if that is later than its own
        (module docstring: its virtual time follows the work it is served, and a request
        parked while others were served banks nothing)."""
        if not tenant.levels:
            tenant.vtime = max(tenant.vtime, self._virtual_now)

    def charge(self, tenant: Tenant, work: float) -> None:
        """Count `work` estimated device seconds served to `tenant`, whose virtual time at the
        start of that work becomes where returning tenants start (a tile of a long item moves
        it as a batch does: a tenant that ran long items alone banks no credit for others)."""
        self._virtual_now = max(self._virtual_now, tenant.vtime)
        tenant.vtime += work / tenant.weight

    @staticmethod
    def least(tenants: list[Tenant], oldest: Callable[[Tenant], int]) -> Tenant:
        """Of `tenants` (not empty), the one served next: the least virtual time, the oldest
        work on ties."""
        if len(tenants) == 1:
            return tenants[0]
        return min(tenants, key=lambda t: (t.vtime, oldest(t)))

    def choose(self, tenants: list[Tenant], oldest: Callable[[Tenant], int]) -> Tenant:
        """least(), and its virtual time becomes where returning tenants start."""
        chosen = self.least(tenants, oldest)
        self._virtual_now = max(self._virtual_now, chosen.vtime)
        return chosen

    def backlogged_weight(self) -> float:
        """The weights of the tenants with work waiting or running, summed."""
        return sum(t.weight for t in self._tenants.values() if t.backlogged)

    def share_of(self, tenant: Tenant, backlogged_weight: float | None = None) -> float:
        """The tenant's fair share of the device now: its weight over the weights of the
        tenants with work (itself counted). `backlogged_weight`: backlogged_weight(), when the
        caller asks for many tenants at once."""
        total = self.backlogged_weight() if backlogged_weight is None else backlogged_weight
        others = total - tenant.weight if tenant.backlogged else total
        # (weights are bounded, service.tenants: the share never underflows to 0)
        return tenant.weight / (max(0.0, others) + tenant.weight)

    # -- arrivals and departures -----------------------------------------------------------

    def enqueue(self, item: Item[T, R]) -> None:
        tenant = self.tenant(item.tenant)
        self.activate(tenant)
        tenant.queued += 1
        tenant.queued_work += item.work
        self._items[item.seq] = item
        self.work += item.work
        if item.tiles:
            self.longs += 1
            self.long_work += item.work
            tenant.longs += 1
            tenant.long_work += item.work
            tenant.latest_long_deadline = max(tenant.latest_long_deadline, item.deadline)
            entry = (item.deadline, item.seq, item)
            heapq.heappush(tenant.long_heap, entry)
            if item.tiles <= FEW_SLICES:
                heapq.heappush(tenant.few_heap, entry)
            self._sweep_long_heaps(tenant)
        else:
            tenant.levels.setdefault(item.priority, OrderedDict())[item.seq] = item
            self._shorts += 1
        self._groups.setdefault(item.key, OrderedDict())[item.seq] = item
        self._on_change(True)

    def remove(self, item: Item[T, R]) -> None:
        """Take a QUEUED item out of the queue without computing it (-> DROPPED)."""
        item.state = State.DROPPED
        self._unlink(item)

    def take(self, item: Item[T, R], now: float) -> None:
        """Take a QUEUED item out of the queue to compute it (-> TAKEN); a short item's tenant
        pays its estimated work now, a long item's tile by tile."""
        item.state = State.TAKEN
        item.queue_s = now - item.enqueued
        tenant = self.tenant(item.tenant)
        if item.tiles:
            self.activate(tenant)  # (it waited for a place: nothing banked meanwhile)
        else:
            self.charge(tenant, item.work)
        self._unlink(item)

    def _unlink(self, item: Item[T, R]) -> None:
        del self._items[item.seq]
        tenant = self.tenant(item.tenant)
        tenant.queued -= 1
        # Summed floats drift: an empty queue holds exactly no work.
        tenant.queued_work = tenant.queued_work - item.work if tenant.queued else 0.0
        self.work = self.work - item.work if self._items else 0.0
        if item.tiles:
            self.longs -= 1
            self.long_work = self.long_work - item.work if self.longs else 0.0
            tenant.longs -= 1
            if tenant.longs:
                tenant.long_work -= item.work
                self._sweep_long_heaps(tenant)
            else:
                tenant.long_work = 0.0
                tenant.latest_long_deadline = -math.inf
                tenant.long_heap.clear()
                tenant.few_heap.clear()
        else:
            level = tenant.levels[item.priority]
            del level[item.seq]
            if not level:
                del tenant.levels[item.priority]
            self._shorts -= 1
        group = self._groups[item.key]
        del group[item.seq]
        if not group:
            del self._groups[item.key]
        self._on_change(False)

    @staticmethod
    def _sweep_long_heaps(tenant: Tenant) -> None:
        """Drop the entries of items no longer queued once they outnumber the queued ones:
        each heap stays within twice the tenant's long items queued (amortized O(1) an
        item)."""
        most = 2 * tenant.longs + 64
        if len(tenant.long_heap) > most or len(tenant.few_heap) > most:
            for heap in (tenant.long_heap, tenant.few_heap):
                heap[:] = [entry for entry in heap if entry[2].state is State.QUEUED]
                heapq.heapify(heap)

    # -- what runs next --------------------------------------------------------------------

    def first_queued(self, heap: list[Entry]) -> Item[T, R] | None:
        """The queued item of `heap` with the earliest deadline (the oldest on ties)."""
        while heap and heap[0][2].state is not State.QUEUED:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def group(self, key: Hashable) -> list[Item[T, R]]:
        return list(self._groups.get(key, {}).values())

    def next_short(self, *, peek: bool = False) -> Item[T, R] | None:
        """The short item a batch forms around next: the chosen tenant's first (module
        docstring), None when no short item waits. `peek`: without choosing (the virtual time
        where returning tenants start stays)."""
        if not self._shorts:
            return None
        waiting = [t for t in self._tenants.values() if t.levels]
        pick = self.least if peek else self.choose
        tenant = pick(waiting, lambda t: min(next(iter(lv)) for lv in t.levels.values()))
        return tenant.first_short()

    def batch_order(self, first: Item[T, R]) -> list[Item[T, R]]:
        """The short items of `first`'s group in the order a batch takes them: its tenant's by
        priority (oldest first within a level), then other tenants' likewise (by priority,
        then arrival: each tenant's own order is kept)."""
        own: dict[int, list[Item[T, R]]] = {}
        others: list[Item[T, R]] = []
        for item in self._groups[first.key].values():
            if item.tiles:
                continue
            if item.tenant == first.tenant:
                own.setdefault(item.priority, []).append(item)
            else:
                others.append(item)
        ordered = [item for level in sorted(own) for item in own[level]]
        if others:
            others.sort(key=lambda item: (item.priority, item.seq))
        return ordered + others

    def queued_of(self, name: str) -> int:
        tenant = self._tenants.get(name)
        return 0 if tenant is None else tenant.queued

    # -- answers ---------------------------------------------------------------------------

    def answer(self, item: Item[T, R], outcome: R | BaseException, *, batch_size: int = 1) -> bool:
        """The one way an item is answered: with its result (a BatchResult of `outcome`) or
        its exception. An item already DONE is not answered again (False); one whose client
        left is closed without an answer."""
        if item.state is State.DONE:
            return False
        item.state = State.DONE
        if item.future.done():  # cancelled: nobody is listening
            return False
        if isinstance(outcome, BaseException):
            item.future.set_exception(outcome)
        else:
            item.future.set_result(
                BatchResult(value=outcome, batch_size=batch_size, queue_ms=item.queue_s * 1e3)
            )
        return True

    def withdraw(self, item: Item[T, R]) -> bool:
        """Take `item` out of the queue without computing it (-> DROPPED) if it is still
        queued: whether it was (its answer is then the caller's, through answer())."""
        if item.state is not State.QUEUED:
            return False
        self.remove(item)
        return True

    @staticmethod
    def awaited(item: Item[Any, Any]) -> bool:
        """Whether someone still waits for `item`'s answer: it is not answered (nor closed),
        and its client did not leave."""
        return item.state is not State.DONE and not item.future.cancelled()

    @staticmethod
    def is_queued(item: Item[Any, Any]) -> bool:
        """Whether `item` is still in the queue (neither taken nor dropped)."""
        return item.state is State.QUEUED

    def close_unheard(self, item: Item[T, R]) -> None:
        """An item nobody waits for any more (its client left): DONE without an answer."""
        item.state = State.DONE
