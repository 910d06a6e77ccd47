"""The Kubernetes API client of a gateway pod: the one given (tests), else the pod's own
service account."""

from __future__ import annotations

from typing import Any


def api_client_or_in_cluster(api_client: Any = None) -> Any:
    from kubernetes import client, config

    if api_client is None:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        api_client = client.ApiClient()
    return api_client
