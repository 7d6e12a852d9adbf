"""Recovery benchmark on the devcluster: how fast and how cheaply a failure is recovered.

For each checkpoint policy (continuous vs interval) one TrainingJob (1 slice, v5e 2x2: one host
of 4 chips) runs and gets N injected failures (SIGKILL of its worker, a crash). Per failure:
  reaction_s  failure -> replacement pod created (the operator's reaction, JobSet + Job included)
  recovery_s  failure -> first progress record of the new attempt past its resume step
  lost_steps  last step the trainer reported before the failure - committed step it resumed from
Prints one JSON object; medians per policy. Run: `make bench-recovery` (about 5 minutes).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from kubernetes import client, config
from tpujob_devcluster.cluster import BUCKET, DevCluster
from tpujob_devcluster.harness import helm_install_operator, signal_pod
from tpujob_operator import api, checkpoints

NAMESPACE = "default"


def _manifest(name: str, policy: str, steps: int, failures: int) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"directory": f"gs://{BUCKET}/bench", "policy": policy}
    if policy == "interval":
        checkpoint["intervalSteps"] = 50
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "metadata": {"name": name},
        "spec": {
            "image": "tpujob-trainer:dev",
            "args": ["--model", "tiny", "--steps", str(steps), "--batch-size", "8", "--log-every", "25"],
            # Progress twice a second, so the last reported step before a crash is close to the real one.
            "env": [{"name": "TPUJOB_PROGRESS_INTERVAL_SECONDS", "value": "0.5"}],
            "tpu": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 1},
            "checkpoint": checkpoint,
            "restart": {"maxRestarts": failures, "backoffSeconds": 0},
        },
    }  # fmt: skip


class Bench:
    def __init__(self, cluster: DevCluster) -> None:
        self.cluster = cluster
        kube = config.new_client_from_config(str(cluster.kubeconfig))
        self.custom = client.CustomObjectsApi(kube)
        self.core = client.CoreV1Api(kube)
        assert cluster.gcs is not None
        self.gcs = storage.Client(
            project="bench", credentials=AnonymousCredentials(), client_options={"api_endpoint": cluster.gcs.endpoint}
        )

    def status(self, name: str) -> dict[str, Any]:
        body: Any = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, name)
        return dict(body.get("status") or {})

    def wait(self, probe: Any, timeout: float = 300.0, interval: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"benchmark step timed out after {timeout}s")

    def running_worker(self, name: str, attempt: int) -> str | None:
        pods: list[Any] = self.core.list_namespaced_pod(
            NAMESPACE, label_selector=f"tpujob.dev/name={name},tpujob.dev/attempt={attempt}"
        ).items
        running = [p.metadata.name for p in pods if p.status.phase == "Running"]
        return str(running[0]) if running else None

    def pod_created(self, name: str, attempt: int) -> bool:
        pods = self.core.list_namespaced_pod(
            NAMESPACE, label_selector=f"tpujob.dev/name={name},tpujob.dev/attempt={attempt}"
        )
        return bool(pods.items)

    def inject_failure(self, name: str, run_dir: str, attempt: int, rng: random.Random) -> dict[str, Any]:
        # Train a random while past the first progress of this attempt, then crash the worker.
        self.wait(lambda: (p := checkpoints.read_progress(self.gcs, run_dir)) and p.attempt == attempt and p.step > 0)
        time.sleep(rng.uniform(4.0, 12.0))
        pod = self.wait(lambda: self.running_worker(name, attempt))
        signal_pod(self.cluster.state_dir, NAMESPACE, pod, signal.SIGKILL)
        failed_at = time.monotonic()
        self.wait(lambda: self.pod_created(name, attempt + 1), interval=0.05)
        reaction = time.monotonic() - failed_at
        progress = self.wait(
            lambda: (
                (p := checkpoints.read_progress(self.gcs, run_dir))
                and p.attempt == attempt + 1
                and p.step > (p.resumed_from_step or 0)
                and p
            ),
            interval=0.05,
        )
        recovery = time.monotonic() - failed_at
        failure = self.status(name)["lastFailure"]
        return {
            "reaction_s": round(reaction, 2),
            "recovery_s": round(recovery, 2),
            "lost_steps": failure.get("lostSteps"),
            "resume_step": progress.resumed_from_step,
        }

    def run_policy(self, policy: str, failures: int, rng: random.Random) -> dict[str, Any]:
        name = f"bench-{policy}"
        run_dir = f"gs://{BUCKET}/bench/{NAMESPACE}/{name}"
        self.custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, _manifest(name, policy, 100000, failures)
        )
        records = [self.inject_failure(name, run_dir, attempt, rng) for attempt in range(failures)]
        self.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, name)
        return {
            "failures": records,
            "median_reaction_s": statistics.median(r["reaction_s"] for r in records),
            "median_recovery_s": statistics.median(r["recovery_s"] for r in records),
            "median_lost_steps": statistics.median(r["lost_steps"] or 0 for r in records),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--failures", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="tpujob-bench-") as state:
        cluster = DevCluster(Path(state)).start()
        try:
            helm_install_operator(cluster.kubeconfig)
            bench = Bench(cluster)
            result = {
                "benchmark": "recovery",
                "workload": "tiny LM, 1 slice v5e 2x2 (1 host, 4 CPU devices), backoff 0, SIGKILL of the worker",
                "failures_per_policy": args.failures,
                "policies": {p: bench.run_policy(p, args.failures, rng) for p in ("continuous", "interval")},
            }
        finally:
            cluster.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
