"""A real server with the CPU flash kernel built at warm-up (SDPA_COMPILE_KERNELS, the
default): /v1/info says which flash kernels run, and a diagnostics request runs on the flash
path (its meta says so) with the float64 reference's numbers."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from sdpa_client import SDPAClient
from tests.core.reference import reference_attention, reference_rows, visibility
from tests.support.live_server import LiveServer, live_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the CPU flash kernel cannot be built")
    env = {"SDPA_COMPILE_KERNELS": "true"}
    # Building the kernel on a cold cache takes about a minute on 2 cores.
    with live_server(env, tmp_path=tmp_path_factory.mktemp("flash"), ready_timeout=400) as srv:
        yield srv


def test_diagnostics_run_on_the_flash_path_and_match_the_reference(server: LiveServer) -> None:
    with SDPAClient(server.url) as client:
        info = client.info()
        kernels = info["kernels"]
        assert set(kernels) == {"triton", "cpu_flash"}
        if not kernels["cpu_flash"]["available"]:
            pytest.fail(f"cpu_flash: {kernels['cpu_flash']['reason']}\n{server.log()[-3000:]}")
        assert kernels["cpu_flash"]["reason"] == ""
        assert kernels["triton"]["available"] is False  # no CUDA, no interpreter here
        assert kernels["triton"]["reason"]
        rng = np.random.default_rng(37)
        q = rng.standard_normal((2, 4, 40, 16)).astype(np.float32)
        k = rng.standard_normal((2, 2, 70, 16)).astype(np.float32)
        v = rng.standard_normal((2, 2, 70, 8)).astype(np.float32)
        pad = np.zeros((2, 70), dtype=bool)
        pad[1, :5] = True  # left padding: the second sequence's sink is keys 5..8
        result = client.attention(
            q,
            k,
            v,
            causal="bottom_right",
            key_lengths=[61, 70],
            key_padding_mask=pad,
            diagnostics="full",
        )
    assert result.meta is not None
    assert result.meta.path == "flash"
    assert result.meta.backend == "cpu_flash"
    vis = visibility(
        b=2,
        h=4,
        n_q=40,
        n_kv=70,
        causal="bottom_right",
        key_lengths=[61, 70],
        key_padding_mask=torch.from_numpy(pad),
    )
    ref = reference_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), vis)
    scale = 1 / math.sqrt(16)
    rows = reference_rows(ref, scale=scale)
    assert result.output is not None
    assert result.diagnostics is not None
    np.testing.assert_allclose(result.output, ref.out.numpy(), atol=2e-5, rtol=1e-4)
    per_row = result.diagnostics.per_row
    assert per_row is not None
    for name in ("entropy", "max_weight", "lse"):
        np.testing.assert_allclose(per_row[name], getattr(rows, name), atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(per_row["visible_keys"], rows.visible_keys)
    rank = np.cumsum(~pad, axis=-1)
    sink = (~pad) & (rank <= 4)  # the first four keys that are not padding
    want_sink = (ref.weights.numpy() * sink[:, None, None, :]).sum(-1)
    np.testing.assert_allclose(per_row["sink_share"], want_sink, atol=2e-6, rtol=1e-4)
    summary = result.diagnostics.summary
    assert summary.grad_health == pytest.approx(float(rows.grad_health.mean()), rel=1e-4)
    assert summary.jacobian_fro == pytest.approx(float(rows.jacobian_fro.mean()), rel=1e-4)
    assert summary.score_variance_raw == pytest.approx(rows.pooled_var_raw, rel=1e-4)
    assert summary.score_abs_max_scaled == pytest.approx(scale * rows.abs_max_raw, rel=1e-5)
    assert summary.masked_rows == rows.masked_rows == 0
