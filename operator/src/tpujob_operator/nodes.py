"""Pure node health: what the Nodes under a failed attempt's pods say about whose failure it was.

On a multi-host slice a dead host's pod stays Running (its kubelet can report nothing) while its
peers exit first on collective or heartbeat errors: the earliest failed pod then blames the
application. The Node objects tell the truth, and they outlive the operator's memory: a failure is
the infrastructure's (NodeLost or Preemption, never counted) when any pod of the failed attempt is
bound to a node that shows one of these signals, begun no later than NODE_FAILURE_WINDOW_SECONDS
after the first failure:

- NodeLost: the node is gone (bound, but no Node of that name exists); it is being deleted; its
  Ready condition is False or Unknown; it carries the node lifecycle controller's NoExecute
  node.kubernetes.io/unreachable or not-ready taint (the ones that evict; their NoSchedule twins only
  shadow the condition, lagging it), or node.kubernetes.io/out-of-service (a non-graceful shutdown).
- Preemption (maintenance or reclaim; the pods' save grace, if any, was given): GKE's
  cloud.google.com/impending-node-termination taint (graceful termination, spot reclaim) or its
  cloud.google.com/active-node-maintenance label (host maintenance in progress); or the node is
  cordoned (spec.unschedulable) and carries the cluster autoscaler's drain taint
  (ToBeDeletedByClusterAutoscaler). A cordon alone is not evidence: admins cordon nodes to stop new
  placements while running pods keep running. An upcoming maintenance
  (cloud.google.com/scheduled-maintenance-time) is not either: nothing has happened yet.

A signal's start is its own time when the node states one (the condition's lastTransitionTime, the
taint's timeAdded, the deletionTimestamp); otherwise it is dated when the operator sees it, so a
signal the node does not date counts only when seen within the window (after an operator restart
long after the failure it proves nothing). Signals still present are ongoing, so one begun before
the failure counts too (a pod cannot train for long on a NotReady node: the taint manager evicts it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import tpujob_contract as contract

from .facts import POD_ENDED_PHASES, NodeFacts, PodFacts, Taint
from .status import parse_time

# A node signal counts for a failure when it began no later than this after the first failed pod
# finished (the node lifecycle controller marks a silent node NotReady after its grace period, 40 s
# by default, often after the dead host's peers exited).
NODE_FAILURE_WINDOW_SECONDS = 60.0
# While a pod of the failed attempt still runs on a node with no signal whose kubelet has not been
# heard from since the first failure (its Lease, renewed every 10 s, is older), a failure that would
# count is decided only once this long has passed since the first failure: that pod may be the dead
# host's, whose node is not yet marked NotReady.
NODE_VERDICT_WAIT_SECONDS = NODE_FAILURE_WINDOW_SECONDS
# How often a held decision looks at the nodes (and their Leases) again.
NODE_VERDICT_CHECK_SECONDS = 2.0

UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
IMPENDING_TERMINATION_TAINT = "cloud.google.com/impending-node-termination"
AUTOSCALER_DRAIN_TAINT = "ToBeDeletedByClusterAutoscaler"
ACTIVE_MAINTENANCE_LABEL = "cloud.google.com/active-node-maintenance"
POOL_LABELS = (contract.NODE_POOL_LABEL, contract.ACCELERATOR_LABEL, contract.TOPOLOGY_LABEL)

_LOST_TAINTS = {
    UNREACHABLE_TAINT: "NodeUnreachable",
    NOT_READY_TAINT: "NodeNotReady",
    OUT_OF_SERVICE_TAINT: "NodeOutOfService",
}

NodeKind = Literal["NodeLost", "Preemption"]
# The DisruptionTarget reason of a pod the operator marks Failed because its node is gone (what the pod
# garbage collector marks DeletionByPodGC, after its quarantine).
NODE_GONE_DISRUPTION = "NodeGone"


@dataclass(frozen=True)
class Signal:
    """One thing a node says that kills (or killed) the pods on it."""

    kind: NodeKind
    reason: str  # NodeGone, NodeDeleting, NodeNotReady, NodeUnreachable, NodeOutOfService, NodeTerminating, ...
    detail: str
    since: datetime | None  # when it began, if the node says


@dataclass(frozen=True)
class Evidence:
    """The signal that decided a failure was the infrastructure's, and where it was seen."""

    kind: NodeKind
    reason: str
    node: str
    pod: str
    slice: int | None
    detail: str
    since: datetime  # the signal's start, or when it was seen


# -- decoding: a Node as the API returns it -> NodeFacts --------------------------------------------


def slim_node(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a Node (one per node in the cluster): no images, addresses, capacity."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    labels = meta.get("labels") or {}
    kept_meta: dict[str, Any] = {
        k: meta[k] for k in ("name", "uid", "resourceVersion", "deletionTimestamp") if k in meta
    }
    # the pool and slice shape a node belongs to (spec.elastic counts ready pools), and GKE's maintenance
    kept_labels = {k: labels[k] for k in (*POOL_LABELS, ACTIVE_MAINTENANCE_LABEL) if k in labels}
    if kept_labels:
        kept_meta["labels"] = kept_labels
    return {
        "metadata": kept_meta,
        "spec": {k: spec[k] for k in ("unschedulable", "taints") if k in spec},
        "status": {"conditions": [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]},
    }


def node_facts(body: Mapping[str, Any]) -> NodeFacts:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    ready: Mapping[str, Any] = next(
        (c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {}
    )
    taints = tuple(
        Taint(str(t.get("key", "")), str(t.get("effect", "")), parse_time(t.get("timeAdded")))
        for t in spec.get("taints") or []
    )
    return NodeFacts(
        name=str(meta.get("name", "")),
        ready=ready.get("status"),
        ready_reason=ready.get("reason"),
        ready_message=ready.get("message"),
        ready_since=parse_time(ready.get("lastTransitionTime")),
        unschedulable=bool(spec.get("unschedulable")),
        taints=taints,
        maintenance=(meta.get("labels") or {}).get(ACTIVE_MAINTENANCE_LABEL),
        deleting_since=parse_time(meta.get("deletionTimestamp")),
    )


# -- verdicts ---------------------------------------------------------------------------------------


def node_signals(node: NodeFacts | None) -> tuple[Signal, ...]:
    """Every signal a node shows (None: the node is gone); empty for a healthy node."""
    if node is None:
        return (Signal("NodeLost", "NodeGone", "the node no longer exists", None),)
    found: list[Signal] = []
    if node.deleting_since is not None:
        found.append(Signal("NodeLost", "NodeDeleting", "the node is being deleted", node.deleting_since))
    if node.ready in ("False", "Unknown"):
        reason = "NodeUnreachable" if node.ready == "Unknown" else "NodeNotReady"
        said = f" ({node.ready_reason}: {node.ready_message})" if node.ready_reason else ""
        found.append(Signal("NodeLost", reason, f"Ready={node.ready}{said}", node.ready_since))
    for taint in node.taints:
        # The lifecycle controller's NoSchedule not-ready/unreachable taints only shadow the Ready
        # condition, and lag it (a node just registered or recovered still has them for seconds).
        if taint.key in _LOST_TAINTS and (taint.effect == "NoExecute" or taint.key == OUT_OF_SERVICE_TAINT):
            found.append(Signal("NodeLost", _LOST_TAINTS[taint.key], _taint_text(taint), taint.added))
        elif taint.key == IMPENDING_TERMINATION_TAINT:
            found.append(Signal("Preemption", "NodeTerminating", _taint_text(taint), taint.added))
        elif taint.key == AUTOSCALER_DRAIN_TAINT and node.unschedulable:
            found.append(Signal("Preemption", "NodeDrained", f"cordoned, {_taint_text(taint)}", taint.added))
    if node.maintenance:
        detail = f"label {ACTIVE_MAINTENANCE_LABEL}={node.maintenance}"
        found.append(Signal("Preemption", "NodeMaintenance", detail, None))
    return tuple(found)


def _taint_text(taint: Taint) -> str:
    return f"taint {taint.key}:{taint.effect}"


def infrastructure_evidence(
    pods: Iterable[PodFacts],
    nodes: Mapping[str, NodeFacts],
    first_failure: datetime,
    now: datetime,
    window_seconds: float = NODE_FAILURE_WINDOW_SECONDS,
) -> Evidence | None:
    """The earliest node signal under any of the pods (bound ones; `nodes` by name, a bound name
    missing from it is a node that is gone) that began no later than `window_seconds` after the first
    failure; None if the nodes show nothing."""
    latest = first_failure + timedelta(seconds=window_seconds)
    found: list[Evidence] = []
    for pod in pods:
        if pod.node is None:
            continue
        for signal in node_signals(nodes.get(pod.node)):
            since = signal.since or now
            if since <= latest:
                found.append(Evidence(signal.kind, signal.reason, pod.node, pod.name, pod.slice, signal.detail, since))
    # The earliest signal is the likeliest cause; at one time, a lost node before a maintenance.
    return min(found, key=lambda e: (e.since, e.kind != "NodeLost"), default=None)


def pods_on_gone_nodes(pods: Iterable[PodFacts], nodes: Mapping[str, NodeFacts] | None) -> list[tuple[str, str]]:
    """(pod, node) for every pod that has not ended and is bound to a node that no longer exists. No
    kubelet will report such a pod again; Kubernetes' pod garbage collector fails it only after a
    40 s quarantine, and until then neither its Job nor a restart round can begin."""
    if nodes is None:
        return []
    return [
        (p.name, p.node) for p in pods if p.node is not None and p.node not in nodes and p.phase not in POD_ENDED_PHASES
    ]


def recorded_pods_on_gone_nodes(
    pods: Iterable[PodFacts], nodes: Mapping[str, NodeFacts] | None, recorded: datetime | None
) -> list[str]:
    """Failed pods bound to a node that no longer exists, whose failure a failure recorded at `recorded`
    (status.lastFailure.time) covers: their evidence is in status, so they may go. JobSet's in-place
    restart lifts its barrier only when every pod of the JobSet is at the new round, and such a pod
    never will be: left to the pod garbage collector, the round would wait out its 40 s quarantine."""
    if nodes is None or recorded is None:
        return []
    return [
        p.name
        for p in pods
        if p.phase == "Failed"
        and p.node is not None
        and p.node not in nodes
        and (ended := p.finished_at or p.disruption_since) is not None
        and ended <= recorded
    ]


def slices_lost_whole(
    pods: Iterable[PodFacts], removed: Iterable[str], hosts: int, slice_job: Callable[[int], str]
) -> list[tuple[str, str]]:
    """(Job, uid) of every slice Job whose `hosts` pods are all `removed` (failed on gone nodes, their
    failure recorded): nothing of that Job runs any more. Deleted, JobSet recreates it and its new pods
    start at once; kept, the Job controller creates their replacements only after its back-off (10 s,
    doubled at each failure of that Job, measured from the pod's end), and the back-off goes with the
    Job. A Job with a pod that is not removed (still running, or the replacement it already made),
    or with pods the watch has not delivered, is kept. Only the JobSet's own slice Jobs, named
    `slice_job(slice)`, are considered: a pod's labels name any Job its author likes."""
    gone = set(removed)
    by_job: dict[tuple[str, str], list[str]] = {}
    for p in pods:
        if p.slice is not None and p.job == slice_job(p.slice) and p.job_uid is not None:
            by_job.setdefault((p.job, p.job_uid), []).append(p.name)
    return sorted(job for job, names in by_job.items() if len(names) == hosts and gone.issuperset(names))


def awaited_nodes(pods: Iterable[PodFacts], round_unrecorded: bool = False) -> set[str]:
    """The nodes whose word a failure may wait for: those under pods still running beside a failed one,
    or under every pod of an in-place restart round not yet recorded (its failed worker runs again)."""
    pods = list(pods)
    if not round_unrecorded and not any(p.phase == "Failed" for p in pods):
        return set()
    return {p.node for p in pods if p.node is not None and p.phase not in POD_ENDED_PHASES}


def verdict_wait(
    pods: Iterable[PodFacts],
    nodes: Mapping[str, NodeFacts],
    first_failure: datetime,
    now: datetime,
    wait_seconds: float = NODE_VERDICT_WAIT_SECONDS,
) -> float | None:
    """Seconds to hold a failure that would count, or None to decide now. It is held while a pod bound to
    a node has not ended and that node's kubelet has not renewed its Lease since the first failure (the
    pod may be the dead host's, its node not yet marked NotReady), at most until `wait_seconds` after
    the first failure. A live kubelet renews every 10 s: on healthy nodes the wait is that long at most."""
    silent = [
        p
        for p in pods
        if p.node is not None and p.phase not in POD_ENDED_PHASES and not _heard_from(nodes.get(p.node), first_failure)
    ]
    if not silent:
        return None
    left = wait_seconds - (now - first_failure).total_seconds()
    return min(left, NODE_VERDICT_CHECK_SECONDS) if left > 0 else None


def _heard_from(node: NodeFacts | None, since: datetime) -> bool:
    return node is not None and node.renewed is not None and node.renewed > since
