"""Scaling analysis: how the score divisor shapes the softmax.

For each divisor c' (scores = q.k / c'), the same row statistics as attention()'s diagnostics
are computed on the chunked path (O(N) memory, no value tensor needed: v is a [.., N_kv, 1]
zero tensor whose output is ignored). recommended_divisor is the standard deviation of the
raw scores over visible entries: the divisor that makes the scaled score variance 1.

The raw statistics come from a pass at scale 1 (the "none" strategy's when it is in the list,
else one more pass), never from whichever strategy ran last: a divisor far from 1 (1e-40, say)
overflows or flushes its scaled scores, and their raw variance with them.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from sdpa_core.attention import prepare_inputs
from sdpa_core.chunked import (
    DEFAULT_BLOCK_SIZE,
    chunked_attention_steps,
    chunked_blocks,
    chunked_tile_rows,
)
from sdpa_core.diagnostics import DiagnosticsSummary, summarize
from sdpa_core.errors import SdpaError
from sdpa_core.masks import NO_MASKS, KeyLengths, Masks
from sdpa_core.shapes import CausalArg
from sdpa_core.tiles import TiledRun, TileInputs, TileOutput, TileResults, check_tiles

STANDARD_STRATEGIES: tuple[str, ...] = ("none", "sqrt_dk", "dk", "dk_quarter", "two_sqrt_dk")


def standard_divisor(name: str, d_k: int) -> float:
    """The divisor of a standard strategy for head dim d_k."""
    divisors: dict[str, float] = {
        "none": 1.0,
        "sqrt_dk": math.sqrt(d_k),
        "dk": float(d_k),
        "dk_quarter": d_k**0.25,
        "two_sqrt_dk": 2.0 * math.sqrt(d_k),
    }
    if name not in divisors:
        raise SdpaError(
            "unknown scaling strategy",
            param="strategies",
            expected=" | ".join(STANDARD_STRATEGIES) + " or a (name, divisor) pair",
            got=repr(name),
        )
    return divisors[name]


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """Statistics of the softmax under one divisor (row statistics: mean over active rows)."""

    name: str
    divisor: float
    score_variance: float
    entropy: float
    normalized_entropy: float
    max_weight: float
    saturated_fraction: float
    grad_health: float


@dataclass(frozen=True, slots=True)
class ScalingReport:
    """d_k, the raw score variance, the recommended divisor and one entry per strategy."""

    d_k: int
    raw_score_variance: float
    recommended_divisor: float
    strategies: tuple[StrategyResult, ...]


StrategySpec = str | tuple[str, float]


def resolve_strategies(
    strategies: Sequence[StrategySpec] | None, d_k: int
) -> list[tuple[str, float]]:
    """(name, divisor) pairs to evaluate.

    None: the five standard strategies. A sequence of standard names and/or custom
    (name, divisor) pairs: exactly those, in that order -- except that a sequence made only of
    custom pairs is evaluated after the five standard ones (so {"name": "t2", "divisor": 16}
    alone still shows the usual comparison). Names must be unique; divisors finite and != 0.
    """
    if strategies is None:
        return [(n, standard_divisor(n, d_k)) for n in STANDARD_STRATEGIES]
    if isinstance(strategies, str | bytes) or not isinstance(strategies, Sequence):
        raise SdpaError(
            "strategies must be a list",
            param="strategies",
            expected="a list of names or (name, divisor) pairs",
            got=type(strategies).__name__,
        )
    out: list[tuple[str, float]] = []
    only_custom = True
    for item in strategies:
        if isinstance(item, str):
            only_custom = False
            out.append((item, standard_divisor(item, d_k)))
            continue
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise SdpaError(
                "a strategy is a name or a (name, divisor) pair",
                param="strategies",
                expected="str or (str, float)",
                got=repr(item),
            )
        name, divisor = item
        if isinstance(divisor, bool) or not isinstance(divisor, int | float):
            raise SdpaError(
                "a divisor must be a number",
                param="strategies",
                expected="a finite non-zero number",
                got=repr(divisor),
            )
        if not math.isfinite(divisor) or divisor == 0:
            raise SdpaError(
                "a divisor must be finite and non-zero",
                param="strategies",
                expected="a finite non-zero number",
                got=repr(divisor),
            )
        out.append((name, float(divisor)))
    if only_custom:
        out = [(n, standard_divisor(n, d_k)) for n in STANDARD_STRATEGIES] + out
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SdpaError(
            "strategy names must be unique",
            param="strategies",
            expected="unique names",
            got=f"duplicates {dup}",
        )
    if not out:
        raise SdpaError(
            "no strategy given", param="strategies", expected="at least one strategy", got="[]"
        )
    return out


def analysis_passes(strategies: Sequence[StrategySpec] | None, d_k: int) -> int:
    """How many chunked passes analyze_scaling() makes for these strategies: one per strategy,
    plus one at scale 1 for the raw statistics unless a strategy's divisor is 1 (the cost
    model counts them). Raises SdpaError as resolve_strategies() does."""
    pairs = resolve_strategies(strategies, d_k)
    return len(pairs) + (0 if any(divisor == 1.0 for _, divisor in pairs) else 1)


def analyze_scaling(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    strategies: Sequence[StrategySpec] | None = None,
    causal: CausalArg = False,
    key_lengths: KeyLengths | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> ScalingReport:
    """Compare how score divisors shape the softmax of q k^T.

    For each strategy the scores q.k / divisor go through the softmax on the chunked path
    (O(N) memory, no N_q x N_kv matrix) and the same row statistics as attention()'s
    diagnostics are pooled over the visible entries.

    Args:
        q: queries [..., H, N_q, d_k] (float16, bfloat16, float32 or float64).
        k: keys [..., H_kv, N_kv, d_k], q's dtype, device and leading dims (GQA allowed).
        strategies: None for the five standard divisors ("none" 1, "sqrt_dk", "dk",
            "dk_quarter" d_k^0.25, "two_sqrt_dk"); else standard names and/or custom
            (name, divisor) pairs, evaluated in that order (custom pairs alone come after
            the five standard ones). Names unique; divisors finite and non-zero.
        causal: as for attention(): False, True / "top_left" or "bottom_right".
        key_lengths: as for attention(): per sequence or per head; keys past it are padding.
        key_padding_mask: as for attention(): bool, True = padding.
        attn_mask: as for attention(); a float mask is added after dividing the scores.
        block_size: the chunked path's key block.

    Returns:
        ScalingReport: d_k, the raw score variance over visible entries, recommended_divisor
        (the standard deviation of the raw scores: the divisor that makes the scaled score
        variance 1) and one StrategyResult per strategy (score_variance, entropy,
        normalized_entropy, max_weight, saturated_fraction, grad_health).

    Raises:
        SdpaError: a malformed strategy list (unknown name, bad divisor, duplicate names), or
            any input error attention() would raise for q, k and these masks (ShapeError,
            DTypeError, MaskError, NonFiniteError).
    """
    masks = Masks(
        causal=causal,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
    )
    return AnalysisRun(q, k, masks, strategies=strategies, block_size=block_size).run()


class AnalysisRun(TiledRun[ScalingReport]):
    """analyze_scaling() as a TiledRun (tiles.py): one pass per strategy (plus the raw pass at
    scale 1 when no divisor is 1), each over the same grid of tiles of sequences and query
    rows on the chunked path (by key blocks when the run stops between them); a pass is
    summarized when its last tile is done. analyze_scaling() is a run of one tile per pass.
    Its arguments and errors are analyze_scaling()'s (the mask options as one Masks), raised
    by the constructor; tiles asks for about that many tiles in all (tiles_total says how
    many), row_quantum as for AttentionRun."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        masks: Masks = NO_MASKS,
        *,
        strategies: Sequence[StrategySpec] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        tiles: int = 1,
        row_quantum: int | None = None,
    ) -> None:
        v = k.new_zeros((*k.shape[:-1], 1))  # the output is not needed, only the row statistics
        inputs = prepare_inputs(q, k, v, masks)
        spec = inputs.spec
        self._pairs = resolve_strategies(strategies, spec.d)
        check_tiles(tiles)
        self._scales = [1.0 / divisor for _, divisor in self._pairs]
        if not any(divisor == 1.0 for _, divisor in self._pairs):
            self._scales.append(1.0)  # the raw statistics' own pass
        self._block_size = block_size
        self._summaries: list[DiagnosticsSummary] = []
        super().__init__(
            spec,
            TileInputs(q4=inputs.q4, k4=inputs.k4, v4=inputs.v4, plan=inputs.plan),
            tiles=tiles,
            row_quantum=row_quantum,
            path_rows=chunked_tile_rows(spec.heads, spec.n_q, spec.n_kv, block_size),
            passes=len(self._scales),
            key_blocks=True,
        )

    @property
    def path(self) -> str:
        """The compute metric's name for it, "analyze" (its tiles run the chunked path)."""
        return "analyze"

    def _block_steps(self, part: TileInputs, pass_index: int) -> Generator[None, None, TileOutput]:
        """A tile of one pass: the row statistics at that pass's scale (the output of the
        zero values is dropped)."""
        _, rows = yield from chunked_attention_steps(
            part.q4,
            part.k4,
            part.v4,
            part.plan,
            scale=self._scales[pass_index],
            accum_dtype=self._spec.accum_dtype,
            need_stats=True,
            block_size=self._block_size,
        )
        return TileOutput(None, rows=rows)

    def _most_blocks(self, part: TileInputs) -> int:
        return chunked_blocks(part.q4, part.k4, self._block_size)

    def _pass_done(self, pass_index: int, results: TileResults) -> None:
        assert results.rows is not None  # need_stats
        scale = self._scales[pass_index]
        self._summaries.append(summarize(results.rows, scale=scale, level="summary").summary)

    def result(self) -> ScalingReport:
        """The report, once every pass is done."""
        self._check_done()
        results = []
        raw_var: float | None = None
        for (name, divisor), s in zip(self._pairs, self._summaries, strict=False):
            if divisor == 1.0:
                raw_var = s.score_variance_raw
            results.append(
                StrategyResult(
                    name=name,
                    divisor=divisor,
                    score_variance=s.score_variance_scaled,
                    entropy=s.entropy,
                    normalized_entropy=s.normalized_entropy,
                    max_weight=s.max_weight,
                    saturated_fraction=s.saturated_fraction,
                    grad_health=s.grad_health,
                )
            )
        if raw_var is None:
            raw_var = self._summaries[-1].score_variance_raw  # the extra pass at scale 1
        return ScalingReport(
            d_k=self._spec.d,
            raw_score_variance=raw_var,
            recommended_divisor=math.sqrt(raw_var),
            strategies=tuple(results),
        )


def make_synthetic_qk(
    *,
    n_q: int,
    n_k: int,
    d_k: int,
    std: float = 1.0,
    seed: int = 0,
    heads: int = 1,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [heads, n_q, d_k] and k [heads, n_k, d_k] with i.i.d. N(0, std^2) entries, seeded.

    Drawn in float64 from a private torch.Generator (the global RNG is untouched), then cast,
    so a seed gives the same values in every dtype up to rounding.
    """
    for name, val in (("n_q", n_q), ("n_k", n_k), ("d_k", d_k), ("heads", heads)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise SdpaError(
                "must be a positive integer", param=name, expected="int >= 1", got=repr(val)
            )
    if not (isinstance(std, int | float) and math.isfinite(std) and std > 0):
        raise SdpaError(
            "std must be a positive finite number", param="std", expected="float > 0", got=repr(std)
        )
    gen = torch.Generator().manual_seed(int(seed))
    q = torch.randn(heads, n_q, d_k, generator=gen, dtype=torch.float64) * std
    k = torch.randn(heads, n_k, d_k, generator=gen, dtype=torch.float64) * std
    return q.to(dtype), k.to(dtype)
