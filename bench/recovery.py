"""Recovery benchmark on the devcluster: how fast and how cheaply a failure is recovered, stage by stage.

For each checkpoint policy (continuous vs interval) and each compile-cache setting (`--compile-cache
on|off|both`) one TrainingJob (1 slice, v5e 2x2: one host of 4 chips, backoff 0) runs and gets N
injected failures (SIGKILL of its worker, a crash). Per failure:
  reaction_s  failure -> replacement pod created (the operator's reaction, JobSet + Job included)
  recovery_s  failure -> first progress record of the new attempt past its resume step (as polled)
  lost_steps  last step the trainer reported before the failure - committed step it resumed from
  stages      the recovery split into stages, on clocks precise to milliseconds: the bench's own
              (the kill, and watch events of the worker pods, the JobSets and the TrainingJob, by
              arrival) and the trainer's record (process start, storage ready, restore end, first
              step); all processes share this machine's wall clock:
    failure_visible         SIGKILL -> the worker pod's phase Failed in the API (pod runner / kubelet)
    detection               pod Failed in the API -> TrainingJob status carries the failure (operator)
    decision_to_jobset      that status -> replacement JobSet created (operator; backoff 0)
    operator_share          pod Failed in the API -> replacement JobSet created (the two above)
    jobset_to_scheduled     JobSet created -> every pod of it bound to a node (JobSet, Job, scheduler)
    scheduled_to_process    pods bound -> trainer main() entered (pod start, Python + JAX imports)
    process_to_storage      main() -> storage probe passed (jax.distributed, probe)
    storage_to_restored     storage ready -> restore finished (listing, Orbax restore)
    restored_to_first_step  restore finished -> first step done (compilation, mostly)
    total                   SIGKILL -> first step done
  timeline    the same recovery as the operator dates it in status.lastFailure.timeline (failed,
              detected, jobSetCreated, podsScheduled, restored, firstNewStep; failed, the pod's
              finish time, has whole seconds)
Prints one JSON object: per run p50/p90 per stage and medians. Run: `make bench-recovery`.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from kubernetes import client, config, watch
from tpujob_devcluster.cluster import BUCKET, DevCluster
from tpujob_devcluster.harness import helm_install_operator, signal_pod
from tpujob_operator import api, checkpoints

NAMESPACE = "default"
LABEL_NAME, LABEL_ATTEMPT = f"{api.GROUP}/name", f"{api.GROUP}/attempt"
POLICIES = ("continuous", "interval")
STAGES = (
    "failure_visible", "detection", "decision_to_jobset", "operator_share", "jobset_to_scheduled",
    "scheduled_to_process", "process_to_storage", "storage_to_restored", "restored_to_first_step", "total",
)  # fmt: skip
TIMELINE_STAGES = {  # status.lastFailure.timeline (failed: the pod's finish time, whole seconds)
    "failed_to_detected": ("failed", "detected"),
    "detected_to_jobset_created": ("detected", "jobSetCreated"),
    "jobset_created_to_pods_scheduled": ("jobSetCreated", "podsScheduled"),
    "pods_scheduled_to_restored": ("podsScheduled", "restored"),
    "restored_to_first_new_step": ("restored", "firstNewStep"),
    "failed_to_first_new_step": ("failed", "firstNewStep"),
}


def _manifest(name: str, policy: str, steps: int, failures: int, compile_cache: str) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"directory": f"gs://{BUCKET}/bench", "policy": policy}
    if policy == "interval":
        checkpoint["intervalSteps"] = 50
    # Progress twice a second, so the last reported step before a crash is close to the real one.
    env = [{"name": "TPUJOB_PROGRESS_INTERVAL_SECONDS", "value": "0.5"}]
    if compile_cache == "off":
        env.append({"name": "TPUJOB_COMPILATION_CACHE_DIR", "value": "off"})
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "metadata": {"name": name},
        "spec": {
            "image": "tpujob-trainer:dev",
            "args": ["--model", "tiny", "--steps", str(steps), "--batch-size", "8", "--log-every", "25"],
            "env": env,
            "tpu": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 1},
            "checkpoint": checkpoint,
            "restart": {"maxRestarts": failures, "backoffSeconds": 0},
        },
    }  # fmt: skip


def _wall(moment: str | datetime | None) -> float | None:
    """An RFC 3339 time (or a parsed one) as a Unix timestamp."""
    if moment is None or moment == "":
        return None
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment.replace("Z", "+00:00"))
    return moment.timestamp()


def _span(start: float | None, end: float | None) -> float | None:
    return round(end - start, 3) if start is not None and end is not None else None


def _quantiles(values: Iterable[float | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    if not known:
        return {"p50": None, "p90": None, "n": 0}
    p50, p90 = np.percentile(known, [50, 90])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "n": len(known)}


class Watcher:
    """Arrival times (this machine's wall clock) of what the API says about one job's objects."""

    def __init__(self, kube: client.ApiClient, name: str) -> None:
        self.name, self.kube = name, kube
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.pod_failed: dict[str, float] = {}  # pod -> first seen with phase Failed
        self.pod_bound: dict[str, float] = {}  # pod -> first seen with spec.nodeName
        self.pod_attempt: dict[str, int] = {}
        self.jobset_created: dict[int, float] = {}  # attempt -> first seen
        self.failure_seen: dict[int, float] = {}  # status.attempt -> first seen with its lastFailure
        selector = f"{LABEL_NAME}={name}"
        core, custom = client.CoreV1Api(kube), client.CustomObjectsApi(kube)
        streams: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Callable[[dict[str, Any]], None]]] = [
            (core.list_namespaced_pod, (NAMESPACE,), {"label_selector": selector}, self._pod),
            (
                custom.list_namespaced_custom_object,
                ("jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets"),
                {"label_selector": selector},
                self._jobset,
            ),
            (
                custom.list_namespaced_custom_object,
                (api.GROUP, api.VERSION, NAMESPACE, api.PLURAL),
                {"field_selector": f"metadata.name={name}"},
                self._training_job,
            ),
        ]
        self.threads = [threading.Thread(target=self._run, args=s, daemon=True) for s in streams]
        for t in self.threads:
            t.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], on: Any) -> None:
        while not self.stopping.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(fn, *args, timeout_seconds=30, **kwargs):
                    obj = event["object"]
                    on(obj if isinstance(obj, dict) else self.kube.sanitize_for_serialization(obj))
                    if self.stopping.is_set():
                        break
            except Exception:
                time.sleep(0.1)
            finally:
                w.stop()

    def _pod(self, pod: dict[str, Any]) -> None:
        now, name = time.time(), pod["metadata"]["name"]
        with self.lock:
            self.pod_attempt[name] = int((pod["metadata"].get("labels") or {}).get(LABEL_ATTEMPT, -1))
            if (pod.get("spec") or {}).get("nodeName"):
                self.pod_bound.setdefault(name, now)
            if (pod.get("status") or {}).get("phase") == "Failed":
                self.pod_failed.setdefault(name, now)

    def _jobset(self, js: dict[str, Any]) -> None:
        now = time.time()
        attempt = int((js["metadata"].get("labels") or {}).get(LABEL_ATTEMPT, -1))
        with self.lock:
            self.jobset_created.setdefault(attempt, now)

    def _training_job(self, tj: dict[str, Any]) -> None:
        now, status = time.time(), tj.get("status") or {}
        if status.get("lastFailure") and status.get("attempt") is not None:
            with self.lock:
                self.failure_seen.setdefault(int(status["attempt"]), now)

    def first_failed_pod(self, attempt: int) -> float | None:
        with self.lock:
            times = [t for p, t in self.pod_failed.items() if self.pod_attempt.get(p) == attempt]
        return min(times) if times else None

    def all_bound(self, attempt: int) -> float | None:
        with self.lock:
            pods = [p for p, a in self.pod_attempt.items() if a == attempt]
            times = [self.pod_bound[p] for p in pods if p in self.pod_bound]
        return max(times) if pods and len(times) == len(pods) else None

    def stop(self) -> None:
        self.stopping.set()


class Bench:
    def __init__(self, cluster: DevCluster) -> None:
        self.cluster = cluster
        self.kube = config.new_client_from_config(str(cluster.kubeconfig))
        self.custom = client.CustomObjectsApi(self.kube)
        self.core = client.CoreV1Api(self.kube)
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
            NAMESPACE, label_selector=f"{LABEL_NAME}={name},{LABEL_ATTEMPT}={attempt}"
        ).items
        running = [p.metadata.name for p in pods if p.status.phase == "Running"]
        return str(running[0]) if running else None

    def pod_created(self, name: str, attempt: int) -> bool:
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"{LABEL_NAME}={name},{LABEL_ATTEMPT}={attempt}")
        return bool(pods.items)

    def timeline(self, name: str, attempt: int) -> dict[str, Any]:
        """lastFailure.timeline once the operator dated the first new step (it polls: up to ~10 s)."""

        def complete() -> dict[str, Any] | None:
            status = self.status(name)
            timeline = dict((status.get("lastFailure") or {}).get("timeline") or {})
            return timeline if status.get("attempt") == attempt and timeline.get("firstNewStep") else None

        try:
            result: dict[str, Any] = self.wait(complete, timeout=30.0, interval=0.5)
        except TimeoutError:
            result = dict((self.status(name).get("lastFailure") or {}).get("timeline") or {})
        return result

    def inject_failure(
        self, name: str, run_dir: str, attempt: int, rng: random.Random, watcher: Watcher
    ) -> dict[str, Any]:
        # Train a random while past the first progress of this attempt, then crash the worker.
        self.wait(lambda: (p := checkpoints.read_progress(self.gcs, run_dir)) and p.attempt == attempt and p.step > 0)
        time.sleep(rng.uniform(4.0, 12.0))
        pod = self.wait(lambda: self.running_worker(name, attempt))
        signal_pod(self.cluster.state_dir, NAMESPACE, pod, signal.SIGKILL)
        failed_at, killed = time.monotonic(), time.time()
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
        timeline = self.timeline(name, attempt + 1)
        failure = self.status(name)["lastFailure"]
        visible = watcher.first_failed_pod(attempt)
        decided = watcher.failure_seen.get(attempt + 1)
        created = watcher.jobset_created.get(attempt + 1)
        bound = watcher.all_bound(attempt + 1)
        process, ready = _wall(progress.process_started_at), _wall(progress.storage_ready_at)
        restored = _wall(progress.restore_finished_at) or ready  # a fresh start restores nothing
        first = _wall(progress.first_step_at)
        stages = {
            "failure_visible": _span(killed, visible),
            "detection": _span(visible, decided),
            "decision_to_jobset": _span(decided, created),
            "operator_share": _span(visible, created),
            "jobset_to_scheduled": _span(created, bound),
            "scheduled_to_process": _span(bound, process),
            "process_to_storage": _span(process, ready),
            "storage_to_restored": _span(ready, restored),
            "restored_to_first_step": _span(restored, first),
            "total": _span(killed, first),
        }
        return {
            "reaction_s": round(reaction, 2),
            "recovery_s": round(recovery, 2),
            "lost_steps": failure.get("lostSteps"),
            "resume_step": progress.resumed_from_step,
            "stages": stages,
            "timeline": timeline,
            "timeline_stages": {
                k: _span(_wall(timeline.get(a)), _wall(timeline.get(b))) for k, (a, b) in TIMELINE_STAGES.items()
            },
        }

    def diagnose(self, name: str) -> None:
        """What the job, its pods and their logs say: printed to stderr when a step times out."""
        print(json.dumps({"status": self.status(name)}, indent=1), file=sys.stderr)
        pods: list[Any] = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"{LABEL_NAME}={name}").items
        for pod in pods:
            print(f"--- pod {pod.metadata.name}: {pod.status.phase}", file=sys.stderr)
            log = self.cluster.state_dir / "pods" / NAMESPACE / str(pod.metadata.name) / "log"
            if log.exists():
                print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)

    def run(self, policy: str, compile_cache: str, failures: int, rng: random.Random) -> dict[str, Any]:
        name = f"bench-{policy}-cache-{compile_cache}"
        run_dir = f"gs://{BUCKET}/bench/{NAMESPACE}/{name}"
        watcher = Watcher(self.kube, name)
        try:
            self.custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, _manifest(name, policy, 100000, failures, compile_cache)
            )
            try:
                records = [self.inject_failure(name, run_dir, attempt, rng, watcher) for attempt in range(failures)]
            except Exception:
                self.diagnose(name)
                raise
            goodput = self.status(name).get("goodput")
            self.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, name)
        finally:
            watcher.stop()
        return {
            "policy": policy,
            "compile_cache": compile_cache,
            "failures": records,
            "median_reaction_s": statistics.median(r["reaction_s"] for r in records),
            "median_recovery_s": statistics.median(r["recovery_s"] for r in records),
            "median_lost_steps": statistics.median(r["lost_steps"] or 0 for r in records),
            "stages": {s: _quantiles(r["stages"][s] for r in records) for s in STAGES},
            "timeline_stages": {s: _quantiles(r["timeline_stages"][s] for r in records) for s in TIMELINE_STAGES},
            "goodput": goodput,
        }


def _comparison(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Median over every failure of both policies, per cache setting, and on/off ratios."""

    def median(mode: str, pick: Callable[[dict[str, Any]], float | None]) -> float | None:
        values = [v for run in runs[mode].values() for r in run["failures"] if (v := pick(r)) is not None]
        return round(statistics.median(values), 3) if values else None

    picks: dict[str, Callable[[dict[str, Any]], float | None]] = {
        "recovery_s": lambda r: r["recovery_s"],
        "total_s": lambda r: r["stages"]["total"],
        "restored_to_first_step_s": lambda r: r["stages"]["restored_to_first_step"],
        "operator_share_s": lambda r: r["stages"]["operator_share"],
    }
    medians = {mode: {k: median(mode, f) for k, f in picks.items()} for mode in runs}
    result: dict[str, Any] = {"median": medians}
    if "on" in medians and "off" in medians:
        result["ratio_on_over_off"] = {
            k: round(on / off, 3) if (on := medians["on"][k]) is not None and (off := medians["off"][k]) else None
            for k in picks
        }
    return result


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the devcluster is stopped too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, default=3, help="failures per policy and cache setting")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--compile-cache",
        choices=["on", "off", "both"],
        default="both",
        help="the trainer's persistent compilation cache (off: TPUJOB_COMPILATION_CACHE_DIR=off); "
        "both: off then on, in one run on the same cluster",
    )
    args = parser.parse_args()
    modes = ["off", "on"] if args.compile_cache == "both" else [args.compile_cache]
    rng = random.Random(args.seed)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpujob-bench-") as state:
        cluster = DevCluster(Path(state)).start()
        try:
            helm_install_operator(cluster.kubeconfig)
            bench = Bench(cluster)
            runs: dict[str, dict[str, dict[str, Any]]] = {mode: {} for mode in modes}
            for policy in POLICIES:  # off and on next to each other: the machine's load drifts
                for mode in modes:
                    runs[mode][policy] = bench.run(policy, mode, args.failures, rng)
        finally:
            cluster.stop()
    result = {
        "benchmark": "recovery",
        "workload": "tiny LM, 1 slice v5e 2x2 (1 host, 4 CPU devices), backoff 0, SIGKILL of the worker",
        "failures_per_policy": args.failures,
        "compile_cache": modes,
        "stages": list(STAGES),
        "runs": runs,
        # The shape of earlier versions: per policy, the last cache setting's run.
        "policies": runs[modes[-1]],
        "comparison": _comparison(runs),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
