"""The checked-in CRD matches the pydantic models, is a valid CRD, accepts every sample, and
rejects bad specs with field-level messages, exactly where the operator's own parsing does."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvfleet.operator.crd import render_crd
from kvfleet.operator.spec import InvalidSpecError, LLMDeploymentSpec, parse_spec

from .crd_schema import admit, check_crd

CRD_FILE = "crds/llmdeployments.kvfleet.dev.yaml"


@pytest.fixture(scope="module")
def crd(repo_root: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((repo_root / CRD_FILE).read_text())
    return loaded


def sample_objects(repo_root: Path) -> list[dict[str, Any]]:
    return [
        yaml.safe_load(p.read_text()) for p in sorted(repo_root.glob("manifests/samples/*.yaml"))
    ]


def llmd(spec: dict[str, Any], name: str = "chat") -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def test_checked_in_crd_is_generated_from_the_models(repo_root: Path) -> None:
    assert (repo_root / CRD_FILE).read_text() == render_crd(), (
        "the CRD drifted from kvfleet.operator.spec: run "
        f"`python -m kvfleet.operator.crd > {CRD_FILE}`"
    )


def test_the_api_server_accepts_the_crd(crd: dict[str, Any]) -> None:
    """Every default is valid for its own schema as written, CEL rules included (a rule reading
    a field a `default: {}` lacks made `kubectl apply -k manifests/` fail on a real server)."""
    assert check_crd(crd) == []


def test_a_rule_that_cannot_evaluate_on_a_default_is_refused(crd: dict[str, Any]) -> None:
    broken = copy.deepcopy(crd)
    spec = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["autoscaling"]["default"] = {}
    spec["properties"]["autoscaling"]["x-kubernetes-validations"][0]["rule"] = (
        "self.minReplicas <= self.maxReplicas"
    )
    errors = check_crd(broken)
    assert len(errors) == 1
    assert "properties[autoscaling].default" in errors[0]
    assert "minReplicas" in errors[0]
    assert "evaluating rule: minReplicas must not exceed maxReplicas" in errors[0]


def test_every_spec_field_is_described(crd: dict[str, Any]) -> None:
    """`kubectl explain llmd.spec...` says something for every field."""
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def undescribed(node: dict[str, Any], path: str) -> list[str]:
        missing = []
        for name, sub in node.get("properties", {}).items():
            if not sub.get("description"):
                missing.append(f"{path}.{name}")
            missing += undescribed(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            missing += undescribed(node["items"], f"{path}[]")
        return missing

    assert undescribed(spec, "spec") == []


def test_crd_is_a_valid_kubernetes_1_30_object(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, "1.30.0", strict=True)
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Replicas", "Ready", "Phase", "Age"]
    assert crd["spec"]["names"]["shortNames"] == ["llmd"]


def _walk(node: Any, path: str = "") -> list[str]:
    """Paths of nodes breaking structural-schema rules: every node typed (or int-or-string), no
    references, unions or `additionalProperties: false`."""
    bad = []
    if isinstance(node, dict):
        typed = node.get("type") in ("object", "array")
        if ("properties" in node or "items" in node) and not typed:
            bad.append(f"{path}: untyped")
        for key in ("$ref", "anyOf", "oneOf", "allOf", "title"):
            if key in node:
                bad.append(f"{path}: {key}")
        if node.get("additionalProperties") is False:
            bad.append(f"{path}: additionalProperties false")
        for name, sub in node.get("properties", {}).items():
            if "type" not in sub and not sub.get("x-kubernetes-int-or-string"):
                bad.append(f"{path}.{name}: no type")
            bad += _walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            bad += _walk(node["items"], f"{path}[]")
    return bad


def test_schema_is_structural(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []


def test_every_sample_is_admitted_and_parses(repo_root: Path, crd: dict[str, Any]) -> None:
    samples = sample_objects(repo_root)
    names = {s["metadata"]["name"] for s in samples}
    assert names == {
        "smollm2",
        "llama-3-8b",
        "llama-3-8b-fp8",
        "llama-3-70b",
        "qwen3-8b",
        "qwen3-30b-a3b",
    }
    for sample in samples:
        stored, errors = admit(sample, crd)
        assert errors == [], sample["metadata"]["name"]
        parse_spec(stored["spec"])


def test_crd_defaults_are_the_models_defaults(crd: dict[str, Any]) -> None:
    stored, errors = admit(llmd({"model": {"source": "smollm2"}}), crd)
    assert errors == []
    from_models = LLMDeploymentSpec.model_validate({"model": {"source": "smollm2"}})
    dumped = from_models.model_dump(by_alias=True, mode="json", exclude_none=True)
    # the API server leaves empty lists and maps absent; pydantic fills them in
    for section, field in (("engine", "extraArgs"), ("resources", "nodeSelector")):
        assert dumped[section].pop(field) in ([], {})
    dumped["resources"].pop("tolerations")
    dumped["images"].pop("pullSecrets")
    assert stored["spec"] == dumped
    assert parse_spec(stored["spec"]) == from_models


BAD_SPECS = [
    (
        "negative replicas",
        {"replicas": -1},
        "spec.replicas: Invalid value: -1: should be greater than or equal to 0",
        "spec.replicas",
    ),
    (
        "min above max",
        {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
        "spec.autoscaling.minReplicas: Invalid value: minReplicas must not exceed maxReplicas",
        "spec.autoscaling",
    ),
    (
        "tensor parallel size not a power of two",
        {"engine": {"tensorParallelSize": 3}},
        'spec.engine.tensorParallelSize: Unsupported value: 3: supported values: "1", "2", '
        '"4", "8"',
        "spec.engine.tensorParallelSize",
    ),
    (
        "a quantization method the engine does not serve",
        {"engine": {"quantization": "int8"}},
        "spec.engine.quantization: Unsupported value: 'int8': supported values: \"fp8\", "
        '"awq", "gptq", "rtn", "gguf"',
        "spec.engine.quantization",
    ),
    (
        "a KV cache dtype the engine does not have",
        {"engine": {"kvCacheDtype": "int4"}},
        'spec.engine.kvCacheDtype: Unsupported value: \'int4\': supported values: "auto", "fp8"',
        "spec.engine.kvCacheDtype",
    ),
    ("unknown field", {"enigne": {}}, 'unknown field "spec.enigne"', "spec.enigne"),
    (
        "unknown nested field",
        {"engine": {"maxNumSeq": 8}},
        'unknown field "spec.engine.maxNumSeq"',
        "spec.engine.maxNumSeq",
    ),
    (
        "fewer GPUs than tensor parallel ranks",
        {"engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}},
        "spec.resources.gpus: Invalid value: resources.gpus must be 0 (CPU) or at least "
        "tensorParallelSize",
        "spec: Value error, resources.gpus",
    ),
    (
        "a model source that is none of the forms",
        {"model": {"source": "../escape"}},
        "spec.model.source: Invalid value: '../escape': should match",
        "spec.model.source",
    ),
    (
        "a TTFT threshold that is no histogram bucket",
        {"monitoring": {"slo": {"ttftThreshold": "300ms"}}},
        "spec.monitoring.slo.ttftThreshold: Unsupported value: '300ms'",
        "spec.monitoring.slo.ttftThreshold",
    ),
    (
        "an availability objective of 100%",
        {"monitoring": {"slo": {"availability": 1.0}}},
        "spec.monitoring.slo.availability: Invalid value: 1.0: should be less than or equal to",
        "spec.monitoring.slo.availability",
    ),
    (
        "a memory quantity Kubernetes cannot parse",
        {"resources": {"memory": "1.2.3Gi"}},
        "spec.resources.memory: Invalid value: '1.2.3Gi': should match",
        "spec.resources.memory",
    ),
    (
        "a negative CPU request",
        {"resources": {"cpu": "-1"}},
        "spec.resources.cpu: Invalid value: '-1': should match",
        "spec.resources.cpu",
    ),
    (
        "a GPU type that is no label value",
        {"resources": {"gpuType": "NVIDIA H100 80GB"}},
        "spec.resources.gpuType: Invalid value: 'NVIDIA H100 80GB': should match",
        "spec.resources.gpuType",
    ),
    (
        "a node selector key that is no label key",
        {"resources": {"nodeSelector": {"gpu type": "h100"}}},
        "spec.resources.nodeSelector: Invalid value: every nodeSelector key must be a label key",
        "spec.resources.nodeSelector",
    ),
    (
        "LoRA with tensor parallelism",
        {"engine": {"tensorParallelSize": 2}, "lora": {"maxLoras": 2}},
        "spec.lora: Invalid value: lora needs tensorParallelSize 1",
        "lora needs tensorParallelSize 1",
    ),
    (
        "draft speculation without a draft model",
        {"engine": {"speculative": {"method": "draft"}}},
        "spec.engine.speculative.draftModel: Invalid value: method draft needs draftModel",
        "spec.engine.speculative",
    ),
]


@pytest.mark.parametrize(
    ("change", "server_error", "operator_error"),
    [case[1:] for case in BAD_SPECS],
    ids=[case[0] for case in BAD_SPECS],
)
def test_bad_specs_are_rejected_field_by_field(
    crd: dict[str, Any], change: dict[str, Any], server_error: str, operator_error: str
) -> None:
    spec: dict[str, Any] = {"model": {"source": "smollm2"}}
    for key, value in change.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    _, errors = admit(llmd(spec), crd)
    assert len(errors) == 1, errors
    assert errors[0].startswith(server_error), errors
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(spec)
    assert operator_error in str(caught.value)


def test_missing_model_is_required(crd: dict[str, Any]) -> None:
    _, errors = admit(llmd({"replicas": 1}), crd)
    assert errors == ["spec.model: Required value"]
    with pytest.raises(InvalidSpecError, match=r"spec\.model: Field required"):
        parse_spec({"replicas": 1})


def test_names_too_long_for_children_are_rejected(crd: dict[str, Any]) -> None:
    ok = llmd({"model": {"source": "smollm2"}}, name="a" * 38)
    assert admit(ok, crd)[1] == []
    for name in ("a" * 39, "9lives", "with.dot"):
        _, errors = admit(llmd({"model": {"source": "smollm2"}}, name=name), crd)
        assert len(errors) == 1
        assert "metadata.name must be a DNS label" in errors[0]


def test_model_source_forms(crd: dict[str, Any]) -> None:
    for source in (
        "smollm2",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "hf://Qwen/Qwen2.5-7B-Instruct",
        "https://example.com/models/m.Q4_1.gguf",
        "pvc://models/llama/70b",
        "/opt/models/m.gguf",
    ):
        obj = llmd({"model": {"source": source}})
        assert admit(copy.deepcopy(obj), crd)[1] == [], source
        parse_spec(obj["spec"])
