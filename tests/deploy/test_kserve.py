"""deploy/kserve: a ServingRuntime and an InferenceService for each door of the v2 protocol,
REST and gRPC (Knative routes one port per InferenceService).

The KServe CRDs are not in kubernetes-validate's schemas, so the fields KServe requires are
checked here by name (apiVersion and kind of each CRD, the predictor's model format, protocol
and runtime, the runtime's kserve-container and its one port, named as KServe reads it: http1
for HTTP/1.1, h2c for gRPC); the runtime's pod parts (containers, volumes) are validated
strictly as a Kubernetes Pod. The probes are checked against the real app: their paths answer
200 without an API key when keys are configured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.dockerfile_parser import REPO_ROOT, package_version
from tests.support.app import in_process_client, small_settings

KSERVE = REPO_ROOT / "deploy" / "kserve"
K8S_VERSION = "1.34.0"
# KServe names an InferenceService's Knative service and its hosts after it: a DNS-1035 label.
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _load(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((KSERVE / name).read_text(encoding="utf-8")) if d]
    assert len(docs) == 1, name
    doc = docs[0]
    assert isinstance(doc, dict)
    return doc


@dataclass(frozen=True)
class Door:
    """One protocol's pair of manifests, and what its runtime must route."""

    runtime_file: str
    isvc_file: str
    protocol: str  # the InferenceService's protocolVersion
    port_name: str  # what KServe (Knative) reads the routed port's protocol from
    port_setting: str  # the setting that makes the service listen on it


DOORS = {
    "rest": Door("servingruntime.yaml", "inferenceservice.yaml", "v2", "http1", "SDPA_PORT"),
    "grpc": Door(
        "servingruntime-grpc.yaml", "inferenceservice-grpc.yaml", "grpc-v2", "h2c", "SDPA_GRPC_PORT"
    ),
}


@pytest.fixture(scope="module", params=sorted(DOORS))
def door(request: pytest.FixtureRequest) -> Door:
    return DOORS[request.param]


@pytest.fixture(scope="module")
def runtime(door: Door) -> dict[str, Any]:
    return _load(door.runtime_file)


@pytest.fixture(scope="module")
def isvc(door: Door) -> dict[str, Any]:
    return _load(door.isvc_file)


def test_every_manifest_is_one_doors() -> None:
    named = {name for d in DOORS.values() for name in (d.runtime_file, d.isvc_file)}
    assert {p.name for p in KSERVE.glob("*.yaml")} == named


def _container(runtime: dict[str, Any]) -> dict[str, Any]:
    containers = runtime["spec"]["containers"]
    named = [c for c in containers if c["name"] == "kserve-container"]
    assert len(named) == 1, "KServe routes to the one container named kserve-container"
    container: dict[str, Any] = named[0]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_inference_service_required_fields(
    isvc: dict[str, Any], runtime: dict[str, Any], door: Door
) -> None:
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["kind"] == "InferenceService"
    name = isvc["metadata"]["name"]
    assert DNS_1035.match(name)
    assert len(name) <= 63
    model = isvc["spec"]["predictor"]["model"]
    assert model["protocolVersion"] == door.protocol
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats


def test_serving_runtime_required_fields(runtime: dict[str, Any], door: Door) -> None:
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert runtime["kind"] == "ServingRuntime"
    assert DNS_1035.match(runtime["metadata"]["name"])
    assert runtime["spec"]["protocolVersions"] == [door.protocol]
    container = _container(runtime)
    assert len(container["ports"]) == 1, "KServe's ingress targets the container's one port"
    port = container["ports"][0]
    assert port["name"] == door.port_name
    env = _env(container)
    assert env[door.port_setting] == str(port["containerPort"])
    assert env["SDPA_HOST"] == "0.0.0.0"
    if door.port_setting == "SDPA_PORT":  # the REST runtime opens no unrouted gRPC listener
        assert env["SDPA_GRPC_PORT"] == "0"
    else:  # the HTTP door still serves the probes, on its own port
        assert int(env["SDPA_PORT"]) != port["containerPort"]
    repository, _, tag = container["image"].rpartition(":")
    assert repository == "localhost/sdpa-service"
    assert tag == package_version()


def test_runtime_pod_parts_are_valid_kubernetes(runtime: dict[str, Any]) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "kserve-runtime-check"},
        "spec": {
            "containers": runtime["spec"]["containers"],
            "volumes": runtime["spec"]["volumes"],
        },
    }
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    pod["spec"]["containers"][0]["readinesProbe"] = {}  # a misspelt field is refused
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_probes_answer_on_the_real_app_without_a_key(runtime: dict[str, Any]) -> None:
    container = _container(runtime)
    port = int(_env(container)["SDPA_PORT"])  # the HTTP door, whichever port is routed
    probes = {
        kind: container[kind]["httpGet"]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    with in_process_client(small_settings(api_keys="probe-test-key")) as client:
        for kind, probe in probes.items():
            assert probe["port"] == port, kind
            response = client.get(probe["path"])  # no key: orchestrators carry none
            assert response.status_code == 200, (kind, probe["path"], response.text)
        # ...while the model itself needs the key.
        assert client.get("/v2/models/attention").status_code == 401
