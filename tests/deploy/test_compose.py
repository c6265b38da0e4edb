"""docker-compose.yml: valid against the Compose Specification's JSON schema, and consistent with
the Dockerfile and the service's settings.

The schema lives in ../shared/schemas/compose-spec.json (beside the repository, not copied in);
without it the schema test skips. No Docker engine runs here, so `${VAR:-default}` interpolation
is done by the test, with an empty environment (what `docker compose up` sees by default).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from service.server import worst_case_exit_s
from service.settings import Settings
from tests.deploy.dockerfile_parser import (
    REPO_ROOT,
    default_image,
    exposed_ports,
    final_stage,
    healthcheck,
)

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
SCHEMA_FILE = REPO_ROOT.parent / "shared" / "schemas" / "compose-spec.json"
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _raw() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def _interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} with no variables set: every reference becomes its default."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    return value


def _services() -> dict[str, Any]:
    services = _interpolate(_raw())["services"]
    assert isinstance(services, dict)
    return services


def _seconds(duration: str) -> float:
    """Compose durations such as '40s', '1m30s'."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts, duration
    assert "".join(n + u for n, u in parts) == duration, duration
    unit = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * unit[u] for n, u in parts)


def _schema() -> dict[str, Any]:
    if not SCHEMA_FILE.exists():
        pytest.skip(f"compose schema not found at {SCHEMA_FILE}")
    loaded = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def _sdpa_services() -> dict[str, Any]:
    repository, _ = default_image()
    return {n: s for n, s in _services().items() if s["image"].startswith(repository + ":")}


def test_compose_file_validates_against_the_compose_spec() -> None:
    schema = _schema()
    validator = jsonschema.Draft7Validator(schema)
    for document in (_raw(), _interpolate(_raw())):
        errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_schema_check_rejects_a_typo() -> None:
    # The validation above can fail: a misspelt key in a service is an error.
    broken = copy.deepcopy(_raw())
    broken["services"]["sdpa"]["helthcheck"] = broken["services"]["sdpa"].pop("healthcheck")
    assert list(jsonschema.Draft7Validator(_schema()).iter_errors(broken))


def test_services_run_the_image_make_image_builds() -> None:
    # The name tests/deploy/test_container.py builds and runs (make image's IMAGE default).
    repository, tag = default_image()
    services = _sdpa_services()
    assert set(services) == {"sdpa", "sdpa-gpu", "sdpa-replica"}
    assert services["sdpa"]["image"] == services["sdpa-replica"]["image"] == f"{repository}:{tag}"
    assert services["sdpa-gpu"]["image"] == f"{repository}:{tag}-cuda"
    # `docker compose build` builds the same Dockerfile from the repository root.
    for name, service in services.items():
        assert service["build"]["context"] == ".", name
        assert "dockerfile" not in service["build"], name


def test_ports_are_the_ones_the_image_serves_on() -> None:
    http, grpc = exposed_ports(final_stage())
    for name, service in _sdpa_services().items():
        assert int(service["environment"]["SDPA_PORT"]) == http, name
        assert int(service["environment"]["SDPA_GRPC_PORT"]) == grpc, name
        assert [int(p) for p in service["expose"]] == [http, grpc], name
        published = [int(p.rsplit(":", 1)[1]) for p in service.get("ports", [])]
        # A published instance publishes both doors; the replicas none (nginx fronts them).
        assert published in ([], [http, grpc]), f"{name}: {service.get('ports')}"


def test_published_host_ports_do_not_collide() -> None:
    """`--profile gpu up` runs the CPU and the GPU instance side by side on one host."""
    hosts = [  # "127.0.0.1:8001:8001" -> "8001", the host's side
        port.rsplit(":", 2)[1]
        for service in _services().values()
        for port in service.get("ports", [])
    ]
    assert len(hosts) == len(set(hosts)), hosts


def test_every_instance_has_the_images_healthcheck_and_a_restart_policy() -> None:
    options, image_healthcheck = healthcheck(final_stage())
    services = _sdpa_services()
    assert set(services) == {"sdpa", "sdpa-gpu", "sdpa-replica"}
    for name, service in services.items():
        assert service["healthcheck"]["test"] == ["CMD", *image_healthcheck], name
        # Compose's options override the image's: they must say the same thing.
        check = service["healthcheck"]
        for option, key in (("interval", "interval"), ("timeout", "timeout"),
                            ("start-period", "start_period")):  # fmt: skip
            assert _seconds(check[key]) == _seconds(options[option]), f"{name}: {key}"
        assert int(check["retries"]) == int(options["retries"]), name
        assert service["restart"] in {"unless-stopped", "always", "on-failure"}, name
        assert service["stop_signal"] == "SIGTERM", name


def test_grace_period_exceeds_the_worst_case_exit() -> None:
    for name, service in _sdpa_services().items():
        drain = float(service["environment"]["SDPA_DRAIN_TIMEOUT_S"])
        grace = _seconds(service["stop_grace_period"])
        assert grace > worst_case_exit_s(drain), name


def test_environment_names_and_defaults_match_the_settings() -> None:
    defaults = Settings()
    for name, service in _sdpa_services().items():
        for key, value in service["environment"].items():
            if not key.startswith("SDPA_"):
                continue
            field = key.removeprefix("SDPA_").lower()
            assert field in Settings.model_fields, f"{name}: unknown setting {key}"
            if key in {"SDPA_DEVICE", "SDPA_API_KEYS"}:
                continue  # per-service choices (cuda for the gpu profile) / a secret
            # The string compose passes parses to the service's own default.
            parsed = Settings(**{field: value})
            assert getattr(parsed, field) == getattr(defaults, field), f"{name}: {key}={value}"
        assert service["environment"]["SDPA_API_KEYS"] == ""  # no key baked in: auth opt-in


def test_gpu_profile_reserves_an_nvidia_gpu() -> None:
    gpu = _services()["sdpa-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["environment"]["SDPA_DEVICE"] == "cuda"
    assert gpu["build"]["args"]["TORCH_VARIANT"].startswith("cu")
    assert _services()["sdpa"].get("profiles") is None  # the plain `up` runs the CPU service


def test_scale_out_profile_puts_replicas_behind_nginx() -> None:
    services = _services()
    replica, nginx = services["sdpa-replica"], services["nginx"]
    assert replica["profiles"] == nginx["profiles"] == ["scale-out"]
    assert int(replica["deploy"]["replicas"]) >= 2
    assert "ports" not in replica  # only nginx is published
    assert nginx["depends_on"]["sdpa-replica"]["condition"] == "service_healthy"

    mount = next(v for v in nginx["volumes"] if v.endswith(":/etc/nginx/nginx.conf:ro"))
    conf_path = REPO_ROOT / mount.split(":")[0]
    conf = conf_path.read_text(encoding="utf-8")
    # nginx proxies to the replica service on the port the image serves.
    assert re.search(r"server\s+sdpa-replica:8000\b", conf)
    assert "proxy_pass http://sdpa;" in conf
    listen = re.search(r"listen\s+(\d+);", conf)
    assert listen is not None
    assert any(p.endswith(f":{listen.group(1)}") for p in nginx["ports"])
    # A draining replica's 503 (never computed) is retried on another replica.
    assert re.search(r"proxy_next_upstream[^;]*http_503", conf)
    # Bodies up to the service's limit get through to the service.
    body = re.search(r"client_max_body_size\s+(\d+)m;", conf)
    assert body is not None
    assert int(body.group(1)) * 1024 * 1024 >= Settings().max_body_bytes
    assert Path(conf_path).is_file()


def test_published_ports_bind_loopback_by_default() -> None:
    for name, service in _services().items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
