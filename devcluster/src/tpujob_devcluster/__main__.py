"""`python -m tpujob_devcluster up|down|status|demo` (the Makefile's up, down and demo targets)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cluster import DEFAULT_STATE_DIR, DevCluster, read_state, stop_from_state


def up(state_dir: Path, kueue: bool = True) -> int:
    if read_state(state_dir):
        stop_from_state(state_dir)  # a half-dead cluster from an earlier run: start clean
    print(f"starting the devcluster in {state_dir} (first run builds the binaries, Kueue included: ~30 min on 2 cores)")
    cluster = DevCluster(state_dir, detached=True, kueue=kueue).start()
    for component in cluster.plane.components:
        print(f"  ready: {component.name:<24} log: {component.log_path}")
    print(f"  ready: {'fake-gcs-server':<24} {cluster.gcs.endpoint if cluster.gcs else ''} bucket tpujob-demo")
    if cluster.kueue is not None:
        print("  kueue: ClusterQueue tpu, LocalQueue default/tpu, WorkloadPriorityClasses low and high")
        print("         (examples/kueue/queues.yaml); label jobs kueue.x-k8s.io/queue-name=tpu")
    print(f"\nexport KUBECONFIG={cluster.kubeconfig}")
    print(f"pod logs: {state_dir / 'pods'}/<namespace>/<pod>/log")
    return 0


def down(state_dir: Path) -> int:
    stopped = stop_from_state(state_dir)
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpujob_devcluster", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "demo"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument(
        "--kueue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="up: run Kueue with the queues of examples/kueue/queues.yaml (default: on)",
    )
    args = parser.parse_args(argv)
    if args.command == "up":
        return up(args.state_dir, args.kueue)
    if args.command == "down":
        return down(args.state_dir)
    if args.command == "status":
        state = read_state(args.state_dir)
        print(state if state else "down")
        return 0
    from .demo import run_demo

    return run_demo(args.state_dir)


if __name__ == "__main__":
    sys.exit(main())
