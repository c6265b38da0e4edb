"""Every path against the float64 reference, across the mask / shape / dtype table."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sdpa_core import (
    DEFAULT_FUSED_TILE_BYTES,
    AttentionOptions,
    Masks,
    attention,
    default_scale,
)
from sdpa_core.attention import AttentionRun, prepare_inputs
from sdpa_core.dense import dense_tile_q
from sdpa_core.fused import SdpaFunction, fused_attention
from tests.core.reference import (
    assert_matches_golden,
    lowp_reference,
    reference_attention,
    reference_rows,
    visibility,
)

AXES: dict[str, tuple[Any, ...]] = {
    "path": ("fused", "dense", "chunked"),
    "causal": ("none", "top_left", "bottom_right"),
    "n_q": (1, 5, 8),
    "n_kv": (1, 2, 8, 9),
    "key_lengths": ("none", "per_sequence", "per_head"),
    "mask": ("none", "bool", "float"),
    "heads": ((2, 2), (4, 2), (4, 1)),  # (H, H_kv): plain, GQA, MQA
    "dtype": (torch.float32, torch.float64, torch.float16, torch.bfloat16),
}


def pairwise_cases(axes: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """A deterministic all-pairs covering: every value of every axis meets every value of
    every other axis (so each path sees every causal mode, size, mask kind, GQA and dtype)."""
    names = list(axes)
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in range(len(axes[a]))
        for vb in range(len(axes[b]))
    }
    cases: list[dict[str, int]] = []
    while uncovered:
        a, va, b, vb = min(uncovered)
        case = {a: va, b: vb}
        for name in names:
            if name in case:
                continue

            def gain(v: int, name: str = name, case: dict[str, int] = case) -> int:
                return sum(
                    (
                        (n, case[n], name, v)
                        if names.index(n) < names.index(name)
                        else (name, v, n, case[n])
                    )
                    in uncovered
                    for n in case
                )

            case[name] = max(range(len(axes[name])), key=gain)
        for x, y in itertools.combinations(names, 2):
            uncovered.discard((x, case[x], y, case[y]))
        cases.append(case)
    return [{n: axes[n][i] for n, i in c.items()} for c in cases]


CASES = pairwise_cases(AXES)


def _case_id(c: dict[str, Any]) -> str:
    return "-".join(
        [
            c["path"],
            c["causal"],
            f"q{c['n_q']}",
            f"k{c['n_kv']}",
            c["key_lengths"],
            c["mask"],
            "h{}x{}".format(*c["heads"]),
            str(c["dtype"]).removeprefix("torch."),
        ]
    )


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict[str, Any]
    visible: torch.Tensor
    bias: torch.Tensor | None


def make_inputs(
    *,
    causal: str,
    n_q: int,
    n_kv: int,
    key_lengths: str,
    mask: str,
    heads: tuple[int, int],
    dtype: torch.dtype,
    seed: int,
    batch: int = 2,
    d: int = 4,
    d_v: int = 3,
) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    h, h_kv = heads
    q = torch.randn(batch, h, n_q, d, generator=gen).to(dtype)
    k = torch.randn(batch, h_kv, n_kv, d, generator=gen).to(dtype)
    v = torch.randn(batch, h_kv, n_kv, d_v, generator=gen).to(dtype)
    kwargs: dict[str, Any] = {"causal": causal}
    kl_list: Any = None
    if key_lengths == "per_sequence":
        kl_list = [rng.randint(0, n_kv) for _ in range(batch)]
        kl_list[0] = max(kl_list[0], 1)
        kwargs["key_lengths"] = torch.tensor(kl_list)
    elif key_lengths == "per_head":
        kl_list = [[rng.randint(0, n_kv) for _ in range(h)] for _ in range(batch)]
        kl_list[0][0] = n_kv
        kwargs["key_lengths"] = torch.tensor(kl_list)
    bias = None
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(batch, 1, n_q, n_kv, generator=gen) < 0.75
        kwargs["attn_mask"] = attn_mask
    elif mask == "float":
        vals = torch.randn(n_q, n_kv, generator=gen)
        vals = vals.masked_fill(torch.rand(n_q, n_kv, generator=gen) < 0.2, -math.inf)
        bias = vals if seed % 2 else vals.to(dtype)  # float32 or q's dtype: both legal
        attn_mask = bias
        kwargs["attn_mask"] = bias
    vis = visibility(
        b=batch, h=h, n_q=n_q, n_kv=n_kv, causal=causal, key_lengths=kl_list, attn_mask=attn_mask
    )
    return Inputs(q, k, v, kwargs, vis, bias)


def check_output(inp: Inputs, output: torch.Tensor, *, scale: float | None = None) -> Any:
    """dtype and shape of q, the float64 reference within tolerance, fully masked rows exactly
    0. Returns the reference."""
    assert output.dtype == inp.q.dtype
    assert output.shape == (*inp.q.shape[:-1], inp.v.shape[-1])
    ref = reference_attention(inp.q, inp.k, inp.v, inp.visible, scale=scale, bias=inp.bias)
    lowp = lowp_reference(inp.q, inp.k, inp.v, inp.visible, scale=scale, bias=inp.bias)
    assert_matches_golden(output, ref.out, lowp)
    empty_rows = ~inp.visible.any(-1)  # [B, H, N_q]
    assert torch.all(output.reshape(ref.out.shape)[empty_rows] == 0)
    return ref


def check_against_reference(
    inp: Inputs, path: str, *, scale: float | None = None, tiles: int = 1
) -> None:
    """Output (every path), weights (dense) and row diagnostics (dense, chunked); tiles > 1
    computes them as an AttentionRun of that many tiles."""
    wants_stats = path != "fused"
    options = AttentionOptions(
        path=path,
        scale=scale,
        return_weights=path == "dense",
        diagnostics="full" if wants_stats else "none",
        block_size=3,
    )
    run = AttentionRun(
        inp.q,
        inp.k,
        inp.v,
        Masks(**inp.kwargs),
        options,
        tiles=tiles,
        row_quantum=1,  # tiny shapes: cut rows anywhere (the default cuts at the path's tile)
    )
    if tiles > 1:
        assert run.tiles_total >= min(tiles, inp.q.shape[0] * inp.q.shape[-2])
    res = run.run()
    assert res.path == path
    ref = check_output(inp, res.output, scale=scale)

    if path == "dense":
        assert res.weights is not None
        assert res.weights.dtype == inp.q.dtype
        w = res.weights.reshape(ref.weights.shape)
        assert torch.all(w[~inp.visible] == 0), "invisible weights must be exactly 0"
        assert_matches_golden(w, ref.weights, None, what="weights")
    if wants_stats:
        c = 1.0 / math.sqrt(inp.q.shape[-1]) if scale is None else scale
        rows = reference_rows(ref, scale=c, bias=inp.bias)
        diag = res.diagnostics
        assert diag is not None
        assert diag.per_row is not None
        tol = 1e-9 if inp.q.dtype == torch.float64 else 2e-5
        pr = diag.per_row
        np.testing.assert_array_equal(
            pr.visible_keys.reshape(rows.visible_keys.shape).numpy(), rows.visible_keys
        )
        for name in ("entropy", "normalized_entropy", "max_weight", "effective_keys"):
            got = getattr(pr, name).double().reshape(rows.visible_keys.shape).numpy()
            np.testing.assert_allclose(got, getattr(rows, name), rtol=tol, atol=tol, err_msg=name)
        lse = pr.lse.double().reshape(rows.lse.shape).numpy()
        np.testing.assert_allclose(lse, rows.lse, rtol=tol, atol=tol, err_msg="lse")
        rs = res.row_stats
        assert rs is not None
        for name in ("grad_health", "jacobian_fro"):
            got = getattr(rs, name).double().reshape(rows.visible_keys.shape).numpy()
            np.testing.assert_allclose(got, getattr(rows, name), rtol=tol, atol=tol, err_msg=name)
        s = diag.summary
        assert s.masked_rows == rows.masked_rows
        big = max(1.0, abs(rows.pooled_mean_raw), rows.pooled_var_raw)
        assert s.score_mean_raw == pytest.approx(rows.pooled_mean_raw, abs=tol * big)
        assert s.score_variance_raw == pytest.approx(rows.pooled_var_raw, rel=tol, abs=tol * big)
        assert s.score_variance_scaled == pytest.approx(
            c * c * rows.pooled_var_raw, rel=tol, abs=tol * big
        )
        assert s.score_abs_max_scaled == pytest.approx(abs(c) * rows.abs_max_raw, rel=tol, abs=tol)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_pairwise_table(case: dict[str, Any]) -> None:
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
    check_against_reference(inp, case["path"])


def test_pairwise_table_covers_every_pair() -> None:
    names = list(AXES)
    for a, b in itertools.combinations(names, 2):
        seen = {(repr(c[a]), repr(c[b])) for c in CASES}
        want = {(repr(x), repr(y)) for x in AXES[a] for y in AXES[b]}
        assert seen == want, (a, b)


GRID = list(itertools.product(AXES["path"], AXES["causal"], AXES["n_q"], AXES["n_kv"]))


@pytest.mark.parametrize(("path", "causal", "n_q", "n_kv"), GRID)
def test_causal_grid_with_every_mask(path: str, causal: str, n_q: int, n_kv: int) -> None:
    """The full causal x N_q x N_kv grid on every path, each with key lengths, a float mask
    and GQA at once (float32)."""
    inp = make_inputs(
        causal=causal,
        n_q=n_q,
        n_kv=n_kv,
        key_lengths="per_sequence",
        mask="float",
        heads=(4, 2),
        dtype=torch.float32,
        seed=1000 + GRID.index((path, causal, n_q, n_kv)),
    )
    check_against_reference(inp, path)


@pytest.mark.parametrize("path", AXES["path"])
@pytest.mark.parametrize("scale", [None, 1.0, 0.01, -0.1])
def test_scales(path: str, scale: float | None) -> None:
    inp = make_inputs(
        causal="bottom_right",
        n_q=5,
        n_kv=9,
        key_lengths="per_head",
        mask="bool",
        heads=(4, 2),
        dtype=torch.float32,
        seed=7,
    )
    check_against_reference(inp, path, scale=scale)


@pytest.mark.parametrize("path", AXES["path"])
@pytest.mark.parametrize("causal", AXES["causal"])
@pytest.mark.parametrize("scale", [-0.1, -2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_negative_scales_with_causal_and_no_other_mask(
    path: str, causal: str, scale: float, dtype: torch.dtype
) -> None:
    """Negative scales are legal (DESIGN.md). Without another mask, top-left causal reaches
    torch's kernel as is_causal, whose CPU flash kernel (torch 2.13.0; it runs when D == D_v)
    returns NaN with a negative scale: the fused path must still match the float64 reference."""
    inp = make_inputs(
        causal=causal, n_q=8, n_kv=8, key_lengths="none", mask="none", heads=(2, 2),
        dtype=dtype, seed=11, d=8, d_v=8,
    )  # fmt: skip
    check_against_reference(inp, path, scale=scale)


@pytest.mark.parametrize("path", AXES["path"])
@pytest.mark.parametrize("shape", [(6, 4), (3, 6, 4), (2, 3, 2, 6, 4)])
def test_leading_dims(path: str, shape: tuple[int, ...]) -> None:
    """2-D (one head), 3-D ([H, N, D]) and 5-D inputs give results shaped like q."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(*shape, generator=gen)
    k = torch.randn(*shape[:-2], 7, 4, generator=gen)
    v = torch.randn(*shape[:-2], 7, 5, generator=gen)
    res = attention(
        q,
        k,
        v,
        causal="bottom_right",
        path=path,
        return_weights=path == "dense",
        diagnostics="none" if path == "fused" else "full",
    )
    assert res.output.shape == (*shape[:-1], 5)
    n_heads_total = math.prod(shape[:-2]) if len(shape) > 2 else 1
    vis = visibility(b=1, h=n_heads_total, n_q=6, n_kv=7, causal="bottom_right")
    ref = reference_attention(
        q.reshape(1, -1, 6, 4), k.reshape(1, -1, 7, 4), v.reshape(1, -1, 7, 5), vis
    )
    assert_matches_golden(res.output, ref.out, None)
    if path != "fused":
        assert res.diagnostics is not None
        assert res.diagnostics.per_row is not None
        assert res.diagnostics.per_row.entropy.shape == shape[:-1]
        assert res.diagnostics.per_head.entropy.shape == shape[:-2]
    if path == "dense":
        assert res.weights is not None
        assert res.weights.shape == (*shape[:-1], 7)


@pytest.mark.parametrize("path", AXES["path"])
def test_key_padding_mask_polarity(path: str) -> None:
    """key_padding_mask True = padding (MHA convention), per sequence and per head."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 2, 4, 4, generator=gen) for _ in range(3))
    per_seq = torch.tensor([[False, False, True, True], [False, True, False, False]])
    per_head = torch.rand(2, 2, 4, generator=gen) < 0.4
    for kpm in (per_seq, per_head):
        vis = visibility(b=2, h=2, n_q=4, n_kv=4, causal="none", key_padding_mask=kpm)
        ref = reference_attention(q, k, v, vis)
        res = attention(
            q,
            k,
            v,
            key_padding_mask=kpm,
            path=path,
            diagnostics="none" if path == "fused" else "summary",
        )
        assert_matches_golden(res.output, ref.out, None)


def test_mask_combination_is_boolean_in_half_precision() -> None:
    """Two masks that each hide a key combine by AND: no finfo.min + finfo.min overflow."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 3, 8, generator=gen, dtype=torch.float16) for _ in range(3))
    bias = torch.zeros(3, 3, dtype=torch.float16)
    bias[:, 2] = torch.finfo(torch.float16).min  # a finite "mask": still visible by DESIGN
    kpm = torch.tensor([[False, True, False]])
    for path in AXES["path"]:
        res = attention(
            q,
            k,
            v,
            attn_mask=bias,
            key_padding_mask=kpm,
            path=path,
            diagnostics="none" if path == "fused" else "summary",
        )
        assert torch.isfinite(res.output).all()
        vis = visibility(b=1, h=1, n_q=3, n_kv=3, causal="none", key_padding_mask=kpm)
        ref = reference_attention(q, k, v, vis, bias=bias)
        assert_matches_golden(res.output, ref.out, lowp_reference(q, k, v, vis, bias=bias))


def test_fused_records_backend() -> None:
    q = torch.randn(1, 2, 8, 16)
    res = attention(q, q, q)
    assert res.path == "fused"
    assert res.backend == "flash"  # CPU: 4-D, dropout-free inputs take the flash kernel
    assert attention(q, q, q, path="dense").backend is None


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_dense_tiles_over_queries_with_long_keys(heads: tuple[int, int]) -> None:
    """Long rows make the dense path tile over queries and write each tile into a strided
    view of the weight matrix (the GQA product then runs on that view)."""
    h, h_kv = heads
    n_q, n_kv = 160, 4096  # 2^20-element tiles: 64 or 128 query rows each
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, h, n_q, 8, generator=gen)
    k = torch.randn(1, h_kv, n_kv, 8, generator=gen)
    assert dense_tile_q(q, k) < n_q  # the premise: more than one tile
    v = torch.randn(1, h_kv, n_kv, 3, generator=gen)
    kl = torch.tensor([[4000, 100, 4096, 5][:h]])
    res = attention(
        q, k, v, key_lengths=kl, causal="bottom_right", return_weights=True, diagnostics="full"
    )
    assert res.path == "dense"
    keys = torch.arange(n_kv)
    rows = torch.arange(n_q)[:, None]
    # explicit broadcasting: key j visible to row i of head h iff j < length_h and
    # j <= i + n_kv - n_q
    vis = (keys < kl[0][:, None, None]) & (keys <= rows + n_kv - n_q)  # [H, N_q, N_kv]
    ref = reference_attention(q, k, v, vis[None])
    assert_matches_golden(res.output, ref.out, None)
    assert res.weights is not None
    assert_matches_golden(res.weights, ref.weights, None, what="weights")
    assert torch.all(res.weights[0][~vis] == 0)
    chunk = attention(q, k, v, key_lengths=kl, causal="bottom_right", diagnostics="full")
    assert res.row_stats is not None
    assert chunk.row_stats is not None
    for name, val in res.row_stats.as_dict().items():
        torch.testing.assert_close(chunk.row_stats.as_dict()[name], val, rtol=1e-4, atol=1e-5)


def fused_with_budget(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    tile_bytes: int,
    sdpa: SdpaFunction = scaled_dot_product_attention,
    **options: Any,
) -> tuple[torch.Tensor, str | None]:
    """The fused path run directly with a tile budget (and a kernel to call): the output
    shaped as attention()'s and the backend name."""
    inputs = prepare_inputs(q, k, v, Masks(**options))
    out4, backend = fused_attention(
        inputs.q4, inputs.k4, inputs.v4, inputs.plan,
        scale=default_scale(inputs.spec.d), tile_bytes=tile_bytes, sdpa=sdpa,
    )  # fmt: skip
    return out4.reshape(*inputs.spec.row_shape, inputs.spec.d_v), backend


@pytest.mark.parametrize("budget", [1, 3000])
@pytest.mark.parametrize(
    ("causal", "n_q"), [("bottom_right", 7), ("bottom_right", 13), ("top_left", 8)]
)
@pytest.mark.parametrize("mask", ["bool", "float"])
def test_fused_runs_large_masks_in_query_tiles(
    budget: int, causal: str, n_q: int, mask: str
) -> None:
    """Past the budget the fused path runs tiles of query rows (1 row, or 2 and a short last
    tile: GQA with a mask runs on torch's math kernel here, 1298 bytes a row): every row still
    equals the float64 reference, fully masked rows (bottom-right causal with N_q > N_kv, zero
    key lengths) are exactly 0."""
    inp = make_inputs(
        causal=causal,
        n_q=n_q,
        n_kv=11,
        key_lengths="per_sequence",
        mask=mask,
        heads=(4, 2),
        dtype=torch.float32,
        seed=n_q,
    )
    tiled, tiled_backend = fused_with_budget(inp.q, inp.k, inp.v, tile_bytes=budget, **inp.kwargs)
    check_output(inp, tiled)
    whole = attention(inp.q, inp.k, inp.v, **inp.kwargs)
    assert whole.path == "fused"
    assert tiled_backend is not None
    assert tiled_backend == whole.backend  # the first tile's backend is the one reported
    torch.testing.assert_close(tiled, whole.output, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize(
    ("heads", "d_v", "kernel"),
    [
        (1, 8, "flash"),  # the mask alone grows: 642 MB before tiles (measured)
        (4, 16, "math"),  # D_v != D: the math kernel holds the scores too (5250 MB before)
    ],
)
def test_fused_memory_stays_bounded(tmp_path: Path, heads: int, d_v: int, kernel: str) -> None:
    """Bottom-right causal with key lengths on N_q = 8192, N_kv = 16384 (inputs of a few MB):
    the peak memory stays near the 64 MiB budget. Peak RSS of a fresh interpreter, after a
    warm-up."""
    script = tmp_path / "peak.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import resource, torch
            from sdpa_core import attention
            q = torch.randn(1, {heads}, 8192, 8)
            k, v = torch.randn(1, {heads}, 16384, 8), torch.randn(1, {heads}, 16384, {d_v})
            attention(q[:, :, :64], k[:, :, :128], v[:, :, :128], causal="bottom_right")
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            res = attention(q, k, v, causal="bottom_right", key_lengths=[16000])
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            assert res.path == "fused" and res.output.isfinite().all()
            print((after - before) // 1024, res.backend)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True
    )
    grown, backend = done.stdout.split()
    assert backend == kernel
    assert int(grown) < 200, f"peak memory grew by {grown} MB"


# Hand-computed bytes per query row, inputs [2, 4, 7, D] x [2, 4, 11, D] float32:
# a mask over causal and key lengths: 2 sequences x 1 head x 11 keys x (3 + 2 x 4) = 242;
# a float bias [2, 4, 7, 1] (no key dimension): 2 x 4 x 1 x 11 = 88;
# the math kernel's scores (D_v != D): 2 x 4 heads x 11 keys x 4 bytes x 3 copies = 1056.
_CAUSAL_PADDED = {"causal": "bottom_right", "key_lengths": [9, 4]}


@pytest.mark.parametrize(
    ("options", "d_v", "budget", "calls"),
    [
        # Padding alone is [B, 1, 1, N_kv]: nothing grows with N_q, one call at any budget.
        ({"key_lengths": [9, 4]}, 8, 1, 1),
        # Top-left causal on a kernel that takes is_causal: no mask at all, one call too.
        ({"causal": True}, 8, 1, 1),
        (_CAUSAL_PADDED, 8, 3 * 242, 3),  # rows 0-2, 3-5, 6
        (_CAUSAL_PADDED, 8, DEFAULT_FUSED_TILE_BYTES, 1),
        # A bias without a key dimension is never widened to N_kv: 7 rows fit 7 x 88 bytes.
        ({"attn_mask": "bias_per_query"}, 8, 7 * 88, 1),
        # No mask, but the math kernel (D_v != D): its scores set the tiles, and tiles of a
        # top-left causal mask carry their own rows of it (is_causal would be misaligned).
        ({}, 4, 3 * 1056, 3),
        ({"causal": True}, 4, 3 * 1056 + 3 * 242, 3),
        ({}, 4, 7 * 1056, 1),
    ],
)
def test_fused_tiles_follow_what_grows_with_the_queries(
    options: dict[str, Any],
    d_v: int,
    budget: int,
    calls: int,
) -> None:
    """How many SDPA calls the fused path makes for a budget: one per tile of query rows, a
    single one when the mask has no query dimension; each result equals the untiled call and
    the float64 reference."""
    seen: list[int] = []

    def counted(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(q.shape[-2])
        return scaled_dot_product_attention(q, *args, **kwargs)

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 7, 8, generator=gen)
    k, v = torch.randn(2, 4, 11, 8, generator=gen), torch.randn(2, 4, 11, d_v, generator=gen)
    if options.get("attn_mask") == "bias_per_query":
        options = {"attn_mask": torch.randn(2, 4, 7, 1, generator=gen)}
    tiled, backend = fused_with_budget(q, k, v, tile_bytes=budget, sdpa=counted, **options)
    assert len(seen) == calls
    assert sum(seen) == 7  # every query row exactly once
    whole = attention(q, k, v, **options)
    assert whole.path == "fused"
    torch.testing.assert_close(tiled, whole.output)
    assert backend == whole.backend
    causal = options.get("causal", False)
    kl = options.get("key_lengths")
    bias = options.get("attn_mask")
    vis = visibility(
        b=2, h=4, n_q=7, n_kv=11, causal={True: "top_left"}.get(causal, causal or "none"),
        key_lengths=kl, attn_mask=bias,
    )  # fmt: skip
    ref = reference_attention(q, k, v, vis, bias=bias)
    assert_matches_golden(tiled, ref.out, None)
