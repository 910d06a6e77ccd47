"""Leader election among the gateway pods of one LLMDeployment, over a `coordination.k8s.io`
Lease: exactly one pod writes the `scale` subresource.

The rules are client-go's leaderelection: the holder renews `renewTime` every `retry_period_s`;
a candidate takes the Lease over once the record has not changed for `lease_duration_s` *as
observed on its own clock* (never by comparing the stored times with its clock, so clock skew
between pods does not matter); every write carries the resourceVersion it read, so of two
candidates racing, the API server lets one win (409 Conflict for the other).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvfleet.gateway.incluster import api_client_or_in_cluster

logger = logging.getLogger(__name__)


def autoscaler_lease_name(name: str) -> str:
    """The Lease of LLMDeployment `name`'s autoscaler (the operator's gateway Role names it)."""
    return f"{name}-autoscaler"


@dataclass(frozen=True)
class LeaseRecord:
    holder: str | None
    lease_duration_s: float
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0
    resource_version: str | None = None  # None: not stored yet


class LeaseConflict(Exception):
    """Someone else wrote the Lease since it was read (or created it first)."""


class LeaseStore(Protocol):
    def read(self) -> LeaseRecord | None: ...

    def create(self, record: LeaseRecord) -> LeaseRecord: ...

    def update(self, record: LeaseRecord) -> LeaseRecord: ...


def micro_time(at: datetime.datetime) -> str:
    """A Kubernetes MicroTime."""
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaderElector:
    store: LeaseStore
    identity: str
    lease_duration_s: float = 15.0
    retry_period_s: float = 5.0
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC)
    is_leader: bool = False
    on_change: Callable[[bool], None] | None = None
    _observed: LeaseRecord | None = None
    _observed_at: float = 0.0

    def __post_init__(self) -> None:
        if self.retry_period_s >= self.lease_duration_s:
            raise ValueError("the retry period must be shorter than the lease duration")

    def try_acquire_or_renew(self) -> bool:
        """One round: renew our Lease, take over an expired one, or stay a follower. Returns
        whether this pod leads now. API errors count as not leading (the old leader's Lease
        expires before anyone else may take it)."""
        try:
            leading = self._round()
        except LeaseConflict:
            leading = False
        except Exception as exc:  # the API server may be away; try again next round
            logger.warning("leader election: %s", exc)
            leading = False
        self._set(leading)
        return leading

    def _round(self) -> bool:
        now, wall = self.monotonic(), micro_time(self.wall())
        current = self.store.read()
        if current is None:
            created = self.store.create(
                LeaseRecord(self.identity, self.lease_duration_s, wall, wall, 0)
            )
            self._observe(created, now)
            return True
        if self._observed is None or current != self._observed:
            self._observe(current, now)  # the record moved: its holder is alive
        mine = current.holder == self.identity
        expired = now - self._observed_at >= current.lease_duration_s
        if not mine and current.holder and not expired:
            return False
        taken = replace(
            current,
            holder=self.identity,
            lease_duration_s=self.lease_duration_s,
            renew_time=wall,
            acquire_time=current.acquire_time if mine else wall,
            transitions=current.transitions + (0 if mine else 1),
        )
        self._observe(self.store.update(taken), now)
        return True

    def _observe(self, record: LeaseRecord, now: float) -> None:
        self._observed, self._observed_at = record, now

    def _set(self, leading: bool) -> None:
        if leading != self.is_leader:
            logger.info("leader election: %s %s", self.identity, "leads" if leading else "follows")
            self.is_leader = leading
            if self.on_change is not None:
                self.on_change(leading)

    async def run(self) -> None:
        """Rounds every retry period until cancelled (then the Lease simply expires)."""
        while True:
            await asyncio.to_thread(self.try_acquire_or_renew)
            await asyncio.sleep(self.retry_period_s)


class KubernetesLeaseStore:
    """One Lease through the API server (the pod's service account in the cluster)."""

    def __init__(self, namespace: str, name: str, api_client: Any = None) -> None:
        from kubernetes import client

        api_client = api_client_or_in_cluster(api_client)
        # Any: the bodies are plain dicts, which the client serializes as they are
        self.api: Any = client.CoordinationV1Api(api_client)
        self.namespace, self.name = namespace, name

    def read(self) -> LeaseRecord | None:
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return _record(lease)

    def create(self, record: LeaseRecord) -> LeaseRecord:
        from kubernetes.client.exceptions import ApiException

        try:
            return _record(self.api.create_namespaced_lease(self.namespace, self._body(record)))
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(str(exc.reason)) from None
            raise

    def update(self, record: LeaseRecord) -> LeaseRecord:
        from kubernetes.client.exceptions import ApiException

        try:
            body = self._body(record)
            return _record(self.api.replace_namespaced_lease(self.name, self.namespace, body))
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(str(exc.reason)) from None
            raise

    def _body(self, record: LeaseRecord) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record.resource_version is not None:
            metadata["resourceVersion"] = record.resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": record.holder,
                "leaseDurationSeconds": round(record.lease_duration_s),
                "acquireTime": record.acquire_time,
                "renewTime": record.renew_time,
                "leaseTransitions": record.transitions,
            },
        }


def _record(lease: Any) -> LeaseRecord:
    spec = lease.spec

    def text(value: Any) -> str | None:
        return micro_time(value) if isinstance(value, datetime.datetime) else value

    return LeaseRecord(
        holder=spec.holder_identity,
        lease_duration_s=float(spec.lease_duration_seconds or 0),
        acquire_time=text(spec.acquire_time),
        renew_time=text(spec.renew_time),
        transitions=int(spec.lease_transitions or 0),
        resource_version=lease.metadata.resource_version,
    )
