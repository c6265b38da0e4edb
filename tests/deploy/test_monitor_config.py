"""deploy/monitoring/prometheus.yml, the one-machine route's Prometheus (`make monitor`): valid
for `promtool check config` (which also checks the rule file it loads), scraping the address
`sdpa-service serve` listens on by default and loading the project's rules, all of them.
tests/e2e/test_monitor.py runs it against a live server."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from service.settings import Settings
from tests.deploy.dockerfile_parser import REPO_ROOT

CONFIG = REPO_ROOT / "deploy" / "monitoring" / "prometheus.yml"


def test_promtool_check_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    proc = subprocess.run(
        [promtool, "check", "config", str(CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout


def test_it_scrapes_the_default_server_and_loads_the_rules() -> None:
    config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    assert config["rule_files"] == ["sdpa.rules.yml"]  # beside it: relative to the config
    (job,) = config["scrape_configs"]
    host, port = (Settings.model_fields[name].default for name in ("host", "port"))
    assert job["static_configs"] == [{"targets": [f"{host}:{port}"]}]
    assert job.get("metrics_path", "/metrics") == "/metrics"
