"""The goodput ledger's arithmetic: every second of wall time lands in exactly one cause."""

from datetime import UTC, datetime, timedelta

import pytest
import tpujob_contract as contract
from tpujob_operator import goodput
from tpujob_operator.api import FailureRecord, TrainingJobStatus
from tpujob_operator.status import rfc3339, rfc3339_precise

from .factories import progress_record

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _status(stage=None, attempt=0, phase="Pending", **fields) -> TrainingJobStatus:
    return TrainingJobStatus(stage=stage, attempt=attempt, phase=phase, start_time=rfc3339(T0), **fields)


def _record(attempt=0, save=0.0, restore=None, rate=None, step=10) -> contract.ProgressRecord:
    started, finished = restore or (None, None)
    return progress_record(
        step=step, attempt=attempt, updated_at=T0, steps_per_second=rate, save_blocking_seconds=save,
        restore_started_at=started, restore_finished_at=finished,
    )  # fmt: skip


class Job:
    """Drive the ledger through a sequence of reconciles, as the operator would."""

    def __init__(self) -> None:
        self.status = _status()

    def step(self, at: float, progress: contract.ProgressRecord | None = None, **after_fields) -> None:
        after = self.status.model_copy(update=after_fields)
        after.goodput = goodput.advance(self.status, after, progress, _at(at))
        self.status = after

    @property
    def ledger(self):
        assert self.status.goodput is not None
        return self.status.goodput


def _parts(ledger) -> dict[str, float]:
    return {"productive": ledger.productive_seconds, **{k: v for k, v in ledger.badput.model_dump().items() if v}}


def test_each_stage_lands_in_its_cause_and_the_parts_add_up_to_the_wall_time():
    job = Job()
    job.step(0, stage="Scheduling")
    job.step(300, stage="StartingUp")  # 300 s waiting for TPU capacity
    job.step(360, stage="Training", phase="Running")  # 60 s start-up
    job.step(960, stage="Suspended", phase="Suspended")  # 600 s training
    job.step(1260, stage="Scheduling", phase="Pending")  # 300 s suspended
    job.step(1300)
    assert _parts(job.ledger) == {
        "productive": 600,
        "scheduling_seconds": 340,
        "startup_seconds": 60,
        "suspended_seconds": 300,
    }
    assert job.ledger.wall_seconds == 1300 and job.ledger.ratio == round(600 / 1300, 4)


def test_save_blocking_moves_from_training_to_checkpoint_save_once():
    job = Job()
    job.step(0, stage="Training", phase="Running")
    job.step(100, _record(save=4.0))
    job.step(200, _record(save=4.0))  # the same cumulative number again: nothing more moves
    job.step(300, _record(save=10.0))
    assert (job.ledger.productive_seconds, job.ledger.badput.checkpoint_save_seconds) == (290, 10)
    assert job.ledger.wall_seconds == 300


def test_restore_moves_from_start_up_to_restore():
    job = Job()
    job.step(0, stage="StartingUp")
    job.step(50, _record(restore=(_at(10), _at(40))), stage="Training", phase="Running")
    job.step(80, _record(restore=(_at(10), _at(40))))
    assert _parts(job.ledger) == {"productive": 30, "startup_seconds": 20, "restore_seconds": 30}


def _failure(at: float, lost: int | None) -> FailureRecord:
    return FailureRecord(time=rfc3339(_at(at)), kind="ApplicationError", reason="ExitCode1", lost_steps=lost)


def test_a_failure_while_training_costs_its_lost_steps_and_its_detection_time():
    job = Job()
    job.step(0, stage="Training", phase="Running")
    job.step(100, _record(rate=2.0))
    # Failed at 108, seen at 110: 20 steps were lost, re-trained at 2 steps/s.
    job.step(110, _record(rate=2.0), stage="BackingOff", attempt=1, last_failure=_failure(108, lost=20))
    job.step(120, stage="Scheduling")  # backoff
    job.step(150, stage="StartingUp")  # replacement placed
    assert _parts(job.ledger) == {
        "productive": 98,
        "wasted_progress_seconds": 10,
        "infrastructure_recovery_seconds": 2 + 10 + 30,
    }
    assert job.ledger.wall_seconds == 150


def test_a_failure_before_the_first_step_wastes_no_progress():
    job = Job()
    job.step(0, stage="StartingUp")
    # The restore had started but never finished: nothing moves to restore.
    record = _record(restore=(_at(5), None))
    job.step(30, record, stage="BackingOff", attempt=1, last_failure=_failure(25, lost=None))
    assert _parts(job.ledger) == {"productive": 0, "startup_seconds": 25, "infrastructure_recovery_seconds": 5}


def test_several_attempts_count_their_own_trainer_numbers():
    job = Job()
    job.step(0, stage="Training", phase="Running")
    job.step(100, _record(attempt=0, save=5.0))
    job.step(100, stage="BackingOff", attempt=1, last_failure=_failure(100, lost=0))
    job.step(110, stage="Training", phase="Running")
    # Attempt 1 starts its own cumulative count from zero; attempt 0's stale record changes nothing.
    job.step(150, _record(attempt=0, save=9.0))
    job.step(200, _record(attempt=1, save=3.0))
    assert job.ledger.badput.checkpoint_save_seconds == 8
    assert job.ledger.productive_seconds == 95 + 87 and job.ledger.wall_seconds == 200


def test_a_finished_job_stops_the_ledger():
    job = Job()
    job.step(0, stage="Training", phase="Running")
    job.step(100, stage="Finished", phase="Succeeded")
    frozen = job.ledger
    job.step(5000)
    assert job.ledger == frozen and frozen.wall_seconds == 100 and frozen.ratio == 1.0


@pytest.mark.parametrize("gap", [0.0, 3.7, 86400.0])
def test_an_operator_outage_is_integrated_at_the_next_reconcile(gap: float):
    job = Job()
    job.step(0, stage="Training", phase="Running")
    job.step(10 + gap)
    assert job.ledger.productive_seconds == pytest.approx(10 + gap) and job.ledger.wall_seconds == pytest.approx(
        10 + gap
    )


def test_the_recovery_timeline_is_dated_stage_by_stage():
    from tpujob_operator.facts import JobSetFacts, Observed, PodFacts
    from tpujob_operator.reconcile import reconcile

    from .factories import training_job

    uid = "0000-1111"
    failed_pod = PodFacts("w", 0, "Failed", exit_code=1, finished_at=_at(8), created=T0, scheduled_at=T0)
    running = JobSetFacts("llama-a0", 0, None, T0, "Active", pods=(failed_pod,), uid=uid, expected_pods=1)
    tj = training_job(restart={"backoffSeconds": 5}, status={"phase": "Running", "attempt": 0, "stage": "Training"})
    status, _ = reconcile(tj, Observed(now=_at(10), jobsets=(running,), latest_committed_step=4))
    assert (status.last_failure.timeline.failed, status.last_failure.timeline.detected) == (
        rfc3339_precise(_at(8)),
        rfc3339_precise(_at(10)),
    )

    def again(status, at, **observed):
        tj = training_job(restart={"backoffSeconds": 5}, status=status.model_dump(by_alias=True, exclude_none=True))
        return reconcile(tj, Observed(now=_at(at), latest_committed_step=4, **observed))[0]

    status = again(status, 15)  # backoff over: the replacement is created
    assert status.last_failure.timeline.job_set_created == rfc3339_precise(_at(15))
    placed = PodFacts("w", 0, "Running", created=_at(16), scheduled_at=_at(20))
    replacement = JobSetFacts("llama-a1", 1, 4, _at(15), "Active", pods=(placed,), uid=uid, expected_pods=1)
    status = again(status, 21, jobsets=(replacement,))
    assert status.last_failure.timeline.pods_scheduled == rfc3339_precise(_at(20))
    record = progress_record(
        step=5, attempt=1, uid=uid, updated_at=_at(40), restore_finished_at=_at(30), first_step_at=_at(38)
    )
    status = again(status, 41, jobsets=(replacement,), progress=record)
    timeline = status.last_failure.timeline
    assert (timeline.restored, timeline.first_new_step) == (rfc3339_precise(_at(30)), rfc3339_precise(_at(38)))
    assert status.last_failure.recovery_seconds == 30.0  # to the first step (38), not to the record read (40)
    ledger = status.goodput
    assert ledger is not None and ledger.wall_seconds == 41 - 10  # from the first reconcile (startTime)
