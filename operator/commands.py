"""`kvfleet operator`: run the kopf operator, after checking that a cluster answers. Light imports:
kopf and the Kubernetes client load only when the command runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_commands(commands: Any) -> None:
    operator = commands.add_parser(
        "operator",
        help="run the operator that turns LLMDeployments into engines and gateways",
        description=(
            "Reconcile LLMDeployment objects (kvfleet.dev/v1alpha1) into engine and gateway "
            "workloads. Uses the in-cluster service account, else $KUBECONFIG or ~/.kube/config."
        ),
    )
    operator.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeat); default: every namespace",
    )
    operator.add_argument(
        "--liveness",
        metavar="URL",
        default="http://0.0.0.0:8080/healthz",
        help="kopf's liveness endpoint (empty to turn it off)",
    )
    operator.add_argument("--verbose", action="store_true", help="log every handler call")
    operator.add_argument(
        "--print-crd", action="store_true", help="print the LLMDeployment CRD (YAML) and exit"
    )
    operator.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.print_crd:
        from kvfleet.operator.crd import render_crd

        sys.stdout.write(render_crd())
        return 0

    from kvfleet.operator.crd import CRD_NAME
    from kvfleet.operator.kube import ClusterUnreachableError, KubeError, connect

    try:
        api, version = connect()
        installed = api.has_crd(CRD_NAME)
    except (ClusterUnreachableError, KubeError) as exc:
        print(f"kvfleet operator: {exc}", file=sys.stderr)
        return 2
    if not installed:
        print(
            f"kvfleet operator: the CRD {CRD_NAME} is not installed (or this account may not "
            "read it): kubectl apply -k manifests/",
            file=sys.stderr,
        )
        return 2
    print(
        f"kvfleet operator: API server {version.get('gitVersion', '?')} answers; starting",
        file=sys.stderr,
    )

    import kopf

    import kvfleet.operator.main  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=True,  # one replica (Recreate): no peering objects to install
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(namespaces=list(args.namespace)),
    )
    return 0
