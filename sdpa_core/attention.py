"""attention(): validate, choose a path (fused | dense | chunked | flash), run it, shape the result.

What is where
- this module: validation and dispatch. prepare_inputs (validate_inputs, the 4-D views, the
  MaskPlan), choose_path, attention(), and AttentionRun: attention() as a TiledRun, whose
  constructor validates and chooses the path and whose tiles call that path's kernel.
- tiles.py: the tile grid, the key-block steps and TiledRun, the one protocol a scheduler
  steps (AttentionRun here, AnalysisRun in analysis.py).
- fused.py: torch's scaled_dot_product_attention in tiles of query rows; used when neither
  weights nor diagnostics are needed.
- dense.py: explicit scores and softmax; the only path that can return the weights.
- flash.py: diagnostics in one kernel call per tile (kernels/: Triton on CUDA, the compiled
  CPU kernel), O(N) memory; the default for diagnostics without weights wherever a kernel
  runs (flash_kernel).
- chunked.py: key-block online softmax over query tiles, O(N) memory; diagnostics without
  the N_q x N_kv matrix where no flash kernel runs (float64, no kernel built), and the
  reference the flash kernels are checked against.
- shapes.py, masks.py, nonfinite.py, diagnostics.py: input checks, the mask plan, the
  NaN/Inf policy, the row statistics and their summary.

dtypes: softmax and statistics accumulate in accumulation_dtype(input dtype): float32, or
float64 for float64 inputs. The output and the returned weights have the input dtype; RowStats
and per-row tensors have the accumulation dtype. Non-finite values follow nonfinite.py.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

import torch

from sdpa_core.chunked import (
    DEFAULT_BLOCK_SIZE,
    chunked_attention_steps,
    chunked_blocks,
    chunked_tile_rows,
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
from sdpa_core.flash import FLASH_DTYPES, FLASH_TILE_ROWS, flash_attention
from sdpa_core.fused import fused_attention
from sdpa_core.kernels import FlashTile, flash_kernel
from sdpa_core.masks import NO_MASKS, KeyLengths, MaskPlan, Masks, build_mask_plan, key_padding
from sdpa_core.nonfinite import check_no_overflow, poison_results, quarantine
from sdpa_core.shapes import (
    CausalArg,
    InputSpec,
    check_int_option,
    resolve_scale,
    score_matrix_nbytes,
    to_4d,
    validate_inputs,
)
from sdpa_core.tiles import TiledRun, TileInputs, TileOutput, TileResults, check_tiles

PathName: TypeAlias = Literal["fused", "dense", "chunked", "flash"]
PATHS: tuple[PathName, ...] = ("fused", "dense", "chunked", "flash")

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
    "flash": (
        "the flash path never materializes the weights",
        '"dense" (or null) when return_weights is true',
    ),
}


@dataclass(frozen=True, slots=True)
class AttentionResult:
    """What attention() returns.

    output: [..., H, N_q, D_v] in the input dtype. weights: [..., H, N_q, N_kv] in the input
    dtype, or None. diagnostics: None unless asked. row_stats: present whenever diagnostics
    is not "none" ([..., H, N_q], accumulation dtype). path: which path ran. backend: the
    torch SDPA backend on the fused path ("flash", "efficient", "cudnn", "math", ...), the
    kernel on the flash path ("triton" or "cpu_flash"), None on the others or when torch does
    not tell.
    """

    output: torch.Tensor
    weights: torch.Tensor | None
    diagnostics: Diagnostics | None
    row_stats: RowStats | None
    path: PathName
    backend: str | None


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """Everything attention() takes besides the tensors and the masks, as one value: the one
    signature of AttentionRun and prepare_inputs (attention() keeps its keyword arguments and
    builds this at once). Meanings and defaults are attention()'s.

    check() validates it, once: AttentionRun calls it after the inputs' own checks, so a
    request with a bad tensor and a bad option is told about the tensor first, as always.
    """

    scale: float | None = None
    return_weights: bool = False
    diagnostics: DiagnosticsLevel | str = "none"
    memory_budget_bytes: int | None = None
    allow_nonfinite: bool = False
    path: PathName | str | None = None
    block_size: int | None = None
    check_finite: bool = True
    sink_tokens: int = DEFAULT_SINK_TOKENS
    # False leaves the refusal of a result that overflowed (nonfinite.check_no_overflow) to a
    # caller that reads the result on the host anyway: on a GPU the check is a reduction of the
    # output and a wait for the device per call, where the caller's copy to the host waits once
    # (the service: service.runtime.engine). Not an attention() keyword: a library caller keeps
    # the check.
    check_overflow: bool = True

    def check(self) -> DiagnosticsLevel:
        """The diagnostics level, once every option is checked (SdpaError naming the first
        bad one; the scale is validate_inputs', which knows the dtype, and the path is
        choose_path's, which knows the shapes)."""
        level = check_diagnostics_level(self.diagnostics)
        if self.block_size is not None:
            check_int_option(
                self.block_size,
                param="block_size",
                minimum=1,
                what="a positive integer",
                expected="int >= 1",
            )
        check_int_option(
            self.sink_tokens,
            param="sink_tokens",
            minimum=0,
            what="a non-negative integer",
            expected="int >= 0",
        )
        if self.memory_budget_bytes is not None:
            check_int_option(
                self.memory_budget_bytes,
                param="memory_budget_bytes",
                minimum=0,
                what="a non-negative integer",
                expected="int >= 0 or null",
            )
        return level


# attention()'s defaults.
DEFAULT_OPTIONS: Final = AttentionOptions()


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
    masks: Masks = NO_MASKS,
    options: AttentionOptions = DEFAULT_OPTIONS,
) -> PreparedInputs:
    """validate_inputs (its errors; of the options it reads scale, allow_nonfinite and
    check_finite), then the 4-D views and the mask plan."""
    spec = validate_inputs(
        q,
        k,
        v,
        masks,
        scale=options.scale,
        allow_nonfinite=options.allow_nonfinite,
        check_finite=options.check_finite,
    )
    plan = build_mask_plan(spec, masks, device=q.device)
    return PreparedInputs(spec=spec, plan=plan, q4=to_4d(q), k4=to_4d(k), v4=to_4d(v))


def weights_nbytes(spec: InputSpec) -> int:
    """Bytes of the B*H*N_q*N_kv weight matrix in the accumulation dtype."""
    return score_matrix_nbytes(
        batch=spec.batch, heads=spec.heads, n_q=spec.n_q, n_kv=spec.n_kv, dtype=spec.dtype
    )


def flash_unavailable(spec: InputSpec, device: torch.device | None) -> str | None:
    """Why the flash path cannot run these inputs on `device` (None: it can). float64 is the
    chunked path's; a device needs a kernel in this process (flash_kernel)."""
    if spec.dtype not in FLASH_DTYPES:
        return f"the flash kernels take float32, float16 and bfloat16, not {spec.dtype}"
    if device is None:
        return "no device given to choose a flash kernel for"
    choice = flash_kernel(device)
    if choice.tile is None:
        return f"no flash kernel for {device.type} tensors ({choice.reason})"
    return None


def choose_path(
    spec: InputSpec,
    *,
    return_weights: bool,
    diagnostics: str,
    memory_budget_bytes: int | None,
    path: str | None,
    device: torch.device | None = None,
) -> PathName:
    """The path attention() runs, or an SdpaError when the request cannot be served.

    Diagnostics without weights take "flash" where a flash kernel runs the inputs on `device`
    (flash_unavailable; without a device, never), else "chunked"."""
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
        if not need_stats:
            return "fused"
        return "chunked" if flash_unavailable(spec, device) else "flash"

    if path not in PATHS:
        raise SdpaError("unknown path", param="path", expected=" | ".join(PATHS), got=repr(path))
    if (path == "fused" and (return_weights or need_stats)) or (
        path in ("chunked", "flash") and return_weights
    ):
        reason, instead = _CANNOT[path]
        raise SdpaError(reason, param="path", expected=instead, got=f'"{path}"')
    if path == "dense" and over_budget:
        raise limit("the dense path")
    if path == "flash":
        why = flash_unavailable(spec, device)
        if why is not None:
            raise SdpaError(
                f"the flash path cannot run here: {why}",
                param="path",
                expected='"chunked" or null (sdpa_core.compile_kernels() builds the CPU kernel)',
                got='"flash"',
            )
    return path


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
        path: None chooses; "fused", "dense", "chunked" or "flash" forces one (tests,
            benchmarks). Diagnostics without weights take "flash" wherever a flash kernel
            runs the inputs (CUDA: Triton; CPU: the kernel compile_kernels() builds, or
            Triton under TRITON_INTERPRET=1), else "chunked" (float64 always).
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
    masks = Masks(
        causal=causal,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
    )
    options = AttentionOptions(
        scale=scale,
        return_weights=return_weights,
        diagnostics=diagnostics,
        memory_budget_bytes=memory_budget_bytes,
        allow_nonfinite=allow_nonfinite,
        path=path,
        block_size=block_size,
        check_finite=check_finite,
        sink_tokens=sink_tokens,
    )
    return AttentionRun(q, k, v, masks, options).run()


class AttentionRun(TiledRun[AttentionResult]):
    """attention() as a TiledRun (tiles.py): the mask options as one Masks and the others as
    one AttentionOptions; validation (the inputs', then options.check()) and the path choice
    in the constructor, then one tile per step() on the path chosen, each with its own rows of
    the mask plan; result() checks the whole result for overflow and summarizes it.
    attention() itself is a run of one tile.

    tiles asks for about that many tiles (tiles_total says how many; at most B * N_q), cut at
    multiples of row_quantum (None: the rows the path computes at once). On the chunked path
    a tile goes by key blocks when the run stops between them (key splits, or step's budget).
    """

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        masks: Masks = NO_MASKS,
        options: AttentionOptions = DEFAULT_OPTIONS,
        *,
        tiles: int = 1,
        row_quantum: int | None = None,
    ) -> None:
        inputs = prepare_inputs(q, k, v, masks, options)
        spec, plan = inputs.spec, inputs.plan
        level = options.check()
        check_tiles(tiles)
        self._path = choose_path(
            spec,
            return_weights=options.return_weights,
            diagnostics=level,
            memory_budget_bytes=options.memory_budget_bytes,
            path=options.path,
            device=q.device,
        )
        self._backend: str | None = None
        self._kernel: FlashTile | None = None
        if self._path == "flash":
            choice = flash_kernel(q.device)  # choose_path checked there is one
            self._backend, self._kernel = choice.name, choice.tile
        self._level = level
        self._scale = resolve_scale(options.scale, spec.d)
        self._return_weights = options.return_weights
        self._check_overflow = options.check_overflow and not options.allow_nonfinite
        self._block_size = options.block_size or DEFAULT_BLOCK_SIZE
        self._sink_tokens = options.sink_tokens
        self._whole: TileResults | None = None

        q4, k4, v4, poisoned = inputs.q4, inputs.k4, inputs.v4, None
        if options.allow_nonfinite:
            q4, k4, v4, poisoned = quarantine(q4, k4, v4, plan)
        self._poisoned = poisoned

        # The sink is the first sink_tokens keys that are not padding: positions
        # [0, sink_tokens) unless a key_padding_mask may hide some of them (key lengths only
        # hide a suffix).
        sink_cols: torch.Tensor | None = None
        if level != "none" and masks.key_padding_mask is not None:
            padding = key_padding(
                spec,
                key_lengths=masks.key_lengths,
                key_padding_mask=masks.key_padding_mask,
                device=q.device,
            )
            sink_cols = None if padding is None else sink_keys(padding, self._sink_tokens)

        super().__init__(
            spec,
            TileInputs(q4=q4, k4=k4, v4=v4, plan=plan, sink_cols=sink_cols),
            tiles=tiles,
            row_quantum=row_quantum,
            path_rows=self._path_rows(q4, k4),
            key_blocks=self._path == "chunked",
        )

    def _path_rows(self, q4: torch.Tensor, k4: torch.Tensor) -> int:
        """The rows the path computes at once: tiles cut at multiples of them cost no more
        than one call (a tile of fewer rows costs about as much as a whole one)."""
        _, h, n_q, _ = q4.shape
        if self._path == "chunked":
            return chunked_tile_rows(h, n_q, k4.shape[2], self._block_size)
        if self._path == "dense":
            return dense_tile_q(q4, k4)
        if self._path == "flash":
            return FLASH_TILE_ROWS
        return 1  # torch's kernels: no row tile of ours

    @property
    def path(self) -> PathName:
        """The path every tile runs."""
        return self._path

    @property
    def backend(self) -> str | None:
        """The fused path's torch backend (known after the first tile), the flash path's
        kernel, else None."""
        return self._backend

    def _compute(self, part: TileInputs, pass_index: int) -> TileOutput:
        """One whole tile on the path chosen."""
        q4, k4, v4, plan = part.q4, part.k4, part.v4, part.plan
        if self._path == "fused":
            # Under a causal mask a tile's rows see no key past its last row's reach: give
            # the kernel only those (a tile of the last rows of N computes N x rows scores,
            # not N x N; the first tile keeps is_causal).
            reach = plan.n_q + plan.causal_offset if plan.causal != "none" else plan.n_kv
            if 0 < reach < plan.n_kv:
                k4, v4, plan = k4[:, :, :reach], v4[:, :, :reach], plan.key_prefix(reach)
            out4, backend = fused_attention(q4, k4, v4, plan, scale=self._scale)
            self._backend = self._backend or backend
            return TileOutput(out4)
        if self._path == "dense":
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
                sink_cols=part.sink_cols,
            )
            return TileOutput(out4, weights4, rows4)
        if self._path == "flash":
            assert self._kernel is not None
            out4, rows4 = flash_attention(
                q4,
                k4,
                v4,
                plan,
                kernel=self._kernel,
                scale=self._scale,
                sink_tokens=self._sink_tokens,
                sink_cols=part.sink_cols,
            )
            return TileOutput(out4, rows=None if self._level == "none" else rows4)
        return super()._compute(part, pass_index)  # chunked: its key blocks at once

    def _block_steps(self, part: TileInputs, pass_index: int) -> Generator[None, None, TileOutput]:
        """A chunked tile as key-block steps."""
        out4, rows4 = yield from self._chunked_steps(
            part.q4, part.k4, part.v4, part.plan, part.sink_cols
        )
        return TileOutput(out4, rows=rows4)

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

    def _most_blocks(self, part: TileInputs) -> int:
        return chunked_blocks(part.q4, part.k4, self._block_size)

    def _pass_done(self, pass_index: int, results: TileResults) -> None:
        self._whole = results

    def result(self) -> AttentionResult:
        """The whole result, once every tile is done: shaped as the inputs, checked for
        overflow, summarized."""
        self._check_done()
        assert self._whole is not None
        spec, whole = self._spec, self._whole
        out4, weights4, rows4 = whole.output, whole.weights, whole.rows
        assert out4 is not None  # every path gives an output
        if self._poisoned is not None:
            out4, weights4, rows4 = poison_results(self._poisoned, out4, weights4, rows4)

        # Back to the caller's dtype and leading dims.
        output = out4.to(spec.dtype).reshape(*spec.row_shape, spec.d_v)  # [..., H, N_q, D_v]
        weights = None
        if weights4 is not None:
            # [..., H, N_q, N_kv]
            weights = weights4.to(spec.dtype).reshape(*spec.row_shape, spec.n_kv)
        row_stats = None if rows4 is None else rows4.reshape(spec.row_shape)  # [..., H, N_q]
        if self._check_overflow:
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
