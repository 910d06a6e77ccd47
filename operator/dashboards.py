"""Grafana dashboards for kvfleet, generated here and checked in under manifests/monitoring/.

`python -m kvfleet.operator.dashboards` rewrites `manifests/monitoring/dashboards/*.json`; a test
fails when they drift, and an integration test evaluates every panel's queries on a real
Prometheus scraping a running gateway and engines. Series are selected the way the operator's
monitors label them: the gateway by `namespace` and `job` (its Service, the LLMDeployment's
name), engines by `namespace` and `pod` (`NAME-engine-...`), SLOs by `llmdeployment`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvfleet.operator.grafana import (
    GATEWAY,
    RATE,
    Dashboard,
    Panel,
    per_second,
    quantiles,
    ratio,
    render_json,
)

MODELS = f'{GATEWAY}, model=~"$model"'
ENGINES = 'namespace="$namespace", pod=~"$deployment-engine-.*"'
SLOS = 'namespace="$namespace", llmdeployment="$deployment"'
EMPTY = "Empty when idle: "  # a panel's description starts so when no data is expected at rest


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
