"""TrainingJobs admitted by Kueue: the operator queues, never unsuspends, and never counts a preemption."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tpujob_operator.facts import JobSetFacts, Observed, PodFacts
from tpujob_operator.jobset import build_jobset, queue_name, workload_admission
from tpujob_operator.reconcile import reconcile

from .factories import progress_record, training_job

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
UID = "0000-1111"
QUEUE = "tpu"


def _jobset(attempt: int = 0, state: str = "Suspended", **facts: object) -> JobSetFacts:
    return JobSetFacts(f"llama-a{attempt}", attempt, None, T0, state, uid=UID, queue_name=QUEUE, **facts)  # type: ignore[arg-type]


def _tj(status: dict[str, object] | None = None, suspend: bool = False, labels: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    tj = training_job(status=status or {}, suspend=suspend)
    tj.metadata["labels"] = {"kueue.x-k8s.io/queue-name": QUEUE, **(labels or {})}
    return tj


def test_the_queue_comes_from_the_label_else_the_operators_default():
    tj = training_job()
    assert queue_name(tj, None) is None
    assert queue_name(tj, "team-a") == "team-a"
    tj.metadata["labels"] = {"kueue.x-k8s.io/queue-name": "tpu"}
    assert queue_name(tj, "team-a") == "tpu"


def test_a_queued_jobset_is_created_suspended_for_kueue_and_resumes_from_the_latest_step():
    tj = _tj(labels={"kueue.x-k8s.io/priority-class": "high"})
    manifest = build_jobset(tj, attempt=2, resume_step=300, queue=QUEUE)
    assert manifest["spec"]["suspend"] is True
    labels = manifest["metadata"]["labels"]
    assert (labels["kueue.x-k8s.io/queue-name"], labels["kueue.x-k8s.io/priority-class"]) == ("tpu", "high")
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TPUJOB_RESUME_STEP"] == "latest"  # Kueue may resume it after its workers saved a newer step
    plain = build_jobset(training_job(), attempt=2, resume_step=300)
    assert plain["spec"]["suspend"] is False and "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]


def test_priority_class_name_reaches_the_pods():
    manifest = build_jobset(training_job(priorityClassName="batch-high"), attempt=0, resume_step=None)
    assert manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["priorityClassName"] == (
        "batch-high"
    )


def test_a_jobset_waiting_for_admission_is_queued_and_never_unsuspended():
    tj = _tj({"phase": "Pending", "attempt": 0})
    waiting = _jobset(queue_reason="couldn't assign flavors to pod set slice: insufficient quota for google.com/tpu")
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(waiting,), queue_name=QUEUE))
    assert (status.phase, status.stage) == ("Pending", "Queued")
    assert "insufficient quota" in next(c.message for c in status.conditions if c.type == "Pending")
    assert actions.set_suspend is None and actions.delete == [] and actions.create_attempt is None
    assert status.queue is not None and (status.queue.name, status.queue.admitted) == (QUEUE, False)
    assert [e.reason for e in actions.events] == ["Queued"]
    assert (status.restarts, status.counted_restarts) == (0, 0)


def test_admission_is_shown_with_its_time():
    tj = _tj({"phase": "Pending", "attempt": 0})
    admitted = _jobset(state="Active", admitted_at=T0 + timedelta(seconds=30), resumed_at=T0 + timedelta(seconds=31))
    status, _ = reconcile(tj, Observed(now=T0 + timedelta(seconds=40), jobsets=(admitted,), queue_name=QUEUE))
    assert status.queue is not None and status.queue.admitted
    assert status.queue.admission_time == "2026-11-30T12:00:30Z"
    assert status.stage == "Scheduling"


def test_a_kueue_preemption_is_not_a_failure():
    running = {"phase": "Running", "attempt": 0, "step": 480, "queue": {"name": QUEUE, "admitted": True}}
    tj = _tj(running)
    # Kueue suspended the JobSet; its workers saved on SIGTERM and exited 143.
    saved = PodFacts("w", 0, "Failed", exit_code=143, finished_at=T0, created=T0 - timedelta(minutes=5))
    preempted = _jobset(pods=(saved,), queue_reason="Preempted to accommodate a higher priority workload")
    progress = progress_record(step=480, attempt=0, updated_at=T0, uid=UID, state="preempted", last_committed_step=480)
    observed = Observed(now=T0, jobsets=(preempted,), progress=progress, latest_committed_step=480, queue_name=QUEUE)
    status, actions = reconcile(tj, observed)
    assert (status.phase, status.stage) == ("Pending", "Queued")
    assert (status.restarts, status.counted_restarts, status.lost_steps, status.last_failure) == (0, 0, 0, None)
    assert actions.delete == [] and actions.set_suspend is None and actions.create_attempt is None
    assert [e.reason for e in actions.events] == ["Preempted"]
    assert status.queue is not None and not status.queue.admitted


def test_user_suspension_deletes_the_queued_jobset_letting_workers_save_then_queues_a_new_attempt():
    tj = _tj({"phase": "Running", "attempt": 0}, suspend=True)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_jobset(state="Active"),), queue_name=QUEUE))
    assert status.phase == "Suspended" and status.attempt == 1
    assert actions.stop == ["llama-a0"] and actions.delete == [] and actions.set_suspend is None
    # While suspended nothing is created: Kueue would admit (unsuspend) it.
    still = _tj(status.model_dump(by_alias=True, exclude_none=True), suspend=True)
    status, actions = reconcile(still, Observed(now=T0 + timedelta(seconds=5), queue_name=QUEUE))
    assert actions.create_attempt is None and status.phase == "Suspended"
    resumed = _tj(status.model_dump(by_alias=True, exclude_none=True))
    status, actions = reconcile(resumed, Observed(now=T0 + timedelta(seconds=9), queue_name=QUEUE))
    assert actions.create_attempt == 1 and status.restarts == 0


def test_queueing_time_is_its_own_badput():
    tj = _tj({"phase": "Pending", "attempt": 0})
    waiting = _jobset()
    first, _ = reconcile(tj, Observed(now=T0, jobsets=(waiting,), queue_name=QUEUE))
    later = _tj(first.model_dump(by_alias=True, exclude_none=True))
    status, _ = reconcile(later, Observed(now=T0 + timedelta(seconds=120), jobsets=(waiting,), queue_name=QUEUE))
    assert status.goodput is not None
    assert status.goodput.badput.queued_seconds >= 120
    assert status.goodput.badput.scheduling_seconds < 1


def test_workload_conditions_say_when_admitted_and_why_not():
    admitted = {
        "status": {
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "lastTransitionTime": "2026-11-30T12:00:29Z"},
                {"type": "Admitted", "status": "True", "lastTransitionTime": "2026-11-30T12:00:30Z"},
            ]
        }
    }
    assert workload_admission(admitted) == (T0 + timedelta(seconds=30), None)
    pending = {
        "status": {
            "conditions": [
                {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "insufficient quota",
                 "lastTransitionTime": "2026-11-30T12:00:10Z"},
                {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "Preempted by a higher one",
                 "lastTransitionTime": "2026-11-30T12:00:05Z"},
            ]
        }
    }  # fmt: skip
    assert workload_admission(pending) == (None, "insufficient quota")
    assert workload_admission({}) == (None, None)


def test_a_suspension_interrupted_by_an_operator_crash_still_lets_the_workers_save():
    # The status write (attempt 1, Suspended) landed; the operator died before deleting attempt 0.
    tj = _tj({"phase": "Suspended", "attempt": 1}, suspend=True)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_jobset(state="Active"),), queue_name=QUEUE))
    assert actions.stop == ["llama-a0"] and actions.delete == []
    assert status.phase == "Suspended" and actions.create_attempt is None
