"""The same contract on CUDA (skipped without a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from sdpa_core import Masks, attention, default_scale
from sdpa_core.attention import prepare_inputs
from sdpa_core.fused import fused_attention
from tests.core.reference import (
    assert_matches_golden,
    lowp_reference,
    reference_attention,
    visibility,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    """Goldens must not be computed with TF32 (kernel-anchors pitfall 17)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("path", ["fused", "dense", "chunked"])
@pytest.mark.parametrize("n", [63, 64, 65, 127, 129])
def test_cuda_paths_match_reference(path: str, dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(2, 4, n, 64, generator=gen).to(dtype)
    k = torch.randn(2, 2, n, 64, generator=gen).to(dtype)
    v = torch.randn(2, 2, n, 64, generator=gen).to(dtype)
    kl = [n, n // 2]
    res = attention(
        q.cuda(),
        k.cuda(),
        v.cuda(),
        causal="bottom_right",
        key_lengths=torch.tensor(kl).cuda(),
        path=path,
        return_weights=path == "dense",
        diagnostics="none" if path == "fused" else "summary",
    )
    if path == "fused":
        assert res.backend in {"flash", "efficient", "cudnn", "math"}
    vis = visibility(b=2, h=4, n_q=n, n_kv=n, causal="bottom_right", key_lengths=kl)
    ref = reference_attention(q, k, v, vis)
    assert_matches_golden(res.output.cpu(), ref.out, lowp_reference(q, k, v, vis))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("path", ["fused", "dense", "chunked"])
def test_cuda_fully_masked_rows_are_zero(path: str, dtype: torch.dtype) -> None:
    q = torch.randn(1, 2, 4, 64, device="cuda", dtype=dtype)
    k = torch.randn(1, 2, 3, 64, device="cuda", dtype=dtype)
    mask = torch.ones(4, 3, dtype=torch.bool, device="cuda")
    mask[1] = False
    res = attention(
        q,
        k,
        k,
        attn_mask=mask,
        path=path,
        diagnostics="none" if path == "fused" else "summary",
    )
    assert not torch.isnan(res.output).any()
    assert torch.all(res.output[:, :, 1] == 0)
    if res.diagnostics is not None:
        assert res.diagnostics.summary.masked_rows == 2
        assert all(math.isfinite(x) for x in res.diagnostics.summary.as_dict().values())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n_q", [33, 65])
def test_cuda_fused_query_tiles_match_reference(dtype: torch.dtype, n_q: int) -> None:
    """The fused path's query tiles on CUDA (a tiny budget: tiles of one row), bottom-right
    causal with key lengths and N_q > N_kv (fully masked first rows), N_kv not a multiple of 8
    (the memory-efficient kernel pads such masks)."""
    n_kv = 45
    gen = torch.Generator().manual_seed(n_q)
    q = torch.randn(2, 4, n_q, 64, generator=gen).to(dtype)
    k = torch.randn(2, 2, n_kv, 64, generator=gen).to(dtype)
    v = torch.randn(2, 2, n_kv, 64, generator=gen).to(dtype)
    kl = [n_kv, 7]
    options = {"causal": "bottom_right", "key_lengths": torch.tensor(kl).cuda()}
    assert attention(q.cuda(), k.cuda(), v.cuda(), **options).path == "fused"
    inputs = prepare_inputs(q.cuda(), k.cuda(), v.cuda(), Masks(**options))
    out4, _ = fused_attention(
        inputs.q4, inputs.k4, inputs.v4, inputs.plan, scale=default_scale(64), tile_bytes=1
    )
    vis = visibility(b=2, h=4, n_q=n_q, n_kv=n_kv, causal="bottom_right", key_lengths=kl)
    ref = reference_attention(q, k, v, vis)
    out = out4.cpu()
    assert_matches_golden(out, ref.out, lowp_reference(q, k, v, vis))
    assert torch.all(out[~vis.any(-1)] == 0)
