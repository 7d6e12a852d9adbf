"""`python -m tpujob_operator`: run the operator (kopf) with a liveness endpoint.

With leader election (the default) the process first campaigns for the Lease and starts kopf only
once it leads; losing the Lease ends the process (see leader.py). The runtime (runtime.py), its
metrics and kopf's registry of handlers (handlers.register) are built here from the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import kopf

from . import handlers, leader, policy, runtime
from .apply import IN_PLACE_AGENT_ROLE
from .jobset import IN_PLACE_RESTART_ACTIONS
from .kube import load_config
from .metrics import DEFAULT_PORT, OperatorMetrics, process_registry

log = logging.getLogger("tpujob")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="tpujob operator")
    parser.add_argument("--namespace", action="append", help="watch only these namespaces (default: all)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument(
        "--metrics-port", type=int, default=DEFAULT_PORT, help="Prometheus /metrics port, served while leading (0: off)"
    )
    election = parser.add_argument_group("leader election (one active operator per Lease)")
    election.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True)
    election.add_argument("--leader-election-namespace", help="Lease namespace (default: POD_NAMESPACE)")
    election.add_argument("--leader-election-id", default=leader.DEFAULT_LEASE_NAME, help="Lease name")
    election.add_argument("--lease-duration", type=int, default=15, metavar="SECONDS")
    election.add_argument("--renew-deadline", type=int, default=10, metavar="SECONDS")
    election.add_argument("--retry-period", type=int, default=2, metavar="SECONDS")
    parser.add_argument(
        "--default-queue-name",
        default=os.environ.get("TPUJOB_DEFAULT_QUEUE_NAME") or None,
        help="Kueue LocalQueue for TrainingJobs without the kueue.x-k8s.io/queue-name label (default: none)",
    )
    parser.add_argument(
        "--in-place-agent-cluster-role",
        default=IN_PLACE_AGENT_ROLE,
        help="ClusterRole bound to the worker pods' ServiceAccount for spec.restart.strategy InPlace (JobSet's "
        f"in-place restart agent reads its JobSet and annotates its pod; default {IN_PLACE_AGENT_ROLE})",
    )
    parser.add_argument(
        "--in-place-restart-action",
        choices=IN_PLACE_RESTART_ACTIONS,
        default="Restart",
        help="the InPlace jobs' container restart rule: Restart (Kubernetes 1.35, with the kubelet's crash-loop "
        "back-off) or RestartAllContainers (needs the nodes' 1.35 alpha gates; no back-off)",
    )
    scale = parser.add_argument_group("scale (see docs/concepts/fleet-scale.md)")
    scale.add_argument(
        "--max-concurrent-reconciles", type=int, default=8, metavar="N", help="jobs reconciled at once (default 8)"
    )
    scale.add_argument(
        "--progress-check-seconds",
        type=float,
        default=runtime.PROGRESS_CHECK_SECONDS,
        metavar="SECONDS",
        help="how often a training job's progress record is checked without other news (default 60; one GCS "
        "read when it is unchanged)",
    )
    parser.add_argument(
        "--watch-kueue-workloads",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep Kueue's Workloads in a watch-fed index (needs get/list/watch on workloads; the chart's "
        "kueue.enabled); without it a queued job's Workload is listed at most every 30 s",
    )
    policy.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        args.policy = policy.from_arguments(args)
    except ValueError as error:
        parser.error(str(error))
    if args.max_concurrent_reconciles < 1 or args.progress_check_seconds <= 0:
        parser.error("--max-concurrent-reconciles must be at least 1 and --progress-check-seconds positive")
    if args.leader_elect and (problem := election_settings(args, identity="-").problem()):
        parser.error(problem)
    return args


def election_settings(args: argparse.Namespace, identity: str) -> leader.ElectionSettings:
    return leader.ElectionSettings(
        namespace=leader.lease_namespace(args.leader_election_namespace, os.environ),
        identity=identity,
        lease_name=args.leader_election_id,
        lease_duration=args.lease_duration,
        renew_deadline=args.renew_deadline,
        retry_period=args.retry_period,
    )


def runtime_settings(args: argparse.Namespace) -> runtime.RuntimeSettings:
    return runtime.RuntimeSettings(
        policy=args.policy,
        default_queue=args.default_queue_name,
        max_concurrent_reconciles=args.max_concurrent_reconciles,
        progress_check_seconds=args.progress_check_seconds,
        watch_kueue_workloads=args.watch_kueue_workloads,
        in_place_agent_role=args.in_place_agent_cluster_role,
        in_place_restart_action=args.in_place_restart_action,
    )


async def run(args: argparse.Namespace) -> None:
    # The one runtime of this process, its metrics and its handlers: built here, handed down, no globals.
    metrics = OperatorMetrics(process_registry())
    operator = runtime.Runtime(runtime_settings(args), metrics)
    registry = kopf.OperatorRegistry()
    handlers.register(operator, registry)
    log.info("policy: %s", args.policy)
    if args.leader_elect:
        load_config()  # the client's LeaseLock uses the default API client
        elector = leader.Elector(election_settings(args, leader.default_identity()))
        settings = elector.settings
        log.info("campaigning as %s for Lease %s/%s", settings.identity, settings.namespace, settings.lease_name)
        elector.start()
        await leader.wait_until_leading(elector, args.liveness)
    metrics.mark_leading()
    if args.metrics_port:  # only the leader reconciles, so only it has metrics to serve
        try:
            metrics.serve(args.metrics_port)
        except OSError as error:  # metrics are not worth a crash loop that would stop reconciling
            log.error("cannot serve metrics on port %d: %s", args.metrics_port, error)
    await kopf.operator(
        registry=registry,
        clusterwide=not args.namespace,
        namespaces=args.namespace or [],
        liveness_endpoint=args.liveness,
        standalone=True,  # no kopf peering: the Lease decides who runs
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    # The client's elector logs every renewal at INFO; our own lines cover campaigning, leading and loss.
    logging.getLogger("leaderelection").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
