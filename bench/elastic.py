"""Elastic slices on the devcluster: goodput of a 2-slice job over a scripted capacity loss, elastic
against waiting, in one run.

Two TrainingJobs run side by side on their own TPU shapes (2 node pools each, no spare): `elastic`
(spec.elastic minSlices 1) and `waiting` (no spec.elastic: the default). Once both train with a
committed step, the node of each job's slice-1 pod is deleted (GKE's node pool repair, stood in for)
and created again `--loss-seconds` later. Both run to Succeeded. Per job the bench reports
  window     the loss, from each job's own goodput ledger (status.goodput) read at the loss and at the
             pool's return: productive and wall seconds between the two, and their ratio (the
             ledger counts training on 1 of 2 slices as productive at half)
  run        the whole job's ledger at the end (wall, productive, ratio, every badput cause), its
             resizes, restarts and lost steps
then elastic / waiting for the run's numbers, and the window's productive seconds side by side.

Both jobs share the 2 cores, so each one's step rate is what it is beside the other: compare the two,
not the absolute numbers. On CPU one process trains faster than two (no cross-process collective),
so the steps a shrunk job trains flatter it; the ledger's share does not.
Run: `make bench-elastic` (`ELASTIC_ARGS=...` to change the flags). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tpujob_contract as contract
import yaml
from kubernetes import client, config
from tpujob_devcluster.cluster import BUCKET, DevCluster
from tpujob_devcluster.harness import helm_install_operator
from tpujob_devcluster.pools import Pool, node_manifests

NAMESPACE = "default"
TRAININGJOBS = (contract.TRAININGJOB_GROUP, contract.TRAININGJOB_VERSION)
# Each job's own shape (one host of one chip a slice), so that neither can use the other's pools.
SHAPES = {"elastic": ("tpu-v6e-slice", "1x1"), "waiting": ("tpu-v5-lite-podslice", "1x1")}


def _pools(job: str) -> list[Pool]:
    accelerator, topology = SHAPES[job]
    return [Pool(f"{job}-{c}", accelerator, topology) for c in "ab"]


def _manifest(job: str, steps: int, shrink_after: int) -> dict[str, Any]:
    accelerator, topology = SHAPES[job]
    spec: dict[str, Any] = {
        "image": "tpujob-trainer:dev",
        "args": ["--model", "tiny", "--steps", str(steps), "--batch-size", "8", "--log-every", "10"],
        "tpu": {"accelerator": accelerator, "topology": topology, "slices": 2},
        "checkpoint": {"directory": f"gs://{BUCKET}/bench-elastic", "policy": "continuous"},
        "restart": {"backoffSeconds": 1},
    }
    if job == "elastic":
        spec["elastic"] = {"minSlices": 1, "shrinkAfterSeconds": shrink_after, "growAfterSeconds": 30}
    return {
        "apiVersion": f"{contract.TRAININGJOB_GROUP}/{contract.TRAININGJOB_VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": job},
        "spec": spec,
    }


class Bench:
    def __init__(self, cluster: DevCluster) -> None:
        api = config.new_client_from_config(str(cluster.kubeconfig))
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def status(self, job: str) -> dict[str, Any]:
        body: Any = self.custom.get_namespaced_custom_object(*TRAININGJOBS, NAMESPACE, "trainingjobs", job)
        return dict(body.get("status") or {})

    def wait(self, what: str, predicate: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {what}: {[self.status(j) for j in SHAPES]}")
            time.sleep(1.0)

    def slice_one_node(self, job: str) -> str:
        selector = f"{contract.LABEL_NAME}={job}"
        pods: Any = self.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        for pod in pods:
            index = (pod.metadata.annotations or {}).get(contract.JOB_INDEX_ANNOTATION)
            if index == "1" and pod.spec.node_name and pod.status.phase == "Running":
                return str(pod.spec.node_name)
        raise RuntimeError(f"{job}: no running pod of slice 1")


def run(steps: int, loss_seconds: float, shrink_after: int, state: Path) -> dict[str, Any]:
    pools = [p for job in SHAPES for p in _pools(job)]
    (state / "pools.yaml").write_text(
        yaml.safe_dump(
            {
                "pools": [{"name": p.name, "accelerator": p.accelerator, "topology": p.topology} for p in pools],
                "system_nodes": 1,
            }
        )
    )
    cluster = DevCluster(state, state / "pools.yaml").start()
    try:
        helm_install_operator(cluster.kubeconfig, "reconcile.progressCheckSeconds=5")
        bench = Bench(cluster)
        manifests = {n["metadata"]["name"]: n for n in node_manifests(pools, 0)}
        for job in SHAPES:
            bench.custom.create_namespaced_custom_object(
                *TRAININGJOBS, NAMESPACE, "trainingjobs", _manifest(job, steps, shrink_after)
            )

        def training(job: str) -> bool:
            status = bench.status(job)
            return status.get("phase") == "Running" and bool((status.get("latestCheckpoint") or {}).get("step"))

        bench.wait("both training with a committed step", lambda: all(training(j) for j in SHAPES), 600)
        lost = {job: bench.slice_one_node(job) for job in SHAPES}
        at_loss = {job: bench.status(job) for job in SHAPES}
        for node in lost.values():
            bench.core.delete_node(node)
        print(f"lost {lost}", file=sys.stderr, flush=True)
        time.sleep(loss_seconds)
        at_return = {job: bench.status(job) for job in SHAPES}
        for node in lost.values():
            bench.core.create_node(manifests[node])  # type: ignore[arg-type]  # the client posts a dict as it is
        print(f"returned; steps {[s.get('step') for s in at_return.values()]}", file=sys.stderr, flush=True)
        bench.wait(
            "both Succeeded", lambda: all(bench.status(j).get("phase") in ("Succeeded", "Failed") for j in SHAPES), 3600
        )
        jobs = {
            job: {"window": _window(at_loss[job], at_return[job]), "run": _run(bench.status(job))} for job in SHAPES
        }
    finally:
        cluster.stop()
    ratio = {
        k: round(e / w, 3)
        if (e := jobs["elastic"]["run"][k]) is not None and (w := jobs["waiting"]["run"][k])
        else None
        for k in ("goodput_ratio", "wall_seconds", "productive_seconds")
    }
    return {
        "steps": steps,
        "loss_seconds": loss_seconds,
        "shrink_after_seconds": shrink_after,
        "jobs": jobs,
        "run_ratio_elastic_over_waiting": ratio,
        "window_productive_seconds": {job: jobs[job]["window"]["productive_seconds"] for job in SHAPES},
    }


def _window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The ledger's productive and wall seconds between two reads of status (each as of its updatedAt)."""
    start, end = before.get("goodput") or {}, after.get("goodput") or {}
    productive = round(end.get("productiveSeconds", 0) - start.get("productiveSeconds", 0), 1)
    wall = round(end.get("wallSeconds", 0) - start.get("wallSeconds", 0), 1)
    return {
        "productive_seconds": productive,
        "wall_seconds": wall,
        "goodput_ratio": round(productive / wall, 3) if wall > 0 else None,
        "steps": (after.get("step") or 0) - (before.get("step") or 0),
        "slices_at_return": after.get("slices"),
    }


def _run(status: dict[str, Any]) -> dict[str, Any]:
    goodput = status.get("goodput") or {}
    return {
        "phase": status.get("phase"),
        "step": status.get("step"),
        "goodput_ratio": goodput.get("ratio"),
        "wall_seconds": goodput.get("wallSeconds"),
        "productive_seconds": goodput.get("productiveSeconds"),
        "badput_seconds": goodput.get("badput"),
        "restarts": status.get("restarts"),
        "counted_restarts": status.get("countedRestarts"),
        "resizes": status.get("resizes", 0),
        "lost_steps": status.get("lostSteps"),
    }


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the devcluster is stopped too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6000, help="long enough that both jobs train past the loss")
    parser.add_argument("--loss-seconds", type=float, default=300.0, help="how long the lost pool stays gone")
    parser.add_argument("--shrink-after", type=int, default=30, help="the elastic job's shrinkAfterSeconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tpujob-bench-elastic-") as state:
        print(json.dumps(run(args.steps, args.loss_seconds, args.shrink_after, Path(state)), indent=2))


if __name__ == "__main__":
    main()
