"""The resources the fake API serves, and their discovery documents (what kopf reads to find
the LLMDeployment, Deployment and CRD resources before it watches them)."""

from __future__ import annotations

from typing import Any

Resources = dict[tuple[str, str], tuple[str, bool]]

# (prefix, plural) -> (kind, namespaced)
BUILTIN: Resources = {
    ("/apis/apps/v1", "deployments"): ("Deployment", True),
    ("/api/v1", "services"): ("Service", True),
    ("/api/v1", "configmaps"): ("ConfigMap", True),
    ("/api/v1", "serviceaccounts"): ("ServiceAccount", True),
    ("/api/v1", "events"): ("Event", True),
    ("/api/v1", "namespaces"): ("Namespace", False),
    ("/apis/rbac.authorization.k8s.io/v1", "roles"): ("Role", True),
    ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"): ("RoleBinding", True),
    ("/apis/policy/v1", "poddisruptionbudgets"): ("PodDisruptionBudget", True),
    ("/apis/discovery.k8s.io/v1", "endpointslices"): ("EndpointSlice", True),
    ("/apis/coordination.k8s.io/v1", "leases"): ("Lease", True),
    ("/apis/kvfleet.dev/v1alpha1", "llmdeployments"): ("LLMDeployment", True),
    ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions"): (
        "CustomResourceDefinition",
        False,
    ),
}
MONITORING = {
    "podmonitors.monitoring.coreos.com": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
    "servicemonitors.monitoring.coreos.com": ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    "prometheusrules.monitoring.coreos.com": ("/apis/monitoring.coreos.com/v1", "prometheusrules"),
}
MONITORING_KINDS = {"podmonitors": "PodMonitor", "servicemonitors": "ServiceMonitor"}
MONITORING_KINDS["prometheusrules"] = "PrometheusRule"
CRD_PREFIX = "/apis/apiextensions.k8s.io/v1"
LLMD = ("/apis/kvfleet.dev/v1alpha1", "llmdeployments")


def group_list(resources: Resources) -> dict[str, Any]:
    """`GET /apis`: every API group version served."""
    versions = sorted({p for p, _ in resources if p.startswith("/apis/")})
    found = []
    for prefix in versions:
        name, version = prefix.removeprefix("/apis/").split("/")
        entry = {"groupVersion": f"{name}/{version}", "version": version}
        found.append({"name": name, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": found}


def resource_list(resources: Resources, prefix: str) -> dict[str, Any]:
    """The discovery document of one API group version (what kopf scans)."""
    found = []
    for (p, plural), (kind, namespaced) in resources.items():
        if p != prefix:
            continue
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        found.append(
            {
                "name": plural,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": verbs,
            }
        )
        if (p, plural) == LLMD:
            for sub in ("status", "scale"):
                found.append(
                    {
                        "name": f"{plural}/{sub}",
                        "singularName": "",
                        "namespaced": True,
                        "kind": "Scale" if sub == "scale" else kind,
                        "verbs": ["get", "patch"],
                    }
                )
    group_version = prefix.removeprefix("/apis/").removeprefix("/api/")
    return {"kind": "APIResourceList", "groupVersion": group_version, "resources": found}
