"""Pure status aggregation: conditions, progress and checkpoint facts -> TrainingJob status fields."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

import tpujob_contract as contract

from .api import IN_PLACE, CheckpointCadence, CheckpointRef, Condition, FailureRecord, Phase, TrainingJobStatus
from .facts import Observed

# One condition per phase, so `kubectl wait --for=condition=Succeeded` works and the reason of the
# current phase (e.g. Pending/Unschedulable) is one lookup away.
CONDITION_TYPES: tuple[Phase, ...] = ("Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed")


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# With microseconds: for clocks that add up many short intervals (the goodput ledger, the timeline).
rfc3339_precise = contract.format_time
parse_time = contract.parse_time


def set_condition(
    conditions: list[Condition], type_: str, status: bool, reason: str, message: str, now: datetime
) -> list[Condition]:
    """Upsert one condition; lastTransitionTime moves only when the status flips."""
    wanted: Literal["True", "False"] = "True" if status else "False"
    previous = next((c for c in conditions if c.type == type_), None)
    transition = previous.last_transition_time if previous and previous.status == wanted else rfc3339(now)
    updated = Condition(type=type_, status=wanted, reason=reason, message=message, last_transition_time=transition)
    return [c for c in conditions if c.type != type_] + [updated]


def with_phase(status: TrainingJobStatus, phase: Phase, reason: str, message: str, now: datetime) -> TrainingJobStatus:
    """Move to `phase`: its condition becomes True with the reason, every other one False. A False
    condition says only which phase replaced it: the current message belongs to the True one."""
    conditions = list(status.conditions)
    # A phase a newer operator wrote has its condition too: it is False once this one moves on.
    unknown = (status.phase,) if status.phase and status.phase not in CONDITION_TYPES else ()
    for type_ in (*CONDITION_TYPES, *unknown):
        if type_ == phase:
            conditions = set_condition(conditions, type_, True, reason, message, now)
        elif any(c.type == type_ for c in conditions):
            conditions = set_condition(conditions, type_, False, phase, f"the job is {phase}", now)
    return status.model_copy(update={"phase": phase, "conditions": conditions})


def with_observations(status: TrainingJobStatus, observed: Observed) -> TrainingJobStatus:
    """Fold the trainer's progress record and GCS's latest committed step into status."""
    update: dict[str, object] = {}
    latest = observed.latest_committed_step
    if latest is not None:
        previous = status.latest_checkpoint
        if previous is None or previous.step != latest:
            update["latest_checkpoint"] = CheckpointRef(step=latest, time=rfc3339(observed.now))
    progress = observed.progress
    if progress is not None and progress.attempt == status.attempt:
        # The step actually restored: the trainer falls back to an older one when the pinned step is broken.
        restored = progress.restored_step if progress.restored_step is not None else progress.resumed_from_step
        update.update(
            step=progress.step,
            loss=progress.loss,
            save_failures=progress.save_failures or None,
            last_progress_time=rfc3339(progress.updated),
            resumed_from_step=restored,
        )
        quarantined = {q.step for q in progress.quarantined}
        if not quarantined <= set(status.quarantined_checkpoints):
            update["quarantined_checkpoints"] = sorted({*status.quarantined_checkpoints, *quarantined})
        if progress.checkpoint_interval_seconds is not None:  # policy adaptive
            update["checkpoint_cadence"] = CheckpointCadence(
                interval_seconds=progress.checkpoint_interval_seconds,
                bound=progress.checkpoint_interval_bound,
                save_cost_seconds=progress.save_cost_seconds,
                overhead_percent=progress.checkpoint_overhead_percent,
                mtbf_seconds=progress.mtbf_seconds,
            )
        failure = status.last_failure
        # The attempt that followed the failure restored a step newer than the failure's resume point (a
        # pin means that step or a newer one: a save that committed after the decision, or the local tier
        # after an in-place restart): the failure lost fewer steps than first said. After an in-place
        # restart the restored step is the resume point either way.
        if (
            failure is not None
            and progress.restored_step is not None
            and recovering_record(failure, progress)
            and (
                moved := moved_resume_point(
                    status.lost_steps, failure, progress.restored_step, failure.rung == IN_PLACE
                )
            )
        ):
            update["lost_steps"], failure = moved
            update["last_failure"] = failure
        if (
            failure is not None
            and progress.restored_from is not None
            and failure.restored_from != progress.restored_from
            and recovering_record(failure, progress)
        ):
            failure = failure.model_copy(update={"restored_from": progress.restored_from})
            update["last_failure"] = failure
        # The first step trained by the attempt that replaced the failed one, or its success when it
        # resumed at the final step and had none to train: the failure's cost in time.
        trained = failure is not None and progress.step > (failure.resume_step or -1)
        if (
            failure is not None
            and failure.recovery_seconds is None
            and (trained or progress.state == "succeeded")
            and recovering_record(failure, progress)
        ):
            # To its first step when the record dates it (the operator may read the record later).
            first_step = parse_time(progress.first_step_at) if trained else None
            seconds = ((first_step or progress.updated) - parse_time(failure.time)).total_seconds()  # type: ignore[operator]
            update["last_failure"] = failure.model_copy(update={"recovery_seconds": round(seconds, 1)})
    return status.model_copy(update=update)


def moved_resume_point(
    lost_steps: int, failure: FailureRecord, step: int, exact: bool = False
) -> tuple[int, FailureRecord] | None:
    """The job's lost steps and the failure record once the failure resumed from `step`, if that is later
    than its recorded resume point (the steps it did not lose are given back); else None. `exact`: `step`
    is the resume point even if earlier (an in-place restart's own restore: the listing the failure was
    decided on may hold a step the restarted process committed since)."""
    if failure.resume_step is not None and (step == failure.resume_step or (step < failure.resume_step and not exact)):
        return None
    lost = max(0, failure.step - step) if failure.step is not None else None
    return lost_steps - ((failure.lost_steps or 0) - (lost or 0)), failure.model_copy(
        update={"resume_step": step, "lost_steps": lost}
    )


def recovering_record(failure: FailureRecord, progress: contract.ProgressRecord) -> bool:
    """Whether a record of the current attempt can be the recovery's: after an in-place restart the
    attempt is the same, so only a process started after the failure is (a restart takes time: one
    stamped with the failure's own time started before it)."""
    if failure.rung != IN_PLACE:
        return True
    started, failed = parse_time(progress.process_started_at), parse_time(failure.time)
    return started is not None and failed is not None and started > failed


def failure_identity(failure: FailureRecord) -> tuple[str, str, str]:
    return failure.time, failure.kind, failure.reason


def decided_failure(before: TrainingJobStatus, after: TrainingJobStatus) -> FailureRecord | None:
    """The failure a reconcile decided on (a restart, or the end of the job), if any: a lastFailure
    that is new, or one that looks like the last but was counted as another restart."""
    failure, previous = after.last_failure, before.last_failure
    if failure is None:
        return None
    if after.restarts > before.restarts or previous is None:
        return failure
    return failure if failure_identity(previous) != failure_identity(failure) else None
