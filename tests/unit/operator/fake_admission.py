"""What the fake API server does to a write before storing it, in the server's order: admission
plugins (OwnerReferencesPermissionEnforcement, RBAC escalation prevention), then decoding and
validation (quantities as apimachinery parses them, label keys and values, the Kubernetes 1.30
OpenAPI schemas with unknown fields refused, immutable fields)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import kubernetes_validate

from .fake_rbac import blocking_owner_errors, escalation
from .k8s_values import label_errors, quantity_errors


def admission_error(
    held: Sequence[Mapping[str, Any]],
    subject: str,
    body: dict[str, Any],
    stored: dict[str, Any] | None,
    namespace: str,
) -> tuple[int, str] | None:
    """(HTTP status, the server's message) when the write is refused; None when it passes."""
    kind, name = body.get("kind", ""), body.get("metadata", {}).get("name", "")
    refused = blocking_owner_errors(held, body, stored, namespace)
    if refused:
        return 403, f'{kind.lower()}s "{name}" is forbidden: {refused[0]}'
    if kind == "Role":
        missing = escalation(held, body.get("rules") or [], namespace)
        if missing:
            return 403, (
                f'roles.rbac.authorization.k8s.io "{name}" is forbidden: user "{subject}" '
                f"is attempting to grant RBAC permissions not currently held: {missing}"
            )
    bad_quantities = quantity_errors(body)
    if bad_quantities:  # a real server failed decoding with 500, not 422
        return 500, bad_quantities[0]
    problems = label_errors(body)
    if not body.get("apiVersion", "").startswith("monitoring.coreos.com/"):
        try:
            kubernetes_validate.validate(body, "1.30.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(exc.message)
    deployment = stored is not None and kind == "Deployment"
    if deployment and body["spec"].get("selector") != (stored or {})["spec"].get("selector"):
        problems.append("spec.selector: Invalid value: field is immutable")
    if problems:
        return 422, f'{kind} "{name}" is invalid: {"; ".join(problems)}'
    return None
