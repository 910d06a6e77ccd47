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


# (long window, short window, burn rate, severity): the multi-window, multi-burn-rate alerts of
# the SRE workbook. A 14.4x burn spends 2% of a 30-day budget in an hour; 6x, 5% in 6 hours;
# 3x, 10% in a day; 1x, 10% in 3 days.
BURN_ALERTS = (
    ("1h", "5m", 14.4, "critical"),
    ("6h", "30m", 6.0, "critical"),
    ("1d", "2h", 3.0, "warning"),
    ("3d", "6h", 1.0, "warning"),
)
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
RUNBOOK = "https://kvfleet.dev/runbooks#"


def prometheus_le(bound: float) -> str:
    """A histogram bound as the `le` label the Python Prometheus client writes (1 -> "1.0")."""
    return repr(float(bound))


def _selectors(owner: Owner) -> tuple[str, str]:
    """Series of this deployment's gateway (ServiceMonitor: job = the Service) and engines."""
    gateway = f'namespace="{owner.namespace}", job="{owner.name}"'
    engines = f'namespace="{owner.namespace}", pod=~"{owner.names(ENGINE)}-.*"'
    return gateway, engines


def slo_error_ratio(owner: Owner, slo: str, window: str) -> str:
    """PromQL: the share of bad events over `window` (availability: 5xx answers; latency:
    streams whose first token came after the threshold)."""
    gateway, _ = _selectors(owner)
    if slo == "availability":
        requests = "kvfleet:gateway_requests_total"
        bad = f'sum(rate({requests}{{{gateway}, status=~"5.."}}[{window}])) or vector(0)'
        return f"({bad}) / sum(rate({requests}{{{gateway}}}[{window}]))"
    ttft = "kvfleet:gateway_time_to_first_token_seconds"
    le = prometheus_le(owner.spec.monitoring.slo.ttft_threshold_seconds)
    fast = f'sum(rate({ttft}_bucket{{{gateway}, le="{le}"}}[{window}]))'
    return f"1 - {fast} / sum(rate({ttft}_count{{{gateway}}}[{window}]))"


def rule_groups(owner: Owner) -> list[dict[str, Any]]:
    """The deployment's rule groups: SLI recording rules, SLO burn-rate alerts, and operational
    alerts. Also what `promtool test rules` runs against in the tests."""
    slo = owner.spec.monitoring.slo
    objectives = {"availability": slo.availability, "latency": slo.latency}
    ident = {"namespace": owner.namespace, "llmdeployment": owner.name}
    recording: list[dict[str, Any]] = []
    for name, objective in objectives.items():
        labels = {**ident, "slo": name}
        recording.append(
            {"record": "kvfleet_slo:objective", "expr": f"vector({objective})", "labels": labels}
        )
        for window in WINDOWS:
            recording.append(
                {
                    "record": f"kvfleet_slo:error_ratio:rate{window}",
                    "expr": slo_error_ratio(owner, name, window),
                    "labels": labels,
                }
            )
        this = ", ".join(f'{k}="{v}"' for k, v in labels.items())
        budget = 1 - objective
        recording.append(
            {
                "record": "kvfleet_slo:error_budget_remaining:ratio30d",
                "expr": (
                    f"1 - avg_over_time(kvfleet_slo:error_ratio:rate5m{{{this}}}[30d]) / {budget:g}"
                ),
                "labels": labels,
            }
        )
    return [
        {"name": f"kvfleet-{owner.name}-slo.rules", "rules": recording},
        {"name": f"kvfleet-{owner.name}-slo.alerts", "rules": _burn_alerts(owner, objectives)},
        {"name": f"kvfleet-{owner.name}.alerts", "rules": _operational_alerts(owner)},
    ]


def _burn_alerts(owner: Owner, objectives: dict[str, float]) -> list[dict[str, Any]]:
    alerts = []
    what = {
        "availability": "answers that are 5xx errors",
        "latency": (
            f"streams slower than {owner.spec.monitoring.slo.ttft_threshold} to their first token"
        ),
    }
    for name, objective in objectives.items():
        this = f'namespace="{owner.namespace}", llmdeployment="{owner.name}", slo="{name}"'
        for severity in ("critical", "warning"):
            pairs = [(lng, sht, rate) for lng, sht, rate, sev in BURN_ALERTS if sev == severity]
            terms = [
                f"(kvfleet_slo:error_ratio:rate{lng}{{{this}}} > {rate * (1 - objective):g}"
                f" and kvfleet_slo:error_ratio:rate{sht}{{{this}}} > {rate * (1 - objective):g})"
                for lng, sht, rate in pairs
            ]
            alert = f"Kvfleet{name.capitalize()}BurnRate{severity.capitalize()}"
            windows = ", ".join(f"{lng}/{sht} at {rate:g}x" for lng, sht, rate in pairs)
            alerts.append(
                {
                    "alert": alert,
                    "expr": "\n  or\n".join(terms),
                    "for": "2m" if severity == "critical" else "15m",
                    "labels": {"severity": severity},
                    "annotations": {
                        "summary": (
                            f"{owner.namespace}/{owner.name} burns its {name} error budget "
                            f"({windows}; objective {objective:g})."
                        ),
                        "description": (
                            f"The share of {what[name]} exceeds the SLO's error budget of "
                            f"{1 - objective:g} by the burn rate in both windows."
                        ),
                        "runbook_url": RUNBOOK + alert.lower(),
                    },
                }
            )
    return alerts


def _operational_alerts(owner: Owner) -> list[dict[str, Any]]:
    _, engines = _selectors(owner)
    labels = {"severity": "warning", "llmdeployment": owner.name}

    def alert(name: str, expr: str, duration: str, summary: str) -> dict[str, Any]:
        return {
            "alert": name,
            "expr": expr,
            "for": duration,
            "labels": labels,
            "annotations": {"summary": summary, "runbook_url": RUNBOOK + name.lower()},
        }

    return [
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


def build_prometheus_rule(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": MONITORING_API,
        "kind": "PrometheusRule",
        "metadata": owner.metadata(ENGINE, name=owner.name),
        "spec": {"groups": rule_groups(owner)},
    }
