"""What a waiting job shows (issue 17 item 12): a pod template the Job API refuses is the job's
status, not "Scheduling 0/N" forever.

The integration tier runs no JobSet controller; the test does what it does (jobset_controller.go:
create the slice's Job from the JobSet's template, and on a refusal post a Warning Event
JobCreationFailed with the error on the JobSet). The refusal itself is the real apiserver's."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from .conftest import eventually, training_job_manifest
from .test_operator import Cluster


def _create_slice_job(control_plane: Any, jobset: dict[str, Any]) -> tuple[int, str]:
    """The JobSet controller's create of slice 0's Job: the apiserver's answer and its message."""
    [rjob] = jobset["spec"]["replicatedJobs"]
    meta = jobset["metadata"]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{meta['name']}-{rjob['name']}-0", "labels": rjob["template"]["metadata"]["labels"]},
        "spec": copy.deepcopy(rjob["template"]["spec"]),
    }
    code, answer = control_plane.request("POST", f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs", job)
    return code, str(answer.get("message"))


def test_a_pod_template_the_job_api_refuses_is_the_jobs_status(operator, control_plane, kube, namespace):
    cluster = Cluster(kube, namespace)
    # An unqualified extended resource: admission cannot know it, the Job API refuses it.
    cluster.apply(training_job_manifest("tmpl", resources={"requests": {"gpu": 1}, "limits": {"gpu": 1}}))
    jobset = eventually(lambda: cluster.jobset("tmpl-a0"), what="the JobSet")
    code, message = _create_slice_job(control_plane, jobset)
    assert code == 422 and "requests[gpu]" in message, message
    now = datetime.now(UTC)
    client.CoreV1Api(kube).create_namespaced_event(
        namespace,
        client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name="tmpl-a0."),
            involved_object=client.V1ObjectReference(
                api_version="jobset.x-k8s.io/v1alpha2",
                kind="JobSet",
                name="tmpl-a0",
                namespace=namespace,
                uid=jobset["metadata"]["uid"],
            ),
            reason="JobCreationFailed",  # constants.JobCreationFailedReason
            message=message,
            type="Warning",
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component="jobset-controller"),
        ),
    )

    def pending() -> dict[str, Any] | None:
        conditions = {c["type"]: c for c in cluster.status("tmpl").get("conditions") or []}
        condition: dict[str, Any] | None = conditions.get("Pending")
        return condition if condition and condition["reason"] == "PodCreationRefused" else None

    # Within the reconciler's safety-net recheck (60 s): nothing else happens to a job with no pods.
    condition = eventually(pending, timeout=120, what="Pending/PodCreationRefused (before: Scheduling 0/4 forever)")
    assert condition["message"] == message
