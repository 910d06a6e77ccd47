"""Kubernetes' own value grammars (k8s.io/apimachinery) as RE2 patterns: the CRD's `pattern`s and
CEL `matches()` use them, and the pydantic models check the same, so a value the API server
would refuse in a child never gets past `kubectl apply`.

No backslashes: a pattern is also written inside CEL string literals.
"""

from __future__ import annotations

# A resource quantity: <number><suffix>, number "1", "1.5", "1." or ".5" (no sign: resources are
# never negative), suffix binary (Ki..Ei), decimal (n, u, m, "", k, M..E) or an exponent (e3).
QUANTITY_PATTERN = r"^([0-9]+([.][0-9]*)?|[.][0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
DURATION_PATTERN = r"^[0-9]+(ms|s|m|h)$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A label value: empty, or at most 63 alphanumerics with - _ . inside.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_VALUE_MAX = 63
# A label key (qualified name): an optional DNS-subdomain prefix and "/", then a name part.
QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
# An extended resource name (nvidia.com/gpu): a domain prefix is required.
RESOURCE_NAME_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
