"""Failure kinds on 1-host slices (v5e 2x2): what the operator concludes and does for each. The five
jobs run side by side, each in its own namespace (the devcluster has seven v5e pools: one each, and
spares for the restarts)."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from kubernetes import client
from tpujob_devcluster.harness import lose_node

from .conftest import E2E, PACED, Scenarios, run_side_by_side

V5E: dict[str, Any] = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 1}
STEPS = 600


def _training(e2e: E2E, name: str) -> str:
    # Jobs run long enough (STEPS, paced: 30 s at least) that the pod is still running when the test acts on it.
    e2e.wait(name, lambda s: s.get("phase") == "Running" and (s.get("step") or 0) > 0, 300, "training")
    return e2e.running_pod(f"{name}-a0-slice-0-0")


def process_exiting_non_zero_spends_the_budget_then_fails(e2e: E2E) -> None:
    e2e.apply("badcfg", 10, extra_args=["--model", "no-such-model"], restart={"maxRestarts": 1}, **V5E)
    status = e2e.wait("badcfg", lambda s: s.get("phase") == "Failed", 240, "phase Failed")
    assert status["restarts"] == 1 and status["countedRestarts"] == 1
    assert (status["lastFailure"]["kind"], status["lastFailure"]["reason"]) == ("ApplicationError", "ExitCode2")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "RestartBudgetExhausted" and "1/1" in failed["message"]
    # A Failed job holds nothing 60 s later (docs/concepts/invariants.md, promise 6): no JobSet, no pod
    # Running or Pending. Polled up to twice that: the pod runner of a loaded machine is slow to end pods.
    deadline = time.monotonic() + 2 * RELEASE_SECONDS
    while held := _held(e2e, "badcfg"):
        assert time.monotonic() < deadline, f"a Failed job still holds {held}"
        time.sleep(1)


RELEASE_SECONDS = 60


def _held(e2e: E2E, name: str) -> list[str]:
    jobsets = [js["metadata"]["name"] for js in e2e.jobsets() if js["metadata"]["name"].startswith(f"{name}-a")]
    pods = [p.metadata.name for p in e2e.pods(f"tpujob.dev/name={name}") if p.status.phase in ("Running", "Pending")]
    return jobsets + pods


def killed_process_is_restarted_and_counted(e2e: E2E) -> None:
    e2e.apply("killed", STEPS, min_step_seconds=PACED, **V5E)
    e2e.signal_pod(_training(e2e, "killed"), signal.SIGKILL)
    status = e2e.wait("killed", lambda s: s.get("phase") == "Succeeded", 300, "Succeeded")
    assert (status["restarts"], status["countedRestarts"]) == (1, 1)
    assert status["lastFailure"]["reason"] == "ExitCode137"


def preemption_checkpoints_the_current_step_and_is_not_counted(e2e: E2E) -> None:
    e2e.apply("preempted", STEPS, restart={"maxRestarts": 0}, min_step_seconds=PACED, **V5E)
    pod = _training(e2e, "preempted")
    # Eviction is how GKE drains a node for maintenance: DisruptionTarget, then SIGTERM with grace.
    e2e.core.create_namespaced_pod_eviction(
        pod, e2e.namespace, client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=e2e.namespace))
    )
    status = e2e.wait("preempted", lambda s: s.get("phase") == "Succeeded", 300, "Succeeded")
    failure = status["lastFailure"]
    assert failure["kind"] == "Preemption" and failure["counted"] is False
    assert status["countedRestarts"] == 0 and status["restarts"] == 1
    # The SIGTERM save covered the step it was at: nothing reported before it was lost.
    assert failure["resumeStep"] >= failure["step"] and failure["lostSteps"] == 0


def lost_node_is_restarted_on_another_pool(e2e: E2E) -> None:
    e2e.apply("nodelost", STEPS, min_step_seconds=PACED, **V5E)
    node = lose_node(e2e.core, e2e.namespace, _training(e2e, "nodelost"))
    try:
        status = e2e.wait("nodelost", lambda s: s.get("phase") == "Succeeded", 360, "Succeeded")
        assert status["restarts"] == 1
        assert status["lastFailure"]["kind"] == "NodeLost", status["lastFailure"]
    finally:
        node.restore(e2e.core)


def hung_process_is_restarted_after_the_hang_timeout(e2e: E2E) -> None:
    e2e.apply("hung", STEPS, restart={"hangTimeoutSeconds": 45}, min_step_seconds=PACED, **V5E)
    pod = _training(e2e, "hung")
    stopped_at = time.monotonic()
    e2e.signal_pod(pod, signal.SIGSTOP)  # alive, no progress
    status = e2e.wait("hung", lambda s: s.get("attempt") == 1, 180, "the hang restart")
    assert status["lastFailure"]["kind"] == "Hang" and status["lastFailure"]["counted"] is True
    assert time.monotonic() - stopped_at >= 40
    status = e2e.wait("hung", lambda s: s.get("phase") == "Succeeded", 300, "Succeeded")
    assert status["restarts"] == 1


SCENARIOS: Scenarios = {
    "exit-code": (process_exiting_non_zero_spends_the_budget_then_fails, "badcfg"),
    "killed": (killed_process_is_restarted_and_counted, "killed"),
    "preempted": (preemption_checkpoints_the_current_step_and_is_not_counted, "preempted"),
    "node-lost": (lost_node_is_restarted_on_another_pool, "nodelost"),
    "hung": (hung_process_is_restarted_after_the_hang_timeout, "hung"),
}


@pytest.mark.timeout(600)
def test_failure_kinds_side_by_side(devcluster, capsys):
    """Each failure kind in its own namespace and thread; every failure is reported, not only the first."""
    run_side_by_side(devcluster, SCENARIOS, "fk", 540, capsys)
