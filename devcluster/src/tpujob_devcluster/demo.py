"""`make demo`: a slice fails mid-training and the job comes back by itself.

devcluster up -> operator installed with the Helm chart (its pod runs through the pod runner) ->
examples/demo.yaml applied -> once a checkpoint is committed, one slice's worker is SIGKILLed ->
the operator restarts the workers from the latest committed step -> training completes. A live
table shows phase, step, checkpoint and restarts; the report at the end gives steps, saves, the
checkpoint interval, restarts, steps lost and recovery time.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from rich.console import Console
from rich.live import Live
from rich.table import Table
from tpujob_operator.checkpoints import latest_committed_step, make_client, read_progress, split_gs_path

from .cluster import BUCKET, DevCluster, read_state
from .controlplane import REPO_ROOT
from .harness import helm_install_operator, signal_pod

NAMESPACE = "default"
DEMO_MANIFEST = REPO_ROOT / "examples" / "demo.yaml"
DEMO_TIMEOUT_S = 540


@dataclass
class Timeline:
    """What the demo saw, sampled from the apiserver and the bucket (independently of the operator)."""

    committed_steps: list[tuple[float, int]] = field(default_factory=list)
    kill_time: float | None = None
    killed_pod: str | None = None
    committed_at_kill: int | None = None
    step_at_kill: int | None = None
    first_resumed_time: float | None = None

    def saw_commit(self, step: int | None) -> None:
        if step is not None and (not self.committed_steps or self.committed_steps[-1][1] != step):
            self.committed_steps.append((time.monotonic(), step))


def view(tj: dict[str, Any], timeline: Timeline, elapsed: float) -> Table:
    status = tj.get("status") or {}
    table = Table(title=f"TrainingJob {NAMESPACE}/{tj['metadata']['name']}  ({elapsed:.0f}s)")
    for column in ("phase", "attempt", "step", "loss", "checkpoint", "restarts", "lost steps", "event"):
        table.add_column(column)
    event = f"killed {timeline.killed_pod}" if timeline.killed_pod else "waiting for the first checkpoint"
    if status.get("lastFailure", {}).get("recoverySeconds") is not None:
        event = f"recovered in {status['lastFailure']['recoverySeconds']}s"
    loss = status.get("loss")
    table.add_row(
        str(status.get("phase", "-")),
        str(status.get("attempt", 0)),
        str(status.get("step", "-")),
        f"{loss:.3f}" if isinstance(loss, float) else "-",
        str((status.get("latestCheckpoint") or {}).get("step", "-")),
        str(status.get("restarts", 0)),
        str(status.get("lostSteps", 0)),
        event,
    )
    return table


def kill_one_slice_worker(core: client.CoreV1Api, state_dir: Path, js_name: str) -> str:
    """SIGKILL the process of slice 1's first worker: a crash, as a dying host would look."""
    pods: list[Any] = core.list_namespaced_pod(
        NAMESPACE, label_selector=f"jobset.sigs.k8s.io/jobset-name={js_name},jobset.sigs.k8s.io/job-index=1"
    ).items
    running = [
        p.metadata.name for p in pods
        if p.status.phase == "Running" and p.metadata.annotations.get("batch.kubernetes.io/job-completion-index") == "0"
    ]  # fmt: skip
    if not running:
        raise RuntimeError(f"no worker of slice 1 of {js_name} is running")
    signal_pod(state_dir, NAMESPACE, running[0], signal.SIGKILL)
    return str(running[0])


def report(tj: dict[str, Any], timeline: Timeline) -> dict[str, Any]:
    status = tj["status"]
    steps = [s for _, s in timeline.committed_steps]
    intervals = [b - a for a, b in itertools.pairwise(steps) if b > a]
    failure = status.get("lastFailure") or {}
    resumed = failure.get("resumeStep")
    return {
        "phase": status.get("phase"),
        "final_step": status.get("step"),
        "saves_observed": len(steps),
        "checkpoint_interval_steps_p50": statistics.median(intervals) if intervals else None,
        "restarts": status.get("restarts"),
        "failure": {"kind": failure.get("kind"), "reason": failure.get("reason"), "slice": failure.get("slice")},
        "reported_step_at_kill": timeline.step_at_kill,
        "committed_step_at_kill": timeline.committed_at_kill,
        "resumed_from_step": resumed,
        "steps_lost": status.get("lostSteps"),
        "recovery_seconds_operator": failure.get("recoverySeconds"),
        "recovery_seconds_observed": round(timeline.first_resumed_time - timeline.kill_time, 1)
        if timeline.first_resumed_time and timeline.kill_time
        else None,
    }


def run_demo(state_dir: Path) -> int:
    console = Console()
    started_here = read_state(state_dir) is None
    cluster = DevCluster(state_dir).start() if started_here else None
    kubeconfig = Path(read_state(state_dir)["kubeconfig"])  # type: ignore[index]
    try:
        console.print("[bold]devcluster up[/]; installing the operator with Helm ...")
        helm_install_operator(kubeconfig)
        api = config.new_client_from_config(str(kubeconfig))
        custom = client.CustomObjectsApi(api)
        manifest = yaml.safe_load(DEMO_MANIFEST.read_text())
        name = manifest["metadata"]["name"]
        os.environ.update(_gcs_env(state_dir))
        gcs = make_client()
        run_dir = f"gs://{BUCKET}/runs/{NAMESPACE}/{name}"
        _delete_previous(custom, gcs, name, run_dir)
        custom.create_namespaced_custom_object("tpujob.dev", "v1alpha1", NAMESPACE, "trainingjobs", manifest)
        timeline = Timeline()
        start = time.monotonic()
        tj: Any = {}
        with Live(console=console, refresh_per_second=4) as live:
            while time.monotonic() - start < DEMO_TIMEOUT_S:
                tj = custom.get_namespaced_custom_object("tpujob.dev", "v1alpha1", NAMESPACE, "trainingjobs", name)
                status = tj.get("status") or {}
                timeline.saw_commit(latest_committed_step(gcs, run_dir))
                live.update(view(tj, timeline, time.monotonic() - start))
                if status.get("phase") in ("Succeeded", "Failed"):
                    break
                committed = timeline.committed_steps[-1][1] if timeline.committed_steps else None
                if timeline.kill_time is None and committed is not None and status.get("phase") == "Running":
                    timeline.committed_at_kill, timeline.step_at_kill = committed, status.get("step")
                    timeline.killed_pod = kill_one_slice_worker(client.CoreV1Api(api), state_dir, status["jobSetName"])
                    timeline.kill_time = time.monotonic()
                if timeline.kill_time and not timeline.first_resumed_time:
                    progress = read_progress(gcs, run_dir)  # the trainer's own record, not the status
                    if progress and progress.attempt >= 1 and progress.step > (progress.resumed_from_step or 0):
                        timeline.first_resumed_time = time.monotonic()
                time.sleep(0.3)
        result = report(tj, timeline)
        console.print_json(data=result)
        ok = result["phase"] == "Succeeded" and result["restarts"] == 1
        console.print("[bold green]demo passed[/]" if ok else "[bold red]demo failed[/]")
        return 0 if ok else 1
    finally:
        if cluster is not None:
            cluster.stop()


def _delete_previous(custom: client.CustomObjectsApi, gcs: Any, name: str, run_dir: str) -> None:
    """A rerun starts from scratch: an earlier demo's job and its checkpoints are removed first."""
    try:
        custom.delete_namespaced_custom_object("tpujob.dev", "v1alpha1", NAMESPACE, "trainingjobs", name)
        time.sleep(3)  # let the garbage collector take the old JobSet and the pod runner its processes
    except client.exceptions.ApiException as error:
        if error.status != 404:
            raise
    bucket_name, prefix = split_gs_path(run_dir)
    for blob in gcs.list_blobs(bucket_name, prefix=prefix + "/"):
        blob.delete()


def _gcs_env(state_dir: Path) -> dict[str, str]:
    endpoint = read_state(state_dir)["gcs"]  # type: ignore[index]
    return {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "tpujob-demo"}
