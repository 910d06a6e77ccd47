"""The LLMDeployment CustomResourceDefinition, generated from the pydantic models in `spec.py`.

`python -m kvfleet.operator.crd > crds/llmdeployments.kvfleet.dev.yaml` regenerates the checked-in
file; a test fails when the two differ. The pydantic JSON schema becomes a Kubernetes structural
schema: references inlined, optional values without a null branch, `int | str` as
`x-kubernetes-int-or-string`, no titles, and a full default on objects whose fields all have
defaults, so an absent section reads as its defaults.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from kvfleet.operator.conditions import LLMDeploymentStatus
from kvfleet.operator.spec import LLMDeploymentSpec
from kvfleet.operator.spec_base import GROUP, KIND, MAX_NAME_LENGTH, PLURAL, SHORT_NAME, VERSION

CRD_NAME = f"{PLURAL}.{GROUP}"
_DROPPED = {"title", "additionalProperties"}  # handled below; structural schemas forbid some
_KEY_ORDER = ("type", "description", "default", "enum")


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node as an OpenAPI v3 structural-schema node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)
    if "anyOf" in schema:
        return _union(schema, defs)
    node: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROPPED or key == "$defs" or (key == "default" and value is None):
            continue
        if key == "properties":
            node[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            node[key] = structural(value, defs)
        elif key == "exclusiveMinimum":  # JSON Schema 2020 number -> OpenAPI 3.0 boolean form
            node["minimum"], node["exclusiveMinimum"] = value, True
        else:
            node[key] = value
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        node["additionalProperties"] = structural(extra, defs)
    if "enum" in schema and "type" not in node:
        kinds = {type(v) for v in schema["enum"]}
        numeric = "integer" if kinds == {int} else "number"
        node["type"] = numeric if kinds <= {int, float} else "string"
    optional_fields = not node.get("required") and "default" not in node
    if node.get("type") == "object" and "properties" in node and optional_fields:
        # NOTE: written in full, not `{}`: the API server validates each default as written
        # (its CEL rules included) when the CRD is created, without filling nested defaults in.
        properties = node["properties"].items()
        node["default"] = {name: sub["default"] for name, sub in properties if "default" in sub}
    first = [k for k in _KEY_ORDER if k in node]
    return {**{k: node[k] for k in first}, **{k: v for k, v in node.items() if k not in first}}


def _union(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """`X | None` becomes X (absent unless given); `int | str` becomes int-or-string."""
    branches = [b for b in schema["anyOf"] if b.get("type") != "null"]
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    if schema.get("default") is not None:
        rest["default"] = schema["default"]
    types = {structural(b, defs).get("type") for b in branches}
    if types == {"integer", "string"}:
        node = {k: v for k, v in rest.items() if k not in _DROPPED}
        # The server checks a pattern on strings only and bounds on numbers only: keep both.
        for branch in branches:
            kept = ("pattern", "maxLength") if branch.get("type") == "string" else ("minimum",)
            node.update({k: branch[k] for k in kept if k in branch})
        return {**node, "x-kubernetes-int-or-string": True}
    if len(branches) != 1:
        raise ValueError(f"no structural form for a union of {sorted(map(str, types))}")
    node = structural({**branches[0], **rest}, defs)
    if schema.get("default") is None:
        node.pop("default", None)  # an optional object stays absent unless given
    return node


def _model_schema(model: type[Any]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def _status_schema() -> dict[str, Any]:
    schema = _model_schema(LLMDeploymentStatus)
    schema.pop("default", None)
    conditions = schema["properties"]["conditions"]
    conditions.pop("default", None)
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def build_crd() -> dict[str, Any]:
    spec = _model_schema(LLMDeploymentSpec)
    spec.pop("default", None)
    name_rule = {
        "rule": (
            f"size(self.metadata.name) <= {MAX_NAME_LENGTH}"
            " && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"
        ),
        "message": (
            f"metadata.name must be a DNS label of at most {MAX_NAME_LENGTH} characters starting "
            "with a letter (it names the Services and Deployments made from it)"
        ),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/part-of": "kvfleet"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": [SHORT_NAME],
                "categories": ["kvfleet"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An OpenAI-compatible LLM endpoint: engines + gateway.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": _status_schema(),
                            },
                            "x-kubernetes-validations": [name_rule],
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
                        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
                        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


HEADER = (
    "# Generated from kvfleet.operator.spec by `python -m kvfleet.operator.crd`; do not edit.\n"
)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared sub-objects out in full: anchors and aliases confuse readers of a CRD."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd() -> str:
    body = yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)
    return HEADER + body


if __name__ == "__main__":
    sys.stdout.write(render_crd())
