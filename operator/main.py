"""The kopf handlers: the only module with kopf decorators. Each is a thin call into
`reconcile.Reconciler`, which `startup` wires once into kopf's `memo`.

Run with `kvfleet operator` (checks the cluster first), or `kopf run -m kvfleet.operator.main`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from kvfleet.operator.common import MANAGED_BY, OperatorConfig
from kvfleet.operator.kube import ClusterUnreachableError, KubeError, connect
from kvfleet.operator.reconcile import ChildRejectedError, Reconciler, Resyncer, owner_reference
from kvfleet.operator.spec import InvalidSpecError
from kvfleet.operator.spec_base import GROUP, PLURAL, VERSION

logger = logging.getLogger(__name__)

LLMD = (GROUP, VERSION, PLURAL)
# Children's changes arrive as events; the resync puts back what someone changed or deleted by
# hand and catches up on any event missed.
RESYNC_INTERVAL_S = 60.0
MAX_RETRY_DELAY_S = 600.0


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from the client `connect` configured (in-cluster, else $KUBECONFIG as
    set now: kopf's own client login reads the path the client cached at import)."""
    try:
        api, _ = connect()
    except ClusterUnreachableError as exc:
        raise kopf.LoginError(str(exc)) from None
    config = api.api_client.configuration
    header = config.get_api_key_with_prefix("BearerToken") or ""
    scheme, _space, token = header.rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
        trust_env=settings.networking.trust_env,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and the last-handled spec live in annotations: the CRD's status schema is
    # structural, so anything kopf put there unasked would be pruned.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    namespaces = list(memo.get("namespaces") or [])
    if namespaces:
        # Watching named namespaces needs no list/watch of all namespaces (nor of CRDs): the
        # operator checked at start that the LLMDeployment CRD is installed.
        settings.scanning.disabled = True
    try:
        api, _ = await asyncio.to_thread(connect)
    except ClusterUnreachableError as exc:
        raise kopf.PermanentError(str(exc)) from None
    reconciler = Reconciler(api, OperatorConfig.from_environment())
    memo.reconciler = reconciler
    resyncer = Resyncer(reconciler, namespaces)
    memo.resync = asyncio.create_task(_resync_forever(resyncer, RESYNC_INTERVAL_S))


async def _resync_forever(resyncer: Resyncer, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(resyncer.run_once)
        except KubeError as exc:
            logger.warning("resync failed, tried again in %.0f s: %s", interval_s, exc)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("resync")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def retry_delay(retry: int) -> float:
    """Seconds before kopf retries a transient failure: doubling from 10 s, at most 10 min."""
    return float(min(10.0 * 2 ** max(retry, 0), MAX_RETRY_DELAY_S))


@kopf.on.resume(*LLMD)
@kopf.on.create(*LLMD)
@kopf.on.update(*LLMD)
def reconcile(body: Mapping[str, Any], memo: kopf.Memo, retry: int = 0, **_: Any) -> None:
    """The spec is new (or the operator restarted): verify the children with a dry run, then
    apply them. A bad spec or a refused child fails until the spec changes (the resync retries
    refused children with backoff); a transient failure is retried with backoff."""
    try:
        memo.reconciler.reconcile(body, verify=True)
    except InvalidSpecError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    except ChildRejectedError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=retry_delay(retry)) from exc


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
    except (InvalidSpecError, ChildRejectedError):
        return
    except KubeError as exc:
        # event handlers are not retried; the resync catches up
        logger.warning("status of %s/%s not refreshed: %s", *owner, exc)
