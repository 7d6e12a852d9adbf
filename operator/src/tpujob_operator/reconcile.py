"""The operator's whole decision as one pure function: (TrainingJob, observed facts) -> (status, actions).

Level-triggered: it looks only at the TrainingJob's status and the world as observed now, so it is
safe to run after an operator restart, twice in a row, or from any event.
"""

from __future__ import annotations

from .api import FailureRecord, TrainingJob, TrainingJobStatus
from .facts import Actions, Event, JobSetFacts, Observed
from .jobset import jobset_name
from .restarts import Failure, backoff, budget_left, classify_jobset_failure, counts_against_budget, hung
from .status import parse_time, rfc3339, with_observations, with_phase

TERMINAL_PHASES = ("Succeeded", "Failed")
# How often a running job is re-examined without events (progress, hang, new checkpoints).
POLL_SECONDS = 10.0


def reconcile(tj: TrainingJob, observed: Observed) -> tuple[TrainingJobStatus, Actions]:
    now = observed.now
    status = tj.status.model_copy(update={"observed_generation": tj.metadata.get("generation")})
    actions = Actions()
    if status.start_time is None:
        status.start_time = rfc3339(now)
    live = [js for js in observed.jobsets if not js.deleting]
    # Adopt a JobSet created just before an operator crash, before its attempt reached status.
    attempt = max([status.attempt, *(js.attempt for js in live)])
    status.attempt = attempt
    status.job_set_name = jobset_name(tj.name, attempt)
    current = next((js for js in live if js.attempt == attempt), None)
    actions.delete = [js.name for js in live if js.attempt < attempt]
    status = with_observations(status, observed)
    if observed.storage_error != status.checkpoint_storage_error:
        if observed.storage_error:
            actions.events.append(Event("Warning", "CheckpointStorageError", observed.storage_error))
        status.checkpoint_storage_error = observed.storage_error

    if status.phase in TERMINAL_PHASES:
        return status, actions
    if current is None:
        return _without_jobset(tj, status, observed, actions)
    if current.state == "Completed":
        status.completion_time = rfc3339(now)
        actions.events.append(Event("Normal", "Succeeded", f"training finished at step {status.step}"))
        return with_phase(status, "Succeeded", "JobSetCompleted", f"JobSet {current.name} completed", now), actions
    # A failed worker fails the attempt (every Job has backoffLimit 0). Acting on the pod, not on the
    # JobSet's Failed condition, saves the time the Job controller spends waiting for the slice's
    # other pods to terminate before it marks the Job failed.
    if current.state == "Failed" or any(p.phase == "Failed" for p in current.pods):
        return _after_failure(tj, status, observed, actions, current, classify_jobset_failure(current))
    return _while_active(tj, status, observed, actions, current)


def _without_jobset(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions
) -> tuple[TrainingJobStatus, Actions]:
    now = observed.now
    due = parse_time(status.next_restart_time)
    if due is not None and due > now:
        actions.requeue_after = (due - now).total_seconds()
        return status, actions
    actions.create_attempt = status.attempt
    actions.resume_step = observed.latest_committed_step
    actions.requeue_after = POLL_SECONDS
    status.next_restart_time = None
    status.resumed_from_step = observed.latest_committed_step
    if status.attempt > 0:  # training goes back to the committed step; the old attempt's numbers are gone
        status.step, status.loss = observed.latest_committed_step, None
    where = (
        f"from committed step {observed.latest_committed_step}"
        if observed.latest_committed_step is not None
        else "from scratch"
    )
    if status.phase is None:
        actions.events.append(Event("Normal", "Created", f"created JobSet {status.job_set_name}, starting {where}"))
        return with_phase(status, "Pending", "JobSetCreated", f"starting {where}", now), actions
    actions.events.append(
        Event("Normal", "Restored", f"attempt {status.attempt}: JobSet {status.job_set_name} resumes {where}")
    )
    return with_phase(status, "Restarting", "Restoring", f"attempt {status.attempt} resumes {where}", now), actions


def _while_active(
    tj: TrainingJob, status: TrainingJobStatus, observed: Observed, actions: Actions, current: JobSetFacts
) -> tuple[TrainingJobStatus, Actions]:
    now = observed.now
    actions.requeue_after = POLL_SECONDS
    if tj.spec.suspend:
        if current.state != "Suspended":
            actions.set_suspend = (current.name, True)
            actions.events.append(
                Event("Normal", "Suspended", f"suspended JobSet {current.name}; checkpoints are kept")
            )
        return with_phase(status, "Suspended", "Suspended", "spec.suspend is true", now), actions
    if current.state == "Suspended":
        if current.resume_step == observed.latest_committed_step:
            actions.set_suspend = (current.name, False)
        else:
            # Its pods would resume from a stale pinned step: replace it with a fresh attempt.
            status.attempt += 1
            status.job_set_name = jobset_name(tj.name, status.attempt)
            actions.delete.append(current.name)
        actions.events.append(Event("Normal", "Resumed", "spec.suspend is false: resuming"))
        return with_phase(status, "Pending", "Resuming", "resuming after suspension", now), actions

    progressing = observed.progress is not None and observed.progress.attempt == status.attempt
    last_progress = parse_time(status.last_progress_time) if progressing else current.created
    if last_progress is not None and hung(now, last_progress, tj.spec.restart.hang_timeout_seconds):
        hang = Failure(
            "Hang",
            "NoProgress",
            f"no step progress for {tj.spec.restart.hang_timeout_seconds}s (last at {rfc3339(last_progress)})",
            None,
            now,
        )
        return _after_failure(tj, status, observed, actions, current, hang)
    if not progressing:
        unschedulable = next((p.unschedulable_message for p in current.pods if p.unschedulable_message), None)
        if unschedulable:
            return with_phase(status, "Pending", "Unschedulable", unschedulable, now), actions
        return with_phase(
            status,
            status.phase if status.phase == "Restarting" else "Pending",
            "Starting",
            f"JobSet {current.name} is starting",
            now,
        ), actions
    if status.phase != "Running":
        actions.events.append(Event("Normal", "Running", f"attempt {status.attempt} is training (step {status.step})"))
    return with_phase(status, "Running", "Training", f"training at step {status.step}", now), actions


def _after_failure(
    tj: TrainingJob,
    status: TrainingJobStatus,
    observed: Observed,
    actions: Actions,
    current: JobSetFacts,
    failure: Failure,
) -> tuple[TrainingJobStatus, Actions]:
    now = observed.now
    policy = tj.spec.restart
    counted = counts_against_budget(failure.kind, policy)
    latest = observed.latest_committed_step
    reported_step = (
        status.step if observed.progress is not None and observed.progress.attempt == status.attempt else None
    )
    lost = max(0, reported_step - (latest if latest is not None else 0)) if reported_step is not None else None
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
    )
    status.lost_steps += lost or 0
    where = f"slice {failure.slice}" if failure.slice is not None else "a slice"
    actions.events.append(Event("Warning", "FailureDetected", f"{failure.kind} on {where}: {failure.message}"))
    if counted and not budget_left(policy, status.counted_restarts):
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
        return with_phase(status, "Failed", "RestartBudgetExhausted", message, now), actions
    status.restarts += 1
    status.counted_restarts += int(counted)
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
    return with_phase(status, "Restarting", failure.reason, message, now), actions
