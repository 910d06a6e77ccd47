"""Pure builders for the engine side: Deployment, headless Service, PodDisruptionBudget.

Where the model comes from decides volumes and arguments: a built-in alias or hub id is fetched
into the model cache volume by the engine itself; a URL is downloaded by an init container; a
`pvc://CLAIM/PATH` mounts the claim read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from kvfleet.engine.config import SpeculativeConfig, engine_settings
from kvfleet.engine.config.settings import flags_for
from kvfleet.operator.common import (
    ENGINE,
    ENGINE_PORT,
    OperatorConfig,
    Owner,
    container_security_context,
    http_probe,
    pod_security_context,
)
from kvfleet.operator.spec import LLMDeploymentSpec

CACHE_DIR = "/var/cache/kvfleet"
PVC_ROOT = "/mnt/pvc"
SHUTDOWN_TIMEOUT_S = 20  # in-flight requests get this long on SIGTERM; the pod gets 10 s more


@dataclass
class Mounts:
    """PersistentVolumeClaims the engine reads models and adapters from, each mounted once."""

    claims: list[str] = field(default_factory=list)

    def path(self, source: str) -> str:
        """Where a `pvc://CLAIM/PATH` source appears in the pod; other sources pass through."""
        if not source.startswith("pvc://"):
            return source
        claim, _, rest = source.removeprefix("pvc://").partition("/")
        if claim not in self.claims:
            self.claims.append(claim)
        return f"{PVC_ROOT}/{claim}/{rest}"

    def volumes(self) -> list[dict[str, Any]]:
        return [
            {"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
            for i, c in enumerate(self.claims)
        ]

    def volume_mounts(self) -> list[dict[str, Any]]:
        return [
            {"name": f"pvc-{i}", "mountPath": f"{PVC_ROOT}/{c}", "readOnly": True}
            for i, c in enumerate(self.claims)
        ]


def url_download_path(source: str) -> str:
    """Where the init container puts a URL source's file in the model cache."""
    name = urlparse(source).path.rsplit("/", 1)[-1] or "model.gguf"
    return f"{CACHE_DIR}/downloads/{name}"


def engine_model_argument(spec: LLMDeploymentSpec, mounts: Mounts) -> str:
    source = spec.model.source
    if source.startswith(("http://", "https://")):
        return url_download_path(source)
    return mounts.path(source.removeprefix("hf://"))


def engine_args(spec: LLMDeploymentSpec, mounts: Mounts) -> list[str]:
    """`kvfleet engine` arguments for one replica: the engine settings the spec gives, as the
    engine's settings table names them (`flags_for`), then the server's."""
    engine = spec.engine
    settings: dict[str, Any] = {
        "load_format": spec.model.load_format,
        "dtype": engine.dtype,
        "quantization": engine.quantization,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "device": "cuda" if spec.gpus > 0 else "cpu",
        "block_size": engine.block_size,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "max_model_len": engine.max_model_len,
        "enable_prefix_caching": engine.prefix_caching,
        "tokenizer": mounts.path(spec.model.tokenizer) if spec.model.tokenizer else None,
    }
    if spec.lora is not None:
        settings |= {
            "enable_lora": True,
            "max_loras": spec.lora.max_loras,
            "max_lora_rank": spec.lora.max_lora_rank,
            "max_cpu_loras": spec.lora.max_cpu_loras,
        }
    if engine.speculative is not None:
        settings["speculative_config"] = SpeculativeConfig.parse(engine.speculative.engine_config())
    return [
        "engine",
        f"--model={engine_model_argument(spec, mounts)}",
        "--host=0.0.0.0",
        f"--port={ENGINE_PORT}",
        f"--served-model-name={spec.served_model_name}",
        *flags_for(engine_settings(), settings),
        f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
        # the model-server metric names the Gateway API Inference Extension and llm-d's endpoint
        # picker read, beside kvfleet's own: engines work behind those gateways unchanged
        "--metrics-compat=vllm",
        *engine.extra_args,
    ]


def _env(spec: LLMDeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "KVFLEET_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "HOME", "value": f"{CACHE_DIR}/home"},  # Triton's kernel cache lives under it
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    secret = spec.model.hub_token_secret
    if secret is not None:
        ref = {"secretKeyRef": {"name": secret.name, "key": secret.key}}
        env.append({"name": "HF_TOKEN", "valueFrom": ref})
    return env


def _resources(spec: LLMDeploymentSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.resources.cpu is not None:
        requests["cpu"] = str(spec.resources.cpu)
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.gpus > 0:
        limits[spec.resources.gpu_resource] = str(spec.gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _scheduling(spec: LLMDeploymentSpec) -> dict[str, Any]:
    node_selector = dict(spec.resources.node_selector)
    tolerations = [
        t.model_dump(by_alias=True, exclude_none=True) for t in spec.resources.tolerations
    ]
    if spec.gpus > 0:
        if spec.resources.gpu_type:
            node_selector.setdefault("nvidia.com/gpu.product", spec.resources.gpu_type)
        # GPU nodes are commonly tainted with their resource name so that only GPU pods land there.
        gpu_taint = {"key": spec.resources.gpu_resource, "operator": "Exists"}
        if not any(t.get("key") == spec.resources.gpu_resource for t in tolerations):
            tolerations.append({**gpu_taint, "effect": "NoSchedule"})
    out: dict[str, Any] = {}
    if node_selector:
        out["nodeSelector"] = node_selector
    if tolerations:
        out["tolerations"] = tolerations
    return out


def _init_containers(owner: Owner, image: str, pull_policy: str) -> list[dict[str, Any]]:
    spec = owner.spec
    if not spec.model.source.startswith(("http://", "https://")):
        return []
    args = [
        "models",
        "download",
        spec.model.source,
        f"--output={url_download_path(spec.model.source)}",
    ]
    if spec.model.sha256:
        args.append(f"--sha256={spec.model.sha256}")
    return [
        {
            "name": "fetch-model",
            "image": image,
            "imagePullPolicy": pull_policy,
            "command": ["kvfleet"],
            "args": args,
            "env": _env(spec),
            "securityContext": container_security_context(),
            "volumeMounts": [{"name": "model-cache", "mountPath": CACHE_DIR}],
        }
    ]


def engine_image(spec: LLMDeploymentSpec, config: OperatorConfig) -> str:
    if spec.images.engine:
        return spec.images.engine
    return config.engine_image if spec.gpus > 0 else config.engine_cpu_image


def build_engine_deployment(owner: Owner, config: OperatorConfig) -> dict[str, Any]:
    spec = owner.spec
    mounts = Mounts()
    args = engine_args(spec, mounts)
    for adapter in spec.lora.adapters if spec.lora else []:
        mounts.path(adapter.source)  # adapters are loaded by path through the engine's API
    image = engine_image(spec, config)
    pull_policy = str(spec.images.pull_policy)
    container = {
        "name": ENGINE,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["kvfleet"],
        "args": args,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _env(spec),
        # /health answers 503 while the model loads: the startup probe allows an hour for
        # downloads and loading before liveness takes over.
        "startupProbe": http_probe("/health", "http", 10, 360),
        "readinessProbe": http_probe("/health", "http", 5, 2),
        "livenessProbe": http_probe("/health", "http", 10, 3),
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            *mounts.volume_mounts(),
        ],
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": SHUTDOWN_TIMEOUT_S + 10,
        "containers": [container],
        "volumes": [
            {"name": "model-cache", "emptyDir": {"sizeLimit": spec.model.cache_size}},
            {
                "name": "dshm",
                "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size},
            },
            {"name": "tmp", "emptyDir": {}},
            *mounts.volumes(),
        ],
        **_scheduling(spec),
    }
    init = _init_containers(owner, image, pull_policy)
    if init:
        pod_spec["initContainers"] = init
    if spec.images.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.images.pull_secrets]
    # GPUs are scarce: a surge pod would wait for a free GPU, so replace in place instead.
    rolling = (
        {"maxSurge": 0, "maxUnavailable": 1} if spec.gpus else {"maxSurge": 1, "maxUnavailable": 0}
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.metadata(ENGINE),
        "spec": {
            "replicas": spec.engine_replicas,
            "selector": {"matchLabels": owner.selector(ENGINE)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": {"metadata": {"labels": owner.labels(ENGINE)}, "spec": pod_spec},
        },
    }


def build_engine_service(owner: Owner) -> dict[str, Any]:
    """Headless: the gateway routes to each engine pod itself (prefix-aware), through the
    Service's EndpointSlices."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(ENGINE),
        "spec": {
            "clusterIP": "None",
            "selector": owner.selector(ENGINE),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
            "publishNotReadyAddresses": False,
        },
    }


def build_engine_pdb(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owner.metadata(ENGINE),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": owner.selector(ENGINE)}},
    }
