"""Grafana's dashboard JSON model, as much as kvfleet's dashboards use: panels of PromQL
queries laid out on a grid, template variables, and the query helpers the panels share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39  # Grafana 11's dashboard JSON model


DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


RATE = "$__rate_interval"
# The gateway's series of one LLMDeployment (its Service is the job)
GATEWAY = 'namespace="$namespace", job="$deployment"'


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
