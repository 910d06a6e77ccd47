"""Grafana dashboards for kvfleet, generated here and checked in under manifests/monitoring/.

`python -m kvfleet.operator.dashboards` rewrites `manifests/monitoring/dashboards/*.json`; a test
fails when they drift, and an integration test evaluates every panel's queries on a real
Prometheus scraping a running gateway and engines. Series are selected the way the operator's
monitors label them: the gateway by `namespace` and `job` (its Service, the LLMDeployment's
name), engines by `namespace` and `pod` (`NAME-engine-...`), SLOs by `llmdeployment`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 39  # Grafana 11's dashboard JSON model
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GATEWAY = 'namespace="$namespace", job="$deployment"'
MODELS = f'{GATEWAY}, model=~"$model"'
ENGINES = 'namespace="$namespace", pod=~"$deployment-engine-.*"'
SLOS = 'namespace="$namespace", llmdeployment="$deployment"'
RATE = "$__rate_interval"
EMPTY = "Empty when idle: "  # a panel's description starts so when no data is expected at rest


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    kind: str = "timeseries"
    width: int = 12


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[str, ...] = field(default=("namespace", "deployment", "model"))


def per_second(by: str, metric: str, selector: str) -> str:
    """`sum by (BY) (rate(METRIC{SELECTOR}[$__rate_interval]))`; BY may be empty."""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{selector}}}[{RATE}]))"


def quantiles(metric: str, selector: str, by: str = "") -> tuple[tuple[str, str], ...]:
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, {per_second(group, metric + '_bucket', selector)})",
            f"{legend}p{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    )


def ratio(numerator: str, denominator: str, selector: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return (
        f"sum{group} (rate({numerator}{{{selector}}}[{RATE}])) / "
        f"sum{group} (rate({denominator}{{{selector}}}[{RATE}]))"
    )


OVERVIEW = Dashboard(
    uid="kvfleet-overview",
    title="kvfleet / Overview",
    description="Requests, errors, latency and tokens of one LLMDeployment, by model and adapter.",
    panels=(
        Panel(
            "Requests by status",
            "reqps",
            (
                (
                    f"sum by (status) (rate(kvfleet:gateway_requests_total{{{MODELS}}}[{RATE}]))",
                    "{{status}}",
                ),
            ),
        ),
        Panel(
            "Requests by model and adapter",
            "reqps",
            (
                (
                    f"sum by (model) (rate(kvfleet:gateway_requests_total{{{MODELS}}}[{RATE}]))",
                    "{{model}}",
                ),
            ),
        ),
        Panel(
            "Server errors (5xx share)",
            "percentunit",
            (
                (
                    f'(sum(rate(kvfleet:gateway_requests_total{{{MODELS}, status=~"5.."}}[{RATE}]))'
                    " or vector(0)) / " + per_second("", "kvfleet:gateway_requests_total", MODELS),
                    "5xx share",
                ),
            ),
        ),
        Panel(
            "Time to first token",
            "s",
            quantiles("kvfleet:gateway_time_to_first_token_seconds", MODELS),
            "Streamed requests, from arrival at the gateway to the first token chunk.",
        ),
        Panel(
            "Inter-token latency",
            "s",
            quantiles("kvfleet:gateway_inter_token_latency_seconds", MODELS),
        ),
        Panel(
            "End-to-end latency",
            "s",
            quantiles("kvfleet:gateway_request_latency_seconds", MODELS),
        ),
        Panel(
            "Tokens per second",
            "short",
            (
                (f"sum(rate(kvfleet:generation_tokens_total{{{ENGINES}}}[{RATE}]))", "generated"),
                (f"sum(rate(kvfleet:prompt_tokens_total{{{ENGINES}}}[{RATE}]))", "prompt"),
            ),
        ),
        Panel(
            "Tokens per second by model",
            "short",
            (
                (
                    per_second("model_name", "kvfleet:generation_tokens_total", ENGINES),
                    "{{model_name}}",
                ),
            ),
        ),
    ),
)

ENGINES_DASHBOARD = Dashboard(
    uid="kvfleet-engines",
    title="kvfleet / Engines",
    description="Each engine replica of one LLMDeployment: KV cache, batch, preemptions, caching.",
    variables=("namespace", "deployment"),
    panels=(
        Panel(
            "KV cache usage",
            "percentunit",
            ((f"max by (pod) (kvfleet:kv_cache_usage_perc{{{ENGINES}}})", "{{pod}}"),),
        ),
        Panel(
            "Running requests",
            "short",
            ((f"sum by (pod) (kvfleet:num_requests_running{{{ENGINES}}})", "{{pod}}"),),
        ),
        Panel(
            "Waiting requests",
            "short",
            ((f"sum by (pod) (kvfleet:num_requests_waiting{{{ENGINES}}})", "{{pod}}"),),
        ),
        Panel(
            "Preemptions",
            "ops",
            (
                (
                    f"sum by (pod) (rate(kvfleet:num_preemptions_total{{{ENGINES}}}[{RATE}]))",
                    "{{pod}}",
                ),
            ),
        ),
        Panel(
            "Prefix cache hit rate",
            "percentunit",
            (
                (
                    ratio(
                        "kvfleet:prefix_cache_hits_total",
                        "kvfleet:prefix_cache_queries_total",
                        ENGINES,
                        "pod",
                    ),
                    "{{pod}}",
                ),
            ),
            "Prompt tokens found in the prefix cache, of those looked up.",
        ),
        Panel(
            "Speculative decoding acceptance",
            "percentunit",
            (
                (
                    ratio(
                        "kvfleet:spec_decode_num_accepted_tokens_total",
                        "kvfleet:spec_decode_num_draft_tokens_total",
                        ENGINES,
                        "pod",
                    ),
                    "{{pod}}",
                ),
            ),
            EMPTY + "draft tokens accepted, of those proposed; only with speculative decoding on.",
        ),
        Panel(
            "Time to first token by replica (p99)",
            "s",
            (
                (
                    f"histogram_quantile(0.99, sum by (le, pod) "
                    f"(rate(kvfleet:time_to_first_token_seconds_bucket{{{ENGINES}}}[{RATE}])))",
                    "{{pod}}",
                ),
            ),
        ),
        Panel("Replica up", "short", ((f"up{{{ENGINES}}}", "{{pod}}"),)),
    ),
)

GATEWAY_DASHBOARD = Dashboard(
    uid="kvfleet-gateway",
    title="kvfleet / Gateway",
    description="Admission, routing and replica health at the gateway of one LLMDeployment.",
    variables=("namespace", "deployment"),
    panels=(
        Panel(
            "Queue depth and in flight",
            "short",
            (
                (f"sum(kvfleet:gateway_queue_depth{{{GATEWAY}}})", "queued"),
                (f"sum(kvfleet:gateway_in_flight{{{GATEWAY}}})", "in flight"),
            ),
        ),
        Panel("Queue wait", "s", quantiles("kvfleet:gateway_queue_wait_seconds", GATEWAY)),
        Panel(
            "Rate limited",
            "reqps",
            (
                (
                    f"sum by (key) (rate(kvfleet:gateway_rate_limited_total{{{GATEWAY}}}[{RATE}]))",
                    "{{key}}",
                ),
            ),
            EMPTY + "requests refused by a per-key rate limit (429).",
        ),
        Panel(
            "Routing decisions",
            "ops",
            (
                (
                    per_second("reason", "kvfleet:gateway_routing_decisions_total", GATEWAY),
                    "{{reason}}",
                ),
            ),
        ),
        Panel(
            "Prefix blocks found on the chosen replica",
            "percentunit",
            (
                (
                    ratio(
                        "kvfleet:gateway_prefix_hit_blocks_total",
                        "kvfleet:gateway_prompt_blocks_total",
                        GATEWAY,
                    ),
                    "hit share",
                ),
            ),
        ),
        Panel(
            "Replica health",
            "short",
            ((f"max by (replica) (kvfleet:gateway_replica_ready{{{GATEWAY}}})", "{{replica}}"),),
        ),
        Panel(
            "KV event lag",
            "s",
            (
                (
                    "max by (replica) "
                    f"(kvfleet:gateway_replica_kv_events_lag_seconds{{{GATEWAY}}})",
                    "{{replica}}",
                ),
            ),
        ),
    ),
)

SLO_DASHBOARD = Dashboard(
    uid="kvfleet-slos",
    title="kvfleet / SLOs",
    description=(
        "Availability (non-5xx answers) and latency (streams under the TTFT threshold) SLOs of "
        "one LLMDeployment, from the rules the operator installs."
    ),
    variables=("namespace", "deployment"),
    panels=(
        Panel(
            "Error budget remaining (30 days)",
            "percentunit",
            ((f"kvfleet_slo:error_budget_remaining:ratio30d{{{SLOS}}}", "{{slo}}"),),
            kind="stat",
        ),
        Panel(
            "Objectives",
            "percentunit",
            ((f"kvfleet_slo:objective{{{SLOS}}}", "{{slo}}"),),
            kind="stat",
        ),
        Panel(
            "Burn rate",
            "short",
            tuple(
                (
                    f"kvfleet_slo:error_ratio:rate{w}{{{SLOS}}}"
                    f" / (1 - kvfleet_slo:objective{{{SLOS}}})",
                    f"{{{{slo}}}} {w}",
                )
                for w in ("5m", "1h", "6h", "1d")
            ),
            "1 spends the budget exactly in 30 days; alerts page at 14.4 (1h) and 6 (6h).",
            width=24,
        ),
        Panel(
            "Bad event share (5m)",
            "percentunit",
            ((f"kvfleet_slo:error_ratio:rate5m{{{SLOS}}}", "{{slo}}"),),
            width=24,
        ),
    ),
)

DASHBOARDS = (OVERVIEW, ENGINES_DASHBOARD, GATEWAY_DASHBOARD, SLO_DASHBOARD)


def expand(
    expr: str, namespace: str, deployment: str, model: str = ".*", rate_interval: str = "1m"
) -> str:
    """A panel query as Grafana sends it for one choice of the template variables."""
    return (
        expr.replace(RATE, rate_interval)
        .replace("$namespace", namespace)
        .replace("$deployment", deployment)
        .replace("$model", model)
    )


def _variable(name: str) -> dict[str, Any]:
    queries = {
        "namespace": "label_values(kvfleet:gateway_requests_total, namespace)",
        "deployment": 'label_values(kvfleet:gateway_requests_total{namespace="$namespace"}, job)',
        "model": f"label_values(kvfleet:gateway_requests_total{{{GATEWAY}}}, model)",
    }
    variable: dict[str, Any] = {
        "name": name,
        "label": name.capitalize(),
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": queries[name], "refId": f"{name}-variable"},
        "definition": queries[name],
        "refresh": 2,  # on time range change
        "sort": 1,
        "includeAll": name == "model",
        "multi": name == "model",
    }
    if name == "model":
        variable["allValue"] = ".*"
    return variable


def _panel(panel: Panel, index: int, y: int, x: int) -> dict[str, Any]:
    targets = [
        {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
        for i, (expr, legend) in enumerate(panel.targets)
    ]
    options: dict[str, Any] = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    if panel.kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return {
        "id": index,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": options,
        "targets": targets,
    }


def render(dashboard: Dashboard) -> dict[str, Any]:
    panels = []
    x = y = 0
    for index, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > 24:
            x, y = 0, y + 8
        panels.append(_panel(panel, index, y, x))
        x += panel.width
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
    }
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["kvfleet"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [datasource, *(_variable(v) for v in dashboard.variables)]},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def render_json(dashboard: Dashboard) -> str:
    return json.dumps(render(dashboard), indent=2) + "\n"


def write_all(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for dashboard in DASHBOARDS:
        path = folder / f"{dashboard.uid}.json"
        path.write_text(render_json(dashboard))
        written.append(path)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "manifests/monitoring/dashboards")
    for written_path in write_all(target):
        sys.stdout.write(f"{written_path}\n")
