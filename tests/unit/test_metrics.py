"""Prometheus metrics derived from what a reconcile read and wrote (a private registry per test)."""

from __future__ import annotations

import dataclasses
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from tpujob_operator import __main__ as main
from tpujob_operator import api
from tpujob_operator import metrics as metrics_module
from tpujob_operator.api import RECREATE
from tpujob_operator.facts import JobSetFacts, Observed, PodFacts
from tpujob_operator.metrics import BADPUT_CAUSES, GOODPUT_BADPUT_TYPES, OperatorMetrics
from tpujob_operator.reconcile import reconcile
from tpujob_operator.status import rfc3339

from .factories import progress_record, training_job

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
UID = "0000-1111"  # tests/unit/factories.py's TrainingJob
JOB = {"namespace": "ml", "name": "llama"}
RESTART = {**JOB, "rung": RECREATE}  # the restarts these tests decide


class Clock:
    def __init__(self, at: datetime) -> None:
        self.now = at.timestamp()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def metrics(clock: Clock) -> OperatorMetrics:
    return OperatorMetrics(CollectorRegistry(), clock=clock, counter_retention=600)


def sample(metrics: OperatorMetrics, metric: str, /, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(metric, labels)


def _failed_jobset(attempt: int, exit_code: int, finished: datetime) -> JobSetFacts:
    pod = PodFacts("w1", 1, "Failed", exit_code=exit_code, finished_at=finished)
    return JobSetFacts(f"llama-a{attempt}", attempt, None, T0, "Failed", pods=(pod,), uid=UID)


def _restart(exit_code: int, decided: datetime, **status: object) -> tuple[api.TrainingJob, api.TrainingJobStatus]:
    """A Running job whose slice-1 worker exited at T0, decided on by the reconciler at `decided`."""
    tj = training_job(status={"phase": "Running", "attempt": 0, "step": 130, **status})
    progress = progress_record(step=130, attempt=0, updated_at=T0, uid=UID)
    jobsets = (_failed_jobset(0, exit_code, T0),)
    after, _ = reconcile(tj, Observed(now=decided, jobsets=jobsets, progress=progress, latest_committed_step=100))
    return tj, after


def test_a_restart_is_counted_once_under_its_kind_and_whether_it_counted(metrics):
    decided = T0 + timedelta(seconds=2)
    tj, after = _restart(exit_code=1, decided=decided)
    assert after.restarts == 1 and after.last_failure.kind == "ApplicationError"

    metrics.observe_reconcile("ml", "llama", tj.status, after, decided)

    restarts = "tpujob_restarts_total"
    assert sample(metrics, restarts, **RESTART, kind="ApplicationError", counted="true") == 1
    assert sample(metrics, restarts, **RESTART, kind="ApplicationError", counted="false") is None
    assert sample(metrics, "tpujob_lost_steps_total", **JOB) == 30
    assert sample(metrics, "tpujob_failure_detection_seconds_count", kind="ApplicationError") == 1
    assert sample(metrics, "tpujob_failure_detection_seconds_sum", kind="ApplicationError") == 2.0
    # The next reconcile reads what this one wrote: nothing new happened, nothing is counted again.
    metrics.observe_reconcile("ml", "llama", after, after, decided + timedelta(seconds=5))
    assert sample(metrics, restarts, **RESTART, kind="ApplicationError", counted="true") == 1
    assert sample(metrics, "tpujob_lost_steps_total", **JOB) == 30
    assert sample(metrics, "tpujob_failure_detection_seconds_count", kind="ApplicationError") == 1


def test_a_preemption_restart_is_labelled_not_counted(metrics):
    tj, after = _restart(exit_code=143, decided=T0)
    metrics.observe_reconcile("ml", "llama", tj.status, after, T0)
    assert sample(metrics, "tpujob_restarts_total", **RESTART, kind="Preemption", counted="false") == 1
    assert sample(metrics, "tpujob_restarts_total", **RESTART, kind="Preemption", counted="true") is None


def test_the_timeline_decides_detection_when_it_is_recorded(metrics):
    tj, after = _restart(exit_code=1, decided=T0 + timedelta(seconds=9))
    timeline = api.FailureTimeline(failed=rfc3339(T0), detected=rfc3339(T0 + timedelta(seconds=1)))
    after.last_failure = after.last_failure.model_copy(update={"timeline": timeline})
    metrics.observe_reconcile("ml", "llama", tj.status, after, T0 + timedelta(seconds=9))
    assert sample(metrics, "tpujob_failure_detection_seconds_sum", kind="ApplicationError") == 1.0


def test_a_failure_that_ends_the_job_is_detected_and_its_series_go(metrics):
    tj, after = _restart(exit_code=1, decided=T0, countedRestarts=3, restarts=3)  # maxRestarts 3: spent
    assert after.phase == "Failed" and after.restarts == 3
    metrics.observe_reconcile("ml", "llama", tj.status, after, T0)
    # no restart, but a failure was detected and steps were lost
    assert sample(metrics, "tpujob_failure_detection_seconds_count", kind="ApplicationError") == 1
    assert sample(metrics, "tpujob_lost_steps_total", **JOB) == 30
    assert metrics.live_jobs() == 0  # an ended job has no gauges


def test_recovery_is_observed_once_when_it_first_appears(metrics):
    failure = {"time": rfc3339(T0), "kind": "ApplicationError", "reason": "ExitCode1", "resumeStep": 100}
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "restarts": 1, "lastFailure": failure})
    progress = progress_record(step=101, attempt=1, updated_at=T0 + timedelta(seconds=42), uid=UID)
    jobset = JobSetFacts("llama-a1", 1, 100, T0, "Active", uid=UID)
    observed = Observed(now=T0 + timedelta(seconds=45), jobsets=(jobset,), progress=progress)
    after, _ = reconcile(tj, observed)
    assert after.last_failure.recovery_seconds == 42.0

    metrics.observe_reconcile("ml", "llama", tj.status, after, observed.now)
    now = observed.now + timedelta(seconds=10)
    later, _ = reconcile(tj.model_copy(update={"status": after}), dataclasses.replace(observed, now=now))
    assert later.last_failure.recovery_seconds == 42.0
    metrics.observe_reconcile("ml", "llama", after, later, now)

    assert sample(metrics, "tpujob_recovery_seconds_count", kind="ApplicationError", rung=RECREATE) == 1
    assert sample(metrics, "tpujob_recovery_seconds_sum", kind="ApplicationError", rung=RECREATE) == 42.0
    assert sample(metrics, "tpujob_recovery_seconds_bucket", kind="ApplicationError", rung=RECREATE, le="60.0") == 1
    assert sample(metrics, "tpujob_restarts_total", **RESTART, kind="ApplicationError", counted="true") is None


def test_a_new_failure_with_recovery_is_observed_again(metrics):
    first = api.FailureRecord(time=rfc3339(T0), kind="Hang", reason="NoProgress", recovery_seconds=30)
    second = api.FailureRecord(
        time=rfc3339(T0 + timedelta(minutes=5)), kind="Hang", reason="NoProgress", recovery_seconds=20
    )
    before = api.TrainingJobStatus(phase="Restarting", restarts=2, last_failure=first)
    after = api.TrainingJobStatus(phase="Running", restarts=2, last_failure=second)
    metrics.observe_reconcile("ml", "llama", before, after, T0 + timedelta(minutes=6))
    assert sample(metrics, "tpujob_recovery_seconds_sum", kind="Hang", rung=RECREATE) == 20


def _with_goodput() -> api.TrainingJobStatus:
    badput = api.Badput(
        scheduling_seconds=30,
        startup_seconds=12.5,
        restore_seconds=4,
        checkpoint_save_seconds=2.25,
        wasted_progress_seconds=6,
        infrastructure_recovery_seconds=20,
        suspended_seconds=0,
    )
    goodput = api.Goodput(ratio=0.5, wall_seconds=149.5, productive_seconds=74.75, badput=badput)
    checkpoint = api.CheckpointRef(step=100, time=rfc3339(T0 - timedelta(seconds=90)))
    return api.TrainingJobStatus(phase="Running", goodput=goodput, latest_checkpoint=checkpoint)


def test_goodput_gauges_match_the_status(metrics):
    status = _with_goodput()
    metrics.observe_reconcile("ml", "llama", status, status, T0)
    assert sample(metrics, "tpujob_goodput_ratio", **JOB) == 0.5
    assert sample(metrics, "tpujob_productive_seconds", **JOB) == 74.75
    badput = status.goodput.badput
    by_cause = {
        cause: sample(metrics, "tpujob_badput_seconds", **JOB, cause=cause, badput_type=GOODPUT_BADPUT_TYPES[cause])
        for cause in BADPUT_CAUSES.values()
    }
    assert by_cause == {
        "scheduling": badput.scheduling_seconds,
        "startup": badput.startup_seconds,
        "restore": badput.restore_seconds,
        "checkpoint_save": badput.checkpoint_save_seconds,
        "wasted_progress": badput.wasted_progress_seconds,
        "infrastructure_recovery": badput.infrastructure_recovery_seconds,
        "suspended": badput.suspended_seconds,
        "queued": badput.queued_seconds,
        "reduced_size": badput.reduced_size_seconds,
    }
    assert status.goodput.productive_seconds + sum(by_cause.values()) == status.goodput.wall_seconds


def test_checkpoint_age_is_measured_at_scrape_time(metrics, clock):
    status = _with_goodput()
    metrics.observe_reconcile("ml", "llama", status, status, T0)
    assert sample(metrics, "tpujob_seconds_since_committed_checkpoint", **JOB) == 90
    clock.now += 15
    assert sample(metrics, "tpujob_seconds_since_committed_checkpoint", **JOB) == 105
    fresh = api.TrainingJobStatus(phase="Pending")  # no checkpoint yet, no ledger yet
    metrics.observe_reconcile("ml", "other", fresh, fresh, T0)
    other = {"namespace": "ml", "name": "other"}
    assert sample(metrics, "tpujob_seconds_since_committed_checkpoint", **other) is None
    assert sample(metrics, "tpujob_goodput_ratio", **other) is None


def test_live_jobs_are_counted_by_phase(metrics):
    for name, phase in (("a", "Running"), ("b", "Running"), ("c", "Pending"), ("d", "Succeeded")):
        status = api.TrainingJobStatus(phase=phase)
        metrics.observe_reconcile("ml", name, status, status, T0)
    jobs = {p: sample(metrics, "tpujob_jobs", phase=p) for p in ("Pending", "Running", "Restarting", "Suspended")}
    assert jobs == {"Pending": 1, "Running": 2, "Restarting": 0, "Suspended": 0}
    assert sample(metrics, "tpujob_jobs", phase="Succeeded") is None  # a finished job is not live
    metrics.forget("ml", "a")
    assert sample(metrics, "tpujob_jobs", phase="Running") == 1


def test_forget_drops_gauges_now_and_counters_after_the_retention(metrics, clock):
    tj, after = _restart(exit_code=1, decided=T0)
    metrics.observe_reconcile("ml", "llama", tj.status, after, T0)
    status = _with_goodput()
    metrics.observe_reconcile("ml", "llama", status, status, T0)
    assert sample(metrics, "tpujob_goodput_ratio", **JOB) == 0.5

    metrics.forget("ml", "llama")

    for gauge in ("tpujob_goodput_ratio", "tpujob_productive_seconds", "tpujob_seconds_since_committed_checkpoint"):
        assert sample(metrics, gauge, **JOB) is None
    assert sample(metrics, "tpujob_badput_seconds", **JOB, cause="scheduling", badput_type="") is None
    assert metrics.live_jobs() == 0
    # The final counts stay long enough for a scrape to see the last increment ...
    assert sample(metrics, "tpujob_restarts_total", **RESTART, kind="ApplicationError", counted="true") == 1
    clock.now += 601
    metrics.forget("ml", "some-other-job")  # ... and go at the next bookkeeping after the retention.
    assert sample(metrics, "tpujob_restarts_total", **RESTART, kind="ApplicationError", counted="true") is None
    assert sample(metrics, "tpujob_lost_steps_total", **JOB) is None


def test_a_job_seen_again_keeps_its_counters(metrics, clock):
    tj, after = _restart(exit_code=1, decided=T0)
    metrics.observe_reconcile("ml", "llama", tj.status, after, T0)
    metrics.forget("ml", "llama")
    metrics.observe_reconcile("ml", "llama", after, after, T0)  # re-created with the same name, say
    clock.now += 601
    metrics.forget("ml", "some-other-job")
    assert sample(metrics, "tpujob_restarts_total", **RESTART, kind="ApplicationError", counted="true") == 1


def test_reconcile_duration_and_errors(metrics):
    with metrics.reconciling():
        pass
    with pytest.raises(RuntimeError), metrics.reconciling():
        raise RuntimeError("apiserver unreachable")
    assert sample(metrics, "tpujob_reconcile_duration_seconds_count") == 2
    assert sample(metrics, "tpujob_reconcile_errors_total") == 1


def test_serve_exposes_the_metrics_over_http(metrics):
    tj, after = _restart(exit_code=1, decided=T0)
    metrics.observe_reconcile("ml", "llama", tj.status, after, T0)
    server = metrics.serve(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [restart] = [s for s in families["tpujob_restarts"].samples if s.name == "tpujob_restarts_total"]
    assert restart.labels == {**RESTART, "kind": "ApplicationError", "counted": "true"} and restart.value == 1
    assert {"tpujob_jobs", "tpujob_reconcile_duration_seconds", "tpujob_reconcile_errors"} <= set(families)


def test_metrics_port_flag():
    assert main.parse_args(["--no-leader-elect"]).metrics_port == 8081
    assert main.parse_args(["--no-leader-elect", "--metrics-port", "0"]).metrics_port == 0


def test_an_in_place_restart_is_counted_under_its_rung(metrics):
    tj = training_job(restart={"strategy": "InPlace"}, status={"phase": "Running", "attempt": 0})
    crashed = PodFacts("w1", 1, "Running", restart_count=1, last_exit_code=1, last_finished_at=T0)
    jobset = JobSetFacts("llama-a0", 0, None, T0, "Active", pods=(crashed,), uid=UID, in_place=True, in_place_round=1,
                         pods_in_place_round=1)  # fmt: skip
    after, _ = reconcile(tj, Observed(now=T0, jobsets=(jobset,), latest_committed_step=100))
    metrics.observe_reconcile("ml", "llama", tj.status, after, T0)
    labels = {**JOB, "kind": "ApplicationError", "counted": "true"}
    assert sample(metrics, "tpujob_restarts_total", **labels, rung="InPlace") == 1
    assert sample(metrics, "tpujob_restarts_total", **labels, rung=RECREATE) is None


def test_the_limits_the_alert_rules_compare_with_are_gauges_of_each_live_job(metrics, clock):
    spec = {"restart": {"hangTimeoutSeconds": 600, "maxRestarts": 5}}
    cadence = {"intervalSeconds": 40.0, "saveCostSeconds": 2.5, "overheadPercent": 1.5}
    progress = rfc3339(T0 - timedelta(seconds=90))
    tj = training_job(status={"phase": "Running", "countedRestarts": 2}, **spec)
    running = tj.status.model_copy(
        update={"last_progress_time": progress, "checkpoint_cadence": api.CheckpointCadence.model_validate(cadence)}
    )
    metrics.observe_reconcile("ml", "llama", tj.status, running, T0, tj.spec)

    assert sample(metrics, "tpujob_seconds_since_progress", **JOB) == 90
    assert sample(metrics, "tpujob_hang_timeout_seconds", **JOB) == 600
    assert (sample(metrics, "tpujob_counted_restarts", **JOB), sample(metrics, "tpujob_max_restarts", **JOB)) == (2, 5)
    assert sample(metrics, "tpujob_checkpoint_interval_seconds", **JOB) == 40
    assert sample(metrics, "tpujob_checkpoint_save_seconds", **JOB) == 2.5
    assert sample(metrics, "tpujob_checkpoint_overhead_ratio", **JOB) == pytest.approx(0.015)
    # Suspended: no step is expected, so no age of the last one; the limits stay.
    suspended = running.model_copy(update={"phase": "Suspended"})
    metrics.observe_reconcile("ml", "llama", running, suspended, T0, tj.spec)
    assert sample(metrics, "tpujob_seconds_since_progress", **JOB) is None
    assert sample(metrics, "tpujob_hang_timeout_seconds", **JOB) == 600
    # Before the trainer reports a cadence, its gauges are absent rather than 0.
    metrics.observe_reconcile("ml", "other", tj.status, tj.status, T0, tj.spec)
    assert sample(metrics, "tpujob_checkpoint_interval_seconds", namespace="ml", name="other") is None
    metrics.forget("ml", "llama")
    assert sample(metrics, "tpujob_max_restarts", **JOB) is None


def test_the_leader_gauge_is_set_once_the_process_leads(metrics):
    assert sample(metrics, "tpujob_leader") == 0
    metrics.mark_leading()
    assert sample(metrics, "tpujob_leader") == 1


def test_a_recovery_is_observed_stage_by_stage_and_the_stages_add_up_to_it(metrics):
    at = [rfc3339(T0 + timedelta(seconds=s)) for s in (0, 2, 5, 9, 20, 42)]
    timeline = api.FailureTimeline(failed=at[0], detected=at[1], job_set_created=at[2], pods_scheduled=at[3],
                                   restored=at[4], first_new_step=at[5])  # fmt: skip
    failure = api.FailureRecord(time=at[0], kind="ApplicationError", reason="ExitCode1", timeline=timeline)
    before = api.TrainingJobStatus(phase="Restarting", last_failure=failure)
    after = before.model_copy(update={"last_failure": failure.model_copy(update={"recovery_seconds": 42.0})})
    metrics.observe_reconcile("ml", "llama", before, after, T0 + timedelta(seconds=45))
    metrics.observe_reconcile("ml", "llama", after, after, T0 + timedelta(seconds=50))  # seen again: not counted

    stage = "tpujob_recovery_stage_seconds_sum"
    sums = {s: sample(metrics, stage, stage=s, rung=RECREATE) for s in metrics_module.RECOVERY_STAGES}
    assert sums == {"detect": 2, "replace": 3, "schedule": 4, "restore": 11, "first_step": 22}
    assert sum(v or 0 for v in sums.values()) == 42
    assert sample(metrics, "tpujob_recovery_stage_seconds_count", stage="detect", rung=RECREATE) == 1
    # In place: no new JobSet and no scheduling; what they would have ended is counted in the next stage.
    in_place = api.FailureTimeline(failed=at[0], detected=at[1], restored=at[4], first_new_step=at[5])
    assert metrics_module.recovery_stages(in_place) == {"detect": 2, "restore": 18, "first_step": 22}


def test_every_badput_cause_has_its_place_in_the_ml_goodput_taxonomy_or_none():
    assert set(GOODPUT_BADPUT_TYPES) == set(BADPUT_CAUSES.values())
    taxonomy = {"TPU_INITIALIZATION", "TRAINING_PREP", "PROGRAM_STARTUP", "DATA_LOADING_SYNC", "DATA_LOADING_ASYNC",
                "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME", "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
                "WASTED_PROGRESS_FROM_DISRUPTION", "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION", "CUSTOM_BADPUT_EVENTS",
                "OTHER"}  # ml-goodput-measurement's BadputType  # fmt: skip
    assert set(GOODPUT_BADPUT_TYPES.values()) - {""} <= taxonomy
