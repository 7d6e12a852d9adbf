"""The reconciler on a fleet's bad days: storage outages, long scheduling, suspension, re-created
jobs, broken checkpoints, refused objects. Each decision is checked on the pure function."""

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import tpujob_contract as contract
from tpujob_operator.api import RestartSpec
from tpujob_operator.facts import JobSetFacts, NodeFacts, Observed, PodFacts
from tpujob_operator.reconcile import reconcile, with_creation_refused
from tpujob_operator.restarts import backoff
from tpujob_operator.status import rfc3339

from .factories import progress_record, training_job

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
UID = "0000-1111"
HOUR = timedelta(hours=1)


def _jobset(attempt=0, state="Active", created=T0, pods=(), uid=UID, **facts):
    return JobSetFacts(f"llama-a{attempt}", attempt, None, created, state, pods=pods, uid=uid, **facts)


def _scheduled(name="w0", at=T0, phase="Running", **facts):
    return PodFacts(name, 0, phase, created=at, scheduled_at=at, **facts)


def _progress(step=50, attempt=0, at=T0, uid=UID, **fields):
    return progress_record(step=step, attempt=attempt, updated_at=at, uid=uid, **fields)


def _condition(status, type_):
    return next(((c.status, c.reason, c.message) for c in status.conditions if c.type == type_), None)


def _running(**spec):
    return training_job(
        status={"phase": "Running", "attempt": 0, "step": 50, "lastProgressTime": rfc3339(T0), "stage": "Training"},
        **spec,
    )


# --- storage faults are not job faults ---------------------------------------------------------------


def test_storage_outage_longer_than_the_hang_timeout_is_reported_not_a_hang():
    tj = _running(restart={"hangTimeoutSeconds": 60})
    late = T0 + HOUR
    status, actions = reconcile(
        tj, Observed(now=late, jobsets=(_jobset(pods=(_scheduled(),)),), storage_error="listing failed: 503")
    )
    assert status.phase == "Running" and status.restarts == 0 and actions.delete == []
    assert (status.step, status.last_progress_time) == (50, rfc3339(T0))  # the last known progress is kept
    assert _condition(status, "CheckpointStorageReachable")[:2] == ("False", "Unreachable")
    assert status.checkpoint_storage_error == "listing failed: 503"
    assert "CheckpointStorageError" in [e.reason for e in actions.events]


def test_after_an_outage_the_hang_clock_starts_again_at_the_recovery():
    tj = _running(restart={"hangTimeoutSeconds": 60})
    pods = (_scheduled(),)
    down = training_job(
        restart={"hangTimeoutSeconds": 60},
        status={**tj.status.model_dump(by_alias=True, exclude_none=True), "checkpointStorageError": "503"},
    )
    back = T0 + HOUR
    status, actions = reconcile(down, Observed(now=back, jobsets=(_jobset(pods=pods),), progress=_progress()))
    assert status.phase == "Running" and status.storage_recovery_time == rfc3339(back)
    assert _condition(status, "CheckpointStorageReachable")[:2] == ("True", "Readable")
    assert "CheckpointStorageReachable" in [e.reason for e in actions.events]
    later = training_job(restart={"hangTimeoutSeconds": 60}, status=status.model_dump(by_alias=True, exclude_none=True))
    still, _ = reconcile(
        later, Observed(now=back + timedelta(seconds=59), jobsets=(_jobset(pods=pods),), progress=_progress())
    )
    assert still.phase == "Running"
    hung, _ = reconcile(
        later, Observed(now=back + timedelta(seconds=61), jobsets=(_jobset(pods=pods),), progress=_progress())
    )
    assert hung.last_failure is not None and hung.last_failure.kind == "Hang"


def test_a_worker_that_gave_up_on_storage_restarts_without_spending_the_budget():
    tj = _running(restart={"maxRestarts": 0})
    pods = (_scheduled(phase="Failed", exit_code=3, finished_at=T0),)
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_jobset(pods=pods),), latest_committed_step=40))
    assert status.phase == "Restarting" and (status.restarts, status.counted_restarts) == (1, 0)
    assert status.last_failure.kind == "StorageUnavailable" and status.last_failure.counted is False


def test_workers_that_keep_failing_to_reach_storage_end_the_job_after_an_hour_not_never():
    def exit_3(status, attempt, at, progress=None):
        tj = training_job(restart={"maxRestarts": 0}, status=status.model_dump(by_alias=True, exclude_none=True))
        pods = (_scheduled(phase="Failed", exit_code=3, finished_at=at),)
        observed = Observed(now=at, jobsets=(_jobset(attempt=attempt, pods=pods),), latest_committed_step=40)
        return reconcile(tj, observed)

    status, _ = exit_3(_running().status, 0, T0)
    assert status.phase == "Restarting" and status.storage_unavailable_since == rfc3339(T0)
    status, _ = exit_3(status, 1, T0 + timedelta(minutes=50))
    assert status.phase == "Restarting" and status.storage_unavailable_since == rfc3339(T0)  # the same streak
    status, actions = exit_3(status, 2, T0 + timedelta(minutes=61))
    assert status.phase == "Failed" and _condition(status, "Failed")[1] == "StorageOutage"
    assert "gs://acme-ckpt" in _condition(status, "Failed")[2] and status.counted_restarts == 0
    assert actions.delete == ["llama-a2"] and actions.create_attempt is None  # and it holds no slice
    # An attempt that reached storage and trained ends the streak: the next outage starts its own hour.
    restarting = training_job(status={"phase": "Restarting", "attempt": 1, "storageUnavailableSince": rfc3339(T0)})
    trained = _progress(step=60, attempt=1, at=T0 + timedelta(minutes=50))
    status, _ = reconcile(restarting, Observed(now=T0 + timedelta(minutes=50), progress=trained,
                          jobsets=(_jobset(attempt=1, pods=(_scheduled(),)),)))  # fmt: skip
    assert status.phase == "Running" and status.storage_unavailable_since is None


def test_a_restart_during_an_outage_lets_the_trainer_find_the_latest_step():
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "latestCheckpoint": {"step": 40}})
    status, actions = reconcile(tj, Observed(now=T0, storage_error="timeout"))
    assert actions.create_attempt == 1 and actions.resume_step is None
    assert status.latest_checkpoint.step == 40


# --- one clock per stage ------------------------------------------------------------------------------


def test_waiting_an_hour_for_capacity_is_not_a_hang():
    tj = training_job(restart={"hangTimeoutSeconds": 60}, status={"phase": "Pending", "attempt": 0})
    pods = (
        PodFacts(
            "w0", 0, "Pending", created=T0, unschedulable_message="0/4 nodes are available: Insufficient google.com/tpu"
        ),
    )
    status, actions = reconcile(tj, Observed(now=T0 + HOUR, jobsets=(_jobset(pods=pods, expected_pods=2),)))
    assert status.phase == "Pending" and status.stage == "Scheduling" and status.restarts == 0
    assert _condition(status, "Pending")[:2] == ("True", "Unschedulable")
    assert "Insufficient google.com/tpu" in _condition(status, "Pending")[2]
    assert actions.delete == []


def test_a_scheduling_timeout_applies_only_when_set():
    tj = training_job(restart={"schedulingTimeoutSeconds": 600}, status={"phase": "Pending", "attempt": 0})
    pods = (PodFacts("w0", 0, "Pending", created=T0),)
    early, _ = reconcile(tj, Observed(now=T0 + timedelta(seconds=599), jobsets=(_jobset(pods=pods, expected_pods=1),)))
    assert early.phase == "Pending"
    late, actions = reconcile(
        tj, Observed(now=T0 + timedelta(seconds=601), jobsets=(_jobset(pods=pods, expected_pods=1),))
    )
    assert late.last_failure.kind == "SchedulingTimeout" and late.counted_restarts == 1
    assert actions.delete == ["llama-a0"]


def test_start_up_has_its_own_clock_and_reports_a_stuck_image_pull():
    tj = training_job(
        restart={"hangTimeoutSeconds": 60, "startupTimeoutSeconds": 900}, status={"phase": "Pending", "attempt": 0}
    )
    placed = T0 + HOUR  # scheduled after an hour of waiting for capacity
    pods = (
        _scheduled(
            at=placed, phase="Pending", waiting_reason="ImagePullBackOff", waiting_message="Back-off pulling image"
        ),
    )
    js = _jobset(pods=pods, expected_pods=1)
    status, _ = reconcile(tj, Observed(now=placed + timedelta(seconds=899), jobsets=(js,)))
    assert (status.phase, status.stage) == ("Pending", "StartingUp")
    assert _condition(status, "Pending")[:2] == ("True", "ImagePullBackOff")
    timed_out, _ = reconcile(tj, Observed(now=placed + timedelta(seconds=901), jobsets=(js,)))
    assert timed_out.last_failure.kind == "StartupTimeout"


def test_create_container_config_error_is_reported():
    tj = training_job(status={"phase": "Pending", "attempt": 0})
    pods = (
        _scheduled(
            phase="Pending", waiting_reason="CreateContainerConfigError", waiting_message='secret "hf" not found'
        ),
    )
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_jobset(pods=pods, expected_pods=1),)))
    assert _condition(status, "Pending") == ("True", "CreateContainerConfigError", 'pod w0: secret "hf" not found')


def test_pods_refused_by_admission_are_reported():
    tj = training_job(status={"phase": "Pending", "attempt": 0})
    refusal = 'pods "llama-a0-slice-0-0" is forbidden: exceeded quota: no-pods'
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_jobset(expected_pods=1, pod_creation_refused=refusal),)))
    assert _condition(status, "Pending") == ("True", "PodCreationRefused", refusal)


# --- suspension is not a failure -----------------------------------------------------------------------


def test_pods_that_exit_while_suspended_are_never_classified():
    tj = training_job(suspend=True, status={"phase": "Suspended", "attempt": 0})
    stopped = (_scheduled(phase="Failed", exit_code=143, finished_at=T0),)
    js = _jobset(state="Suspended", pods=stopped, suspended_by_operator=True)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(js,)))
    assert status.phase == "Suspended" and status.restarts == 0 and status.last_failure is None
    assert actions.delete == [] and actions.set_suspend is None


def test_a_suspension_by_someone_else_is_respected_and_not_a_failure():
    tj = _running()
    stopped = (_scheduled(phase="Failed", exit_code=143, finished_at=T0),)
    status, actions = reconcile(tj, Observed(now=T0 + HOUR, jobsets=(_jobset(state="Suspended", pods=stopped),)))
    assert status.phase == "Suspended" and _condition(status, "Suspended")[1] == "SuspendedExternally"
    assert actions.set_suspend is None and status.restarts == 0


def test_after_a_resume_old_pods_are_history_and_the_clocks_start_again():
    tj = _running(restart={"hangTimeoutSeconds": 60})
    resumed = T0 + HOUR
    pods = (
        _scheduled("old", at=T0, phase="Failed", exit_code=143, finished_at=T0),
        _scheduled("new", at=resumed),
    )
    js = _jobset(pods=pods, resumed_at=resumed, expected_pods=1)
    status, actions = reconcile(tj, Observed(now=resumed + timedelta(seconds=120), jobsets=(js,), progress=_progress()))
    # The only progress is from before the suspension: the attempt is starting up again, not hung.
    assert status.restarts == 0 and actions.delete == []
    assert status.stage == "StartingUp" and status.phase == "Pending"


def test_while_the_jobset_controller_resumes_nothing_is_classified():
    tj = training_job(status={"phase": "Suspended", "attempt": 0})
    stopped = (_scheduled(phase="Failed", exit_code=143, finished_at=T0),)
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_jobset(pods=stopped, resuming=True),)))
    assert status.restarts == 0 and _condition(status, "Pending")[1] == "Resuming"


# --- identity --------------------------------------------------------------------------------------------


def test_a_jobset_of_an_earlier_incarnation_is_removed_not_adopted():
    tj = training_job(status={})
    orphan = _jobset(state="Completed", uid="old-uid")
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(orphan,), latest_committed_step=80))
    assert status.phase == "Pending" and actions.create_attempt is None
    # Its workers are healthy: stopped with their save grace, not killed
    assert actions.stop == ["llama-a0"] and not actions.delete and "OrphanRemoved" in [e.reason for e in actions.events]
    gone, actions = reconcile(tj, Observed(now=T0, jobsets=(), latest_committed_step=80, foreign_pods=2))
    assert actions.create_attempt is None and _condition(gone, "Pending")[1] == "RemovingOrphans"
    started, actions = reconcile(tj, Observed(now=T0, jobsets=(), latest_committed_step=80))
    assert (actions.create_attempt, actions.resume_step) == (0, 80) and started.phase == "Pending"


def test_a_progress_record_of_another_incarnation_is_ignored():
    tj = training_job(status={"phase": "Pending", "attempt": 0})
    stale = _progress(step=999, state="succeeded", uid="old-uid")
    status, _ = reconcile(
        tj, Observed(now=T0, jobsets=(_jobset(pods=(_scheduled(),), expected_pods=1),), progress=stale)
    )
    assert status.step is None and status.phase == "Pending" and status.stage == "StartingUp"


# --- checkpoint integrity ---------------------------------------------------------------------------------


def test_an_incompatible_checkpoint_fails_the_job_at_once_without_spending_the_budget():
    tj = _running(restart={"maxRestarts": 5})
    pods = (_scheduled(phase="Failed", exit_code=4, finished_at=T0),)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_jobset(pods=pods),), latest_committed_step=40))
    assert status.phase == "Failed" and _condition(status, "Failed")[1] == "CheckpointIncompatible"
    assert (status.restarts, status.counted_restarts) == (0, 0) and actions.create_attempt is None
    assert status.last_failure.counted is False


def test_the_step_actually_restored_is_recorded_with_an_event():
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "resumedFromStep": 60})
    progress = _progress(step=45, attempt=1, restored_step=40, resumed_from_step=40,
                         restore_failures=(contract.RestoreFailure(60, "missing object"),),
                         quarantined=(contract.QuarantinedStep(60, "run/quarantine/60"),))  # fmt: skip
    pods = (_scheduled(),)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_jobset(attempt=1, pods=pods),), progress=progress))
    assert status.resumed_from_step == 40
    fallback = [e for e in actions.events if e.reason == "RestoreFallback"]
    assert fallback and "step 60 (missing object)" in fallback[0].message and "restored step 40" in fallback[0].message
    assert "quarantined step(s) 60 to quarantine/" in fallback[0].message
    assert status.quarantined_checkpoints == [60]


def test_quarantined_steps_stay_named_in_status_across_attempts():
    tj = training_job(status={"phase": "Running", "attempt": 2, "quarantinedCheckpoints": [60]})
    moved = (contract.QuarantinedStep(90, "run/quarantine/90"),)
    progress = _progress(step=95, attempt=2, restored_step=80, resumed_from_step=90, quarantined=moved)
    pods = (_scheduled(),)
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_jobset(attempt=2, pods=pods),), progress=progress))
    assert status.quarantined_checkpoints == [60, 90]


# --- refused objects, bounded numbers ----------------------------------------------------------------------


def test_a_refused_jobset_fails_only_when_the_refusal_is_permanent():
    status = training_job(status={"phase": "Pending", "attempt": 0, "jobSetName": "llama-a0"}).status
    invalid = with_creation_refused(status, "spec.x: Invalid value", permanent=True, now=T0)
    assert invalid.phase == "Failed" and _condition(invalid, "Failed")[1] == "JobSetRefused"
    assert "spec.x: Invalid value" in _condition(invalid, "Failed")[2]
    quota = with_creation_refused(status, "exceeded quota", permanent=False, now=T0)
    assert quota.phase == "Pending" and _condition(quota, "Pending")[1] == "JobSetRefused"
    # The next reconcile tries again without announcing a new attempt.
    tj = training_job(status=quota.model_dump(by_alias=True, exclude_none=True))
    again, actions = reconcile(tj, Observed(now=T0))
    assert actions.create_attempt == 0 and actions.events == [] and _condition(again, "Pending")[1] == "JobSetRefused"


def test_backoff_never_overflows():
    policy = RestartSpec(backoff_seconds=604800, max_backoff_seconds=604800, max_restarts=10000)
    assert backoff(policy, 10000, counted=True) == timedelta(seconds=604800)


def test_a_resume_that_replaces_a_stale_jobset_is_not_announced_as_a_restart():
    tj = training_job(status={"phase": "Suspended", "attempt": 0})
    stale = _jobset(state="Suspended", suspended_by_operator=True)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(stale,), latest_committed_step=160))
    assert actions.stop == ["llama-a0"] and not actions.delete and status.attempt == 1
    after = training_job(status=status.model_dump(by_alias=True, exclude_none=True))
    created, actions = reconcile(after, Observed(now=T0, latest_committed_step=160))
    assert (actions.create_attempt, actions.resume_step) == (1, 160)
    assert created.phase == "Pending" and _condition(created, "Pending")[1] == "Resuming"
    assert created.restarts == 0 and [e.reason for e in actions.events] == []


def test_an_unschedulable_leader_explains_the_refused_followers():
    tj = training_job(status={"phase": "Pending", "attempt": 0})
    leader = PodFacts("w0", 0, "Pending", created=T0, unschedulable_message="0/3 nodes are available")
    refusal = 'admission webhook "vpod.kb.io" denied the request: follower pod node selector not found'
    js = _jobset(pods=(leader,), expected_pods=2, pod_creation_refused=refusal)
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(js,)))
    assert _condition(status, "Pending")[:2] == ("True", "Unschedulable")


# --- giving up releases everything --------------------------------------------------------------------


def _given_up(tj, observed):
    status, actions = reconcile(tj, observed)
    assert status.phase == "Failed", status.phase
    # The same answer from the finished job's status, as after an operator restart between the
    # status write and the delete: level-triggered.
    _, later = reconcile(training_job(status=status.model_dump(by_alias=True, exclude_none=True)), observed)
    return status, actions, later


def test_every_way_to_failed_deletes_the_attempt_and_a_finished_job_keeps_deleting_it():
    hung = _running(restart={"maxRestarts": 0, "hangTimeoutSeconds": 60})
    pods = (_scheduled(),)
    late = T0 + timedelta(seconds=61)
    waiting = training_job(
        restart={"maxRestarts": 0, "schedulingTimeoutSeconds": 60, "startupTimeoutSeconds": 60},
        status={"phase": "Pending", "attempt": 0},
    )
    cases = {
        "Hang": (hung, Observed(now=late, jobsets=(_jobset(pods=pods),), progress=_progress())),
        "StartupTimeout": (waiting, Observed(now=late, jobsets=(_jobset(pods=pods, expected_pods=1),))),
        "SchedulingTimeout": (waiting, Observed(now=late, jobsets=(_jobset(pods=(), expected_pods=1),))),
        "ApplicationError": (
            _running(restart={"maxRestarts": 0}),
            Observed(now=T0, jobsets=(_jobset(pods=(_scheduled(phase="Failed", exit_code=1, finished_at=T0),)),)),
        ),
        "CheckpointIncompatible": (
            _running(restart={"maxRestarts": 5}),
            Observed(now=T0, jobsets=(_jobset(pods=(_scheduled(phase="Failed", exit_code=4, finished_at=T0),)),)),
        ),
    }
    for kind, (tj, observed) in cases.items():
        status, actions, later = _given_up(tj, observed)
        assert status.last_failure.kind == kind
        # Hung or failed workers cannot save without their peers: gone in seconds, as on a restart.
        assert (actions.delete, actions.stop, actions.create_attempt) == (["llama-a0"], [], None), kind
        assert (later.delete, later.stop, later.events) == (["llama-a0"], [], []), kind
        assert later.requeue_after is not None  # looked at again until the JobSet is gone
        gone = training_job(status=status.model_dump(by_alias=True, exclude_none=True))
        _, done = reconcile(gone, Observed(now=late, jobsets=(_jobset(deleting=True),)))
        assert (done.delete, done.stop, done.requeue_after) == ([], [], None), kind


def test_a_job_failed_for_another_reason_stops_its_live_workers_with_their_save_grace():
    # An invalid spec or a policy refusal (written by the runtime) ends a healthy attempt: it saves first.
    failed = {"phase": "Failed", "attempt": 2, "conditions": [{"type": "Failed", "status": "True",
              "reason": "PolicyViolation", "message": "serviceAccountName not allowed"}]}  # fmt: skip
    tj = training_job(status=failed)
    live, other = _jobset(attempt=2, pods=(_scheduled(),)), _jobset(attempt=1, uid="old-uid")
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(live, other)))
    assert status == tj.status and (actions.stop, actions.delete) == (["llama-a2"], [])


# --- storage permission errors are not outages ---------------------------------------------------------


def test_a_worker_refused_by_storage_fails_the_job_at_once_naming_the_bucket_and_the_identity():
    tj = _running(restart={"maxRestarts": 5}, serviceAccountName="trainer")
    said = "StoragePermissionDenied: gs://acme-ckpt as trainer@acme.iam.gserviceaccount.com: 403 Forbidden"
    pods = (_scheduled(phase="Failed", exit_code=5, finished_at=T0, termination_message=said),)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_jobset(pods=pods),), latest_committed_step=40))
    assert status.phase == "Failed" and _condition(status, "Failed")[1] == "StoragePermissionDenied"
    message = _condition(status, "Failed")[2]
    assert "gs://acme-ckpt" in message and "ServiceAccount ml/trainer" in message and "grant" in message
    assert "(the trainer: gs://acme-ckpt as trainer@acme.iam.gserviceaccount.com: 403 Forbidden)" in message
    from tpujob_operator.jobset import pod_facts  # where the message comes from: the container's termination

    terminated = {"exitCode": 5, "reason": "Error", "message": said}
    pod = {"metadata": {"name": "w"}, "status": {"phase": "Failed", "containerStatuses": [
           {"name": "trainer", "state": {"terminated": terminated}}]}}  # fmt: skip
    assert pod_facts(pod).termination_message == said
    assert (status.restarts, status.counted_restarts, status.last_failure.counted) == (0, 0, False)
    assert status.last_failure.kind == "StoragePermissionDenied"
    assert actions.create_attempt is None and actions.delete == ["llama-a0"]  # and it holds no slice


def test_the_operators_own_storage_refusal_is_a_condition_of_its_own_not_an_outage():
    tj = _running()
    refused = "listing gs://acme-ckpt/runs/ml/llama/checkpoints: permission denied (403): ... gs://acme-ckpt ..."
    observed = Observed(now=T0, jobsets=(_jobset(pods=(_scheduled(),)),), storage_error=refused, storage_denied=True)
    status, _ = reconcile(tj, observed)
    assert _condition(status, "CheckpointStorageReachable") == ("False", "PermissionDenied", refused)
    assert _condition(status, "Running")[1] == "StoragePermissionDenied"


# --- status a newer operator wrote, a failed JobSet suspended ------------------------------------------


def test_status_written_by_a_newer_operator_is_kept_and_reconciled_not_refused():
    from tpujob_operator.api import TrainingJob

    newer = {
        "phase": "Draining", "stage": "Quiescing", "attempt": 0, "futureField": {"x": 1},
        "conditions": [{"type": "Draining", "status": "True", "reason": "Maintenance", "message": "m"}],
        "lastFailure": {"time": rfc3339(T0), "kind": "GremlinAttack", "reason": "Gremlin", "futureDetail": "d"},
        "goodput": {"updatedAt": rfc3339(T0), "badput": {"schedulingSeconds": 1.0, "futureSeconds": 2.0}},
    }  # fmt: skip
    tj = training_job(status=newer)  # before: a ValidationError, so the job failed as InvalidSpec
    assert (tj.status.phase, tj.status.stage, tj.status.last_failure.kind) == ("Draining", "Quiescing", "GremlinAttack")
    status, _ = reconcile(tj, Observed(now=T0 + timedelta(seconds=10), jobsets=(_jobset(pods=(_scheduled(),)),)))
    written = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert written["futureField"] == {"x": 1} and written["lastFailure"]["futureDetail"] == "d"
    assert written["lastFailure"]["kind"] == "GremlinAttack" and written["goodput"]["badput"]["futureSeconds"] == 2.0
    assert status.phase == "Pending" and _condition(status, "Draining")[:2] == ("False", "Pending")
    again = TrainingJob.model_validate({**tj.model_dump(by_alias=True, mode="json"), "status": written})
    assert again.status.model_dump(by_alias=True, exclude_none=True, mode="json") == written  # a round trip


def test_a_failed_jobset_under_spec_suspend_is_suspended_and_announced_once():
    tj = training_job(suspend=True, status={"phase": "Running", "attempt": 0})
    failed = _jobset(state="Failed", pods=(_scheduled(phase="Failed", exit_code=1, finished_at=T0),))
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(failed,)))
    assert actions.set_suspend == ("llama-a0", True) and [e.reason for e in actions.events] == ["Suspended"]
    # The JobSet now carries the operator's suspension, but its Failed condition still decides its state.
    suspended = _jobset(state="Failed", suspended_by_operator=True)
    later = training_job(suspend=True, status=status.model_dump(by_alias=True, exclude_none=True))
    status, actions = reconcile(later, Observed(now=T0 + timedelta(seconds=60), jobsets=(suspended,)))
    assert status.phase == "Suspended" and actions.set_suspend is None and actions.events == []


def test_a_recreated_attempt_that_restored_a_step_committed_after_the_decision_records_it():
    # The failed attempt's last save committed after the restart was decided and its JobSet created:
    # the pin means that step or a newer one, so the new attempt restored 61, not the decided 31.
    pods = (_scheduled(phase="Failed", exit_code=137, finished_at=T0),)
    failed = Observed(now=T0, jobsets=(_jobset(pods=pods),), progress=_progress(step=65), latest_committed_step=31)
    decided, _ = reconcile(_running(), failed)
    assert (decided.attempt, decided.last_failure.resume_step) == (1, 31)
    assert (decided.last_failure.lost_steps, decided.lost_steps) == (34, 34)
    later = T0 + timedelta(seconds=30)
    restarted = training_job(status=decided.model_dump(by_alias=True, exclude_none=True))
    progress = _progress(step=70, attempt=1, at=later, restored_step=61, resumed_from_step=61)
    observed = Observed(
        now=later, jobsets=(_jobset(attempt=1, pods=(_scheduled(),)),), progress=progress, latest_committed_step=61
    )
    status, _ = reconcile(restarted, observed)
    assert status.phase == "Running" and status.resumed_from_step == 61
    assert (status.last_failure.resume_step, status.last_failure.lost_steps, status.lost_steps) == (61, 4, 4)
    assert status.last_failure.recovery_seconds is not None


def test_recovery_is_not_measured_before_the_attempt_trains_past_the_step_it_restored():
    # Decided at 31; the new attempt restored 61 (a save committed after the decision). Its record at
    # step 61, restored and not yet trained, is not the recovery: that is its first step, 62.
    pods = (_scheduled(phase="Failed", exit_code=137, finished_at=T0),)
    failed = Observed(now=T0, jobsets=(_jobset(pods=pods),), progress=_progress(step=65), latest_committed_step=31)
    decided, _ = reconcile(_running(), failed)
    restored_at, first_step_at = T0 + timedelta(seconds=20), T0 + timedelta(seconds=35)

    def observe(before, progress, now):
        tj = training_job(status=before.model_dump(by_alias=True, exclude_none=True))
        jobsets = (_jobset(attempt=1, pods=(_scheduled(),)),)
        return reconcile(tj, Observed(now=now, jobsets=jobsets, progress=progress, latest_committed_step=61))[0]

    restored = _progress(step=61, attempt=1, at=restored_at, restored_step=61, resumed_from_step=61)
    status = observe(decided, restored, restored_at)
    assert (status.last_failure.resume_step, status.last_failure.recovery_seconds) == (61, None)
    trained = _progress(step=62, attempt=1, at=first_step_at, restored_step=61, first_step_at=rfc3339(first_step_at))
    status = observe(status, trained, first_step_at)
    assert status.last_failure.recovery_seconds == 35.0


# --- the third round: no overlap, no cut save, evictions counted (issue 30) -------------------------------


def _with_peer_on(node: str, finished=T0):
    crashed = PodFacts("w0", 0, "Failed", exit_code=1, reason="Error", finished_at=finished, node="n0")
    peer = PodFacts("w1", 1, "Running", created=T0, scheduled_at=T0, node=node)
    return _jobset(pods=(crashed, peer), expected_pods=2)


def test_a_restart_starts_no_attempt_while_a_worker_of_the_failed_one_may_still_write():
    tj = _running(restart={"backoffSeconds": 0, "maxRestarts": 5})
    nodes = {"n0": NodeFacts("n0", ready="True"), "n1": NodeFacts("n1", ready="True")}
    later = T0 + timedelta(seconds=90)  # past the nodes' verdict wait: the failure is decided
    status, actions = reconcile(tj, Observed(now=later, jobsets=(_with_peer_on("n1"),), nodes=nodes))
    # The peer ends within its 5 s of grace: until then it may still write the run directory.
    assert actions.delete == ["llama-a0"] and actions.create_attempt is None and status.attempt == 1
    assert "1 worker pods of the previous attempt" in _condition(status, "Restarting")[2]
    after = training_job(restart={"backoffSeconds": 0, "maxRestarts": 5}, status=status.model_dump(by_alias=True))
    still, actions = reconcile(after, Observed(now=later, earlier_pods=1, nodes=nodes))
    assert actions.create_attempt is None and actions.requeue_after == 2.0
    assert _condition(still, "Restarting")[1] == _condition(status, "Restarting")[1]  # the failure's reason stays
    _, actions = reconcile(after, Observed(now=later, earlier_pods=0, nodes=nodes, latest_committed_step=40))
    assert (actions.create_attempt, actions.resume_step) == (1, 40)


def test_a_worker_cut_off_on_an_unreachable_node_is_waited_for_only_while_it_could_still_commit():
    nodes = {"n0": NodeFacts("n0", ready="True"), "n1": NodeFacts("n1", ready="Unknown")}
    later = T0 + timedelta(seconds=90)
    tj = _running(restart={"backoffSeconds": 0, "maxRestarts": 5})
    # Beside a peer that failed, it can neither train nor commit (a save needs every process): go on.
    _, actions = reconcile(tj, Observed(now=later, jobsets=(_with_peer_on("n1"),), nodes=nodes))
    assert actions.create_attempt == 1
    # Alone in its attempt (a one-host job), it may train and commit on: wait for it.
    hung = _running(restart={"backoffSeconds": 0, "maxRestarts": 5, "hangTimeoutSeconds": 60})
    alone = PodFacts("w0", 0, "Running", created=T0, scheduled_at=T0, node="n1")
    jobsets = (_jobset(pods=(alone,), expected_pods=1),)
    observed = Observed(now=later, jobsets=jobsets, nodes=nodes, progress=_progress(), latest_committed_step=40)
    status, actions = reconcile(hung, observed)
    assert status.last_failure is not None and status.last_failure.kind == "Hang"
    assert status.last_failure is not None and actions.create_attempt is None and status.attempt == 1


def test_a_restart_with_no_backoff_goes_on_at_once_when_the_failed_attempts_workers_are_gone():
    tj = _running(restart={"backoffSeconds": 0, "maxRestarts": 5})
    nodes = {"n0": NodeFacts("n0", ready="True")}  # n1 is gone: nothing runs there any more
    status, actions = reconcile(
        tj, Observed(now=T0 + timedelta(seconds=90), jobsets=(_with_peer_on("n1"),), nodes=nodes)
    )
    assert actions.delete == ["llama-a0"] and actions.create_attempt == 1 and status.attempt == 1


def test_resuming_a_suspension_waits_for_the_suspensions_save_and_never_cuts_it():
    tj = training_job(status={"phase": "Suspended", "attempt": 0})
    saving = PodFacts("w0", 0, "Running", created=T0, scheduled_at=T0, node="n0")
    stale = _jobset(state="Suspended", suspended_by_operator=True, pods=(saving,))
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(stale,), latest_committed_step=160))
    assert not (actions.delete or actions.stop or actions.set_suspend) and status.attempt == 0
    assert _condition(status, "Pending")[1:] == (
        "Resuming",
        "waiting for 1 worker pods of JobSet llama-a0 to finish the suspension's save",
    )
    saved = _jobset(state="Suspended", suspended_by_operator=True)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(saved,), latest_committed_step=170))
    assert actions.stop == ["llama-a0"] and not actions.delete and status.attempt == 1


def test_an_earlier_attempt_left_by_a_dead_operator_is_stopped_unless_it_failed():
    tj = training_job(status={"phase": "Pending", "attempt": 1})
    healthy, failed = _jobset(attempt=0), _jobset(attempt=0, state="Failed")
    _, actions = reconcile(tj, Observed(now=T0, jobsets=(healthy,)))
    assert actions.stop == ["llama-a0"] and not actions.delete
    _, actions = reconcile(tj, Observed(now=T0, jobsets=(failed,)))
    assert actions.delete == ["llama-a0"] and not actions.stop


def _decided(tj, failed: PodFacts):
    """The decision on a Failed JobSet whose one pod is `failed`, and the failure it records."""
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(_jobset(state="Failed", pods=(failed,)),)))
    assert status.last_failure is not None
    return status, status.last_failure


def test_a_node_pressure_eviction_is_the_jobs_own_and_counts():
    tj = _running(restart={"maxRestarts": 5})
    evicted = PodFacts(
        "w0",
        0,
        "Failed",
        exit_code=137,
        reason="Error",
        pod_reason="Evicted",
        pod_message="The node was low on resource: memory.",
        disruption_reason="TerminationByKubelet",
        finished_at=T0,
    )
    status, failure = _decided(tj, evicted)
    assert (failure.kind, failure.reason, failure.counted) == ("ApplicationError", "Evicted", True)
    assert "node pressure: The node was low on resource: memory." in failure.message
    assert status.counted_restarts == 1
    shutdown = PodFacts(
        "w0",
        0,
        "Failed",
        exit_code=143,
        pod_reason="Terminated",
        disruption_reason="TerminationByKubelet",
        finished_at=T0,
    )
    assert not _decided(tj, shutdown)[1].counted  # a node shutdown is not the job's


def test_an_operator_blind_to_storage_past_the_limit_stops_the_job_with_the_save_grace_uncounted():
    unreadable = {"type": "CheckpointStorageReachable", "status": "False", "lastTransitionTime": rfc3339(T0)}
    tj = training_job(
        status={**_running().status.model_dump(by_alias=True, exclude_none=True), "conditions": [unreadable]}
    )
    observed = Observed(now=T0 + HOUR, jobsets=(_jobset(pods=(_scheduled(),)),), storage_error="403 Forbidden")
    status, actions = reconcile(tj, observed)
    assert status.phase == "Running" and not actions.stop  # an hour: still waiting, no clock decides
    status, actions = reconcile(tj, replace(observed, now=T0 + HOUR + timedelta(seconds=2)))
    assert status.phase == "Failed" and _condition(status, "Failed")[1] == "CheckpointStorageUnreadable"
    assert actions.stop == ["llama-a0"] and not actions.delete  # its workers save first
    assert status.counted_restarts == 0 and status.last_failure is None
    assert "CheckpointStorageUnreadable" in [e.reason for e in actions.events]


def _lost_node_failure(streak: int, resumed_from: int):
    previous = {
        "time": rfc3339(T0 - HOUR),
        "kind": "NodeLost",
        "reason": "DeletionByPodGC",
        "resumeStep": resumed_from,
        "counted": False,
    }
    status = {**_running().status.model_dump(by_alias=True, exclude_none=True), "lastFailure": previous}
    tj = training_job(status={**status, "uncountedRestartsWithoutProgress": streak}, restart={"maxRestarts": 3})
    lost = PodFacts("w0", 0, "Failed", disruption_reason="DeletionByPodGC", finished_at=T0)
    return tj, _jobset(state="Failed", pods=(lost,))


def test_infrastructure_failures_restart_uncounted_but_not_for_ever_without_a_new_commit():
    tj, failed = _lost_node_failure(streak=9, resumed_from=40)
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(failed,), latest_committed_step=40))
    assert status.phase == "Restarting" and status.uncounted_restarts_without_progress == 10
    tj, failed = _lost_node_failure(streak=10, resumed_from=40)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(failed,), latest_committed_step=40))
    assert status.phase == "Failed" and _condition(status, "Failed")[1] == "RestartsWithoutProgress"
    assert status.counted_restarts == 0 and status.last_failure is not None and not status.last_failure.counted
    assert actions.delete == ["llama-a0"]  # the failed attempt's workers cannot save: they go at once
    # A new commit since the previous failure: the streak starts again.
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(failed,), latest_committed_step=50))
    assert status.phase == "Restarting" and status.uncounted_restarts_without_progress == 1


def test_a_restore_fallback_onto_the_pinned_step_is_reported():
    # The decision pinned step 100; a save of step 120 committed after it, was found damaged, and the
    # trainer fell back to 100: the pinned step, which status already names as the resume point.
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "resumedFromStep": 100})
    broken = contract.RestoreFailure(step=120, error="OCDBT manifest unreadable")
    record = _progress(step=101, attempt=1, restored_step=100, restore_failures=(broken,), restore_finished_at=T0)
    status, actions = reconcile(
        tj, Observed(now=T0, jobsets=(_jobset(attempt=1, pods=(_scheduled(),)),), progress=record)
    )
    assert "RestoreFallback" in [e.reason for e in actions.events]
    again = training_job(status=status.model_dump(by_alias=True, exclude_none=True))
    later = _progress(step=130, attempt=1, restored_step=100, restore_failures=(broken,), restore_finished_at=T0)
    _, actions = reconcile(again, Observed(now=T0, jobsets=(_jobset(attempt=1, pods=(_scheduled(),)),), progress=later))
    assert "RestoreFallback" not in [e.reason for e in actions.events]  # once


def test_a_completion_whose_trainer_stopped_on_sigterm_is_not_a_success_when_the_final_step_is_unknown():
    env = [{"name": "TPUJOB_STEPS", "valueFrom": {"secretKeyRef": {"name": "run", "key": "steps"}}}]
    tj = training_job(env=env, status={"phase": "Running", "attempt": 0})
    done = _jobset(state="Completed")
    stopped = _progress(step=70, state="preempted")
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(done,), latest_committed_step=70, progress=stopped))
    assert status.phase == "Restarting" and status.last_failure is not None
    assert (status.last_failure.reason, status.last_failure.counted) == ("CompletedShort", False)
    finished = _progress(step=90, state="succeeded")
    status, _ = reconcile(tj, Observed(now=T0, jobsets=(done,), latest_committed_step=90, progress=finished))
    assert status.phase == "Succeeded"


def test_an_abort_by_the_distributed_runtime_is_a_startup_failure_not_the_jobs():
    said = "F0101 coordination_service.cc:512] RegisterTask() failed: incarnation mismatch for /job:jax_worker/task:1"
    aborted = PodFacts("w0", 0, "Failed", exit_code=134, termination_message=said, finished_at=T0)
    tj = _running(restart={"maxRestarts": 5})
    failure = _decided(tj, aborted)[1]
    assert (failure.kind, failure.reason, failure.counted) == ("StartupFailure", "DistributedRuntimeAborted", False)
    crashed = PodFacts("w0", 0, "Failed", exit_code=134, termination_message="Assertion failed: x > 0", finished_at=T0)
    assert _decided(tj, crashed)[1].counted  # any other abort is the job's


def test_a_local_tier_that_does_not_save_is_said_in_status_once():
    tj = _running(checkpoint={"directory": "gs://acme-ckpt/runs", "local": {"sizeLimit": "2Gi"}})
    problem = "the local tier holds up to 3 copies of this host's 1024Mi state (3072Mi) but its volume has 2048Mi"
    record = _progress(step=60, local_tier_problem=problem)
    status, actions = reconcile(tj, Observed(now=T0, jobsets=(_jobset(pods=(_scheduled(),)),), progress=record))
    assert _condition(status, "LocalCheckpointTierSaving") == ("False", "LocalTierNotSaving", problem)
    assert [e.message for e in actions.events if e.reason == "LocalTierNotSaving"] == [problem]
    again = training_job(
        checkpoint={"directory": "gs://acme-ckpt/runs", "local": {"sizeLimit": "2Gi"}},
        status=status.model_dump(by_alias=True, exclude_none=True),
    )
    _, actions = reconcile(again, Observed(now=T0, jobsets=(_jobset(pods=(_scheduled(),)),), progress=record))
    assert "LocalTierNotSaving" not in [e.reason for e in actions.events]  # told once
    saving, _ = reconcile(again, Observed(now=T0, jobsets=(_jobset(pods=(_scheduled(),)),), progress=_progress(61)))
    assert _condition(saving, "LocalCheckpointTierSaving")[:2] == ("True", "Saving")
