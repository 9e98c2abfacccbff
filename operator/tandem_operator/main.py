"""`tandem-operator`: run the InferencePool operator (kopf) with its metrics and liveness endpoints.

Peering: replicas of the operator share a KopfPeering (or ClusterKopfPeering with
--all-namespaces) object and only the one with the highest priority works; the others pause
until its keep-alives stop. kopf pauses *every* replica when two share a priority, so each
process picks a random priority unless --priority says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections.abc import Sequence

import kopf
import prometheus_client
from tandem_engine.cli_help import ArgumentParser

from tandem_operator import metrics
from tandem_operator.handlers import Settings

LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tandem-operator", description=__doc__.split("\n")[0])
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="serve pools in this namespace (repeat for more; globs allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="serve pools in every namespace (the default without --namespace)")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME", default=None,
                         help="the KopfPeering object shared with other replicas (required to "
                              "exist); without it, a peering named 'default' is used if present")
    peering.add_argument("--standalone", action="store_true",
                         help="no peering: the only operator for these namespaces")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority (the highest works); default: random per process")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="serve Prometheus /metrics here (0: off)")
    p.add_argument("--liveness-port", type=int, default=8081,
                   help="serve kopf's liveness probe at /healthz here (0: off)")
    p.add_argument("--resync-seconds", type=float, default=5.0,
                   help="reconcile every pool at least this often")
    p.add_argument("--skip-weights-check", action="store_true",
                   help="do not look for <weights>/config.json on the operator's own filesystem "
                        "before a pool's first engines (when the operator cannot see the model "
                        "volume)")
    p.add_argument("--prometheus-url", default=None, metavar="URL",
                   help="read the autoscaling planner's metrics (spec.autoscaling) from this "
                        "Prometheus, e.g. http://prometheus-operated.monitoring:9090, which "
                        "must scrape the pools' pods with `namespace` and `pool` labels (their "
                        "PodMonitor does); default: read each pod's own /metrics")
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: $KUBECONFIG, else in-cluster, else "
                        "~/.kube/config)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log verbosity")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.resync_seconds <= 0:
        raise SystemExit("tandem-operator: --resync-seconds must be > 0")
    kopf.configure(debug=args.log_level == "debug", quiet=args.log_level in ("warning", "error"),
                   log_format=kopf.LogFormat.PLAIN)
    logging.getLogger().setLevel(args.log_level.upper())
    if args.log_level != "debug":  # kopf's line per handler call; our events say what happened
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    import tandem_operator.handlers  # noqa: F401  (registers the handlers with kopf)

    prometheus_client.disable_created_metrics()  # no `_created` series (docs/metrics.md)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    settings = Settings(resync_seconds=args.resync_seconds,
                        check_weights=not args.skip_weights_check, kubeconfig=args.kubeconfig,
                        prometheus_url=args.prometheus_url)
    priority = args.priority if args.priority is not None else random.randint(1, 2**30)
    kopf.run(
        standalone=True if args.standalone else None,
        peering_name=args.peering,
        priority=priority,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=(f"http://0.0.0.0:{args.liveness_port}/healthz"
                           if args.liveness_port else None),
        memo=kopf.Memo(settings=settings),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
