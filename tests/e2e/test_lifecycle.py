"""Scheduling and deletion on the devcluster."""

from __future__ import annotations

from typing import Any

from .conftest import PACED


def test_job_without_a_matching_node_pool_stays_pending_and_says_why(e2e):
    e2e.apply("nopool", 10, accelerator="tpu-v6e-slice", topology="4x4", slices=1)
    status = e2e.wait(
        "nopool",
        lambda s: any(c["type"] == "Pending" and c["reason"] == "Unschedulable" for c in s.get("conditions", [])),
        120, "an Unschedulable condition",
    )  # fmt: skip
    pending = next(c for c in status["conditions"] if c["type"] == "Pending")
    assert status["phase"] == "Pending" and "node" in pending["message"]


def test_deleting_a_running_job_removes_jobset_pods_and_processes_but_keeps_checkpoints(e2e):
    e2e.apply(  # still training when deleted: at least 50 s of steps
        "doomed", 1000, accelerator="tpu-v5-lite-podslice", topology="2x2", slices=1, min_step_seconds=PACED
    )
    e2e.wait("doomed", lambda s: s.get("latestCheckpoint") and s.get("phase") == "Running", 300, "a checkpoint")
    pod = e2e.running_pod("doomed-a0-slice-0-0")
    pids = e2e.trainer_pids(pod)
    assert pids
    e2e.custom.delete_namespaced_custom_object("tpujob.dev", "v1alpha1", e2e.namespace, "trainingjobs", "doomed")

    def all_gone() -> bool:
        jobsets: Any = e2e.custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", e2e.namespace, "jobsets")
        jobs = e2e.batch.list_namespaced_job(e2e.namespace).items
        alive = [p for p in pids if _running(p)]
        return not jobsets["items"] and not jobs and not e2e.pods() and not alive

    e2e.until(all_gone, 200, "JobSet, Jobs, pods and processes to be gone")
    assert e2e.latest_committed("doomed") is not None  # checkpoints stay


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
