"""AttentionRun: attention computed tile by tile (what the service's runtime schedules in
slices) against the float64 reference, for every path and mask option; and the one protocol
of tiles.py (TiledRun) that AttentionRun and AnalysisRun share, and the Masks value they take."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch

from sdpa_core import (
    AttentionOptions,
    MaskError,
    Masks,
    SdpaError,
    analyze_scaling,
    attention,
)
from sdpa_core.analysis import AnalysisRun
from sdpa_core.attention import AttentionRun, prepare_inputs
from sdpa_core.tiles import TiledRun, TileInputs, TileOutput, TileResults, tile_bounds
from tests.core.reference import reference_attention, reference_rows, visibility
from tests.core.test_paths import (
    AXES,
    CASES,
    GRID,
    _case_id,
    check_against_reference,
    check_output,
    make_inputs,
)

CAUSAL = Masks(causal=True)
BOTTOM_RIGHT = Masks(causal="bottom_right")
# The chunked path by name: a process whose flash kernel is built (compile_kernels()) would
# take "flash" by default, which cuts rows and steps otherwise (tests/core/test_flash_path.py).
SUMMARY = AttentionOptions(diagnostics="summary", path="chunked")


@pytest.mark.parametrize("tiles", [2, 5])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_pairwise_table_in_tiles(case: dict[str, Any], tiles: int) -> None:
    """The same mask / shape / dtype table as the untiled paths, computed in tiles: batch
    chunks first, then query rows (tiles = 5 on a batch of 2 splits rows too)."""
    inp = make_inputs(
        causal=case["causal"],
        n_q=case["n_q"],
        n_kv=case["n_kv"],
        key_lengths=case["key_lengths"],
        mask=case["mask"],
        heads=case["heads"],
        dtype=case["dtype"],
        seed=CASES.index(case),
    )
    check_against_reference(inp, case["path"], tiles=tiles)


@pytest.mark.parametrize(("path", "causal", "n_q", "n_kv"), GRID)
def test_causal_grid_in_tiles(path: str, causal: str, n_q: int, n_kv: int) -> None:
    """Causal alignment is counted from each tile's first row: every causal mode and
    N_q x N_kv, with key lengths, a float mask and GQA, in tiles of query rows."""
    inp = make_inputs(
        causal=causal,
        n_q=n_q,
        n_kv=n_kv,
        key_lengths="per_sequence",
        mask="float",
        heads=(4, 2),
        dtype=torch.float32,
        seed=2000 + GRID.index((path, causal, n_q, n_kv)),
        batch=1,  # every tile is a slice of query rows
    )
    check_against_reference(inp, path, tiles=3)


@pytest.mark.parametrize("path", AXES["path"])
@pytest.mark.parametrize("per_head", [False, True])
def test_key_padding_mask_and_sink_in_tiles(path: str, per_head: bool) -> None:
    """A key_padding_mask (per sequence or per head) and the attention sink it moves: the
    output against the reference, and sink_share equal to the untiled run's."""
    gen = torch.Generator().manual_seed(7)
    b, h, n_q, n_kv = 3, 2, 7, 9
    q = torch.randn(b, h, n_q, 4, generator=gen)
    k = torch.randn(b, h, n_kv, 4, generator=gen)
    v = torch.randn(b, h, n_kv, 3, generator=gen)
    shape = (b, h, n_kv) if per_head else (b, n_kv)
    kpm = torch.rand(shape, generator=gen) < 0.4
    kpm[..., 0] = True  # a left-padded sequence: its sink starts after the padding
    kwargs: dict[str, Any] = {"causal": "bottom_right", "key_padding_mask": kpm}
    diag = "none" if path == "fused" else "summary"
    whole = attention(q, k, v, path=path, diagnostics=diag, **kwargs)
    options = AttentionOptions(path=path, diagnostics=diag)
    run = AttentionRun(q, k, v, Masks(**kwargs), options, tiles=8, row_quantum=1)
    assert run.tiles_total == 9  # 3 sequences x 3 tiles of rows
    tiled = run.run()

    pad4 = kpm if per_head else kpm[:, None].expand(b, h, n_kv)
    vis = visibility(b=b, h=h, n_q=n_q, n_kv=n_kv, causal="bottom_right")
    vis = vis & ~pad4[:, :, None, :]
    ref = reference_attention(q, k, v, vis)
    torch.testing.assert_close(tiled.output.double(), ref.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tiled.output, whole.output, atol=1e-6, rtol=1e-6)
    if path != "fused":
        assert tiled.diagnostics is not None
        assert whole.diagnostics is not None
        assert tiled.diagnostics.summary.sink_share == pytest.approx(
            whole.diagnostics.summary.sink_share, rel=1e-6
        )
        rows = reference_rows(ref, scale=1 / math.sqrt(4))
        assert tiled.diagnostics.summary.masked_rows == rows.masked_rows


def test_a_run_steps_tile_by_tile() -> None:
    """step() computes one tile at a time and says when the last is done; the result is
    there only then; a bad request fails in the constructor, before any tile."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=gen) for _ in range(3))
    run = AttentionRun(q, k, v, CAUSAL, SUMMARY, tiles=4, row_quantum=1)
    assert (run.tiles_total, run.tiles_done, run.done) == (4, 0, False)
    with pytest.raises(RuntimeError, match="0 of 4 tiles"):
        run.result()
    assert [(run.step(), run.share_done) for _ in range(4)] == [
        (False, 0.25),
        (False, 0.5),
        (False, 0.75),
        (True, 1.0),
    ]
    assert run.tiles_done == 4
    assert run.step() is True
    torch.testing.assert_close(run.result().output, attention(q, k, v, causal=True).output)
    with pytest.raises(MaskError):
        AttentionRun(q, k, v, Masks(key_lengths=[11]), tiles=4)


@pytest.mark.parametrize(
    ("length", "tiles", "want"),
    [
        (10, 1, [(0, 10)]),
        (10, 3, [(0, 3), (3, 6), (6, 10)]),
        (2, 5, [(0, 1), (1, 2)]),  # never more parts than rows
        (1, 1, [(0, 1)]),
    ],
)
def test_tile_bounds(length: int, tiles: int, want: list[tuple[int, int]]) -> None:
    assert tile_bounds(length, tiles) == want


@pytest.mark.parametrize(
    ("length", "tiles", "quantum", "want"),
    [
        (300, 4, 128, [(0, 128), (128, 256), (256, 300)]),  # 3 units: at most 3 parts
        (1024, 2, 128, [(0, 512), (512, 1024)]),
        (1000, 3, 128, [(0, 256), (256, 640), (640, 1000)]),
        (100, 5, 128, [(0, 100)]),
    ],
)
def test_tile_bounds_cut_at_multiples_of_the_quantum(
    length: int, tiles: int, quantum: int, want: list[tuple[int, int]]
) -> None:
    assert tile_bounds(length, tiles, quantum) == want


def test_rows_are_cut_where_the_path_cuts_them() -> None:
    """By default a run cuts query rows at the path's own row tile (the chunked path's 256
    rows for 8 heads and 512-key blocks: 2^20-element tiles), where a tile costs no more
    than its share; the result is the same either way."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 8, 1200, 16, generator=gen) for _ in range(3))
    run = AttentionRun(q, k, v, options=SUMMARY, tiles=4)
    assert run.path == "chunked"
    assert [tile.q0 for tile in run._tiles] == [0, 256, 512, 768]
    torch.testing.assert_close(run.run().output, attention(q, k, v).output)


@pytest.mark.parametrize("causal", AXES["causal"])
def test_analysis_in_tiles(causal: str) -> None:
    """AnalysisRun in tiles: every strategy's statistics as analyze_scaling's, and the raw
    score variance that of the visible q.k computed in float64 here."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 2, 9, 8, generator=gen)
    k = torch.randn(2, 2, 6, 8, generator=gen)
    kwargs: dict[str, Any] = {"causal": causal, "key_lengths": [6, 4]}
    strategies: list[Any] = ["sqrt_dk", ("tiny", 1e-40)]
    whole = analyze_scaling(q, k, strategies=strategies, **kwargs)
    run = AnalysisRun(q, k, Masks(**kwargs), strategies=strategies, tiles=12, row_quantum=1)
    assert run.tiles_total == 12  # 3 passes (the raw one too) x 2 sequences x 2 row tiles
    tiled = run.run()

    vis = visibility(b=2, h=2, n_q=9, n_kv=6, causal=causal, key_lengths=[6, 4])
    raw = (q.double() @ k.double().transpose(-1, -2))[vis]
    assert tiled.raw_score_variance == pytest.approx(float(raw.var(unbiased=False)), rel=1e-5)
    assert tiled.raw_score_variance == pytest.approx(whole.raw_score_variance, rel=1e-6)
    for got, want in zip(tiled.strategies, whole.strategies, strict=True):
        assert got.name == want.name
        for field in ("score_variance", "entropy", "max_weight", "grad_health"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("run", [AttentionRun, AnalysisRun])
@pytest.mark.parametrize(("option", "value"), [("tiles", 0), ("tiles", 2.5), ("row_quantum", -5)])
def test_tile_options_are_checked(run: Any, option: str, value: object) -> None:
    q = torch.zeros(1, 1, 4, 2)
    args = (q, q) if run is AnalysisRun else (q, q, q)
    with pytest.raises(SdpaError) as caught:
        run(*args, **{option: value})
    assert caught.value.param == option


@pytest.mark.parametrize("causal", AXES["causal"])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize("key_lengths", ["none", "per_head"])
def test_few_queries_many_keys_step_through_key_blocks(
    causal: str, mask: str, key_lengths: str
) -> None:
    """One sequence of 5 queries and 300 keys cannot be cut into enough row tiles: the
    chunked path then stops between key blocks (block_size 16: 19 blocks, 6 steps), and
    the output and row statistics are the float64 reference's."""
    inp = make_inputs(
        causal=causal,
        n_q=5,
        n_kv=300,
        key_lengths=key_lengths,
        mask=mask,
        heads=(4, 2),
        dtype=torch.float32,
        seed=77,
        batch=1,
    )
    options = AttentionOptions(diagnostics="full", block_size=16, path="chunked")
    run = AttentionRun(inp.q, inp.k, inp.v, Masks(**inp.kwargs), options, tiles=6)
    assert run.path == "chunked"
    steps = 1
    while not run.step():
        steps += 1
    # top_left: the 5 rows see only keys 0..4, one block; the others are skipped unseen.
    assert steps == 1 if causal == "top_left" else 1 < steps <= 6
    assert run.tiles_total == run.tiles_done == steps
    result = run.result()
    ref = check_output(inp, result.output)
    rows = reference_rows(ref, scale=1 / math.sqrt(inp.q.shape[-1]), bias=inp.bias)
    assert result.diagnostics is not None
    per_row = result.diagnostics.per_row
    assert per_row is not None
    got = per_row.entropy.double().reshape(rows.visible_keys.shape).numpy()
    np.testing.assert_allclose(got, rows.entropy, rtol=2e-5, atol=2e-5)
    assert result.diagnostics.summary.masked_rows == rows.masked_rows


def test_analysis_of_few_queries_many_keys_steps_through_key_blocks() -> None:
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, 1, 8, 16, generator=gen)
    k = torch.randn(1, 1, 5000, 16, generator=gen)
    whole = analyze_scaling(q, k, causal="bottom_right", block_size=256)
    run = AnalysisRun(q, k, BOTTOM_RIGHT, block_size=256, tiles=40)
    steps = 1
    while not run.step():
        steps += 1
    assert steps >= 30  # 5 passes x 20 key blocks, in about 40 steps
    report = run.result()
    assert report.raw_score_variance == pytest.approx(whole.raw_score_variance, rel=1e-6)
    for got, want in zip(report.strategies, whole.strategies, strict=True):
        assert got.entropy == pytest.approx(want.entropy, rel=1e-6)


def test_a_time_budget_cuts_chunked_steps_wherever_the_estimate_was() -> None:
    """Asked for one tile but given a budget of a millisecond per step, a chunked run stops
    between key blocks whenever the budget is spent (the service's guard against a cost
    model that under-estimates), and the result is the one call's. share_done tells the
    scheduler how far it got, though the steps outnumber the one tile planned."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 64, 16, generator=gen)
    k, v = torch.randn(1, 2, 4096, 16, generator=gen), torch.randn(1, 2, 4096, 16, generator=gen)
    whole = attention(
        q, k, v, diagnostics="summary", causal="bottom_right", block_size=64, path="chunked"
    )
    options = AttentionOptions(diagnostics="summary", block_size=64, path="chunked")
    run = AttentionRun(q, k, v, BOTTOM_RIGHT, options)
    assert run.share_done == 0.0
    shares = []
    while not run.step(budget_s=1e-9):  # one block per step
        shares.append(run.share_done)
    shares.append(run.share_done)
    assert len(shares) == 64  # 4096 keys in blocks of 64, one query tile
    assert shares == [step / 64 for step in range(1, 65)]
    result = run.result()
    torch.testing.assert_close(result.output, whole.output)
    assert result.diagnostics is not None
    assert whole.diagnostics is not None
    assert result.diagnostics.summary == whole.diagnostics.summary  # the same blocks, in order

    analysis = AnalysisRun(q, k, strategies=["sqrt_dk"], block_size=1024)
    shares = []
    while not analysis.step(budget_s=1e-9):
        shares.append(analysis.share_done)
    shares.append(analysis.share_done)
    assert len(shares) == 2 * 4  # two passes (the raw one) of 4 key blocks
    assert shares == [step / 8 for step in range(1, 9)]
    report, want = analysis.result(), analyze_scaling(q, k, strategies=["sqrt_dk"], block_size=1024)
    assert report.raw_score_variance == pytest.approx(want.raw_score_variance, rel=1e-6)


def test_a_run_whose_step_failed_refuses_to_go_on() -> None:
    """A step that raises between key blocks closes the tile's generator: stepping the run
    again must not take the closed generator for a finished tile (a review found every tile
    left then marked done, and result() returning uninitialized rows)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    options = AttentionOptions(diagnostics="summary", block_size=8, path="chunked")
    run = AttentionRun(q, k, v, options=options, tiles=4)
    real_steps = run._chunked_steps

    def failing_steps(*args: Any) -> Any:
        yield from itertools.islice(real_steps(*args), 2)
        raise MemoryError("injected: the third key block's allocation")

    run._chunked_steps = failing_steps  # type: ignore[method-assign]
    assert [run.step(budget_s=1e-9) for _ in range(2)] == [False, False]  # a block each
    with pytest.raises(MemoryError, match="injected"):
        run.step(budget_s=1e-9)
    share = run.share_done
    assert 0 < share < 1
    with pytest.raises(RuntimeError, match="cannot go on"):
        run.step(budget_s=1e-9)
    assert run.share_done == share
    assert not run.done
    with pytest.raises(RuntimeError, match="tiles done"):
        run.result()


# -- the one protocol: TiledRun (tiles.py) --------------------------------------------------

# One request for every run kind: GQA, bottom-right causal with N_q < N_kv, key lengths per
# sequence and a float mask with -inf entries; 40 keys in blocks of 8.
PROTOCOL_INPUTS = make_inputs(
    causal="bottom_right",
    n_q=9,
    n_kv=40,
    key_lengths="per_sequence",
    mask="float",
    heads=(4, 2),
    dtype=torch.float32,
    seed=31,
)
STRATEGIES: list[Any] = ["sqrt_dk", ("tiny", 1e-40)]
RUN_KINDS = ["fused", "dense", "chunked", "chunked_key_splits", "analysis"]


def make_run(kind: str) -> TiledRun[Any]:
    """A run of each kind over PROTOCOL_INPUTS, in tiles (rows cut anywhere)."""
    inp = PROTOCOL_INPUTS
    masks = Masks(**inp.kwargs)
    if kind == "analysis":  # 3 passes (the raw one too) x 2 sequences x 2 row tiles
        return AnalysisRun(
            inp.q, inp.k, masks, strategies=STRATEGIES, block_size=8, tiles=12, row_quantum=1
        )
    options = {
        "fused": AttentionOptions(path="fused"),
        "dense": AttentionOptions(path="dense", return_weights=True, diagnostics="full"),
        "chunked": AttentionOptions(diagnostics="full", block_size=8, path="chunked"),
        "chunked_key_splits": AttentionOptions(diagnostics="full", block_size=8, path="chunked"),
    }[kind]
    # 40 tiles asked of 2 sequences x 9 rows: 18 tiles, each in about 3 parts of key blocks.
    tiles = 40 if kind == "chunked_key_splits" else 5
    return AttentionRun(inp.q, inp.k, inp.v, masks, options, tiles=tiles, row_quantum=1)


def check_run_result(kind: str, result: Any) -> None:
    """The result against independent truths: the float64 reference (attention's output,
    weights, per-row entropy; the analysis' raw score variance) and the untiled call."""
    inp = PROTOCOL_INPUTS
    if kind == "analysis":
        whole = analyze_scaling(inp.q, inp.k, strategies=STRATEGIES, block_size=8, **inp.kwargs)
        raw = reference_attention(inp.q, inp.k, inp.v, inp.visible).raw[inp.visible]  # q.k
        assert result.raw_score_variance == pytest.approx(float(raw.var(unbiased=False)), rel=1e-5)
        assert [s.name for s in result.strategies] == [s.name for s in whole.strategies]
        for got, want in zip(result.strategies, whole.strategies, strict=True):
            for field in ("score_variance", "entropy", "max_weight", "grad_health"):
                assert getattr(got, field) == pytest.approx(
                    getattr(want, field), rel=1e-5, abs=1e-7
                )
        return
    ref = check_output(inp, result.output)
    if kind == "dense":
        assert result.weights is not None
        torch.testing.assert_close(result.weights.double(), ref.weights, atol=1e-5, rtol=1e-5)
    if kind != "fused":
        assert result.diagnostics is not None
        per_row = result.diagnostics.per_row
        assert per_row is not None
        rows = reference_rows(ref, scale=1 / math.sqrt(inp.q.shape[-1]), bias=inp.bias)
        got = per_row.entropy.double().reshape(rows.visible_keys.shape).numpy()
        np.testing.assert_allclose(got, rows.entropy, rtol=2e-5, atol=2e-5)
        assert result.diagnostics.summary.masked_rows == rows.masked_rows


@pytest.mark.parametrize("budget", [None, 1e-9])
@pytest.mark.parametrize("kind", RUN_KINDS)
def test_every_run_kind_keeps_the_protocol(kind: str, budget: float | None) -> None:
    """AttentionRun on each path and AnalysisRun are one kind of thing to a scheduler: no step
    before the first, one more per step(), share_done climbing from 0 to exactly 1, at least
    one step left while not done, tiles_total the steps once done, result() only then (and
    the untiled result). A budget of 1e-9 s makes a run of key blocks take one block a step;
    it does not touch the others."""
    run = make_run(kind)
    assert isinstance(run, TiledRun)
    planned = run.tiles_total
    assert (run.tiles_done, run.share_done, run.done) == (0, 0.0, False)
    with pytest.raises(RuntimeError, match=f"0 of {planned} tiles done"):
        run.result()
    share = 0.0
    while True:
        before = run.tiles_done
        finished = run.step(budget)
        assert run.tiles_done == before + 1
        assert finished is run.done
        assert share <= run.share_done <= 1.0
        share = run.share_done
        if finished:
            break
        assert run.tiles_total >= run.tiles_done + 1
    assert run.share_done == 1.0
    assert run.tiles_total == run.tiles_done
    if budget is None or kind in ("fused", "dense"):
        assert run.tiles_done <= planned  # blocks a mask hides take no step
    if kind in ("fused", "dense", "analysis") and budget is None:
        assert run.tiles_done == planned  # no key splits: one step a tile
    assert run.step(budget) is True  # a done run stays done
    assert run.tiles_done == run.tiles_total
    check_run_result(kind, run.result())


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_path_and_backend_say_what_ran(kind: str) -> None:
    """The compute metric's labels come from the run itself, whatever its kind: an attention
    run's path and backend are its result's; an analysis is "analyze", with no backend."""
    run = make_run(kind)
    result = run.run()
    if kind == "analysis":
        assert (run.path, run.backend) == ("analyze", None)
        return
    assert run.path == result.path == kind.removesuffix("_key_splits")
    assert run.backend == result.backend
    if kind != "fused":
        assert run.backend is None


class RowSums(TiledRun[torch.Tensor]):
    """A third kind of run, on TiledRun alone: pass p gives (p + 1) * q.sum(-1) per row."""

    def __init__(self, q: torch.Tensor, *, tiles: int, passes: int) -> None:
        inputs = prepare_inputs(q, q, q)
        tile_inputs = TileInputs(q4=inputs.q4, k4=inputs.k4, v4=inputs.v4, plan=inputs.plan)
        self.sums: list[torch.Tensor] = []
        super().__init__(
            inputs.spec, tile_inputs, tiles=tiles, row_quantum=None, path_rows=1, passes=passes
        )

    @property
    def path(self) -> str:
        return "row_sums"

    def _compute(self, part: TileInputs, pass_index: int) -> TileOutput:
        return TileOutput((pass_index + 1) * part.q4.sum(-1, keepdim=True))  # [b, H, q, 1]

    def _pass_done(self, pass_index: int, results: TileResults) -> None:
        assert results.output is not None
        self.sums.append(results.output)

    def result(self) -> torch.Tensor:
        self._check_done()
        return torch.stack(self.sums)  # [passes, B, H, N_q, 1]


def test_the_base_class_runs_any_kind_of_tiles() -> None:
    """The grid, the passes, the placing of each tile's rows and the scheduler's numbers live
    in TiledRun, not in attention's or analysis' runs: a run of another kind gets them too,
    and every row of every pass lands where it belongs."""
    q = torch.randn(3, 2, 7, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    run = RowSums(q, tiles=18, passes=2)
    assert run.tiles_total == 2 * 9  # 2 passes x (3 sequences x 3 row tiles)
    assert run.run().equal(torch.stack([p * q.sum(-1, keepdim=True) for p in (1, 2)]))
    assert (run.tiles_done, run.share_done, run.path, run.backend) == (18, 1.0, "row_sums", None)


def test_masks_move_every_tensor_and_keep_the_rest() -> None:
    """Masks.to moves each tensor option once, with the mover given (the service's pinned
    copies), and keeps the causal option and key lengths given as ints; the moved masks mean
    what they meant (attention against the float64 reference)."""
    inp = make_inputs(
        causal="bottom_right", n_q=6, n_kv=9, key_lengths="per_head", mask="bool",
        heads=(2, 2), dtype=torch.float32, seed=40,
    )  # fmt: skip
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 0] = True  # a left-padded second sequence
    masks = Masks(**inp.kwargs, key_padding_mask=kpm)
    assert [id(t) for t in masks.tensors()] == [
        id(inp.kwargs["key_lengths"]),
        id(kpm),
        id(inp.kwargs["attn_mask"]),
    ]
    moved: list[torch.Tensor] = []

    def copy_to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
        moved.append(x)
        return x.clone().to(device)

    copied = masks.to(torch.device("cpu"), move=copy_to)
    assert [id(t) for t in moved] == [id(t) for t in masks.tensors()]
    assert copied.causal == "bottom_right"
    for got, want in zip(copied.tensors(), masks.tensors(), strict=True):
        assert got is not want
        assert torch.equal(got, want)
    vis = inp.visible & ~kpm[:, None, None, :]
    ref = reference_attention(inp.q, inp.k, inp.v, vis)
    result = AttentionRun(inp.q, inp.k, inp.v, copied).run()
    torch.testing.assert_close(result.output.double(), ref.out, atol=1e-5, rtol=1e-5)

    on_meta = masks.to(torch.device("meta"))
    for got, want in zip(on_meta.tensors(), masks.tensors(), strict=True):
        assert (got.device.type, got.shape, got.dtype) == ("meta", want.shape, want.dtype)
    as_ints = Masks(causal=True, key_lengths=[3, 5])
    assert as_ints.to(torch.device("meta"), move=copy_to) == as_ints  # nothing to move
    assert len(moved) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_round_trip_to_cuda() -> None:
    """Masks moved to the GPU give the CPU run's result there, and come back unchanged."""
    inp = PROTOCOL_INPUTS
    masks = Masks(**inp.kwargs)
    cuda = torch.device("cuda")
    on_gpu = masks.to(cuda)
    assert all(t.device.type == "cuda" for t in on_gpu.tensors())
    back = on_gpu.to(torch.device("cpu"))
    for got, want in zip(back.tensors(), masks.tensors(), strict=True):
        assert got.device.type == "cpu"
        assert torch.equal(got, want)
    options = AttentionOptions(diagnostics="summary")
    gpu = AttentionRun(inp.q.cuda(), inp.k.cuda(), inp.v.cuda(), on_gpu, options).run()
    cpu = AttentionRun(inp.q, inp.k, inp.v, masks, options).run()
    torch.testing.assert_close(gpu.output.cpu(), cpu.output, atol=1e-4, rtol=1e-4)
