"""The restart ladder's InPlace rung, decided by the pure reconciler: JobSet restarts the workers in
place, and the operator records, charges and, when the rung is spent or stalls, climbs to Recreate."""

import dataclasses
import functools
from datetime import UTC, datetime, timedelta

from tpujob_operator.facts import JobSetFacts, NodeFacts, Observed, PodFacts
from tpujob_operator.jobset import IN_PLACE_RESTART_EXIT_CODE, jobset_facts, slice_job_name
from tpujob_operator.nodes import (
    NODE_GONE_DISRUPTION,
    awaited_nodes,
    recorded_pods_on_gone_nodes,
    slices_lost_whole,
)
from tpujob_operator.reconcile import reconcile
from tpujob_operator.status import rfc3339, rfc3339_precise

from .factories import progress_record, training_job

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
UID = "0000-1111"  # tests/unit/factories.py's TrainingJob
IN_PLACE = {"strategy": "InPlace", "inPlace": {"maxRestarts": 2, "recoveryDeadlineSeconds": 120}}


def _job(status=None, **restart):
    return training_job(restart={**IN_PLACE, **restart}, status={"phase": "Running", "attempt": 0, **(status or {})})


def _jobset(round_=1, pods=(), state="Active", attempt=0, pods_round=None):
    """`pods_round`: the round the pods show (default: the JobSet's, as when the pod watch has caught up)."""
    return JobSetFacts(
        f"llama-a{attempt}", attempt, None, T0, state, pods=pods, uid=UID, in_place=True, in_place_round=round_,
        pods_in_place_round=round_ if pods_round is None else pods_round,
    )  # fmt: skip


def _worker(name="llama-a0-slice-1-0", slice_=1, **facts):
    return PodFacts(name, slice_, "Running", scheduled_at=T0, **facts)


def _crashed(exit_code=1, at=T0, **facts):
    """A worker whose trainer exited and was restarted in place (lastState.terminated)."""
    return _worker(restart_count=1, last_exit_code=exit_code, last_reason="Error", last_finished_at=at, **facts)


def _observed(jobset, now=T0 + timedelta(seconds=2), progress=None, latest=100):
    return Observed(now=now, jobsets=(jobset,), progress=progress, latest_committed_step=latest)


def _restarted_record(step, restored, updated_at, **facts):
    """The record of the process restarted in place 1 s after the crash, which restored `restored` from its
    local tier and is at `step`."""
    return progress_record(
        uid=UID, attempt=0, step=step, updated_at=updated_at, process_started_at=T0 + timedelta(seconds=1),
        restored_step=restored, restored_from="local", **facts,
    )  # fmt: skip


def _restarting():
    """The job once the operator recorded the in-place restart after a crash at step 130 (GCS: 100)."""
    before = progress_record(uid=UID, attempt=0, step=130, updated_at=T0, process_started_at=T0 - timedelta(hours=1))
    status, _ = reconcile(_job({"step": 130}), _observed(_jobset(pods=(_crashed(),)), progress=before))
    return _job().model_copy(update={"status": status}), before


def test_a_round_the_pods_do_not_show_yet_waits_for_the_pod_watch():
    # JobSet's counters say round 1, the pods the watch delivered are still at round 0: what explains
    # the round (a crashed run, a replacement pod) has not arrived; deciding now would count it Unknown.
    observed = _observed(_jobset(pods=(_worker(),), pods_round=0))
    status, actions = reconcile(_job(), observed)
    assert status.last_failure is None and status.in_place_round == 0
    assert actions.requeue_after is not None and actions.requeue_after <= 2


def test_a_round_jobset_begins_is_recorded_once_as_a_failure_restarted_in_place():
    tj = _job({"step": 130})
    before = progress_record(uid=UID, attempt=0, step=130, updated_at=T0)
    observed = _observed(_jobset(pods=(_crashed(), _worker("llama-a0-slice-0-0", 0))), progress=before)
    status, actions = reconcile(tj, observed)
    assert (status.phase, status.attempt) == ("Restarting", 0)
    assert (status.restarts, status.counted_restarts, status.in_place_restarts, status.in_place_round) == (1, 1, 1, 1)
    failure = status.last_failure
    assert (failure.kind, failure.slice, failure.rung, failure.counted) == ("ApplicationError", 1, "InPlace", True)
    assert (failure.resume_step, failure.lost_steps) == (100, 30)
    assert actions.delete == [] and actions.create_attempt is None  # the same pods, on the same nodes
    assert [e.reason for e in actions.events] == ["FailureDetected", "RestartingInPlace"]
    # The next look at the same world (the operator restarted, or any event): nothing is charged twice.
    again, actions = reconcile(tj.model_copy(update={"status": status}), observed)
    assert (again.restarts, again.counted_restarts, again.in_place_restarts, again.lost_steps) == (1, 1, 1, 30)
    assert again.phase == "Restarting" and actions.events == []


def test_a_lost_node_is_the_infrastructures_restart_and_costs_no_budget():
    lost = PodFacts("llama-a0-slice-0-0", 0, "Failed", disruption_reason="DeletionByTaintManager", finished_at=T0)
    status, actions = reconcile(_job(), _observed(_jobset(pods=(lost, _worker()))))
    assert (status.restarts, status.counted_restarts, status.in_place_restarts) == (1, 0, 1)
    assert (status.last_failure.kind, status.last_failure.counted) == ("NodeLost", False)
    assert actions.delete == []


def test_a_pod_marked_failed_on_a_gone_node_is_removed_once_its_round_is_recorded():
    """The lost host's pod keeps JobSet's barrier down until it is gone (it will never reach the new
    round): once status records the round's NodeLost failure, the operator deletes it, rather than
    leaving it to the pod garbage collector's 40 s quarantine; never before, so that a restarted
    operator still finds the evidence."""
    marked = PodFacts("llama-a0-slice-0-0", 0, "Failed", disruption_reason=NODE_GONE_DISRUPTION,
                      disruption_since=T0, node="gone-host")  # fmt: skip
    nodes = {"host-1": NodeFacts("host-1", ready="True")}
    observed = dataclasses.replace(_observed(_jobset(pods=(marked, _worker(node="host-1")))), nodes=nodes)
    status, actions = reconcile(_job(), observed)
    assert (status.last_failure.kind, status.last_failure.counted) == ("NodeLost", False)
    assert actions.remove_from_gone_nodes == ["llama-a0-slice-0-0"] and actions.delete == []
    # Never before a failure at or after its own is recorded, never one on a node that exists or still running.
    assert recorded_pods_on_gone_nodes([marked], nodes, None) == []
    assert recorded_pods_on_gone_nodes([marked], nodes, T0 - timedelta(seconds=1)) == []
    assert recorded_pods_on_gone_nodes([dataclasses.replace(marked, node="host-1")], nodes, T0) == []
    assert recorded_pods_on_gone_nodes([dataclasses.replace(marked, phase="Running")], nodes, T0) == []
    assert recorded_pods_on_gone_nodes([marked], None, T0) == []  # no node watch: nothing is known gone


OWN_JOB = functools.partial(slice_job_name, "llama-a0")


def test_a_slice_whose_pods_all_went_with_their_nodes_has_its_job_recreated_and_only_that_job():
    """Once the lost pods are recorded and removed, their slice's Job is deleted (that uid only) for JobSet
    to recreate: the Job controller would create the replacement only after its back-off (10 s, doubled
    at each loss), which goes with the Job. A Job that still has a pod of its own is kept."""

    def pod(name, slice_, job_uid, **facts):
        return PodFacts(name, slice_, job=f"llama-a0-slice-{slice_}", job_uid=job_uid, **facts)

    lost = [pod(f"llama-a0-slice-0-{h}", 0, "uid-0", phase="Failed", disruption_reason=NODE_GONE_DISRUPTION,
                disruption_since=T0, node=f"gone-{h}") for h in (0, 1)]  # fmt: skip
    alive = [pod(f"llama-a0-slice-1-{h}", 1, "uid-1", phase="Running", node=f"host-{h}") for h in (0, 1)]
    nodes = {"host-0": NodeFacts("host-0", ready="True"), "host-1": NodeFacts("host-1", ready="True")}
    jobset = dataclasses.replace(_jobset(pods=(*lost, *alive)), slices=2, expected_pods=4)
    status, actions = reconcile(_job(), dataclasses.replace(_observed(jobset), nodes=nodes))
    assert status.last_failure.kind == "NodeLost"
    assert actions.remove_from_gone_nodes == ["llama-a0-slice-0-0", "llama-a0-slice-0-1"]
    assert actions.recreate_lost_slices == [("llama-a0-slice-0", "uid-0")]
    # One host of the two lost: the other still runs in that Job, which stays (its pod is replaced).
    half = dataclasses.replace(
        jobset, pods=(lost[0], dataclasses.replace(lost[1], phase="Running", node="host-1"), *alive)
    )
    _, actions = reconcile(_job(), dataclasses.replace(_observed(half), nodes=nodes))
    assert actions.remove_from_gone_nodes == ["llama-a0-slice-0-0"] and actions.recreate_lost_slices == []
    # The watch has not delivered the Job's other pod: kept. The Job's replacement pod exists: kept.
    assert slices_lost_whole([lost[0]], ["llama-a0-slice-0-0"], hosts=2, slice_job=OWN_JOB) == []
    replacement = pod("llama-a0-slice-0-0-new", 0, "uid-0", phase="Pending")
    assert slices_lost_whole([*lost, replacement], [p.name for p in lost], hosts=2, slice_job=OWN_JOB) == []
    # A Job recreated under the same name is another uid: the old one's pods never name it.
    recreated = [dataclasses.replace(p, name=f"{p.name}-b", job_uid="uid-0b", phase="Pending", node=None) for p in lost]
    assert slices_lost_whole([*lost, *recreated], [p.name for p in lost], hosts=2, slice_job=OWN_JOB) == [
        ("llama-a0-slice-0", "uid-0")
    ]
    # Only the JobSet's own slice Jobs: a pod whose labels name another Job (any pod author can write
    # labels) never gets that Job deleted.
    forged = [dataclasses.replace(p, job="payments-db-migrate", job_uid="uid-victim") for p in lost]
    assert slices_lost_whole(forged, [p.name for p in lost], hosts=2, slice_job=OWN_JOB) == []
    # Recreate rung: the whole JobSet goes anyway; JobSet must not bring a deleted Job back beside it.
    _, actions = reconcile(
        _job(), dataclasses.replace(_observed(dataclasses.replace(jobset, in_place=False)), nodes=nodes)
    )
    assert actions.recreate_lost_slices == []


def test_the_round_after_the_rung_is_spent_climbs_to_recreate():
    tj = _job({"restarts": 2, "countedRestarts": 2, "inPlaceRestarts": 2, "inPlaceRound": 2})
    status, actions = reconcile(tj, _observed(_jobset(round_=3, pods=(_crashed(at=T0),))))
    assert (status.attempt, status.restarts, status.in_place_restarts, status.in_place_round) == (1, 3, 2, 0)
    assert status.last_failure.rung == "Recreate"
    assert actions.delete == ["llama-a0"]
    assert [e.reason for e in actions.events] == ["FailureDetected", "Restarting"]


def test_an_exit_no_restart_can_fix_ends_the_job_and_releases_its_slices():
    incompatible = PodFacts("llama-a0-slice-0-0", 0, "Failed", exit_code=4, finished_at=T0)
    status, actions = reconcile(_job(), _observed(_jobset(round_=0, pods=(incompatible, _worker()))))
    assert (status.phase, status.last_failure.kind, status.last_failure.rung) == (
        "Failed",
        "CheckpointIncompatible",
        None,
    )
    assert actions.delete == ["llama-a0"]


def test_the_budget_counts_in_place_restarts_and_its_end_releases_the_slices():
    tj = _job({"restarts": 3, "countedRestarts": 3, "inPlaceRestarts": 1, "inPlaceRound": 1})
    status, actions = reconcile(tj, _observed(_jobset(round_=2, pods=(_crashed(),))))
    assert status.phase == "Failed" and _reason(status) == "RestartBudgetExhausted"
    assert actions.delete == ["llama-a0"]


def test_rounds_begun_while_the_operator_was_away_are_each_charged():
    status, _ = reconcile(_job(), _observed(_jobset(round_=2, pods=(_crashed(),))))
    assert (status.restarts, status.counted_restarts, status.in_place_restarts, status.in_place_round) == (2, 2, 2, 2)


def test_a_restart_that_trains_no_step_by_the_deadline_climbs_uncharged():
    tj, _ = _restarting()
    status, actions = reconcile(tj, _observed(_jobset(pods=(_crashed(),)), now=T0 + timedelta(seconds=100)))
    assert status.phase == "Restarting" and actions.delete == []
    status, actions = reconcile(tj, _observed(_jobset(pods=(_crashed(),)), now=T0 + timedelta(seconds=121)))
    assert (status.attempt, status.restarts, status.counted_restarts) == (1, 2, 1)
    assert (status.last_failure.reason, status.last_failure.counted) == ("InPlaceRestartStalled", False)
    assert actions.delete == ["llama-a0"]


def test_recovery_is_measured_from_the_restarted_process_only():
    tj, stale = _restarting()
    now = T0 + timedelta(seconds=9)
    # The record before the failure (same attempt, step past the resume point) is not the recovery.
    status, _ = reconcile(tj, _observed(_jobset(pods=(_crashed(),)), now=now, progress=stale))
    assert status.last_failure.recovery_seconds is None and status.phase == "Restarting"
    fresh = _restarted_record(121, 120, T0 + timedelta(seconds=8), restore_finished_at=T0 + timedelta(seconds=5))
    status, _ = reconcile(tj, _observed(_jobset(pods=(_crashed(),)), now=now, progress=fresh))
    failure = status.last_failure
    assert failure.recovery_seconds == 8.0
    assert failure.timeline.restored == rfc3339_precise(T0 + timedelta(seconds=5))
    # The local tier held step 120, newer than GCS's 100: the failure lost 10 steps, not 30.
    assert (failure.resume_step, failure.lost_steps, status.lost_steps) == (120, 10, 10)


def test_a_round_decided_after_the_restarted_process_trained_on_records_the_failed_processs_numbers():
    # The decision waits up to a kubelet lease (verdict_wait); meanwhile the restarted process restored
    # step 125 from its local tier, trained to 385 and committed step 300 to GCS.
    tj = _job({"step": 130})
    crashed = _jobset(pods=(_crashed(), _worker("llama-a0-slice-0-0", 0)))
    recovered = _restarted_record(385, 125, T0 + timedelta(seconds=9))
    status, _ = reconcile(tj, _observed(crashed, now=T0 + timedelta(seconds=10), progress=recovered, latest=300))
    failure = status.last_failure
    # The failed process had reported 130 and the restart resumed from 125: 5 steps lost, not the
    # recovery's 385 against the 300 its own save committed.
    assert (failure.rung, failure.step, failure.resume_step, failure.lost_steps) == ("InPlace", 130, 125, 5)
    assert status.lost_steps == 5 and status.step == 385  # the record is folded once the round is recorded
    again, _ = reconcile(tj.model_copy(update={"status": status}), _observed(crashed, progress=recovered, latest=300))
    assert (again.last_failure.resume_step, again.last_failure.lost_steps, again.lost_steps) == (125, 5, 5)


def test_the_decoder_reads_jobsets_rounds_and_leaves_out_the_agents_own_exits():
    pod = {
        "metadata": {"name": "w", "annotations": {"jobset.sigs.k8s.io/in-place-restart-attempt": "2"}},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "restartCount": 2,
                    "lastState": {"terminated": {"exitCode": IN_PLACE_RESTART_EXIT_CODE, "reason": "Error"}},
                }
            ],
        },
    }
    jobset = {
        "metadata": {"name": "llama-a0", "labels": {"tpujob.dev/attempt": "0"}},
        "spec": {"failurePolicy": {"restartStrategy": "InPlaceRestart"}},
        "status": {"currentInPlaceRestartAttempt": 1, "previousInPlaceRestartAttempt": 1},
    }
    facts = jobset_facts(jobset, [pod])
    assert (facts.in_place, facts.in_place_round) == (True, 2)
    assert (facts.pods[0].restart_count, facts.pods[0].last_exit_code) == (2, None)
    assert jobset_facts({**jobset, "spec": {}}, [pod]).in_place is False
    # A failed pod begins the next round before any agent says so (JobSet replaces only that pod).
    failed = {"metadata": {"name": "v", "annotations": {}}, "status": {"phase": "Failed"}}
    assert jobset_facts(jobset, [failed]).in_place_round == 2


def _reason(status):
    return next(c.reason for c in status.conditions if c.type == status.phase)


def test_an_unrecorded_round_waits_for_word_from_the_kubelets_under_its_pods():
    """A dead host's pod stays Running while its peers crash on collective errors and restart in place:
    the round is recorded once every kubelet under its pods was heard from after the failure."""
    pods = (_crashed(node="n1"), _worker("llama-a0-slice-0-0", 0, node="n0"))
    assert awaited_nodes(pods, round_unrecorded=True) == {"n0", "n1"}
    assert awaited_nodes(pods) == set()  # nothing failed and no round pending: no Lease is read
    silent = {
        "n0": NodeFacts("n0", ready="True"),
        "n1": NodeFacts("n1", ready="True", renewed=T0 + timedelta(seconds=1)),
    }
    observed = dataclasses.replace(_observed(_jobset(pods=pods)), nodes=silent)
    status, actions = reconcile(_job(), observed)
    assert status.restarts == 0 and actions.requeue_after is not None  # n0 has not renewed since the failure
    heard = {**silent, "n0": NodeFacts("n0", ready="True", renewed=T0 + timedelta(seconds=2))}
    status, _ = reconcile(_job(), dataclasses.replace(observed, nodes=heard))
    assert (status.restarts, status.last_failure.kind) == (1, "ApplicationError")


def test_the_recovery_deadline_does_not_run_while_storage_cannot_be_read():
    tj, _ = _restarting()
    late = T0 + timedelta(seconds=500)  # past the 120 s deadline
    blind = dataclasses.replace(_observed(_jobset(pods=(_crashed(),)), now=late), storage_error="503")
    status, actions = reconcile(tj, blind)
    assert (status.attempt, status.restarts) == (0, 1) and actions.delete == []
    assert status.phase == "Restarting" and _reason(status) == "StorageUnreachable"
    # Storage back at 490 s: the deadline counts from then, not from the failure.
    back = tj.model_copy(
        update={"status": status.model_copy(update={"storage_recovery_time": rfc3339(late - timedelta(seconds=10))})}
    )
    status, actions = reconcile(back, _observed(_jobset(pods=(_crashed(),)), now=late))
    assert status.attempt == 0 and actions.delete == []


def test_a_round_no_pod_explains_beside_a_replacement_pod_is_a_deleted_pods_and_free():
    # An eviction deleted a worker pod (and its DisruptionTarget) before the operator read it; its Job
    # replaced it: a fresh container whose agent joined round 1. Nothing else failed.
    replacement = _worker("llama-a0-slice-0-1", 0, in_place_attempt=1)
    restarted = _worker(restart_count=1, in_place_attempt=1)  # the agent ended it (exit 86: no lastState)
    status, _ = reconcile(_job({"step": 130}), _observed(_jobset(pods=(replacement, restarted))))
    failure = status.last_failure
    assert (failure.kind, failure.reason, failure.counted) == ("Preemption", "WorkerPodDeleted", False)


def _assert_a_crash_a_minute_later_is_counted(first, lost):
    """Round 2, after `first` recorded round 1: slice 1's trainer crashes beside `lost`, a pod that failed
    in round 1 and stays in the API, and slice 0's replacement. The crash is the job's, counted."""
    later = T0 + timedelta(seconds=60)
    crashed = dataclasses.replace(_crashed(at=later, in_place_attempt=2), restart_count=2)
    replacement = _worker("llama-a0-slice-0-1", 0, in_place_attempt=2, restart_count=1)
    observed = _observed(_jobset(round_=2, pods=(lost, crashed, replacement)), now=later + timedelta(seconds=2))
    second, _ = reconcile(_job().model_copy(update={"status": first}), observed)
    failure = second.last_failure
    assert (failure.kind, failure.reason, failure.counted, failure.slice) == ("ApplicationError", "ExitCode1", True, 1)


def test_a_pod_that_failed_in_an_earlier_round_says_nothing_of_the_next_one():
    # Round 1: a node was lost under slice 0 (its pod stays Failed in the API, replaced by its Job).
    lost = PodFacts("llama-a0-slice-0-0", 0, "Failed", disruption_reason="DeletionByTaintManager", finished_at=T0)
    first, _ = reconcile(_job({"step": 130}), _observed(_jobset(pods=(lost, _worker()))))
    assert (first.last_failure.kind, first.in_place_round) == ("NodeLost", 1)
    # Round 2, a minute later: the trainer of slice 1 crashes. Its failure is the job's, counted.
    _assert_a_crash_a_minute_later_is_counted(first, lost)


def test_a_lost_nodes_pod_marked_failed_after_its_rounds_failure_says_nothing_of_the_next_round():
    # Round 1: slice 1's trainer crashes at T0 and, in the same round, slice 0's node goes away; its pod
    # is marked Failed two seconds later (after the failure the round is recorded with) and stays in the API.
    lost = PodFacts(
        "llama-a0-slice-0-0", 0, "Failed", disruption_reason="DeletionByTaintManager",
        finished_at=T0 + timedelta(seconds=2), in_place_attempt=0,
    )  # fmt: skip
    observed = _observed(_jobset(pods=(lost, _crashed(in_place_attempt=1))), now=T0 + timedelta(seconds=4))
    first, _ = reconcile(_job({"step": 130}), observed)
    assert first.in_place_round == 1
    # Round 2, a minute later: slice 1's trainer crashes again. The lost node's pod joined no round
    # since round 0: it is not this round's cause, and this crash is the job's, counted.
    _assert_a_crash_a_minute_later_is_counted(first, lost)


def test_an_in_place_jobset_that_failed_before_the_pods_show_why_waits_a_bounded_while_for_the_pod_watch():
    # The rung is spent: JobSet failed the attempt on a crash whose pod the watch has not delivered yet.
    # A replacement pod is all it shows: deciding now would make the crash a deleted pod, not counted.
    replacement = _worker("llama-a0-slice-0-1", 0, in_place_attempt=1)
    failed = dataclasses.replace(_jobset(pods=(replacement, _worker()), state="Failed"), ended_at=T0)
    status, actions = reconcile(_job(), _observed(failed, now=T0 + timedelta(seconds=1)))
    assert status.last_failure is None and actions.create_attempt is None
    assert actions.requeue_after is not None and actions.requeue_after <= 2
    # The crash's news arrives: the job's failure, counted.
    shown = dataclasses.replace(failed, pods=(replacement, _crashed(at=T0)))
    status, _ = reconcile(_job(), _observed(shown, now=T0 + timedelta(seconds=3)))
    failure = status.last_failure
    assert (failure.kind, failure.reason, failure.counted, failure.slice) == ("ApplicationError", "ExitCode1", True, 1)
    # No news for the whole wait: decided as the pods show it.
    status, _ = reconcile(_job(), _observed(failed, now=T0 + timedelta(seconds=31)))
    assert status.last_failure is not None and status.last_failure.reason == "WorkerPodDeleted"


def test_a_round_the_fresh_agents_of_a_jobset_kueue_resumed_begin_is_no_failure():
    # Kueue preempted the JobSet (suspended it) and admitted it again: its new pods' agents join round 1
    # as a replaced worker's would. Nothing failed; the next real failure counts from round 1.
    resumed = T0 + timedelta(seconds=30)
    fresh = tuple(
        _worker(f"llama-a0-slice-{i}-0", i, in_place_attempt=1, created=resumed + timedelta(seconds=1)) for i in (0, 1)
    )
    jobset = dataclasses.replace(_jobset(pods=fresh), resumed_at=resumed, queue_name="team-a")
    status, actions = reconcile(_job(), _observed(jobset, now=resumed + timedelta(seconds=3)))
    assert status.last_failure is None and (status.restarts, status.in_place_round) == (0, 1)
    assert actions.events == []
    # A crash after that is round 2: the job's, counted.
    crashed = dataclasses.replace(_crashed(at=resumed + timedelta(seconds=60), in_place_attempt=2), created=resumed)
    later = dataclasses.replace(_jobset(round_=2, pods=(fresh[0], crashed)), resumed_at=resumed, queue_name="team-a")
    status, _ = reconcile(
        _job().model_copy(update={"status": status}), _observed(later, now=resumed + timedelta(seconds=62))
    )
    failure = status.last_failure
    assert (failure.kind, failure.counted, status.in_place_round, status.restarts) == ("ApplicationError", True, 2, 1)


def test_a_round_begun_by_an_earlier_resume_is_no_failure_while_the_pod_watch_shows_that_resumes_pods():
    # Preempted and admitted twice: the watch still shows the first resume's pods (fresh, at round 1),
    # created before the last resume; none of the last resume's pods has arrived yet.
    first, last = T0 + timedelta(seconds=30), T0 + timedelta(seconds=60)
    shown = tuple(_worker(f"llama-a0-slice-{i}-0", i, in_place_attempt=1, created=first) for i in (0, 1))
    jobset = dataclasses.replace(_jobset(pods=shown), resumed_at=last, queue_name="team-a")
    status, _ = reconcile(_job(), _observed(jobset, now=last + timedelta(seconds=1)))
    assert status.last_failure is None and (status.restarts, status.in_place_round) == (0, 1)


def test_resuming_a_suspended_in_place_job_starts_a_fresh_attempt_and_counts_its_own_rounds():
    # New pods of the same JobSet would have fresh agents join round current + 1, as if a worker failed.
    status = {"phase": "Suspended", "attempt": 0, "inPlaceRound": 1}
    suspended = dataclasses.replace(_jobset(round_=1, state="Suspended"), suspended_by_operator=True, resume_step=100)
    after, actions = reconcile(_job(status), _observed(suspended, latest=100))
    assert actions.set_suspend is None and actions.stop == ["llama-a0"]
    assert (after.attempt, after.in_place_round, after.restarts) == (1, 0, 0)


def test_a_round_a_suspension_leaves_unrecorded_holds_no_record_back():
    # A worker crashed and was restarted in place (round 1); Kueue suspended the JobSet before the round
    # was decided. A suspension records no round, so holding the trainer's record would only freeze
    # status.step for as long as the job stays suspended: the workers' suspension save reaches status.
    suspended = dataclasses.replace(_jobset(state="Suspended"), queue_name="team-a")
    saved = progress_record(
        uid=UID, attempt=0, step=160, state="preempted", last_committed_step=160,
        updated_at=T0 + timedelta(seconds=5), process_started_at=T0 + timedelta(seconds=1),
    )  # fmt: skip
    status, _ = reconcile(_job({"step": 130}), _observed(suspended, progress=saved, latest=160))
    assert (status.step, status.in_place_round, status.restarts, status.last_failure) == (160, 0, 0, None)
