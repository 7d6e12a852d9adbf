"""Recovery benchmark on the devcluster: how fast and how cheaply a failure is recovered, stage by stage.

For each checkpoint policy (continuous vs interval) and each side, one TrainingJob (1 slice, v5e 2x2:
one host of 4 chips, backoff 0) runs and gets N injected failures (SIGKILL of its worker, a crash),
each 4-12 s (random) after the previous recovery. A side is the trainer's compile-cache setting
(`--compile-cache on|off|both`) and, with `--baseline-rev REV`, also the operator and trainer of an
older revision ("baseline"), run on the same devcluster in the same run: REV is checked out into a
temporary git worktree, its chart is installed as a second release that watches its own namespace,
and PYTHONPATH (the chart's extraEnv for the operator, spec.env for the trainer; the pod runner maps
both images to this venv's interpreter) puts its sources first. Sides alternate job by job and
round by round (`--rounds`), so the machine's load drifts over both alike. Per failure:
  reaction_s  failure -> replacement pod created (the operator's reaction, JobSet + Job included)
  recovery_s  failure -> first progress record of the new attempt past its resume step (as polled;
              the one end-to-end measure both sides have: the baseline trainer records no timeline)
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
    scheduled_to_recovered  pods bound -> the new attempt's first record past its resume step seen
                            (bench clock: both sides have it; includes up to one progress interval)
    scheduled_to_process    pods bound -> trainer main() entered (pod start, Python + JAX imports)
    process_to_storage      main() -> storage probe passed (jax.distributed, probe)
    storage_to_restored     storage ready -> restore finished (listing, Orbax restore)
    restored_to_first_step  restore finished -> first step done (compilation, mostly)
    total                   SIGKILL -> first step done
  timeline    the same recovery as the operator dates it in status.lastFailure.timeline (failed,
              detected, jobSetCreated, podsScheduled, restored, firstNewStep; failed, the pod's
              finish time, has whole seconds); the baseline has none
Prints one JSON object: per run p50/p90/p99 per stage and medians, per side the medians over all its
failures and the operator share's p50/p99/max with n, each side's ratio to the first side, and the
median of the per-round, per-policy ratios (jobs run back to back).
Run: `make bench-recovery` (`RECOVERY_ARGS=...` to change the flags).

`--rungs recreate,inplace[,inplace-gcs]` (alone: recreate,inplace) compares the restart ladder's rungs
instead: one 2-slice job (v5e 2x2 x 2, two v5e nodes, no spare) per rung and round, alternating, each
with N SIGKILLs of one trainer process (slice 1's; under JobSet's agent on InPlace), GCS saves every 50
steps on every rung. recreate: strategy Recreate; inplace: InPlace + spec.checkpoint.local (every 10
steps); inplace-gcs: InPlace, GCS only. Per failure: recovery (kill -> the new process's first step, on
the trainer's clock; also as polled and as status.lastFailure.recoverySeconds), pods_rescheduled (live
pod uids that changed: 0 in place), steps_lost (the step last reported before the kill - the step
restored), restored_from (local | gcs), and stages: kill_to_detected (status timeline), kill_to_process,
process_to_storage, storage_to_restored, restored_to_first_step, total; the ratios are over the first rung.
`--model` picks the trainer's model (tiny by default; medium, 18.9 M parameters, ~227 MB of state with
Adam's moments, is the largest short of 100m, 110 M parameters and ~1.3 GB, too slow on 2 CPU cores).
`--gcs-mb-per-s` (default 25) puts the trainers' GCS traffic behind a proxy that this bench starts,
paced to that many MB/s per host and direction (one bucket per direction for the job's 2 hosts): GCS's
default egress quota of 200 Gbps per project and region, over 1,000 hosts restoring at once.
`--failure node` (with `--spare-nodes 1`) deletes the victim's node instead of killing its trainer: the
pod is gone with it and is replaced on the spare node, the other workers restart in place (InPlace) or
are recreated (Recreate); the node comes back after each recovery. The stages are the same.
`--hot-spares` puts a placeholder of the chart's `spares` on each spare node first: the replacement
then preempts it (kill_to_process includes the preemption).
With `--baseline-rev REV`, each rung runs twice per round, first as `<rung>-base` with REV's operator
(a release of REV's chart watching its own namespace, REV's sources first on its PYTHONPATH) and REV's
trainer (first on the pods' PYTHONPATH), then with this tree's: the ratios are over the first. Per
failure, `gcs_bytes_read` counts what the trainers read through the throttle between the failure and
the first new step (the restore, and a few kB of progress-record reads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import tpujob_contract as contract
import yaml
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from kubernetes import client, config, watch
from tpujob_contract import LABEL_ATTEMPT, LABEL_NAME
from tpujob_devcluster.cluster import BUCKET, DevCluster
from tpujob_devcluster.controlplane import REPO_ROOT
from tpujob_devcluster.harness import (
    CHART,
    OPERATOR_NAMESPACE,
    OPERATOR_RELEASE,
    ensure_namespace,
    git,
    helm_install_operator,
    lose_node,
    pod_pids,
    quantiles,
    signal_pod,
    worktree,
)
from tpujob_devcluster.pools import POOLS_FILE
from tpujob_devcluster.throttle import ThrottledProxy
from tpujob_operator import checkpoints

NAMESPACE = "default"
BASELINE_NAMESPACE = "tpujob-bench-baseline"  # the baseline's jobs; its operator watches only this one
# The custom-object calls' (group, version) of the two kinds the bench reads.
TRAININGJOBS = (contract.TRAININGJOB_GROUP, contract.TRAININGJOB_VERSION)
JOBSETS = (contract.JOBSET_GROUP, contract.JOBSET_VERSION)
POLICIES = ("continuous", "interval")
# What a revision's PYTHONPATH puts first.
SOURCES = ("operator/src", "trainer_image/src", "library/src", "contract/src")
STAGES = (
    "failure_visible", "detection", "decision_to_jobset", "operator_share", "jobset_to_scheduled",
    "scheduled_to_recovered", "scheduled_to_process", "process_to_storage", "storage_to_restored",
    "restored_to_first_step", "total",
)  # fmt: skip
TIMELINE_STAGES = {  # status.lastFailure.timeline (failed: the pod's finish time, whole seconds)
    "failed_to_detected": ("failed", "detected"),
    "detected_to_jobset_created": ("detected", "jobSetCreated"),
    "jobset_created_to_pods_scheduled": ("jobSetCreated", "podsScheduled"),
    "pods_scheduled_to_restored": ("podsScheduled", "restored"),
    "restored_to_first_new_step": ("restored", "firstNewStep"),
    "failed_to_first_new_step": ("failed", "firstNewStep"),
}


def source_pythonpath(source: Path | None) -> str | None:
    """A revision's checkout as the first entries of PYTHONPATH (None: this working tree)."""
    if source is None:
        return None
    return ":".join(str(source / d) for d in SOURCES if (source / d).is_dir())


def install_release(bench: Bench, namespace: str, key: str, source: Path | None, *values: str) -> None:
    """An operator release watching only `namespace`: `source`'s chart with its sources first on the
    operator's PYTHONPATH (None: this tree's), in its own namespace, named after `key`."""
    bench.ensure_namespace(namespace)
    helm_install_operator(
        bench.cluster.kubeconfig,
        f"watchNamespaces={{{namespace}}}",
        *values,
        release=OPERATOR_RELEASE if namespace == NAMESPACE else f"{OPERATOR_RELEASE}-{key}",
        chart=source / "charts" / "tpujob" if source else CHART,
        namespace=f"{OPERATOR_NAMESPACE}-{key}",
        env={"PYTHONPATH": path} if (path := source_pythonpath(source)) else None,
        skip_crds=True,
    )


@dataclass(frozen=True)
class Side:
    """One compared setting: whose operator and trainer (a revision, or this working tree) and the
    trainer's compile cache. `key` names it in the JSON."""

    key: str
    namespace: str
    compile_cache: str  # on | off (TPUJOB_COMPILATION_CACHE_DIR=off); a trainer without the cache ignores it
    rev: str | None = None  # None: this working tree (the venv's editable installs)
    commit: str | None = None
    source: Path | None = None  # the revision's checkout

    @property
    def pythonpath(self) -> str | None:
        return source_pythonpath(self.source)

    @property
    def has_timeline(self) -> bool:
        """Whether its operator dates lastFailure.timeline (the pre-issue-8 one does not)."""
        chart_crd = (self.source or REPO_ROOT) / "crds" / "trainingjob.yaml"
        return "jobSetCreated" in chart_crd.read_text()


def plan(sides: list[Side], rounds: int) -> list[tuple[int, str, Side]]:
    """Job order: per round, per policy, every side once; the sides' order turns each round, so no
    side always runs first (right after a long job, or on a freshly started cluster)."""
    order = []
    for r in range(rounds):
        turned = sides[r % len(sides) :] + sides[: r % len(sides)]
        for policy in POLICIES:
            order += [(r, policy, side) for side in turned]
    return order


def _manifest(name: str, policy: str, steps: int, failures: int, side: Side) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"directory": f"gs://{BUCKET}/bench", "policy": policy}
    if policy == "interval":
        checkpoint["intervalSteps"] = 50
    # Progress twice a second, so the last reported step before a crash is close to the real one.
    env = [{"name": contract.PROGRESS_INTERVAL_ENV, "value": "0.5"}]
    if side.compile_cache == "off":
        env.append({"name": contract.COMPILATION_CACHE_ENV, "value": "off"})
    if side.pythonpath:  # the trainer of that revision (images.yaml runs this venv's interpreter)
        env.append({"name": "PYTHONPATH", "value": side.pythonpath})
    return {
        "apiVersion": "/".join(TRAININGJOBS), "kind": contract.TRAININGJOB_KIND,
        "metadata": {"name": name, "namespace": side.namespace},
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


class Watcher:
    """Arrival times (this machine's wall clock) of what the API says about one job's objects."""

    def __init__(self, kube: client.ApiClient, name: str, namespace: str) -> None:
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
            (core.list_namespaced_pod, (namespace,), {"label_selector": selector}, self._pod),
            (
                custom.list_namespaced_custom_object,
                (*JOBSETS, namespace, contract.JOBSET_PLURAL),
                {"label_selector": selector},
                self._jobset,
            ),
            (
                custom.list_namespaced_custom_object,
                (*TRAININGJOBS, namespace, contract.TRAININGJOB_PLURAL),
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

    def status(self, name: str, namespace: str) -> dict[str, Any]:
        body: Any = self.custom.get_namespaced_custom_object(
            *TRAININGJOBS, namespace, contract.TRAININGJOB_PLURAL, name
        )
        return dict(body.get("status") or {})

    def wait(self, probe: Any, timeout: float = 300.0, interval: float = 0.1) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"benchmark step timed out after {timeout}s")

    def ensure_namespace(self, namespace: str) -> None:
        ensure_namespace(self.core, namespace)

    def pods(self, name: str, namespace: str, attempt: int | None = None) -> list[Any]:
        selector = f"{LABEL_NAME}={name}" + (f",{LABEL_ATTEMPT}={attempt}" if attempt is not None else "")
        found: list[Any] = self.core.list_namespaced_pod(namespace, label_selector=selector).items
        return found

    def running_worker(self, name: str, namespace: str, attempt: int) -> str | None:
        running = [p.metadata.name for p in self.pods(name, namespace, attempt) if p.status.phase == "Running"]
        return str(running[0]) if running else None

    def timeline(self, name: str, namespace: str, attempt: int) -> dict[str, Any]:
        """lastFailure.timeline once the operator dated the first new step (it polls: up to ~10 s)."""

        def complete() -> dict[str, Any] | None:
            status = self.status(name, namespace)
            timeline = dict((status.get("lastFailure") or {}).get("timeline") or {})
            return timeline if status.get("attempt") == attempt and timeline.get("firstNewStep") else None

        try:
            result: dict[str, Any] = self.wait(complete, timeout=30.0, interval=0.5)
        except TimeoutError:
            result = dict((self.status(name, namespace).get("lastFailure") or {}).get("timeline") or {})
        return result

    def inject_failure(
        self, name: str, side: Side, run_dir: str, attempt: int, since: float, rng: random.Random, watcher: Watcher
    ) -> tuple[dict[str, Any], float]:
        """Crash the worker 4-12 s (random) after `since` (the attempt's first step, as polled), wait
        for the replacement's first step; returns the failure's record and when that step was seen."""
        ns = side.namespace
        time.sleep(max(0.0, since + rng.uniform(4.0, 12.0) - time.monotonic()))
        pod = self.wait(lambda: self.running_worker(name, ns, attempt))
        signal_pod(self.cluster.state_dir, ns, pod, signal.SIGKILL)
        failed_at, killed = time.monotonic(), time.time()
        self.wait(lambda: self.pods(name, ns, attempt + 1), interval=0.05)
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
        recovered_at, recovered = time.monotonic(), time.time()
        recovery = recovered_at - failed_at
        timeline = self.timeline(name, ns, attempt + 1) if side.has_timeline else {}
        failure = self.status(name, ns)["lastFailure"]
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
            "scheduled_to_recovered": _span(bound, recovered),
            "scheduled_to_process": _span(bound, process),
            "process_to_storage": _span(process, ready),
            "storage_to_restored": _span(ready, restored),
            "restored_to_first_step": _span(restored, first),
            "total": _span(killed, first),
        }
        record = {
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
        return record, recovered_at

    def diagnose(self, name: str, namespace: str) -> None:
        """What the job, its pods and their logs say: printed to stderr when a step times out."""
        print(json.dumps({"status": self.status(name, namespace)}, indent=1), file=sys.stderr)
        for pod in self.pods(name, namespace):
            print(f"--- pod {pod.metadata.name}: {pod.status.phase}", file=sys.stderr)
            log = self.cluster.state_dir / "pods" / namespace / str(pod.metadata.name) / "log"
            if log.exists():
                print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)

    def run(self, name: str, policy: str, side: Side, failures: int, rng: random.Random) -> dict[str, Any]:
        ns = side.namespace
        run_dir = f"gs://{BUCKET}/bench/{ns}/{name}"
        watcher = Watcher(self.kube, name, ns)
        try:
            self.custom.create_namespaced_custom_object(
                *TRAININGJOBS, ns, contract.TRAININGJOB_PLURAL, _manifest(name, policy, 100000, failures, side)
            )
            records = []
            try:
                self.wait(lambda: (p := checkpoints.read_progress(self.gcs, run_dir)) and p.step > 0)
                since = time.monotonic()
                for attempt in range(failures):
                    record, since = self.inject_failure(name, side, run_dir, attempt, since, rng, watcher)
                    records.append(record)
            except Exception:
                self.diagnose(name, ns)
                raise
            goodput = self.status(name, ns).get("goodput")
            self.custom.delete_namespaced_custom_object(*TRAININGJOBS, ns, contract.TRAININGJOB_PLURAL, name)
            # The next job needs the one v5e node: wait for this one's pods to be gone.
            self.wait(lambda: not self.pods(name, ns), timeout=120.0, interval=0.5)
        finally:
            watcher.stop()
        return {
            "policy": policy,
            "side": side.key,
            "compile_cache": side.compile_cache,
            "failures": records,
            "median_reaction_s": statistics.median(r["reaction_s"] for r in records),
            "median_recovery_s": statistics.median(r["recovery_s"] for r in records),
            "median_lost_steps": statistics.median(r["lost_steps"] or 0 for r in records),
            "stages": {s: quantiles(r["stages"][s] for r in records) for s in STAGES},
            "timeline_stages": {s: quantiles(r["timeline_stages"][s] for r in records) for s in TIMELINE_STAGES},
            "goodput": goodput,
        }


PICKS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "recovery_s": lambda r: r["recovery_s"],
    "reaction_s": lambda r: r["reaction_s"],
    "total_s": lambda r: r["stages"]["total"],
    "restored_to_first_step_s": lambda r: r["stages"]["restored_to_first_step"],
    "operator_share_s": lambda r: r["stages"]["operator_share"],
}


def comparison(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per side, over every failure of every policy and round: the medians, each stage's quantiles
    (the operator share's p50/p99/max with n among them), and each side's median over the first side's.
    `runs` is side -> policy -> that side's runs of that policy."""
    failures = {side: [r for per in by_policy.values() for run in per for r in run["failures"]]
                for side, by_policy in runs.items()}  # fmt: skip

    def median(side: str, pick: Callable[[dict[str, Any]], float | None]) -> float | None:
        values = [v for r in failures[side] if (v := pick(r)) is not None]
        return round(statistics.median(values), 3) if values else None

    medians = {side: {k: median(side, f) for k, f in PICKS.items()} for side in runs}
    result: dict[str, Any] = {
        "failures": {side: len(records) for side, records in failures.items()},
        "median": medians,
        "stages": {
            side: {s: quantiles(r["stages"][s] for r in records) for s in STAGES} for side, records in failures.items()
        },
    }
    sides = list(runs)
    if len(sides) > 1:
        first = sides[0]
        result[f"ratio_over_{first}"] = {
            side: {
                k: round(value / base, 3)
                if (value := medians[side][k]) is not None and (base := medians[first][k])
                else None
                for k in PICKS
            }
            for side in sides[1:]
        }
    if "on" in medians and "off" in medians:  # the earlier shape: compile cache on over off
        result["ratio_on_over_off"] = {
            k: round(on / off, 3) if (on := medians["on"][k]) is not None and (off := medians["off"][k]) else None
            for k in PICKS
        }
    return result


def paired_ratios(runs: list[dict[str, Any]], first: str) -> dict[str, Any]:
    """Each side's job-median recovery over the first side's job of the same round and policy (the
    two ran back to back, under nearly the same load), and the median of those ratios: a comparison
    that the machine's load drifting over the run moves less than the pooled medians."""
    base = {(r["round"], r["policy"]): r["median_recovery_s"] for r in runs if r["side"] == first}
    result: dict[str, Any] = {}
    for side in dict.fromkeys(r["side"] for r in runs if r["side"] != first):
        pairs = {
            f"r{r['round']}-{r['policy']}": round(r["median_recovery_s"] / b, 3)
            for r in runs
            if r["side"] == side and (b := base.get((r["round"], r["policy"])))
        }
        result[side] = {"pairs": pairs, "median": round(statistics.median(pairs.values()), 3) if pairs else None}
    return result


def sides_for(
    modes: list[str], baseline: tuple[str, str, Path] | None, current: tuple[str, str, Path] | None
) -> list[Side]:
    """The compared sides, the baseline first. Without a baseline each cache setting is a side keyed
    by the setting (on/off, as before); with one, the current side(s) are `current[-cache-<mode>]`."""
    cur_rev, cur_commit, cur_source = current or (None, None, None)
    if baseline is None:
        return [Side(m, NAMESPACE, m, cur_rev, cur_commit, cur_source) for m in modes]
    rev, commit, source = baseline
    sides = [Side("baseline", BASELINE_NAMESPACE, "on", rev, commit, source)]
    for m in modes:
        key = "current" if len(modes) == 1 else f"current-cache-{m}"
        sides.append(Side(key, NAMESPACE, m, cur_rev, cur_commit, cur_source))
    return sides


# --- The restart ladder's rungs side by side (--rungs) -------------------------------------------------------


@dataclass(frozen=True)
class Rung:
    """One rung compared: spec.restart.strategy, and whether spec.checkpoint.local is on."""

    key: str
    strategy: str  # Recreate | InPlace
    local: bool
    # --baseline-rev: that revision's tree, whose operator (a release of its own chart watching `namespace`)
    # and trainer (first on the pods' PYTHONPATH) run the rung
    source: Path | None = None
    namespace: str = NAMESPACE

    @property
    def pythonpath(self) -> str | None:
        return source_pythonpath(self.source)


RUNGS = {
    "recreate": Rung("recreate", "Recreate", False),  # a new JobSet, GCS only
    "inplace": Rung("inplace", "InPlace", True),  # the same pods, the local tier restored first
    "inplace-gcs": Rung("inplace-gcs", "InPlace", False),  # the same pods, GCS only
}
RUNG_GCS_INTERVAL = 50  # steps between GCS saves (policy interval), the same on every rung
RUNG_LOCAL_INTERVAL = 10  # steps between local-tier saves (spec.checkpoint.local.intervalSteps)
RUNG_STAGES = (
    "kill_to_detected", "kill_to_process", "process_to_storage", "storage_to_restored",
    "restored_to_first_step", "total",
)  # fmt: skip
RUNG_PICKS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "recovery_s": lambda r: r["stages"]["total"],
    "recovery_polled_s": lambda r: r["recovery_polled_s"],
    "status_recovery_s": lambda r: r["status_recovery_s"],
    "pods_rescheduled": lambda r: r["pods_rescheduled"],
    "steps_lost": lambda r: r["steps_lost"],
    "status_lost_steps": lambda r: r["status_lost_steps"],
    "gcs_bytes_read": lambda r: r.get("gcs_bytes_read"),
}


def _rung_manifest(
    name: str, rung: Rung, model: str, failures: int, storage_env: dict[str, str] | None = None
) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {
        "directory": f"gs://{BUCKET}/bench", "policy": "interval", "intervalSteps": RUNG_GCS_INTERVAL,
    }  # fmt: skip
    if rung.local:
        # A fixed interval (no budget): steps lost are then at most RUNG_LOCAL_INTERVAL, on any model.
        checkpoint["local"] = {"sizeLimit": "2Gi", "intervalSteps": RUNG_LOCAL_INTERVAL, "overheadBudgetPercent": 0}
    restart: dict[str, Any] = {"maxRestarts": failures, "backoffSeconds": 0, "strategy": rung.strategy}
    if rung.strategy == "InPlace":  # every failure of the job in place: the ladder never climbs
        restart["inPlace"] = {"maxRestarts": failures}
    return {
        "apiVersion": "/".join(TRAININGJOBS), "kind": contract.TRAININGJOB_KIND,
        "metadata": {"name": name, "namespace": rung.namespace},
        "spec": {
            "image": "tpujob-trainer:dev",
            "args": ["--model", model, "--steps", "100000", "--batch-size", "8", "--log-every", "25"],
            "env": [
                {"name": contract.PROGRESS_INTERVAL_ENV, "value": "0.5"},
                *({"name": k, "value": v} for k, v in (storage_env or {}).items()),
                *([{"name": "PYTHONPATH", "value": rung.pythonpath}] if rung.pythonpath else []),
            ],
            "tpu": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 2},
            "checkpoint": checkpoint,
            "restart": restart,
        },
    }  # fmt: skip


def rung_plan(rungs: list[Rung], rounds: int) -> list[tuple[int, Rung]]:
    """Per round every rung once, the first one turning each round (as `plan`)."""
    return [(r, rung) for r in range(rounds) for rung in rungs[r % len(rungs) :] + rungs[: r % len(rungs)]]


FAILURES = {"crash": "SIGKILL of one trainer process", "node": "deletion of one worker's node"}
RUNG_HOSTS = 2  # the job's hosts: the proxy's one bucket per direction carries all of them
# The trainers' GCS traffic goes through a throttle (tpujob_devcluster.throttle) at this per-host rate:
# GCS's default Google egress bandwidth quota, 200 Gbps per project and region, shared by 1,000 hosts
# restoring at once (a large multi-slice job after a failure) leaves each about 25 MB/s.
DEFAULT_GCS_MB_PER_S = 25.0


class RungBench(Bench):
    storage_env: dict[str, str] | None = None  # the trainers' GCS endpoints, when throttled
    proxy: ThrottledProxy | None = None  # their throttle, which counts the bytes
    namespace: str = NAMESPACE  # the running rung's

    def gcs_bytes_read(self) -> int | None:
        return self.proxy.transferred["down"] if self.proxy else None

    def pod_uids(self, name: str) -> dict[str, str]:
        """The job's live pods (any attempt): name -> uid."""
        return {
            str(p.metadata.name): str(p.metadata.uid)
            for p in self.pods(name, self.namespace)
            if p.status.phase not in ("Failed", "Succeeded") and p.metadata.deletion_timestamp is None
        }

    def trainer_pid(self, pod: str) -> int | None:
        """The trainer's python process (under the agent's shell on InPlace): a crash of the training
        process alone, the issue's failure, the same on every rung."""
        for pid in pod_pids(self.cluster.state_dir, self.namespace, pod):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            line = b" ".join(argv)  # `python -m tpujob_trainer`, or the entrypoint under the agent
            if Path(argv[0].decode()).name.startswith("python") and (
                b"tpujob-train" in line or b"tpujob_trainer" in line
            ):
                return pid
        return None

    def victim(self, name: str) -> tuple[str, int] | None:
        """A running worker of the second slice (not process 0, which writes the record) and its trainer."""
        pods = [p for p in self.pods(name, self.namespace) if p.status.phase == "Running"]
        pods.sort(key=lambda p: "-slice-1-" not in str(p.metadata.name))
        for pod in pods:
            if (pid := self.trainer_pid(str(pod.metadata.name))) is not None:
                return str(pod.metadata.name), pid
        return None

    def recovered(self, run_dir: str, killed: float, last: list[int]) -> contract.ProgressRecord | None:
        """The first record of a process started after the kill that trained past its restored step;
        `last` keeps the highest step the old process recorded (it goes on recording, its step stuck
        where the kill stopped it: the last step trained, not the one last read before the kill)."""
        p = checkpoints.read_progress(self.gcs, run_dir)
        started = _wall(p.process_started_at) if p else None
        if p and started is not None and started <= killed:
            last[0] = max(last[0], p.step)
        if p and started is not None and started > killed and p.first_step_at and p.step > (p.restored_step or 0):
            return p
        return None

    def failure_status(self, name: str, count: int) -> dict[str, Any]:
        """status once its lastFailure is the count-th failure's, with the first new step dated."""

        def complete() -> dict[str, Any] | None:
            status = self.status(name, self.namespace)
            timeline = (status.get("lastFailure") or {}).get("timeline") or {}
            return status if status.get("restarts", 0) >= count and timeline.get("firstNewStep") else None

        try:
            result: dict[str, Any] = self.wait(complete, timeout=30.0, interval=0.5)
        except TimeoutError:
            result = self.status(name, self.namespace)
        return result

    def inject(
        self, name: str, run_dir: str, count: int, since: float, rng: random.Random, mode: str = "crash"
    ) -> tuple[dict[str, Any], float]:
        time.sleep(max(0.0, since + rng.uniform(4.0, 12.0) - time.monotonic()))
        pod, pid = self.wait(lambda: self.victim(name))
        before_uids = self.pod_uids(name)
        before = checkpoints.read_progress(self.gcs, run_dir)
        read_before = self.gcs_bytes_read()
        lost = None
        if mode == "node":
            lost = lose_node(self.core, self.namespace, pod)
        else:
            os.kill(pid, signal.SIGKILL)
        killed, t0 = time.time(), time.monotonic()
        last = [before.step if before else 0]
        progress: contract.ProgressRecord = self.wait(lambda: self.recovered(run_dir, killed, last), interval=0.05)
        recovered_at = time.monotonic()
        read_after = self.gcs_bytes_read()
        if lost is not None:  # the next failure finds the pools as the job began
            lost.restore(self.core)
        status = self.failure_status(name, count)
        failure = status.get("lastFailure") or {}
        timeline = failure.get("timeline") or {}
        after_uids = self.pod_uids(name)
        process, ready = _wall(progress.process_started_at), _wall(progress.storage_ready_at)
        restored = _wall(progress.restore_finished_at) or ready
        first = _wall(progress.first_step_at)
        reported = last[0] if before else None
        record = {
            "failure": mode,
            "victim": pod,
            "recovery_polled_s": round(recovered_at - t0, 2),
            "status_recovery_s": failure.get("recoverySeconds"),
            "rung": failure.get("rung"),
            "pods_rescheduled": len(set(after_uids.values()) - set(before_uids.values())),
            "pods": len(after_uids),
            "reported_step": reported,
            "restored_step": progress.restored_step,
            "restored_from": progress.restored_from,
            # What the trainers read from GCS between the failure and the first new step (the restore,
            # and the progress record's reads: a few kB), through the throttle.
            "gcs_bytes_read": None if read_before is None or read_after is None else read_after - read_before,
            "steps_lost": reported - (progress.restored_step or 0) if reported is not None else None,
            "status_lost_steps": failure.get("lostSteps"),
            "stages": {
                "kill_to_detected": _span(killed, _wall(timeline.get("detected"))),
                "kill_to_process": _span(killed, process),
                "process_to_storage": _span(process, ready),
                "storage_to_restored": _span(ready, restored),
                "restored_to_first_step": _span(restored, first),
                "total": _span(killed, first),
            },
            "timeline": timeline,
            "timeline_stages": {
                k: _span(_wall(timeline.get(a)), _wall(timeline.get(b))) for k, (a, b) in TIMELINE_STAGES.items()
            },
            "in_place_restarts": status.get("inPlaceRestarts"),
            "attempt": status.get("attempt"),
        }
        return record, recovered_at

    def run_rung(
        self, name: str, rung: Rung, model: str, failures: int, rng: random.Random, failure: str = "crash"
    ) -> dict[str, Any]:
        self.namespace = rung.namespace
        run_dir = f"gs://{BUCKET}/bench/{self.namespace}/{name}"
        self.custom.create_namespaced_custom_object(
            *TRAININGJOBS,
            self.namespace,
            contract.TRAININGJOB_PLURAL,
            _rung_manifest(name, rung, model, failures, self.storage_env),
        )
        records = []
        try:
            # Past a GCS save and a few local ones, so each tier has something to restore.
            self.wait(
                lambda: (p := checkpoints.read_progress(self.gcs, run_dir)) and p.step > RUNG_GCS_INTERVAL + 5,
                timeout=600.0,
            )
            since = time.monotonic()
            for i in range(failures):
                record, since = self.inject(name, run_dir, i + 1, since, rng, failure)
                records.append(record)
                print(f"  {name} failure {i + 1}: {json.dumps(record['stages'])}", file=sys.stderr, flush=True)
        except Exception:
            self.diagnose(name, self.namespace)
            raise
        status = self.status(name, self.namespace)
        self.custom.delete_namespaced_custom_object(*TRAININGJOBS, self.namespace, contract.TRAININGJOB_PLURAL, name)
        self.wait(
            lambda: not self.pods(name, self.namespace), timeout=180.0, interval=0.5
        )  # the next job needs the nodes
        return {
            "rung": rung.key,
            "strategy": rung.strategy,
            "local": rung.local,
            "failures": records,
            "restarts": status.get("restarts"),
            "in_place_restarts": status.get("inPlaceRestarts"),
            "goodput": status.get("goodput"),
            "median": _rung_medians(records),
            "stages": {s: quantiles(r["stages"][s] for r in records) for s in RUNG_STAGES},
        }


def _rung_medians(records: list[dict[str, Any]]) -> dict[str, float | None]:
    def median(pick: Callable[[dict[str, Any]], float | None]) -> float | None:
        values = [v for r in records if (v := pick(r)) is not None]
        return round(statistics.median(values), 3) if values else None

    return {k: median(f) for k, f in RUNG_PICKS.items()}


def rung_comparison(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rung over all its failures: medians, stage quantiles, restore tiers; each rung's medians
    over the first rung's (recreate's, by default)."""
    rungs = list(dict.fromkeys(r["rung"] for r in runs))
    failures = {k: [f for r in runs if r["rung"] == k for f in r["failures"]] for k in rungs}
    medians = {k: _rung_medians(v) for k, v in failures.items()}
    result: dict[str, Any] = {
        "failures": {k: len(v) for k, v in failures.items()},
        "median": medians,
        "stages": {k: {s: quantiles(f["stages"][s] for f in v) for s in RUNG_STAGES} for k, v in failures.items()},
        "timeline_stages": {
            k: {s: quantiles(f["timeline_stages"][s] for f in v) for s in TIMELINE_STAGES} for k, v in failures.items()
        },
        "restored_from": {k: [f["restored_from"] for f in v] for k, v in failures.items()},
    }
    if len(rungs) > 1:
        first = rungs[0]
        result[f"ratio_over_{first}"] = {
            k: {
                p: round(value / base, 3)
                if (value := medians[k][p]) is not None and (base := medians[first][p])
                else None
                for p in ("recovery_s", "recovery_polled_s", "status_recovery_s", "steps_lost", "status_lost_steps")
            }
            for k in rungs[1:]
        }
    return result


def _bench_rungs(
    rungs: list[Rung],
    model: str,
    rounds: int,
    failures: int,
    rng: random.Random,
    state: Path,
    spare: int = 0,
    gcs_mb_per_s: float = 0.0,
    failure: str = "crash",
    hot_spares: bool = False,
) -> tuple[list[dict[str, Any]], float, dict[str, int]]:
    t0 = time.monotonic()
    # v5e 2x2 pools for the 2-slice job's two nodes, and `spare` more: with none, Recreate reschedules
    # onto the nodes its old pods free, waiting out their termination (a reservation sized to the job).
    state.mkdir(parents=True, exist_ok=True)
    pools = yaml.safe_load(POOLS_FILE.read_text())
    for extra in range(1 + spare):
        pools["pools"].append({"name": f"v5e-pool-x{extra}", "accelerator": "tpu-v5-lite-podslice", "topology": "2x2"})
    (state / "pools.yaml").write_text(yaml.safe_dump(pools))
    cluster = DevCluster(state, state / "pools.yaml").start()
    proxy: ThrottledProxy | None = None
    try:
        bench = RungBench(cluster)
        if gcs_mb_per_s > 0:
            assert cluster.gcs is not None
            proxy = ThrottledProxy(cluster.gcs, gcs_mb_per_s * 1e6 * RUNG_HOSTS).start()
            bench.storage_env, bench.proxy = proxy.env(), proxy
        # The chart's hot spares: a placeholder on each spare node, which a replacement must preempt.
        pool = {"name": "v5e", "accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "hosts": spare}
        spares = [f"spares.pools[0].{k}={v}" for k, v in pool.items()] if hot_spares else []
        if all(r.source is None for r in rungs):
            helm_install_operator(cluster.kubeconfig, *spares)
        else:  # one release per namespace, each watching only its own rungs' jobs
            for rung in {r.namespace: r for r in rungs}.values():
                key = "base" if rung.source else "current"
                install_release(bench, rung.namespace, key, rung.source, *([] if rung.source else spares))
        cluster_seconds = round(time.monotonic() - t0, 1)
        runs = []
        for r, rung in rung_plan(rungs, rounds):
            name = f"bench-{rung.key}-r{r}"
            runs.append({"round": r, **bench.run_rung(name, rung, model, failures, rng, failure)})
            print(f"{name}: medians {json.dumps(runs[-1]['median'])}", file=sys.stderr, flush=True)
        return runs, cluster_seconds, dict(proxy.transferred) if proxy else {}
    finally:
        if proxy is not None:
            proxy.stop()
        cluster.stop()


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the devcluster is stopped too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failures", type=int, default=3, help="failures per job (one job per policy, side and round)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of jobs; sides alternate within each")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--compile-cache",
        choices=["on", "off", "both"],
        default=None,
        help="the current trainer's persistent compilation cache (off: TPUJOB_COMPILATION_CACHE_DIR=off); "
        "both: off and on, in one run on the same cluster (default: both, or on with --baseline-rev)",
    )
    parser.add_argument(
        "--baseline-rev",
        help="also run this revision's operator and trainer (e.g. a740187, the code before issue 8) on the "
        "same cluster, alternating with the current side; ratios are over it",
    )
    parser.add_argument("--current-rev", help="run this revision as the current side instead of the working tree")
    parser.add_argument(
        "--rungs",
        nargs="?",
        const="recreate,inplace",
        help=f"the restart ladder's rungs side by side instead (of {','.join(RUNGS)}; alone: recreate,inplace): "
        "2-slice jobs, the trainer process SIGKILLed, recovery to the first new step, pods rescheduled, "
        "steps lost and the restore tier per failure",
    )
    parser.add_argument(
        "--spare-nodes", type=int, default=0, help="with --rungs: v5e nodes beyond the job's two (default 0)"
    )
    parser.add_argument("--model", default="tiny", help="the trainer's --model with --rungs (tiny, small, medium, ...)")
    parser.add_argument(
        "--failure",
        choices=list(FAILURES),
        default="crash",
        help="with --rungs: crash (SIGKILL of a trainer process) or node (its node deleted; needs --spare-nodes 1)",
    )
    parser.add_argument(
        "--hot-spares",
        action="store_true",
        help="with --rungs: the chart's spares hold the spare nodes (placeholders a replacement preempts)",
    )
    parser.add_argument(
        "--gcs-mb-per-s",
        type=float,
        default=DEFAULT_GCS_MB_PER_S,
        help="with --rungs: the trainers' GCS bandwidth per host and direction, through a throttling proxy "
        f"(default {DEFAULT_GCS_MB_PER_S:g}: a 200 Gbps regional quota over 1,000 hosts; 0: no proxy)",
    )
    args = parser.parse_args()
    if args.rungs:
        _main_rungs(args)
        return
    mode = args.compile_cache or ("on" if args.baseline_rev else "both")
    modes = ["off", "on"] if mode == "both" else [mode]
    rng = random.Random(args.seed)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="tpujob-bench-") as temp,
        _checkout(args.baseline_rev, Path(temp)) as baseline,
        _checkout(args.current_rev, Path(temp)) as current,
    ):
        sides = sides_for(modes, baseline, current)
        runs, cluster_seconds = _bench(sides, args.rounds, args.failures, rng, Path(temp) / "cluster")
    by_side: dict[str, dict[str, list[dict[str, Any]]]] = {
        s.key: {p: [r for r in runs if r["side"] == s.key and r["policy"] == p] for p in POLICIES} for s in sides
    }
    result = {
        "benchmark": "recovery",
        "workload": "tiny LM, 1 slice v5e 2x2 (1 host, 4 CPU devices), backoff 0, SIGKILL of the worker "
        "4-12 s after the previous recovery, progress every 0.5 s, interval policy every 50 steps",
        "command": " ".join(["bench/recovery.py", *sys.argv[1:]]),
        "sides": {
            s.key: {
                "namespace": s.namespace,
                "compile_cache": s.compile_cache,
                "rev": s.rev,
                "commit": s.commit or f"{git('rev-parse', 'HEAD')} (working tree)",
            }
            for s in sides
        },
        "failures_per_job": args.failures,
        "rounds": args.rounds,
        "stages": list(STAGES),
        "comparison": comparison(by_side),
        f"paired_recovery_ratio_over_{sides[0].key}": paired_ratios(runs, sides[0].key),
        # The shape of earlier versions: side -> policy -> that policy's (first) run.
        "runs": {side: {p: per[0] for p, per in by_policy.items() if per} for side, by_policy in by_side.items()},
        "all_runs": runs,
        "cluster_start_seconds": cluster_seconds,
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))


def _main_rungs(args: argparse.Namespace) -> None:
    if args.hot_spares and args.spare_nodes < 1:
        sys.exit("--hot-spares needs --spare-nodes 1 or more: the nodes its placeholders hold")
    if args.failure == "node" and args.spare_nodes < 1:
        sys.exit("--failure node needs --spare-nodes 1 or more: the lost node's pod is placed on a spare one")
    keys = [k.strip() for k in args.rungs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in RUNGS]
    if unknown or not keys:
        sys.exit(f"unknown rungs {unknown}; choose from {list(RUNGS)}")
    rungs = [RUNGS[k] for k in keys]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpujob-bench-") as temp, _checkout(args.baseline_rev, Path(temp)) as base:
        if base is not None:  # each rung with that revision's operator and trainer first (the ratios are over it)
            _, _, source = base
            rungs = [
                r
                for rung in rungs
                for r in (replace(rung, key=f"{rung.key}-base", source=source, namespace=BASELINE_NAMESPACE), rung)
            ]
        runs, cluster_seconds, throttled_bytes = _bench_rungs(
            rungs,
            args.model,
            args.rounds,
            args.failures,
            random.Random(args.seed),
            Path(temp) / "cluster",
            args.spare_nodes,
            args.gcs_mb_per_s,
            args.failure,
            args.hot_spares,
        )
    result = {
        "benchmark": "recovery-rungs",
        "workload": (
            f"{args.model} LM, 2 slices v5e 2x2 (2 hosts, {args.spare_nodes} spare nodes"
            + (", each held by a hot spare placeholder" if args.hot_spares else "")
            + "), backoff 0, "
            f"{FAILURES[args.failure]} (slice 1) 4-12 s after the previous recovery, progress every 0.5 s, "
            f"GCS every {RUNG_GCS_INTERVAL} steps, local tier (inplace) every {RUNG_LOCAL_INTERVAL} steps, "
            + (
                f"the trainers' GCS throttled to {args.gcs_mb_per_s:g} MB/s per host and direction"
                if args.gcs_mb_per_s > 0
                else "GCS unthrottled"
            )
        ),
        "failure": args.failure,
        "gcs_mb_per_s_per_host": args.gcs_mb_per_s,
        "gcs_bytes_through_throttle": throttled_bytes,
        "command": " ".join(["bench/recovery.py", *sys.argv[1:]]),
        "commit": f"{git('rev-parse', 'HEAD')} (working tree)",
        "baseline": args.baseline_rev,
        "rungs": {
            r.key: {"strategy": r.strategy, "local": r.local, "operator_and_trainer": str(r.source or "working tree")}
            for r in rungs
        },
        "failures_per_job": args.failures,
        "rounds": args.rounds,
        "stages": list(RUNG_STAGES),
        "comparison": rung_comparison(runs),
        "all_runs": runs,
        "cluster_start_seconds": cluster_seconds,
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))


@contextmanager
def _checkout(rev: str | None, parent: Path) -> Iterator[tuple[str, str, Path] | None]:
    if rev is None:
        yield None
        return
    with worktree(rev, parent) as (commit, path):
        yield rev, commit, path


def _bench(
    sides: list[Side], rounds: int, failures: int, rng: random.Random, state: Path
) -> tuple[list[dict[str, Any]], float]:
    t0 = time.monotonic()
    cluster = DevCluster(state).start()
    try:
        bench = Bench(cluster)
        if len({s.namespace for s in sides}) == 1 and sides[0].source is None:
            helm_install_operator(cluster.kubeconfig)  # one operator, the chart as a user installs it
        else:  # one release per namespace, each watching only its own side's jobs
            for side in {s.namespace: s for s in sides}.values():
                install_release(bench, side.namespace, side.key, side.source)
        cluster_seconds = round(time.monotonic() - t0, 1)
        runs = []
        for r, policy, side in plan(sides, rounds):
            name = f"bench-{side.key}-{policy}-r{r}"
            runs.append({"round": r, **bench.run(name, policy, side, failures, rng)})
            print(f"{name}: median recovery {runs[-1]['median_recovery_s']} s", file=sys.stderr, flush=True)
        return runs, cluster_seconds
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
