"""The operator, in-process, against a real kube-apiserver + kube-controller-manager + fake-gcs-server.

No kubelet and no JobSet controller run in this tier, so a slice failure is written through the API
the way those components would report it: a worker pod's status (exit code, slice annotation) and
the JobSet's Failed condition.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest
from google.cloud import storage
from kubernetes import client
from tpujob_contract import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION
from tpujob_operator import api, checkpoints
from tpujob_operator.jobset import build_jobset

from ..conftest import TEST_BUCKET
from .conftest import eventually, training_job_manifest


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Cluster:
    def __init__(self, kube: client.ApiClient, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(kube)
        self.core = client.CoreV1Api(kube)
        self.namespace = namespace

    def apply(self, manifest: dict[str, Any]) -> Any:
        return self.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, api.PLURAL, manifest)

    def training_job(self, name: str) -> Any:
        return self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, api.PLURAL, name)

    def status(self, name: str) -> Any:
        return self.training_job(name).get("status") or {}

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, name, {"spec": spec}
        )

    def jobsets(self) -> list[Any]:
        found: Any = self.custom.list_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL
        )
        return [js for js in found["items"] if not js["metadata"].get("deletionTimestamp")]

    def all_jobsets(self) -> list[str]:
        """Every JobSet the apiserver holds in the namespace, being deleted or not."""
        found: Any = self.custom.list_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL
        )
        return [js["metadata"]["name"] for js in found["items"]]

    def jobset(self, name: str) -> Any:
        return next((js for js in self.jobsets() if js["metadata"]["name"] == name), None)

    def fail_slice(self, jobset: Any, slice_index: int, exit_code: int) -> None:
        """What kubelet + the Job and JobSet controllers would report when a worker of one slice dies.

        An InPlace job's operator may act on the failed pod alone and delete the JobSet before its
        controller reports: then there is no JobSet left to report on, as with the real controller.
        """
        self.fail_pod(jobset, slice_index, exit_code)
        meta = jobset["metadata"]
        try:
            self._report_failed(meta["name"], slice_index)
        except client.exceptions.ApiException as e:
            if e.status != 404:
                raise

    def _report_failed(self, name: str, slice_index: int) -> None:
        self.custom.patch_namespaced_custom_object_status(
            JOBSET_GROUP,
            JOBSET_VERSION,
            self.namespace,
            JOBSET_PLURAL,
            name,
            {
                "status": {
                    "conditions": [
                        {
                            "type": "Failed",
                            "status": "True",
                            "reason": "FailedJobs",
                            "lastTransitionTime": _now(),
                            "message": f"jobset failed: job {name}-slice-{slice_index} failed",
                        }
                    ]
                },
            },
        )

    def complete(self, jobset: Any) -> None:
        """What the JobSet controller reports when every worker exited 0."""
        condition = {"type": "Completed", "status": "True", "reason": "AllJobsCompleted", "lastTransitionTime": _now(),
                     "message": "jobset completed successfully"}  # fmt: skip
        self.custom.patch_namespaced_custom_object_status(
            JOBSET_GROUP, JOBSET_VERSION, self.namespace, JOBSET_PLURAL, jobset["metadata"]["name"],
            {"status": {"conditions": [condition]}},
        )  # fmt: skip

    def fail_pod(self, jobset: Any, slice_index: int, exit_code: int) -> None:
        """What kubelet reports when the worker process of one slice exits with `exit_code`."""
        meta = jobset["metadata"]
        pod_name = f"{meta['name']}-slice-{slice_index}-0"
        template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        pod: Any = {
            "metadata": {
                "name": pod_name,
                "labels": template["metadata"]["labels"],
                "annotations": {"jobset.sigs.k8s.io/job-index": str(slice_index)},
            },
            "spec": {"containers": [{"name": "trainer", "image": template["spec"]["containers"][0]["image"]}]},
        }
        self.core.create_namespaced_pod(self.namespace, pod)
        self.core.patch_namespaced_pod_status(
            pod_name,
            self.namespace,
            {
                "status": {
                    "phase": "Failed",
                    "containerStatuses": [
                        {
                            "name": "trainer",
                            "image": "x",
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "state": {"terminated": {"exitCode": exit_code, "reason": "Error", "finishedAt": _now()}},
                        }
                    ],
                }
            },
        )

    def events(self, name: str) -> list[str]:
        found = self.core.list_namespaced_event(self.namespace, field_selector=f"involvedObject.name={name}")
        return [e.reason or "" for e in found.items]


@pytest.fixture
def cluster(kube, namespace) -> Cluster:
    return Cluster(kube, namespace)


def _write_checkpoint(bucket: storage.Bucket, run: str, step: int, committed: bool) -> None:
    """The object layout Orbax leaves on GCS (see trainer_image/README.md: Committed checkpoints)."""
    bucket.blob(f"{run}/checkpoints/{step}/state/manifest.ocdbt").upload_from_string(b"x" * 64)
    if committed:
        bucket.blob(f"{run}/checkpoints/{step}/{checkpoints.COMMIT_MARKER}").upload_from_string(b"")


def test_apply_creates_the_expected_owned_jobset(operator, cluster, unique_name):
    created = cluster.apply(training_job_manifest(unique_name))
    jobset = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    expected = build_jobset(api.TrainingJob.model_validate(created), attempt=0, resume_step=None)
    assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 2
    assert jobset["metadata"]["ownerReferences"] == expected["metadata"]["ownerReferences"]
    assert jobset["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    sent_pod = expected["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    stored_pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert stored_pod["containers"][0]["env"] == sent_pod["containers"][0]["env"]
    assert stored_pod["nodeSelector"] == sent_pod["nodeSelector"]
    status = eventually(lambda: (s := cluster.status(unique_name)).get("phase") and s, what="status")
    assert status["phase"] == "Pending" and status["jobSetName"] == f"{unique_name}-a0"
    assert "Created" in eventually(lambda: cluster.events(unique_name), what="events")


def test_slice_failure_restarts_from_the_latest_committed_step(operator, cluster, unique_name, fake_gcs_server):
    run = f"runs/{cluster.namespace}/{unique_name}"
    bucket = storage.Client(project="t", credentials=checkpoints.AnonymousCredentials()).bucket(TEST_BUCKET)
    for step, committed in ((100, True), (200, True), (300, False)):  # 300: a save cut short
        _write_checkpoint(bucket, run, step, committed)
    cluster.apply(training_job_manifest(unique_name))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    assert first["metadata"]["annotations"]["tpujob.dev/resume-step"] == "200"

    cluster.fail_slice(first, slice_index=1, exit_code=1)

    second = eventually(lambda: cluster.jobset(f"{unique_name}-a1"), what="JobSet a1")
    pod = second["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TPUJOB_RESUME_STEP"] == "200" and env["TPUJOB_ATTEMPT"] == "1"
    eventually(lambda: cluster.jobset(f"{unique_name}-a0") is None, what="failed JobSet deleted")
    status = cluster.status(unique_name)
    assert (status["restarts"], status["attempt"]) == (1, 1)
    failure = status["lastFailure"]
    assert (failure["kind"], failure["slice"], failure["resumeStep"], failure["reason"]) == (
        "ApplicationError",
        1,
        200,
        "ExitCode1",
    )
    assert status["latestCheckpoint"]["step"] == 200
    reasons = eventually(lambda: (r := cluster.events(unique_name)) and "Restored" in r and r, what="events")
    assert {"Created", "FailureDetected", "Restarting", "Restored"} <= set(reasons)


def test_exhausted_budget_fails_the_job_with_a_condition(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name, restart={"maxRestarts": 0}))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.fail_slice(first, slice_index=0, exit_code=1)
    status = eventually(lambda: (s := cluster.status(unique_name)).get("phase") == "Failed" and s, what="phase Failed")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "RestartBudgetExhausted")
    assert "restart budget exhausted (0/0)" in failed["message"]
    assert status["restarts"] == 0
    # Giving up releases the slices: the apiserver holds no JobSet of the job (deleting ones included).
    eventually(lambda: cluster.all_jobsets() == [], timeout=60, what="no JobSet left after giving up")
    eventually(lambda: "RestartBudgetExhausted" in cluster.events(unique_name), what="the Event")


def test_a_job_failed_while_the_operator_was_down_loses_its_jobset_when_it_is_back(
    start_operator, cluster, unique_name
):
    first = start_operator()
    cluster.apply(training_job_manifest(unique_name))
    eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    eventually(lambda: cluster.status(unique_name).get("phase"), what="status")
    first.stop()
    # What an operator that died between its Failed status write and the delete left behind.
    failed = {"type": "Failed", "status": "True", "reason": "RestartBudgetExhausted", "message": "gave up",
              "lastTransitionTime": _now()}  # fmt: skip
    cluster.custom.patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, cluster.namespace, api.PLURAL, unique_name,
        {"status": {"phase": "Failed", "conditions": [failed], "stage": "Finished"}},
    )  # fmt: skip
    assert cluster.jobset(f"{unique_name}-a0") is not None
    start_operator()  # a new operator process, remembering nothing
    eventually(lambda: cluster.all_jobsets() == [], timeout=60, what="no JobSet left by the finished job")
    assert cluster.status(unique_name)["phase"] == "Failed"


def test_a_run_completed_short_of_its_final_step_resumes_and_succeeds_only_at_it(operator, cluster, unique_name):
    run = f"runs/{cluster.namespace}/{unique_name}"
    bucket = storage.Client(project="t", credentials=checkpoints.AnonymousCredentials()).bucket(TEST_BUCKET)
    _write_checkpoint(bucket, run, 200, committed=True)
    cluster.apply(training_job_manifest(unique_name, args=["--model", "tiny", "--steps", "300"]))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.complete(first)  # every pod was stopped and exited 0 at committed step 200
    second = eventually(lambda: cluster.jobset(f"{unique_name}-a1"), what="JobSet a1")
    assert second["metadata"]["annotations"]["tpujob.dev/resume-step"] == "200"
    status = cluster.status(unique_name)
    assert (status["phase"], status["lastFailure"]["kind"], status["countedRestarts"]) == (
        "Restarting", "Preemption", 0)  # fmt: skip
    _write_checkpoint(bucket, run, 300, committed=True)  # the final step, committed
    cluster.complete(second)
    done = eventually(lambda: (s := cluster.status(unique_name)).get("phase") == "Succeeded" and s, what="Succeeded")
    assert done["latestCheckpoint"]["step"] == 300
    assert cluster.all_jobsets() == [f"{unique_name}-a1"]  # a Succeeded job keeps its completed JobSet


def test_preemption_is_restarted_without_spending_the_budget(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name, restart={"maxRestarts": 0, "backoffSeconds": 0}))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.fail_slice(first, slice_index=0, exit_code=143)  # the trainer's exit after SIGTERM
    eventually(lambda: cluster.jobset(f"{unique_name}-a1"), what="JobSet a1")
    status = cluster.status(unique_name)
    assert (status["restarts"], status["countedRestarts"], status["lastFailure"]["kind"]) == (1, 0, "Preemption")


def test_delete_cascades_to_the_jobset(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name))
    eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, cluster.namespace, api.PLURAL, unique_name)
    eventually(lambda: cluster.jobsets() == [], what="JobSet garbage-collected")


def test_restarted_operator_never_duplicates_a_jobset(start_operator, cluster, unique_name):
    first_operator = start_operator()
    cluster.apply(training_job_manifest(unique_name))
    eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    first_operator.stop()
    start_operator()
    time.sleep(10)  # the start-up listing and the new JobSet events are handled in this window
    assert [js["metadata"]["name"] for js in cluster.jobsets()] == [f"{unique_name}-a0"]
    assert cluster.status(unique_name)["attempt"] == 0


def test_suspend_and_resume_map_to_the_jobset(operator, cluster, unique_name):
    cluster.apply(training_job_manifest(unique_name))
    eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    cluster.patch_spec(unique_name, {"suspend": True})
    eventually(
        lambda: (cluster.jobset(f"{unique_name}-a0") or {}).get("spec", {}).get("suspend") is True, what="suspended"
    )
    assert eventually(lambda: cluster.status(unique_name).get("phase") == "Suspended", what="phase Suspended")
    cluster.patch_spec(unique_name, {"suspend": False})
    eventually(
        lambda: (cluster.jobset(f"{unique_name}-a0") or {}).get("spec", {}).get("suspend") is False, what="resumed"
    )


def test_unreadable_checkpoint_storage_is_reported_and_the_job_still_runs(operator, cluster, unique_name):
    manifest = training_job_manifest(unique_name, checkpoint={"directory": "gs://no-such-bucket-tpujob/runs"})
    cluster.apply(manifest)
    eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    status = eventually(
        lambda: (s := cluster.status(unique_name)).get("checkpointStorageError") and s, what="storage error"
    )
    assert "gs://no-such-bucket-tpujob/runs" in status["checkpointStorageError"]
    assert "CheckpointStorageError" in eventually(lambda: cluster.events(unique_name), what="events")
