"""A real server with the diagnostics kernel compiled at warm-up (SDPA_COMPILE_KERNELS, the
default): /v1/info says so, and a request's diagnostics are the float64 reference's."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from sdpa_client import SDPAClient, SummaryStats
from tests.core.reference import reference_attention, reference_rows, visibility
from tests.support.live_server import LiveServer, live_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: inductor cannot build the kernel")
    env = {"SDPA_COMPILE_KERNELS": "true"}
    # Compiling on a cold inductor cache takes tens of seconds on 2 cores.
    with live_server(env, tmp_path=tmp_path_factory.mktemp("kernel"), ready_timeout=300) as srv:
        yield srv


def test_info_says_compiled_and_diagnostics_match_the_reference(server: LiveServer) -> None:
    with SDPAClient(server.url) as client:
        info = client.info()
        assert info["diagnostics_kernel"] == "compiled", server.log()
        rng = np.random.default_rng(7)
        q = rng.standard_normal((1, 4, 96, 32)).astype(np.float32)
        k = rng.standard_normal((1, 4, 130, 32)).astype(np.float32)
        v = rng.standard_normal((1, 4, 130, 16)).astype(np.float32)
        result = client.attention(
            q, k, v, causal="bottom_right", key_lengths=[120], diagnostics="full"
        )
    vis = visibility(b=1, h=4, n_q=96, n_kv=130, causal="bottom_right", key_lengths=[120])
    ref = reference_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), vis)
    rows = reference_rows(ref, scale=32**-0.5)
    assert result.output is not None
    assert result.diagnostics is not None
    np.testing.assert_allclose(result.output, ref.out.numpy(), atol=2e-5, rtol=1e-4)
    per_row = result.diagnostics.per_row
    assert per_row is not None
    np.testing.assert_allclose(per_row["entropy"], rows.entropy, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(per_row["max_weight"], rows.max_weight, atol=2e-5, rtol=1e-4)
    summary = result.diagnostics.summary
    assert isinstance(summary, SummaryStats)
    assert summary.grad_health == pytest.approx(float(rows.grad_health.mean()), rel=1e-4)
    assert summary.score_variance_raw == pytest.approx(rows.pooled_var_raw, rel=1e-4)
