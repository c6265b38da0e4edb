"""Tiled runs: one protocol for computing a request a tile at a time.

A scheduler (the service's batcher) steps a long request between others, one tile per step,
and must not care what the request computes. This module is that one protocol and what every
run shares; it knows no kernel (fused.py, dense.py and chunked.py are the runs' business), so
the kernels may import it.

- The tile grid: tile_bounds, Tile and tile_grid cut the normalized batch [B] and the query
  rows [N_q] into tiles (every query row is independent: a tile computes its rows with their
  own rows of the mask plan, and the result is the untiled one up to float reduction order).
- The key-block steps: a path that runs as a generator of (query tile x key block) steps
  (chunked.py) can stop between key blocks; TileBlocks takes such a generator a part at a
  time, finish() drains it at once.
- TiledRun: the base of AttentionRun (attention.py) and AnalysisRun (analysis.py). It owns
  the grid, the passes over it (AnalysisRun makes one per strategy), the key-block stepping,
  the assembly of the tiles' results and the scheduler's view (tiles_total, tiles_done,
  share_done, done, step, result, run; path and backend for a compute metric). A subclass
  says how a tile is computed and what the run's result is.
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import torch

from sdpa_core.diagnostics import RowStats
from sdpa_core.masks import MaskPlan
from sdpa_core.shapes import InputSpec, check_int_option

ReturnT = TypeVar("ReturnT")
ResultT = TypeVar("ResultT")


# -- the tile grid ----------------------------------------------------------------------------


def tile_bounds(length: int, tiles: int, quantum: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of about `tiles` near-equal consecutive parts of range(length), cut at
    multiples of `quantum` (at most ceil(length / quantum) parts, at least one)."""
    units = -(-length // max(1, quantum))
    parts = max(1, min(tiles, units))
    cuts = [min(length, (i * units // parts) * quantum) for i in range(parts + 1)]
    return list(itertools.pairwise(cuts))


@dataclass(frozen=True, slots=True)
class TileInputs:
    """What a tile computes from: [B, H, N, D] views, their mask plan and (for the
    diagnostics' sink_share) the sink's key columns, bool [B|1, H|1, N_kv] or None."""

    q4: torch.Tensor  # [B, H, N_q, D]
    k4: torch.Tensor  # [B, H_kv, N_kv, D]
    v4: torch.Tensor  # [B, H_kv, N_kv, D_v]
    plan: MaskPlan
    sink_cols: torch.Tensor | None = None  # [B|1, H|1, N_kv]


@dataclass(frozen=True, slots=True)
class Tile:
    """Sequences [b0, b1) of the normalized batch x query rows [q0, q1)."""

    b0: int
    b1: int
    q0: int
    q1: int

    def of(self, inputs: TileInputs) -> TileInputs:
        """This tile's part of the inputs (the rows of the mask plan keep causal alignment)."""
        b0, b1, q0, q1 = self.b0, self.b1, self.q0, self.q1
        sink_cols = inputs.sink_cols
        if sink_cols is not None and sink_cols.shape[0] != 1:
            sink_cols = sink_cols[b0:b1]
        return TileInputs(
            q4=inputs.q4[b0:b1, :, q0:q1],  # [b, H, q, D]
            k4=inputs.k4[b0:b1],  # [b, H_kv, N_kv, D]
            v4=inputs.v4[b0:b1],  # [b, H_kv, N_kv, D_v]
            plan=inputs.plan.batch_slice(b0, b1).query_rows(q0, q1),
            sink_cols=sink_cols,
        )

    def place_rows(
        self, whole: RowStats | None, part: RowStats, rows_shape: tuple[int, ...]
    ) -> RowStats:
        """part written into `whole` (allocated [B, H, N_q] at the first tile)."""
        if whole is None:
            whole = part.apply(lambda _, t: t.new_empty(rows_shape))
        for name, tensor in whole.as_dict().items():
            tensor[self.b0 : self.b1, :, self.q0 : self.q1] = getattr(part, name)
        return whole


def tile_grid(batch: int, n_q: int, tiles: int, row_quantum: int = 1) -> list[Tile]:
    """About `tiles` tiles over [batch, N_q]: the batch split first (up to `batch` chunks),
    then each chunk's query rows at multiples of row_quantum (the path's own row tile)."""
    chunks = tile_bounds(batch, tiles)
    rows = tile_bounds(n_q, -(-tiles // len(chunks)), row_quantum)
    return [Tile(b0, b1, q0, q1) for b0, b1 in chunks for q0, q1 in rows]


def check_tiles(tiles: object) -> None:
    """A run's `tiles` option: a positive integer, or an SdpaError naming it."""
    check_int_option(tiles, param="tiles", minimum=1, what="a positive integer",
                     expected="int >= 1")  # fmt: skip


# -- the key-block steps ----------------------------------------------------------------------


class TileBlocks(Generic[ReturnT]):
    """One tile's generator of (query tile x key block) steps, taken a part at a time.

    A part is `blocks` / key_splits steps or, with a time budget, as many steps as fit it.
    share_done says about how much of the tile is done, for a scheduler's estimate of what is
    left when the steps outnumber its plan. A step that raised ends the tile: advance() then
    refuses, since the generator, closed by the error, would look finished with no result.
    """

    def __init__(
        self, steps: Generator[None, None, ReturnT], *, blocks: int, key_splits: int
    ) -> None:
        self._steps = steps
        self._most_steps = max(1, blocks)  # chunked_blocks: at most this many steps
        self._per_part = max(1, -(-self._most_steps // key_splits))
        self._taken = 0
        self._failed = False

    @property
    def share_done(self) -> float:
        """Steps taken over the most the tile may take. Blocks a mask hides entirely are
        skipped without a step, so under such a mask it lags, and the last part makes up
        the rest."""
        return min(1.0, self._taken / self._most_steps)

    def advance(self, budget_s: float | None) -> tuple[bool, ReturnT | None]:
        """Take the next part: its share of the steps or, with budget_s, as many as fit in
        budget_s seconds of this thread's time (at least one; the clock is read between steps,
        so budget_s only bounds host-side work: the caller passes it for the CPU alone).
        -> (True, what the generator returned) once it is done, else (False, None)."""
        if self._failed:
            raise RuntimeError("a step of this tile failed: the tile cannot go on")
        started = time.perf_counter()
        taken_now = 0
        while True:
            try:
                next(self._steps)
            except StopIteration as stop:
                self._taken = self._most_steps
                return True, cast("ReturnT", stop.value)
            except BaseException:
                self._failed = True
                raise
            taken_now += 1
            self._taken += 1
            if budget_s is None:
                if taken_now >= self._per_part:
                    return False, None
            elif time.perf_counter() - started >= budget_s:
                return False, None


def finish(steps: Generator[None, None, ReturnT]) -> ReturnT:
    """What a generator of steps returns, once every step ran."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return cast("ReturnT", stop.value)


# -- the run protocol -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TileOutput:
    """What one tile computed (accumulation dtype): output [b, H, q, D_v], weights
    [b, H, q, N_kv] and row statistics [b, H, q], each None when the run does not keep it."""

    output: torch.Tensor | None
    weights: torch.Tensor | None = None
    rows: RowStats | None = None


class TileResults:
    """One pass's whole results, written tile by tile: [B, H, N_q, ...] tensors allocated by
    the first tile, in the dtypes the path gives. A grid of one tile keeps that tile's own
    tensors (no copy)."""

    __slots__ = ("_n_kv", "_rows_shape", "_whole", "output", "rows", "weights")

    def __init__(self, rows_shape: tuple[int, int, int], n_kv: int, *, whole: bool) -> None:
        self._rows_shape = rows_shape  # [B, H, N_q]
        self._n_kv = n_kv
        self._whole = whole
        self.output: torch.Tensor | None = None  # [B, H, N_q, D_v]
        self.weights: torch.Tensor | None = None  # [B, H, N_q, N_kv]
        self.rows: RowStats | None = None  # [B, H, N_q]

    def put(self, tile: Tile, part: TileOutput) -> None:
        """One tile's results, in their place."""
        if self._whole:
            self.output, self.weights, self.rows = part.output, part.weights, part.rows
            return
        shape = self._rows_shape
        at = (slice(tile.b0, tile.b1), slice(None), slice(tile.q0, tile.q1))
        if part.output is not None:
            if self.output is None:
                self.output = part.output.new_empty((*shape, part.output.shape[-1]))
            self.output[at] = part.output
        if part.weights is not None:
            if self.weights is None:
                self.weights = part.weights.new_empty((*shape, self._n_kv))
            self.weights[at] = part.weights
        if part.rows is not None:
            self.rows = tile.place_rows(self.rows, part.rows, shape)


class TiledRun(ABC, Generic[ResultT]):
    """A request as a sequence of steps a scheduler can interleave with others: each step
    computes one tile (or, on a path of key blocks, the next part of a tile's key blocks), and
    result() is the untiled call's result once every step ran. run() is the untiled call.

    A run makes `passes` passes over one grid of tiles of the normalized [B, N_q] (about
    tiles / passes tiles each: the batch split first, then each chunk's query rows, cut at
    multiples of row_quantum; None: the rows the path computes at once, so that no tile costs
    more than its share of one call). When the grid has fewer tiles than asked (a few queries,
    many keys) a run whose tiles go by key blocks (key_blocks) also stops between them.

    Validation happens in the subclass's constructor, so a bad request fails before any tile
    runs; the checks that need the whole result, in result(). A subclass computes a tile in
    _compute (whole) or _block_steps (key block by key block, when key_blocks), gets each
    finished pass in _pass_done, and says what the run's result() is.
    """

    def __init__(
        self,
        spec: InputSpec,
        inputs: TileInputs,
        *,
        tiles: int,
        row_quantum: int | None,
        path_rows: int,
        passes: int = 1,
        key_blocks: bool = False,
    ) -> None:
        """spec and inputs: the validated request; tiles (checked by the subclass, in its
        order of errors): about how many tiles in all; path_rows: the rows its path computes
        at once (the default row_quantum); key_blocks: whether tiles go by key blocks."""
        if row_quantum is not None:
            check_int_option(row_quantum, param="row_quantum", minimum=1,
                             what="a positive integer", expected="int >= 1 or null")  # fmt: skip
        per_pass = -(-tiles // passes)
        self._spec = spec
        self._inputs = inputs
        if per_pass == 1:  # the untiled call (attention()): one tile, no grid to cut
            self._tiles = [Tile(0, spec.batch, 0, spec.n_q)]
        else:
            self._tiles = tile_grid(spec.batch, spec.n_q, per_pass, row_quantum or path_rows)
        self._passes = passes
        self._key_blocks = key_blocks
        # Sequences and rows may give fewer tiles than asked (one sequence of a few queries
        # and many keys): a run of key blocks then also stops between them.
        self._key_splits = -(-per_pass // len(self._tiles)) if key_blocks else 1
        self._blocks: TileBlocks[TileOutput] | None = None  # the tile under way by key blocks
        self._steps = 0
        self._done = 0  # tiles done, over every pass
        self._results = self._new_results()

    # -- what a scheduler reads -----------------------------------------------------------

    @property
    @abstractmethod
    def path(self) -> str:
        """What the run computes on, for a compute metric: the attention path ("fused",
        "dense", "chunked") or "analyze"."""

    @property
    def backend(self) -> str | None:
        """The torch SDPA backend its tiles ran on (fused path, known after the first tile),
        else None."""
        return None

    @property
    def tiles_total(self) -> int:
        """The steps of the run (with key splits an estimate until done: blocks a mask hides
        are skipped without a step)."""
        if self.done:
            return self._steps
        planned = self._passes * len(self._tiles) * self._key_splits
        return max(self._steps + 1, planned)

    @property
    def tiles_done(self) -> int:
        """The steps taken."""
        return self._steps

    @property
    def share_done(self) -> float:
        """About how much of the run is done, from 0 to 1: whole tiles, and the part of the
        current one its key blocks tell (a scheduler's measure of what is left, which steps
        cannot give once they outnumber tiles_total's plan)."""
        part = 0.0 if self._blocks is None else self._blocks.share_done
        return (self._done + part) / (self._passes * len(self._tiles))

    @property
    def done(self) -> bool:
        return self._done == self._passes * len(self._tiles)

    def step(self, budget_s: float | None = None) -> bool:
        """Compute the next tile (on a path of key blocks with key splits, the next part of
        its key blocks); True once every tile is done.

        budget_s (on the CPU, a path of key blocks): stop the tile's key blocks once this many
        seconds went by (at least one block), and go on from there at the next step, so a
        step lasts about budget_s whatever the cost model estimated. On a GPU the host only
        queues the kernels, so it cannot stop them there: a step given a budget returns once
        its kernels are done instead, so that the scheduler that times it (the service's
        runtime, which steps this run as it is) measures the tile's device time, not its
        launch (run() gives none: it does not wait between tiles).
        """
        done = self._step(budget_s)
        device = self._inputs.q4.device
        if budget_s is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return done

    def _step(self, budget_s: float | None) -> bool:
        if self.done:
            return True
        per_pass = len(self._tiles)
        tile, pass_index = self._tiles[self._done % per_pass], self._done // per_pass
        budget = budget_s if self._inputs.q4.device.type == "cpu" else None
        by_blocks = self._key_blocks and (self._key_splits > 1 or budget is not None)
        output: TileOutput | None
        if self._blocks is None and not by_blocks:
            output = self._compute(self._part(tile), pass_index)
        else:
            if self._blocks is None:
                part = self._part(tile)
                self._blocks = TileBlocks(
                    self._block_steps(part, pass_index),
                    blocks=self._most_blocks(part),
                    key_splits=self._key_splits,
                )
            finished, output = self._blocks.advance(budget)
            if finished:
                self._blocks = None
        self._steps += 1
        if output is None:
            return False  # more key blocks of this tile next step
        self._results.put(tile, output)
        self._done += 1
        if self._done % per_pass == 0:
            self._pass_done(pass_index, self._results)
            if not self.done:
                self._results = self._new_results()
        return self.done

    @abstractmethod
    def result(self) -> ResultT:
        """The whole result, once every tile is done (RuntimeError before)."""

    def run(self) -> ResultT:
        """Every remaining tile, then the result. A run of one tile in one pass that has not
        started (attention() itself) computes it at once, without step()'s bookkeeping."""
        if (
            self._steps == 0
            and self._passes == 1
            and len(self._tiles) == 1
            and not (self._key_blocks and self._key_splits > 1)
        ):
            self._results.put(self._tiles[0], self._compute(self._inputs, 0))
            self._steps = self._done = 1
            self._pass_done(0, self._results)
            return self.result()
        while not self.step():
            pass
        return self.result()

    # -- what a subclass provides ---------------------------------------------------------

    def _compute(self, part: TileInputs, pass_index: int) -> TileOutput:
        """One whole tile (default: its key blocks at once)."""
        return finish(self._block_steps(part, pass_index))

    def _block_steps(self, part: TileInputs, pass_index: int) -> Generator[None, None, TileOutput]:
        """One tile as a generator of key-block steps (a run with key_blocks)."""
        raise NotImplementedError(f"{type(self).__name__} computes its tiles whole")

    def _most_blocks(self, part: TileInputs) -> int:
        """The most steps _block_steps takes for this tile (a run with key_blocks)."""
        raise NotImplementedError(f"{type(self).__name__} computes its tiles whole")

    @abstractmethod
    def _pass_done(self, pass_index: int, results: TileResults) -> None:
        """Every tile of pass `pass_index` is done: its results are whole."""

    # -- shared ---------------------------------------------------------------------------

    def _part(self, tile: Tile) -> TileInputs:
        """A tile's inputs (a grid of one tile: the inputs themselves, nothing sliced)."""
        return self._inputs if len(self._tiles) == 1 else tile.of(self._inputs)

    def _new_results(self) -> TileResults:
        spec = self._spec
        rows_shape = (spec.batch, spec.heads, spec.n_q)
        return TileResults(rows_shape, spec.n_kv, whole=len(self._tiles) == 1)

    def _check_done(self) -> None:
        """RuntimeError unless every tile is done (result()'s guard)."""
        if not self.done:
            raise RuntimeError(f"{self.tiles_done} of {self.tiles_total} tiles done")
