"""Whose failure it was, told by the Nodes: the operator in-process against a real kube-apiserver and
kube-controller-manager, whose node lifecycle controller is the one that marks silent nodes.

No kubelet runs in this tier: Node objects are created and their status written through the API as a
kubelet writes it (a Ready condition with its heartbeat), and worker pods are bound to them and given
the status their kubelet would report (a dead host's kubelet reports nothing: its pod stays Running).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from tpujob_operator.kube import NODE_LEASE_NAMESPACE
from tpujob_operator.nodes import NODE_VERDICT_WAIT_SECONDS

from .conftest import eventually, training_job_manifest
from .test_operator import Cluster, _now


@pytest.fixture
def cluster(kube: client.ApiClient, namespace: str) -> Cluster:
    return Cluster(kube, namespace)


@pytest.fixture
def nodes(cluster: Cluster, unique_name: str, kube: client.ApiClient) -> Iterator[list[str]]:
    """Two TPU hosts' Node objects (and their kubelets' Leases, if any), deleted afterwards."""
    names = [f"{unique_name}-host-0", f"{unique_name}-host-1"]
    yield names
    for name in names:
        with contextlib.suppress(client.ApiException):
            cluster.core.delete_node(name)
        with contextlib.suppress(client.ApiException):
            client.CoordinationV1Api(kube).delete_namespaced_lease(name, NODE_LEASE_NAMESPACE)


def _renew_lease(kube: client.ApiClient, node: str) -> None:
    """What a live kubelet does every 10 s: renew its node's Lease."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease: Any = {
        "metadata": {"name": node},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": now},
    }
    client.CoordinationV1Api(kube).create_namespaced_lease(NODE_LEASE_NAMESPACE, lease)


def _post_node_status(cluster: Cluster, name: str, ready: str, reason: str, message: str) -> None:
    """What a kubelet posts (`ready` True), or one that sees its node fail (`ready` False)."""
    now = _now()
    condition = {
        "type": "Ready",
        "status": ready,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    cluster.core.patch_node_status(name, {"status": {"conditions": [condition]}})


def _create_node(cluster: Cluster, name: str) -> None:
    labels = {"kubernetes.io/hostname": name, "cloud.google.com/gke-nodepool": name.rsplit("-", 1)[0]}
    node: Any = {"metadata": {"name": name, "labels": labels}}  # the client posts a dict as it is
    cluster.core.create_node(node)
    _post_node_status(cluster, name, "True", "KubeletReady", "kubelet is posting ready status")


def _bound_pod(cluster: Cluster, jobset: Any, slice_index: int, node: str, state: dict[str, Any]) -> str:
    """A worker pod of `jobset` bound to `node`, its container in `state` (as its kubelet last reported)."""
    name = f"{jobset['metadata']['name']}-slice-{slice_index}-0"
    template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    pod: Any = {
        "metadata": {
            "name": name,
            "labels": template["metadata"]["labels"],
            "annotations": {"jobset.sigs.k8s.io/job-index": str(slice_index)},
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "trainer", "image": template["spec"]["containers"][0]["image"]}],
        },
    }
    cluster.core.create_namespaced_pod(cluster.namespace, pod)
    phase = "Failed" if "terminated" in state else "Running"
    container = {"name": "trainer", "image": "x", "imageID": "", "ready": phase == "Running", "restartCount": 0}
    status = {"phase": phase, "containerStatuses": [{**container, "state": state}]}
    cluster.core.patch_namespaced_pod_status(name, cluster.namespace, {"status": status})
    return name


def test_a_dead_host_is_node_lost_not_counted_and_a_restarted_operator_keeps_it(
    start_operator, cluster, nodes, unique_name
):
    """Slice 1's host dies while no operator runs (a failover): its pod stays Running on a node that is
    NotReady, while slice 0's worker exits 1 on the collective error. The new operator, with no memory,
    must blame the node, not the job (maxRestarts 0: a counted failure would fail the job), write the
    evidence, and another restart must leave that record as it is."""
    healthy, dead = nodes
    first = start_operator()
    cluster.apply(training_job_manifest(unique_name, restart={"backoffSeconds": 0, "maxRestarts": 0}))
    jobset = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    first.stop()  # the next operator (start_operator) remembers nothing

    for name in nodes:
        _create_node(cluster, name)
    running = {"running": {"startedAt": _now()}}
    dead_pod = _bound_pod(cluster, jobset, 1, dead, running)
    _post_node_status(cluster, dead, "False", "KubeletNotReady", "PLEG is not healthy")
    marked = datetime.now(UTC).replace(microsecond=0)
    exited = {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": _now()}}
    _bound_pod(cluster, jobset, 0, healthy, exited)

    second = start_operator()
    status = eventually(lambda: (s := cluster.status(unique_name)).get("lastFailure") and s, what="failure decided")
    failure = status["lastFailure"]
    assert (failure["kind"], failure["reason"], failure["counted"], failure["slice"]) == (
        "NodeLost",
        "NodeNotReady",
        False,
        1,
    ), failure
    assert status["countedRestarts"] == 0 and status["phase"] != "Failed", status
    evidence = failure["evidence"]
    assert (evidence["node"], evidence["pod"], evidence["signal"]) == (dead, dead_pod, "NodeNotReady")
    assert "KubeletNotReady" in evidence["detail"]
    assert abs((datetime.fromisoformat(evidence["since"]) - marked).total_seconds()) <= 2
    replacement = eventually(lambda: cluster.jobset(f"{unique_name}-a1"), what="JobSet a1, the uncounted restart")
    assert replacement is not None

    # A third operator: the record stands as written (never re-classified), nothing is counted.
    second.stop()
    start_operator()
    time.sleep(5)  # its start-up listing is reconciled in this window
    after = cluster.status(unique_name)
    assert after["lastFailure"]["kind"] == "NodeLost" and after["lastFailure"]["evidence"] == evidence
    assert after["countedRestarts"] == 0 and after["attempt"] == 1 and after["phase"] != "Failed"


def test_an_application_error_beside_a_running_peer_waits_only_until_its_kubelet_is_heard_from(
    operator, cluster, kube, nodes, unique_name
):
    """A worker exits 1 while its peer still runs on a Ready node: that peer's host may be the dead one,
    not yet marked, so the decision waits; the peer's kubelet renewing its Lease after the failure
    shows it alive, and the failure is the job's (counted) at once, not after the whole wait."""
    healthy, alive = nodes
    cluster.apply(training_job_manifest(unique_name, restart={"backoffSeconds": 0, "maxRestarts": 1}))
    jobset = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    for name in nodes:
        _create_node(cluster, name)
    _bound_pod(cluster, jobset, 1, alive, {"running": {"startedAt": _now()}})
    exited = {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": _now()}}
    _bound_pod(cluster, jobset, 0, healthy, exited)
    failed = time.monotonic()
    time.sleep(4)
    early = cluster.status(unique_name)
    assert "lastFailure" not in early, f"decided before the peer's host was heard from: {early['lastFailure']}"
    _renew_lease(kube, alive)
    status = eventually(lambda: (s := cluster.status(unique_name)).get("lastFailure") and s, what="failure decided")
    waited = time.monotonic() - failed
    failure = status["lastFailure"]
    assert (failure["kind"], failure["counted"], status["countedRestarts"]) == ("ApplicationError", True, 1), failure
    assert "evidence" not in failure
    assert waited < NODE_VERDICT_WAIT_SECONDS / 2, waited


@pytest.fixture
def fake_kubelet(kube: client.ApiClient) -> Iterator[Callable[[str], None]]:
    """Keeps renewing the Leases of the nodes it is given (a live kubelet's heartbeat, every 2 s here)."""
    stop = threading.Event()
    alive: list[str] = []

    def beat() -> None:
        leases = client.CoordinationV1Api(kube)
        while not stop.wait(2.0):
            for node in list(alive):
                now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                with contextlib.suppress(client.ApiException):
                    leases.patch_namespaced_lease(node, NODE_LEASE_NAMESPACE, {"spec": {"renewTime": now}})

    thread = threading.Thread(target=beat, name="fake-kubelet", daemon=True)
    thread.start()

    def keep_alive(node: str) -> None:
        _renew_lease(kube, node)
        alive.append(node)

    yield keep_alive
    stop.set()
    thread.join(10)


def test_a_host_that_dies_before_its_node_is_marked_is_node_lost_once_the_node_lifecycle_controller_marks_it(
    operator, cluster, nodes, fake_kubelet, unique_name
):
    """The race as it happens: slice 1's host dies, slice 0's worker exits 1 on the collective error
    first, and only then does kube-controller-manager's node lifecycle controller (the real one) mark
    the silent node Unknown and taint it unreachable. The decision waits for it (the dead host's pod
    still runs, its kubelet is silent) and the failure is NodeLost, not counted."""
    healthy, dead = nodes
    cluster.apply(training_job_manifest(unique_name, restart={"backoffSeconds": 0, "maxRestarts": 0}))
    jobset = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    for name in nodes:
        _create_node(cluster, name)
    fake_kubelet(healthy)  # the dead host's kubelet posts nothing more from here on
    dead_pod = _bound_pod(cluster, jobset, 1, dead, {"running": {"startedAt": _now()}})
    # The peer fails well before the node lifecycle controller marks the silent node (about 55 s after
    # it registered: its grace period and monitor period), 30 s before it: inside the 60 s of the wait.
    time.sleep(25)
    exited = {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": _now()}}
    _bound_pod(cluster, jobset, 0, healthy, exited)
    time.sleep(3)
    assert "lastFailure" not in cluster.status(unique_name), "decided before the silent node could be marked"
    status = eventually(
        lambda: (s := cluster.status(unique_name)).get("lastFailure") and s,
        timeout=NODE_VERDICT_WAIT_SECONDS + 10,
        what="failure decided",
    )
    failure = status["lastFailure"]
    assert (failure["kind"], failure["counted"], status["countedRestarts"]) == ("NodeLost", False, 0), failure
    assert (failure["evidence"]["node"], failure["evidence"]["pod"]) == (dead, dead_pod)
    assert failure["evidence"]["signal"] in ("NodeUnreachable", "NodeNotReady"), failure
    marked = cluster.core.read_node(dead)
    ready = next(c for c in marked.status.conditions if c.type == "Ready")
    assert ready.status == "Unknown", ready  # the controller's verdict, not ours
    assert status["phase"] != "Failed"


def test_a_pod_whose_node_is_deleted_is_failed_at_once_and_its_loss_is_not_counted(
    operator, cluster, nodes, unique_name
):
    """Slice 1's VM is deleted with its Node (what GKE does to a failed or reclaimed host): no kubelet
    will report its pod again, which stays Running in the API, and its peer keeps training. The pod
    garbage collector would mark it Failed only after its 40 s orphan quarantine; the operator marks
    it at once (DisruptionTarget NodeGone: not the pod GC's DeletionByPodGC), and the failure is the
    node's, not counted (maxRestarts 0: a counted one would fail the job)."""
    healthy, doomed = nodes
    cluster.apply(training_job_manifest(unique_name, restart={"backoffSeconds": 0, "maxRestarts": 0}))
    jobset = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    for name in nodes:
        _create_node(cluster, name)
    running = {"running": {"startedAt": _now()}}
    healthy_pod = _bound_pod(cluster, jobset, 0, healthy, running)
    lost_pod = _bound_pod(cluster, jobset, 1, doomed, running)
    time.sleep(2)  # the operator has seen both pods on their nodes
    assert cluster.core.read_namespaced_pod(lost_pod, cluster.namespace).status.phase == "Running"

    cluster.core.delete_node(doomed)

    def marked() -> Any:
        pod = cluster.core.read_namespaced_pod(lost_pod, cluster.namespace)
        return pod if pod.status.phase == "Failed" else None

    pod = eventually(marked, timeout=30, what="the pod on the deleted node marked Failed")
    [disruption] = [c for c in pod.status.conditions if c.type == "DisruptionTarget"]
    assert (disruption.status, disruption.reason) == ("True", "NodeGone"), disruption
    assert doomed in disruption.message
    status = eventually(lambda: (s := cluster.status(unique_name)).get("lastFailure") and s, what="failure decided")
    failure = status["lastFailure"]
    assert (failure["kind"], failure["counted"], failure["slice"]) == ("NodeLost", False, 1), failure
    assert status["countedRestarts"] == 0 and status["phase"] != "Failed", status
    # The failed attempt's JobSet goes, and its peer with it in 5 s of grace: this tier runs no kubelet (nor
    # owner references on the test's pods), so the test ends the peer itself. The next attempt waits for
    # that: it never starts beside a trainer of the previous one.
    eventually(lambda: cluster.jobset(f"{unique_name}-a0") is None or None, what="JobSet a0 deleted")
    time.sleep(2)  # a decision or two that must not create a1 yet
    assert cluster.jobset(f"{unique_name}-a1") is None
    cluster.core.delete_namespaced_pod(healthy_pod, cluster.namespace, grace_period_seconds=0)
    eventually(lambda: cluster.jobset(f"{unique_name}-a1"), what="JobSet a1, the uncounted restart")
