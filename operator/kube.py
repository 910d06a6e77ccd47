"""The few Kubernetes API calls the operator makes, over the official client's ApiClient.

Children are written with server-side apply (`PATCH` with `application/apply-patch+yaml`, field
manager `kvfleet-operator`, forced): the same call creates, updates, and changes nothing when
nothing changed, so reconciling is idempotent by construction.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.common import MANAGED_BY
from kvfleet.operator.spec_base import GROUP, PLURAL, VERSION

# kind -> (API path prefix, plural) for every kind the operator writes or reads
RESOURCES: Mapping[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "PodMonitor": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
    "ServiceMonitor": ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    "PrometheusRule": ("/apis/monitoring.coreos.com/v1", "prometheusrules"),
    "LLMDeployment": (f"/apis/{GROUP}/{VERSION}", PLURAL),
    "Event": ("/api/v1", "events"),
}


@dataclass(frozen=True)
class Applied:
    """What a server-side apply answered: the object as stored, and whether it was created."""

    object: dict[str, Any]
    created: bool


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0: the server could not be reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API error {status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        return self.status in (0, 409, 429) or self.status >= 500


def object_path(kind: str, namespace: str | None, name: str | None = None) -> str:
    """The object's (or, without a name, the collection's) path; no namespace: every one."""
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


class ClusterUnreachableError(Exception):
    """No API server answers: the message says why and what to set."""


def connect(timeout_s: float = 10.0) -> tuple[KubeApi, dict[str, Any]]:
    """A KubeApi for the cluster this process runs in (or $KUBECONFIG's), and its version."""
    from kubernetes import client, config

    try:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            # $KUBECONFIG as it is now (the client reads it once, when first imported)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    except Exception as exc:
        raise ClusterUnreachableError(
            "no Kubernetes cluster is reachable: no in-cluster service account and no usable "
            f"kubeconfig ({exc}); set KUBECONFIG, or run the operator in a pod with the RBAC of "
            "manifests/operator"
        ) from None
    api = KubeApi(client.ApiClient(), timeout_s=timeout_s)
    try:
        version = api.version()
    except KubeError as exc:
        host = api.api_client.configuration.host
        raise ClusterUnreachableError(
            f"no Kubernetes cluster is reachable: the API server at {host} does not answer ({exc})"
        ) from None
    return api, version


class KubeApi:
    """Typed-enough access for the operator: dicts in, dicts out."""

    def __init__(self, api_client: Any, timeout_s: float = 30.0) -> None:
        self.api_client = api_client
        self.timeout_s = timeout_s

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
    ) -> tuple[int, Any]:
        """(HTTP status, decoded body) of a successful call; KubeError otherwise."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            request = self.api_client.param_serialize(
                method,
                path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self.api_client.call_api(*request, _request_timeout=self.timeout_s)
            data = response.read()
        except ApiException as exc:
            raise KubeError(int(exc.status or 0), str(exc.reason)) from None
        except HTTPError as exc:
            raise KubeError(0, f"cannot reach the API server: {exc}") from None
        if not 200 <= response.status < 300:
            raise KubeError(response.status, _reason(data, response.reason))
        return response.status, json.loads(data) if data else None

    def version(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/version")[1]
        return result

    def apply(self, manifest: Mapping[str, Any], dry_run: bool = False) -> Applied:
        """Server-side apply; `dry_run`: the server validates and admits it, stores nothing."""
        meta = manifest["metadata"]
        path = object_path(manifest["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", MANAGED_BY), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        status, result = self._call(
            "PATCH", path, dict(manifest), query, "application/apply-patch+yaml"
        )
        return Applied(result, created=status == 201)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self._call("GET", object_path(kind, namespace, name))[1]
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return result

    def list(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every object of a kind, in one namespace or (None) in all."""
        items: list[dict[str, Any]] = self._call("GET", object_path(kind, namespace))[1]["items"]
        return items

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        path = object_path(manifest["kind"], manifest["metadata"]["namespace"])
        result: dict[str, Any] = self._call("POST", path, dict(manifest))[1]
        return result

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """A JSON merge patch of the main resource."""
        path = object_path(kind, namespace, name)
        self._call("PATCH", path, dict(patch), None, "application/merge-patch+json")

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete one object (its dependents follow through the garbage collector); False when
        there was none."""
        try:
            self._call("DELETE", object_path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        path = object_path("LLMDeployment", namespace, name) + "/status"
        self._call("PATCH", path, {"status": dict(status)}, None, "application/merge-patch+json")

    def has_crd(self, name: str) -> bool:
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
        try:
            self._call("GET", path)
        except KubeError as exc:
            if exc.status in (403, 404):  # no CRD, or no right to know: create nothing
                return False
            raise
        return True


def _reason(data: bytes, fallback: str) -> str:
    try:
        return str(json.loads(data)["message"])
    except (TypeError, ValueError, KeyError):
        return fallback
