"""What every builder shares: the owner, names, labels, images and the pod security baseline."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.spec import LLMDeploymentSpec
from kvfleet.operator.spec_base import API_VERSION, KIND

MANAGED_BY = "kvfleet-operator"  # also the server-side apply field manager
ENGINE, GATEWAY = "engine", "gateway"
ENGINE_PORT, GATEWAY_PORT = 8100, 8000
CONFIG_HASH_ANNOTATION = "kvfleet.dev/config-hash"
VERSION = "0.1.0"


@dataclass(frozen=True)
class OperatorConfig:
    """Images the operator uses when a spec names none (set on the operator's Deployment)."""

    engine_image: str = f"ghcr.io/kvfleet/engine:{VERSION}"
    engine_cpu_image: str = f"ghcr.io/kvfleet/engine-cpu:{VERSION}"
    gateway_image: str = f"ghcr.io/kvfleet/gateway:{VERSION}"
    cluster_domain: str = "cluster.local"

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> OperatorConfig:
        default = cls()
        return cls(
            engine_image=environ.get("KVFLEET_ENGINE_IMAGE", default.engine_image),
            engine_cpu_image=environ.get("KVFLEET_ENGINE_CPU_IMAGE", default.engine_cpu_image),
            gateway_image=environ.get("KVFLEET_GATEWAY_IMAGE", default.gateway_image),
            cluster_domain=environ.get("KVFLEET_CLUSTER_DOMAIN", default.cluster_domain),
        )


@dataclass(frozen=True)
class Owner:
    """The LLMDeployment the children belong to."""

    name: str
    namespace: str
    uid: str
    spec: LLMDeploymentSpec
    generation: int = 1

    def names(self, component: str) -> str:
        """Child object names: `NAME` is the gateway Service (the endpoint), `NAME-COMPONENT` the
        rest."""
        return f"{self.name}-{component}"

    def labels(self, component: str) -> dict[str, str]:
        return {
            **self.selector(component),
            "app.kubernetes.io/name": "kvfleet",
            "app.kubernetes.io/version": VERSION,
            "app.kubernetes.io/managed-by": MANAGED_BY,
            "app.kubernetes.io/part-of": "kvfleet",
        }

    def selector(self, component: str) -> dict[str, str]:
        """Immutable Deployment selectors: only labels that never change."""
        return {"app.kubernetes.io/instance": self.name, "app.kubernetes.io/component": component}

    def metadata(self, component: str, name: str | None = None) -> dict[str, Any]:
        return {
            "name": name or self.names(component),
            "namespace": self.namespace,
            "labels": self.labels(component),
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": self.name,
                    "uid": self.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }

    def endpoint(self, config: OperatorConfig) -> str:
        port = self.spec.gateway.port
        host = f"{self.name}.{self.namespace}.svc.{config.cluster_domain}"
        return f"http://{host}{'' if port == 80 else f':{port}'}/v1"


def config_hash(data: Any) -> str:
    """A short stable digest: a pod-template annotation that rolls pods when config changes."""
    encoded = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def http_probe(path: str, port: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }
