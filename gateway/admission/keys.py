"""API keys: only their sha256 is stored; each key has an id, rate limits and a fair-share weight.

The file (locally) or the Secret's data (in a cluster) is JSON:
`{"keys": [{"id": "team-a", "sha256": "<hex>", "requests_per_min": 60, "tokens_per_min": 100000,
"weight": 1, "priority": 0, "max_priority": 0}]}`. Lower priorities go first; `max_priority` is
the most urgent a request of the key may ask for (default: its `priority`), so one tenant can
make its own requests wait but never jump another's. Without keys the gateway runs open: every
caller is the key "anonymous", and any priority goes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.gateway.admission.rate_limit import KeyId, KeyLimits

ANONYMOUS = KeyId("anonymous")


@dataclass(frozen=True)
class ApiKey:
    key_id: KeyId
    sha256: str
    limits: KeyLimits
    weight: float = 1.0
    priority: int = 0  # queue priority when the request names none (lower goes first)
    max_priority: int | None = None  # the most urgent it may ask for; None: `priority`

    def __post_init__(self) -> None:
        if self.priority < self.ceiling:
            raise ValueError(f"priority {self.priority} is above max_priority {self.ceiling}")

    @property
    def ceiling(self) -> int:
        return self.priority if self.max_priority is None else self.max_priority


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = {k.sha256: k for k in keys}  # by hash: a presented key is one lookup
        self._by_id = {k.key_id: k for k in keys}

    @property
    def is_open(self) -> bool:
        return not self.keys

    @classmethod
    def from_file(cls, path: str | Path) -> KeyStore:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the API keys file {str(path)!r}: {exc}") from exc
        return cls.from_mapping(data)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> KeyStore:
        keys = []
        for entry in data.get("keys", []):
            try:
                keys.append(
                    ApiKey(
                        KeyId(str(entry["id"])),
                        str(entry["sha256"]).lower(),
                        KeyLimits(entry.get("requests_per_min"), entry.get("tokens_per_min")),
                        float(entry.get("weight", 1.0)),
                        int(entry.get("priority", 0)),
                        None if entry.get("max_priority") is None else int(entry["max_priority"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"a bad API key entry {entry!r}: {exc}") from exc
        return cls(keys)

    def authenticate(self, presented: str | None) -> KeyId | None:
        """The key's id, or None for a missing or unknown key (open mode: ANONYMOUS)."""
        if self.is_open:
            return ANONYMOUS
        if not presented:
            return None
        key = self.keys.get(hash_key(presented))
        return key.key_id if key is not None else None

    def limits(self) -> dict[KeyId, KeyLimits]:
        return {k.key_id: k.limits for k in self.keys.values()}

    def priority_of(self, key_id: KeyId) -> int:
        key = self._by_id.get(key_id)
        return key.priority if key is not None else 0

    def ceiling_of(self, key_id: KeyId) -> int | None:
        """The most urgent priority the key may ask for; None in open mode (no tenants)."""
        key = self._by_id.get(key_id)
        return key.ceiling if key is not None else None

    def weights(self) -> dict[KeyId, float]:
        return {k.key_id: k.weight for k in self.keys.values()}
