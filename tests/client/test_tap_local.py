"""AttentionTap(compute="local"): statistics computed in the model's process by sdpa_core, only
per-head numbers sent (POST /v1/health/observe), or nothing at all (url=None).

The truth is independent of sdpa_core: each call's q, k, v and masks are read as the model's
kernel received them (through the hooks alone, which compute nothing) and their weights are
made here in float64 (tests.client.tap_reference). Outputs must be bitwise those of the model
untapped, and the app must have seen no tensor request, only observations.
"""

from __future__ import annotations

import importlib.machinery
import math
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from torch import nn

from sdpa_client.tap import AttentionCall, AttentionTap
from sdpa_client.tap.hooks import attach_hooks
from tests.client.tap_reference import per_head_stats
from tests.client.test_tap import CausalStack
from tests.support.app import app_transport, in_process_client, requests_total, small_settings

SINK_TOKENS = 2
REPO_ROOT = Path(__file__).resolve().parents[2]
STATS = ("entropy", "normalized_entropy", "max_weight", "sink_share")


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    settings = small_settings(health_sink_tokens=SINK_TOKENS, health_sample_rate=0.0)
    with in_process_client(settings) as client:
        yield client


def local_tap(app_client: TestClient | None, **kwargs: Any) -> AttentionTap:
    kwargs.setdefault("sink_tokens", SINK_TOKENS)
    if app_client is None:
        return AttentionTap(None, compute="local", **kwargs)
    return AttentionTap(
        "http://testserver", compute="local", transport=app_transport(app_client), **kwargs
    )


def truth_of(call: AttentionCall) -> dict[str, np.ndarray[Any, Any]]:
    """Per-head statistics [B, H] of one call, from float64 weights made here."""
    q, k = call.q.detach().double().cpu(), call.k.detach().double().cpu()
    heads, kv_heads = q.shape[-3], k.shape[-3]
    k = k.repeat_interleave(heads // kv_heads, dim=-3)  # grouped-query: head i uses i // group
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    scores = (q @ k.transpose(-1, -2)) * scale
    n_q, n_kv = scores.shape[-2:]
    visible = torch.ones(scores.shape, dtype=torch.bool)
    if call.attn_mask is not None:
        mask = call.attn_mask.detach().cpu()
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            visible = visible & (mask > torch.finfo(mask.dtype).min) & (mask > -math.inf)
            scores = scores + torch.where(mask > -math.inf, mask.double(), 0.0)
    if call.key_padding_mask is not None:
        visible = visible & ~call.key_padding_mask.cpu()[:, None, None, :]
    if call.causal:
        visible = visible & torch.ones(n_q, n_kv, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
    assert bool(visible.any(-1).all()), "the reference expects every row to see a key"
    return per_head_stats(weights.numpy(), visible.numpy(), sink_tokens=SINK_TOKENS)


def truths(model: nn.Module, run: Any) -> list[dict[str, np.ndarray[Any, Any]]]:
    """Each attention call's truth, in call order, from one forward through the bare hooks."""
    found: list[dict[str, np.ndarray[Any, Any]]] = []

    def failed(exc: BaseException) -> None:
        raise exc

    with attach_hooks(model, 1, lambda call: found.append(truth_of(call)), failed):
        run()
    return found


def check(reports: list[Any], want: list[dict[str, np.ndarray[Any, Any]]]) -> None:
    assert len(reports) == len(want)
    for report, expected in zip(sorted(reports, key=lambda r: r.layer), want, strict=True):
        for name in STATS:
            np.testing.assert_allclose(
                report.per_head[name], expected[name], rtol=1e-4, atol=1e-6,
                err_msg=f"{report.tag} {name}",
            )  # fmt: skip


def health_count(app_client: TestClient, tag: str) -> float:
    text = app_client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith("sdpa_attention_entropy_normalized_count{") and f'tag="{tag}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("send", [True, False], ids=["service", "url=None"])
def test_a_module_calling_sdpa_is_computed_locally_exactly(
    app_client: TestClient, send: bool
) -> None:
    torch.manual_seed(0)
    model, x = CausalStack().eval(), torch.randn(3, 10, 32)
    with torch.no_grad():
        untapped = model(x)
        want = truths(model, lambda: model(x))
    before = requests_total(app_client.get("/metrics").text)
    name = f"local-{'sent' if send else 'kept'}"
    with local_tap(app_client if send else None, model=name, every=1) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(x)
        assert len(tap.reports) == 2  # there at once, before any flush
        assert tap.flush(timeout_s=30)
        stats = tap.stats
        reports = tap.reports
    assert torch.equal(tapped, untapped)
    assert stats.sampled == stats.answered == 2, (stats, tap.first_failure)
    assert stats.sent == (2 if send else 0)
    check(reports, want)
    assert [r.tag for r in sorted(reports, key=lambda r: r.layer)] == [
        f"{name}/layer0", f"{name}/layer1"
    ]  # fmt: skip
    counts = requests_total(app_client.get("/metrics").text)
    for layer in range(2):  # the service's histograms count sequences x heads per layer tag
        assert health_count(app_client, f"{name}/layer{layer}") == (3 * 4 if send else 0)
    # No tensor reached the service: only observations (one request for the forward's layers).
    for route, want_more in (("/v1/attention", 0), ("/v2/models/attention/infer", 0),
                             ("/v1/health/observe", 1 if send else 0)):  # fmt: skip
        key = (route, "200")
        assert counts.get(key, 0) - before.get(key, 0) == want_more, route


def test_the_chunked_path_where_no_flash_kernel_runs(app_client: TestClient) -> None:
    """Where sdpa_core has no flash kernel for the tensors (no compiler for the CPU one), the
    chunked path computes the same statistics, and local_kernel says so."""
    from sdpa_core.kernels import TRITON_KERNEL, use_kernel

    torch.manual_seed(4)
    model, x = CausalStack().eval(), torch.randn(2, 7, 32)
    with torch.no_grad():
        want = truths(model, lambda: model(x))
    # Triton alone allowed: it takes no CPU tensors without TRITON_INTERPRET.
    with local_tap(None, every=1) as tap, use_kernel(TRITON_KERNEL):
        with tap.attach(model), torch.no_grad():
            model(x)
        assert tap.flush(timeout_s=30)
    assert tap.local_kernel == "chunked"
    check(tap.reports, want)


_FRESH_PROCESS = textwrap.dedent(
    """
    import torch
    import sdpa_core
    from sdpa_client.tap import AttentionTap
    from tests.client.test_tap import CausalStack

    print({s.name: s.available for s in sdpa_core.flash_kernels()}["cpu_flash"])
    tap = AttentionTap(None, compute="local", every=1)
    print({s.name: s.available for s in sdpa_core.flash_kernels()}["cpu_flash"])
    model = CausalStack().eval()
    with tap, tap.attach(model), torch.no_grad():
        model(torch.randn(2, 8, 32))
    print(tap.local_kernel)
    """
)


@pytest.mark.slow  # a fresh interpreter, which may compile the kernel
@pytest.mark.parametrize("compiler", [True, False], ids=["compiler", "no-compiler"])
def test_a_cpu_model_gets_the_flash_kernel_the_tap_loads(compiler: bool, tmp_path: Path) -> None:
    """In a fresh process (nothing has loaded sdpa_core's CPU flash kernel, as in a model's own
    process): the local tap loads it when made (on a CUDA machine too: never on a forward), and
    the statistics take it; without a compiler (and no prebuilt library) the chunked path
    serves them."""
    from sdpa_core.kernels import cpu_flash

    prebuilt = cpu_flash.PREBUILT_DIR / (
        cpu_flash.library_name() + importlib.machinery.EXTENSION_SUFFIXES[-1]
    )
    env = dict(os.environ)
    if compiler:
        if shutil.which(env.get("CXX", "c++")) is None and not prebuilt.exists():
            pytest.skip("no C++ compiler to build sdpa_core's CPU flash kernel with")
    else:
        if prebuilt.exists():
            pytest.skip("a prebuilt CPU flash kernel loads without a compiler")
        env["CXX"] = str(tmp_path / "no-such-compiler")
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, cwd=REPO_ROOT,
        env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    if compiler:
        assert done.stdout.splitlines() == ["False", "True", "flash (cpu_flash)"], done.stderr
    else:
        assert done.stdout.splitlines() == ["False", "False", "chunked"], done.stderr


def _tiny(name: str, config_name: str, **config: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model: nn.Module = getattr(transformers, name)(getattr(transformers, config_name)(**config))
    return model.eval()


LLAMA: dict[str, Any] = {
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_size": 32, "intermediate_size": 64, "vocab_size": 100,
}  # fmt: skip
GPT2: dict[str, Any] = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 100}


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("GPT2LMHeadModel", GPT2),
        ("GPT2LMHeadModel", {**GPT2, "attn_implementation": "eager"}),
        ("LlamaForCausalLM", LLAMA),  # grouped-query: 4 query heads on 2 kv heads
        ("LlamaForCausalLM", {**LLAMA, "attn_implementation": "eager"}),
    ],
)
def test_transformers_decoders_in_local_mode(
    app_client: TestClient, name: str, config: dict[str, Any]
) -> None:
    config_name = name.replace("LMHeadModel", "Config").replace("ForCausalLM", "Config")
    model = _tiny(name, config_name, **config)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        untapped = model(input_ids=ids).logits
        want = truths(model, lambda: model(input_ids=ids))
    with local_tap(app_client, model="dec-local", every=1) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(input_ids=ids).logits
        assert tap.flush(timeout_s=30)
        stats = tap.stats
        reports = tap.reports
    assert torch.equal(tapped, untapped)
    assert stats.sampled == stats.answered == 2, (stats, tap.first_failure)
    assert sorted(r.layer for r in reports) == [0, 1]
    check(reports, want)


def test_a_transformer_encoders_slow_path_in_local_mode(app_client: TestClient) -> None:
    """In training mode (dropout 0) nn.TransformerEncoder runs nn.MultiheadAttention's slow
    path, which calls SDPA with the key padding as a mask: seen, bitwise, against float64."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
    x = torch.randn(2, 6, 32)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    with torch.no_grad():
        untapped = encoder(x, src_key_padding_mask=padding)
        want = truths(encoder, lambda: encoder(x, src_key_padding_mask=padding))
    with local_tap(app_client, model="enc-local", every=1) as tap:
        with tap.attach(encoder), torch.no_grad():
            tapped = encoder(x, src_key_padding_mask=padding)
        assert tap.flush(timeout_s=30)
        stats = tap.stats
        reports = tap.reports
    assert torch.equal(tapped, untapped)
    assert stats.sampled == stats.answered == 2, (stats, tap.first_failure)
    check(reports, want)


def test_every_hundredth_forward_and_the_counts(app_client: TestClient) -> None:
    torch.manual_seed(1)
    model, x = CausalStack().eval(), torch.randn(1, 5, 32)
    with local_tap(None, every=100) as tap:
        with tap.attach(model), torch.no_grad():
            for _ in range(201):
                model(x)
        assert tap.flush(timeout_s=30)
        stats = tap.stats
    assert (stats.forwards, stats.sampled, stats.answered) == (201, 6, 6)
    assert sorted({r.forward for r in tap.reports}) == [0, 100, 200]


def test_a_service_that_refuses_counts_failures_and_keeps_the_reports() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"title": "Unauthorized", "status": 401, "detail": "no"})

    torch.manual_seed(2)
    model, x = CausalStack().eval(), torch.randn(1, 5, 32)
    tap = AttentionTap(
        "http://testserver", compute="local", transport=httpx.MockTransport(refuse), every=1
    )
    with tap:
        with tap.attach(model), torch.no_grad():
            model(x)
        assert tap.flush(timeout_s=30)
        stats = tap.stats
    assert (stats.sampled, stats.sent, stats.failed, stats.answered) == (2, 2, 2, 0)
    assert len(tap.reports) == 2  # computed here: the reports stand whatever the service says
    assert tap.first_failure is not None


def test_nothing_the_local_tap_meets_reaches_the_model(app_client: TestClient) -> None:
    """A call sdpa_core refuses (NaN in q) is counted as failed; the model runs on."""

    class Nan(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, q, q)

    q = torch.randn(1, 2, 4, 8)
    q[0, 0, 0, 0] = math.nan
    model = Nan()
    with torch.no_grad():
        untapped = model(q)
    with local_tap(None, every=1) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(q)
        assert tap.flush(timeout_s=10)
        stats = tap.stats
    assert torch.equal(tapped.isnan(), untapped.isnan())
    assert torch.equal(tapped.nan_to_num(), untapped.nan_to_num())
    assert (stats.sampled, stats.failed, stats.answered) == (1, 1, 0)


def test_local_arguments_are_checked_up_front() -> None:
    with pytest.raises(ValueError, match="compute"):
        AttentionTap("http://x", compute="remote")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="url"):
        AttentionTap(None)
    with pytest.raises(ValueError, match="sink_tokens"):
        AttentionTap(None, compute="local", sink_tokens=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_cuda_model_in_local_mode_against_float64(app_client: TestClient, dtype: Any) -> None:
    torch.manual_seed(3)
    model = CausalStack().to("cuda", dtype).eval()
    x = torch.randn(4, 64, 32, device="cuda", dtype=dtype)
    with torch.no_grad():
        untapped = model(x)
        want = truths(model, lambda: model(x))
    with local_tap(app_client, model="cuda-local", every=1) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(x)
        assert tap.flush(timeout_s=60)
        stats = tap.stats
        reports = tap.reports
    assert torch.equal(tapped, untapped)
    assert stats.sampled == stats.answered == 2, (stats, tap.first_failure)
    rtol = 1e-4 if dtype == torch.float32 else 1e-3  # float16 inputs: the reference reads them
    for report, expected in zip(sorted(reports, key=lambda r: r.layer), want, strict=True):
        for name in STATS:
            np.testing.assert_allclose(
                report.per_head[name], expected[name], rtol=rtol, atol=1e-5, err_msg=name
            )
