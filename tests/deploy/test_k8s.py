"""deploy/k8s: every manifest valid for Kubernetes (kubernetes-validate, offline, strict), and the
properties a rolling update needs: probes on the right paths, a grace period that covers the
preStop sleep + drain + response flush, non-root, resources, autoscaler/PDB/Service wired to the
pods. The autoscaler is KEDA's ScaledObject (no schema here: tests/deploy/test_autoscaling.py
checks its fields); the image name and tag agree with `make image` and pyproject.toml.

The GPU variant is a kustomize overlay; it is rendered with `kubectl kustomize` where kubectl is
installed (skipped otherwise) and validated the same way.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.healthcheck import default_url
from service.server import worst_case_exit_s
from service.settings import Settings
from tests.deploy.dockerfile_parser import (
    REPO_ROOT,
    default_image,
    exposed_ports,
    final_stage,
    healthcheck,
    package_version,
)

K8S = REPO_ROOT / "deploy" / "k8s"
BASE = K8S / "base"
GPU_OVERLAY = K8S / "overlays" / "gpu"
# The oldest version kubernetes-validate bundles here that has every field we use (preStop
# `sleep` is in the schema from 1.29 on; the kubelet runs it by default from 1.30).
K8S_VERSION = "1.34.0"


def _documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _base_resources() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text(encoding="utf-8"))
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs.extend(_documents((BASE / name).read_text(encoding="utf-8")))
    return docs


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _rendered(overlay: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    proc = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=True
    )
    return _documents(proc.stdout)


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def test_every_manifest_file_is_in_the_kustomization() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text(encoding="utf-8"))
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk


@pytest.mark.parametrize(
    "path", sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
)
def test_base_manifest_is_valid_kubernetes(path: str) -> None:
    for doc in _documents((BASE / path).read_text(encoding="utf-8")):
        if _is_keda(doc):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _is_keda(doc: dict[str, Any]) -> bool:
    """KEDA's ScaledObject: a CRD kubernetes-validate has no schema for. tests/deploy/
    test_autoscaling.py checks its fields against KEDA's specification instead."""
    return str(doc.get("apiVersion", "")).startswith("keda.sh/")


def test_validation_rejects_a_misspelt_field() -> None:
    # The check above is real: strict validation refuses an unknown field.
    deployment = _by_kind(_base_resources(), "Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", [BASE, GPU_OVERLAY], ids=["base", "gpu"])
def test_rendered_kustomization_is_valid_kubernetes(overlay: Path) -> None:
    docs = _rendered(overlay)
    # The autoscaler is KEDA's ScaledObject (KEDA makes and owns the HPA).
    assert {d["kind"] for d in docs} >= {
        "Deployment", "Service", "ScaledObject", "PodDisruptionBudget", "ConfigMap",
    }  # fmt: skip
    for doc in docs:
        if not _is_keda(doc):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_probes_hit_health_and_readiness() -> None:
    container = _container(_by_kind(_base_resources(), "Deployment"))
    port = container["ports"][0]
    assert port["containerPort"] == Settings().port
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert get["port"] in {port["name"], port["containerPort"]}, probe
    # The startup probe allows the warm-up; liveness only takes over after it.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60


def test_grace_period_covers_prestop_and_the_worst_case_exit() -> None:
    docs = _base_resources()
    deployment = _by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    drain = float(_by_kind(docs, "ConfigMap")["data"]["SDPA_DRAIN_TIMEOUT_S"])
    pre_stop = _container(deployment)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop > 0  # endpoints deregister before the drain starts
    assert pod["terminationGracePeriodSeconds"] > pre_stop + worst_case_exit_s(drain)
    # The image's default agrees with the ConfigMap, so a pod without it behaves the same.
    assert float(final_stage().env()["SDPA_DRAIN_TIMEOUT_S"]) == drain


def test_pod_runs_non_root_with_a_read_only_root_filesystem() -> None:
    deployment = _by_kind(_base_resources(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    image_user = final_stage().last("USER")
    assert image_user is not None
    assert str(pod["securityContext"]["runAsUser"]) == image_user.args.split(":")[0]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # The one writable path is the image's HOME.
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert final_stage().env()["HOME"] in mounts
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]


def test_rolling_update_keeps_capacity_and_objects_select_the_pods() -> None:
    docs = _base_resources()
    deployment = _by_kind(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    def selects(selector: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    assert selects(deployment["spec"]["selector"]["matchLabels"])
    assert selects(_by_kind(docs, "Service")["spec"]["selector"])
    assert selects(_by_kind(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    # The Service reaches both doors by the container's port names: HTTP, then gRPC.
    service_ports = _by_kind(docs, "Service")["spec"]["ports"]
    container_ports = _container(deployment)["ports"]
    assert [p["targetPort"] for p in service_ports] == [p["name"] for p in container_ports]
    assert service_ports[1]["appProtocol"] == "kubernetes.io/h2c"  # gRPC: cleartext HTTP/2

    scaler = _by_kind(docs, "ScaledObject")
    target = scaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    # With the PDB allowing one pod down, the autoscaler's floor keeps one serving.
    assert scaler["spec"]["minReplicaCount"] >= 2
    assert _by_kind(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_gpu_overlay_requests_a_gpu_and_the_cuda_image() -> None:
    docs = _rendered(GPU_OVERLAY)
    container = _container(_by_kind(docs, "Deployment"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith("-cuda")
    assert _by_kind(docs, "ConfigMap")["data"]["SDPA_DEVICE"] == "cuda"
    # Everything the base guarantees survives the patch.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def _kustomization(directory: Path) -> dict[str, Any]:
    loaded = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def test_the_image_tag_has_one_owner_the_package_version() -> None:
    # The manifests name the image make image builds, untagged; kustomization.yaml sets the
    # tag, and that tag is the package version (a release image is tagged with it).
    repository, _ = default_image()
    container = _container(_by_kind(_base_resources(), "Deployment"))
    assert container["image"] == repository
    version = package_version()
    for directory, tag in ((BASE, version), (GPU_OVERLAY, f"{version}-cuda")):
        images = _kustomization(directory)["images"]
        assert images == [{"name": repository, "newTag": tag}], directory


@pytest.mark.parametrize(("overlay", "suffix"), [(BASE, ""), (GPU_OVERLAY, "-cuda")],
                         ids=["base", "gpu"])  # fmt: skip
def test_rendered_image_is_the_versioned_image(overlay: Path, suffix: str) -> None:
    repository, _ = default_image()
    container = _container(_by_kind(_rendered(overlay), "Deployment"))
    assert container["image"] == f"{repository}:{package_version()}{suffix}"


def test_probes_and_port_match_what_the_container_test_proved() -> None:
    # tests/deploy/test_container.py runs the image's HEALTHCHECK (`sdpa-service healthcheck`,
    # which GETs /readyz on SDPA_PORT) and serves on the EXPOSEd port: the kubelet's readiness
    # probe asks the same question on the same port.
    _, command = healthcheck(final_stage())
    assert command == ["sdpa-service", "healthcheck"]
    port, grpc_port = exposed_ports(final_stage())
    container = _container(_by_kind(_base_resources(), "Deployment"))
    assert [p["containerPort"] for p in container["ports"]] == [port, grpc_port]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["SDPA_PORT"]) == port
    assert int(env["SDPA_GRPC_PORT"]) == grpc_port
    readiness_path = "/" + default_url(port).split("/", 3)[3]
    assert container["readinessProbe"]["httpGet"]["path"] == readiness_path
