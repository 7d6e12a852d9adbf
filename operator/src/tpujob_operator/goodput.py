"""The goodput ledger (pure): where a job's wall time went, across attempts.

Every reconcile integrates the time since the ledger's last update into the cause of the stage the
job was in (Scheduling, StartingUp, Training, BackingOff, Suspended), then moves time between
causes with what only the trainer knows (its record: how long the restore ran, how long saves
blocked the loop) and what a failure cost (the steps it lost, re-trained at the measured rate; the
time it went unnoticed). So wall = productive + every badput cause, at every update, and a crashed
operator loses nothing: the gap is integrated at its next reconcile.

The categories follow ml-goodput-measurement's: scheduling, start-up (process start, compilation),
restore, checkpoint save, wasted progress, infrastructure recovery (a failure until its replacement's
pods are all scheduled), suspended; and reduced size: training on fewer slices than the spec's
(spec.elastic) is productive at its share of them, the rest is this cause.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import tpujob_contract as contract

from .api import TERMINAL_PHASES, Badput, Goodput, Stage, TrainingJobStatus
from .status import decided_failure, parse_time, rfc3339_precise

Cause = Literal[
    "productive",
    "scheduling",
    "startup",
    "restore",
    "checkpoint_save",
    "wasted_progress",
    "infrastructure_recovery",
    "suspended",
    "queued",
    "reduced_size",
]
_STAGE_CAUSE: dict[Stage, Cause] = {
    "Scheduling": "scheduling",
    "StartingUp": "startup",
    "Training": "productive",
    "BackingOff": "infrastructure_recovery",
    "Suspended": "suspended",
    "Queued": "queued",
}


def _seconds(ledger: Goodput, cause: Cause) -> float:
    if cause == "productive":
        return ledger.productive_seconds
    return float(getattr(ledger.badput, f"{cause}_seconds"))


def _add(ledger: Goodput, cause: Cause, seconds: float) -> None:
    if cause == "productive":
        ledger.productive_seconds += seconds
    else:
        setattr(ledger.badput, f"{cause}_seconds", _seconds(ledger, cause) + seconds)


def _move(ledger: Goodput, source: Cause, target: Cause, seconds: float) -> float:
    """Re-attribute up to `seconds` from source to target; returns what was moved (never more than
    the source holds, so no cause goes negative and the sum stays the wall time)."""
    moved = max(0.0, min(seconds, _seconds(ledger, source)))
    _add(ledger, source, -moved)
    _add(ledger, target, moved)
    return moved


def _cause_of(status: TrainingJobStatus) -> Cause | None:
    """What the time since the last update was spent on, by the stage the job was in."""
    if status.phase in TERMINAL_PHASES or status.stage == "Finished":
        return None
    if status.stage is None:
        return "scheduling"
    failure = status.last_failure
    recovering = failure is not None and failure.recovery_seconds is None
    if status.stage == "Scheduling" and recovering:
        return "infrastructure_recovery"  # the replacement of a failed attempt is not yet placed
    return _STAGE_CAUSE.get(status.stage)  # a stage a newer operator wrote: counted from the next known one


def advance(
    before: TrainingJobStatus,
    after: TrainingJobStatus,
    progress: contract.ProgressRecord | None,
    now: datetime,
    full_slices: int = 1,
) -> Goodput | None:
    """The ledger after one reconcile: `before` is the status it started from, `after` the one it
    decided, `progress` the trainer's record of this TrainingJob (if readable), `full_slices` the
    spec's slice count (training on fewer, spec.elastic, is productive at its share)."""
    if before.goodput is None:
        start = parse_time(before.start_time) or now
        ledger = Goodput(updated_at=rfc3339_precise(start), attempt=before.attempt)
    else:
        ledger = before.goodput.model_copy(deep=True)
    cause = _cause_of(before)
    if cause is None:
        return before.goodput
    since = parse_time(ledger.updated_at) or now
    elapsed = max(0.0, (now - since).total_seconds())
    _add(ledger, cause, elapsed)
    if cause == "productive" and before.slices and before.slices < full_slices:
        _move(ledger, "productive", "reduced_size", elapsed * (1 - before.slices / full_slices))

    if progress is not None and progress.attempt == ledger.attempt:
        # The trainer's own numbers for this attempt are cumulative: count only what is new.
        saved = _move(
            ledger, "productive", "checkpoint_save", progress.save_blocking_seconds - ledger.attempt_save_seconds
        )
        ledger.attempt_save_seconds += saved
        started, finished = parse_time(progress.restore_started_at), parse_time(progress.restore_finished_at)
        if started and finished:
            restore = (finished - started).total_seconds()
            ledger.attempt_restore_seconds += _move(
                ledger, "startup", "restore", restore - ledger.attempt_restore_seconds
            )

    failure = decided_failure(before, after)
    if failure is not None:
        failed_at = parse_time(failure.time)
        if failed_at is not None:  # from the failure to this decision, the job only looked alive
            _move(ledger, cause, "infrastructure_recovery", min(elapsed, (now - failed_at).total_seconds()))
        rate = progress.steps_per_second if progress is not None and progress.attempt == before.attempt else None
        if failure.lost_steps and rate:
            _move(ledger, "productive", "wasted_progress", failure.lost_steps / rate)

    if after.attempt != ledger.attempt:
        ledger.attempt, ledger.attempt_save_seconds, ledger.attempt_restore_seconds = after.attempt, 0.0, 0.0
    return _totalled(ledger, now)


def _totalled(ledger: Goodput, now: datetime) -> Goodput:
    # Causes a newer operator added are kept, and are part of the wall time it counted.
    seconds = {k: v for k, v in ledger.badput.model_dump().items() if isinstance(v, int | float)}
    badput = Badput(**{**ledger.badput.model_dump(), **{k: round(v, 3) for k, v in seconds.items()}})
    wall = ledger.productive_seconds + sum(round(v, 3) for v in seconds.values())
    return ledger.model_copy(
        update={
            "badput": badput,
            "productive_seconds": round(ledger.productive_seconds, 3),
            "wall_seconds": round(wall, 3),
            "ratio": round(ledger.productive_seconds / wall, 4) if wall > 0 else None,
            "updated_at": rfc3339_precise(now),
        }
    )
