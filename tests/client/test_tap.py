"""The live-model tap against the service's own app in process (the tap's httpx transport is the
app's ASGI test transport): a module that calls torch's SDPA and a tiny transformers model, each
with its outputs bitwise unchanged and its statistics equal to a float64 reference; sampling,
the bounded queue and every failure counted, never raised into the model.

The real transformer (all-MiniLM-L6-v2) through a real server is tests/e2e/test_tap_minilm.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from torch import nn

from sdpa_client.tap import AttentionTap, LayerReport
from tests.client.tap_reference import per_head_stats, softmax_weights
from tests.support.app import app_transport, in_process_client, small_settings
from tests.support.live_server import free_port

SINK_TOKENS = 2


class CausalStack(nn.Module):
    """Two self-attention layers that call torch's SDPA directly, causal, as a decoder does."""

    def __init__(self, d_model: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(d_model, 3 * d_model) for _ in range(layers))

    def project(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, n, d = x.shape
        qkv = self.qkv[i](x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # each [B, H, N, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.qkv)):
            q, k, v = self.project(i, x)
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out.transpose(1, 2).reshape(x.shape)
        return x


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    settings = small_settings(health_sink_tokens=SINK_TOKENS, health_sample_rate=0.0)
    with in_process_client(settings) as client:
        yield client


def tap_for(app_client: TestClient, **kwargs: Any) -> AttentionTap:
    return AttentionTap("http://testserver", transport=app_transport(app_client), **kwargs)


def inputs(seed: int = 0, batch: int = 2, n: int = 12) -> tuple[CausalStack, torch.Tensor]:
    torch.manual_seed(seed)
    return CausalStack().eval(), torch.randn(batch, n, 32)


@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_a_module_calling_sdpa_is_watched_exactly(app_client: TestClient, protocol: str) -> None:
    model, x = inputs()
    with torch.no_grad():
        untapped = model(x)
    with tap_for(app_client, model="stack", every=1, protocol=protocol) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(x)
        assert tap.flush(timeout_s=30)
        reports = sorted(tap.reports, key=lambda r: r.layer)
        stats = tap.stats
    assert torch.equal(tapped, untapped)  # bitwise
    assert [r.tag for r in reports] == ["stack/layer0", "stack/layer1"]
    assert stats.forwards == 1
    assert stats.sampled == stats.sent == stats.answered == 2
    assert stats.dropped == stats.failed == 0

    # The reference: each layer's q and k recomputed in float64 from the module's weights.
    h = x.double()
    with torch.no_grad():
        model64 = CausalStack().double()
        model64.load_state_dict(model.state_dict())
        for report in reports:
            q, k, v = model64.project(report.layer, h)
            w = softmax_weights(q, k, scale=q.shape[-1] ** -0.5, causal=True)
            causal = np.tril(np.ones(w.shape[-2:], dtype=bool))
            want = per_head_stats(w.numpy(), causal, sink_tokens=SINK_TOKENS)
            for name, value in want.items():
                got = report.per_head[name]
                assert got.shape == (2, 4), name
                np.testing.assert_allclose(got, value, rtol=2e-5, atol=2e-6, err_msg=name)
            h = h + torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True
            ).transpose(1, 2).reshape(h.shape)


def test_every_nth_forward_is_sampled_and_counted_from_zero(app_client: TestClient) -> None:
    model, x = inputs()
    with tap_for(app_client, model="stack", every=3) as tap:
        with tap.attach(model), torch.no_grad():
            for _ in range(7):
                model(x)
        assert tap.flush(timeout_s=30)
        assert sorted({r.forward for r in tap.reports}) == [0, 3, 6]
        # A second attach counts its forwards from 0 again.
        with tap.attach(model), torch.no_grad():
            model(x)
            model(x)
        assert tap.flush(timeout_s=30)
        stats = tap.stats
        assert [r.forward for r in tap.reports[-2:]] == [0, 0]
    assert stats.forwards == 9
    assert stats.sampled == stats.answered == 8


def test_detached_means_untouched(app_client: TestClient) -> None:
    """Outside attach nothing is sampled: no hook, no mode left behind."""
    model, x = inputs()
    with tap_for(app_client, model="stack", every=1) as tap:
        with tap.attach(model), torch.no_grad():
            model(x)
        with torch.no_grad():
            model(x)
        tap.flush(timeout_s=30)
        assert tap.stats.sampled == 2
    assert not model._forward_pre_hooks
    assert not model._forward_hooks


def test_a_full_queue_drops_and_counts_without_copying(app_client: TestClient) -> None:
    model, x = inputs()
    with tap_for(app_client, model="stack", every=1, max_queue_bytes=1024) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(x)
        tap.flush(timeout_s=30)
        stats = tap.stats
    with torch.no_grad():
        assert torch.equal(tapped, model(x))
    assert stats.sampled == stats.dropped == 2
    assert stats.sent == stats.answered == stats.failed == 0


def test_a_service_that_is_down_counts_failures(app_client: TestClient) -> None:
    model, x = inputs()
    with torch.no_grad():
        untapped = model(x)
    # Nothing listens on this loopback port: every connection is refused.
    with AttentionTap(f"http://127.0.0.1:{free_port()}", model="down", every=1) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(x)
        assert tap.flush(timeout_s=30)
        stats = tap.stats
    assert torch.equal(tapped, untapped)
    assert stats.sampled == stats.sent == stats.failed == 2
    assert stats.answered == 0
    assert tap.reports == []


def test_an_error_status_counts_as_failed() -> None:
    """A service answering 503 (queue full, draining): failed, not retried, not raised."""
    seen: list[httpx.Request] = []

    def busy(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            503, json={"title": "Service Unavailable", "detail": "queue full"},
            headers={"retry-after": "1"},
        )  # fmt: skip

    model, x = inputs()
    with AttentionTap(
        "http://testserver", model="busy", every=1, transport=httpx.MockTransport(busy)
    ) as tap:
        with tap.attach(model), torch.no_grad():
            model(x)
        assert tap.flush(timeout_s=30)
        stats = tap.stats
    assert stats.failed == 2
    assert stats.answered == 0
    assert len(seen) == 2  # once each: no retries piling up behind the model
    assert {r.headers["content-type"] for r in seen} == {"application/json"}


@pytest.mark.slow
def test_a_slow_service_never_holds_the_forward() -> None:
    """Answers after 5 s: the forwards return while the first sample is still unanswered, and
    closing early counts what was never sent as dropped."""
    release = threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        release.wait(5.0)
        return httpx.Response(503, json={"detail": "slow"})

    model, x = inputs()
    with torch.no_grad():
        untapped = model(x)
    tap = AttentionTap(
        "http://testserver", model="slow", every=1, transport=httpx.MockTransport(slow)
    )
    with tap.attach(model), torch.no_grad():
        outs = [model(x) for _ in range(3)]
    during = tap.stats
    tap.close(timeout_s=0.5)
    release.set()
    after = tap.stats
    assert all(torch.equal(o, untapped) for o in outs)
    assert during.sampled == 6
    assert during.answered == 0
    assert during.sent <= 1  # the sender is still waiting on the first answer
    assert after.dropped >= 4
    assert after.answered == 0


def test_nothing_the_tap_meets_reaches_the_model(app_client: TestClient) -> None:
    """A report callback that raises, and a sample the service refuses (a NaN in the model's
    activations: 422): the forward runs exactly as without the tap, the samples are counted."""
    raised: list[LayerReport] = []

    def broken(report: LayerReport) -> None:
        raised.append(report)
        raise RuntimeError("the user's logger is broken")

    model, x = inputs()
    nan_x = x.clone()
    nan_x[0, 3, 5] = float("nan")
    with tap_for(app_client, model="stack", every=1, on_report=broken) as tap:
        with tap.attach(model), torch.no_grad():
            out = model(x)
            nan_out = model(nan_x)
        assert tap.flush(timeout_s=30)
        stats = tap.stats
    assert len(raised) == 2
    assert stats.sampled == 4
    assert stats.answered == 2
    assert stats.failed == 2
    with torch.no_grad():
        assert torch.equal(out, model(x))
        torch.testing.assert_close(nan_out, model(nan_x), rtol=0, atol=0, equal_nan=True)


def test_arguments_are_checked_up_front() -> None:
    for bad in (
        {"model": "has space"},
        {"model": "x" * 49},
        {"every": 0},
        {"every": True},
        {"diagnostics": "none"},
        {"protocol": "v3"},
        {"max_queue_bytes": 0},
        {"timeout_s": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AttentionTap("http://127.0.0.1:1", **bad)


def test_the_forward_is_not_blocked_by_a_busy_sender(app_client: TestClient) -> None:
    """Many sampled forwards in a row: the forwards never wait for answers (the queue bound
    drops the excess), and every sample ends answered, failed or dropped."""
    model, x = inputs(batch=1, n=8)
    with tap_for(app_client, model="stack", every=1, max_queue_bytes=64 << 10) as tap:
        with tap.attach(model), torch.no_grad():
            for _ in range(50):
                model(x)
        assert tap.flush(timeout_s=60)
        s = tap.stats
    assert s.sampled == 100
    assert s.answered + s.failed + s.dropped == s.sampled
    assert s.failed == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_cuda_model_is_copied_off_its_stream_exactly(
    app_client: TestClient, dtype: torch.dtype
) -> None:
    """On CUDA the tap copies into pinned memory on a side stream: the forward's outputs are
    bitwise unchanged and the statistics match float64 computed from the model's own q and k."""
    model, x = inputs()
    model = model.to("cuda", dtype)
    x = x.to("cuda", dtype)
    with torch.no_grad():
        untapped = model(x)
    with tap_for(app_client, model="cuda", every=1) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(x)
        assert tap.flush(timeout_s=60)
        reports = sorted(tap.reports, key=lambda r: r.layer)
    assert torch.equal(tapped, untapped)
    assert len(reports) == 2
    with torch.no_grad():
        h = x
        for report in reports:
            q, k, v = model.project(report.layer, h)
            w = softmax_weights(q.cpu(), k.cpu(), scale=q.shape[-1] ** -0.5, causal=True)
            causal = np.tril(np.ones(w.shape[-2:], dtype=bool))
            want = per_head_stats(w.numpy(), causal, sink_tokens=SINK_TOKENS)
            for name, value in want.items():
                np.testing.assert_allclose(
                    report.per_head[name], value, rtol=1e-3, atol=1e-4, err_msg=name
                )
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + out.transpose(1, 2).reshape(h.shape)


def _tiny(name: str, config_name: str, **config: Any) -> nn.Module:
    """A small transformers model of random weights (seeded)."""
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
    ("name", "config", "seen"),
    [
        # GPT-2's eager path with reorder_and_upcast_attn runs its own method, past the
        # attention interface: nothing to see, and the tap must not switch it off by renaming.
        ("GPT2LMHeadModel", {**GPT2, "reorder_and_upcast_attn": True,
                             "attn_implementation": "eager"}, 0),
        ("GPT2LMHeadModel", {**GPT2, "attn_implementation": "eager"}, 2),
        ("GPT2LMHeadModel", GPT2, 2),
        # Grouped-query attention (4 query heads, 2 kv heads), sdpa and eager.
        ("LlamaForCausalLM", LLAMA, 2),
        ("LlamaForCausalLM", {**LLAMA, "attn_implementation": "eager"}, 2),
    ],
)  # fmt: skip
def test_transformers_decoders_run_their_own_code_untouched(
    app_client: TestClient, name: str, config: dict[str, Any], seen: int
) -> None:
    """The model keeps its implementation's name (no branch of transformers changes) and its
    outputs bitwise; every layer is answered; the registry is as before afterwards."""
    transformers = pytest.importorskip("transformers")
    model = _tiny(name, name.replace("LMHeadModel", "Config").replace("ForCausalLM", "Config"),
                  **config)  # fmt: skip
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    before = dict(transformers.AttentionInterface._global_mapping)
    implementation = model.config._attn_implementation
    with torch.no_grad():
        untapped = model(input_ids=ids, attention_mask=mask).logits
    with tap_for(app_client, model="dec", every=1) as tap:
        with tap.attach(model), torch.no_grad():
            assert model.config._attn_implementation == implementation
            tapped = model(input_ids=ids, attention_mask=mask).logits
        assert tap.flush(timeout_s=30)
        stats = tap.stats
    assert torch.equal(tapped, untapped)
    assert stats.sampled == stats.answered == seen, (stats, tap.first_failure)
    assert transformers.AttentionInterface._global_mapping == before


def test_a_transformer_encoder_keeps_its_fast_path(app_client: TestClient) -> None:
    """nn.TransformerEncoder in eval runs a native fused kernel that a TorchFunctionMode would
    turn off (changing padded rows' outputs): the tap leaves it on, and sees its slow path's
    SDPA calls in training mode."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 6, 32)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    with torch.no_grad():
        untapped = encoder(x, src_key_padding_mask=padding)
    with tap_for(app_client, model="enc", every=1) as tap:
        with tap.attach(encoder), torch.no_grad():
            tapped = encoder(x, src_key_padding_mask=padding)
        encoder.train()
        with tap.attach(encoder), torch.no_grad():
            slow = encoder(x, src_key_padding_mask=padding)
        assert tap.flush(timeout_s=30)
        stats = tap.stats
    assert torch.equal(tapped, untapped)
    with torch.no_grad():
        assert torch.equal(slow, encoder(x, src_key_padding_mask=padding))
    assert stats.sampled == stats.answered == 2  # the training-mode forward's two layers


@pytest.mark.slow  # torch.compile traces the model (dynamo: seconds, its import included)
def test_a_compiled_model_runs_and_is_not_sampled(app_client: TestClient) -> None:
    model, x = inputs()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        untapped = model(x)
    with tap_for(app_client, model="compiled", every=1) as tap:
        with tap.attach(model), torch.no_grad():
            out = compiled(x)
        assert tap.flush(timeout_s=30)
    assert torch.equal(out, untapped)


def test_a_t5_position_bias_is_counted_as_failed_not_misreported(app_client: TestClient) -> None:
    model = _tiny(
        "T5EncoderModel", "T5Config", d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64,
        vocab_size=100, attn_implementation="sdpa",
    )  # fmt: skip
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        untapped = model(input_ids=ids).last_hidden_state
    with tap_for(app_client, model="t5", every=1) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(input_ids=ids).last_hidden_state
        assert tap.flush(timeout_s=30)
        stats = tap.stats
    assert torch.equal(tapped, untapped)
    assert stats.sampled == stats.failed == 2
    assert stats.sent == 0
    assert tap.first_failure is not None
    assert "position_bias" in tap.first_failure
