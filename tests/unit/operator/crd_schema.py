"""What the API server does with a custom resource on `kubectl apply`, from the CRD's own schema.

No API server runs here, so this applies an `openAPIV3Schema` the way the server does for the
parts our CRD uses: defaulting, strict field validation (unknown fields are errors, as with
kubectl's default `--validate=strict`), type/enum/bounds/pattern checks, int-or-string, and the
`x-kubernetes-validations` CEL rules, evaluated by a real CEL implementation (cel-python). Errors
read like the server's: `spec.replicas: Invalid value: -1: should be greater than or equal to 0`.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import celpy

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill defaults in, depth first, as the API server does before validation."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(value[name], sub)
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every error in `value`, each prefixed with its field path."""
    errors = _check_node(value, schema, path)
    if errors:
        return errors  # the server skips CEL rules on a node whose schema checks failed
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += validate(value[name], sub, f"{path}.{name}" if path else name)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                errors += validate(item, extra, f"{path}[{name}]")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += validate(item, schema["items"], f"{path}[{index}]")
    if not errors:
        errors += _check_rules(value, schema, path)
    return errors


def _check_node(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    where = path or "<root>"
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            return [f"{where}: Invalid value: {value!r}: must be an integer or a string"]
    elif "type" in schema:
        kinds = _TYPES[schema["type"]]
        if not isinstance(value, kinds) or (
            schema["type"] != "boolean" and isinstance(value, bool)
        ):
            return [f"{where}: Invalid value: {value!r}: must be of type {schema['type']}"]
    errors = _check_value(value, schema, where)
    if isinstance(value, dict):
        errors += _check_fields(value, schema, path)
    return errors


def _check_value(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(f'"{v}"' for v in schema["enum"])
        errors.append(f"{where}: Unsupported value: {value!r}: supported values: {supported}")
    number = isinstance(value, int | float)
    if number and "minimum" in schema and value < schema["minimum"]:
        errors.append(
            f"{where}: Invalid value: {value!r}: should be greater than or equal to "
            f"{schema['minimum']}"
        )
    if number and "maximum" in schema and value > schema["maximum"]:
        errors.append(
            f"{where}: Invalid value: {value!r}: should be less than or equal to "
            f"{schema['maximum']}"
        )
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: Invalid value: {value!r}: should match {schema['pattern']!r}")
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{where}: Invalid value: {value!r}: too short")
        if len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{where}: Too long: may not be longer than {schema['maxLength']}")
    if isinstance(value, list) and len(value) > schema.get("maxItems", len(value)):
        errors.append(f"{where}: Too many: {len(value)}: must have at most {schema['maxItems']}")
    return errors


def _check_fields(value: dict[str, Any], schema: dict[str, Any], path: str) -> list[str]:
    prefix = f"{path}." if path else ""
    required = schema.get("required", [])
    errors = [f"{prefix}{name}: Required value" for name in required if name not in value]
    known = schema.get("properties")
    if known is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
        errors += [f'unknown field "{prefix}{name}"' for name in value if name not in known]
    return errors


def _check_rules(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """The node's CEL rules, as the API server runs them: a rule that cannot be evaluated (a
    field it reads is absent, a type mismatch) is an error too, never a pass."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        where = path + rule.get("fieldPath", "")
        message = rule.get("message", f"failed rule: {rule['rule']}")
        environment = celpy.Environment()
        program = environment.program(environment.compile(rule["rule"]))
        try:
            result = program.evaluate({"self": celpy.json_to_cel(value)})
        except celpy.CELEvalError as exc:
            reason = exc.args[0] if exc.args else str(exc)
            errors.append(f"{path or '<root>'}: Invalid value: {reason} evaluating rule: {message}")
            continue
        if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and result):
            errors.append(f"{where or '<root>'}: Invalid value: {message}")
    return errors


def check_crd(crd: dict[str, Any]) -> list[str]:
    """What the API server answers when the CRD itself is created: every `default` must be valid
    for its own schema node *as written* (no nested defaults filled in), known fields only, and
    every CEL rule must compile and hold on it."""
    errors = []
    for version in crd["spec"]["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        errors += _check_defaults(schema, f"spec.versions[{version['name']}].schema")
    return errors


def _check_defaults(schema: dict[str, Any], path: str) -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            celpy.Environment().compile(rule["rule"])
        except celpy.CELParseError as exc:
            errors.append(f"{path}: Invalid value: {rule['rule']!r}: compilation failed: {exc}")
    if "default" in schema:
        where = f"{path}.default"
        found = validate(copy.deepcopy(schema["default"]), schema, where)
        errors += [f"{path}.default: {e.removeprefix(where).lstrip('.:[ ')}" for e in found]
    for name, sub in schema.get("properties", {}).items():
        errors += _check_defaults(sub, f"{path}.properties[{name}]")
    if isinstance(schema.get("items"), dict):
        errors += _check_defaults(schema["items"], f"{path}.items")
    return errors


def admit(obj: dict[str, Any], crd: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The stored object (defaults filled in) and the errors the API server would answer."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stored = apply_defaults(copy.deepcopy(obj), schema)
    # metadata is validated by the server itself, not the CRD schema
    checked = {k: v for k, v in stored.items() if k != "metadata"}
    errors = validate(checked, {**schema, "x-kubernetes-validations": []})
    if not errors:
        errors = _check_rules(stored, schema, "")
    return stored, errors
