"""Kubernetes Events on LLMDeployments: what `kubectl describe llmd` lists.

Posted as client-go's recorder posts them: a repeat of the same reason and message on the same
object (within the process) raises the first Event's `count` and `lastTimestamp` instead of
making another, so a failure retried with backoff reads as one line with a count, not a flood.
"""

from __future__ import annotations

import enum
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.kube import KubeApi, KubeError
from kvfleet.operator.spec_base import API_VERSION, KIND

logger = logging.getLogger(__name__)

COMPONENT = "kvfleet-operator"
MAX_MESSAGE = 1024  # the API server refuses longer event messages


class EventType(enum.StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass
class EventRecorder:
    """Posts Events through `api`; `clock` gives RFC 3339 times."""

    api: KubeApi
    clock: Callable[[], str]
    component: str = COMPONENT
    instance: str = field(default_factory=socket.gethostname)
    # (object uid, reason, message) -> (event name, count) of events this process posted
    _posted: dict[tuple[str, str, str], tuple[str, int]] = field(default_factory=dict)

    def record(self, body: Mapping[str, Any], kind: EventType, reason: str, message: str) -> None:
        """One Event about the LLMDeployment `body`. Never raises: an Event that cannot be
        posted is logged, and the reconcile goes on."""
        meta = body["metadata"]
        message = message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"
        key = (str(meta.get("uid")), reason, message)
        now = self.clock()
        try:
            if key in self._posted:
                name, count = self._posted[key]
                patch = {"count": count + 1, "lastTimestamp": now}
                self.api.patch("Event", meta["namespace"], name, patch)
                self._posted[key] = (name, count + 1)
                return
            event = self.api.create(self._event(meta, kind, reason, message, now))
            self._posted[key] = (event["metadata"]["name"], 1)
        except KubeError as exc:
            if exc.status == 404 and key in self._posted:
                del self._posted[key]  # the event expired: the next repeat posts a new one
            logger.warning("event %s on %s/%s not posted: %s", reason, *_where(meta), exc)

    def _event(
        self, meta: Mapping[str, Any], kind: EventType, reason: str, message: str, now: str
    ) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid", ""),
            },
            "type": str(kind),
            "reason": reason,
            "message": message,
            "source": {"component": self.component},
            "reportingComponent": f"kvfleet.dev/{self.component}",
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }


def _where(meta: Mapping[str, Any]) -> tuple[str, str]:
    return str(meta.get("namespace")), str(meta.get("name"))
