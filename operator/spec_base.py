"""The building blocks of the `LLMDeployment` models (spec.py): the API group and names, the
base model (camelCase aliases, unknown fields refused), CEL rules, the shared patterns and
enumerations."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from kvfleet.operator.grammar import (
    LABEL_VALUE_MAX,
    LABEL_VALUE_PATTERN,
    QUANTITY_PATTERN,
)

GROUP, VERSION, KIND, PLURAL, SHORT_NAME = (
    "kvfleet.dev",
    "v1alpha1",
    "LLMDeployment",
    "llmdeployments",
    "llmd",
)
API_VERSION = f"{GROUP}/{VERSION}"
# The longest child name appends "-gateway" (8) and Deployments add a pod-template hash and a
# pod suffix (17) to their pods' names, which stay within a 63-character DNS label.
MAX_NAME_LENGTH = 38

# alias ("smollm2"), hub id ("org/name", "hf://org/name"), URL, PVC path, or a path in the image.
MODEL_SOURCE_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+|https?://[^\s]+|hf://[\w.-]+/[\w.-]+"
    r"|/[^\s]*|[A-Za-z0-9][\w.-]*(/[\w.-]+)?)$"
)
ADAPTER_SOURCE_PATTERN = r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+|/[^\s]*)$"

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]
IntOrQuantity = Annotated[int, Field(ge=0)] | Quantity
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=LABEL_VALUE_MAX)]


class CrdModel(BaseModel):
    """camelCase fields in the resource, snake_case in Python; unknown fields are an error."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def cel_rules(*rules: tuple[str, str, str]) -> ConfigDict:
    """A model's cross-field rules for the API server (CEL, `x-kubernetes-validations`), each
    (rule, message, fieldPath); the model enforces the same in a validator with the same message.

    NOTE: the API server also evaluates each rule against the schema's defaults *as written*
    when the CRD is created (`crd.py` writes object defaults in full), and a rule that reads an
    absent field fails there: guard optional fields with `has()`.
    """
    validations: list[JsonDict] = [
        {"rule": rule, "message": message, "fieldPath": field_path}
        for rule, message, field_path in rules
    ]
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(validations)})


def cel_items(rule: str, message: str) -> JsonDict:
    """A rule on one field (a map or a list), for `Field(json_schema_extra=...)`."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


class LoadFormat(enum.StrEnum):
    AUTO = "auto"
    HF = "hf"
    GGUF = "gguf"
    DUMMY = "dummy"  # random weights at a real shape (benchmarks)


class Dtype(enum.StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class KVCacheDtype(enum.StrEnum):
    AUTO = "auto"  # the model's dtype; the engine keeps its KV cache in it
    FP8 = "fp8"  # e4m3 with a scale per layer: twice the tokens in the same memory


class Quantization(enum.StrEnum):
    FP8 = "fp8"  # linear layers quantized at load (FP8 weights and activations)
    AWQ = "awq"  # an AWQ checkpoint (INT4 weights; the checkpoint says so without the field)
    GPTQ = "gptq"  # a GPTQ checkpoint (INT4 weights; likewise)
    RTN = "rtn"  # INT4 weights rounded to nearest at load (group 128, zero points)
    GGUF = "gguf"  # a GGUF file's Q4_0 / Q4_1 / Q4_K layers kept 4-bit, Q8_0 8-bit


class RoutingPolicy(enum.StrEnum):
    PREFIX = "prefix"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"


class ServiceType(enum.StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class PullPolicy(enum.StrEnum):
    IF_NOT_PRESENT = "IfNotPresent"
    ALWAYS = "Always"
    NEVER = "Never"
