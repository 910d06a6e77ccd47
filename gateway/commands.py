"""`kvfleet gateway`: the OpenAI front door over engine replicas. Light imports: the server loads
only when the command runs."""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

from kvfleet.engine.protocol.arguments import tcp_port

GATEWAY_HOST, GATEWAY_PORT = "0.0.0.0", 8000


def add_commands(commands: Any) -> None:
    gateway = commands.add_parser(
        "gateway",
        help="run the gateway in front of engine replicas",
        description="Admit, route (prefix/KV/LoRA aware) and proxy OpenAI requests to engines.",
    )
    gateway.add_argument(
        "--replica", action="append", default=[], metavar="URL", help="an engine URL (repeat)"
    )
    gateway.add_argument(
        "--discover",
        choices=["k8s"],
        help="k8s: follow the ready endpoints of --service (EndpointSlices) instead of --replica",
    )
    gateway.add_argument("--namespace", help="k8s: default the pod's own namespace")
    gateway.add_argument("--service", help="k8s: the engines' Service")
    gateway.add_argument("--port-name", default="http", help="k8s: the Service port's name")
    gateway.add_argument(
        "--autoscale",
        metavar="NAMESPACE/NAME",
        help="k8s: scale this LLMDeployment from the engines' load (its scale subresource)",
    )
    gateway.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="k8s: this pod's name in the autoscaler's leader election (default $POD_NAME)",
    )
    gateway.add_argument(
        "--activation-timeout",
        type=float,
        default=300.0,
        help="k8s, autoscaling: seconds a request waits for an engine when none is ready "
        "(scaled to zero: the gateway scales to 1)",
    )
    gateway.add_argument("--min-replicas", type=int, default=1)
    gateway.add_argument("--max-replicas", type=int, default=4)
    gateway.add_argument("--target-kv-usage", type=float, default=0.7)
    gateway.add_argument("--target-waiting", type=float, default=2.0, help="per replica")
    gateway.add_argument("--scale-down-window", type=float, default=300.0, help="seconds")
    gateway.add_argument("--host", default=GATEWAY_HOST)
    gateway.add_argument("--port", type=tcp_port, default=GATEWAY_PORT)
    gateway.add_argument(
        "--policy", default="prefix", choices=["prefix", "least-load", "round-robin"]
    )
    gateway.add_argument(
        "--max-imbalance",
        type=float,
        default=8.0,
        help="requests by which the prefix choice may exceed the least-loaded replica's load",
    )
    gateway.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="URL",
        help="another gateway sharing the per-key limits (repeat)",
    )
    gateway.add_argument(
        "--peers-service",
        metavar="NAME",
        help="k8s: the gateway's own Service; its ready pods share the per-key limits",
    )
    gateway.add_argument("--api-keys", help="JSON file of hashed API keys (default: open mode)")
    gateway.add_argument("--requests-per-min", type=float, help="default per-key request limit")
    gateway.add_argument("--tokens-per-min", type=float, help="default per-key token limit")
    gateway.add_argument(
        "--max-inflight-per-replica",
        type=int,
        default=256,
        help="requests proxied at once per ready replica; more wait in the fair queue",
    )
    gateway.add_argument("--queue-capacity", type=int, default=4096)
    gateway.add_argument("--queue-timeout", type=float, default=60.0, help="seconds")
    gateway.add_argument(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an adapter the gateway loads onto a replica when none holds it (repeat)",
    )
    gateway.add_argument("--max-body-bytes", type=int, default=8 << 20)
    gateway.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    gateway.set_defaults(run=_run)


def settings_from(args: argparse.Namespace) -> Any:
    from kvfleet.engine.protocol.openai import LoadLoRAAdapterRequest
    from kvfleet.gateway.admission.keys import KeyStore
    from kvfleet.gateway.admission.rate_limit import KeyLimits
    from kvfleet.gateway.app import GatewaySettings
    from kvfleet.gateway.routing.autoscale import AutoscalePolicy
    from kvfleet.gateway.routing.snapshot import Policy

    discover = None
    if args.discover == "k8s":
        if not args.service:
            raise SystemExit("kvfleet: error: --discover k8s needs --service")
        discover = (args.namespace or _pod_namespace(), args.service, args.port_name)
    elif not args.replica:
        raise SystemExit("kvfleet: error: give at least one --replica URL, or --discover k8s")
    try:
        keys = KeyStore.from_file(args.api_keys) if args.api_keys else KeyStore([])
    except ValueError as exc:
        raise SystemExit(f"kvfleet: error: {exc}") from exc
    if not args.activation_timeout > 0:
        raise SystemExit("kvfleet: error: --activation-timeout must be positive (seconds)")
    autoscale = None
    if args.autoscale:
        namespace, sep, name = args.autoscale.partition("/")
        if not sep or not namespace or not name:
            raise SystemExit("kvfleet: error: --autoscale takes NAMESPACE/NAME")
        try:
            policy = AutoscalePolicy(
                args.min_replicas,
                args.max_replicas,
                args.target_kv_usage,
                args.target_waiting,
                scale_down_window_s=args.scale_down_window,
            )
        except ValueError as exc:
            raise SystemExit(f"kvfleet: error: {exc}") from exc
        autoscale = (namespace, name, policy)
    try:
        adapters = LoadLoRAAdapterRequest.parse_flag(args.lora_adapter, "--lora-adapter")
    except ValueError as exc:
        raise SystemExit(f"kvfleet: error: {exc}") from exc
    return GatewaySettings(
        replicas=tuple(args.replica),
        policy=Policy(args.policy),
        max_imbalance=args.max_imbalance,
        keys=keys,
        default_limits=KeyLimits(args.requests_per_min, args.tokens_per_min),
        max_body_bytes=args.max_body_bytes,
        max_in_flight_per_replica=args.max_inflight_per_replica,
        queue_capacity=args.queue_capacity,
        queue_timeout_s=args.queue_timeout,
        adapters=tuple(adapters),
        discover=discover,
        autoscale=autoscale,
        identity=args.identity,
        peers=tuple(args.peer),
        peers_service=args.peers_service,
        activation_timeout_s=args.activation_timeout,
        prestart_body_worker=True,
    )


def _pod_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return "default"


def _run(args: argparse.Namespace) -> int:
    import gc
    import logging

    import uvicorn

    from kvfleet.engine.protocol.http import quiet_health_checks
    from kvfleet.gateway.app import create_gateway_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise

    app = create_gateway_app(settings_from(args))
    # What startup built lives as long as the process: out of the collector's full passes,
    # which then cost what request objects cost (a large body's work is paused for anyway).
    gc.collect()
    gc.freeze()
    quiet_health_checks()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
