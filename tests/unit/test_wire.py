"""The decoding side of the JobSet wire format (jobset.py): what the API returns -> facts.

Checked against what build_jobset wrote plus what the apiserver, the JobSet and Job controllers, the
kubelet and Kueue add, and against hand-written objects in the API's camelCase with literal keys, so
that renaming a label or annotation on both sides (and so orphaning the JobSets already in a cluster)
fails here.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from tpujob_operator.facts import PodFacts
from tpujob_operator.jobset import (
    build_jobset,
    expected_pods,
    incarnation_uid,
    jobset_facts,
    jobset_state,
    pod_facts,
    workload_admission,
)

from .factories import training_job

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
TJ_UID = "0000-1111"  # factories.training_job's metadata.uid
JOBSET_UID = "5e7a0c1d-jobset"


def _at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(type_: str, status: str, seconds: float, reason: str = "", message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": _at(seconds)}


def _stored(manifest: dict[str, Any], *conditions: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """The manifest as a GET returns it: what the apiserver and the JobSet controller add."""
    jobset = copy.deepcopy(manifest)
    jobset["metadata"].update(uid=JOBSET_UID, creationTimestamp=_at(0), resourceVersion="4711", generation=1)
    jobset["spec"].update(spec)
    jobset["status"] = {"restarts": 0, "conditions": list(conditions)}
    return jobset


# -- round trip: build_jobset -> apiserver -> jobset_facts


@pytest.mark.parametrize(
    ("attempt", "resume_step", "queue", "suspend", "decoded"),
    [
        # (attempt, resume_step, queue_name, state, suspended_by_operator)
        pytest.param(3, 400, None, False, (3, 400, None, "Active", False), id="pinned-step"),
        pytest.param(0, None, None, False, (0, None, None, "Active", False), id="latest-step"),
        pytest.param(5, 0, None, False, (5, 0, None, "Active", False), id="step-zero-is-pinned"),
        # Queued: created suspended for Kueue, and resuming from the latest step whatever was asked.
        pytest.param(2, 300, "tpu", False, (2, None, "tpu", "Suspended", False), id="queued"),
        pytest.param(1, 200, None, True, (1, 200, None, "Suspended", True), id="suspended-by-spec"),
    ],
)
def test_what_build_jobset_wrote_is_read_back(attempt, resume_step, queue, suspend, decoded):  # type: ignore[no-untyped-def]
    tj = training_job(suspend=suspend)
    facts = jobset_facts(_stored(build_jobset(tj, attempt, resume_step, queue)), [])
    assert (facts.attempt, facts.resume_step, facts.queue_name, facts.state, facts.suspended_by_operator) == decoded
    assert facts.name == f"llama-a{attempt}"
    assert facts.uid == TJ_UID  # the TrainingJob's, not the JobSet's own metadata.uid
    assert facts.created == T0
    assert (facts.resumed_at, facts.resuming, facts.deleting, facts.pods) == (None, False, False, ())
    assert (facts.condition_reason, facts.condition_message) == ("", "")
    assert (facts.pod_creation_refused, facts.admitted_at, facts.queue_reason) == (None, None, None)


@pytest.mark.parametrize(
    ("tpu", "pods"),
    [  # hosts per slice as GKE documents them: v5e 2x2 one host; v5p 2x2x2 and v6e 4x4, 4 chips a host
        ({"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 1}, 1),
        ({"accelerator": "tpu-v5p-slice", "topology": "2x2x2", "slices": 2}, 4),
        ({"accelerator": "tpu-v6e-slice", "topology": "4x4", "slices": 4}, 16),
    ],
)
def test_expected_pods_are_slices_times_hosts(tpu, pods):  # type: ignore[no-untyped-def]
    manifest = build_jobset(training_job(**tpu), attempt=0, resume_step=None)
    assert expected_pods(manifest) == pods
    assert jobset_facts(_stored(manifest), []).expected_pods == pods


@pytest.mark.parametrize(
    ("conditions", "spec", "state", "reason", "resumed_at", "resuming"),
    [
        pytest.param(
            [_condition("Completed", "True", 90, "AllJobsCompleted", "jobset completed successfully")],
            {},
            "Completed",
            "AllJobsCompleted",
            None,
            False,
            id="completed",
        ),
        pytest.param(
            [_condition("Failed", "True", 90, "FailedJobs", "jobset failed due to one or more job failures")],
            {},
            "Failed",
            "FailedJobs",
            None,
            False,
            id="failed",
        ),
        # A terminal condition outranks spec.suspend.
        pytest.param(
            [_condition("Failed", "True", 90, "FailedJobs", "jobset failed due to one or more job failures")],
            {"suspend": True},
            "Failed",
            "FailedJobs",
            None,
            False,
            id="failed-while-suspended",
        ),
        pytest.param(
            [_condition("Completed", "False", 90, "AllJobsCompleted")], {}, "Active", "", None, False, id="not-done"
        ),
        pytest.param(
            [_condition("Suspended", "True", 10, "SuspendJobs", "jobset is suspended")],
            {"suspend": True},
            "Suspended",
            "",
            None,
            False,
            id="suspended",
        ),
        # spec.suspend was lifted; the JobSet controller has not resumed the Jobs yet.
        pytest.param(
            [_condition("Suspended", "True", 10, "SuspendJobs", "jobset is suspended")],
            {"suspend": False},
            "Active",
            "",
            None,
            True,
            id="resuming",
        ),
        pytest.param(
            [_condition("Suspended", "False", 31, "ResumeJobs", "jobset is resumed")],
            {"suspend": False},
            "Active",
            "",
            T0 + timedelta(seconds=31),
            False,
            id="resumed",
        ),
    ],
)
def test_the_jobset_controllers_conditions(conditions, spec, state, reason, resumed_at, resuming):  # type: ignore[no-untyped-def]
    jobset = _stored(build_jobset(training_job(), 1, 100), *conditions, **spec)
    facts = jobset_facts(jobset, [])
    assert (facts.state, facts.condition_reason, facts.resumed_at, facts.resuming) == (
        state,
        reason,
        resumed_at,
        resuming,
    )
    assert facts.condition_message == next((c["message"] for c in conditions if c["reason"] == reason), "")
    assert jobset_state(jobset)[0] == state


def test_a_jobset_as_found_in_a_cluster_with_literal_keys():
    """The keys themselves are the wire format: JobSets written by an older operator carry them."""
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": "bert-a7",
            "namespace": "ml",
            "uid": JOBSET_UID,
            "creationTimestamp": _at(0),
            "deletionTimestamp": _at(60),
            "labels": {
                "tpujob.dev/name": "bert",
                "tpujob.dev/attempt": "7",
                "tpujob.dev/uid": "bert-uid",
                "kueue.x-k8s.io/queue-name": "team-a",
            },
            "annotations": {"tpujob.dev/resume-step": "1200", "tpujob.dev/suspended": "true"},
        },
        "spec": {
            "suspend": True,
            "replicatedJobs": [{"name": "slice", "replicas": 3, "template": {"spec": {"parallelism": 2}}}],
        },
    }
    facts = jobset_facts(jobset, [], "exceeded quota: tpu", (T0, "Preempted"))
    assert (facts.name, facts.attempt, facts.resume_step, facts.uid) == ("bert-a7", 7, 1200, "bert-uid")
    assert (facts.state, facts.suspended_by_operator, facts.queue_name, facts.deleting) == (
        "Suspended",
        True,
        "team-a",
        True,
    )
    assert (facts.expected_pods, facts.created) == (6, T0)
    assert (facts.pod_creation_refused, facts.admitted_at, facts.queue_reason) == (
        "exceeded quota: tpu",
        T0,
        "Preempted",
    )


def test_a_jobset_without_the_operators_labels_and_annotations():
    jobset = {"metadata": {"name": "x", "creationTimestamp": _at(0)}, "spec": {}}
    facts = jobset_facts(jobset, [])
    assert (facts.attempt, facts.resume_step, facts.uid, facts.queue_name) == (0, None, None, None)
    assert (facts.state, facts.suspended_by_operator, facts.expected_pods) == ("Active", False, 0)


# -- pods, as the kubelet and the scheduler report them


def _pod(
    *,
    index: tuple[str, str] | None = ("annotations", "1"),
    phase: str | None = "Running",
    containers: list[dict[str, Any]] | None = None,
    conditions: list[dict[str, Any]] | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": "llama-a0-slice-1-0-x7k2p",
        "namespace": "ml",
        "creationTimestamp": _at(0),
        "labels": {
            "tpujob.dev/name": "llama",
            "jobset.sigs.k8s.io/jobset-name": "llama-a0",
            "batch.kubernetes.io/job-name": "llama-a0-slice-1",  # the Job controller's labels
            "batch.kubernetes.io/controller-uid": "8f1c2d3e-job",
        },
        "annotations": {},
    }
    if index is not None:
        meta[index[0]]["jobset.sigs.k8s.io/job-index"] = index[1]
    status: dict[str, Any] = {"conditions": conditions or [], "containerStatuses": containers or []}
    if phase is not None:
        status["phase"] = phase
    if reason is not None:
        status["reason"] = reason
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


def _container(name: str = "trainer", **state: Any) -> dict[str, Any]:
    return {"name": name, "image": "trainer:1", "ready": False, "restartCount": 0, "state": state}


KILLED = _container(terminated={"exitCode": 137, "reason": "OOMKilled", "startedAt": _at(5), "finishedAt": _at(50)})


@pytest.mark.parametrize(
    ("index", "slice_"),
    [
        (("annotations", "1"), 1),
        (("labels", "3"), 3),
        (("annotations", "12"), 12),
        (("labels", "not-a-number"), None),
        (None, None),
    ],
)
def test_the_slice_comes_from_the_job_index_annotation_or_label(index, slice_):  # type: ignore[no-untyped-def]
    assert pod_facts(_pod(index=index)).slice == slice_


def test_a_killed_trainer():
    pod = _pod(phase="Failed", containers=[KILLED])
    assert pod_facts(pod) == PodFacts(
        name="llama-a0-slice-1-0-x7k2p",
        slice=1,
        phase="Failed",
        exit_code=137,
        reason="OOMKilled",
        finished_at=T0 + timedelta(seconds=50),
        created=T0,
        job="llama-a0-slice-1",
        job_uid="8f1c2d3e-job",
    )


def test_the_container_reason_comes_before_the_pods():
    assert pod_facts(_pod(phase="Failed", containers=[KILLED], reason="Evicted")).reason == "OOMKilled"
    running = _container(running={"startedAt": _at(5)})
    assert pod_facts(_pod(phase="Failed", containers=[running], reason="Evicted")).reason == "Evicted"


def test_only_the_trainer_container_counts():
    sidecar = _container("log-shipper", terminated={"exitCode": 1, "reason": "Error", "finishedAt": _at(20)})
    waiting = _container("istio-proxy", waiting={"reason": "ImagePullBackOff", "message": "pull failed"})
    trainer = _container(running={"startedAt": _at(5)})
    facts = pod_facts(_pod(containers=[sidecar, waiting, trainer]))
    assert (facts.exit_code, facts.reason, facts.finished_at) == (None, None, None)
    assert (facts.waiting_reason, facts.waiting_message) == (None, None)
    facts = pod_facts(_pod(phase="Failed", containers=[sidecar, KILLED]))
    assert (facts.exit_code, facts.reason) == (137, "OOMKilled")


@pytest.mark.parametrize(
    ("condition", "disruption"),
    [
        (_condition("DisruptionTarget", "True", 40, "TerminationByKubelet", "node shutdown"), "TerminationByKubelet"),
        (_condition("DisruptionTarget", "True", 40, "PreemptionByScheduler", "preempted"), "PreemptionByScheduler"),
        (_condition("DisruptionTarget", "False", 40, "DeletionByTaintManager"), None),
    ],
)
def test_a_disruption_target_condition(condition, disruption):  # type: ignore[no-untyped-def]
    facts = pod_facts(_pod(phase="Failed", containers=[KILLED], conditions=[condition]))
    assert facts.disruption_reason == disruption
    assert (facts.exit_code, facts.reason) == (137, "OOMKilled")


def test_an_unschedulable_pod():
    message = "0/4 nodes are available: 4 Insufficient google.com/tpu. preemption: 0/4 nodes are available."
    pending = _pod(
        phase="Pending",
        index=("labels", "0"),
        conditions=[_condition("PodScheduled", "False", 1, "Unschedulable", message)],
    )
    facts = pod_facts(pending)
    assert (facts.phase, facts.slice, facts.unschedulable_message, facts.scheduled_at) == ("Pending", 0, message, None)


def test_a_scheduled_pod_is_placed_at_its_transition_else_at_creation():
    scheduled = _condition("PodScheduled", "True", 12)
    facts = pod_facts(_pod(conditions=[_condition("Initialized", "True", 13), scheduled]))
    assert (facts.scheduled_at, facts.unschedulable_message) == (T0 + timedelta(seconds=12), None)
    del scheduled["lastTransitionTime"]
    assert pod_facts(_pod(conditions=[scheduled])).scheduled_at == T0


def test_a_trainer_waiting_for_its_image():
    message = 'Back-off pulling image "us-docker.pkg.dev/acme/tpujob-trainer:0.1.0"'
    waiting = _container(waiting={"reason": "ImagePullBackOff", "message": message})
    facts = pod_facts(_pod(phase="Pending", containers=[waiting], conditions=[_condition("PodScheduled", "True", 2)]))
    assert (facts.waiting_reason, facts.waiting_message, facts.exit_code) == ("ImagePullBackOff", message, None)


def test_a_pod_without_status_is_pending():
    pod = _pod(phase=None)
    del pod["status"]
    assert pod_facts(pod) == PodFacts(
        name="llama-a0-slice-1-0-x7k2p",
        slice=1,
        phase="Pending",
        created=T0,
        job="llama-a0-slice-1",
        job_uid="8f1c2d3e-job",
    )


def test_jobset_facts_decodes_the_pods_given_in_order():
    pods = [_pod(phase="Failed", containers=[KILLED]), _pod(index=("labels", "0"))]
    facts = jobset_facts(_stored(build_jobset(training_job(), 0, None)), pods)
    assert facts.pods == (pod_facts(pods[0]), pod_facts(pods[1]))
    assert [(p.slice, p.exit_code) for p in facts.pods] == [(1, 137), (0, None)]


# -- which TrainingJob incarnation an object belongs to

OWNED_BY_JOB = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "name": "llama-a0-slice-0",
    "uid": "job-uid",
    "controller": True,
}
OWNED_BY_TJ = {
    "apiVersion": "tpujob.dev/v1alpha1",
    "kind": "TrainingJob",
    "name": "llama",
    "uid": "owner-uid",
    "controller": True,
    "blockOwnerDeletion": True,
}


@pytest.mark.parametrize(
    ("labels", "owners", "uid"),
    [
        pytest.param({"tpujob.dev/uid": "label-uid"}, [OWNED_BY_TJ], "label-uid", id="label-wins"),
        pytest.param({"tpujob.dev/uid": "label-uid"}, None, "label-uid", id="label-only"),
        pytest.param({"tpujob.dev/name": "llama"}, [OWNED_BY_JOB, OWNED_BY_TJ], "owner-uid", id="owner-reference"),
        pytest.param(None, [OWNED_BY_JOB], None, id="owned-by-a-job"),
        pytest.param(None, None, None, id="neither"),
    ],
)
def test_incarnation_uid(labels, owners, uid):  # type: ignore[no-untyped-def]
    meta: dict[str, Any] = {"name": "llama-a0"}
    if labels is not None:
        meta["labels"] = labels
    if owners is not None:
        meta["ownerReferences"] = owners
    assert incarnation_uid({"metadata": meta}) == uid


def test_a_jobset_from_before_the_uid_label_belongs_to_its_owner():
    manifest = _stored(build_jobset(training_job(), 0, None))
    del manifest["metadata"]["labels"]["tpujob.dev/uid"]
    assert incarnation_uid(manifest) == TJ_UID
    assert jobset_facts(manifest, []).uid == TJ_UID


# -- Kueue Workloads (test_kueue.py covers admitted, a newest False QuotaReserved, and no status)


@pytest.mark.parametrize(
    ("conditions", "reason"),
    [
        pytest.param(
            [_condition("QuotaReserved", "True", 10, "QuotaReserved", "Quota reserved in ClusterQueue tpu")],
            None,
            id="reserved-not-yet-admitted",
        ),
        pytest.param(
            [
                _condition("QuotaReserved", "True", 10, "QuotaReserved", "Quota reserved in ClusterQueue tpu"),
                _condition("Admitted", "False", 11, "NoChecks", "The workload has not all checks ready"),
            ],
            "The workload has not all checks ready",
            id="admission-checks-pending",
        ),
        pytest.param(
            [
                _condition("QuotaReserved", "False", 10, "Pending", "insufficient quota"),
                _condition("Evicted", "True", 20, "Preempted", "Preempted to accommodate a higher priority Workload"),
            ],
            "Preempted to accommodate a higher priority Workload",
            id="newest-evicted",
        ),
        pytest.param(
            [_condition("Preempted", "True", 20, "InClusterQueue")], "InClusterQueue", id="reason-if-no-message"
        ),
        pytest.param([_condition("Evicted", "False", 20, "Preempted", "old news")], None, id="evicted-false-ignored"),
    ],
)
def test_a_workload_not_admitted(conditions, reason):  # type: ignore[no-untyped-def]
    assert workload_admission({"status": {"conditions": conditions}}) == (None, reason)
