"""deploy/monitoring: the alert rules pass `promtool check rules` and their unit tests
(`promtool test rules`); the PrometheusRule holds the same groups; the ServiceMonitor scrapes
the Service's port; the dashboard's ConfigMap is the dashboard; and every metric a dashboard
query, an alert or the autoscaler's query names is one a live server exports on /metrics.

promtool comes with Debian's prometheus package; without it those two tests skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.dockerfile_parser import REPO_ROOT
from tests.support.live_server import LiveServer, live_server

MONITORING = REPO_ROOT / "deploy" / "monitoring"
RULES = MONITORING / "sdpa.rules.yml"
DASHBOARD = MONITORING / "sdpa-dashboard.json"
SERVICE = REPO_ROOT / "deploy" / "k8s" / "base" / "service.yaml"
SCALED_OBJECT = REPO_ROOT / "deploy" / "k8s" / "base" / "hpa.yaml"
K8S_VERSION = "1.34.0"
ALERTS = {
    "SdpaAttentionEntropyCollapse",
    "SdpaAttentionSaturationSurge",
    "SdpaAttentionSinkTakeover",
    "SdpaAttentionLogitBlowUp",
    "SdpaAttentionLogitQkClip",
    "SdpaAttentionSinkRateShift",
    "SdpaNonFiniteInputs",
    "SdpaQueueBacklog",
    "SdpaTenantBacklog",
    "SdpaBrokenAdmissions",
    "SdpaP99LatencyHigh",
}
RECORDS = {"sdpa:attention_sink_rate:ratio15m"}
# Where each attention-health alert's signal and threshold come from, cited in its runbook.
SOURCES = {
    "SdpaAttentionEntropyCollapse": "arXiv 2303.06296",  # Zhai et al., ICML 2023
    "SdpaAttentionSaturationSurge": "arXiv 1706.03762",  # Vaswani et al. 2017
    "SdpaAttentionSinkTakeover": "arXiv 2309.17453",  # StreamingLLM
    "SdpaAttentionLogitBlowUp": "arXiv 2302.05442",  # ViT-22B
    "SdpaAttentionLogitQkClip": "arXiv 2507.20534",  # Kimi K2, QK-Clip
    "SdpaAttentionSinkRateShift": "arXiv 2410.10781",  # Gu et al., ICLR 2025
}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


# ---- the rules ----------------------------------------------------------------------------


def test_promtool_check_rules() -> None:
    proc = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS) + len(RECORDS)} rules found" in proc.stdout


@pytest.mark.parametrize(
    "tests", sorted((MONITORING / "tests").glob("*.yml")), ids=lambda p: p.name
)
def test_promtool_test_rules(tests: Path) -> None:
    proc = subprocess.run(
        [promtool(), "test", "rules", tests.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tests.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(RULES)["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def test_every_alert_is_there_with_a_runbook_and_a_severity() -> None:
    by_name = alerts()
    assert set(by_name) == ALERTS
    assert {rule["record"] for rule in rules() if "record" in rule} == RECORDS
    for name, rule in by_name.items():
        assert rule["annotations"]["runbook"].strip(), name
        assert rule["annotations"]["summary"].strip(), name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name


def test_every_health_alert_cites_its_source_and_the_thresholds_are_the_literatures() -> None:
    by_name = alerts()
    for name, source in SOURCES.items():
        assert source in by_name[name]["annotations"]["runbook"], name
    collapse = by_name["SdpaAttentionEntropyCollapse"]["annotations"]["runbook"]
    assert "H / log(visible keys)" in collapse
    assert "ICML 2023" in collapse
    # QK-Clip's tau is a bucket bound of the logit histogram: the share above it is exact.
    assert (
        'sdpa_attention_logit_abs_max_bucket{le="100.0"}'
        in by_name["SdpaAttentionLogitQkClip"]["expr"]
    )
    record = next(r for r in rules() if r.get("record") == "sdpa:attention_sink_rate:ratio15m")
    assert 'sdpa_attention_sink_share_bucket{le="0.3"}' in record["expr"]  # Gu et al.'s 0.3


def test_every_recording_rule_has_a_promtool_test() -> None:
    tested = set()
    for path in (MONITORING / "tests").glob("*.yml"):
        for case in load_yaml(path)["tests"]:
            for check in case.get("promql_expr_test", []):
                if check.get("exp_samples"):
                    tested |= metric_names(check["expr"])
    assert tested >= RECORDS


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    fired = set()
    for path in (MONITORING / "tests").glob("*.yml"):
        for case in load_yaml(path)["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    assert fired == ALERTS


def test_the_prometheus_rule_holds_the_same_groups() -> None:
    rule = load_yaml(MONITORING / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["metadata"]["name"]
    assert rule["spec"]["groups"] == load_yaml(RULES)["groups"]


def test_the_service_monitor_scrapes_the_service_port_at_metrics() -> None:
    monitor = load_yaml(MONITORING / "servicemonitor.yaml")
    service = load_yaml(SERVICE)
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    ports = {port["name"] for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in ports
        assert endpoint["path"] == "/metrics"
    # The autoscaler's query selects the series by the job label the ServiceMonitor gives them:
    # the Service's name (the Prometheus Operator's default jobLabel).
    query = autoscaler_query()
    assert f'job="{service["metadata"]["name"]}"' in query


def rendered_monitoring() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    proc = subprocess.run(
        [kubectl, "kustomize", str(MONITORING)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def test_the_dashboard_config_map_is_the_dashboard() -> None:
    docs = rendered_monitoring()
    assert {d["kind"] for d in docs} == {"ConfigMap", "PrometheusRule", "ServiceMonitor"}
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    kubernetes_validate.validate(config_map, K8S_VERSION, strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    embedded = config_map["data"]["sdpa-dashboard.json"]
    assert json.loads(embedded) == json.loads(DASHBOARD.read_text(encoding="utf-8"))


# ---- metric names -------------------------------------------------------------------------

# Words of PromQL that look like metric names: aggregation modifiers and binary operators.
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                       "unless", "bool", "offset", "inf", "nan"})  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (Grafana variables allowed) selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", " ", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function
        if match.group(0).lower() not in _KEYWORDS:
            names.add(match.group(0))
    return names


def test_metric_names_reads_what_a_query_selects() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, tag) (rate(a_bucket{le="0.1", x=~"b|c"}[5m]))) '
        "/ on (tag) group_left sum without (pod) (b_total offset 5m) > 1e3 and c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert metric_names("sum(rate(d_count[$__rate_interval]))") == {"d_count"}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    for panel in walk(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        exprs.extend(target["expr"] for target in panel["targets"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            found = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
            assert found, query
            exprs.append(found.group(1))
    return exprs


def autoscaler_query() -> str:
    triggers = load_yaml(SCALED_OBJECT)["spec"]["triggers"]
    return str(next(t for t in triggers if t["type"] == "prometheus")["metadata"]["query"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server({}, tmp_path=tmp_path_factory.mktemp("monitoring")) as running:
        yield running


def exported_names(url: str) -> set[str]:
    """Every series name /metrics declares (a family with no sample yet included)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count"),
        }.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
    return names


def test_every_dashboard_query_names_an_exported_metric(server: LiveServer) -> None:
    exported = exported_names(server.url)
    queries = dashboard_queries()
    assert len(queries) >= 15
    used: set[str] = set()
    for expr in queries:
        names = metric_names(expr)
        assert names, expr
        assert names <= exported, (expr, names - exported)
        used |= names
    # The health histograms, the counters and the process metrics all have a panel.
    for name in (
        "sdpa_attention_entropy_normalized_bucket",
        "sdpa_attention_sink_share_sum",
        "sdpa_attention_saturated_fraction_sum",
        "sdpa_attention_max_weight_sum",
        "sdpa_attention_logit_abs_max_bucket",
        "sdpa_attention_head_entropy_normalized",
        "sdpa_attention_head_sink_share",
        "sdpa_attention_head_logit_abs_max",
        "sdpa_attention_masked_rows_total",
        "sdpa_nonfinite_inputs_total",
        "sdpa_health_observations_total",
        "sdpa_queue_depth",
        "sdpa_requests_in_flight",
        "process_resident_memory_bytes",
        "python_gc_collections_total",
    ):
        assert name in used, name


def test_every_alert_and_the_autoscaler_name_exported_metrics(server: LiveServer) -> None:
    """... or a series a recording rule records."""
    exported = exported_names(server.url) | RECORDS
    for rule in rules():
        name = rule.get("alert") or rule["record"]
        names = metric_names(rule["expr"])
        assert names, name
        assert names <= exported, (name, names - exported)
    assert metric_names(autoscaler_query()) == {"sdpa_backlog_seconds"}
