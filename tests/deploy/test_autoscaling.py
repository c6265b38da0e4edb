"""Autoscaling on the queued work: both kustomizations (CPU base, GPU overlay) scale the
Deployment with a KEDA ScaledObject whose Prometheus trigger reads sdpa_backlog_seconds, CPU
only as the base's fallback, and no hand-written HorizontalPodAutoscaler beside it (KEDA owns
the HPA it makes).

kubernetes-validate has no schema for KEDA's CRD: the ScaledObject's fields are checked here by
hand against KEDA's ScaledObject specification (keda.sh/docs/latest/reference/scaledobject-spec),
and its HPA behavior is validated by kubernetes-validate inside a real autoscaling/v2 HPA (KEDA
copies it there verbatim). Everything else rendered is validated strictly, as in test_k8s.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.dockerfile_parser import REPO_ROOT

K8S = REPO_ROOT / "deploy" / "k8s"
BASE = K8S / "base"
GPU_OVERLAY = K8S / "overlays" / "gpu"
K8S_VERSION = "1.34.0"

# Fields of ScaledObject.spec, and of a trigger, in KEDA's specification.
SPEC_FIELDS = {
    "scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
    "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers",
}  # fmt: skip
TRIGGER_FIELDS = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}
PROMETHEUS_METADATA = {
    "serverAddress", "query", "threshold", "activationThreshold", "namespace",
    "ignoreNullValues", "unsafeSsl", "queryParameters", "customHeaders",
}  # fmt: skip


def rendered(overlay: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    proc = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=True
    )
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def check_scaled_object(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ScaledObject's fields, by hand; returns its spec."""
    scaled = one(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    spec = scaled["spec"]
    assert set(spec) <= SPEC_FIELDS, set(spec) - SPEC_FIELDS
    deployment = one(docs, "Deployment")
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "apps/v1",
        "Deployment",
        deployment["metadata"]["name"],
    )
    # With the PDB allowing one pod down, the floor keeps one serving.
    assert spec["minReplicaCount"] >= 2
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert spec["maxReplicaCount"] > spec["minReplicaCount"]
    names = [t["name"] for t in spec["triggers"]]
    assert len(set(names)) == len(names)
    for trigger in spec["triggers"]:
        assert set(trigger) <= TRIGGER_FIELDS, set(trigger) - TRIGGER_FIELDS
    queue = [t for t in spec["triggers"] if t["type"] == "prometheus"]
    assert len(queue) == 1
    meta = queue[0]["metadata"]
    assert set(meta) <= PROMETHEUS_METADATA, set(meta) - PROMETHEUS_METADATA
    assert meta["serverAddress"].startswith(("http://", "https://"))
    assert "sdpa_backlog_seconds" in meta["query"]
    assert isinstance(meta["threshold"], str)  # KEDA's metadata values are strings
    assert float(meta["threshold"]) > 0
    assert queue[0].get("metricType", "AverageValue") == "AverageValue"

    # The behavior KEDA puts in its HPA, validated as Kubernetes validates an HPA.
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    assert behavior is not None
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-hpa-sdpa-service"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": behavior,
        },
    }
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    return dict(spec)


@pytest.mark.parametrize("overlay", [BASE, GPU_OVERLAY], ids=["base", "gpu"])
def test_everything_but_the_scaled_object_is_valid_kubernetes(overlay: Path) -> None:
    docs = rendered(overlay)
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_base_scales_on_the_backlog_with_cpu_as_fallback() -> None:
    spec = check_scaled_object(rendered(BASE))
    cpu = [t for t in spec["triggers"] if t["type"] == "cpu"]
    assert len(cpu) == 1
    assert cpu[0]["metricType"] == "Utilization"
    # A fallback, not the main signal: a high utilization target.
    assert 70 <= int(cpu[0]["metadata"]["value"]) <= 95
    assert {t["type"] for t in spec["triggers"]} == {"prometheus", "cpu"}
    # No fixed-count fallback: it would override the CPU trigger (kedacore/keda#6659).
    assert "fallback" not in spec


def test_the_gpu_overlay_scales_on_the_backlog_alone() -> None:
    base = check_scaled_object(rendered(BASE))
    spec = check_scaled_object(rendered(GPU_OVERLAY))
    assert [t["type"] for t in spec["triggers"]] == ["prometheus"]
    assert spec["maxReplicaCount"] < base["maxReplicaCount"]  # GPUs are scarce
    gpu_target = float(spec["triggers"][0]["metadata"]["threshold"])
    base_target = float(next(t for t in base["triggers"] if t["type"] == "prometheus")[
        "metadata"]["threshold"])  # fmt: skip
    assert gpu_target > base_target  # more queued work per pod before another GPU


def test_the_scaled_object_is_in_the_base_kustomization() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text(encoding="utf-8"))
    docs = [
        doc
        for name in kustomization["resources"]
        for doc in yaml.safe_load_all((BASE / name).read_text(encoding="utf-8"))
        if doc
    ]
    assert one(docs, "ScaledObject")["metadata"]["name"] == "sdpa-service"
