"""Plain data the handlers gather from the API and GCS, and the pure modules decide on."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

import tpujob_contract as contract

JobSetState = Literal["Active", "Suspended", "Completed", "Failed"]
POD_ENDED_PHASES = ("Succeeded", "Failed")  # a pod in either has ended for good


def may_still_run(phase: str | None, node: str | None, nodes: Container[str] | None) -> bool:
    """Whether a worker pod's trainer may still run: it has not ended and is bound to a node that exists
    (`nodes`: the names known to exist; None: unknown, any node counts). A pod deleted but not ended
    still runs: its kubelet may be unreachable, its save in flight."""
    return phase not in POD_ENDED_PHASES and node is not None and (nodes is None or node in nodes)


@dataclass(frozen=True)
class Worker:
    """A worker pod as far as who may still write a run directory is concerned."""

    attempt: int
    phase: str | None
    node: str | None


def still_writing(workers: Iterable[Worker], nodes: Mapping[str, NodeFacts] | None) -> int:
    """How many of `workers` may still write their run directory: they may still run (may_still_run;
    `nodes`: those under the pods, by name; None: unknown), except one on a node whose kubelet cannot
    be reached (Ready False or Unknown) beside a peer of its attempt that ended. That one's trainer is
    cut off from its peers: it can neither train nor commit a save, which needs every process; it stays
    in the API until its node comes back or goes, which nothing needs to wait for. Alone, or with every
    peer alive, it may still train and commit, and is waited for."""
    workers = list(workers)
    unreachable = {name for name, n in (nodes or {}).items() if n.ready in ("False", "Unknown")}
    broken = {w.attempt for w in workers if w.phase in POD_ENDED_PHASES}
    return sum(
        1
        for w in workers
        if may_still_run(w.phase, w.node, nodes) and not (w.node in unreachable and w.attempt in broken)
    )


@dataclass(frozen=True)
class PodFacts:
    """What a worker pod tells about why it ended (or that it has not)."""

    name: str
    slice: int | None
    phase: str
    exit_code: int | None = None
    reason: str | None = None  # container terminated reason (Error, OOMKilled, ...) or pod reason
    pod_reason: str | None = None  # the pod's own status.reason (Evicted, Terminated, NodeLost, ...)
    pod_message: str | None = None  # ... and status.message ("The node was low on resource: memory. ...")
    disruption_reason: str | None = None  # DisruptionTarget condition reason, if any
    disruption_since: datetime | None = None  # ... and its lastTransitionTime
    finished_at: datetime | None = None
    unschedulable_message: str | None = None  # PodScheduled=False/Unschedulable message
    created: datetime | None = None
    scheduled_at: datetime | None = None  # PodScheduled=True since
    waiting_reason: str | None = None  # container waiting reason (ImagePullBackOff, CreateContainerConfigError, ...)
    waiting_message: str | None = None
    termination_message: str | None = None  # what the container wrote to its termination-log on exit
    node: str | None = None  # spec.nodeName: the node it was bound to (None: never scheduled)
    # Restarted in place (spec.restart.strategy InPlace): its trainer container's restarts, and how
    # the run before the latest restart ended (lastState.terminated), unless the agent ended it on request.
    restart_count: int = 0
    last_exit_code: int | None = None
    last_reason: str | None = None
    last_finished_at: datetime | None = None
    last_termination_message: str | None = None
    in_place_attempt: int | None = None  # JobSet's agent's annotation: the in-place restart round it is at
    deleting: bool = False  # its deletion was asked (metadata.deletionTimestamp)
    job: str | None = None  # the Job that made it (its slice's), by the Job controller's labels ...
    job_uid: str | None = None  # ... and that Job's uid: a Job recreated under the same name has another


@dataclass(frozen=True)
class Taint:
    key: str
    effect: str
    added: datetime | None = None  # timeAdded (Kubernetes writes it for NoExecute taints only)


@dataclass(frozen=True)
class NodeFacts:
    """What a Node says about its health (nodes.py turns it into verdicts)."""

    name: str
    ready: str | None = None  # the Ready condition's status: True, False, Unknown (None: never reported)
    ready_reason: str | None = None
    ready_message: str | None = None
    ready_since: datetime | None = None  # the Ready condition's lastTransitionTime
    unschedulable: bool = False  # spec.unschedulable: cordoned
    taints: tuple[Taint, ...] = ()
    maintenance: str | None = None  # GKE's cloud.google.com/active-node-maintenance label, if any
    deleting_since: datetime | None = None  # metadata.deletionTimestamp
    # Its kubelet's Lease renewal (kube-node-lease, every 10 s while it lives); read only while a failure
    # waits for the nodes' word (nodes.verdict_wait).
    renewed: datetime | None = None


@dataclass(frozen=True)
class JobSetFacts:
    name: str
    attempt: int
    resume_step: int | None
    created: datetime
    state: JobSetState
    condition_reason: str = ""
    condition_message: str = ""
    ended_at: datetime | None = None  # its Completed or Failed condition's lastTransitionTime
    failed_slice: int | None = None  # from the failed child Job, when JobSet's status names one
    pods: tuple[PodFacts, ...] = ()
    deleting: bool = False
    uid: str | None = None  # the TrainingJob incarnation that created it (label, else owner reference)
    expected_pods: int = 0  # slices x hosts per slice
    slices: int = 0  # its replicated Job's replicas: one per slice
    resumed_at: datetime | None = None  # when its last suspension ended (JobSet Suspended=False)
    suspended_by_operator: bool = False  # the operator's own suspension (spec.suspend), not a queue's
    resuming: bool = False  # spec.suspend is false but the JobSet controller has not resumed it yet
    pod_creation_refused: str | None = None  # why the Job controller could not create a worker pod
    queue_name: str | None = None  # Kueue's LocalQueue (label): Kueue, not the operator, suspends and resumes it
    admitted_at: datetime | None = None  # Kueue admitted its Workload (None: waiting, or no Kueue)
    queue_reason: str | None = None  # why Kueue has not admitted it (or evicted it), as Kueue says
    in_place: bool = False  # its failure policy restarts in place (JobSet's InPlaceRestart)
    # The highest in-place restart round begun: JobSet's current and previous attempt counters, its pods'
    # annotations, and a failed pod's (its round + 1), since a pod's failure begins the next round.
    in_place_round: int = 0
    pods_in_place_round: int = 0  # ... as the pods alone show it (behind in_place_round: the pod watch lags)


@dataclass(frozen=True)
class Observed:
    now: datetime
    jobsets: tuple[JobSetFacts, ...] = ()
    latest_committed_step: int | None = None
    progress: contract.ProgressRecord | None = None  # the trainer's record (or what MaxText leaves)
    storage_error: str | None = None  # GCS could not be read: reported, never fatal
    storage_denied: bool = False  # ... because it refused the operator's identity (401/403)
    # Worker pods left by an earlier TrainingJob of the same name (deleted with --cascade=orphan):
    # this incarnation starts only once they are gone, since both would write one run directory.
    foreign_pods: int = 0
    queue_name: str | None = None  # the Kueue LocalQueue the job's attempts go to (None: no Kueue)
    # The nodes the job's pods are bound to, by name; a name bound but absent is a node that is gone.
    # None: no node watch (nothing can be said about nodes).
    nodes: Mapping[str, NodeFacts] | None = None
    # spec.elastic, below full size: TPU node pools of the job's slice shape that are ready (every node
    # Ready, schedulable, untainted) and hold none of the current attempt's pods; None: not asked.
    spare_pools: int | None = None
    # This incarnation's worker pods of earlier attempts that have not ended (a resize waits for them:
    # the stopped workers save first, and the next attempt restores what they saved).
    earlier_pods: int = 0


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Actions:
    """Side effects the runtime performs, in this order: status, delete, stop, pods on gone nodes failed,
    lost slices' Jobs deleted, pods on gone nodes removed, create, events, suspend (the failed attempt's
    JobSet is gone before its replacement exists: never two live attempts)."""

    create_attempt: int | None = None
    create_slices: int | None = None  # the attempt's slice count (None: spec.tpu.slices)
    resume_step: int | None = None
    delete: list[str] = field(default_factory=list)
    # JobSets to delete with their pods' own grace, so that the workers save on SIGTERM (a suspension)
    stop: list[str] = field(default_factory=list)
    set_suspend: tuple[str, bool] | None = None
    # (pod, node): worker pods bound to a node that is gone, to mark Failed (once the API confirms the
    # node is gone) as the pod garbage collector would, without its 40 s quarantine
    fail_on_gone_nodes: list[tuple[str, str]] = field(default_factory=list)
    # Failed worker pods on a gone node whose failure status records: deleted (what the pod GC does after
    # its quarantine), since JobSet's in-place restart waits for every pod of the JobSet to restart
    remove_from_gone_nodes: list[str] = field(default_factory=list)
    # (Job, uid): an in-place attempt's slice Jobs whose every pod is such a pod, deleted (only that uid)
    # for JobSet to recreate: a new Job's pods start at once, where the old one's wait out its back-off
    recreate_lost_slices: list[tuple[str, str]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    # Decide again on a fresh read of storage, though nothing else changes (a completion to confirm).
    fresh_storage: bool = False


@dataclass(frozen=True)
class CreationRefused:
    """The apiserver refused the attempt's JobSet (what apply saw; the next decision reads it)."""

    message: str
    code: int | None = None  # the HTTP status of the refusal; None: a foreign JobSet holds the name
