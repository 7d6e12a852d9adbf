"""Faults at the API seam, on a real kube-apiserver + kube-controller-manager with the operator
in-process: status writes, refused objects, suspension, re-created jobs, and what the operator keeps.

No JobSet controller or kubelet runs in this tier: what they would report (a worker pod's exit, a
JobSet's conditions) is written through the API the way they write it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tpujob_contract import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, LABEL_UID
from tpujob_operator import api
from tpujob_operator.kube import Cluster as OperatorCluster
from tpujob_operator.kube import Conflict, load_config
from tpujob_operator.restarts import WORKER_POD_DELETED

from .conftest import eventually, training_job_manifest
from .test_operator import Cluster, _now


@pytest.fixture
def cluster(kube: client.ApiClient, namespace: str) -> Cluster:
    return Cluster(kube, namespace)


def _set_jobset_conditions(cluster: Cluster, name: str, conditions: list[dict[str, Any]]) -> None:
    """What the JobSet controller writes (there is none in this tier)."""
    cluster.custom.patch_namespaced_custom_object_status(
        JOBSET_GROUP, JOBSET_VERSION, cluster.namespace, JOBSET_PLURAL, name, {"status": {"conditions": conditions}}
    )


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def test_a_new_failure_leaves_nothing_of_the_previous_one_in_status(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.fail_slice(first, slice_index=1, exit_code=1)
    eventually(lambda: cluster.jobset(f"{unique_name}-a1"), what="JobSet a1")
    assert cluster.status(unique_name)["lastFailure"]["slice"] == 1
    # The second attempt fails with no pod left to blame (a deleted pod takes its reason with it): the
    # infrastructure's, not counted.
    condition = {
        "type": "Failed",
        "status": "True",
        "reason": "FailedJobs",
        "lastTransitionTime": _now(),
        "message": "x",
    }
    _set_jobset_conditions(cluster, f"{unique_name}-a1", [condition])
    status = eventually(
        lambda: (s := cluster.status(unique_name)).get("attempt") == 2 and s, what="second restart recorded"
    )
    failure = status["lastFailure"]
    assert failure["kind"] == "Preemption" and failure["reason"] == WORKER_POD_DELETED
    assert failure["counted"] is False and status["countedRestarts"] == 1
    assert "slice" not in failure and "lostSteps" not in failure and "recoverySeconds" not in failure


def test_a_status_write_from_a_stale_read_is_refused(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name))
    stale = eventually(lambda: (tj := cluster.training_job(unique_name)).get("status") and tj, what="status")
    cluster.patch_spec(unique_name, {"suspend": True})  # anyone's write moves the resourceVersion
    with pytest.raises(Conflict):
        OperatorCluster().replace_status(stale, {**stale["status"], "attempt": 7})
    assert cluster.status(unique_name)["attempt"] == 0


def test_a_jobset_refused_by_a_quota_is_reported_and_created_once_allowed(operator, cluster, unique_name):
    quota = client.V1ResourceQuota(
        metadata=client.V1ObjectMeta(name="no-jobsets"),
        spec=client.V1ResourceQuotaSpec(hard={f"count/{JOBSET_PLURAL}.{JOBSET_GROUP}": "0"}),
    )
    cluster.core.create_namespaced_resource_quota(cluster.namespace, quota)
    cluster.apply(training_job_manifest(unique_name))
    status = eventually(
        lambda: (s := cluster.status(unique_name)) and _condition(s, "Pending").get("reason") == "JobSetRefused" and s,
        what="Pending/JobSetRefused",
    )
    assert "quota" in _condition(status, "Pending")["message"]
    assert cluster.jobsets() == []
    assert "JobSetRefused" in eventually(lambda: cluster.events(unique_name), what="events")
    cluster.core.delete_namespaced_resource_quota("no-jobsets", cluster.namespace)
    eventually(lambda: cluster.jobset(f"{unique_name}-a0"), timeout=90, what="JobSet a0 once the quota is gone")
    assert cluster.status(unique_name)["attempt"] == 0


def test_a_worker_stopped_by_a_suspension_is_not_a_failure(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.patch_spec(unique_name, {"suspend": True})
    eventually(lambda: cluster.status(unique_name).get("phase") == "Suspended", what="phase Suspended")
    suspended = {
        "type": "Suspended",
        "status": "True",
        "reason": "SuspendJobs",
        "lastTransitionTime": _now(),
        "message": "x",
    }
    _set_jobset_conditions(cluster, first["metadata"]["name"], [suspended])
    # The suspension's SIGTERM: the worker saves and exits 143, as the trainer does.
    cluster.fail_pod(first, slice_index=0, exit_code=143)
    time.sleep(2)
    cluster.patch_spec(unique_name, {"suspend": False})
    eventually(lambda: cluster.jobset(f"{unique_name}-a0")["spec"]["suspend"] is False, what="JobSet resumed")
    time.sleep(1.1)  # the resume is later than the stopped pod's creation, at the API's 1 s resolution
    resumed = {
        "type": "Suspended",
        "status": "False",
        "reason": "ResumeJobs",
        "lastTransitionTime": _now(),
        "message": "x",
    }
    _set_jobset_conditions(cluster, first["metadata"]["name"], [resumed])
    time.sleep(2 * 5)  # several polls
    status = cluster.status(unique_name)
    assert (status["restarts"], status["attempt"]) == (0, 0) and "lastFailure" not in status
    assert status["stage"] in ("Scheduling", "StartingUp")


def test_a_jobset_suspended_by_someone_else_stays_suspended(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name))
    eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.custom.patch_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, cluster.namespace, JOBSET_PLURAL, f"{unique_name}-a0", {"spec": {"suspend": True}}
    )
    status = eventually(
        lambda: (s := cluster.status(unique_name)).get("phase") == "Suspended" and s, what="phase Suspended"
    )
    assert _condition(status, "Suspended")["reason"] == "SuspendedExternally"
    time.sleep(2 * 5)
    assert cluster.jobset(f"{unique_name}-a0")["spec"]["suspend"] is True  # the operator did not undo it


def test_a_job_recreated_with_the_same_name_never_adopts_its_predecessor(operator, cluster, unique_name):
    old = cluster.apply(training_job_manifest(unique_name))
    eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.custom.delete_namespaced_custom_object(
        api.GROUP, api.VERSION, cluster.namespace, api.PLURAL, unique_name,
        body=client.V1DeleteOptions(propagation_policy="Orphan"),
    )  # fmt: skip
    eventually(lambda: _gone(cluster, unique_name), what="old TrainingJob gone")
    orphan = cluster.jobset(f"{unique_name}-a0")
    assert orphan is not None and orphan["metadata"]["labels"][LABEL_UID] == old["metadata"]["uid"]
    new = cluster.apply(training_job_manifest(unique_name))
    adopted = eventually(
        lambda: (
            (js := cluster.jobset(f"{unique_name}-a0"))
            and js["metadata"]["labels"][LABEL_UID] == new["metadata"]["uid"]
            and js
        ),
        what="a JobSet of the new incarnation",
    )
    assert adopted["metadata"]["ownerReferences"][0]["uid"] == new["metadata"]["uid"]
    assert "OrphanRemoved" in eventually(lambda: cluster.events(unique_name), what="events")
    assert cluster.status(unique_name)["attempt"] == 0


def _gone(cluster: Cluster, name: str) -> bool:
    try:
        cluster.training_job(name)
    except ApiException as error:
        return error.status == 404
    return False


def test_nothing_is_remembered_of_a_job_once_it_is_deleted(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name, restart={"maxRestarts": 5, "backoffSeconds": 30}))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.fail_pod(first, slice_index=0, exit_code=1)
    key = (cluster.namespace, unique_name)
    eventually(lambda: operator.runtime.remembered(key) > 1, what="the failed pod remembered")
    cluster.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, cluster.namespace, api.PLURAL, unique_name)
    eventually(lambda: operator.runtime.remembered(key) == 0, what="memory of the job dropped")


def test_a_record_claiming_a_commit_the_listing_does_not_show_never_pins_it(operator, cluster, unique_name):
    import tpujob_contract as contract
    from google.cloud import storage
    from tpujob_operator import checkpoints

    from ..conftest import TEST_BUCKET
    from .test_operator import _write_checkpoint

    run = f"runs/{cluster.namespace}/{unique_name}"
    bucket = storage.Client(project="t", credentials=checkpoints.AnonymousCredentials()).bucket(TEST_BUCKET)
    _write_checkpoint(bucket, run, 100, committed=True)
    created = cluster.apply(training_job_manifest(unique_name))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    # This job's own record says step 300 committed; the bucket holds no such step (e.g. quarantined).
    record = contract.ProgressRecord(step=310, attempt=0, updated_at=contract.now_rfc3339(),
                                     uid=created["metadata"]["uid"], last_committed_step=300)  # fmt: skip
    bucket.blob(f"{run}/{contract.PROGRESS_FILE}").upload_from_string(contract.to_json(record))
    cluster.fail_slice(first, slice_index=0, exit_code=1)
    second = eventually(lambda: cluster.jobset(f"{unique_name}-a1"), what="JobSet a1")
    assert second["metadata"]["annotations"]["tpujob.dev/resume-step"] == "100"
    assert cluster.status(unique_name)["lastFailure"]["resumeStep"] == 100


def test_a_jobset_of_the_attempts_name_without_the_jobs_uid_is_never_adopted(operator, cluster, unique_name):
    from tpujob_operator.jobset import build_jobset

    manifest = training_job_manifest(unique_name)
    other = {**manifest, "metadata": {"name": unique_name, "namespace": cluster.namespace, "uid": "someone-else"}}
    stranger = build_jobset(api.TrainingJob.model_validate(other), attempt=0, resume_step=None)
    stranger["metadata"] = {"name": f"{unique_name}-a0"}  # no owner, no tpujob labels: not this job's
    cluster.custom.create_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, cluster.namespace, JOBSET_PLURAL, stranger
    )
    cluster.apply(manifest)
    status = eventually(
        lambda: (s := cluster.status(unique_name)) and _condition(s, "Pending").get("reason") == "JobSetRefused" and s,
        what="Pending/JobSetRefused",
    )
    assert "already exists and is not this TrainingJob's" in _condition(status, "Pending")["message"]
    assert "ownerReferences" not in cluster.jobset(f"{unique_name}-a0")["metadata"]  # left as it was


def test_a_node_where_another_tenants_pod_holds_tpu_chips_is_not_free_to_grow_into(kube, namespace, unique_name):
    """spec.elastic grows only into pools no TPU pod occupies: the operator asks the apiserver for the pods
    bound to those nodes, in every namespace (elastic.spare_pools)."""
    core = client.CoreV1Api(kube)

    def pod(name: str, node: str, limits: dict[str, str], phase: str | None = None) -> None:
        container = {"name": "c", "image": "busybox", "resources": {"limits": limits}}
        body = {"metadata": {"name": name}, "spec": {"nodeName": node, "containers": [container]}}
        core.create_namespaced_pod(namespace, body)
        if phase is not None:
            core.patch_namespaced_pod_status(name, namespace, {"status": {"phase": phase}})

    load_config()  # the operator's own client, as its runtime makes it
    pod(f"{unique_name}-batch", f"{unique_name}-tpu-a", {"google.com/tpu": "4"})  # another tenant's TPU job
    pod(f"{unique_name}-agent", f"{unique_name}-tpu-b", {"cpu": "100m"})  # a node agent: holds no chips
    pod(f"{unique_name}-done", f"{unique_name}-tpu-c", {"google.com/tpu": "4"}, phase="Succeeded")
    nodes = [f"{unique_name}-tpu-{suffix}" for suffix in "abcd"]
    assert OperatorCluster().nodes_holding_tpus(nodes) == {f"{unique_name}-tpu-a"}
