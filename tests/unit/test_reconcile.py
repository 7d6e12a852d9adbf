"""Scenarios for the pure reconciler: what the operator decides from a TrainingJob and the world."""

from datetime import UTC, datetime, timedelta

from tpujob_operator.facts import JobSetFacts, Observed, PodFacts
from tpujob_operator.reconcile import final_step, reconcile
from tpujob_operator.status import rfc3339

from .factories import progress_record, training_job

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


UID = "0000-1111"  # tests/unit/factories.py's TrainingJob


def _active(attempt=0, state="Active", resume=None, created=T0, pods=(), **facts):
    return JobSetFacts(f"llama-a{attempt}", attempt, resume, created, state, pods=pods, uid=UID, **facts)


def _progress(**fields):
    return progress_record(uid=UID, **fields)


def _conditions(status):
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_new_job_creates_attempt_zero_from_latest_committed_step():
    status, actions = reconcile(training_job(), Observed(now=T0, latest_committed_step=None))
    assert (actions.create_attempt, actions.resume_step) == (0, None)
    assert status.phase == "Pending" and status.job_set_name == "llama-a0"
    assert [e.reason for e in actions.events] == ["Created"]


def test_reconcile_is_idempotent_when_the_jobset_exists():
    tj = training_job(status={"phase": "Pending", "attempt": 0})
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_active(),)))
    assert actions.create_attempt is None and actions.delete == []
    assert status.phase == "Pending"


def test_progress_of_the_current_attempt_makes_it_running():
    tj = training_job(status={"phase": "Pending", "attempt": 0})
    progress = _progress(step=120, attempt=0, updated_at=T0, loss=3.2)
    status, actions = reconcile(
        tj, Observed(now=T0, jobsets=(_active(),), progress=progress, latest_committed_step=100)
    )
    assert status.phase == "Running"
    assert (status.step, status.loss, status.latest_checkpoint.step) == (120, 3.2, 100)
    assert _conditions(status)["Running"] == ("True", "Training")
    assert [e.reason for e in actions.events] == ["Running"]


def test_failure_restarts_from_latest_committed_with_lost_steps_recorded():
    tj = training_job(status={"phase": "Running", "attempt": 0, "step": 130})
    failed = _active(state="Failed", pods=(PodFacts("w", 1, "Failed", exit_code=1, finished_at=T0),))
    progress = _progress(step=130, attempt=0, updated_at=T0)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(failed,), progress=progress, latest_committed_step=100))
    assert status.phase == "Restarting"
    assert (status.restarts, status.counted_restarts, status.attempt) == (1, 1, 1)
    assert status.last_failure.kind == "ApplicationError" and status.last_failure.slice == 1
    assert (status.last_failure.resume_step, status.last_failure.lost_steps, status.lost_steps) == (100, 30, 30)
    assert actions.delete == ["llama-a0"] and actions.create_attempt is None
    assert status.next_restart_time == rfc3339(T0 + timedelta(seconds=10))
    assert [e.reason for e in actions.events] == ["FailureDetected", "Restarting"]


def test_without_backoff_the_failure_decision_creates_the_next_attempt_itself():
    tj = training_job(restart={"backoffSeconds": 0}, status={"phase": "Running", "attempt": 0, "step": 130})
    failed = _active(state="Failed", pods=(PodFacts("w", 1, "Failed", exit_code=1, finished_at=T0),))
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(failed,), latest_committed_step=100))
    assert (actions.delete, actions.create_attempt, actions.resume_step) == (["llama-a0"], 1, 100)
    assert (status.phase, status.attempt, status.restarts, status.next_restart_time) == ("Restarting", 1, 1, None)
    assert [e.reason for e in actions.events] == ["FailureDetected", "Restarting", "Restored"]


def test_after_backoff_the_next_attempt_is_created_pinned_to_the_committed_step():
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "restarts": 1, "nextRestartTime": rfc3339(T0)})
    _, early_actions = reconcile(tj, Observed(now=T0 - timedelta(seconds=3), latest_committed_step=100))
    assert early_actions.create_attempt is None and early_actions.requeue_after == 3
    status, actions = reconcile(tj, Observed(now=T0, latest_committed_step=100))
    assert (actions.create_attempt, actions.resume_step) == (1, 100)
    assert status.next_restart_time is None and status.resumed_from_step == 100
    assert [e.reason for e in actions.events] == ["Restored"]


def test_a_save_committed_after_the_restart_decision_is_the_resume_point_and_its_steps_are_not_lost():
    tj = training_job(status={"phase": "Running", "attempt": 0, "step": 130})
    failed = _active(state="Failed", pods=(PodFacts("w", 1, "Failed", exit_code=137, finished_at=T0),))
    progress = _progress(step=130, attempt=0, updated_at=T0)
    decided, _ = reconcile(tj, Observed(now=T0, jobsets=(failed,), progress=progress, latest_committed_step=100))
    assert (decided.last_failure.resume_step, decided.lost_steps) == (100, 30)
    # The failed attempt's other slice finished its in-flight save of step 120 before the new attempt exists.
    later = T0 + timedelta(seconds=11)
    restarting = training_job(status=decided.model_dump(by_alias=True, exclude_none=True))
    status, actions = reconcile(restarting, Observed(now=later, latest_committed_step=120))
    assert (actions.create_attempt, actions.resume_step) == (1, 120)
    assert (status.resumed_from_step, status.last_failure.resume_step) == (120, 120)
    assert (status.last_failure.lost_steps, status.lost_steps, status.restarts) == (10, 10, 1)
    assert status.last_failure.time == decided.last_failure.time  # the same failure, not a second one


def test_preemption_restarts_without_spending_the_budget():
    tj = training_job(restart={"maxRestarts": 0}, status={"phase": "Running", "attempt": 2})
    failed = _active(attempt=2, state="Failed", pods=(PodFacts("w", 0, "Failed", exit_code=143),))
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(failed,), latest_committed_step=40))
    assert status.phase == "Restarting"
    assert (status.restarts, status.counted_restarts) == (1, 0)
    assert status.last_failure.counted is False


def test_exhausted_budget_fails_the_job_with_a_condition_saying_why():
    tj = training_job(
        restart={"maxRestarts": 1}, status={"phase": "Running", "attempt": 1, "restarts": 1, "countedRestarts": 1}
    )
    failed = _active(attempt=1, state="Failed", pods=(PodFacts("w", 0, "Failed", exit_code=2),))
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(failed,)))
    assert status.phase == "Failed"
    assert _conditions(status)["Failed"] == ("True", "RestartBudgetExhausted")
    assert "1/1" in next(c.message for c in status.conditions if c.type == "Failed")
    # Giving up releases the slices: the failed attempt's JobSet goes in the same decision.
    assert actions.create_attempt is None and actions.delete == ["llama-a1"]
    assert "RestartBudgetExhausted" in [e.reason for e in actions.events]


def test_terminal_jobs_decide_nothing_but_keep_only_a_succeeded_jobset():
    tj = training_job(status={"phase": "Succeeded", "attempt": 1})
    completed, stray = _active(attempt=1, state="Completed"), _active(attempt=0, state="Failed")
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(completed, stray)))
    assert status == tj.status and actions.create_attempt is None and actions.events == []
    assert (actions.delete, actions.stop) == (["llama-a0"], [])
    _, actions = reconcile(tj, Observed(now=T0, jobsets=(completed,)))
    assert (actions.delete, actions.stop, actions.requeue_after) == ([], [], None)


def test_completed_jobset_succeeds_once_the_final_step_is_committed():
    tj = training_job(status={"phase": "Running", "attempt": 0})  # the trainer's default: 100 steps
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_active(state="Completed"),), latest_committed_step=100))
    assert status.phase == "Succeeded" and status.completion_time == rfc3339(T0)


def test_a_jobset_that_completes_short_of_the_final_step_is_a_preemption_and_training_resumes():
    tj = training_job(args=["--model", "tiny", "--steps", "500"], status={"phase": "Running", "attempt": 0})
    completed = _active(state="Completed")
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(completed,), latest_committed_step=200))
    assert status.phase == "Restarting" and status.completion_time is None
    failure = status.last_failure
    assert (failure.kind, failure.reason, failure.counted, failure.resume_step) == ("Preemption", "CompletedShort",
                                                                                   False, 200)  # fmt: skip
    assert "short of the final step 500" in failure.message
    assert (status.attempt, status.counted_restarts, actions.delete) == (1, 0, ["llama-a0"])
    # The next attempt completes at the same committed step again: counted, so the budget bounds a loop.
    again = training_job(
        args=["--model", "tiny", "--steps", "500"],
        status={**status.model_dump(by_alias=True, exclude_none=True), "nextRestartTime": None},
    )
    status, _ = reconcile(again, Observed(now=T0, jobsets=(_active(attempt=1, state="Completed"),),
                                          latest_committed_step=200))  # fmt: skip
    assert (status.last_failure.kind, status.last_failure.counted, status.counted_restarts) == (
        "ApplicationError", True, 1)  # fmt: skip


def test_a_completion_is_not_success_while_storage_cannot_confirm_the_final_step():
    tj = training_job(status={"phase": "Running", "attempt": 0})
    observed = Observed(now=T0, jobsets=(_active(state="Completed"),), latest_committed_step=100, storage_error="503")
    status, actions = reconcile(tj, observed)
    assert status.phase == "Running" and _conditions(status)["Running"] == ("True", "ConfirmingCompletion")
    assert actions.fresh_storage and actions.delete == [] and actions.create_attempt is None


def test_the_final_step_comes_from_the_trainer_flags_or_maxtexts():
    def final(**spec):
        return final_step(training_job(**spec))

    assert final() == 100  # the trainer's default
    assert final(args=["--steps", "7", "--model", "tiny", "--steps=500"]) == 500  # argparse: the last wins
    assert final(args=["--step", "300"]) == 300  # an unambiguous prefix
    assert final(env=[{"name": "TPUJOB_STEPS", "value": "40"}]) == 40
    assert final(args=["--steps", "many"]) is None
    assert final(framework="maxtext", args=["steps=300"]) == 299  # MaxText's loop ends at steps - 1
    assert final(framework="maxtext", args=["steps=-1"]) is None
    assert final(framework="maxtext", args=[]) == 150_000


def test_no_progress_for_the_hang_timeout_is_a_counted_hang():
    tj = training_job(
        restart={"hangTimeoutSeconds": 60}, status={"phase": "Running", "attempt": 0, "lastProgressTime": rfc3339(T0)}
    )
    progress = _progress(step=50, attempt=0, updated_at=T0)
    fine, _ = reconcile(tj, Observed(now=T0 + timedelta(seconds=59), jobsets=(_active(),), progress=progress))
    assert fine.phase == "Running"
    status, actions = reconcile(tj, Observed(now=T0 + timedelta(seconds=61), jobsets=(_active(),), progress=progress))
    assert status.phase == "Restarting" and status.last_failure.kind == "Hang" and status.counted_restarts == 1
    assert actions.delete == ["llama-a0"]


def test_jobset_created_before_an_operator_crash_is_adopted_not_duplicated():
    tj = training_job(status={"phase": "Restarting", "attempt": 0})
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_active(attempt=0, state="Failed"), _active(attempt=1))))
    assert status.attempt == 1 and actions.create_attempt is None
    assert actions.delete == ["llama-a0"]


def test_suspend_and_resume_map_to_the_jobset():
    suspended_tj = training_job(suspend=True, status={"phase": "Running", "attempt": 0})
    status, actions = reconcile(suspended_tj, Observed(now=T0, jobsets=(_active(resume=None),)))
    assert status.phase == "Suspended" and actions.set_suspend == ("llama-a0", True)
    resumed_tj = training_job(status={"phase": "Suspended", "attempt": 0})
    same = _active(state="Suspended", resume=100, suspended_by_operator=True)
    _, actions = reconcile(resumed_tj, Observed(now=T0, jobsets=(same,), latest_committed_step=100))
    assert actions.set_suspend == ("llama-a0", False)
    # Checkpoints advanced since the JobSet was built: its pinned step is stale, so it is replaced.
    status, actions = reconcile(resumed_tj, Observed(now=T0, jobsets=(same,), latest_committed_step=160))
    assert actions.stop == ["llama-a0"] and not actions.delete and status.attempt == 1


def test_unschedulable_pods_keep_the_job_pending_with_the_reason():
    pods = (
        PodFacts("w", 0, "Pending", unschedulable_message="0/3 nodes are available: node(s) didn't match selector"),
    )
    tj = training_job(status={"phase": "Pending", "attempt": 0})
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_active(pods=pods),)))
    assert status.phase == "Pending"
    pending = next(c for c in status.conditions if c.type == "Pending")
    assert (pending.status, pending.reason) == ("True", "Unschedulable") and "didn't match" in pending.message


def test_recovery_time_is_measured_to_the_first_resumed_step():
    failure = {"time": rfc3339(T0), "kind": "ApplicationError", "reason": "ExitCode1", "resumeStep": 100}
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "lastFailure": failure})
    progress = _progress(step=101, attempt=1, updated_at=T0 + timedelta(seconds=42))
    status, _ = reconcile(
        tj, Observed(now=T0 + timedelta(seconds=45), jobsets=(_active(attempt=1),), progress=progress)
    )
    assert status.last_failure.recovery_seconds == 42.0
    assert status.phase == "Running"


def test_a_replacement_that_resumed_at_the_final_step_recovered_when_it_reports_success():
    # The failed attempt's last save committed the final step after the restart was decided: the
    # replacement restores it and trains no step, and the failure's cost is measured to its success.
    failure = {"time": rfc3339(T0), "kind": "ApplicationError", "reason": "ExitCode137", "resumeStep": 100}
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "lastFailure": failure}, args=["--steps", "100"])
    progress = _progress(step=100, attempt=1, updated_at=T0 + timedelta(seconds=30), state="succeeded")
    status, _ = reconcile(
        tj, Observed(now=T0 + timedelta(seconds=31), jobsets=(_active(attempt=1),), progress=progress)
    )
    assert status.last_failure.recovery_seconds == 30.0


def test_a_failed_worker_fails_the_attempt_before_the_jobset_says_so():
    # The Job controller marks a Job failed only after the slice's other pods terminated; the
    # operator acts on the first failed pod instead.
    tj = training_job(status={"phase": "Running", "attempt": 0, "step": 40})
    pods = (PodFacts("w0", 0, "Running"), PodFacts("w1", 1, "Failed", exit_code=137, finished_at=T0))
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_active(pods=pods),), latest_committed_step=30))
    assert status.phase == "Restarting" and status.last_failure.slice == 1
    assert actions.delete == ["llama-a0"]


def test_a_new_attempt_starts_its_step_from_the_committed_step():
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "step": 47, "loss": 2.0, "restarts": 1})
    status, _ = reconcile(tj, Observed(now=T0, latest_committed_step=40))
    assert (status.step, status.loss) == (40, None)


def test_only_the_true_condition_carries_the_current_message():
    pending_condition = {"type": "Pending", "status": "True", "reason": "JobSetCreated", "message": "starting"}
    tj = training_job(status={"phase": "Pending", "attempt": 0, "conditions": [pending_condition]})
    progress = _progress(step=3, attempt=0, updated_at=T0)
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_active(),), progress=progress, latest_committed_step=1))
    pending = next(c for c in status.conditions if c.type == "Pending")
    running = next(c for c in status.conditions if c.type == "Running")
    assert (running.status, running.message) == ("True", "training at step 3")
    assert (pending.status, pending.reason, pending.message) == ("False", "Running", "the job is Running")


def test_a_trainer_blocked_in_a_save_says_so_and_its_fresh_record_holds_the_hang_clock():
    tj = training_job(
        restart={"hangTimeoutSeconds": 60}, status={"phase": "Running", "attempt": 0, "lastProgressTime": rfc3339(T0)}
    )
    blocked_at = T0 + timedelta(seconds=30)  # silent for 55 s by its step, written 5 s ago by its save's wait
    progress = _progress(step=50, attempt=0, updated_at=T0 + timedelta(seconds=80), blocked_in_save_at=blocked_at)
    status, actions = reconcile(tj, Observed(now=T0 + timedelta(seconds=85), jobsets=(_active(),), progress=progress))
    running = next(c for c in status.conditions if c.type == "Running")
    assert status.phase == "Running" and not actions.delete, status
    since = progress.blocked_in_save_at
    assert running.message == f"training at step 50; blocked in a checkpoint save since {since}"


def test_failed_saves_of_the_current_attempt_are_shown_in_status():
    """The trainer counts saves that raised (training goes on); the record carried the count and the
    operator dropped it. It is shown with the step, and goes once an attempt reports none."""
    tj = training_job(status={"phase": "Running", "attempt": 1})
    running = Observed(now=T0, jobsets=(_active(1),), progress=_progress(step=9, attempt=1, updated_at=T0,
                       save_failures=2))  # fmt: skip
    status, _ = reconcile(tj, running)
    assert status.save_failures == 2
    assert status.model_dump(by_alias=True, exclude_none=True)["saveFailures"] == 2
    later = Observed(now=T0, jobsets=(_active(2),), progress=_progress(step=12, attempt=2, updated_at=T0))
    status, _ = reconcile(training_job(status={**status.model_dump(by_alias=True), "attempt": 2}), later)
    assert status.save_failures is None
    stale = _progress(step=9, attempt=0, updated_at=T0, save_failures=5)  # the previous attempt's record
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_active(1),), progress=stale))
    assert status.save_failures is None


def test_the_adaptive_cadence_of_the_current_attempt_is_shown_in_status():
    tj = training_job(status={"phase": "Running", "attempt": 1})
    cadence = dict(checkpoint_interval_seconds=42.0, checkpoint_interval_bound="young_daly", save_cost_seconds=0.8,
                   checkpoint_overhead_percent=1.9, mtbf_seconds=10800.0)  # fmt: skip
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_active(1),), progress=_progress(step=9, attempt=1,
                          updated_at=T0, **cadence)))  # fmt: skip
    shown = status.checkpoint_cadence
    assert shown is not None
    assert (shown.interval_seconds, shown.bound, shown.overhead_percent, shown.mtbf_seconds) == (
        42.0, "young_daly", 1.9, 10800.0)  # fmt: skip
    older = _progress(step=9, attempt=0, updated_at=T0, **cadence)  # the previous attempt's record
    status, _ = reconcile(training_job(status={"phase": "Running", "attempt": 1}),
                          Observed(now=T0, jobsets=(_active(1),), progress=older))  # fmt: skip
    assert status.checkpoint_cadence is None
