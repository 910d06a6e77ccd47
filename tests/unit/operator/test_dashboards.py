"""The Grafana dashboards: checked in as generated, well-formed for the dashboard JSON model of the
schema version they declare, every query valid PromQL (promtool), titles, units and legends set."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvfleet.operator.dashboards import DASHBOARDS
from kvfleet.operator.grafana import SCHEMA_VERSION, expand, render, render_json

from .test_slo_rules import check_rules

FOLDER = "manifests/monitoring/dashboards"
UNITS = {"reqps", "ops", "s", "percentunit", "short"}

# Grafana's dashboard JSON model (schemaVersion 39): the fields a provisioned dashboard needs,
# with their types, and the shape of every panel, target and query variable we emit.
DASHBOARD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating", "time", "version"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"const": SCHEMA_VERSION},
        "version": {"type": "integer"},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "refresh": {"type": "string"},
        "timezone": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {
                "list": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "type"],
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-z_]+$"},
                            "type": {"enum": ["query", "datasource", "custom", "constant"]},
                            "refresh": {"enum": [0, 1, 2]},
                        },
                    },
                }
            },
        },
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "type", "title", "gridPos", "targets", "fieldConfig"],
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "type": {"enum": ["timeseries", "stat"]},
                    "title": {"type": "string", "minLength": 1},
                    "gridPos": {
                        "type": "object",
                        "required": ["h", "w", "x", "y"],
                        "properties": {
                            "h": {"type": "integer", "minimum": 1},
                            "w": {"type": "integer", "minimum": 1, "maximum": 24},
                            "x": {"type": "integer", "minimum": 0, "maximum": 23},
                            "y": {"type": "integer", "minimum": 0},
                        },
                    },
                    "datasource": {
                        "type": "object",
                        "required": ["type", "uid"],
                        "properties": {"type": {"const": "prometheus"}},
                    },
                    "fieldConfig": {
                        "type": "object",
                        "required": ["defaults", "overrides"],
                        "properties": {
                            "defaults": {
                                "type": "object",
                                "required": ["unit"],
                                "properties": {"unit": {"enum": sorted(UNITS)}},
                            }
                        },
                    },
                    "targets": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["refId", "expr", "legendFormat", "datasource"],
                            "properties": {
                                "refId": {"type": "string", "pattern": "^[A-Z]$"},
                                "expr": {"type": "string", "minLength": 1},
                                "legendFormat": {"type": "string", "minLength": 1},
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_checked_in_dashboards_are_generated(repo_root: Path) -> None:
    files = sorted(p.name for p in (repo_root / FOLDER).glob("*.json"))
    assert files == sorted(f"{d.uid}.json" for d in DASHBOARDS)
    for dashboard in DASHBOARDS:
        text = (repo_root / FOLDER / f"{dashboard.uid}.json").read_text()
        assert text == render_json(dashboard), (
            f"{dashboard.uid} drifted: run `python -m kvfleet.operator.dashboards`"
        )


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=[d.uid for d in DASHBOARDS])
def test_dashboard_is_well_formed(dashboard: Any) -> None:
    model = render(dashboard)
    jsonschema.validate(model, DASHBOARD_SCHEMA)
    panels = model["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
    # every variable a query uses is defined, and every defined variable is used
    defined = {v["name"] for v in model["templating"]["list"]}
    used = set()
    for panel in panels:
        for target in panel["targets"]:
            used |= set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
    assert used <= defined
    assert {"namespace", "deployment"} <= used
    assert defined - used <= {"datasource"}


def test_dashboards_cover_what_operators_watch() -> None:
    titles = {p.title for d in DASHBOARDS for p in d.panels}
    for wanted in (
        "Time to first token",
        "Inter-token latency",
        "End-to-end latency",
        "Tokens per second",
        "Requests by model and adapter",
        "KV cache usage",
        "Waiting requests",
        "Preemptions",
        "Prefix cache hit rate",
        "Speculative decoding acceptance",
        "Queue wait",
        "Rate limited",
        "Routing decisions",
        "Replica health",
        "Error budget remaining (30 days)",
        "Burn rate",
    ):
        assert wanted in titles


def test_every_query_is_valid_promql(promtool: str, tmp_path: Path) -> None:
    rules = []
    for dashboard in DASHBOARDS:
        model = render(dashboard)  # (variables use Grafana's label_values(), not PromQL)
        for panel in model["panels"]:
            for target in panel["targets"]:
                expr = expand(target["expr"], "llm", "chat")
                rules.append({"record": f"check:{len(rules)}", "expr": expr})
    rule_file = tmp_path / "queries.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    check_rules(promtool, rule_file)


def test_the_dashboards_configmap_carries_them(repo_root: Path) -> None:
    kustomization = yaml.safe_load(
        (repo_root / "manifests/monitoring/kustomization.yaml").read_text()
    )
    (generator,) = kustomization["configMapGenerator"]
    assert sorted(generator["files"]) == sorted(f"dashboards/{d.uid}.json" for d in DASHBOARDS)
    assert kustomization["generatorOptions"]["labels"]["grafana_dashboard"] == "1"
    for name in generator["files"]:
        json.loads((repo_root / "manifests/monitoring" / name).read_text())
