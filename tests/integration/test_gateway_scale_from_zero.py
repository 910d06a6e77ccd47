"""Scale from zero through the real gateway in cluster mode: a request arriving while the
LLMDeployment runs no engine is held, the gateway raises the scale to 1, and the request is
answered once the engine is ready. Against the strict fake API, as the gateway's ServiceAccount
with the Role the operator wrote; the test plays the Deployment controller and kubelet."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from kvfleet.bench.fake_engine import MODEL, fake_engine
from kvfleet.gateway.app import GatewaySettings, create_gateway_app
from kvfleet.gateway.routing.autoscale import AutoscalePolicy
from kvfleet.operator.common import OperatorConfig
from kvfleet.operator.reconcile import Reconciler

from ..unit.operator.conftest import SPEC, client_for
from ..unit.operator.fake_kube import FakeKube, running
from .test_gateway_admission import serve
from .test_gateway_election import GATEWAY_SA, gateway_client

LLMD = ("/apis/kvfleet.dev/v1alpha1", "llmdeployments")
SLICES = ("/apis/discovery.k8s.io/v1", "endpointslices")


@pytest.fixture
def scaled_to_zero() -> Iterator[tuple[FakeKube, str]]:
    fake = FakeKube()
    fake.tokens["gateway-token"] = GATEWAY_SA
    autoscaling = {"enabled": True, "minReplicas": 0, "maxReplicas": 2}
    spec = {**copy.deepcopy(SPEC), "replicas": 0, "autoscaling": autoscaling}
    fake.create(*LLMD, {"metadata": {"name": "chat", "namespace": "llm"}, "spec": spec})
    with running(fake) as url:
        reconciler = Reconciler(client_for(url), OperatorConfig())
        reconciler.reconcile(fake.objects[(*LLMD, "llm", "chat")])
        yield fake, url


def engine_slice(engine_url: str) -> dict[str, Any]:
    """The EndpointSlice the control plane writes once the engine pod is ready."""
    parsed = urlparse(engine_url)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "chat-engine-abcde",
            "namespace": "llm",
            "labels": {"kubernetes.io/service-name": "chat-engine"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": parsed.port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [parsed.hostname], "conditions": {"ready": True}}],
    }


def gateway_settings(**changes: Any) -> GatewaySettings:
    return GatewaySettings(
        replicas=(),
        discover=("llm", "chat-engine", "http"),
        autoscale=("llm", "chat", AutoscalePolicy(0, 2, scale_down_window_s=60)),
        identity="gateway-a",
        poll_interval_s=0.05,
        **changes,
    )


def test_a_request_at_zero_replicas_scales_up_and_is_answered(
    scaled_to_zero: tuple[FakeKube, str],
) -> None:
    fake, api_url = scaled_to_zero
    settings = gateway_settings(activation_timeout_s=20.0)
    app = create_gateway_app(settings, kube_api_client=gateway_client(api_url))
    answer: dict[str, Any] = {}
    with serve(fake_engine()) as engine_url, serve(app, any_answer=True) as gateway_url:

        def ask() -> None:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            answer["response"] = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=30)

        client = threading.Thread(target=ask)
        client.start()
        deadline = time.monotonic() + 10
        while fake.objects[(*LLMD, "llm", "chat")]["spec"]["replicas"] == 0:
            assert time.monotonic() < deadline, "the gateway did not scale from zero"
            time.sleep(0.05)
        assert client.is_alive()  # held, not refused
        time.sleep(0.5)  # the engine loads...
        fake.create(*SLICES, engine_slice(engine_url))  # ...and turns ready
        client.join(30)
    response = answer["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"]
    assert [w for w in fake.writes if w[0] == "scale"] == [("scale", "llmdeployments", "chat")]
    assert fake.objects[(*LLMD, "llm", "chat")]["spec"]["replicas"] == 1
    assert fake.denied == []


def test_no_engine_within_the_activation_timeout_is_a_503(
    scaled_to_zero: tuple[FakeKube, str],
) -> None:
    fake, api_url = scaled_to_zero
    settings = gateway_settings(activation_timeout_s=1.0)
    app = create_gateway_app(settings, kube_api_client=gateway_client(api_url))
    with serve(app, any_answer=True) as gateway_url:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        response = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert "within 1 s" in response.json()["error"]["message"]
    assert fake.objects[(*LLMD, "llm", "chat")]["spec"]["replicas"] == 1  # it did ask
