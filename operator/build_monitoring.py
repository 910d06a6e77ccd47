"""Pure builders for Prometheus operator objects: a PodMonitor for the engines (every pod, so a
replica that stops answering shows as `up == 0`), a ServiceMonitor for the gateway, and the
deployment's PrometheusRule. The operator creates them only when their CRDs exist."""

from __future__ import annotations

from typing import Any

from kvfleet.operator.common import ENGINE, GATEWAY, Owner

MONITORING_API = "monitoring.coreos.com/v1"
MONITORING_CRDS = {
    "PodMonitor": "podmonitors.monitoring.coreos.com",
    "ServiceMonitor": "servicemonitors.monitoring.coreos.com",
    "PrometheusRule": "prometheusrules.monitoring.coreos.com",
}


def build_engine_pod_monitor(owner: Owner) -> dict[str, Any]:
    endpoint = {"port": "http", "path": "/metrics", "interval": owner.spec.monitoring.interval}
    return {
        "apiVersion": MONITORING_API,
        "kind": "PodMonitor",
        "metadata": owner.metadata(ENGINE),
        "spec": {
            "selector": {"matchLabels": owner.selector(ENGINE)},
            "podMetricsEndpoints": [endpoint],
        },
    }


def build_gateway_service_monitor(owner: Owner) -> dict[str, Any]:
    endpoint = {"port": "http", "path": "/metrics", "interval": owner.spec.monitoring.interval}
    return {
        "apiVersion": MONITORING_API,
        "kind": "ServiceMonitor",
        "metadata": owner.metadata(GATEWAY),
        "spec": {"selector": {"matchLabels": owner.selector(GATEWAY)}, "endpoints": [endpoint]},
    }


def build_prometheus_rule(owner: Owner) -> dict[str, Any]:
    engines = f'namespace="{owner.namespace}", pod=~"{owner.names(ENGINE)}-.*"'
    labels = {"severity": "warning", "llmdeployment": owner.name}

    def alert(name: str, expr: str, duration: str, summary: str) -> dict[str, Any]:
        return {
            "alert": name,
            "expr": expr,
            "for": duration,
            "labels": labels,
            "annotations": {
                "summary": summary,
                "runbook_url": f"https://kvfleet.dev/runbooks#{name.lower()}",
            },
        }

    rules = [
        alert(
            "KvfleetEngineDown",
            f"max by (pod) (up{{{engines}}}) == 0",
            "5m",
            f"An engine pod of {owner.namespace}/{owner.name} does not answer its scrape.",
        ),
        alert(
            "KvfleetKVCacheFull",
            f"max(kvfleet:kv_cache_usage_perc{{{engines}}}) > 0.95",
            "10m",
            f"The KV cache of {owner.namespace}/{owner.name} is nearly full: add replicas.",
        ),
        alert(
            "KvfleetRequestsWaiting",
            f"sum(kvfleet:num_requests_waiting{{{engines}}}) > 10 * count(up{{{engines}}} == 1)",
            "10m",
            f"Requests queue in the engines of {owner.namespace}/{owner.name}.",
        ),
    ]
    return {
        "apiVersion": MONITORING_API,
        "kind": "PrometheusRule",
        "metadata": owner.metadata(ENGINE, name=owner.name),
        "spec": {"groups": [{"name": f"kvfleet-{owner.name}", "rules": rules}]},
    }
