"""Path "flash" through attention(): the float64 reference, the chunked path, path choice.

Every test runs on each flash kernel this process has: the CPU kernel (built here by
cpu_flash.build(), as a service's warm-up builds it) and Triton's. Triton runs CPU tensors only
under its interpreter, which it reads once, at import (TRITON_INTERPRET=1): a process without
it runs the Triton cases in a child pytest with it set
(test_triton_kernel_through_attention_under_the_interpreter), on the tiny shapes the
interpreter's speed allows. The kernels' own tests (tests/core/test_cpu_flash.py,
test_triton_flash.py) call flash_tile directly; these go through attention(): the mask plan
turned into the contract's arguments, tiles, the summary.
"""

from __future__ import annotations

import decimal
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdpa_core import (
    AttentionOptions,
    AttentionRun,
    Masks,
    RowStats,
    SdpaError,
    attention,
    choose_path,
    flash_kernels,
    validate_inputs,
)
from sdpa_core.kernels import (
    CPU_KERNEL,
    TRITON_KERNEL,
    cpu_flash,
    triton_interpreted,
    use_kernel,
)
from tests.core.reference import (
    assert_matches_golden,
    lowp_reference,
    reference_attention,
    reference_rows,
    visibility,
)

ROOT = Path(__file__).resolve().parents[2]
KERNELS = (CPU_KERNEL, TRITON_KERNEL)
# The child pytest that runs the Triton cases under the interpreter sets this, so that it does
# not start a child of its own.
_CHILD = "SDPA_FLASH_PATH_CHILD"


def _state(name: str) -> tuple[bool, str]:
    state = {s.name: s for s in flash_kernels()}[name]
    return state.available and (name != TRITON_KERNEL or state.device == "cpu"), state.reason


@pytest.fixture(scope="module")
def built() -> None:
    """The CPU kernel, built as the service's warm-up builds it (cpu_flash.build(): the prebuilt
    or cached library, compiled once on a cold cache; a no-op once loaded; not in the
    interpreter's child, which runs the Triton cases alone). Not compile_kernels(), which also
    compiles the chunked path's statistics kernel (seconds of inductor, tests/core/
    test_stats_kernel.py tests it), which no test here needs."""
    if not os.environ.get(_CHILD):
        cpu_flash.build()


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest, built: None) -> Iterator[str]:
    """Each flash kernel that runs CPU tensors in this process, the only one the path takes."""
    name: str = request.param
    ok, why = _state(name)
    if not ok:
        pytest.skip(f"{name}: {why}")
    with use_kernel(name):
        yield name


def _small(kernel: str) -> bool:
    """Triton's interpreter costs about 500x torch's kernels: tiny shapes only."""
    return kernel == TRITON_KERNEL


# ---- the float64 reference, every mask, dtype, scale and shape class ----------------------


def _case(name: str, seed: int) -> dict[str, Any]:
    """q, k, v (float64, cast per dtype by the test), attention() kwargs and the reference's
    visibility arguments, for one named case."""
    gen = torch.Generator().manual_seed(seed)
    b, h, h_kv, n_q, n_kv, d, d_v = 2, 4, 2, 11, 19, 8, 6
    kw: dict[str, Any] = {}
    vis_kw: dict[str, Any] = {}
    if name == "mha_same_n":
        h_kv, n_q, n_kv, d_v = 4, 16, 16, 8
    if name == "mqa_d_v_wider":
        h_kv, d_v = 1, 12
    q = torch.randn(b, h, n_q, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, h_kv, n_kv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h_kv, n_kv, d_v, generator=gen, dtype=torch.float64)
    causal = "none"
    if name in ("top_left", "combined"):
        kw["causal"] = causal = "top_left"
    if name == "bottom_right":
        kw["causal"] = causal = "bottom_right"
    if name in ("key_lengths", "combined"):
        lengths = [[19, 3, 0, 11], [1, 19, 7, 18]]  # per head, with a fully masked head
        kw["key_lengths"] = torch.tensor(lengths)
        vis_kw["key_lengths"] = lengths
    if name == "key_lengths_per_sequence":
        kw["key_lengths"] = torch.tensor([5, 19])
        vis_kw["key_lengths"] = [5, 19]
    if name in ("key_padding", "combined"):
        pad = torch.zeros(b, n_kv, dtype=torch.bool)
        pad[0, :3] = True  # left padding: the sink is keys 3..6
        pad[1, 5:9] = True
        kw["key_padding_mask"] = pad
        vis_kw["key_padding_mask"] = pad
    if name == "bool_mask":
        mask = torch.rand(n_q, n_kv, generator=gen) < 0.6
        mask[4] = False  # a fully masked row
        kw["attn_mask"] = mask
    if name in ("float_mask", "combined"):
        bias = torch.randn(h, n_q, n_kv, generator=gen, dtype=torch.float64)
        bias[bias > 1.0] = -math.inf
        kw["attn_mask"] = bias
    vis = visibility(
        b=b,
        h=h,
        n_q=n_q,
        n_kv=n_kv,
        causal=causal,
        attn_mask=kw.get("attn_mask"),
        **vis_kw,
    )
    return {"q": q, "k": k, "v": v, "kw": kw, "vis": vis}


CASES = (
    "no_mask",
    "mha_same_n",
    "mqa_d_v_wider",
    "top_left",
    "bottom_right",
    "key_lengths",
    "key_lengths_per_sequence",
    "key_padding",
    "bool_mask",
    "float_mask",
    "combined",
)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# None: 1/sqrt(D). Negative, tiny (every row near uniform) and huge (near one-hot rows).
SCALES = (None, -0.7, 1e-7, 40.0)


def _sink_reference(weights: torch.Tensor, vis_kw: dict[str, Any], sink_tokens: int) -> Any:
    """float64 weight on each row's first sink_tokens keys that are not key padding."""
    pad = vis_kw.get("key_padding_mask")
    n_kv = weights.shape[-1]
    if pad is None:
        return weights[..., :sink_tokens].sum(-1).numpy()
    rank = (~pad).to(torch.int64).cumsum(-1)
    sink = (~pad) & (rank <= sink_tokens)  # [B, N_kv]
    return (weights * sink[:, None, None, :n_kv]).sum(-1).numpy()


def _close(got: torch.Tensor, want: Any, *, rtol: float, atol: float, what: str) -> None:
    g = got.double().numpy()
    w = np.asarray(want, dtype=np.float64)
    assert g.shape == w.shape, what
    assert not np.isnan(g).any(), f"{what}: NaN"
    both_inf = np.isinf(w) & (g == w)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both are -inf: set to 0 below
        err = np.where(both_inf, 0.0, np.abs(g - w))
    bound = atol + rtol * np.abs(np.where(np.isinf(w), 0.0, w))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{what}: {g[worst]} vs {w[worst]} at {worst}"


def _check_against_reference(
    res: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: dict[str, Any], scale: Any
) -> None:
    """Output within the house's golden bound; every RowStats field and summary scalar
    against the float64 reference computed from the inputs as the kernel saw them."""
    kw, vis = case["kw"], case["vis"]
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    bias = kw.get("attn_mask")
    bias = None if bias is None or bias.dtype == torch.bool else bias
    ref = reference_attention(q, k, v, vis, scale=s, bias=bias)
    low = lowp_reference(q, k, v, vis, scale=s, bias=None if bias is None else bias.to(q.dtype))
    assert_matches_golden(res.output, ref.out, low, what="output")
    rows = reference_rows(ref, scale=s, bias=bias)
    rs = res.row_stats
    assert torch.equal(rs.visible_keys, torch.as_tensor(rows.visible_keys))
    assert rs.entropy.dtype == torch.float32
    # Statistics accumulate in float32 from the inputs' own values: float32 round-off
    # relative to each value, and relative to the scores' size for lse.
    tol = {"rtol": 2e-4, "atol": 2e-6}
    _close(rs.entropy, rows.entropy, **tol, what="entropy")
    _close(rs.max_weight, rows.max_weight, **tol, what="max_weight")
    _close(rs.grad_health, rows.grad_health, **tol, what="grad_health")
    _close(rs.jacobian_fro, rows.jacobian_fro, **tol, what="jacobian_fro")
    score_size = float(np.abs(ref.raw.numpy()).max()) * abs(s) + 1.0
    _close(rs.lse, rows.lse, rtol=2e-5, atol=2e-5 * score_size, what="lse")
    sink = _sink_reference(ref.weights, {"key_padding_mask": kw.get("key_padding_mask")}, 4)
    _close(rs.sink_share, sink, **tol, what="sink_share")
    raw = ref.raw.numpy()
    v_np = vis.numpy()
    cnt = v_np.sum(-1)
    mean = np.where(cnt > 0, np.where(v_np, raw, 0).sum(-1) / np.maximum(cnt, 1), 0.0)
    m2 = np.where(v_np, (raw - mean[..., None]) ** 2, 0).sum(-1)
    raw_size = float(np.abs(raw).max())
    _close(rs.score_mean_raw, mean, rtol=1e-4, atol=1e-5 * raw_size, what="score_mean_raw")
    _close(rs.score_m2_raw, m2, rtol=1e-4, atol=1e-5 * raw_size**2, what="score_m2_raw")
    abs_max = np.where(v_np, np.abs(raw), 0).max(-1)
    _close(rs.score_abs_max_raw, abs_max, rtol=1e-5, atol=1e-6, what="score_abs_max_raw")
    summary = res.diagnostics.summary
    assert summary.masked_rows == rows.masked_rows
    active = rows.visible_keys > 0
    for name in ("entropy", "max_weight", "grad_health", "jacobian_fro"):
        want = float(getattr(rows, name)[active].mean()) if active.any() else 0.0
        assert getattr(summary, name) == pytest.approx(want, rel=2e-4, abs=2e-6), name
    assert summary.score_mean_raw == pytest.approx(rows.pooled_mean_raw, rel=1e-4, abs=1e-5)
    assert summary.score_variance_raw == pytest.approx(rows.pooled_var_raw, rel=1e-4, abs=1e-6)
    assert summary.score_abs_max_scaled == pytest.approx(abs(s) * rows.abs_max_raw, rel=1e-5)


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"scale={s}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_flash_matches_the_float64_reference(
    kernel: str, name: str, dtype: torch.dtype, scale: float | None
) -> None:
    """Every mask option (both causal alignments, key lengths per sequence and per head,
    left key padding, bool and float masks, all combined), GQA / MQA, N_q != N_kv,
    D_v != D, fp32 / fp16 / bf16 and default, negative, tiny and huge scales."""
    if _small(kernel) and scale not in (None, 40.0) and name not in ("combined", "no_mask"):
        pytest.skip("the interpreter runs every mask at two scales; all four on two cases")
    case = _case(name, seed=CASES.index(name))
    q, k, v = (case[x].to(dtype) for x in "qkv")
    kw = dict(case["kw"])
    if isinstance(kw.get("attn_mask"), torch.Tensor) and kw["attn_mask"].is_floating_point():
        kw["attn_mask"] = kw["attn_mask"].to(dtype)
        case = {**case, "kw": kw}
    res = attention(q, k, v, diagnostics="full", scale=scale, **kw)
    assert res.path == "flash"
    assert res.backend == kernel
    assert res.output.dtype == dtype
    _check_against_reference(res, q, k, v, case, scale)


@pytest.mark.parametrize("shape", [(7, 5), (3, 7, 5), (2, 3, 2, 7, 5)], ids=str)
def test_flash_takes_every_rank(kernel: str, shape: tuple[int, ...]) -> None:
    """2-D (one head), 3-D and 5-D inputs come back in their own shapes."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(*shape, generator=gen)
    k = torch.randn(*shape[:-2], 9, 5, generator=gen)
    res = attention(q, k, k, diagnostics="full", causal="bottom_right")
    assert res.path == "flash"
    assert res.output.shape == shape
    assert res.row_stats.entropy.shape == shape[:-1]
    chunk = attention(q, k, k, diagnostics="full", causal="bottom_right", path="chunked")
    torch.testing.assert_close(res.output, chunk.output, rtol=1e-5, atol=1e-5)


# ---- against the chunked path: every RowStats field and summary scalar ---------------------


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    n_q = draw(st.integers(1, 9))
    n_kv = draw(st.integers(1, 21))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    std = draw(st.sampled_from([0.1, 1.0, 4.0]))
    q = torch.randn(2, h, n_q, 4, generator=gen) * std
    k = torch.randn(2, h_kv, n_kv, 4, generator=gen) * std
    v = torch.randn(2, h_kv, n_kv, 3, generator=gen)
    kw: dict[str, Any] = {"causal": draw(st.sampled_from([False, "top_left", "bottom_right"]))}
    if draw(st.booleans()):
        kw["key_lengths"] = torch.tensor([draw(st.integers(0, n_kv)) for _ in range(2)])
    if draw(st.booleans()):
        kw["key_padding_mask"] = torch.rand(2, n_kv, generator=gen) < 0.3
    mask = draw(st.sampled_from(["none", "bool", "float"]))
    if mask == "bool":
        kw["attn_mask"] = torch.rand(n_q, n_kv, generator=gen) < 0.7
    elif mask == "float":
        bias = torch.randn(h, n_q, n_kv, generator=gen)
        kw["attn_mask"] = bias.masked_fill(bias > 1.2, -math.inf)
    kw["scale"] = draw(st.sampled_from([None, 1.0, -0.5, 1e-6, 25.0]))
    kw["sink_tokens"] = draw(st.integers(0, 5))
    return {"q": q, "k": k, "v": v, "kw": kw}


def _flash_equals_chunked(problem: dict[str, Any]) -> None:
    q, k, v, kw = problem["q"], problem["k"], problem["v"], problem["kw"]
    flash = attention(q, k, v, diagnostics="full", **kw)
    chunk = attention(q, k, v, diagnostics="full", path="chunked", **kw)
    assert flash.path == "flash"
    torch.testing.assert_close(flash.output, chunk.output, rtol=1e-5, atol=2e-5)
    for f in fields(RowStats):
        x, y = getattr(flash.row_stats, f.name), getattr(chunk.row_stats, f.name)
        if f.name == "visible_keys":
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=f"{f.name} differs")
    for name, val in chunk.diagnostics.summary.as_dict().items():
        assert flash.diagnostics.summary.as_dict()[name] == pytest.approx(val, rel=1e-4, abs=1e-5)
    for name, val in chunk.diagnostics.per_head.as_dict().items():
        got = flash.diagnostics.per_head.as_dict()[name]
        torch.testing.assert_close(got, val, rtol=1e-4, atol=1e-5, msg=name)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(problem=problems())
def test_property_flash_equals_chunked(kernel: str, problem: dict[str, Any]) -> None:
    if _small(kernel) and problem["q"].shape[2] * problem["k"].shape[2] > 100:
        return  # the interpreter's share of the examples: the smaller ones
    _flash_equals_chunked(problem)


# ---- entropy near 0: the cancellation case -------------------------------------------------


def _exact_row(scores: list[float]) -> dict[str, float]:
    """One row's statistics from their definitions in 60-digit decimal arithmetic: the
    float64 reference itself cancels once 1 - p_max < 1e-16 (its p log p, p (1 - p) and
    Jacobian entries of the max are then 0), so the near-one-hot rows need more digits."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        top = max(scores)
        e = [(decimal.Decimal(x) - decimal.Decimal(top)).exp() for x in scores]
        total = sum(e)
        p = [x / total for x in e]
        s2 = sum(x * x for x in p)
        s4 = sum(x**4 for x in p)
        diag = sum((x - x * x) ** 2 for x in p)
        return {
            "entropy": float(-sum(x * x.ln() for x in p if x > 0)),
            "one_minus_max": float(1 - max(p)),
            "grad_health": float(sum(x * (1 - x) for x in p) / len(p)),
            "jacobian_fro": float((diag + s2 * s2 - s4).sqrt()),
            "sink_share": float(sum(p[:4])),
        }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gap", [8.0, 16.0, 30.0, 60.0])
def test_entropy_near_zero_on_one_hot_rows(kernel: str, dtype: torch.dtype, gap: float) -> None:
    """Rows whose max key leads the others by `gap` (scaled): p_max -> 1, entropy ~ n gap
    e^-gap. 1 - sum p^2 and the Jacobian's S2 - 2 S3 + S2^2 cancel in float32 unless the
    kernel keeps the sums that leave the max out. The scores are small integers, exact in
    every dtype, so the exact reference sees the very scores the kernel does."""
    n_kv, n_q = 37, 3
    q = torch.zeros(1, 2, n_q, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, n_kv, 16)
    k[0, :, :, 0] = torch.arange(n_kv) % 3  # the others' scores: 0, 1, 2
    k[0, 0, 20, 0] = 2.0 + gap  # head 0: one key ahead by gap, in a middle block
    k[0, 1, 3, 0] = 2.0 + gap  # head 1: near the start (inside the sink)
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(1, 2, n_kv, 4).to(dtype)
    res = attention(q, k, v, diagnostics="full", scale=1.0)
    assert res.path == "flash"
    rs = res.row_stats
    for head in range(2):
        want = _exact_row(k[0, head, :, 0].double().tolist())
        for row in range(n_q):
            for name in ("entropy", "grad_health", "jacobian_fro"):
                got = float(getattr(rs, name)[0, head, row])
                # Relative accuracy down to 1e-26: no cancellation anywhere.
                assert got == pytest.approx(want[name], rel=1e-3), (name, head, row)
            got_rest = 1.0 - float(rs.max_weight[0, head, row])
            assert got_rest == pytest.approx(want["one_minus_max"], rel=1e-3, abs=6e-8)
            got_sink = float(rs.sink_share[0, head, row])
            assert got_sink == pytest.approx(want["sink_share"], rel=1e-5, abs=1e-7)


# ---- O(N) memory ----------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, torch
    from sdpa_core import attention, compile_kernels
    from sdpa_core.kernels import use_kernel
    torch.set_num_threads(1)
    compile_kernels()
    n, d = 16384, 32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, generator=gen) for _ in range(3))
    def status(field):
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith(field + ":"))
    with use_kernel("cpu_flash"):
        attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], diagnostics="summary")  # warm
        try:  # reset the peak RSS (VmHWM) to the current RSS: compiling peaked higher
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            peak, before = "VmHWM", status("VmRSS")
        except OSError:  # refused: ru_maxrss, which an earlier peak may hide
            peak, before = None, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        res = attention(q, k, v, diagnostics="summary", causal=True)
        after = status(peak) if peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"path": res.path, "growth_kib": after - before, "peak": peak,
                      "masked_rows": res.diagnostics.summary.masked_rows,
                      "entropy": res.diagnostics.summary.entropy}))
    """
)


@pytest.mark.slow
def test_16384_keys_with_summary_diagnostics_in_linear_memory(built: None) -> None:
    """[1, 2, 16384, 32] causal with summary diagnostics: the peak RSS (VmHWM, reset through
    /proc/self/clear_refs once the inputs exist and the kernels are built; ru_maxrss where
    that is refused) grows by at most 256 MiB over the RSS before the call; a score matrix
    would be 2 GiB in float32. Measured on the CPU kernel (the interpreter would take hours)."""
    ok, why = _state(CPU_KERNEL)
    if not ok:
        pytest.skip(f"{CPU_KERNEL}: {why}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["path"] == "flash"
    assert got["masked_rows"] == 0
    # Causal rows see 1 ... 16384 keys: the mean entropy lies between 0 and log(16384).
    assert 0.0 < got["entropy"] < math.log(16384)
    assert got["growth_kib"] <= 256 * 1024, got


# ---- path choice, backends, forced-path errors ---------------------------------------------


def test_path_choice_rules(kernel: str) -> None:
    q = torch.randn(1, 2, 6, 4)
    assert attention(q, q, q, diagnostics="summary").path == "flash"
    assert attention(q, q, q, diagnostics="full", memory_budget_bytes=1).path == "flash"
    assert attention(q, q, q).path == "fused"
    assert attention(q, q, q, return_weights=True, diagnostics="summary").path == "dense"
    # float64 never reaches a kernel: the chunked path serves it.
    q64 = q.double()
    assert attention(q64, q64, q64, diagnostics="summary").path == "chunked"
    spec = validate_inputs(q, q, q)
    common = {"return_weights": False, "diagnostics": "summary", "memory_budget_bytes": None}
    assert choose_path(spec, path=None, device=q.device, **common) == "flash"
    # Without a device there is no kernel to ask: the chunked path, as before.
    assert choose_path(spec, path=None, **common) == "chunked"
    # Forced "flash" without diagnostics: the output alone.
    res = attention(q, q, q, path="flash")
    assert res.path == "flash"
    assert res.row_stats is None
    torch.testing.assert_close(res.output, attention(q, q, q).output, rtol=1e-5, atol=1e-6)


def test_backend_names_the_kernel(kernel: str) -> None:
    q = torch.randn(1, 2, 6, 4)
    assert attention(q, q, q, diagnostics="summary").backend == kernel
    assert attention(q, q, q, diagnostics="summary", path="chunked").backend is None
    run = AttentionRun(q, q, q, Masks(), AttentionOptions(diagnostics="summary"), tiles=3)
    assert run.backend == kernel  # known before any tile runs


def test_forced_flash_that_cannot_run_says_why(built: None) -> None:
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(SdpaError) as info:
        attention(q, q, q, path="flash", return_weights=True)
    assert info.value.param == "path"
    assert "weights" in str(info.value)
    q64 = q.double()
    with pytest.raises(SdpaError) as info:
        attention(q64, q64, q64, path="flash", diagnostics="summary")
    assert info.value.param == "path"
    assert "float64" in str(info.value)
    if not triton_interpreted():
        # Triton takes CPU tensors only under its interpreter.
        with use_kernel(TRITON_KERNEL), pytest.raises(SdpaError) as info:
            attention(q, q, q, path="flash", diagnostics="summary")
        assert info.value.param == "path"
        assert "TRITON_INTERPRET" in str(info.value)
        with use_kernel(TRITON_KERNEL):
            assert attention(q, q, q, diagnostics="summary").path == "chunked"


def test_flash_kernels_say_what_runs_and_why_not(built: None) -> None:
    states = {s.name: s for s in flash_kernels()}
    assert set(states) == set(KERNELS)
    for state in states.values():
        assert state.available == (state.reason == "")
        assert state.device in ("cpu", "cuda")
    assert states[CPU_KERNEL].device == "cpu"


# ---- tiles ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiles", [2, 5])
def test_flash_tiles_equal_one_call(kernel: str, tiles: int) -> None:
    """A run of several tiles (one kernel call each, its own rows of the mask plan and its
    causal alignment) equals the untiled call."""
    case = _case("combined", seed=11)
    q, k, v = (case[x].float() for x in "qkv")
    kw = dict(case["kw"])
    kw["attn_mask"] = kw["attn_mask"].float()
    masks = Masks(**{n: kw[n] for n in ("causal", "key_lengths", "key_padding_mask", "attn_mask")})
    options = AttentionOptions(diagnostics="full")
    whole = AttentionRun(q, k, v, masks, options).run()
    run = AttentionRun(q, k, v, masks, options, tiles=tiles, row_quantum=2)
    assert run.path == "flash"
    assert run.tiles_total >= tiles  # the grid splits the batch first, then each chunk's rows
    tiled = run.run()
    torch.testing.assert_close(tiled.output, whole.output, rtol=1e-6, atol=1e-6)
    for f in fields(RowStats):
        x, y = getattr(tiled.row_stats, f.name), getattr(whole.row_stats, f.name)
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=f.name)


def test_flash_with_nonfinite_inputs_poisons_the_rows_that_see_them(kernel: str) -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 4, generator=gen)
    k = torch.randn(1, 2, 7, 4, generator=gen)
    k[0, 0, 4, 1] = math.nan  # seen by causal rows 4... of head 0 only (bottom_right: 2+)
    flash = attention(q, k, k, diagnostics="full", causal="bottom_right", allow_nonfinite=True)
    chunk = attention(
        q, k, k, diagnostics="full", causal="bottom_right", allow_nonfinite=True, path="chunked"
    )
    assert flash.path == "flash"
    torch.testing.assert_close(flash.output, chunk.output, equal_nan=True, rtol=1e-5, atol=1e-5)
    assert torch.isnan(flash.output[0, 0, 2:]).all()
    assert torch.isfinite(flash.output[0, 0, :2]).all()
    assert torch.isfinite(flash.output[0, 1]).all()


# ---- Triton through attention(), under its interpreter ------------------------------------


@pytest.mark.slow
def test_triton_kernel_through_attention_under_the_interpreter() -> None:
    """The Triton cases of this module in a child pytest with TRITON_INTERPRET=1 (Triton
    reads it once, at import, so this process cannot switch to it)."""
    if triton_interpreted() or os.environ.get(_CHILD):
        pytest.skip("this process runs the Triton cases itself")
    ok, why = _triton_importable()
    if not ok:
        pytest.skip(why)
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD: "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         f"{Path(__file__).relative_to(ROOT)}", "-k", TRITON_KERNEL],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout, tail


def _triton_importable() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, ""


# ---- CUDA: the Triton kernel through attention() on the device -----------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["combined", "bottom_right", "mqa_d_v_wider", "float_mask"])
def test_flash_on_cuda_matches_the_float64_reference(name: str, dtype: torch.dtype) -> None:
    """On a GPU diagnostics take the flash path on the Triton kernel by default; every field
    against the float64 reference, as on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the goldens' own matmuls (pitfall 17)
    case = _case(name, seed=CASES.index(name))
    q, k, v = (case[x].to(dtype) for x in "qkv")
    kw = {
        n: x.to("cuda", dtype if x.is_floating_point() else x.dtype)
        if isinstance(x, torch.Tensor)
        else x
        for n, x in case["kw"].items()
    }
    res = attention(q.cuda(), k.cuda(), v.cuda(), diagnostics="full", **kw)
    assert res.path == "flash"
    assert res.backend == TRITON_KERNEL
    host = type(res)(
        output=res.output.cpu(),
        weights=None,
        diagnostics=res.diagnostics,
        row_stats=res.row_stats.to("cpu"),
        path=res.path,
        backend=res.backend,
    )
    mask = kw.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        case = {**case, "kw": {**case["kw"], "attn_mask": mask.cpu()}}
    _check_against_reference(host, q, k, v, case, None)
