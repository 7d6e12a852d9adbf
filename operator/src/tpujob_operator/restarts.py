"""Pure restart policy: classify a failure, decide whether the budget allows a restart, and when."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from tpujob_contract import ExitCode

from .api import FailureKind, RestartSpec
from .facts import POD_ENDED_PHASES, JobSetFacts, NodeFacts, PodFacts
from .nodes import NODE_FAILURE_WINDOW_SECONDS, NODE_GONE_DISRUPTION, Evidence, infrastructure_evidence, verdict_wait

# The trainer's exit codes that name a cause (the contract; trainer_image/README.md, "Exit codes"):
# exit code -> (kind, reason, what the pod did).
_NAMED_EXITS: dict[int, tuple[FailureKind, str, str]] = {
    ExitCode.PREEMPTED: ("Preemption", "Terminated", "exited 143 after SIGTERM"),
    ExitCode.STORAGE: ("StorageUnavailable", "StorageUnreachable", "could not reach checkpoint storage (exit 3)"),
    ExitCode.CHECKPOINT_INCOMPATIBLE: (
        "CheckpointIncompatible",
        "CheckpointIncompatible",
        "could restore no committed checkpoint (exit 4); the model no longer matches the run directory's checkpoints",
    ),
    ExitCode.STORAGE_PERMISSION_DENIED: (
        "StoragePermissionDenied",
        "StoragePermissionDenied",
        "was refused by checkpoint storage (exit 5: 401/403)",
    ),
    ExitCode.DISTRIBUTED_STARTUP: (
        "StartupFailure",
        "DistributedStartupFailed",
        "could not start JAX's distributed runtime (exit 6: its coordinator address is another process's)",
    ),
}
# Kinds that no restart can fix: the job fails at once, without spending the budget.
TERMINAL_KINDS: frozenset[FailureKind] = frozenset({"CheckpointIncompatible", "StoragePermissionDenied"})
# Exits after which no in-place restart is tried (jobset.py): success, and those of the terminal kinds.
NOT_RESTARTED_EXIT_CODES: tuple[int, ...] = (
    int(ExitCode.OK),
    *(int(code) for code, (kind, _, _) in _NAMED_EXITS.items() if kind in TERMINAL_KINDS),
)
# Kinds that are not the job's fault and never count against maxRestarts.
_NEVER_COUNTED: frozenset[FailureKind] = frozenset(
    {"StorageUnavailable", "CheckpointIncompatible", "StoragePermissionDenied", "StartupFailure"}
)
# DisruptionTarget reasons (pod condition set by Kubernetes) and what they mean for a TPU slice.
_INFRASTRUCTURE_DISRUPTIONS: dict[str, FailureKind] = {
    "PreemptionByScheduler": "Preemption",
    "EvictionByEvictionAPI": "Preemption",  # drain for maintenance / upgrade
    "TerminationByKubelet": "Preemption",  # node shutdown / spot reclaim (a node-pressure eviction: classify_pod)
    "DeletionByTaintManager": "NodeLost",  # node NotReady / unreachable
    "DeletionByPodGC": "NodeLost",  # node object deleted
    NODE_GONE_DISRUPTION: "NodeLost",  # node object deleted, marked by the operator ahead of the pod GC
}
_NODE_LOST_POD_REASONS = {"NodeLost", "NodeShutdown", "Terminated"}
NODE_PRESSURE_EVICTION = "Evicted"  # the pod's status.reason after the kubelet's node-pressure eviction
ABORTED = 134  # 128 + SIGABRT
# Why a failed JobSet none of whose pods is left failed (Preemption: the infrastructure's by default).
WORKER_POD_DELETED = "WorkerPodDeleted"
# How long a failed JobSet that no pod explains waits for its pods' news (the pod watch's lag), how often
# it looks.
FAILED_JOBSET_POD_WAIT_SECONDS = 30.0
POD_NEWS_RECHECK_SECONDS = 2.0
# What JAX's coordination service (XLA's distributed runtime) says when it aborts a healthy process.
_DISTRIBUTED_ABORT_MARKS = ("incarnation", "registertask", "coordination service")
# Kinds that blame the job, which the nodes under its pods can show to be the infrastructure's (nodes.py):
# a hang too, as a node cut off from the network also cuts its trainer off from storage and its record.
_NODE_ATTRIBUTABLE: frozenset[FailureKind] = frozenset({"ApplicationError", "Unknown", "Hang"})


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    reason: str
    message: str
    slice: int | None
    time: datetime | None
    evidence: Evidence | None = None  # the node signal that made it the infrastructure's


def classify_pod(pod: PodFacts) -> Failure | None:
    """Why one pod failed, or None if it did not."""
    if pod.pod_reason == NODE_PRESSURE_EVICTION:
        # The kubelet's node-pressure eviction (its DisruptionTarget says TerminationByKubelet, as a node
        # shutdown's does): on a node the job holds alone, the pressure is the job's own (its memory, its
        # local checkpoint tier's tmpfs, its disk), so it counts.
        said = f": {pod.pod_message}" if pod.pod_message else ""
        return Failure(
            "ApplicationError",
            NODE_PRESSURE_EVICTION,
            f"pod {pod.name} was evicted by its kubelet under node pressure{said}",
            pod.slice,
            pod.finished_at or pod.disruption_since,
        )
    if pod.disruption_reason in _INFRASTRUCTURE_DISRUPTIONS:
        kind = _INFRASTRUCTURE_DISRUPTIONS[pod.disruption_reason]
        return Failure(
            kind, pod.disruption_reason, f"pod {pod.name}: {pod.disruption_reason}", pod.slice, pod.finished_at
        )
    if pod.phase != "Failed":
        return None
    if pod.reason in _NODE_LOST_POD_REASONS:
        return Failure(
            "NodeLost", pod.reason or "NodeLost", f"pod {pod.name}: {pod.reason}", pod.slice, pod.finished_at
        )
    if pod.exit_code in _NAMED_EXITS:
        kind, reason, what = _NAMED_EXITS[pod.exit_code]
        return Failure(kind, reason, f"pod {pod.name} {what}", pod.slice, pod.finished_at)
    if pod.exit_code == ABORTED and _distributed_runtime_abort(pod.termination_message):
        message = f"pod {pod.name} was aborted by JAX's distributed runtime (exit 134): {pod.termination_message}"
        return Failure("StartupFailure", "DistributedRuntimeAborted", message[:1024], pod.slice, pod.finished_at)
    if pod.exit_code is not None and pod.exit_code != 0:
        reason = pod.reason if pod.reason and pod.reason != "Error" else f"ExitCode{pod.exit_code}"
        return Failure(
            "ApplicationError",
            reason,
            f"pod {pod.name} exited with code {pod.exit_code} ({pod.reason or 'Error'})",
            pod.slice,
            pod.finished_at,
        )
    return Failure("Unknown", pod.reason or "PodFailed", f"pod {pod.name} failed", pod.slice, pod.finished_at)


def _distributed_runtime_abort(said: str | None) -> bool:
    """Whether a worker's last words (its log's tail) are JAX's coordination service aborting it: a peer
    came back with a new incarnation, or it could not register. Not the job's code: a restart fixes it."""
    text = (said or "").lower()
    return any(mark in text for mark in _DISTRIBUTED_ABORT_MARKS)


def classify_jobset_failure(
    jobset: JobSetFacts, nodes: Mapping[str, NodeFacts] | None = None, now: datetime | None = None
) -> Failure:
    """The root cause of a failed JobSet: the earliest failed pod (later ones are usually its
    collateral, e.g. peers timing out in a collective), else what JobSet's condition says. One that
    would blame the job is the infrastructure's when the nodes under the attempt's pods say so
    (`nodes`: by name, see nodes.infrastructure_evidence; None: nodes unknown)."""
    failure = _earliest_failure(jobset)
    if nodes is None or now is None:
        return failure
    return with_node_evidence(failure, jobset.pods, nodes, failure.time or now, now)


def with_node_evidence(
    failure: Failure,
    pods: Iterable[PodFacts],
    nodes: Mapping[str, NodeFacts],
    since: datetime,
    now: datetime,
    window_seconds: float = NODE_FAILURE_WINDOW_SECONDS,
) -> Failure:
    """`failure`, or the infrastructure's when it would blame the job and a node under `pods` shows a
    signal that began no later than `window_seconds` after `since` (the job gets the benefit of the doubt)."""
    if failure.kind not in _NODE_ATTRIBUTABLE:
        return failure
    evidence = infrastructure_evidence(pods, nodes, since, now, window_seconds)
    if evidence is None:
        return failure
    message = f"pod {evidence.pod} is on node {evidence.node}: {evidence.detail} (first failure: {failure.message})"
    where = evidence.slice if evidence.slice is not None else failure.slice
    return Failure(evidence.kind, evidence.reason, message, where, failure.time, evidence)


def classify_in_place_round(
    jobset: JobSetFacts,
    after: datetime | None,
    recorded_round: int = 0,
    nodes: Mapping[str, NodeFacts] | None = None,
    now: datetime | None = None,
) -> Failure:
    """Why JobSet restarts the workers in place: as classify_jobset_failure, over the failed pods and the
    containers whose last run failed (their lastState) after `after` (the failure recorded before this
    round: a container's lastState outlives its round), leaving out the pods that failed in a round
    before `recorded_round` (the last round the operator recorded)."""
    runs = tuple(run for run in (_last_run(p, after, recorded_round) for p in jobset.pods) if run is not None)
    asked = f"JobSet {jobset.name} restarted its workers in place (round {jobset.in_place_round})"
    failure = classify_jobset_failure(
        dataclasses.replace(jobset, pods=runs, condition_reason="InPlaceRestart", condition_message=asked), nodes, now
    )
    replaced = next((p for p in jobset.pods if _replacement(p)), None)
    if failure.kind == "Unknown" and failure.time is None and replaced is not None:
        # No pod, no container run explains the round, and a pod is its Job's replacement: the one it
        # replaced left no Failed pod behind, so it was deleted (an eviction, a preemption).
        message = (
            f"{asked}: pod {replaced.name} replaced a worker pod that was deleted (an eviction, a preemption "
            "or a node's removal) before the operator read it"
        )
        return Failure("Preemption", WORKER_POD_DELETED, message, replaced.slice, None)
    return failure


def _replacement(pod: PodFacts) -> bool:
    """A pod its Job created in place of another during the JobSet's life: a fresh container (never
    restarted) whose agent joined a later round than the first."""
    return pod.restart_count == 0 and (pod.in_place_attempt or 0) > 0 and pod.phase not in POD_ENDED_PHASES


def _last_run(pod: PodFacts, after: datetime | None, recorded_round: int) -> PodFacts | None:
    """The pod as its failure is classified: a failed pod as it is, a restarted one as its last run ended;
    None for a pod that failed in a round recorded before (its Job replaced it: it stays in the API, and
    neither its failure nor its node says anything of this round). A pod whose agent last joined a round
    before the recorded one failed in a recorded round, whenever its phase was written (a lost node's
    pod is marked Failed seconds after the failure that began its round)."""
    if pod.phase == "Failed":
        ended = pod.finished_at or pod.disruption_since
        if pod.in_place_attempt is not None and pod.in_place_attempt < recorded_round:
            return None
        return None if after is not None and ended is not None and ended <= after else pod
    if pod.last_exit_code is None:
        return pod
    if after is not None and pod.last_finished_at is not None and pod.last_finished_at <= after:
        return pod  # its last failure was the round recorded before
    return dataclasses.replace(
        pod,
        phase="Failed",
        exit_code=pod.last_exit_code,
        reason=pod.last_reason,
        finished_at=pod.last_finished_at,
        termination_message=pod.last_termination_message,
    )


def node_verdict_wait(
    jobset: JobSetFacts, failure: Failure, nodes: Mapping[str, NodeFacts] | None, now: datetime
) -> float | None:
    """Seconds to hold the decision on a failure that would count while the nodes may still show it to
    be the infrastructure's (nodes.verdict_wait); None: decide now."""
    if nodes is None or failure.time is None or failure.kind not in _NODE_ATTRIBUTABLE:
        return None
    return verdict_wait(jobset.pods, nodes, failure.time, now)


def _earliest_failure(jobset: JobSetFacts) -> Failure:
    failures = [f for f in (classify_pod(p) for p in jobset.pods) if f is not None]
    if failures:
        dated = [f for f in failures if f.time is not None]
        return min(dated, key=lambda f: f.time or datetime.min) if dated else failures[0]
    if jobset.state == "Failed" and not any(_running(p) for p in jobset.pods):
        # A crashed worker's pod stays Failed in the API (backoffLimit 0); only a deleted one is missing:
        # an eviction, a preemption, a node's removal, whose DisruptionTarget went with the pod.
        message = (
            f"JobSet {jobset.name} failed and no pod of it is left to say why: a worker pod was deleted "
            "(an eviction, a preemption or a node's removal) before the operator read it"
        )
        return Failure("Preemption", WORKER_POD_DELETED, message, jobset.failed_slice, jobset.ended_at)
    return Failure(
        "Unknown",
        jobset.condition_reason or "JobSetFailed",
        jobset.condition_message or f"JobSet {jobset.name} failed",
        jobset.failed_slice,
        None,
    )


def _running(pod: PodFacts) -> bool:
    return pod.phase not in POD_ENDED_PHASES and not pod.deleting


def pod_news_wait(jobset: JobSetFacts, failure: Failure, now: datetime) -> float | None:
    """Seconds to hold the decision on a failed JobSet that no pod explains (WorkerPodDeleted, or Unknown
    while a pod still shows running): the pod watch may lag the JobSet's, and a crashed pod, which
    stays in the API, shows up within that lag; a deleted one never does. An InPlace JobSet that failed
    (its rounds spent) waits alike for the run that ended its last round. None: decide now."""
    if jobset.state != "Failed" or jobset.ended_at is None:
        return None  # an in-place round's pods run on: _in_place holds until they show the round
    if failure.kind not in ("Unknown", "Preemption"):
        return None
    explained = failure.time is not None if jobset.in_place else any(classify_pod(p) for p in jobset.pods)
    if explained:
        return None
    left = FAILED_JOBSET_POD_WAIT_SECONDS - (now - jobset.ended_at).total_seconds()
    return min(left, POD_NEWS_RECHECK_SECONDS) if left > 0 else None


def counts_against_budget(kind: FailureKind, policy: RestartSpec) -> bool:
    if kind in _NEVER_COUNTED:
        return False
    if kind in ("Preemption", "NodeLost"):
        return policy.count_preemptions
    return True


# Uncounted restarts in a row with no newer committed step between them that a job may make: an
# infrastructure failure never spends the budget, but no job restarts for ever without training.
MAX_UNCOUNTED_RESTARTS_WITHOUT_PROGRESS = 10


def uncounted_streak(streak: int, counted: bool, previous_resume_step: int | None, latest: int | None) -> int:
    """The uncounted restarts without progress after this failure: none after a counted one; one more
    when the latest committed step is still the one the previous failure resumed from (`streak` is
    the count before, 0 when the previous failure was counted); else this one alone."""
    if counted:
        return 0
    return streak + 1 if streak > 0 and latest == previous_resume_step else 1


def budget_left(policy: RestartSpec, counted_restarts: int) -> bool:
    return counted_restarts < policy.max_restarts


def backoff(policy: RestartSpec, counted_restarts: int, counted: bool) -> timedelta:
    """Exponential for counted failures (a crash loop should not hammer the cluster); infrastructure
    failures restart after the base delay, since waiting longer only loses training time."""
    if not counted or counted_restarts <= 0:
        return timedelta(seconds=min(policy.backoff_seconds, policy.max_backoff_seconds))
    # The exponent is capped: past 2**32 the maximum wins anyway, and a huge power would overflow timedelta.
    seconds = policy.backoff_seconds * 2 ** min(counted_restarts - 1, 32)
    return timedelta(seconds=min(seconds, policy.max_backoff_seconds))


def expired(now: datetime, since: datetime, timeout_seconds: int) -> bool:
    """A stage clock that started at `since` ran past its timeout (0: the stage never times out)."""
    return timeout_seconds > 0 and (now - since).total_seconds() > timeout_seconds
