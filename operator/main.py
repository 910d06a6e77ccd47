"""The kopf handlers: the only module with kopf decorators. Each is a thin call into
`reconcile.Reconciler`, which `startup` wires once into kopf's `memo`.

Run with `kvfleet operator` (checks the cluster first), or `kopf run -m kvfleet.operator.main`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from kvfleet.operator.common import MANAGED_BY, OperatorConfig
from kvfleet.operator.kube import ClusterUnreachableError, KubeError, connect
from kvfleet.operator.reconcile import Reconciler, owner_reference
from kvfleet.operator.spec import GROUP, PLURAL, VERSION, InvalidSpecError

LLMD = (GROUP, VERSION, PLURAL)
# Children's changes arrive as events; the resync puts back what someone changed or deleted
# by hand and catches up on any event missed.
RESYNC_INTERVAL_S = 60.0


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    try:
        connect()
    except ClusterUnreachableError as exc:
        raise kopf.LoginError(str(exc)) from None
    return kopf.login_via_client(**kwargs)


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and the last-handled spec live in annotations: the CRD's status schema is
    # structural, so anything kopf put there unasked would be pruned.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    try:
        api, _ = connect()
    except ClusterUnreachableError as exc:
        raise kopf.PermanentError(str(exc)) from None
    memo.reconciler = Reconciler(api, OperatorConfig.from_environment())


def _temporary(exc: KubeError) -> kopf.TemporaryError:
    return kopf.TemporaryError(str(exc), delay=10 if exc.transient else 60)


@kopf.on.resume(*LLMD)
@kopf.on.create(*LLMD)
@kopf.on.update(*LLMD)
def reconcile(body: Mapping[str, Any], memo: kopf.Memo, **_: Any) -> None:
    try:
        memo.reconciler.reconcile(body)
    except InvalidSpecError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    except KubeError as exc:
        raise _temporary(exc) from exc


@kopf.timer(*LLMD, interval=RESYNC_INTERVAL_S, initial_delay=RESYNC_INTERVAL_S)
def resync(body: Mapping[str, Any], memo: kopf.Memo, **_: Any) -> None:
    try:
        memo.reconciler.reconcile(body)
    except InvalidSpecError:
        return  # reported when the spec changed; nothing to apply until it is fixed
    except KubeError as exc:
        raise _temporary(exc) from exc


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
def child_changed(
    body: Mapping[str, Any], memo: kopf.Memo, type: str | None = None, **_: Any
) -> None:
    """A Deployment we own changed (pods became ready, a rollout moved): refresh its owner's
    status; one deleted by hand is put back."""
    owner = owner_reference(body)
    if owner is None:
        return
    reconciler: Reconciler = memo.reconciler
    try:
        parent = reconciler.api.get("LLMDeployment", *owner)
        if parent is None or parent["metadata"].get("deletionTimestamp") is not None:
            return
        if type == "DELETED":
            reconciler.reconcile(parent)
        else:
            reconciler.refresh_status(parent)
    except InvalidSpecError:
        return
    except KubeError as exc:
        # event handlers are not retried; the status timer catches up
        logging.getLogger(__name__).warning("status of %s/%s not refreshed: %s", *owner, exc)
