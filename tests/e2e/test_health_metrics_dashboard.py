"""The dashboard and the alert rules in a real Prometheus scraping a real server.

A live server gets requests of known attention (tagged), a rejected one, a non-finite one and a
long one abandoned at its deadline; Debian's `prometheus` (2.x) scrapes it every second and
loads deploy/monitoring/sdpa.rules.yml.
Then every query of the Grafana dashboard is evaluated by that Prometheus ($__rate_interval,
$tag and $model filled in as Grafana would: $model is the first value of its variable's
label_values query after its regex): each returns data, and the health panels, per tag and per
layer and head of the model "tiny" (tags "tiny/layer{i}", as the tap sends them), return the
values computed by hand. The panels are drawn from those query results with matplotlib
(headless) into a PNG; with UPDATE_SCREENSHOTS=1 it is written to docs/monitoring-dashboard.png
(the README's screenshot).

Skips without the prometheus binary (Debian: apt-get install prometheus).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from tests.e2e.test_health_metrics import (
    ONE_HOT,
    SINK,
    UNIFORM,
    b64,
    by_hand,
    post,
    scores_request,
)
from tests.e2e.test_long_requests_live import LONG
from tests.support.live_server import LiveServer, free_port, live_server

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
SCREENSHOT = REPO / "docs" / "monitoring-dashboard.png"
SCRAPE_S = 1
RATE_INTERVAL = "20s"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {
        "SDPA_HEALTH_SAMPLE_RATE": "1",
        "SDPA_HEALTH_SINK_TOKENS": "2",
        "SDPA_MAX_BODY_BYTES": "1048576",
        # The long requests must run into their deadline, not be refused (422) for their cost:
        # "auto" derives the limit from a throughput measured at warm-up, which a busy machine
        # (tests running beside this one) measures low.
        "SDPA_MAX_REQUEST_FLOPS": "1e15",
    }
    with live_server(env, tmp_path=tmp_path_factory.mktemp("dash_server")) as running:
        yield running


@pytest.fixture(scope="module")
def prometheus(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    target = server.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(MONITORING / "sdpa.rules.yml")],
        "scrape_configs": [{"job_name": "sdpa-service", "static_configs": [{"targets": [target]}]}],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError((tmp / "prometheus.log").read_text(encoding="utf-8"))
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def traffic(server: LiveServer, prometheus: str) -> tuple[float, float]:
    """About 25 s of known requests, scraped every second -> (start, end) unix times."""
    start = time.time()
    url = server.url
    deadline = time.monotonic() + 25.0
    sent = 0
    while time.monotonic() < deadline and sent < 2000:
        assert post(url, scores_request([UNIFORM, ONE_HOT]) | {"tag": "mixed"}).status_code == 200
        assert post(url, scores_request([SINK]) | {"tag": "sinky"}).status_code == 200
        body = scores_request([SINK]) | {"tag": "sampled", "diagnostics": "none"}
        assert post(url, body).status_code == 200
        # A model of three layers, as the tap names them (layer 10: the rows sort as numbers).
        for layer, heads in TINY.items():
            body = scores_request(heads) | {"tag": f"tiny/layer{layer}"}
            assert post(url, body).status_code == 200
        sent += 3 + len(TINY)
        time.sleep(0.05)
    # One refused for size (413, rejected_total{reason="too_large"}), one for NaN (422).
    big = httpx.post(
        f"{url}/v1/attention",
        content=b" " * 2_000_000,
        headers={"content-type": "application/json"},
        timeout=30.0,
    )
    assert big.status_code == 413
    nan = scores_request([UNIFORM])
    nan["q"] = b64(np.full((1, 1, 3, 2), np.nan))
    assert post(url, nan).status_code == 422
    # Long requests (seconds of compute in tiles) abandoned at their 0.3 s deadline (504,
    # sdpa_abandoned_total{reason="deadline"}): the first makes the series, scraped before
    # the second, so that the panel's rate shows the second.
    long = {"synthetic": LONG["synthetic"], "timeout_ms": 300}
    for _ in range(2):
        assert httpx.post(f"{url}/v1/analyze", json=long, timeout=30.0).status_code == 504
        time.sleep(2 * SCRAPE_S)
    time.sleep(3 * SCRAPE_S)  # the last samples scraped
    return start, time.time()


# The tap's tags of a model "tiny": layer -> its heads' row scores.
TINY = {0: [UNIFORM, ONE_HOT, SINK], 1: [SINK, UNIFORM], 10: [ONE_HOT]}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(
        (MONITORING / "sdpa-dashboard.json").read_text(encoding="utf-8")
    )
    return loaded


def variable_options(prometheus: str, variable: dict[str, Any]) -> list[str]:
    """A query variable's options as Grafana computes them: label_values(metric, label) from
    Prometheus, then the variable's regex (its capture group, when it has one), deduplicated
    and, with sort 1, sorted alphabetically."""
    found = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
    assert found, variable["query"]
    metric, label = found.groups()
    response = httpx.get(
        f"{prometheus}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10.0
    )
    values: list[str] = response.json()["data"]
    if variable.get("regex"):
        pattern = re.compile(variable["regex"].strip("/"))
        matches = [pattern.search(value) for value in values]
        values = [m.group(1) if m.groups() else m.group(0) for m in matches if m]
    options = list(dict.fromkeys(values))
    return sorted(options) if variable.get("sort") == 1 else options


@pytest.fixture(scope="module")
def variables(prometheus: str, traffic: tuple[float, float]) -> dict[str, str]:
    """Each template variable's value: "All" (its allValue) where it has one, else its first
    option, as Grafana picks when nothing is selected."""
    values = {"__rate_interval": RATE_INTERVAL}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        if variable.get("includeAll"):
            values[variable["name"]] = variable["allValue"]
        else:
            options = variable_options(prometheus, variable)
            assert options, variable["name"]
            values[variable["name"]] = options[0]
    return values


def grafana_expr(expr: str, variables: dict[str, str]) -> str:
    """An expression as Grafana sends it: its variables ($name, ${name}) filled in."""
    for name in sorted(variables, key=len, reverse=True):  # $model before a $mod
        expr = expr.replace("${" + name + "}", variables[name])
        expr = expr.replace("$" + name, variables[name])
    return expr


def query(prometheus: str, expr: str, *, at: float | None = None) -> list[dict[str, Any]]:
    """An instant query at `at` (here the traffic's end, so that its rate windows hold the
    last scrapes however long the tests before took), or now."""
    params: dict[str, str | float] = {"query": expr}
    if at is not None:
        params["time"] = at
    response = httpx.get(f"{prometheus}/api/v1/query", params=params, timeout=10.0)
    payload = response.json()
    assert payload["status"] == "success", (expr, payload)
    result: list[dict[str, Any]] = payload["data"]["result"]
    return result


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_every_dashboard_query_returns_data(
    prometheus: str, traffic: tuple[float, float], variables: dict[str, str]
) -> None:
    assert variables["model"] == "tiny"  # the only model: "tiny/layer{i}"
    for panel in panels():
        for target in panel["targets"]:
            result = query(prometheus, grafana_expr(target["expr"], variables), at=traffic[1])
            assert result, (panel["title"], target["expr"])


def by_tag(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"].get("tag", ""): float(r["value"][1]) for r in result}


def test_health_panels_show_the_values_computed_by_hand(
    prometheus: str, traffic: tuple[float, float], variables: dict[str, str]
) -> None:
    """Every observation of a tag has the same value here, so a panel's mean is that value."""
    sink = next(p for p in panels() if p["title"].startswith("Sink share ("))
    values = by_tag(
        query(prometheus, grafana_expr(sink["targets"][0]["expr"], variables), at=traffic[1])
    )
    hand = {"sinky": by_hand(SINK), "sampled": by_hand(SINK)}
    for tag, stats in hand.items():
        assert values[tag] == pytest.approx(stats["sdpa_attention_sink_share"], rel=1e-9)
    mixed = [by_hand(UNIFORM), by_hand(ONE_HOT)]
    want = sum(s["sdpa_attention_sink_share"] for s in mixed) / 2
    assert values["mixed"] == pytest.approx(want, rel=1e-9)

    saturated = next(p for p in panels() if p["title"].startswith("Saturated"))
    values = by_tag(
        query(prometheus, grafana_expr(saturated["targets"][0]["expr"], variables), at=traffic[1])
    )
    assert values["mixed"] == pytest.approx(0.5)  # one head of two is one-hot
    assert values["sinky"] == 0.0

    sources = query(
        prometheus, 'sum by (source) (sdpa_health_observations_total{tag="sampled"})', at=traffic[1]
    )
    assert {r["metric"]["source"] for r in sources} == {"sampled"}


def test_the_per_model_heatmaps_show_each_layer_and_head_as_by_hand(
    prometheus: str, traffic: tuple[float, float], variables: dict[str, str]
) -> None:
    """One cell per layer and head of "tiny", labelled with zero-padded numbers so that the
    rows sort as numbers (L01 before L10), each the head's value in its layer's requests."""
    statistic = {
        "Normalized entropy by layer and head": "sdpa_attention_entropy_normalized",
        "Sink share by layer and head": "sdpa_attention_sink_share",
        "Max |scaled score| by layer and head": "sdpa_attention_logit_abs_max",
    }
    for title, name in statistic.items():
        panel = next(p for p in panels() if p["title"] == title)
        assert panel["type"] == "heatmap"
        result = query(
            prometheus, grafana_expr(panel["targets"][0]["expr"], variables), at=traffic[1]
        )
        cells = {(r["metric"]["layer"], r["metric"]["head"]): float(r["value"][1]) for r in result}
        want = {
            (f"{layer:02d}", f"{head:02d}"): by_hand(scores)[name]
            for layer, heads in TINY.items()
            for head, scores in enumerate(heads)
        }
        assert cells.keys() == want.keys(), title
        for cell, value in want.items():
            assert cells[cell] == pytest.approx(value, rel=1e-9, abs=1e-12), (title, cell)
        legend = panel["targets"][0]["legendFormat"]
        rows = [legend.replace("{{layer}}", la).replace("{{head}}", he) for la, he in cells]
        assert sorted(rows)[-1] == "L10 H00"  # layer 10 after layers 0 and 1


def test_the_alert_rules_load_and_stay_quiet_on_healthy_traffic(
    prometheus: str, traffic: tuple[float, float]
) -> None:
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10.0).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    in_file = yaml.safe_load((MONITORING / "sdpa.rules.yml").read_text(encoding="utf-8"))
    assert len(rules) == sum(len(group["rules"]) for group in in_file["groups"])
    assert all(rule["health"] == "ok" for rule in rules), rules
    # A third of the heads are one-hot, every query 60 logits: the logit and collapse alerts
    # may go pending (their `for` is minutes away); nothing can have fired yet.
    assert all(rule.get("state") != "firing" for rule in rules)
    # The sink rate is recorded per tag: "sinky" sends one head, which sinks (11/15 > 0.3).
    recorded = by_tag(query(prometheus, "sdpa:attention_sink_rate:ratio15m", at=traffic[1]))
    assert recorded["sinky"] == 1.0


def test_the_dashboard_panels_render(
    prometheus: str, traffic: tuple[float, float], variables: dict[str, str], tmp_path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end = traffic
    shown = panels()
    cols = 3
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 2.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, shown, strict=False):
        drawn = 0
        target = panel["targets"][0]
        if panel["type"] == "heatmap" and target.get("format") != "heatmap":
            # Layer x head at the end: rows as Grafana sorts them, one column a head.
            result = query(prometheus, grafana_expr(target["expr"], variables), at=end)
            cells = {
                (r["metric"]["layer"], r["metric"]["head"]): float(r["value"][1]) for r in result
            }
            layers = sorted({layer for layer, _ in cells})
            heads = sorted({head for _, head in cells})
            grid = np.full((len(layers), len(heads)), np.nan)
            for (layer, head), cell in cells.items():
                grid[layers.index(layer), heads.index(head)] = cell
            ax.imshow(grid, aspect="auto", cmap="viridis")
            ax.set_yticks(range(len(layers)), [f"L{layer}" for layer in layers])
            ax.set_xticks(range(len(heads)), [f"H{head}" for head in heads])
            drawn = len(cells)
        elif panel["type"] == "heatmap":  # the distribution at the end, per bucket
            result = query(prometheus, grafana_expr(target["expr"], variables), at=end)
            cumulative = sorted((float(r["metric"]["le"]), float(r["value"][1])) for r in result)
            finite = [(le, n) for le, n in cumulative if math.isfinite(le)]
            counts = [n - (finite[i - 1][1] if i else 0.0) for i, (_, n) in enumerate(finite)]
            ax.bar([le for le, _ in finite], counts, width=0.04, align="edge")
            ax.set_xlabel("normalized entropy (bucket upper bound)", fontsize=7)
            drawn = len(finite)
        for target in panel["targets"] if panel["type"] != "heatmap" else []:
            response = httpx.get(
                f"{prometheus}/api/v1/query_range",
                params={
                    "query": grafana_expr(target["expr"], variables),
                    "start": start,
                    "end": end,
                    "step": SCRAPE_S,
                },
                timeout=10.0,
            )
            for series in response.json()["data"]["result"]:
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = target["legendFormat"]
                for name, value in series["metric"].items():
                    label = label.replace("{{" + name + "}}", value)
                ax.plot(xs, ys, label=label.replace("{{pod}}", "").strip() or "value")
                drawn += 1
        assert drawn, panel["title"]
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        if panel["type"] != "heatmap":
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.suptitle("sdpa-service dashboard: panels evaluated by Prometheus on a live server (s)")
    save_screenshot(fig, tmp_path / "dashboard.png", SCREENSHOT)


def save_screenshot(fig: Any, out: Path, screenshot: Path) -> None:
    """Write the figure to `out` (checked to be a PNG); with UPDATE_SCREENSHOTS=1 also to
    `screenshot`, the README's picture."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    assert out.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        screenshot.parent.mkdir(exist_ok=True)
        shutil.copyfile(out, screenshot)
