"""TrainingJobs admitted by the real Kueue (issue 10): a job beyond quota waits Queued with no pods
until the running one finishes; a higher-priority job preempts a running one, which saves on
SIGTERM, is not counted as a failure, waits Queued, and resumes from its saved step with nothing lost.

The ClusterQueue holds quota for exactly one 1-host v5e job (4 chips) in this test; every job
here runs on that flavor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from tpujob_devcluster.cluster import BUCKET, DevCluster
from tpujob_devcluster.kueue import HIGH_PRIORITY, LOW_PRIORITY, flavor_name

from .conftest import E2E, PACED, trainer_args

ACCELERATOR, TOPOLOGY = "tpu-v5-lite-podslice", "2x2"
V5E = {"accelerator": ACCELERATOR, "topology": TOPOLOGY, "slices": 1}
QUEUE = "tpu"


@pytest.fixture
def queued(devcluster: DevCluster, e2e: E2E) -> Iterator[E2E]:
    """Quota for one 1-host v5e job, and a LocalQueue in the test's namespace."""
    assert devcluster.kueue is not None
    devcluster.set_kueue_quota({flavor_name(ACCELERATOR, TOPOLOGY): 4})
    devcluster.kueue.add_local_queue(e2e.namespace, QUEUE)
    try:
        yield e2e
    finally:
        devcluster.set_kueue_quota(None)


def _apply_queued(e2e: E2E, name: str, steps: int, priority: str, min_step_seconds: float = 0.0) -> None:
    """Like E2E.apply, with Kueue's labels: the LocalQueue and the WorkloadPriorityClass."""
    labels = {"kueue.x-k8s.io/queue-name": QUEUE, "kueue.x-k8s.io/priority-class": priority}
    manifest: dict[str, Any] = {
        "apiVersion": "tpujob.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "image": "tpujob-trainer:dev",
            "args": trainer_args(steps, min_step_seconds),
            "tpu": V5E,
            "checkpoint": {"directory": f"gs://{BUCKET}/e2e", "policy": "continuous"},
            "restart": {"backoffSeconds": 1, "maxRestarts": 0},
        },
    }
    e2e.custom.create_namespaced_custom_object("tpujob.dev", "v1alpha1", e2e.namespace, "trainingjobs", manifest)


def _queued(status: dict[str, Any]) -> bool:
    queue = status.get("queue") or {}
    return status.get("stage") == "Queued" and queue.get("name") == QUEUE and queue.get("admitted") is False


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _pods_of(e2e: E2E, name: str) -> list[Any]:
    return e2e.pods(f"tpujob.dev/name={name}")


def _live_pods(e2e: E2E, name: str) -> list[Any]:
    return [p for p in _pods_of(e2e, name) if p.status.phase in ("Pending", "Running")]


def test_a_job_beyond_quota_waits_queued_until_the_running_one_finishes(queued: E2E):
    e2e = queued
    _apply_queued(e2e, "first", 400, LOW_PRIORITY)
    first = e2e.wait("first", lambda s: (s.get("queue") or {}).get("admitted") is True, 120, "first admitted")
    _apply_queued(e2e, "second", 200, LOW_PRIORITY)
    waiting = e2e.wait("second", _queued, 60, "second Queued")
    assert waiting["phase"] == "Pending" and waiting.get("restarts", 0) == 0, waiting
    # While the first one runs, the second has no pods at all and nothing is counted.
    while e2e.status("first").get("phase") != "Succeeded":
        status = e2e.status("second")
        assert _queued(status) and status.get("restarts", 0) == 0, status
        assert not _pods_of(e2e, "second"), [p.metadata.name for p in _pods_of(e2e, "second")]
        assert e2e.status("first").get("phase") != "Failed", e2e.status("first")
        time.sleep(1)
    first = e2e.status("first")
    second = e2e.wait("second", lambda s: s.get("phase") == "Succeeded", 240, "second Succeeded")
    assert (second["restarts"], second["countedRestarts"], second.get("lastFailure")) == (0, 0, None), second
    assert _time(second["queue"]["admissionTime"]) >= _time(first["completionTime"]).replace(microsecond=0)
    assert second["goodput"]["badput"]["queuedSeconds"] > 0, second["goodput"]
    reasons = {reason for reason, _ in e2e.event_records("second")}
    assert "Queued" in reasons and "FailureDetected" not in reasons, reasons


def test_a_higher_priority_job_preempts_without_costing_the_low_one_a_step(queued: E2E):
    e2e = queued
    _apply_queued(e2e, "low", 1000, LOW_PRIORITY, min_step_seconds=PACED)  # 40 s of steps after the 150th
    e2e.wait("low", lambda s: s.get("phase") == "Running" and (s.get("step") or 0) >= 150, 180, "low training")
    e2e.until(lambda: (e2e.latest_committed("low") or 0) > 0, 60, "a committed step of low")
    _apply_queued(e2e, "high", 200, HIGH_PRIORITY)
    preempted = e2e.wait("low", _queued, 120, "low preempted and Queued")
    assert (preempted.get("restarts", 0), preempted.get("countedRestarts", 0)) == (0, 0), preempted
    assert preempted.get("lastFailure") is None, preempted
    # The workers saved the step they had reached on SIGTERM before they exited.
    e2e.until(lambda: not _live_pods(e2e, "low"), 150, "low's workers stopped")
    record = e2e.progress("low")
    assert record is not None and record.state == "preempted", record
    saved = e2e.latest_committed("low")
    assert saved == record.step, (saved, record)

    high = e2e.wait("high", lambda s: s.get("phase") == "Succeeded", 240, "high Succeeded")
    assert high["restarts"] == 0, high
    low = e2e.wait("low", lambda s: s.get("phase") == "Succeeded", 300, "low Succeeded")
    assert (low["restarts"], low["countedRestarts"], low.get("lostSteps", 0), low.get("lastFailure")) == (
        0, 0, 0, None), low  # fmt: skip
    assert low["resumedFromStep"] == saved, (low["resumedFromStep"], saved)
    assert low["attempt"] == 0, low  # the same JobSet resumed when Kueue re-admitted it
    assert low["goodput"]["badput"]["queuedSeconds"] > 0, low["goodput"]
    reasons = {reason for reason, _ in e2e.event_records("low")}
    assert "Preempted" in reasons and "FailureDetected" not in reasons, reasons
