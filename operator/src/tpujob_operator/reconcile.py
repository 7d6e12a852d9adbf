"""The operator's whole decision as one pure function: (TrainingJob, observed facts) -> (status, actions).

Level-triggered: it looks only at the TrainingJob's status and the world as observed now, so it is
safe to run after an operator restart, twice in a row, or from any event.

A live attempt is always on exactly one clock (status.stage), each with its own deadline:
Scheduling (not every worker pod is scheduled: waiting for capacity is normal, no deadline unless
the user sets one), StartingUp (pods placed, no step yet: image pull, restore, compilation) and
Training (no new step). No clock runs while the job is suspended or while checkpoint storage cannot
be read, and every clock starts again when a suspension ends or storage comes back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from datetime import datetime

from tpujob_contract import STORAGE_DENIED_PREFIX, ExitCode

from . import elastic, frameworks, goodput
from .api import (
    IN_PLACE,
    RECREATE,
    TERMINAL_PHASES,
    FailureEvidence,
    FailureRecord,
    FailureTimeline,
    Phase,
    QueueStatus,
    ResizeRecord,
    RestartStrategy,
    Stage,
    TrainingJob,
    TrainingJobStatus,
)
from .facts import (
    POD_ENDED_PHASES,
    Actions,
    CreationRefused,
    Event,
    JobSetFacts,
    Observed,
    PodFacts,
    Worker,
    still_writing,
)
from .jobset import jobset_name, slice_job_name
from .nodes import pods_on_gone_nodes, recorded_pods_on_gone_nodes, slices_lost_whole
from .restarts import (
    MAX_UNCOUNTED_RESTARTS_WITHOUT_PROGRESS,
    POD_NEWS_RECHECK_SECONDS,
    TERMINAL_KINDS,
    Failure,
    backoff,
    budget_left,
    classify_in_place_round,
    classify_jobset_failure,
    classify_pod,
    counts_against_budget,
    expired,
    node_verdict_wait,
    pod_news_wait,
    uncounted_streak,
    with_node_evidence,
)
from .status import (
    moved_resume_point,
    parse_time,
    recovering_record,
    rfc3339,
    rfc3339_precise,
    set_condition,
    with_observations,
    with_phase,
)
from .tpu import slice_shape

# When a job is next re-examined without news (`Actions.requeue_after`): watch events bring news about
# JobSets and pods at once, so a timer is needed only for what no event announces: a stage's deadline,
# the trainer's progress (in storage), a backoff's end.
RECHECK_SECONDS = 60.0  # nothing is expected: a safety net
STARTUP_CHECK_SECONDS = 5.0  # the first step of a started attempt is expected any moment
STORAGE_RETRY_SECONDS = 10.0  # storage could not be read: try again soon
STORAGE_CONDITION = "CheckpointStorageReachable"
PREVIOUS_ATTEMPT_CHECK_SECONDS = 2.0  # an earlier attempt's workers are ending: look again soon
PREVIOUS_ATTEMPT_ENDING = "PreviousAttemptEnding"
LOCAL_TIER_CONDITION = "LocalCheckpointTierSaving"
LOCAL_TIER_NOT_SAVING = "LocalTierNotSaving"
# Attempts that fail in a row because the workers cannot reach checkpoint storage (exit 3, after the
# trainer's own 600 s wait) are restarted, uncounted, for this long from the first; then the job fails.
# So does a job whose storage the operator cannot read for this long (its progress unknown meanwhile).
STORAGE_OUTAGE_LIMIT_SECONDS = 3600
# Container waiting reasons that keep a started pod from ever running until someone fixes something.
_STUCK_WAITING_REASONS = (
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
)


def reconcile(tj: TrainingJob, observed: Observed) -> tuple[TrainingJobStatus, Actions]:
    if tj.status.phase in TERMINAL_PHASES:  # decided: what is left is to hold nothing
        return tj.status, release(tj.metadata.get("uid"), tj.status, observed.jobsets)
    # A record of another incarnation of this name is never taken for ours.
    if observed.progress is not None and observed.progress.uid != (tj.metadata.get("uid") or ""):
        observed = dataclasses.replace(observed, progress=None)
    if tj.status.start_time is None:
        tj = tj.model_copy(update={"status": tj.status.model_copy(update={"start_time": rfc3339(observed.now)})})
    status, actions = _decide(tj, observed)
    if (current := _current(status, observed, tj.metadata.get("uid"))) is not None:
        recorded = parse_time(status.last_failure.time) if status.last_failure else None
        actions.remove_from_gone_nodes = recorded_pods_on_gone_nodes(current.pods, observed.nodes, recorded)
        if current.in_place and current.slices:
            hosts = current.expected_pods // current.slices
            own_job = functools.partial(slice_job_name, current.name)
            lost = slices_lost_whole(current.pods, actions.remove_from_gone_nodes, hosts, own_job)
            actions.recreate_lost_slices = lost
            actions.events += [
                Event("Normal", "SliceJobRecreated", f"Job {job}: every pod of it was lost with its node; deleted "
                      "for JobSet to recreate, so that its replacements start without the Job's failure back-off")
                for job, _ in actions.recreate_lost_slices
            ]  # fmt: skip
    status = _with_queue(status, observed, tj.metadata.get("uid"))
    status = _with_timeline(status, observed, actions, tj.metadata.get("uid"))
    status.goodput = goodput.advance(tj.status, status, observed.progress, observed.now, tj.spec.tpu.slices)
    return status, actions


def _current(status: TrainingJobStatus, observed: Observed, uid: str | None) -> JobSetFacts | None:
    return next(
        (js for js in observed.jobsets if js.uid == uid and js.attempt == status.attempt and not js.deleting), None
    )


def _with_queue(status: TrainingJobStatus, observed: Observed, uid: str | None) -> TrainingJobStatus:
    """status.queue: the current attempt's Kueue admission (jobs with a queue only)."""
    current = _current(status, observed, uid)
    name = current.queue_name if current is not None else observed.queue_name
    if not name or status.phase in TERMINAL_PHASES:
        return status.model_copy(update={"queue": None if not name else status.queue})
    if current is None or current.state == "Suspended" or current.resuming:
        queue = QueueStatus(name=name, admitted=False, reason=current.queue_reason if current else None)
    else:
        admitted_at = current.admitted_at or current.resumed_at
        queue = QueueStatus(name=name, admitted=True, admission_time=rfc3339(admitted_at) if admitted_at else None)
    return status.model_copy(update={"queue": queue})


def _with_timeline(
    status: TrainingJobStatus, observed: Observed, actions: Actions, uid: str | None
) -> TrainingJobStatus:
    """Date the stages of the recovery from the last failure as they are seen happen."""
    failure = status.last_failure
    if failure is None:
        return status
    timeline = failure.timeline.model_copy()
    current = _current(status, observed, uid)
    if timeline.job_set_created is None and actions.create_attempt == status.attempt:
        timeline.job_set_created = rfc3339_precise(observed.now)
    if current is not None and timeline.detected is not None:
        scheduled = [p.scheduled_at for p in current.pods if p.scheduled_at is not None]
        if timeline.pods_scheduled is None and scheduled and len(scheduled) >= (current.expected_pods or 1):
            timeline.pods_scheduled = rfc3339_precise(max(scheduled))
    progress = observed.progress
    in_place = failure.rung == IN_PLACE
    if (
        progress is not None
        and progress.attempt == status.attempt
        and (status.attempt > 0 or in_place)
        and recovering_record(failure, progress)
    ):
        if timeline.restored is None and (restored := parse_time(progress.restore_finished_at)) is not None:
            timeline.restored = rfc3339_precise(restored)
        if timeline.first_new_step is None and failure.recovery_seconds is not None:
            timeline.first_new_step = rfc3339_precise(parse_time(progress.first_step_at) or progress.updated)
    if timeline == failure.timeline:
        return status
    return status.model_copy(update={"last_failure": failure.model_copy(update={"timeline": timeline})})


def _decide(tj: TrainingJob, observed: Observed) -> tuple[TrainingJobStatus, Actions]:
    now = observed.now
    uid = tj.metadata.get("uid")
    status = tj.status.model_copy(update={"observed_generation": tj.metadata.get("generation")})
    actions = Actions()
    ours = [js for js in observed.jobsets if js.uid == uid]
    foreign = [js for js in observed.jobsets if js.uid != uid]
    live = [js for js in ours if not js.deleting]
    # Adopt a JobSet created just before an operator crash, before its attempt reached status.
    attempt = max([status.attempt, *(js.attempt for js in live)])
    status.attempt = attempt
    status.job_set_name = jobset_name(tj.name, attempt)
    current = next((js for js in live if js.attempt == attempt), None)
    # An earlier attempt still alive: the operator died between writing the next attempt and removing
    # it. Only a failed one's workers go at once (they cannot save without their failed peer); any other
    # (a suspension, a resize, a resume that replaced a stale pin) stops with the workers' save grace.
    older = [js for js in live if js.attempt < attempt]
    actions.delete = [js.name for js in older if js.state == "Failed"]
    actions.stop = [js.name for js in older if js.state != "Failed"]
    status = _with_storage(status, observed, actions)
    previous_progress_time = status.last_progress_time
    status = with_observations(status, _holding_record_of_unrecorded_round(observed, status, current, tj))
    _report_restore_fallback(status, observed, previous_progress_time, actions)
    status = _with_local_tier(tj, status, observed, actions)

    if foreign:
        return _remove_foreign(tj, status, observed, actions, foreign)
    if current is None:
        if observed.queue_name and tj.spec.suspend:  # Kueue would admit a suspended JobSet: create none
            actions.requeue_after = RECHECK_SECONDS
            return _enter(status, "Suspended", "Suspended", "spec.suspend is true", "Suspended", now), actions
        return _without_jobset(tj, status, observed, actions)
    if current.state == "Completed":
        return _completed(tj, status, observed, actions, current)
    if _suspension_holds(tj, current):
        # Pods stopped by a suspension exit 143 after saving: that is not a failure, never classified.
        return _suspension(tj, status, observed, actions, current)
    current = _without_pods_from_before_resume(current)
    actions.fail_on_gone_nodes = pods_on_gone_nodes(current.pods, observed.nodes)
    if current.in_place and current.state != "Failed":  # a Failed one: JobSet spent the rung without us
        return _in_place(tj, status, observed, actions, current)
    # A failed worker fails the attempt (every Job has backoffLimit 0). Acting on the pod, not on the
    # JobSet's Failed condition, saves the time the Job controller spends waiting for the slice's
    # other pods to terminate before it marks the Job failed.
    if current.state == "Failed" or any(p.phase == "Failed" for p in current.pods):
        if current.in_place:
            failure = classify_in_place_round(
                current, _last_failure_time(status), status.in_place_round, observed.nodes, now
            )
        else:
            failure = classify_jobset_failure(current, observed.nodes, now)
        # A failure that would count waits (briefly) while a pod still runs: it may be the dead host's,
        # or the pod that explains it may not have reached the watch yet.
        wait = node_verdict_wait(current, failure, observed.nodes, now)
        if wait is None:
            wait = pod_news_wait(current, failure, now)
        if wait is not None:
            actions.requeue_after = wait
            return status, actions
        return _after_failure(tj, status, observed, actions, current, failure)
    return _while_active(tj, status, observed, actions, current)


STORAGE_OUTAGE_REASON = "StorageOutage"
OPERATOR_STORAGE_OUTAGE_REASON = "CheckpointStorageUnreadable"  # the operator's own reads, past the limit
NO_PROGRESS_REASON = "RestartsWithoutProgress"  # uncounted restarts in a row that committed nothing
# Why a job that a failure ended was given up (its failed attempt's workers go at once: `release`).
_FAILURE_GIVE_UPS = ("RestartBudgetExhausted", STORAGE_OUTAGE_REASON, NO_PROGRESS_REASON)
RELEASE_CHECK_SECONDS = 5.0  # a finished job's JobSets were deleted: look again until none is left


def release(uid: str | None, status: TrainingJobStatus, jobsets: tuple[JobSetFacts, ...]) -> Actions:
    """A finished job holds nothing: every JobSet of it still alive is deleted (its Kueue Workload, and
    with it the quota, goes with it), whichever way the job ended and whenever the operator got to it
    (one that died between the status write and the delete cleans up when it is back). A Succeeded
    job's completed JobSet is kept: none of its pods runs, and they hold the logs. The workers of an
    attempt whose failure ended the job are gone in seconds, as on a restart: they cannot save without
    their failed or hung peer; any other live workers (a policy refusal, an invalid spec) first get
    their save grace."""
    actions = Actions()
    for js in jobsets:
        if js.uid != uid or js.deleting or (status.phase == "Succeeded" and js.state == "Completed"):
            continue
        if js.state == "Failed" or (js.attempt == status.attempt and _ended_by_a_failure(status)):
            actions.delete.append(js.name)
        else:
            actions.stop.append(js.name)
    if actions.delete or actions.stop:
        actions.requeue_after = RELEASE_CHECK_SECONDS
    return actions


def _ended_by_a_failure(status: TrainingJobStatus) -> bool:
    failure = status.last_failure
    return (
        status.phase == "Failed"
        and failure is not None
        and _phase_reason(status) in (*_FAILURE_GIVE_UPS, failure.reason)
    )


def _phase_reason(status: TrainingJobStatus) -> str | None:
    return next((c.reason for c in status.conditions if c.type == status.phase and c.status == "True"), None)


def _enter(
    status: TrainingJobStatus, phase: Phase, reason: str, message: str, stage: Stage, now: datetime
) -> TrainingJobStatus:
    return _staged(with_phase(status, phase, reason, message, now), stage, now)


def _staged(status: TrainingJobStatus, stage: Stage, now: datetime) -> TrainingJobStatus:
    """Enter `stage`; its start time moves only when the stage changes."""
    if status.stage == stage and status.stage_start_time:
        return status
    return status.model_copy(update={"stage": stage, "stage_start_time": rfc3339(now)})


def _with_storage(status: TrainingJobStatus, observed: Observed, actions: Actions) -> TrainingJobStatus:
    """CheckpointStorageReachable, the error text, and when storage came back (the clocks restart there)."""
    error, previous = observed.storage_error, status.checkpoint_storage_error
    update: dict[str, object] = {"checkpoint_storage_error": error}
    if error and error != previous:
        actions.events.append(Event("Warning", "CheckpointStorageError", error))
    if previous and not error:
        update["storage_recovery_time"] = rfc3339(observed.now)
        actions.events.append(Event("Normal", "CheckpointStorageReachable", "checkpoint storage is readable again"))
    if error:  # a refusal of the operator's identity is a grant to fix, not an outage to wait out
        reason, message = ("PermissionDenied" if observed.storage_denied else "Unreachable"), error
    else:
        reason, message = "Readable", "the run directory can be read"
    update["conditions"] = set_condition(
        status.conditions, STORAGE_CONDITION, error is None, reason, message, observed.now
    )
    return status.model_copy(update=update)


def _report_restore_fallback(
    status: TrainingJobStatus, observed: Observed, previous_progress_time: str | None, actions: Actions
) -> None:
    progress = observed.progress
    if progress is None or progress.attempt != status.attempt or not progress.restore_failures:
        return
    seen = parse_time(previous_progress_time)
    restored_at = parse_time(progress.restore_finished_at) or progress.updated
    if seen is not None and seen >= restored_at:
        return  # a record of this attempt written after its restore was seen before: already reported
    broken = ", ".join(f"step {f.step} ({f.error})" for f in progress.restore_failures)
    restored = "nothing: fresh start" if progress.restored_step is None else f"step {progress.restored_step}"
    moved = ", ".join(str(q.step) for q in progress.quarantined)
    aside = f"; quarantined step(s) {moved} to quarantine/ in the run directory, bytes kept" if moved else ""
    actions.events.append(
        Event(
            "Warning",
            "RestoreFallback",
            f"attempt {status.attempt} could not restore {broken}; restored {restored}{aside}",
        )
    )


def _with_local_tier(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions
) -> TrainingJobStatus:
    """LocalCheckpointTierSaving, from the current attempt's record: False with the trainer's words when
    the local tier does not save (a volume too small for its copies, a failed save), and a Warning when
    that first shows or changes; the GCS tier goes on either way."""
    progress = observed.progress
    if tj.spec.checkpoint.local is None or progress is None or progress.attempt != status.attempt:
        return status
    problem = progress.local_tier_problem
    previous = next((c for c in status.conditions if c.type == LOCAL_TIER_CONDITION), None)
    if problem and (previous is None or previous.status == "True" or previous.message != problem):
        actions.events.append(Event("Warning", LOCAL_TIER_NOT_SAVING, problem))
    reason, message = (LOCAL_TIER_NOT_SAVING, problem) if problem else ("Saving", "the local tier saves")
    conditions = set_condition(status.conditions, LOCAL_TIER_CONDITION, problem is None, reason, message, observed.now)
    return status.model_copy(update={"conditions": conditions})


def _known_latest_step(status: TrainingJobStatus, observed: Observed) -> int | None:
    """GCS's latest committed step, or while storage cannot be read, the last one seen."""
    if observed.storage_error is None:
        return observed.latest_committed_step
    return status.latest_checkpoint.step if status.latest_checkpoint else None


def _remove_foreign(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, foreign: list[JobSetFacts]
) -> tuple[TrainingJobStatus, Actions]:
    """JobSets of an earlier TrainingJob of this name (orphaned by a --cascade=orphan delete) would
    write the same run directory: remove them, and start only when they and their pods are gone."""
    actions.requeue_after = 2.0
    for js in foreign:
        if not js.deleting:  # its workers are healthy: they get their save grace
            actions.stop.append(js.name)
            actions.events.append(
                Event("Normal", "OrphanRemoved", f"deleted JobSet {js.name} of an earlier TrainingJob named {tj.name}")
            )
    names = ", ".join(js.name for js in foreign)
    message = f"waiting for JobSets of an earlier TrainingJob of this name to go away: {names}"
    return _enter(status, "Pending", "RemovingOrphans", message, "Scheduling", observed.now), actions


def _without_jobset(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions
) -> tuple[TrainingJobStatus, Actions]:
    now = observed.now
    due = parse_time(status.next_restart_time)
    if due is not None and due > now:
        actions.requeue_after = (due - now).total_seconds()
        return _staged(status, "BackingOff", now), actions
    if observed.foreign_pods:
        actions.requeue_after = 2.0
        message = f"waiting for {observed.foreign_pods} worker pods of an earlier TrainingJob of this name to end"
        return _enter(status, "Pending", "RemovingOrphans", message, "Scheduling", now), actions
    resizing = _phase_reason(status) == elastic.RESIZING
    if ending := observed.earlier_pods + _still_running_before(status.attempt, observed):
        # Two attempts never run against one run directory: the new trainer's start-up removes every
        # uncommitted step directory, an older trainer's save in flight among them (its commit would
        # then be damaged), and an older trainer's progress record would overwrite the new one. The
        # stopped workers save on SIGTERM first, and the next attempt restores what they commit.
        actions.requeue_after = PREVIOUS_ATTEMPT_CHECK_SECONDS
        message = f"waiting for {ending} worker pods of the previous attempt to save and stop"
        if resizing:
            return _enter(status, "Restarting", elastic.RESIZING, message, "Scheduling", now), actions
        reason = _phase_reason(status) or PREVIOUS_ATTEMPT_ENDING  # a Resuming or a failure's reason is kept
        waiting = with_phase(status, status.phase or "Pending", reason, message, now)
        return _staged(waiting, "Scheduling", now), actions
    # Without storage the latest committed step is unknown: leave the choice to the trainer (-1),
    # which waits for storage at start and then restores the latest committed step itself.
    latest = observed.latest_committed_step if observed.storage_error is None else None
    actions.create_attempt = status.attempt
    actions.create_slices = status.slices
    actions.resume_step = latest
    actions.requeue_after = RECHECK_SECONDS
    status.next_restart_time = None
    status.resumed_from_step = latest
    _with_later_resume_point(status, latest)
    if status.attempt > 0 and observed.storage_error is None:
        # training goes back to the committed step; the old attempt's numbers are gone
        status.step, status.loss = latest, None
    if observed.storage_error is not None:
        where = "from the latest committed step (storage unreadable now: the trainer finds it)"
    elif latest is not None:
        where = f"from committed step {latest}"
    else:
        where = "from scratch"
    status = _staged(status, "Scheduling", now)
    if _phase_reason(status) == "JobSetRefused":
        return status, actions  # tried again; the refusal stays reported until the JobSet exists
    if resizing:
        message = f"attempt {status.attempt} resumes {where} on {elastic.slices_in_force(tj, status)} slices"
        return with_phase(status, "Restarting", elastic.RESIZING, message, now), actions
    if _phase_reason(status) == "Resuming":  # a resume that replaced a stale JobSet: nothing failed
        return with_phase(status, "Pending", "Resuming", f"attempt {status.attempt} resumes {where}", now), actions
    if status.phase is None:
        actions.events.append(Event("Normal", "Created", f"created JobSet {status.job_set_name}, starting {where}"))
        return with_phase(status, "Pending", "JobSetCreated", f"starting {where}", now), actions
    actions.events.append(
        Event("Normal", "Restored", f"attempt {status.attempt}: JobSet {status.job_set_name} resumes {where}")
    )
    return with_phase(status, "Restarting", "Restoring", f"attempt {status.attempt} resumes {where}", now), actions


def _still_writing(jobsets: Iterable[JobSetFacts], observed: Observed) -> int:
    """How many worker pods of `jobsets` may still write their run directory (facts.still_writing)."""
    return still_writing((Worker(js.attempt, p.phase, p.node) for js in jobsets for p in js.pods), observed.nodes)


def _still_running_before(attempt: int, observed: Observed) -> int:
    """Workers of attempts before `attempt` that the JobSets observed hold and that may still write (the
    attempt observed current, which this very decision replaced; observed.earlier_pods has the rest)."""
    return _still_writing((js for js in observed.jobsets if js.attempt < attempt), observed)


def _suspension_holds(tj: TrainingJob, current: JobSetFacts) -> bool:
    """Whether the current attempt is the suspension's to handle (_suspension): suspended, being
    suspended, or resuming with pods from before the resume."""
    return tj.spec.suspend or current.state == "Suspended" or current.resuming


def _holding_record_of_unrecorded_round(
    observed: Observed, status: TrainingJobStatus, current: JobSetFacts | None, tj: TrainingJob
) -> Observed:
    """The observations to fold into status: the trainer's record is held back while JobSet shows an
    in-place round the status has not recorded (the failure is decided up to a kubelet lease later): it
    may already be the restarted process's, and folding it first would make the failure's step the
    recovery's. It is folded once the round is recorded (_restarting_in_place). A suspension records no
    round, so nothing is held while it lasts: holding would only freeze status.step."""
    if current is None or not current.in_place or current.in_place_round <= status.in_place_round:
        return observed
    if _suspension_holds(tj, current):
        return observed
    return dataclasses.replace(observed, progress=None)


def _with_later_resume_point(status: TrainingJobStatus, latest: int | None) -> None:
    """A save in flight at the failure may commit after the restart was decided (the failed attempt's
    last process finishes it): the new attempt resumes from that later step, and the failure record
    says so, with the steps it did not lose given back."""
    failure = status.last_failure
    if failure is None or status.phase != "Restarting" or failure.recovery_seconds is not None or latest is None:
        return
    if moved := moved_resume_point(status.lost_steps, failure, latest):
        status.lost_steps, status.last_failure = moved


def final_step(tj: TrainingJob) -> int | None:
    """The step a run that trained to the end has committed last, as its framework reads the spec
    (frameworks/): None when the spec does not say."""
    return frameworks.for_job(tj).final_step(tj)


def _completed(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, current: JobSetFacts
) -> tuple[TrainingJobStatus, Actions]:
    """Every worker exited 0. That is success only when the final step is committed: a run whose pods
    were all stopped (an eviction, maintenance) saves and may exit 0 too (MaxText does), short of it.
    The decision reads storage afresh to know."""
    now = observed.now
    final, latest = final_step(tj), observed.latest_committed_step
    progress = observed.progress
    if final is None and progress is not None and progress.attempt == status.attempt and progress.state == "preempted":
        # The final step is unknown (TPUJOB_STEPS from a Secret, MaxText's steps=-1), but the trainer said
        # it stopped on SIGTERM, short of the end: not a success.
        message = f"JobSet {current.name} completed, but its trainer stopped on SIGTERM at step {progress.step}"
        failure = Failure("Preemption", "CompletedShort", f"{message}: its workers were stopped", None, now)
        return _after_failure(tj, status, observed, actions, current, failure)
    if final is not None and observed.storage_error is not None:
        actions.fresh_storage = True
        actions.requeue_after = STORAGE_RETRY_SECONDS
        message = (
            f"JobSet {current.name} completed; waiting for checkpoint storage to confirm the final step {final} "
            f"is committed: {observed.storage_error}"
        )
        phase: Phase = status.phase if status.phase in ("Running", "Restarting", "Pending") else "Running"
        return with_phase(status, phase, "ConfirmingCompletion", message, now), actions
    if final is not None and (latest is None or latest < final):
        committed = "no committed step" if latest is None else f"committed step {latest}"
        message = f"JobSet {current.name} completed at {committed}, short of the final step {final}"
        previous = status.last_failure
        again = previous is not None and previous.reason == "CompletedShort" and previous.resume_step == latest
        if again:  # ended early twice without a new commit: counted, so the budget bounds it
            failure = Failure("ApplicationError", "CompletedShort", f"{message}, again without progress", None, now)
        else:  # its workers were stopped and saved: a preemption, training resumes
            failure = Failure("Preemption", "CompletedShort", f"{message}: its workers were stopped", None, now)
        return _after_failure(tj, status, observed, actions, current, failure)
    status.completion_time = rfc3339(now)
    actions.events.append(Event("Normal", "Succeeded", f"training finished at step {status.step}"))
    done = with_phase(status, "Succeeded", "JobSetCompleted", f"JobSet {current.name} completed", now)
    return _staged(done, "Finished", now), actions


def _suspension(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, current: JobSetFacts
) -> tuple[TrainingJobStatus, Actions]:
    now = observed.now
    actions.requeue_after = RECHECK_SECONDS
    if current.queue_name:
        return _queued(tj, status, observed, actions, current)
    if tj.spec.suspend:
        # Suspended by the operator already: a Failed or Completed JobSet keeps that state with
        # spec.suspend set, and is neither patched nor announced again.
        if current.state == "Active" or not current.suspended_by_operator:
            actions.set_suspend = (current.name, True)
            actions.events.append(
                Event("Normal", "Suspended", f"suspended JobSet {current.name}; checkpoints are kept")
            )
        return _enter(status, "Suspended", "Suspended", "spec.suspend is true", "Suspended", now), actions
    if current.resuming:
        message = f"JobSet {current.name} is resuming"
        return _enter(status, "Pending", "Resuming", message, "Suspended", now), actions
    if not current.suspended_by_operator:
        # Someone else (a queueing system) suspended it: its decision stands until it resumes the JobSet.
        message = f"JobSet {current.name} was suspended by another controller; training resumes when it is resumed"
        return _enter(status, "Suspended", "SuspendedExternally", message, "Suspended", now), actions
    if saving := _still_writing((current,), observed):
        # The suspension's workers are still making their save: resuming now would start new workers
        # beside them, and replacing the JobSet would cut the save short.
        actions.requeue_after = PREVIOUS_ATTEMPT_CHECK_SECONDS
        message = f"waiting for {saving} worker pods of JobSet {current.name} to finish the suspension's save"
        return _enter(status, "Pending", "Resuming", message, "Suspended", now), actions
    latest = _known_latest_step(status, observed)
    if (current.resume_step == latest or observed.storage_error is not None) and not current.in_place:
        actions.set_suspend = (current.name, False)
    else:
        # Its pods would resume from a stale pinned step (the suspension saved a newer one), or, on the
        # InPlace rung, their fresh agents would join a new in-place round as if a worker had failed:
        # replace it with a fresh attempt. Not a restart: nothing failed.
        status.in_place_round = 0  # the next attempt's JobSet counts its own
        status.attempt += 1
        status.job_set_name = jobset_name(tj.name, status.attempt)
        actions.stop.append(current.name)
    actions.events.append(Event("Normal", "Resumed", "spec.suspend is false: resuming"))
    return _enter(status, "Pending", "Resuming", "resuming after suspension", "Scheduling", now), actions


def _queued(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, current: JobSetFacts
) -> tuple[TrainingJobStatus, Actions]:
    """A JobSet that Kueue manages: Kueue alone suspends and resumes it; the operator never does.

    spec.suspend still wins: Kueue would resume a JobSet the operator suspended, so the operator
    deletes it instead (its workers save on SIGTERM) and queues the next attempt once the job is
    resumed. A JobSet Kueue suspended waits for admission, or was preempted (its workers saved on
    SIGTERM): neither is a failure, and the same JobSet resumes from the latest committed step.
    """
    now = observed.now
    queue = current.queue_name
    if tj.spec.suspend:
        status.attempt += 1
        status.job_set_name = jobset_name(tj.name, status.attempt)
        actions.stop.append(current.name)
        actions.events.append(Event("Normal", "Suspended", f"deleted JobSet {current.name}; checkpoints are kept"))
        return _enter(status, "Suspended", "Suspended", "spec.suspend is true", "Suspended", now), actions
    if current.resuming:
        message = f"Kueue admitted JobSet {current.name} from queue {queue}; it is resuming"
        return _enter(status, "Pending", "Resuming", message, "Queued", now), actions
    why = f": {current.queue_reason}" if current.queue_reason else ""
    was_admitted = tj.status.queue is not None and tj.status.queue.admitted
    if was_admitted:  # Kueue took the admission back just now: the wait for it starts here, whatever the stage
        status = status.model_copy(update={"stage": "Queued", "stage_start_time": rfc3339(now)})
    if (resized := _shrunk_in_queue(tj, status, observed, actions, current, why)) is not None:
        return resized
    if was_admitted:
        actions.events.append(
            Event("Normal", "Preempted", f"Kueue suspended JobSet {current.name}{why}; it resumes when re-admitted")
        )
    elif _phase_reason(status) != "Queued":
        actions.events.append(Event("Normal", "Queued", f"JobSet {current.name} waits in Kueue queue {queue}"))
    message = f"waiting in Kueue queue {queue} for admission{why}"
    return _enter(status, "Pending", "Queued", message, "Queued", now), actions


def _without_pods_from_before_resume(current: JobSetFacts) -> JobSetFacts:
    """Pods that a suspension stopped (exit 143 after their save) are history once the JobSet resumed."""
    resumed = current.resumed_at
    if resumed is None:
        return current
    kept = tuple(p for p in current.pods if p.created is None or p.created >= resumed)
    return dataclasses.replace(current, pods=kept)


def _as_watched(observed: Observed, current: JobSetFacts) -> JobSetFacts:
    """`current` with every pod the watch shows, those from before its last resume included."""
    return next((js for js in observed.jobsets if js.name == current.name), current)


def _pods_that_may_train(observed: Observed, current: JobSetFacts) -> tuple[PodFacts, ...]:
    """The attempt's pods whose trainers may still run: the current ones, and those from before the last
    resume that never ended (stuck on a node whose kubelet is cut off, their trainers still write)."""
    watched = _as_watched(observed, current).pods
    stuck = tuple(p for p in watched if p not in current.pods and p.phase not in POD_ENDED_PHASES)
    return (*current.pods, *stuck)


def _clock_floor(status: TrainingJobStatus, current: JobSetFacts) -> datetime:
    """No clock counts time before the attempt's JobSet existed, before it was last resumed, or
    while checkpoint storage could not be read."""
    recovered = parse_time(status.storage_recovery_time)
    return max(t for t in (current.created, current.resumed_at, recovered) if t is not None)


def _until(now: datetime, since: datetime, timeout_seconds: int, at_most: float) -> float:
    """Seconds until a stage clock that started at `since` expires (just after it), at most `at_most`."""
    if timeout_seconds <= 0:
        return at_most
    left = timeout_seconds - (now - since).total_seconds()
    return max(0.5, min(at_most, left + 0.5))


def _stuck_pod(pods: tuple[PodFacts, ...]) -> PodFacts | None:
    return next((p for p in pods if p.waiting_reason in _STUCK_WAITING_REASONS), None)


def _while_active(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, current: JobSetFacts
) -> tuple[TrainingJobStatus, Actions]:
    now = observed.now
    policy = tj.spec.restart
    actions.requeue_after = STORAGE_RETRY_SECONDS
    waiting_phase: Phase = "Restarting" if status.phase == "Restarting" else "Pending"
    if observed.storage_error is not None:
        # Progress is unknown, so no clock may decide anything: keep what was known and say why, for at
        # most STORAGE_OUTAGE_LIMIT_SECONDS; past it an attempt that may be hung holds its slices no longer.
        if (blind := _storage_unreadable_for(status, now)) > STORAGE_OUTAGE_LIMIT_SECONDS:
            return _blind_too_long(tj, status, observed, actions, blind)
        message = f"checkpoint storage unreadable, no timeout applies until it is back: {observed.storage_error}"
        phase = status.phase if status.phase in ("Running", "Restarting", "Pending") else waiting_phase
        reason = "StoragePermissionDenied" if observed.storage_denied else "StorageUnreachable"
        return with_phase(status, phase or "Pending", reason, message, now), actions
    floor = _clock_floor(status, current)
    started = current.resumed_at or current.created
    progress = observed.progress
    progressing = progress is not None and progress.attempt == status.attempt and progress.updated >= started
    scheduled = [p.scheduled_at for p in current.pods if p.scheduled_at is not None]
    expected = current.expected_pods or len(current.pods)

    if not progressing and (len(scheduled) < expected or expected == 0):
        status = _staged(status, "Scheduling", now)
        actions.requeue_after = _until(now, floor, policy.scheduling_timeout_seconds, RECHECK_SECONDS)
        if expired(now, floor, policy.scheduling_timeout_seconds):
            timeout = f"{len(scheduled)}/{expected} worker pods scheduled after {policy.scheduling_timeout_seconds}s"
            failure = Failure("SchedulingTimeout", "SchedulingTimeout", timeout, None, now)
            return _after_failure(tj, status, observed, actions, current, failure)
        unschedulable = next((p.unschedulable_message for p in current.pods if p.unschedulable_message), None)
        if unschedulable and (resized := _shrunk(tj, status, observed, actions, current, floor, unschedulable)):
            return resized
        # The scheduler's reason first: with exclusive placement JobSet refuses the other pods of a
        # slice until its leader pod is placed, so their refusal is the consequence, not the cause.
        if unschedulable:
            reason, message = "Unschedulable", unschedulable
        elif current.pod_creation_refused:
            reason, message = "PodCreationRefused", current.pod_creation_refused
        else:
            reason, message = "Scheduling", f"{len(scheduled)}/{expected} worker pods scheduled"
        return with_phase(status, waiting_phase, reason, message, now), actions

    if not progressing:
        status = _staged(status, "StartingUp", now)
        since = max([floor, *scheduled])
        actions.requeue_after = _until(now, since, policy.startup_timeout_seconds, STARTUP_CHECK_SECONDS)
        if expired(now, since, policy.startup_timeout_seconds):
            timeout = f"no step within {policy.startup_timeout_seconds}s of all pods being scheduled"
            failure = Failure("StartupTimeout", "StartupTimeout", timeout, None, now)
            return _after_failure(tj, status, observed, actions, current, failure)
        stuck = _stuck_pod(current.pods)
        if stuck is not None:
            reason = stuck.waiting_reason or "Starting"
            message = f"pod {stuck.name}: {stuck.waiting_message or reason}"
        else:
            reason, message = "Starting", f"JobSet {current.name} is starting (image pull, restore, compilation)"
        return with_phase(status, waiting_phase, reason, message, now), actions

    status = _staged(status, "Training", now)
    status.storage_unavailable_since = None  # this attempt reached storage and trains: no outage streak
    last_progress = parse_time(status.last_progress_time) or floor
    since = max(floor, last_progress)
    actions.requeue_after = _until(now, since, policy.hang_timeout_seconds, RECHECK_SECONDS)
    if expired(now, since, policy.hang_timeout_seconds):
        silence = f"no step progress for {policy.hang_timeout_seconds}s (last at {rfc3339(last_progress)})"
        hang = Failure("Hang", "NoProgress", silence, None, now)
        if observed.nodes is not None:  # a node that went unreachable in the silence: not the job's hang
            pods = _pods_that_may_train(observed, current)
            hang = with_node_evidence(hang, pods, observed.nodes, since, now, policy.hang_timeout_seconds)
        return _after_failure(tj, status, observed, actions, current, hang)
    if (resized := _grown(tj, status, observed, actions, current)) is not None:
        return resized
    if status.phase != "Running":
        actions.events.append(Event("Normal", "Running", f"attempt {status.attempt} is training (step {status.step})"))
    message = f"training at step {status.step}"
    if progress is not None and progress.blocked_in_save_at:  # why the step stands still, before the hang clock says
        message += f"; blocked in a checkpoint save since {progress.blocked_in_save_at}"
    return with_phase(status, "Running", "Training", message, now), actions


def _storage_unreadable_for(status: TrainingJobStatus, now: datetime) -> float:
    """Seconds the operator has been unable to read checkpoint storage (its condition's last flip)."""
    condition = next((c for c in status.conditions if c.type == STORAGE_CONDITION and c.status == "False"), None)
    since = parse_time(condition.last_transition_time) if condition is not None else None
    return (now - since).total_seconds() if since is not None else 0.0


def _blind_too_long(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, blind: float
) -> tuple[TrainingJobStatus, Actions]:
    """The operator could not read storage for longer than the limit: the job ends, uncounted, and its
    workers are stopped with their save grace (a healthy trainer saves its step, a hung one frees its
    slices). Re-created once storage answers, it resumes from what they committed."""
    message = (
        f"the operator could not read checkpoint storage for {blind:.0f}s (more than {STORAGE_OUTAGE_LIMIT_SECONDS}s): "
        f"{observed.storage_error}; its progress is unknown, so its workers were stopped (they save first): "
        "re-create the job once gs://" + _bucket(tj) + " can be read by the operator"
    )
    return _give_up(tj, status, observed, actions, OPERATOR_STORAGE_OUTAGE_REASON, message)


def _shrunk(
    tj: TrainingJob,
    status: TrainingJobStatus,
    observed: Observed,
    actions: Actions,
    current: JobSetFacts,
    since: datetime,
    unschedulable: str,
) -> tuple[TrainingJobStatus, Actions] | None:
    """spec.elastic: a slice unschedulable for shrinkAfterSeconds makes the next attempt the largest
    allowed size the placed slices fill. The attempt has trained nothing (it is still scheduling):
    its pods go at once. None: wait on (not elastic, not long enough, or no smaller size fits)."""
    hosts = slice_shape(tj.spec.tpu.accelerator, tj.spec.tpu.topology).hosts
    now_slices = elastic.slices_in_force(tj, status, current)
    target = elastic.shrink_to(tj, now_slices, elastic.placed_slices(current, hosts))
    if target is None:
        return None
    cause = f"{now_slices - target} of {now_slices} slices unschedulable"
    return _shrunk_when_due(
        tj, status, observed, actions.delete, actions, current, since, now_slices, target, cause, f": {unschedulable}"
    )


def _shrunk_in_queue(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, current: JobSetFacts, why: str
) -> tuple[TrainingJobStatus, Actions] | None:
    """spec.elastic under Kueue: an attempt its queue has not admitted for shrinkAfterSeconds goes one
    allowed size down (its Workload asks for that much less quota). Kueue keeps a JobSet it has not
    admitted suspended; one it preempted may still have workers making their suspension's save, so
    they are stopped with their grace, never cut short."""
    since = parse_time(status.stage_start_time) if status.stage == "Queued" else None
    if since is None or _phase_reason(status) != "Queued":
        return None
    now_slices = elastic.slices_in_force(tj, status, current)
    target = elastic.shrink_to(tj, now_slices, now_slices - 1)
    if target is None:
        return None
    cause = f"not admitted by Kueue queue {current.queue_name}"
    return _shrunk_when_due(tj, status, observed, actions.stop, actions, current, since, now_slices, target, cause, why)


def _shrunk_when_due(
    tj: TrainingJob,
    status: TrainingJobStatus,
    observed: Observed,
    removal: list[str],
    actions: Actions,
    current: JobSetFacts,
    since: datetime,
    before: int,
    target: int,
    cause: str,
    detail: str,
) -> tuple[TrainingJobStatus, Actions] | None:
    """Shrink from `before` to `target` slices once `cause` has lasted shrinkAfterSeconds from `since`,
    the current JobSet going by `removal` (actions.delete or actions.stop); until then, be woken when it has."""
    spec = tj.spec.elastic
    if spec is None:
        return None
    waited = (observed.now - since).total_seconds()
    if waited < spec.shrink_after_seconds:
        actions.requeue_after = min(actions.requeue_after or RECHECK_SECONDS, spec.shrink_after_seconds - waited)
        return None
    message = f"{cause} for {waited:.0f}s (shrinkAfterSeconds {spec.shrink_after_seconds}){detail}"
    removal.append(current.name)
    return _resize(tj, status, observed, actions, before, target, elastic.CAPACITY_LOST, message)


def _grown(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, current: JobSetFacts
) -> tuple[TrainingJobStatus, Actions] | None:
    """spec.elastic below full size: enough ready TPU node pools, free of any pod holding TPU chips, make
    the next attempt larger, at least elastic.grow_cooldown_seconds after the last resize. The
    workers are stopped with their own grace, so they save on SIGTERM (checkpoint.saveOnPreemption),
    and the larger attempt starts once they are gone, from what they committed."""
    now_slices = elastic.slices_in_force(tj, status, current)
    target = elastic.grow_to(tj, now_slices, observed.spare_pools)
    if target is None:
        return None
    if (wait := elastic.grow_wait(tj, status, observed.now)) > 0:  # bounds the resizes in any window
        actions.requeue_after = min(actions.requeue_after or RECHECK_SECONDS, wait + 0.5)
        return None
    message = f"{observed.spare_pools} more TPU node pools of {tj.spec.tpu.topology} ready"
    actions.stop.append(current.name)
    return _resize(tj, status, observed, actions, now_slices, target, elastic.CAPACITY_RETURNED, message)


def _resize(
    tj: TrainingJob,
    status: TrainingJobStatus,
    observed: Observed,
    actions: Actions,
    before: int,
    after: int,
    reason: str,
    message: str,
) -> tuple[TrainingJobStatus, Actions]:
    """Move to the next attempt on `after` slices: no failure, no restart counted, nothing lost that the
    committed steps hold."""
    now = observed.now
    status.in_place_round = 0
    status.attempt += 1
    status.job_set_name = jobset_name(tj.name, status.attempt)
    status.slices = after
    status.resizes += 1
    status.last_resize = ResizeRecord(
        time=rfc3339(now),
        from_slices=before,
        to_slices=after,
        reason=reason,
        message=message,
        attempt=status.attempt,
        step=_known_latest_step(status, observed),
    )
    verb = "shrinks" if after < before else "grows"
    told = f"{verb} from {before} to {after} slices (attempt {status.attempt}): {message}"
    actions.events.append(Event("Warning" if after < before else "Normal", "Resized", told))
    actions.requeue_after = 2.0  # the next decision creates the attempt, once the stopped pods are gone
    return _enter(status, "Restarting", elastic.RESIZING, told, "Scheduling", now), actions


def _after_failure(
    tj: TrainingJob,
    status: TrainingJobStatus,
    observed: Observed,
    actions: Actions,
    current: JobSetFacts,
    failure: Failure,
    rung: RestartStrategy = RECREATE,
    counted: bool | None = None,
    rounds: int = 1,
) -> tuple[TrainingJobStatus, Actions]:
    """Record `failure` and restart on `rung` (InPlace: JobSet restarts the workers, `rounds` of its
    in-place restarts are accounted for), or end the job when no restart may follow. `counted`
    overrides the failure kind's word on the budget (False: a failure already charged)."""
    now = observed.now
    policy = tj.spec.restart
    if failure.kind == "StoragePermissionDenied":
        failure = dataclasses.replace(failure, message=f"{failure.message}: {_permission_advice(tj, current)}")
    counted = counts_against_budget(failure.kind, policy) if counted is None else counted
    latest = _known_latest_step(status, observed)
    previous_resume = status.last_failure.resume_step if status.last_failure is not None else None
    status.uncounted_restarts_without_progress = uncounted_streak(
        status.uncounted_restarts_without_progress, counted, previous_resume, latest
    )
    progress = observed.progress
    reported_step = status.step if progress is not None and progress.attempt == status.attempt else None
    lost = max(0, reported_step - (latest if latest is not None else 0)) if reported_step is not None else None
    # A fresh record: nothing of the previous failure may survive in it.
    status.last_failure = FailureRecord(
        time=rfc3339(failure.time or now),
        kind=failure.kind,
        reason=failure.reason,
        message=failure.message,
        slice=failure.slice,
        step=reported_step,
        resume_step=latest,
        lost_steps=lost,
        counted=counted,
        timeline=FailureTimeline(failed=rfc3339_precise(failure.time or now), detected=rfc3339_precise(now)),
        evidence=_evidence_record(failure),
    )
    status.lost_steps += lost or 0
    where = f"slice {failure.slice}" if failure.slice is not None else "a slice"
    actions.events.append(Event("Warning", "FailureDetected", f"{failure.kind} on {where}: {failure.message}"))
    if failure.kind == "StorageUnavailable":  # an outage the workers keep meeting ends the job, in time
        since = parse_time(status.storage_unavailable_since) or failure.time or now
        status.storage_unavailable_since = rfc3339(since)
        if (now - since).total_seconds() > STORAGE_OUTAGE_LIMIT_SECONDS:
            message = (
                f"checkpoint storage unreachable from the workers in every attempt since {rfc3339(since)}, more "
                f"than {STORAGE_OUTAGE_LIMIT_SECONDS} s: {failure.message}; check that gs://"
                f"{_bucket(tj)} is reachable from the "
                "nodes, then re-create the job"
            )
            return _give_up(tj, status, observed, actions, STORAGE_OUTAGE_REASON, message)
    else:
        status.storage_unavailable_since = None
    if failure.kind in TERMINAL_KINDS:
        status.completion_time = rfc3339(now)
        actions.events.append(Event("Warning", failure.reason, f"{failure.message}; no restart can fix this"))
        failed = with_phase(status, "Failed", failure.reason, failure.message, now)
        return _given_up(tj, _staged(failed, "Finished", now), observed, actions)
    if status.uncounted_restarts_without_progress > MAX_UNCOUNTED_RESTARTS_WITHOUT_PROGRESS:
        message = (
            f"{MAX_UNCOUNTED_RESTARTS_WITHOUT_PROGRESS} restarts after infrastructure failures in a row committed no "
            f"new step (still {latest}); last failure: {failure.kind}: {failure.message}; none was counted: "
            "look at the node pool's health and the workers' start-up, then re-create the job"
        )
        return _give_up(tj, status, observed, actions, NO_PROGRESS_REASON, message)
    if counted and not budget_left(policy, status.counted_restarts + rounds - 1):
        actions.events.append(
            Event(
                "Warning",
                "RestartBudgetExhausted",
                f"{status.counted_restarts} counted restarts used of {policy.max_restarts}",
            )
        )
        status.completion_time = rfc3339(now)
        used = f"{status.counted_restarts}/{policy.max_restarts}"
        message = f"restart budget exhausted ({used}); last failure: {failure.kind}: {failure.message}"
        failed = _enter(status, "Failed", "RestartBudgetExhausted", message, "Finished", now)
        return _given_up(tj, failed, observed, actions)
    status.restarts += rounds
    status.counted_restarts += int(counted) * rounds
    status.last_failure = status.last_failure.model_copy(update={"rung": rung})
    if rung == IN_PLACE:
        return _restarting_in_place(tj, status, observed, actions, current, latest)
    status.in_place_round = 0  # the next attempt's JobSet counts its own
    delay = backoff(policy, status.counted_restarts, counted)
    status.attempt += 1
    status.job_set_name = jobset_name(tj.name, status.attempt)
    status.next_restart_time = rfc3339(now + delay)
    actions.delete.append(current.name)
    actions.requeue_after = delay.total_seconds()
    resume = f"committed step {latest}" if latest is not None else "scratch"
    actions.events.append(
        Event(
            "Normal",
            "Restarting",
            f"restart {status.restarts} (attempt {status.attempt}) in {delay.total_seconds():.0f}s from {resume}",
        )
    )
    message = f"{failure.kind} ({failure.reason}); attempt {status.attempt} resumes from {resume}"
    status = with_phase(status, "Restarting", failure.reason, message, now)
    if delay.total_seconds() <= 0:  # no backoff: the next attempt is created by this decision
        return _without_jobset(tj, status, observed, actions)
    return _staged(status, "BackingOff", now), actions


def _last_failure_time(status: TrainingJobStatus) -> datetime | None:
    return parse_time(status.last_failure.time) if status.last_failure is not None else None


def _in_place(
    tj: TrainingJob,
    status: TrainingJobStatus,
    observed: Observed,
    actions: Actions,
    current: JobSetFacts,
) -> tuple[TrainingJobStatus, Actions]:
    """The InPlace rung: JobSet's agents restart the workers on their nodes. Each restart round JobSet
    begins is recorded as a failure, classified and charged as a Recreate's would be; the operator
    climbs to Recreate when the rung is spent (a round past inPlace.maxRestarts) or when a round has
    trained no step inPlace.recoveryDeadlineSeconds after its failure. JobSet's own counter is the
    truth of how many rounds there were: an operator that dies before recording one records it later."""
    now = observed.now
    rung = tj.spec.restart.in_place
    failed = (classify_pod(p) for p in current.pods)
    terminal = next((f for f in failed if f is not None and f.kind in TERMINAL_KINDS), None)
    if terminal is not None:  # its container is not restarted (jobset.py): nothing can fix it
        return _after_failure(tj, status, observed, actions, current, terminal)
    if current.in_place_round > status.in_place_round:
        if current.pods_in_place_round < current.in_place_round:
            # JobSet's counters are ahead of the pods the watch delivered: the pod that explains the
            # round (a failed run, a replacement) has not arrived yet.
            actions.requeue_after = POD_NEWS_RECHECK_SECONDS
            return status, actions
        # Over every pod the watch shows: it may still show an earlier resume's pods, whose agents began it.
        if _begun_by_resume(_as_watched(observed, current)):  # nothing failed: the round to count from
            status.in_place_round = current.in_place_round
            return _while_active(tj, status, observed, actions, current)
        failure = classify_in_place_round(
            current, _last_failure_time(status), status.in_place_round, observed.nodes, now
        )
        if (wait := node_verdict_wait(current, failure, observed.nodes, now)) is not None:
            actions.requeue_after = wait
            return status, actions
        climb: RestartStrategy = RECREATE if current.in_place_round > rung.max_restarts else IN_PLACE
        rounds = current.in_place_round - status.in_place_round
        return _after_failure(tj, status, observed, actions, current, failure, climb, rounds=rounds)
    last = status.last_failure
    if last is None or last.rung != IN_PLACE or last.recovery_seconds is not None or status.phase != "Restarting":
        return _while_active(tj, status, observed, actions, current)
    if observed.storage_error is not None:  # progress unknown: _while_active says so, no clock decides
        return _while_active(tj, status, observed, actions, current)
    since = max(parse_time(last.time) or now, _clock_floor(status, current))
    if expired(now, since, rung.recovery_deadline_seconds):
        message = (
            f"no step trained {rung.recovery_deadline_seconds}s after the in-place restart that followed "
            f"{last.kind} ({last.message})"
        )
        stalled = Failure(last.kind, "InPlaceRestartStalled", message, last.slice, now)
        return _after_failure(tj, status, observed, actions, current, stalled, counted=False)
    actions.requeue_after = _until(now, since, rung.recovery_deadline_seconds, STARTUP_CHECK_SECONDS)
    return status, actions


def _begun_by_resume(current: JobSetFacts) -> bool:
    """A round begun by a resume: Kueue suspended the JobSet (its pods went) and admitted it again, and
    the new pods' fresh agents joined the next round as a replaced worker's would. Every pod shows that
    round with its container never restarted and none failed; a worker's failure leaves a restarted or
    failed pod, and a replaced worker's round restarts the others (the pod watch shows the round only
    with the restart: the agent annotates it once its container is back)."""
    return (
        current.queue_name is not None
        and current.resumed_at is not None
        and bool(current.pods)
        and all(
            p.restart_count == 0 and p.phase != "Failed" and p.in_place_attempt == current.in_place_round
            for p in current.pods
        )
    )


def _restarting_in_place(
    tj: TrainingJob,
    status: TrainingJobStatus,
    observed: Observed,
    actions: Actions,
    current: JobSetFacts,
    latest: int | None,
) -> tuple[TrainingJobStatus, Actions]:
    rung = tj.spec.restart.in_place
    status.in_place_restarts += current.in_place_round - status.in_place_round
    status.in_place_round = current.in_place_round
    resume = f"the newest committed step (GCS: {latest})" if latest is not None else "the newest committed step"
    message = (
        f"restart {status.restarts} in place (round {current.in_place_round} of {rung.max_restarts}): the same pods "
        f"restart on their nodes and resume from {resume}"
    )
    actions.events.append(Event("Normal", "RestartingInPlace", message))
    actions.fresh_storage = True  # the resume point and the steps lost, from a listing made for this decision
    actions.requeue_after = _until(observed.now, observed.now, rung.recovery_deadline_seconds, STARTUP_CHECK_SECONDS)
    status = with_phase(status, "Restarting", "RestartingInPlace", message, observed.now)
    # The record held while the round was unrecorded: the restarted process's restored step, if it is
    # that far, is the failure's resume point (status.moved_resume_point).
    status = with_observations(status, observed)
    return _staged(status, "StartingUp", observed.now), actions


def _bucket(tj: TrainingJob) -> str:
    return tj.spec.checkpoint.directory.removeprefix("gs://").partition("/")[0]


def _permission_advice(tj: TrainingJob, current: JobSetFacts) -> str:
    """Which bucket refused whom, and what fixes it (no restart does); with the trainer's own word when
    its termination message gives it (the bucket, the GCP identity it ran as, the error)."""
    bucket = _bucket(tj)
    account = tj.spec.service_account_name or "default"
    denied = ExitCode.STORAGE_PERMISSION_DENIED
    said = next((p.termination_message for p in current.pods if p.termination_message and p.exit_code == denied), None)
    trainer = f" (the trainer: {said.removeprefix(STORAGE_DENIED_PREFIX)[:400]})" if said else ""
    return (
        f"the workers' identity (ServiceAccount {tj.namespace}/{account}, through Workload Identity its GCP "
        f"service account) may not use bucket gs://{bucket}{trainer}: grant it roles/storage.objectUser on the "
        "bucket, then re-create the job"
    )


def _give_up(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, reason: str, message: str
) -> tuple[TrainingJobStatus, Actions]:
    """End the job Failed for `reason`, a Warning Event saying `message`; it releases what it holds."""
    status.completion_time = rfc3339(observed.now)
    actions.events.append(Event("Warning", reason, message))
    failed = _enter(status, "Failed", reason, message, "Finished", observed.now)
    return _given_up(tj, failed, observed, actions)


def _given_up(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions
) -> tuple[TrainingJobStatus, Actions]:
    """The job failed: its JobSets go in the decision that says so (and again at every reconcile of the
    finished job until none is left: `release`)."""
    released = release(tj.metadata.get("uid"), status, observed.jobsets)
    actions.delete += [n for n in released.delete if n not in actions.delete]
    actions.stop += [n for n in released.stop if n not in actions.stop and n not in actions.delete]
    actions.requeue_after = released.requeue_after
    return status, actions


def _evidence_record(failure: Failure) -> FailureEvidence | None:
    """What the nodes said, recorded with the decision it made (the status write precedes every action)."""
    found = failure.evidence
    if found is None:
        return None
    return FailureEvidence(
        node=found.node, pod=found.pod, signal=found.reason, detail=found.detail, since=rfc3339(found.since)
    )


def with_creation_refused(status: TrainingJobStatus, message: str, permanent: bool, now: datetime) -> TrainingJobStatus:
    """The apiserver (schema, quota, admission) refused the attempt's JobSet. A refusal that only a
    spec change can fix (invalid) fails the job; one that may pass later (quota, policy) keeps it
    Pending and is tried again at the next reconcile."""
    text = f"the apiserver refused JobSet {status.job_set_name}: {message}"
    if permanent:
        status = status.model_copy(update={"completion_time": rfc3339(now)})
        return _enter(status, "Failed", "JobSetRefused", text, "Finished", now)
    return with_phase(status, "Pending", "JobSetRefused", text, now)


# Refusals that only a spec change can fix; others (quota: 403, overload: 429/5xx) may pass later.
PERMANENT_REFUSALS = (400, 422)


def after_creation_refused(
    status: TrainingJobStatus, refused: CreationRefused, now: datetime
) -> tuple[TrainingJobStatus, Actions]:
    """The decision on a JobSet the apiserver refused (apply's observation): Failed if only a spec
    change can fix it (a foreign JobSet holding the name is not one: it may go), else Pending and
    tried again; a JobSetRefused Event either way."""
    permanent = refused.code in PERMANENT_REFUSALS
    told = Actions(events=[Event("Warning", "JobSetRefused", refused.message)])
    return with_creation_refused(status, refused.message, permanent, now), told
