"""RBAC as the API server enforces it, for the fake API: who may do what, the
OwnerReferencesPermissionEnforcement admission plugin, and the escalation check on Roles.

Rules are the `rules` lists of (Cluster)Roles; a subject holds the union of its roles' rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
OPERATOR_SUBJECT = "system:serviceaccount:kvfleet-system:kvfleet-operator"
# kind -> (API group, plural) of owners the plugin can be asked about
OWNER_KINDS = {"LLMDeployment": ("kvfleet.dev", "llmdeployments")}


@dataclass(frozen=True)
class Attributes:
    """One request as the authorizer sees it."""

    verb: str
    group: str
    resource: str  # "llmdeployments" or "llmdeployments/status"
    namespace: str | None
    name: str | None

    def describe(self, subject: str) -> str:
        where = (
            f' in the namespace "{self.namespace}"' if self.namespace else " at the cluster scope"
        )
        group = self.group or "core"
        return (
            f'{self.resource} "{self.name or ""}" is forbidden: User "{subject}" cannot '
            f'{self.verb} resource "{self.resource}" in API group "{group}"{where}'
        ).replace(' in API group "core"', ' in API group ""')


def operator_cluster_role() -> list[dict[str, Any]]:
    """The rules of manifests/operator/clusterrole.yaml, as installed."""
    role = yaml.safe_load((REPO / "manifests/operator/clusterrole.yaml").read_text())
    rules: list[dict[str, Any]] = role["rules"]
    return rules


def _matches(rule: Mapping[str, Any], attributes: Attributes) -> bool:
    def has(field: str, value: str) -> bool:
        values = rule.get(field) or []
        return "*" in values or value in values

    if not (has("apiGroups", attributes.group) and has("verbs", attributes.verb)):
        return False
    if not has("resources", attributes.resource):
        return False
    names = rule.get("resourceNames") or []
    return not names or (attributes.name is not None and attributes.name in names)


def allows(rules: Iterable[Mapping[str, Any]], attributes: Attributes) -> bool:
    return any(_matches(rule, attributes) for rule in rules)


def _requests_of(rule: Mapping[str, Any], namespace: str) -> Iterable[Attributes]:
    names: Sequence[str | None] = rule.get("resourceNames") or [None]
    for group, resource, verb, name in itertools.product(
        rule.get("apiGroups") or [],
        rule.get("resources") or [],
        rule.get("verbs") or [],
        names,
    ):
        yield Attributes(verb, group, resource, namespace, name)


def escalation(
    held: Sequence[Mapping[str, Any]], granted: Sequence[Mapping[str, Any]], namespace: str
) -> list[str]:
    """Rules in `granted` the holder of `held` lacks (RBAC's escalation prevention)."""
    missing = []
    for rule in granted:
        for attributes in _requests_of(rule, namespace):
            if not allows(held, attributes):
                missing.append(
                    f"{{APIGroups:[{attributes.group!r}], Resources:[{attributes.resource!r}], "
                    f"Verbs:[{attributes.verb!r}]}}"
                )
    return missing


def blocking_owner_errors(
    held: Sequence[Mapping[str, Any]],
    obj: Mapping[str, Any],
    stored: Mapping[str, Any] | None,
    namespace: str,
) -> list[str]:
    """OwnerReferencesPermissionEnforcement: setting `blockOwnerDeletion` on a reference (new or
    changed) needs `update` on the owner's `finalizers` subresource."""
    before = {
        (r.get("uid"), bool(r.get("blockOwnerDeletion")))
        for r in ((stored or {}).get("metadata") or {}).get("ownerReferences") or []
    }
    errors = []
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if not ref.get("blockOwnerDeletion") or (ref.get("uid"), True) in before:
            continue
        group, plural = OWNER_KINDS.get(ref.get("kind", ""), ("", ""))
        attributes = Attributes("update", group, f"{plural}/finalizers", namespace, ref["name"])
        if not plural or not allows(held, attributes):
            errors.append(
                "cannot set blockOwnerDeletion if an ownerReference refers to a resource you "
                f"can't set finalizers on: User cannot update {plural or ref.get('kind')}/"
                "finalizers"
            )
    return errors
