"""Every dashboard query returns data from a real Prometheus scraping a running `kvfleet serve`
(the gateway and two SmolLM2 engines) after some load, with the operator's SLO rules loaded.

Prometheus scrapes with the labels the operator's monitors give in a cluster: the gateway as
job `chat` in namespace `llm` (ServiceMonitor: job = the Service), engines as pods
`chat-engine-N` (PodMonitor).
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from kvfleet.engine.server.commands import ENGINE_PORT
from kvfleet.operator.build_monitoring import rule_groups
from kvfleet.operator.common import Owner
from kvfleet.operator.dashboards import DASHBOARDS, EMPTY
from kvfleet.operator.grafana import expand, render
from kvfleet.operator.spec import parse_spec

from .conftest import MODEL, Server, end_process, engine_options, free_port, launch

REPLICAS = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp_path = tmp_path_factory.mktemp("serve")
    port = free_port()
    command = [sys.executable, "-m", "kvfleet.cli.main", "serve", MODEL]
    command += ["--replicas", str(REPLICAS), *engine_options(port), "--log-level", "warning"]

    def all_ready(server: Server) -> bool:
        metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
        ready = [
            line
            for line in metrics.splitlines()
            if line.startswith("kvfleet:gateway_replica_ready")
        ]
        return len(ready) == REPLICAS and all(line.endswith(" 1.0") for line in ready)

    server = launch(tmp_path, "serve", port, command, 300, all_ready)
    yield server
    end_process(server)


@pytest.fixture(scope="module")
def prometheus(
    stack: Server, prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("prometheus")
    owner = Owner("chat", "llm", "uid", parse_spec({"model": {"source": MODEL}}))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(owner)}))
    gateway = stack.url.removeprefix("http://")
    engines = [
        {
            "targets": [f"127.0.0.1:{ENGINE_PORT + 1 + i}"],
            "labels": {"namespace": "llm", "pod": f"chat-engine-{i}"},
        }
        for i in range(REPLICAS)
    ]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {
                "job_name": "chat",
                "static_configs": [{"targets": [gateway], "labels": {"namespace": "llm"}}],
            },
            {"job_name": "llm/chat-engine", "static_configs": engines},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        prometheus_binary,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]

    def ready(server: Server) -> bool:
        return httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200

    server = launch(tmp_path, "prometheus", port, command, 60, ready)
    yield server.url
    server.process.terminate()
    server.process.wait(30)


def send_load(base_url: str, prometheus: str) -> None:
    """One request, then the load once Prometheus holds the request counter: rates over the
    load need a sample from before it (a counter series starts at its first request)."""
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.completions.create(model=MODEL, prompt="primer", max_tokens=2).choices
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not query(prometheus, "kvfleet:gateway_requests_total"):
        time.sleep(0.5)
    time.sleep(2)  # (a scrape or two more)

    def stream(i: int) -> None:
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=12,
            stream=True,
        )
        assert sum(1 for _ in chunks) > 2

    def complete(i: int) -> None:
        reply = client.completions.create(model=MODEL, prompt=f"{i} plus {i} is", max_tokens=4)
        assert reply.choices

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        work = [pool.submit(stream, i) for i in range(12)]
        work += [pool.submit(complete, i) for i in range(6)]
        for future in work:
            future.result()
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30)
    body = reply.json()
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_every_dashboard_query_returns_data(stack: Server, prometheus: str) -> None:
    send_load(stack.url, prometheus)
    # a few scrapes and rule evaluations after the load
    deadline = time.monotonic() + 60
    probe = 'kvfleet_slo:error_ratio:rate5m{slo="latency"}'
    while time.monotonic() < deadline and not query(prometheus, probe):
        time.sleep(1)
    time.sleep(3)
    empty, checked = [], 0
    for dashboard in DASHBOARDS:
        model = render(dashboard)
        for panel in model["panels"]:
            for target in panel["targets"]:
                checked += 1
                result = query(prometheus, expand(target["expr"], "llm", "chat"))
                if not result and not panel["description"].startswith(EMPTY):
                    empty.append(f"{model['title']} / {panel['title']} / {target['legendFormat']}")
    assert checked >= 40
    assert empty == [], "panels with no data: " + "; ".join(empty)


def test_template_variables_find_the_deployment(stack: Server, prometheus: str) -> None:
    for series, label, expected in (
        ("kvfleet:gateway_requests_total", "namespace", "llm"),
        ('kvfleet:gateway_requests_total{namespace="llm"}', "job", "chat"),
        ('kvfleet:gateway_requests_total{namespace="llm", job="chat"}', "model", MODEL),
    ):
        reply = httpx.get(
            f"{prometheus}/api/v1/label/{label}/values", params={"match[]": series}, timeout=10
        )
        assert expected in reply.json()["data"]


def test_slo_rules_see_the_traffic(stack: Server, prometheus: str) -> None:
    availability = query(prometheus, 'kvfleet_slo:error_ratio:rate5m{slo="availability"}')
    assert availability
    assert float(availability[0]["value"][1]) == 0.0  # a 404 is the client's error, not ours
    budget = query(prometheus, "kvfleet_slo:error_budget_remaining:ratio30d")
    assert {r["metric"]["slo"] for r in budget} == {"availability", "latency"}
