"""Whose failure it was, by the nodes under the attempt's pods (nodes.py), and what the reconciler
makes of it. Node bodies are written as the apiserver returns them (what kubelet, the node lifecycle
controller, the cluster autoscaler and GKE write)."""

import dataclasses
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from tpujob_operator.facts import JobSetFacts, Observed, PodFacts
from tpujob_operator.nodes import (
    ACTIVE_MAINTENANCE_LABEL,
    AUTOSCALER_DRAIN_TAINT,
    IMPENDING_TERMINATION_TAINT,
    NODE_FAILURE_WINDOW_SECONDS,
    NODE_GONE_DISRUPTION,
    NODE_VERDICT_WAIT_SECONDS,
    NOT_READY_TAINT,
    OUT_OF_SERVICE_TAINT,
    UNREACHABLE_TAINT,
    awaited_nodes,
    infrastructure_evidence,
    node_facts,
    node_signals,
    pods_on_gone_nodes,
    slim_node,
    verdict_wait,
)
from tpujob_operator.reconcile import reconcile
from tpujob_operator.restarts import classify_jobset_failure
from tpujob_operator.status import rfc3339

from .factories import progress_record, training_job

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
UID = "0000-1111"
SECOND = timedelta(seconds=1)
WINDOW = timedelta(seconds=NODE_FAILURE_WINDOW_SECONDS)


def _node(
    name: str = "gke-tpu-a",
    ready: str = "True",
    since: datetime = T0 - timedelta(hours=1),
    reason: str = "KubeletReady",
    taints: list[dict[str, Any]] | None = None,
    unschedulable: bool = False,
    labels: dict[str, str] | None = None,
    deleting: datetime | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "resourceVersion": "7", "labels": {"kubernetes.io/hostname": name}}
    meta["labels"].update(labels or {})
    if deleting is not None:
        meta["deletionTimestamp"] = rfc3339(deleting)
    spec: dict[str, Any] = {"podCIDR": "10.0.0.0/24", "taints": taints or []}
    if unschedulable:
        spec["unschedulable"] = True
    conditions = [
        {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
        {
            "type": "Ready",
            "status": ready,
            "reason": reason,
            "message": "kubelet is posting ready status" if ready == "True" else "Kubelet stopped posting node status.",
            "lastHeartbeatTime": rfc3339(since),
            "lastTransitionTime": rfc3339(since),
        },
    ]
    status = {"conditions": conditions, "images": [{"names": ["x"], "sizeBytes": 1}], "capacity": {"cpu": "240"}}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec, "status": status}


def _taint(key: str, effect: str = "NoExecute", added: datetime | None = None) -> dict[str, Any]:
    taint = {"key": key, "effect": effect}
    return taint | ({"timeAdded": rfc3339(added)} if added else {})


def _reasons(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(s.kind, s.reason) for s in node_signals(node_facts(body))]


# -- verdicts of one node ---------------------------------------------------------------------------


def test_a_healthy_node_shows_no_signal():
    assert _reasons(_node()) == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_node(ready="False", reason="KubeletNotReady", since=T0), [("NodeLost", "NodeNotReady")]),
        (
            _node(ready="Unknown", reason="NodeStatusUnknown", since=T0, taints=[_taint(UNREACHABLE_TAINT, added=T0)]),
            [("NodeLost", "NodeUnreachable"), ("NodeLost", "NodeUnreachable")],
        ),
        (_node(taints=[_taint(NOT_READY_TAINT, added=T0)]), [("NodeLost", "NodeNotReady")]),
        (_node(taints=[_taint(OUT_OF_SERVICE_TAINT, added=T0)]), [("NodeLost", "NodeOutOfService")]),
        (_node(deleting=T0), [("NodeLost", "NodeDeleting")]),
        (_node(taints=[_taint(IMPENDING_TERMINATION_TAINT, "NoSchedule")]), [("Preemption", "NodeTerminating")]),
        (
            _node(unschedulable=True, taints=[_taint(AUTOSCALER_DRAIN_TAINT, "NoSchedule")]),
            [("Preemption", "NodeDrained")],
        ),
        (_node(labels={ACTIVE_MAINTENANCE_LABEL: "ONGOING"}), [("Preemption", "NodeMaintenance")]),
    ],
    ids=[
        "not-ready",
        "unreachable",
        "not-ready-taint",
        "out-of-service",
        "deleting",
        "gke-termination",
        "autoscaler-drain",
        "gke-maintenance",
    ],
)
def test_each_node_signal_is_recognised(body, expected):
    assert _reasons(body) == expected


@pytest.mark.parametrize(
    "body",
    [
        # A cordon alone stops new placements; running pods keep running.
        _node(unschedulable=True, taints=[_taint("node.kubernetes.io/unschedulable", "NoSchedule")]),
        # The autoscaler's drain taint without the cordon: a candidate, not a drain.
        _node(taints=[_taint(AUTOSCALER_DRAIN_TAINT, "NoSchedule")]),
        # An upcoming maintenance: nothing happened yet.
        _node(labels={"cloud.google.com/scheduled-maintenance-time": "1795000000"}),
        # A user's own taint.
        _node(taints=[_taint("google.com/tpu", "NoSchedule")]),
        # The NoSchedule twin of not-ready on a Ready node: it lags the condition (a node just registered).
        _node(taints=[_taint(NOT_READY_TAINT, "NoSchedule")]),
    ],
    ids=["cordon-alone", "drain-taint-uncordoned", "scheduled-maintenance", "tpu-taint", "not-ready-no-schedule"],
)
def test_what_does_not_kill_pods_is_not_a_signal(body):
    assert _reasons(body) == []


def test_a_node_that_is_gone_is_lost():
    assert [(s.kind, s.reason) for s in node_signals(None)] == [("NodeLost", "NodeGone")]


def test_the_slimmed_node_decides_as_the_whole_one():
    bodies = [
        _node(ready="Unknown", since=T0, taints=[_taint(UNREACHABLE_TAINT, added=T0)], unschedulable=True),
        _node(labels={ACTIVE_MAINTENANCE_LABEL: "ONGOING"}, deleting=T0),
    ]
    for body in bodies:
        slim = slim_node(body)
        assert node_facts(slim) == node_facts(body)
        assert "images" not in slim["status"] and "kubernetes.io/hostname" not in slim["metadata"].get("labels", {})


# -- evidence for a failure -------------------------------------------------------------------------


def _pod(name: str, node: str | None, phase: str = "Running", exit_code: int | None = None, at=T0, slice_=0):
    finished = at if phase == "Failed" else None
    return PodFacts(name, slice_, phase, exit_code=exit_code, reason="Error" if exit_code else None,
                    finished_at=finished, created=T0 - timedelta(hours=2), scheduled_at=T0 - timedelta(hours=2),
                    node=node)  # fmt: skip


def _facts(*bodies: dict[str, Any]):
    return {b["metadata"]["name"]: node_facts(b) for b in bodies}


def test_a_pod_on_a_node_that_went_not_ready_within_the_window_is_evidence():
    nodes = _facts(_node("a"), _node("b", ready="Unknown", since=T0 + 40 * SECOND))
    pods = [_pod("w0", "a", "Failed", 1), _pod("w1", "b")]
    found = infrastructure_evidence(pods, nodes, first_failure=T0, now=T0 + 45 * SECOND)
    assert found is not None
    assert (found.kind, found.reason, found.node, found.pod, found.since) == (
        "NodeLost", "NodeUnreachable", "b", "w1", T0 + 40 * SECOND
    )  # fmt: skip


def test_a_signal_begun_after_the_window_is_not_evidence():
    nodes = _facts(_node("b", ready="False", since=T0 + WINDOW + SECOND))
    assert infrastructure_evidence([_pod("w1", "b")], nodes, T0, now=T0 + 2 * WINDOW) is None


def test_a_signal_still_present_since_before_the_failure_is_evidence():
    nodes = _facts(_node("b", ready="False", since=T0 - 10 * WINDOW))
    assert infrastructure_evidence([_pod("w1", "b")], nodes, T0, now=T0 + SECOND) is not None


def test_an_undated_signal_counts_only_when_seen_within_the_window():
    nodes: dict[str, Any] = {}  # the node is gone: nothing dates it
    pods = [_pod("w1", "b")]
    seen = infrastructure_evidence(pods, nodes, T0, now=T0 + 10 * SECOND)
    assert seen is not None and (seen.reason, seen.since) == ("NodeGone", T0 + 10 * SECOND)
    assert infrastructure_evidence(pods, nodes, T0, now=T0 + WINDOW + SECOND) is None


def test_unbound_pods_and_healthy_nodes_are_no_evidence():
    nodes = _facts(_node("a"))
    assert infrastructure_evidence([_pod("w0", "a", "Failed", 1), _pod("w1", None, "Pending")], nodes, T0, T0) is None


def test_the_earliest_signal_is_the_evidence():
    nodes = _facts(_node("a", ready="False", since=T0 + 20 * SECOND), _node("b", deleting=T0 + 5 * SECOND))
    found = infrastructure_evidence([_pod("w0", "a"), _pod("w1", "b")], nodes, T0, T0 + 30 * SECOND)
    assert found is not None and (found.node, found.reason) == ("b", "NodeDeleting")


def test_a_decision_waits_while_a_bound_pod_still_runs_at_most_the_window():
    nodes = _facts(_node("a"), _node("b"))
    running = [_pod("w0", "a", "Failed", 1), _pod("w1", "b")]
    assert verdict_wait(running, nodes, T0, T0 + SECOND) == 2.0
    assert verdict_wait(running, nodes, T0, T0 + timedelta(seconds=NODE_VERDICT_WAIT_SECONDS - 1)) == pytest.approx(1)
    assert verdict_wait(running, nodes, T0, T0 + timedelta(seconds=NODE_VERDICT_WAIT_SECONDS)) is None
    ended = [_pod("w0", "a", "Failed", 1), _pod("w1", "b", "Failed", 1)]
    assert verdict_wait(ended, nodes, T0, T0 + SECOND) is None
    assert verdict_wait([_pod("w0", "a", "Failed", 1), _pod("w1", None, "Pending")], nodes, T0, T0 + SECOND) is None


def test_a_running_pods_node_whose_kubelet_renewed_its_lease_after_the_failure_is_not_waited_for():
    pods = [_pod("w0", "a", "Failed", 1), _pod("w1", "b"), _pod("w2", "c")]
    alive = replace(node_facts(_node("b")), renewed=T0 + 3 * SECOND)
    before = replace(node_facts(_node("c")), renewed=T0 - SECOND)  # its last renewal predates the failure
    nodes = {"a": node_facts(_node("a")), "b": alive, "c": before}
    assert verdict_wait(pods, nodes, T0, T0 + 4 * SECOND) == 2.0  # c may be the dead host
    nodes["c"] = replace(before, renewed=T0 + 9 * SECOND)
    assert verdict_wait(pods, nodes, T0, T0 + 10 * SECOND) is None


def test_only_the_nodes_of_pods_running_beside_a_failed_one_are_awaited():
    assert awaited_nodes([_pod("w0", "a"), _pod("w1", "b")]) == set()
    assert awaited_nodes([_pod("w0", "a", "Failed", 1), _pod("w1", "b"), _pod("w2", None, "Pending")]) == {"b"}


# -- the classification and the reconciler: the dead host of a multi-host slice ---------------------

# Slice 1's host 1 died: its pod still shows Running (its kubelet can report nothing) while its peers,
# on healthy hosts, exited 1 on collective errors, the first 3 s after the host died. The node
# lifecycle controller marked its node Unknown 40 s after its last heartbeat.
DEAD_AT = T0 - 3 * SECOND
NODES = (
    _node("gke-tpu-s0-h0"),
    _node("gke-tpu-s0-h1"),
    _node("gke-tpu-s1-h0"),
    _node(
        "gke-tpu-s1-h1",
        ready="Unknown",
        reason="NodeStatusUnknown",
        since=DEAD_AT + 40 * SECOND,
        taints=[_taint(UNREACHABLE_TAINT, added=DEAD_AT + 41 * SECOND)],
    ),
)


def _dead_host_pods():
    return (
        _pod("llama-a0-slice-0-0", "gke-tpu-s0-h0", "Failed", 1, at=T0, slice_=0),
        _pod("llama-a0-slice-0-1", "gke-tpu-s0-h1", "Failed", 1, at=T0 + SECOND, slice_=0),
        _pod("llama-a0-slice-1-0", "gke-tpu-s1-h0", "Failed", 1, at=T0 + 2 * SECOND, slice_=1),
        _pod("llama-a0-slice-1-1", "gke-tpu-s1-h1", "Running", slice_=1),
    )


def _jobset(pods, state="Active"):
    return JobSetFacts("llama-a0", 0, None, T0 - timedelta(hours=2), state, pods=pods, uid=UID, expected_pods=4)


def _running_job(**spec):
    status = {"phase": "Running", "attempt": 0, "step": 50, "lastProgressTime": rfc3339(T0), "stage": "Training",
              "startTime": rfc3339(T0 - timedelta(hours=2))}  # fmt: skip
    return training_job(status=status, restart={"backoffSeconds": 30, "maxRestarts": 1}, **spec)


def test_without_the_nodes_the_first_failed_peer_blames_the_application():
    failure = classify_jobset_failure(_jobset(_dead_host_pods()))
    assert (failure.kind, failure.slice) == ("ApplicationError", 0)


def test_the_dead_hosts_node_makes_the_peers_failure_node_lost():
    nodes = {b["metadata"]["name"]: node_facts(b) for b in NODES}
    failure = classify_jobset_failure(_jobset(_dead_host_pods()), nodes, now=T0 + 45 * SECOND)
    assert (failure.kind, failure.reason, failure.slice, failure.time) == ("NodeLost", "NodeUnreachable", 1, T0)
    assert failure.evidence is not None and failure.evidence.node == "gke-tpu-s1-h1"
    assert "gke-tpu-s1-h1" in failure.message and "llama-a0-slice-0-0" in failure.message


def _observed(now, nodes=NODES, pods=None, state="Active"):
    jobset = _jobset(_dead_host_pods() if pods is None else pods, state)
    return Observed(now=now, jobsets=(jobset,), latest_committed_step=40,
                    nodes={b["metadata"]["name"]: node_facts(b) for b in nodes})  # fmt: skip


def test_a_dead_host_is_node_lost_not_counted_with_its_evidence_in_status():
    tj = _running_job()
    status, actions = reconcile(tj, _observed(T0 + 45 * SECOND))
    failure = status.last_failure
    assert failure is not None
    assert (failure.kind, failure.reason, failure.counted, failure.slice) == ("NodeLost", "NodeUnreachable", False, 1)
    assert (status.counted_restarts, status.restarts, status.attempt) == (0, 1, 1)
    assert failure.evidence is not None
    assert (failure.evidence.node, failure.evidence.pod, failure.evidence.signal, failure.evidence.since) == (
        "gke-tpu-s1-h1", "llama-a0-slice-1-1", "NodeUnreachable", rfc3339(DEAD_AT + 40 * SECOND)
    )  # fmt: skip
    assert "NodeStatusUnknown" in failure.evidence.detail
    assert actions.delete == ["llama-a0"]
    # the uncounted restart backs off the base delay only, and the budget of 1 is untouched
    assert status.next_restart_time == rfc3339(T0 + 45 * SECOND + 30 * SECOND)


def test_before_the_node_is_marked_the_decision_waits_then_finds_it():
    tj = _running_job()
    healthy = (*NODES[:3], _node("gke-tpu-s1-h1"))  # 5 s after the peers failed: not NotReady yet
    status, actions = reconcile(tj, _observed(T0 + 5 * SECOND, nodes=healthy))
    assert status.last_failure is None and status.attempt == 0 and actions.delete == []
    assert actions.requeue_after is not None and 0 < actions.requeue_after <= 5
    status, actions = reconcile(tj, _observed(T0 + 45 * SECOND))  # marked Unknown meanwhile
    assert status.last_failure is not None and status.last_failure.kind == "NodeLost"
    assert not status.last_failure.counted


def test_an_application_error_with_healthy_nodes_still_counts_once_the_wait_is_over():
    tj = _running_job()
    healthy = (*NODES[:3], _node("gke-tpu-s1-h1"))
    status, _ = reconcile(tj, _observed(T0 + timedelta(seconds=NODE_VERDICT_WAIT_SECONDS + 1), nodes=healthy))
    failure = status.last_failure
    assert failure is not None and (failure.kind, failure.counted, failure.evidence) == ("ApplicationError", True, None)
    assert status.counted_restarts == 1


def test_an_application_error_is_decided_once_the_running_pods_kubelets_were_heard_from():
    tj = _running_job()
    healthy = (*NODES[:3], _node("gke-tpu-s1-h1"))
    observed = _observed(T0 + 11 * SECOND, nodes=healthy)
    renewed = {n: replace(f, renewed=T0 + 10 * SECOND) for n, f in (observed.nodes or {}).items()}
    status, _ = reconcile(tj, replace(observed, nodes=renewed))
    failure = status.last_failure
    assert failure is not None and (failure.kind, failure.counted) == ("ApplicationError", True)


def test_when_every_pod_ended_an_application_error_is_decided_at_once():
    tj = _running_job()
    pods = (*_dead_host_pods()[:3], _pod("llama-a0-slice-1-1", "gke-tpu-s1-h1", "Failed", 1, at=T0, slice_=1))
    healthy = (*NODES[:3], _node("gke-tpu-s1-h1"))
    status, _ = reconcile(tj, _observed(T0 + SECOND, nodes=healthy, pods=pods))
    assert status.last_failure is not None and status.last_failure.kind == "ApplicationError"


def test_a_restarted_operator_decides_the_same_from_status_and_the_apiservers_objects():
    """An operator restart: no memory, only the TrainingJob (its status) and the objects the apiserver
    holds. Before the decision: the dead host's pod and its node are still there (the pod of an
    unreachable node is never confirmed deleted), so the new operator finds the same evidence. After
    it: the recorded decision stands, never re-classified (the next attempt is the current one)."""
    tj = _running_job()
    decided, _ = reconcile(tj, _observed(T0 + 45 * SECOND))
    # The operator died before its decision: a new one, 2 minutes later, with the same objects.
    again, _ = reconcile(tj, _observed(T0 + 165 * SECOND))
    assert again.last_failure is not None and decided.last_failure is not None
    assert again.last_failure.model_copy(update={"timeline": None}) == decided.last_failure.model_copy(
        update={"timeline": None}
    )
    # The operator died after writing its decision, before deleting the failed JobSet: the new one reads
    # the written status and the failed JobSet, deletes it, and keeps the record as it was written.
    written = training_job(status=decided.model_dump(by_alias=True, exclude_none=True, mode="json"),
                           restart={"backoffSeconds": 30, "maxRestarts": 1})  # fmt: skip
    later = T0 + 50 * SECOND
    status, actions = reconcile(written, _observed(later, state="Failed"))
    assert actions.delete == ["llama-a0"]
    assert status.last_failure == decided.last_failure and status.counted_restarts == 0


# -- a pod on a node that is gone -------------------------------------------------------------------


def _on_a_gone_node(phase: str = "Running", disruption: str | None = None) -> tuple[PodFacts, ...]:
    """Slice 1's second host's VM was deleted with its Node: its pod still says Running (no kubelet
    reports it) and its peers still train."""
    lost = replace(_pod("llama-a0-slice-1-1", "gke-tpu-s1-h1", phase, slice_=1), disruption_reason=disruption)
    return (*(_pod(f"llama-a0-slice-{s}-{h}", f"gke-tpu-s{s}-h{h}", slice_=s) for s, h in ((0, 0), (0, 1), (1, 0))),
            lost)  # fmt: skip


def test_only_pods_still_running_on_a_node_that_is_gone_are_to_fail():
    pods = (
        *_on_a_gone_node(),
        _pod("ended", "gone-too", "Failed", 1),
        _pod("done", "gone-too", "Succeeded"),
        _pod("unbound", None, "Pending"),
    )
    assert pods_on_gone_nodes(pods, _facts(*NODES[:3])) == [("llama-a0-slice-1-1", "gke-tpu-s1-h1")]
    assert pods_on_gone_nodes(pods, None) == []  # no node watch: nothing can be said


def test_a_training_job_whose_node_vanished_marks_that_pod_failed_and_decides_nothing_yet():
    healthy = NODES[:3]  # gke-tpu-s1-h1 is gone
    observed = replace(
        _observed(T0, nodes=healthy, pods=_on_a_gone_node()),
        progress=progress_record(uid=UID, step=50, attempt=0, updated_at=T0),
    )
    status, actions = reconcile(_running_job(), observed)
    assert actions.fail_on_gone_nodes == [("llama-a0-slice-1-1", "gke-tpu-s1-h1")]
    assert status.last_failure is None and actions.delete == [] and actions.create_attempt is None


def test_the_pod_marked_failed_for_its_gone_node_is_node_lost_and_not_counted():
    pods = _on_a_gone_node("Failed", NODE_GONE_DISRUPTION)
    status, actions = reconcile(_running_job(), _observed(T0 + SECOND, nodes=NODES[:3], pods=pods))
    failure = status.last_failure
    assert failure is not None and (failure.kind, failure.counted, failure.slice) == ("NodeLost", False, 1)
    assert status.counted_restarts == 0 and actions.delete == ["llama-a0"] and actions.fail_on_gone_nodes == []


def test_a_pod_on_a_gone_node_is_failed_while_storage_cannot_be_read_but_not_under_a_suspension():
    """Marking needs no storage (the failure that follows is decided as any with storage unknown); a
    JobSet someone else suspended is stopping its pods itself, and its pods' end is not a failure."""
    unreadable = replace(_observed(T0, nodes=NODES[:3], pods=_on_a_gone_node()), storage_error="GCS timed out")
    _, actions = reconcile(_running_job(), unreadable)
    assert actions.fail_on_gone_nodes == [("llama-a0-slice-1-1", "gke-tpu-s1-h1")]
    suspended = _observed(T0, nodes=NODES[:3], pods=_on_a_gone_node(), state="Suspended")
    _, actions = reconcile(_running_job(), suspended)
    assert actions.fail_on_gone_nodes == [] and actions.remove_from_gone_nodes == []


def test_a_silence_while_a_node_under_the_job_is_unreachable_is_the_infrastructures_not_a_counted_hang():
    """A node cut off from the network cuts its trainer off from storage too: the record goes silent.
    The hang clock's expiry is then the node's failure (not counted); with every node healthy it stays
    the job's Hang (counted)."""
    tj = training_job(
        restart={"hangTimeoutSeconds": 60}, status={"phase": "Running", "attempt": 0, "lastProgressTime": rfc3339(T0)}
    )
    progress = progress_record(uid=tj.metadata["uid"], step=50, attempt=0, updated_at=T0)
    pods = (_pod("llama-a0-slice-0-0", "a"), _pod("llama-a0-slice-1-0", "b", slice_=1))
    jobset = JobSetFacts("llama-a0", 0, None, T0 - timedelta(hours=2), "Active", pods=pods, uid=tj.metadata["uid"])
    now = T0 + 61 * SECOND

    def decided(*nodes: dict[str, Any]):
        observed = Observed(now=now, jobsets=(jobset,), progress=progress, nodes=_facts(*nodes))
        return reconcile(tj, observed)[0]

    cut_off = decided(_node("a"), _node("b", ready="Unknown", since=T0 + 20 * SECOND))
    assert (cut_off.last_failure.kind, cut_off.last_failure.reason) == ("NodeLost", "NodeUnreachable")
    assert not cut_off.last_failure.counted and cut_off.counted_restarts == 0
    healthy = decided(_node("a"), _node("b"))
    assert (healthy.last_failure.kind, healthy.last_failure.counted, healthy.counted_restarts) == ("Hang", True, 1)


def test_a_silence_of_trainers_left_on_unreachable_nodes_by_a_resume_is_the_infrastructures_not_a_counted_hang():
    """Kueue preempted the JobSet while its nodes were cut off: its pods could not end and their trainers
    trained on, and it was admitted again (the new pods wait for the old ones to go). The old pods are
    from before the resume, yet their nodes still explain the silence."""
    tj = training_job(
        restart={"hangTimeoutSeconds": 60}, status={"phase": "Running", "attempt": 0, "lastProgressTime": rfc3339(T0)}
    )
    progress = progress_record(uid=tj.metadata["uid"], step=50, attempt=0, updated_at=T0)
    stuck = (_pod("llama-a0-slice-0-0", "a"), _pod("llama-a0-slice-1-0", "b", slice_=1))
    jobset = dataclasses.replace(
        JobSetFacts("llama-a0", 0, None, T0 - timedelta(hours=2), "Active", pods=stuck, uid=tj.metadata["uid"]),
        resumed_at=T0 - timedelta(seconds=30), queue_name="team-a",
    )  # fmt: skip
    unreachable = (
        _node("a", ready="Unknown", since=T0 + 20 * SECOND),
        _node("b", ready="Unknown", since=T0 + 20 * SECOND),
    )
    observed = Observed(now=T0 + 61 * SECOND, jobsets=(jobset,), progress=progress, nodes=_facts(*unreachable))
    failure = reconcile(tj, observed)[0].last_failure
    assert (failure.kind, failure.reason, failure.counted) == ("NodeLost", "NodeUnreachable", False)
