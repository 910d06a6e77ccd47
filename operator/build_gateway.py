"""Pure builders for the gateway side: its arguments ConfigMap, RBAC, Deployment and Service.

The gateway reads its arguments from the ConfigMap (`kvfleet gateway @FILE`, one per line); the
pod template carries the arguments' hash so a change rolls the gateway pods.
"""

from __future__ import annotations

from typing import Any

from kvfleet.operator.build_engine import Mounts
from kvfleet.operator.common import (
    CONFIG_HASH_ANNOTATION,
    ENGINE,
    GATEWAY,
    GATEWAY_PORT,
    OperatorConfig,
    Owner,
    config_hash,
    container_security_context,
    pod_security_context,
)
from kvfleet.operator.spec_base import GROUP, PLURAL

CONFIG_DIR = "/etc/kvfleet/gateway"
KEYS_DIR = "/etc/kvfleet/keys"
ARGS_KEY = "args"


def gateway_args(owner: Owner) -> list[str]:
    spec, gateway = owner.spec, owner.spec.gateway
    args = [
        "--discover=k8s",
        f"--namespace={owner.namespace}",
        f"--service={owner.names(ENGINE)}",
        "--port-name=http",
        f"--port={GATEWAY_PORT}",
        f"--policy={gateway.routing_policy}",
        f"--max-imbalance={gateway.max_imbalance}",
        f"--max-inflight-per-replica={gateway.max_inflight_per_replica}",
        f"--queue-capacity={gateway.queue_capacity}",
        f"--queue-timeout={gateway.queue_timeout_seconds}",
        # the gateway pods (several, or two during a rollout) hold the per-key limits together
        f"--peers-service={owner.name}",
    ]
    limits = gateway.rate_limits
    if limits.requests_per_minute is not None:
        args.append(f"--requests-per-min={limits.requests_per_minute}")
    if limits.tokens_per_minute is not None:
        args.append(f"--tokens-per-min={limits.tokens_per_minute}")
    if gateway.api_keys_secret is not None:
        args.append(f"--api-keys={KEYS_DIR}/keys.json")
    scaling = spec.autoscaling
    if scaling.enabled:
        args += [
            f"--autoscale={owner.namespace}/{owner.name}",
            f"--min-replicas={scaling.min_replicas}",
            f"--max-replicas={scaling.max_replicas}",
            f"--target-kv-usage={scaling.target_kv_cache_usage}",
            f"--target-waiting={scaling.target_queue_length}",
            f"--scale-down-window={scaling.scale_down_window_seconds}",
            f"--activation-timeout={gateway.activation_timeout_seconds}",
        ]
    mounts = Mounts()  # the same paths the engine pods mount the adapters' claims at
    for adapter in spec.lora.adapters if spec.lora else []:
        args.append(f"--lora-adapter={adapter.name}={mounts.path(adapter.source)}")
    return args


def autoscaler_lease_name(name: str) -> str:
    """The Lease the gateway pods of LLMDeployment `name` elect their autoscaler with (the
    gateway derives the same name from `--autoscale NAMESPACE/NAME`)."""
    return f"{name}-autoscaler"


def build_gateway_configmap(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owner.metadata(GATEWAY),
        "data": {ARGS_KEY: "\n".join(gateway_args(owner)) + "\n"},
    }


def build_gateway_service_account(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": owner.metadata(GATEWAY)}


def build_gateway_role(owner: Owner) -> dict[str, Any]:
    """Least privilege: watch its engines' EndpointSlices; with autoscaling on, read and write
    the scale of its own LLMDeployment only."""
    rules: list[dict[str, Any]] = [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        }
    ]
    if owner.spec.autoscaling.enabled:
        rules += [
            {
                "apiGroups": [GROUP],
                "resources": [f"{PLURAL}/scale"],
                "resourceNames": [owner.name],
                "verbs": ["get", "patch"],
            },
            # the Lease electing the one gateway pod that writes the scale (create cannot be
            # limited to a name: RBAC does not know it before the object exists)
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [autoscaler_lease_name(owner.name)],
                "verbs": ["get", "update"],
            },
        ]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": owner.metadata(GATEWAY),
        "rules": rules,
    }


def build_gateway_role_binding(owner: Owner) -> dict[str, Any]:
    name = owner.names(GATEWAY)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": owner.metadata(GATEWAY),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }


def build_gateway_deployment(owner: Owner, config: OperatorConfig) -> dict[str, Any]:
    spec = owner.spec
    gateway = spec.gateway
    tcp = {"tcpSocket": {"port": "http"}, "timeoutSeconds": 2}
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": owner.names(GATEWAY)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if gateway.api_keys_secret is not None:
        secret = gateway.api_keys_secret
        items = [{"key": secret.key, "path": "keys.json"}]
        volumes.append({"name": "api-keys", "secret": {"secretName": secret.name, "items": items}})
        mounts.append({"name": "api-keys", "mountPath": KEYS_DIR, "readOnly": True})
    container = {
        "name": GATEWAY,
        "image": spec.images.gateway or config.gateway_image,
        "imagePullPolicy": str(spec.images.pull_policy),
        "command": ["kvfleet"],
        "args": [GATEWAY, f"@{CONFIG_DIR}/{ARGS_KEY}"],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        # The gateway answers 503 with an OpenAI error body when no engine is ready, which
        # is better for clients than no endpoint at all: probe the process, not the engines.
        "readinessProbe": {**tcp, "periodSeconds": 5},
        "livenessProbe": {**tcp, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {
            "requests": {"cpu": str(gateway.resources.cpu), "memory": gateway.resources.memory},
            "limits": {"memory": gateway.resources.memory},
        },
        # the pod's name: its identity in the autoscaler's leader election
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": owner.names(GATEWAY),
        "securityContext": pod_security_context(),
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
    }
    if spec.images.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.images.pull_secrets]
    annotations = {CONFIG_HASH_ANNOTATION: config_hash(gateway_args(owner))}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.metadata(GATEWAY),
        "spec": {
            "replicas": gateway.replicas,
            "selector": {"matchLabels": owner.selector(GATEWAY)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {"labels": owner.labels(GATEWAY), "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def build_gateway_service(owner: Owner) -> dict[str, Any]:
    """The endpoint clients call: named after the LLMDeployment itself."""
    port = {
        "name": "http",
        "port": owner.spec.gateway.port,
        "targetPort": "http",
        "protocol": "TCP",
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(GATEWAY, name=owner.name),
        "spec": {
            "type": str(owner.spec.gateway.service_type),
            "selector": owner.selector(GATEWAY),
            "ports": [port],
        },
    }
