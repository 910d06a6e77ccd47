"""The PrometheusRule the operator writes, checked and unit-tested by the real `promtool`: each
burn-rate alert fires under a synthetic burn and stays silent under a healthy series."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from kvfleet.operator.build_monitoring import prometheus_le, rule_groups
from kvfleet.operator.common import Owner
from kvfleet.operator.spec import parse_spec

GATEWAY = 'namespace="llm", job="chat", model="smollm2"'
MINUTES_3D = 3 * 24 * 60


def check_rules(promtool: str, *files: Path) -> None:
    """`promtool check rules` passes on every file."""
    result = subprocess.run(
        [promtool, "check", "rules", *map(str, files)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def owner(slo: dict[str, Any] | None = None) -> Owner:
    spec: dict[str, Any] = {"model": {"source": "smollm2"}}
    if slo is not None:
        spec["monitoring"] = {"slo": slo}
    return Owner("chat", "llm", "uid", parse_spec(spec))


def requests(per_minute: int, errors_per_minute: int, minutes: int) -> list[dict[str, str]]:
    """Gateway request counters: `per_minute` answers, of which `errors_per_minute` are 503."""
    series = [
        {
            "series": f'kvfleet:gateway_requests_total{{{GATEWAY}, key="k", status="200"}}',
            "values": f"0+{per_minute - errors_per_minute}x{minutes}",
        }
    ]
    if errors_per_minute:
        series.append(
            {
                "series": f'kvfleet:gateway_requests_total{{{GATEWAY}, key="k", status="503"}}',
                "values": f"0+{errors_per_minute}x{minutes}",
            }
        )
    return series


def streams(per_minute: int, slow_per_minute: int, minutes: int, le: str) -> list[dict[str, str]]:
    """TTFT histogram counters: `slow_per_minute` of the streams miss the `le` bucket."""
    ttft = "kvfleet:gateway_time_to_first_token_seconds"
    fast = per_minute - slow_per_minute
    return [
        {"series": f'{ttft}_bucket{{{GATEWAY}, le="{le}"}}', "values": f"0+{fast}x{minutes}"},
        {"series": f'{ttft}_bucket{{{GATEWAY}, le="+Inf"}}', "values": f"0+{per_minute}x{minutes}"},
        {"series": f"{ttft}_count{{{GATEWAY}}}", "values": f"0+{per_minute}x{minutes}"},
    ]


def run_promtool(promtool: str, tmp_path: Path, rules: Owner, tests: list[dict[str, Any]]) -> str:
    rule_file = tmp_path / "rules.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": rule_groups(rules)}, sort_keys=False))
    check_rules(promtool, rule_file)
    test_file = tmp_path / "tests.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests},
            sort_keys=False,
        )
    )
    result = subprocess.run(
        [promtool, "test", "rules", str(test_file)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def alert(rules: Owner, name: str) -> dict[str, Any]:
    for group in rule_groups(rules):
        for rule in group["rules"]:
            if rule.get("alert") == name:
                return rule
    raise KeyError(name)


def fired(rules: Owner, name: str, slo: str) -> list[dict[str, Any]]:
    rule = alert(rules, name)
    labels = {"namespace": "llm", "llmdeployment": "chat", "slo": slo, **rule["labels"]}
    return [{"exp_labels": labels, "exp_annotations": rule["annotations"]}]


BURN_ALERTS = [
    f"Kvfleet{slo}BurnRate{severity}"
    for slo in ("Availability", "Latency")
    for severity in ("Critical", "Warning")
]


def silent(at: str) -> list[dict[str, Any]]:
    return [{"eval_time": at, "alertname": name, "exp_alerts": []} for name in BURN_ALERTS]


def test_healthy_series_raise_no_alert(promtool: str, tmp_path: Path) -> None:
    rules = owner()
    le = prometheus_le(1.0)
    # a little under the budget: 0.05% errors against 0.1%, 0.5% slow streams against 1%
    series = requests(2000, 1, MINUTES_3D + 60) + streams(2000, 10, MINUTES_3D + 60, le)
    run_promtool(
        promtool,
        tmp_path,
        rules,
        [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": silent("2h") + silent("3d"),
                "promql_expr_test": [
                    {
                        "expr": 'kvfleet_slo:error_ratio:rate1h{slo="availability"}',
                        "eval_time": "2h",
                        "exp_samples": [
                            {
                                "labels": 'kvfleet_slo:error_ratio:rate1h{llmdeployment="chat", '
                                'namespace="llm", slo="availability"}',
                                "value": 0.0005,
                            }
                        ],
                    }
                ],
            }
        ],
    )


def test_fast_availability_burn_pages(promtool: str, tmp_path: Path) -> None:
    rules = owner()
    # 5% errors: 50x the 0.1% budget; the 1h/5m pair crosses 14.4x well within the first hour
    run_promtool(
        promtool,
        tmp_path,
        rules,
        [
            {
                "interval": "1m",
                "input_series": requests(1000, 50, 120),
                "alert_rule_test": [
                    {
                        "eval_time": "90m",
                        "alertname": "KvfleetAvailabilityBurnRateCritical",
                        "exp_alerts": fired(
                            rules, "KvfleetAvailabilityBurnRateCritical", "availability"
                        ),
                    },
                    {
                        "eval_time": "90m",
                        "alertname": "KvfleetLatencyBurnRateCritical",
                        "exp_alerts": [],
                    },
                ],
            }
        ],
    )


def test_slow_availability_burn_opens_a_ticket_not_a_page(promtool: str, tmp_path: Path) -> None:
    rules = owner()
    # 0.4% errors: 4x the budget, above the 3x (1d/2h) threshold, below 6x and 14.4x
    minutes = 26 * 60
    run_promtool(
        promtool,
        tmp_path,
        rules,
        [
            {
                "interval": "1m",
                "input_series": requests(1000, 4, minutes),
                "alert_rule_test": [
                    {
                        "eval_time": "25h",
                        "alertname": "KvfleetAvailabilityBurnRateWarning",
                        "exp_alerts": fired(
                            rules, "KvfleetAvailabilityBurnRateWarning", "availability"
                        ),
                    },
                    {
                        "eval_time": "25h",
                        "alertname": "KvfleetAvailabilityBurnRateCritical",
                        "exp_alerts": [],
                    },
                ],
            }
        ],
    )


def test_latency_burn_pages_at_the_configured_threshold(promtool: str, tmp_path: Path) -> None:
    rules = owner({"latency": 0.95, "ttftThreshold": "500ms"})
    le = prometheus_le(0.5)
    assert le == "0.5"
    # 20% of streams miss 500 ms against a 5% budget: 4x; above 3x (ticket), below 6x (page)
    minutes = 26 * 60
    slow_ticket = streams(1000, 200, minutes, le)
    # 90% slow: 18x, pages
    slow_page = streams(1000, 900, 120, le)
    run_promtool(
        promtool,
        tmp_path,
        rules,
        [
            {
                "interval": "1m",
                "input_series": slow_ticket,
                "alert_rule_test": [
                    {
                        "eval_time": "25h",
                        "alertname": "KvfleetLatencyBurnRateWarning",
                        "exp_alerts": fired(rules, "KvfleetLatencyBurnRateWarning", "latency"),
                    },
                    {
                        "eval_time": "25h",
                        "alertname": "KvfleetLatencyBurnRateCritical",
                        "exp_alerts": [],
                    },
                ],
            },
            {
                "interval": "1m",
                "input_series": slow_page,
                "alert_rule_test": [
                    {
                        "eval_time": "90m",
                        "alertname": "KvfleetLatencyBurnRateCritical",
                        "exp_alerts": fired(rules, "KvfleetLatencyBurnRateCritical", "latency"),
                    },
                    {
                        "eval_time": "90m",
                        "alertname": "KvfleetAvailabilityBurnRateCritical",
                        "exp_alerts": [],
                    },
                ],
            },
        ],
    )


def test_no_traffic_is_not_an_outage(promtool: str, tmp_path: Path) -> None:
    idle = [
        {
            "series": f'kvfleet:gateway_requests_total{{{GATEWAY}, key="k", status="200"}}',
            "values": "0x200",
        }
    ]
    run_promtool(
        promtool,
        tmp_path,
        owner(),
        [{"interval": "1m", "input_series": idle, "alert_rule_test": silent("3h")}],
    )


def test_fleet_rules_and_the_operators_rules_pass_promtool_check(
    promtool: str, tmp_path: Path, repo_root: Path
) -> None:
    fleet = yaml.safe_load((repo_root / "manifests/monitoring/fleet-rules.yaml").read_text())
    samples = sorted(repo_root.glob("manifests/samples/*.yaml"))
    files = [tmp_path / "fleet.yaml"]
    files[0].write_text(yaml.safe_dump({"groups": fleet["spec"]["groups"]}))
    for path in samples:
        obj = yaml.safe_load(path.read_text())
        sample = Owner(obj["metadata"]["name"], "default", "uid", parse_spec(obj["spec"]))
        files.append(tmp_path / path.name)
        files[-1].write_text(yaml.safe_dump({"groups": rule_groups(sample)}))
    check_rules(promtool, *files)
