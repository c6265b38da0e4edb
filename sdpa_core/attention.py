"""attention(): validate, choose a path (fused | dense | chunked), run it, shape the result.

Paths (each in its own module)
- fused (fused.py): torch's scaled_dot_product_attention in tiles of query rows; used when
  neither weights nor diagnostics are needed.
- dense (dense.py): explicit scores and softmax; the only path that can return the weights.
- chunked (chunked.py): key-block online softmax over query tiles, O(N) memory; diagnostics
  without the N_q x N_kv matrix.

dtypes: softmax and statistics accumulate in accumulation_dtype(input dtype): float32, or
float64 for float64 inputs. The output and the returned weights have the input dtype; RowStats
and per-row tensors have the accumulation dtype. Non-finite values follow nonfinite.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch

from sdpa_core.chunked import (
    DEFAULT_BLOCK_SIZE,
    TileBlocks,
    chunked_attention_steps,
    chunked_blocks,
    chunked_tile_rows,
    finish,
)
from sdpa_core.dense import dense_attention, dense_tile_q
from sdpa_core.diagnostics import (
    DEFAULT_SINK_TOKENS,
    Diagnostics,
    DiagnosticsLevel,
    RowStats,
    check_diagnostics_level,
    sink_keys,
    summarize,
)
from sdpa_core.errors import LimitError, SdpaError
from sdpa_core.fused import fused_attention
from sdpa_core.masks import KeyLengths, MaskPlan, build_mask_plan, key_padding
from sdpa_core.nonfinite import check_no_overflow, poison_results, quarantine
from sdpa_core.shapes import (
    CausalArg,
    InputSpec,
    resolve_scale,
    score_matrix_nbytes,
    to_4d,
    validate_inputs,
)

PathName: TypeAlias = Literal["fused", "dense", "chunked"]
PATHS: tuple[PathName, ...] = ("fused", "dense", "chunked")

# What a forced path cannot give: (the reason, what to ask instead).
_CANNOT = {
    "fused": (
        "the fused path returns neither weights nor diagnostics",
        '"dense" or "chunked" (or null) when weights or diagnostics are asked',
    ),
    "chunked": (
        "the chunked path never materializes the weights",
        '"dense" (or null) when return_weights is true',
    ),
}


@dataclass(frozen=True, slots=True)
class AttentionResult:
    """What attention() returns.

    output: [..., H, N_q, D_v] in the input dtype. weights: [..., H, N_q, N_kv] in the input
    dtype, or None. diagnostics: None unless asked. row_stats: present whenever diagnostics
    is not "none" ([..., H, N_q], accumulation dtype). path: which path ran. backend: the
    torch SDPA backend on the fused path ("flash", "efficient", "cudnn", "math", ...), None
    on the others or when torch does not tell.
    """

    output: torch.Tensor
    weights: torch.Tensor | None
    diagnostics: Diagnostics | None
    row_stats: RowStats | None
    path: PathName
    backend: str | None


@dataclass(frozen=True, slots=True)
class PreparedInputs:
    """Validated inputs as every path takes them: [B, H, N, D] views and one MaskPlan."""

    spec: InputSpec
    plan: MaskPlan
    q4: torch.Tensor  # [B, H, N_q, D]
    k4: torch.Tensor  # [B, H_kv, N_kv, D]
    v4: torch.Tensor  # [B, H_kv, N_kv, D_v]


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: CausalArg = False,
    key_lengths: KeyLengths | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    allow_nonfinite: bool = False,
    check_finite: bool = True,
) -> PreparedInputs:
    """validate_inputs (same arguments, same errors), then the 4-D views and the mask plan."""
    spec = validate_inputs(
        q,
        k,
        v,
        causal=causal,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        scale=scale,
        allow_nonfinite=allow_nonfinite,
        check_finite=check_finite,
    )
    plan = build_mask_plan(
        spec,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        device=q.device,
    )
    return PreparedInputs(spec=spec, plan=plan, q4=to_4d(q), k4=to_4d(k), v4=to_4d(v))


def weights_nbytes(spec: InputSpec) -> int:
    """Bytes of the B*H*N_q*N_kv weight matrix in the accumulation dtype."""
    return score_matrix_nbytes(
        batch=spec.batch, heads=spec.heads, n_q=spec.n_q, n_kv=spec.n_kv, dtype=spec.dtype
    )


def choose_path(
    spec: InputSpec,
    *,
    return_weights: bool,
    diagnostics: str,
    memory_budget_bytes: int | None,
    path: str | None,
) -> PathName:
    """The path attention() runs, or an SdpaError when the request cannot be served."""
    need_stats = diagnostics != "none"
    nbytes = weights_nbytes(spec)
    over_budget = memory_budget_bytes is not None and nbytes > memory_budget_bytes

    def limit(what: str) -> LimitError:
        return LimitError(
            f"{what} needs the {spec.batch}x{spec.heads}x{spec.n_q}x{spec.n_kv} weight matrix",
            param="return_weights" if return_weights else "path",
            expected=f"<= {memory_budget_bytes} bytes",
            got=f"{nbytes} bytes",
        )

    if path is None:
        if return_weights:
            if over_budget:
                raise limit("returning the weights")
            return "dense"
        return "chunked" if need_stats else "fused"

    if path not in PATHS:
        raise SdpaError("unknown path", param="path", expected=" | ".join(PATHS), got=repr(path))
    if (path == "fused" and (return_weights or need_stats)) or (
        path == "chunked" and return_weights
    ):
        reason, instead = _CANNOT[path]
        raise SdpaError(reason, param="path", expected=instead, got=f'"{path}"')
    if path == "dense" and over_budget:
        raise limit("the dense path")
    return path


def check_int_option(value: object, *, param: str, minimum: int, what: str, expected: str) -> None:
    """An integer option (never a bool) of at least `minimum`, or an SdpaError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SdpaError(f"{param} must be {what}", param=param, expected=expected, got=repr(value))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: CausalArg = False,
    key_lengths: KeyLengths | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_weights: bool = False,
    diagnostics: DiagnosticsLevel | str = "none",
    memory_budget_bytes: int | None = None,
    allow_nonfinite: bool = False,
    path: PathName | str | None = None,
    block_size: int | None = None,
    check_finite: bool = True,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
) -> AttentionResult:
    """Scaled dot-product attention, softmax(q k^T * scale + mask) v, with optional weights
    and diagnostics.

    Every mask option combines by logical AND as booleans. A query row that sees no key gets
    output 0, weights 0 and counts in diagnostics.summary.masked_rows: never NaN.

    Args:
        q: queries [..., H, N_q, D]: any number of leading batch dims; a 2-D q [N_q, D] is
            one head of one sequence. float16, bfloat16, float32 or float64.
        k: keys [..., H_kv, N_kv, D], q's dtype, device and leading dims. H must be a
            multiple of H_kv (GQA/MQA): query head i uses kv head i // (H / H_kv).
        v: values [..., H_kv, N_kv, D_v]; D_v may differ from D.
        causal: False (or None, "none"); True or "top_left": query i sees keys j <= i, as
            torch's is_causal; "bottom_right" (KV-cache decoding): query i sees keys
            j <= i + N_kv - N_q.
        key_lengths: integers; keys j >= length are padding. Shape q.shape[:-3] (one per
            sequence, shared by its heads), q.shape[:-2] (one per head), or a single int.
        key_padding_mask: bool, True = padding (nn.MultiheadAttention's convention), shape
            q.shape[:-3] + (N_kv,) or q.shape[:-2] + (N_kv,).
        attn_mask: bool (True = may attend) or float (an additive bias on the scaled scores,
            whose -inf entries count as not visible), broadcastable to [..., H, N_q, N_kv].
        scale: the factor on q.k; None = 1 / sqrt(D) (default_scale). Negative and tiny
            scales are legal.
        return_weights: also return the [..., H, N_q, N_kv] weights (the dense path).
        diagnostics: "none", "summary" (scalars and per-head statistics) or "full" (also the
            per-row tensors); computed over visible entries only.
        memory_budget_bytes: a bound on the B*H*N_q*N_kv weight matrix in the accumulation
            dtype (weights_nbytes); diagnostics without weights then take the chunked path.
        allow_nonfinite: accept NaN/Inf inputs; they reach only the rows that can see them,
            which get NaN output, weights and statistics.
        path: None chooses; "fused", "dense" or "chunked" forces one (tests, benchmarks).
        block_size: the chunked path's key block (default DEFAULT_BLOCK_SIZE = 512).
        check_finite: False skips the scan of q, k, v (and a float attn_mask) for NaN/Inf,
            for a caller that has already run validate_inputs on these very tensors; a
            result that overflows is still refused.
        sink_tokens: how many first keys of each sequence are its attention sink, whose share
            of each row's attention the diagnostics report as sink_share (default
            DEFAULT_SINK_TOKENS = 4); keys a key_padding_mask marks as padding do not count
            (a left-padded sequence's sink is its first real tokens).

    Returns:
        AttentionResult: output [..., H, N_q, D_v] in q's dtype; weights (or None); diagnostics
        (None for "none"); row_stats [..., H, N_q] whenever diagnostics is not "none"; the
        path that ran and, on the fused path, torch's backend name.

    Raises:
        ShapeError: ranks, head counts or dims that do not fit, or an empty dimension.
        DTypeError: an unsupported dtype, or dtypes that disagree.
        MaskError: a malformed mask, key length outside [0, N_kv] or causal option.
        NonFiniteError: NaN/Inf in an input (without allow_nonfinite), a non-finite scale, or
            scaled scores that overflow the accumulation dtype.
        LimitError: weights above memory_budget_bytes.
        SdpaError: any other bad argument (unknown path or diagnostics level, a forced path
            that cannot give what is asked, a bad block_size or budget, tensors on different
            devices). Every error above derives from it and names the parameter.
    """
    return AttentionRun(
        q,
        k,
        v,
        causal=causal,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        scale=scale,
        return_weights=return_weights,
        diagnostics=diagnostics,
        memory_budget_bytes=memory_budget_bytes,
        allow_nonfinite=allow_nonfinite,
        path=path,
        block_size=block_size,
        check_finite=check_finite,
        sink_tokens=sink_tokens,
    ).run()


def tile_bounds(length: int, tiles: int, quantum: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of about `tiles` near-equal consecutive parts of range(length), cut at
    multiples of `quantum` (at most ceil(length / quantum) parts, at least one)."""
    units = -(-length // max(1, quantum))
    parts = max(1, min(tiles, units))
    cuts = [min(length, (i * units // parts) * quantum) for i in range(parts + 1)]
    return list(itertools.pairwise(cuts))


@dataclass(frozen=True, slots=True)
class Tile:
    """Sequences [b0, b1) of the normalized batch x query rows [q0, q1)."""

    b0: int
    b1: int
    q0: int
    q1: int

    def of(
        self, inputs: PreparedInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MaskPlan]:
        """q4, k4, v4 and the mask plan of this tile."""
        b0, b1, q0, q1 = self.b0, self.b1, self.q0, self.q1
        plan = inputs.plan.batch_slice(b0, b1).query_rows(q0, q1)
        return inputs.q4[b0:b1, :, q0:q1], inputs.k4[b0:b1], inputs.v4[b0:b1], plan

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


class AttentionRun:
    """attention() as a sequence of tiles a scheduler can step through, one tile per step().

    A tile is a chunk of sequences (the normalized batch) and of query rows: every query row
    is independent, so each tile runs the path attention() chose on its rows with their own
    rows of the mask plan (MaskPlan.query_rows keeps causal alignment), and the result is the
    untiled one up to float reduction order. attention() itself is a run of one tile.
    Validation and the path choice happen in the constructor, so a bad request fails before
    any tile runs; the checks that need the whole result (overflow, the summary) run in
    result().

    tiles asks for about that many tiles: the batch is split first (up to B chunks), then
    each chunk's query rows, cut at multiples of row_quantum (None: the rows the path computes
    at once, so that no tile costs more than its share of one call; 1 cuts anywhere). A run
    has at most B * N_q tiles; tiles_total says how many.
    """

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: CausalArg = False,
        key_lengths: KeyLengths | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        return_weights: bool = False,
        diagnostics: DiagnosticsLevel | str = "none",
        memory_budget_bytes: int | None = None,
        allow_nonfinite: bool = False,
        path: PathName | str | None = None,
        block_size: int | None = None,
        check_finite: bool = True,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        tiles: int = 1,
        row_quantum: int | None = None,
    ) -> None:
        inputs = prepare_inputs(
            q,
            k,
            v,
            causal=causal,
            key_lengths=key_lengths,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            scale=scale,
            allow_nonfinite=allow_nonfinite,
            check_finite=check_finite,
        )
        spec, plan = inputs.spec, inputs.plan
        level = check_diagnostics_level(diagnostics)
        if block_size is not None:
            check_int_option(
                block_size,
                param="block_size",
                minimum=1,
                what="a positive integer",
                expected="int >= 1",
            )
        check_int_option(
            sink_tokens,
            param="sink_tokens",
            minimum=0,
            what="a non-negative integer",
            expected="int >= 0",
        )
        if memory_budget_bytes is not None:
            check_int_option(
                memory_budget_bytes,
                param="memory_budget_bytes",
                minimum=0,
                what="a non-negative integer",
                expected="int >= 0 or null",
            )
        check_int_option(tiles, param="tiles", minimum=1, what="a positive integer",
                          expected="int >= 1")  # fmt: skip
        self._path = choose_path(
            spec,
            return_weights=return_weights,
            diagnostics=level,
            memory_budget_bytes=memory_budget_bytes,
            path=path,
        )
        self._spec, self._plan, self._level = spec, plan, level
        self._scale = resolve_scale(scale, spec.d)
        self._return_weights = return_weights
        self._allow_nonfinite = allow_nonfinite
        self._block_size = block_size or DEFAULT_BLOCK_SIZE
        self._sink_tokens = sink_tokens

        q4, k4, v4, poisoned = inputs.q4, inputs.k4, inputs.v4, None
        if allow_nonfinite:
            q4, k4, v4, poisoned = quarantine(q4, k4, v4, plan)
        self._poisoned = poisoned

        # The sink is the first sink_tokens keys that are not padding: positions
        # [0, sink_tokens) unless a key_padding_mask may hide some of them (key lengths only
        # hide a suffix).
        self._sink_cols: torch.Tensor | None = None
        if level != "none" and key_padding_mask is not None:
            padding = key_padding(
                spec, key_lengths=key_lengths, key_padding_mask=key_padding_mask, device=q.device
            )
            self._sink_cols = None if padding is None else sink_keys(padding, sink_tokens)

        self._inputs = dataclasses.replace(inputs, q4=q4, k4=k4, v4=v4)
        if row_quantum is not None:
            check_int_option(row_quantum, param="row_quantum", minimum=1,
                              what="a positive integer", expected="int >= 1 or null")  # fmt: skip
        quantum = row_quantum or self._row_quantum(q4, k4)
        self._tiles = tile_grid(spec.batch, spec.n_q, tiles, quantum)
        # Sequences and rows may give fewer tiles than asked (one sequence of a few queries
        # and many keys): the chunked path then also stops between key blocks.
        self._key_splits = 1
        if self._path == "chunked" and len(self._tiles) < tiles:
            self._key_splits = -(-tiles // len(self._tiles))
        self._tile_blocks: TileBlocks[tuple[torch.Tensor, RowStats | None]] | None = None
        self._steps = 0
        self._done = 0
        self._backend: str | None = None
        self._out4: torch.Tensor | None = None
        self._weights4: torch.Tensor | None = None
        self._rows4: RowStats | None = None

    def _row_quantum(self, q4: torch.Tensor, k4: torch.Tensor) -> int:
        """The rows the path computes at once: tiles cut at multiples of them cost no more
        than one call (a tile of fewer rows costs about as much as a whole one)."""
        _, h, n_q, _ = q4.shape
        if self._path == "chunked":
            return chunked_tile_rows(h, n_q, k4.shape[2], self._block_size)
        if self._path == "dense":
            return dense_tile_q(q4, k4)
        return 1  # torch's kernels: no row tile of ours

    @property
    def path(self) -> PathName:
        """The path every tile runs."""
        return self._path

    @property
    def backend(self) -> str | None:
        """The fused path's torch backend (known after the first tile), else None."""
        return self._backend

    @property
    def tiles_total(self) -> int:
        """The steps of the run (with key splits an estimate until done: blocks a mask hides
        are skipped without a step)."""
        if self.done:
            return self._steps
        return max(self._steps + 1, len(self._tiles) * self._key_splits)

    @property
    def tiles_done(self) -> int:
        return self._steps

    @property
    def share_done(self) -> float:
        """About how much of the run is done, from 0 to 1: whole tiles, and the part of the
        current one its key blocks tell (a scheduler's measure of what is left, which steps
        cannot give once they outnumber tiles_total's plan)."""
        part = 0.0 if self._tile_blocks is None else self._tile_blocks.share_done
        return (self._done + part) / len(self._tiles)

    @property
    def done(self) -> bool:
        return self._done == len(self._tiles)

    def step(self, budget_s: float | None = None) -> bool:
        """Compute the next tile (on the chunked path with key splits, the next part of its
        key blocks); True once every tile is done.

        budget_s (on the CPU, chunked path): stop the tile's key blocks once this many
        seconds went by (at least one block), and go on from there at the next step, so a
        step lasts about budget_s whatever the cost model estimated. On a GPU the host only
        queues the kernels, so it is ignored there.
        """
        if self.done:
            return True
        tile = self._tiles[self._done]
        budget = budget_s if self._inputs.q4.device.type == "cpu" else None
        by_blocks = self._path == "chunked" and (self._key_splits > 1 or budget is not None)
        finished = self._advance_blocks(tile, budget) if by_blocks else self._compute(tile)
        self._steps += 1
        if finished:
            self._done += 1
        return self.done

    def _tile_inputs(
        self, tile: Tile
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MaskPlan, torch.Tensor | None]:
        """q4, k4, v4, the mask plan and the sink columns of one tile."""
        inputs, sink_cols = self._inputs, self._sink_cols
        if len(self._tiles) == 1:
            return inputs.q4, inputs.k4, inputs.v4, inputs.plan, sink_cols
        q4, k4, v4, plan = tile.of(inputs)
        if sink_cols is not None and sink_cols.shape[0] != 1:
            sink_cols = sink_cols[tile.b0 : tile.b1]
        return q4, k4, v4, plan, sink_cols

    def _compute(self, tile: Tile) -> bool:
        """One whole tile on the path chosen."""
        q4, k4, v4, plan, sink_cols = self._tile_inputs(tile)
        weights4: torch.Tensor | None = None
        rows4: RowStats | None = None
        if self._path == "fused":
            # Under a causal mask a tile's rows see no key past its last row's reach: give
            # the kernel only those (a tile of the last rows of N computes N x rows scores,
            # not N x N; the first tile keeps is_causal).
            reach = plan.n_q + plan.causal_offset if plan.causal != "none" else plan.n_kv
            if 0 < reach < plan.n_kv:
                k4, v4, plan = k4[:, :, :reach], v4[:, :, :reach], plan.key_prefix(reach)
            out4, backend = fused_attention(q4, k4, v4, plan, scale=self._scale)
            self._backend = self._backend or backend
        elif self._path == "dense":
            out4, weights4, rows4 = dense_attention(
                q4,
                k4,
                v4,
                plan,
                scale=self._scale,
                accum_dtype=self._spec.accum_dtype,
                need_weights=self._return_weights,
                need_stats=self._level != "none",
                sink_tokens=self._sink_tokens,
                sink_cols=sink_cols,
            )
        else:
            out4, rows4 = finish(self._chunked_steps(q4, k4, v4, plan, sink_cols))
        self._store(tile, out4, weights4, rows4)
        return True

    def _chunked_steps(
        self,
        q4: torch.Tensor,
        k4: torch.Tensor,
        v4: torch.Tensor,
        plan: MaskPlan,
        sink_cols: torch.Tensor | None,
    ) -> Generator[None, None, tuple[torch.Tensor, RowStats | None]]:
        return chunked_attention_steps(
            q4,
            k4,
            v4,
            plan,
            scale=self._scale,
            accum_dtype=self._spec.accum_dtype,
            need_stats=self._level != "none",
            block_size=self._block_size,
            sink_tokens=self._sink_tokens,
            sink_cols=sink_cols,
        )

    def _advance_blocks(self, tile: Tile, budget_s: float | None) -> bool:
        """The next key_splits-th of a chunked tile's (query tile x key block) steps, or as
        many as fit in budget_s; True when the tile is done."""
        if self._tile_blocks is None:
            q4, k4, v4, plan, sink_cols = self._tile_inputs(tile)
            self._tile_blocks = TileBlocks(
                self._chunked_steps(q4, k4, v4, plan, sink_cols),
                blocks=chunked_blocks(q4, k4, self._block_size),
                key_splits=self._key_splits,
            )
        finished, value = self._tile_blocks.advance(budget_s)
        if value is not None:
            out4, rows4 = value
            self._tile_blocks = None
            self._store(tile, out4, None, rows4)
        return finished

    def _store(
        self,
        tile: Tile,
        out4: torch.Tensor,
        weights4: torch.Tensor | None,
        rows4: RowStats | None,
    ) -> None:
        if len(self._tiles) == 1:
            self._out4, self._weights4, self._rows4 = out4, weights4, rows4
        else:
            self._place(tile, out4, weights4, rows4)

    def _place(
        self,
        tile: Tile,
        out4: torch.Tensor,
        weights4: torch.Tensor | None,
        rows4: RowStats | None,
    ) -> None:
        """Write one tile's results into the whole result (allocated by the first tile, in
        the dtypes the path gives)."""
        spec = self._spec
        rows_shape = (spec.batch, spec.heads, spec.n_q)
        at = (slice(tile.b0, tile.b1), slice(None), slice(tile.q0, tile.q1))
        if self._out4 is None:
            self._out4 = out4.new_empty((*rows_shape, out4.shape[-1]))
        self._out4[at] = out4
        if weights4 is not None:
            if self._weights4 is None:
                self._weights4 = weights4.new_empty((*rows_shape, spec.n_kv))
            self._weights4[at] = weights4
        if rows4 is not None:
            self._rows4 = tile.place_rows(self._rows4, rows4, rows_shape)

    def result(self) -> AttentionResult:
        """The whole result, once every tile is done: shaped as the inputs, checked for
        overflow, summarized."""
        if not self.done or self._out4 is None:
            raise RuntimeError(f"{self._done} of {self.tiles_total} tiles done")
        spec, out4, weights4, rows4 = self._spec, self._out4, self._weights4, self._rows4
        if self._poisoned is not None:
            out4, weights4, rows4 = poison_results(self._poisoned, out4, weights4, rows4)

        # Back to the caller's dtype and leading dims.
        output = out4.to(spec.dtype).reshape(*spec.row_shape, spec.d_v)  # [..., H, N_q, D_v]
        weights = None
        if weights4 is not None:
            # [..., H, N_q, N_kv]
            weights = weights4.to(spec.dtype).reshape(*spec.row_shape, spec.n_kv)
        row_stats = None if rows4 is None else rows4.reshape(spec.row_shape)  # [..., H, N_q]
        if not self._allow_nonfinite:
            check_no_overflow(output, row_stats, scale=self._scale, accum_dtype=spec.accum_dtype)
        diag = None
        if row_stats is not None and self._level != "none":
            diag = summarize(row_stats, scale=self._scale, level=self._level)
        return AttentionResult(
            output=output,
            weights=weights,
            diagnostics=diag,
            row_stats=row_stats,
            path=self._path,
            backend=self._backend,
        )

    def run(self) -> AttentionResult:
        """Every remaining tile, then the result."""
        while not self.step():
            pass
        return self.result()
