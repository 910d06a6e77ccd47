"""manifests/ and crds/: every object valid for Kubernetes 1.30, the kustomizations render (with
`kubectl kustomize` where kubectl exists, and always with the small renderer here), and the
operator's RBAC is exactly what its code needs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvfleet.operator.build_gateway import build_gateway_role
from kvfleet.operator.common import OperatorConfig, Owner
from kvfleet.operator.kube import RESOURCES
from kvfleet.operator.reconcile import desired_children
from kvfleet.operator.spec import parse_spec

CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
BASES = ["manifests", "manifests/operator", "manifests/monitoring", "crds"]


def render(folder: Path) -> list[dict[str, Any]]:
    """What `kustomize build` makes of our kustomizations: resources, recursively, and the
    namespace of namespaced objects (the only transformer they use)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    used = {"apiVersion", "kind", "resources", "namespace", "configMapGenerator"}
    assert set(kustomization) <= used | {"generatorOptions"}, folder
    objects: list[dict[str, Any]] = []
    for entry in kustomization["resources"]:
        path = (folder / entry).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
    options = kustomization.get("generatorOptions", {})
    for generator in kustomization.get("configMapGenerator", []):
        assert options.get("disableNameSuffixHash"), "names stay stable for Grafana's sidecar"
        data = {Path(f).name: (folder / f).read_text() for f in generator["files"]}
        metadata = {"name": generator["name"], "labels": options.get("labels", {})}
        config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
        objects.append(config_map)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def identity(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


@pytest.mark.parametrize("base", BASES)
def test_kustomization_renders_valid_objects(repo_root: Path, base: str) -> None:
    objects = render(repo_root / base)
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            for group in obj["spec"]["groups"]:
                for rule in group["rules"]:
                    assert ("record" in rule) != ("alert" in rule), rule
                    assert rule["expr"], rule
            continue
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        result = subprocess.run(
            [kubectl, "kustomize", str(repo_root / base)],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        rendered = [o for o in yaml.safe_load_all(result.stdout) if o]
        assert sorted(map(identity, rendered)) == sorted(map(identity, objects))


def test_install_base_has_crd_namespace_and_operator(repo_root: Path) -> None:
    kinds = {identity(o) for o in render(repo_root / "manifests")}
    assert kinds == {
        ("Namespace", "", "kvfleet-system"),
        ("CustomResourceDefinition", "", "llmdeployments.kvfleet.dev"),
        ("ServiceAccount", "kvfleet-system", "kvfleet-operator"),
        ("ClusterRole", "", "kvfleet-operator"),
        ("ClusterRoleBinding", "", "kvfleet-operator"),
        ("Deployment", "kvfleet-system", "kvfleet-operator"),
    }


def test_every_yaml_file_is_valid(repo_root: Path) -> None:
    files = sorted(repo_root.glob("manifests/**/*.yaml")) + sorted(repo_root.glob("crds/*.yaml"))
    checked = 0
    for path in files:
        for obj in yaml.safe_load_all(path.read_text()):
            if not obj or obj.get("kind") == "Kustomization":
                continue
            if obj["apiVersion"].startswith(("kvfleet.dev/", "monitoring.coreos.com/")):
                continue  # samples: test_crd admits them; rules: checked above
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
            checked += 1
    assert checked >= 6


def _cluster_role(repo_root: Path) -> list[dict[str, Any]]:
    role = yaml.safe_load((repo_root / "manifests/operator/clusterrole.yaml").read_text())
    rules: list[dict[str, Any]] = role["rules"]
    return rules


def _allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules
    )


def test_operator_rbac_is_least_privilege_and_sufficient(repo_root: Path) -> None:
    rules = _cluster_role(repo_root)
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        assert "resourceNames" not in rule or rule["resourceNames"]
    # every child the operator can write: server-side apply needs create and patch, status reads get
    spec = {
        "model": {"source": "smollm2"},
        "autoscaling": {"enabled": True},
        "lora": {"adapters": [{"name": "a", "source": "/adapters/a"}]},
    }
    owner = Owner("chat", "llm", "uid", parse_spec(spec))
    monitoring = frozenset({"PodMonitor", "ServiceMonitor", "PrometheusRule"})
    needed: set[tuple[str, str, str]] = set()
    for child in desired_children(owner, OperatorConfig(), monitoring):
        prefix, plural = RESOURCES[child["kind"]]
        group = "" if prefix == "/api/v1" else prefix.split("/")[2]
        needed |= {(group, plural, "create"), (group, plural, "patch"), (group, plural, "get")}
    needed |= {("monitoring.coreos.com", p, "delete") for p in ("podmonitors", "servicemonitors")}
    needed |= {("apps", "deployments", v) for v in ("list", "watch")}  # kopf event handler
    needed |= {("kvfleet.dev", "llmdeployments", v) for v in ("get", "list", "watch", "patch")}
    needed |= {("kvfleet.dev", "llmdeployments/status", "patch")}
    # children carry blockOwnerDeletion: OwnerReferencesPermissionEnforcement asks for this
    needed |= {("kvfleet.dev", "llmdeployments/finalizers", "update")}
    needed |= {("", "events", "create"), ("", "events", "patch")}  # Events, and their repeats
    needed |= {("apiextensions.k8s.io", "customresourcedefinitions", "get")}
    for group, resource, verb in sorted(needed):
        assert _allows(rules, group, resource, verb), (group, resource, verb)
    # ...and nothing beyond: each granted (group, resource, verb) is needed, or is kopf's own
    kopf_needs = {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("kvfleet.dev", "llmdeployments/status", "get"),
        ("monitoring.coreos.com", "prometheusrules", "delete"),
    }
    gateway_rules = build_gateway_role(owner)["rules"]
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted = (group, resource, verb)
                    delegated = _allows(gateway_rules, group, resource, verb)
                    assert granted in needed | kopf_needs or delegated, granted
    # RBAC escalation check: the operator holds everything it grants the gateways
    for rule in gateway_rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert _allows(rules, group, resource, verb), (group, resource, verb)


def test_operator_deployment_is_non_root_and_pinned(repo_root: Path) -> None:
    deployment = yaml.safe_load((repo_root / "manifests/operator/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    images = [container["image"]] + [e["value"] for e in container["env"] if "IMAGE" in e["name"]]
    for image in images:
        assert ":" in image, image
        assert not image.endswith(":latest"), image
    assert container["args"][0] == "operator"
    assert (
        OperatorConfig.from_environment({e["name"]: e["value"] for e in container["env"]})
        == OperatorConfig()
    )
