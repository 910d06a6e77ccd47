"""The pure builders: every manifest valid for Kubernetes 1.30 (quantities and labels as the API
server parses them too), and the engine and gateway arguments accepted by the real `kvfleet`
command-line parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvfleet.cli.main import build_parser
from kvfleet.gateway.commands import settings_from
from kvfleet.operator.build_engine import Mounts, build_engine_deployment, engine_args
from kvfleet.operator.build_gateway import (
    build_gateway_configmap,
    build_gateway_deployment,
    build_gateway_role,
    gateway_args,
)
from kvfleet.operator.common import CONFIG_HASH_ANNOTATION, OperatorConfig, Owner
from kvfleet.operator.reconcile import desired_children
from kvfleet.operator.spec import parse_spec

from .k8s_values import label_errors, quantity_errors

CONFIG = OperatorConfig()
ALL_MONITORING = frozenset({"PodMonitor", "ServiceMonitor", "PrometheusRule"})


def owner(spec: dict[str, Any], name: str = "chat") -> Owner:
    return Owner(name=name, namespace="llm", uid="uid-1", spec=parse_spec(spec))


def samples(repo_root: Path) -> list[Owner]:
    found = []
    for path in sorted(repo_root.glob("manifests/samples/*.yaml")):
        obj = yaml.safe_load(path.read_text())
        found.append(owner(obj["spec"], obj["metadata"]["name"]))
    return found


EXTRA_SPECS: list[dict[str, Any]] = [
    {"model": {"source": "https://example.com/m.Q4_1.gguf", "sha256": "a" * 64}},
    {
        "model": {"source": "pvc://models/base", "loadFormat": "hf"},
        "lora": {
            "maxLoras": 2,
            "adapters": [
                {"name": "sql", "source": "pvc://models/adapters/sql"},
                {"name": "chat", "source": "pvc://adapters/chat"},
            ],
        },
        "gateway": {"apiKeysSecret": {"name": "keys", "key": "keys.json"}},
        "monitoring": {"enabled": False},
    },
    {
        "model": {"source": "llama-3-8b", "loadFormat": "dummy"},
        "engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 3}},
        "resources": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
        "gateway": {"serviceType": "LoadBalancer", "port": 8080, "replicas": 0},
        "replicas": 0,
    },
]


def test_every_child_of_every_sample_is_valid_kubernetes(repo_root: Path) -> None:
    owners = samples(repo_root) + [owner(s) for s in EXTRA_SPECS]
    kinds = set()
    for o in owners:
        for child in desired_children(o, CONFIG, ALL_MONITORING):
            kinds.add(child["kind"])
            if child["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # not a Kubernetes schema; see test_monitoring_objects
            kubernetes_validate.validate(child, "1.30.0", strict=True)
            # (what the schemas do not say: quantities as apimachinery parses them, labels)
            assert quantity_errors(child) == [], (o.name, child["kind"])
            assert label_errors(child) == [], (o.name, child["kind"])
            refs = child["metadata"]["ownerReferences"]
            assert refs == [
                {
                    "apiVersion": "kvfleet.dev/v1alpha1",
                    "kind": "LLMDeployment",
                    "name": o.name,
                    "uid": "uid-1",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
            assert len(child["metadata"]["name"]) <= 63
    assert kinds == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
        "PodMonitor",
        "ServiceMonitor",
        "PrometheusRule",
    }


def test_monitoring_objects_only_where_wanted() -> None:
    on = owner({"model": {"source": "smollm2"}})
    kinds = [c["kind"] for c in desired_children(on, CONFIG, frozenset({"PodMonitor"}))]
    assert "PodMonitor" in kinds
    assert "ServiceMonitor" not in kinds  # the cluster lacks that CRD
    off = owner({"model": {"source": "smollm2"}, "monitoring": {"enabled": False}})
    assert not {"PodMonitor", "ServiceMonitor", "PrometheusRule"} & {
        c["kind"] for c in desired_children(off, CONFIG, ALL_MONITORING)
    }


def _engine_container(o: Owner) -> dict[str, Any]:
    container: dict[str, Any] = build_engine_deployment(o, CONFIG)["spec"]["template"]["spec"][
        "containers"
    ][0]
    return container


def test_engine_args_parse_with_the_real_engine_command() -> None:
    spec = {
        "model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "servedModelName": "qwen"},
        "engine": {
            "maxModelLen": 4096,
            "prefixCaching": False,
            "blockSize": 32,
            "extraArgs": ["--seed=7"],
        },
        "lora": {"maxLoras": 3, "maxCpuLoras": 8, "maxLoraRank": 32},
    }
    args = engine_args(parse_spec(spec), Mounts())
    parsed = build_parser().parse_args(args)
    assert parsed.model == "Qwen/Qwen2.5-7B-Instruct"
    assert parsed.served_model_name == "qwen"
    assert parsed.max_model_len == 4096
    assert parsed.no_prefix_caching
    assert parsed.block_size == 32
    assert parsed.device == "cuda"
    assert parsed.enable_lora
    assert (parsed.max_loras, parsed.max_cpu_loras, parsed.max_lora_rank) == (3, 8, 32)
    assert parsed.seed == 7
    assert parsed.port == 8100
    assert parsed.metrics_compat == "vllm"
    assert parsed.quantization is None
    assert parsed.kv_cache_dtype == "auto"


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq", "rtn", "gguf"])
def test_quantization_and_the_kv_cache_dtype_reach_the_engine(method: str) -> None:
    spec = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
            "engine": {"quantization": method, "kvCacheDtype": "fp8"}}  # fmt: skip
    parsed = build_parser().parse_args(engine_args(parse_spec(spec), Mounts()))
    assert (parsed.quantization, parsed.kv_cache_dtype) == (method, "fp8")


def test_the_crd_offers_exactly_the_engines_quantization_methods() -> None:
    from kvfleet.engine.layers.quantization.scheme import QUANTIZATION_METHODS
    from kvfleet.operator.spec_base import Quantization

    assert tuple(Quantization) == QUANTIZATION_METHODS


def test_cpu_engine_has_no_gpu_and_uses_the_cpu_image() -> None:
    o = owner({"model": {"source": "smollm2"}, "resources": {"gpus": 0, "memory": "3Gi"}})
    container = _engine_container(o)
    assert "--device=cpu" in container["args"]
    assert container["image"] == CONFIG.engine_cpu_image
    assert container["resources"] == {"requests": {"memory": "3Gi"}, "limits": {"memory": "3Gi"}}
    pod = build_engine_deployment(o, CONFIG)["spec"]["template"]["spec"]
    assert "tolerations" not in pod
    assert "nodeSelector" not in pod


def test_gpu_engine_limits_gpus_and_lands_on_gpu_nodes() -> None:
    o = owner(
        {
            "model": {"source": "pvc://models/llama-70b"},
            "engine": {"tensorParallelSize": 4},
            "resources": {"gpuType": "NVIDIA-H100-80GB-HBM3", "shmSize": "16Gi"},
        }
    )
    deployment = build_engine_deployment(o, CONFIG)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert "--tensor-parallel-size=4" in container["args"]
    assert "--model=/mnt/pvc/models/llama-70b" in container["args"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["pvc-0"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    # non-root, read-only root, probes on /health
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"


def test_url_source_is_downloaded_by_an_init_container() -> None:
    source = "https://example.com/files/m.Q4_1.gguf?download=1"
    o = owner({"model": {"source": source, "sha256": "b" * 64}})
    pod = build_engine_deployment(o, CONFIG)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    parsed = build_parser().parse_args(init["args"])
    assert parsed.url == source
    assert parsed.output == "/var/cache/kvfleet/downloads/m.Q4_1.gguf"
    assert parsed.sha256 == "b" * 64
    assert f"--model={parsed.output}" in pod["containers"][0]["args"]


def test_hub_token_comes_from_the_secret() -> None:
    o = owner({"model": {"source": "org/gated", "hubTokenSecret": {"name": "hf", "key": "t"}}})
    env = {e["name"]: e for e in _engine_container(o)["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "t"}}


def test_gateway_args_parse_into_gateway_settings(tmp_path: Path) -> None:
    o = owner(
        {
            "model": {"source": "pvc://models/base"},
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
            "lora": {"adapters": [{"name": "sql", "source": "pvc://adapters/sql"}]},
            "gateway": {
                "routingPolicy": "least-load",
                "rateLimits": {"requestsPerMinute": 60, "tokensPerMinute": 10000},
                "apiKeysSecret": {"name": "keys", "key": "k.json"},
                "activationTimeoutSeconds": 90,
            },
        }
    )
    config_map = build_gateway_configmap(o)
    args_file = tmp_path / "args"
    args_file.write_text(config_map["data"]["args"])
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": []}))
    # the gateway reads the ConfigMap through `@FILE`; the keys path is the Secret's mount
    lines = [f"--api-keys={keys}" if a.startswith("--api-keys=") else a for a in gateway_args(o)]
    assert "--api-keys=/etc/kvfleet/keys/keys.json" in gateway_args(o)
    args_file.write_text("\n".join(lines) + "\n")
    parsed = build_parser().parse_args(["gateway", f"@{args_file}"])
    settings = settings_from(parsed)
    assert settings.discover == ("llm", "chat-engine", "http")
    namespace, name, policy = settings.autoscale
    assert (namespace, name, policy.min_replicas, policy.max_replicas) == ("llm", "chat", 2, 6)
    assert settings.policy.value == "least-load"
    assert settings.default_limits.requests_per_min == 60
    assert settings.adapters == (("sql", "/mnt/pvc/adapters/sql"),)
    assert settings.activation_timeout_s == 90
    deployment = build_gateway_deployment(o, CONFIG)
    pod = deployment["spec"]["template"]["spec"]
    env = pod["containers"][0]["env"]
    assert env == [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    assert pod["containers"][0]["args"] == ["gateway", "@/etc/kvfleet/gateway/args"]
    secret = next(v for v in pod["volumes"] if v["name"] == "api-keys")["secret"]
    assert secret == {"secretName": "keys", "items": [{"key": "k.json", "path": "keys.json"}]}


def test_gateway_role_grants_scale_only_with_autoscaling() -> None:
    plain = build_gateway_role(owner({"model": {"source": "smollm2"}}))
    assert [r["resources"] for r in plain["rules"]] == [["endpointslices"]]
    scaling = build_gateway_role(
        owner({"model": {"source": "smollm2"}, "autoscaling": {"enabled": True}})
    )
    scale_rule = scaling["rules"][1]
    assert scale_rule["resources"] == ["llmdeployments/scale"]
    assert scale_rule["resourceNames"] == ["chat"]
    assert scale_rule["verbs"] == ["get", "patch"]


def test_gateway_rolls_when_its_arguments_change() -> None:
    first = build_gateway_deployment(owner({"model": {"source": "smollm2"}}), CONFIG)
    second = build_gateway_deployment(
        owner({"model": {"source": "smollm2"}, "gateway": {"maxImbalance": 2}}), CONFIG
    )
    again = build_gateway_deployment(owner({"model": {"source": "smollm2"}}), CONFIG)

    def digest(d: dict[str, Any]) -> str:
        return str(d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])

    assert digest(first) != digest(second)
    assert digest(first) == digest(again)


@pytest.mark.parametrize(
    ("replicas", "autoscaling", "expected"),
    [(3, None, 3), (9, {"enabled": True, "maxReplicas": 4}, 4), (0, {"enabled": True}, 1)],
)
def test_engine_replicas_follow_spec_within_autoscaling_bounds(
    replicas: int, autoscaling: dict[str, Any] | None, expected: int
) -> None:
    spec: dict[str, Any] = {"model": {"source": "smollm2"}, "replicas": replicas}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    assert build_engine_deployment(owner(spec), CONFIG)["spec"]["replicas"] == expected


def test_engine_takes_the_operators_tensor_parallelism_and_speculation() -> None:
    from kvfleet.engine.config import SpeculativeConfig
    from kvfleet.engine.server.commands import _settings

    args = build_parser().parse_args(["engine", "--tensor-parallel-size=2"])
    assert _settings(args, args.model).engine.tensor_parallel_size == 2
    for spec, want in (
        (
            {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 5},
            SpeculativeConfig("ngram", 3, prompt_lookup_max=5),
        ),
        (
            {"method": "draft", "draftModel": "smollm2"},
            SpeculativeConfig("draft", 4, model="smollm2"),
        ),
    ):
        o = owner({"model": {"source": "smollm2"}, "engine": {"speculative": spec}})
        given = _engine_container(o)["args"]
        args = build_parser().parse_args(given)
        assert _settings(args, args.model).engine.speculative == want
    for flag, error in (
        ('{"method":"ngram"}', "needs 'num_speculative_tokens'"),
        ('{"method":"ngram","num_speculative_tokens":4,"k":1}', "unknown speculative config keys"),
        ("{method: ngram}", "not valid JSON"),
    ):
        args = build_parser().parse_args(["engine", f"--speculative-config={flag}"])
        with pytest.raises(SystemExit, match=f"--speculative-config: .*{error}"):
            _settings(args, args.model)


def test_prometheus_rule_carries_the_deployments_slos() -> None:
    from kvfleet.operator.build_monitoring import build_prometheus_rule

    slo = {"availability": 0.995, "latency": 0.9, "ttftThreshold": "250ms"}
    o = owner({"model": {"source": "smollm2"}, "monitoring": {"slo": slo}})
    rules = [r for g in build_prometheus_rule(o)["spec"]["groups"] for r in g["rules"]]
    exprs = [r["expr"] for r in rules]
    assert "vector(0.995)" in exprs
    assert "vector(0.9)" in exprs
    assert any('le="0.25"' in e for e in exprs)
    page = next(r for r in rules if r.get("alert") == "KvfleetAvailabilityBurnRateCritical")
    assert "> 0.072" in page["expr"]  # 14.4 x the 0.5% budget
    assert all('namespace="llm"' in e for e in exprs if "kvfleet_slo:error_ratio" in e)


def test_the_gateway_role_names_the_lease_the_gateway_elects_with() -> None:
    from kvfleet.gateway.leader import autoscaler_lease_name as gateway_lease
    from kvfleet.operator.build_gateway import build_gateway_role

    o = owner({"model": {"source": "smollm2"}, "autoscaling": {"enabled": True}})
    named = [r for r in build_gateway_role(o)["rules"] if r.get("resourceNames")]
    leases = [r for r in named if r["resources"] == ["leases"]]
    assert leases[0]["resourceNames"] == [gateway_lease(o.name)]
