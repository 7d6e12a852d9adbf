"""At fleet scale the apiserver sees watches and writes, not periodic lists (issue 11): the operator,
in-process, against a real kube-apiserver, whose own request counters are the truth."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
from google.cloud import storage
from kubernetes import client
from tpujob_operator import checkpoints
from tpujob_operator.runtime import RuntimeSettings

from ..conftest import TEST_BUCKET
from .conftest import eventually, training_job_manifest
from .test_operator import Cluster

JOBS = 4
# The resources the operator reads; other components (the controller-manager) use other ones.
OPERATOR_RESOURCES = {"trainingjobs", "jobsets", "pods", "events", "workloads"}
_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


@pytest.fixture
def cluster(kube: client.ApiClient, namespace: str) -> Cluster:
    return Cluster(kube, namespace)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _requests(kube: client.ApiClient) -> Counter[tuple[str, str]]:
    """The apiserver's request counters for the operator's resources: (verb, resource) -> count."""
    method, url, headers, body, _ = kube.param_serialize("GET", "/metrics", auth_settings=["BearerToken"])
    response = kube.call_api(method, url, header_params=headers, body=body)
    counts: Counter[tuple[str, str]] = Counter()
    for line in (response.read() or b"").decode().splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels")))
        if labels.get("resource") in OPERATOR_RESOURCES:
            counts[(labels["verb"], labels["resource"])] += int(float(match.group("value")))
    return counts


def _running_worker(cluster: Cluster, jobset: Any) -> None:
    """What the scheduler and kubelet would report for slice 0's worker: scheduled and running."""
    meta = jobset["metadata"]
    template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    name = f"{meta['name']}-slice-0-0"
    pod: Any = {
        "metadata": {
            "name": name,
            "labels": template["metadata"]["labels"],
            "annotations": {"jobset.sigs.k8s.io/job-index": "0"},
        },
        "spec": {"containers": [{"name": "trainer", "image": template["spec"]["containers"][0]["image"]}]},
    }
    cluster.core.create_namespaced_pod(cluster.namespace, pod)
    running = {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
    cluster.core.patch_namespaced_pod_status(
        name, cluster.namespace, {"status": {"phase": "Running", "conditions": [running]}}
    )


def _no_namespace_terminating(kube: client.ApiClient) -> bool:
    """Earlier tests' namespaces are deleted when they end; the apiserver's counters cannot tell what
    that makes anyone read from the operator's reads."""
    return not any(
        ns.metadata and ns.metadata.deletion_timestamp for ns in client.CoreV1Api(kube).list_namespace().items
    )


def _write_progress(bucket: storage.Bucket, run: str, uid: str, step: int) -> None:
    record = {"step": step, "attempt": 0, "uid": uid, "updated_at": datetime.now(UTC).isoformat(), "loss": 1.0}
    bucket.blob(f"{run}/{checkpoints.PROGRESS_FILE}").upload_from_string(json.dumps(record))


def test_training_jobs_cost_the_apiserver_no_periodic_list_or_get(
    start_operator, cluster, kube, unique_name, fake_gcs_server
):
    # Earlier tests' namespaces are being emptied: their jobs would be reconciled (a status write answered
    # 404 makes the operator LIST to resync), and the namespace controller LISTs while it empties them.
    eventually(lambda: _no_namespace_terminating(kube), timeout=120, what="earlier tests' namespaces gone")
    # Many checks in the quiet window below; this namespace only, as the chart's watchNamespaces does.
    start_operator(RuntimeSettings(progress_check_seconds=1.0), namespaces=[cluster.namespace])
    bucket = storage.Client(project="t", credentials=checkpoints.AnonymousCredentials()).bucket(TEST_BUCKET)
    names = [f"{unique_name}-{i}" for i in range(JOBS)]
    for name in names:
        created = cluster.apply(
            training_job_manifest(name, tpu={"accelerator": "tpu-v5p-slice", "topology": "2x2x1", "slices": 1})
        )
        jobset = eventually(lambda n=name: cluster.jobset(f"{n}-a0"), what=f"JobSet {name}-a0")
        _running_worker(cluster, jobset)
        _write_progress(bucket, f"runs/{cluster.namespace}/{name}", created["metadata"]["uid"], step=10)
    for name in names:
        eventually(lambda n=name: cluster.status(n).get("phase") == "Running", what=f"{name} Running")

    before = _requests(kube)
    time.sleep(8)  # about 8 progress checks of every job
    after = _requests(kube)

    reads = {k: after[k] - before[k] for k in after if k[0] in ("LIST", "GET") and after[k] != before[k]}
    assert reads == {}, f"the operator read the apiserver while nothing happened: {reads}"
    # ...and it kept checking: a new step in the record reaches status without any event.
    _write_progress(
        bucket, f"runs/{cluster.namespace}/{names[0]}", cluster.training_job(names[0])["metadata"]["uid"], step=20
    )
    eventually(lambda: cluster.status(names[0]).get("step") == 20, timeout=30, what="step 20 in status")


def test_the_progress_record_is_parsed_again_only_when_its_generation_changed(fake_gcs_server, unique_name):
    client = checkpoints.make_client()
    bucket = client.bucket(TEST_BUCKET)
    run_dir = f"gs://{TEST_BUCKET}/runs/fleet/{unique_name}"
    view = checkpoints.refresh_progress(client, run_dir, checkpoints.RunView())
    assert view.progress is None and view.error is None  # no record yet
    _write_progress(bucket, f"runs/fleet/{unique_name}", "uid-1", step=10)
    first = checkpoints.refresh_progress(client, run_dir, view)
    written = bucket.get_blob(f"runs/fleet/{unique_name}/{checkpoints.PROGRESS_FILE}")
    assert first.progress is not None and first.progress.step == 10
    assert first.progress_generation == written.generation  # the generation GCS reports for it
    again = checkpoints.refresh_progress(client, run_dir, first)
    assert again.progress is first.progress  # the same generation: not parsed again
    _write_progress(bucket, f"runs/fleet/{unique_name}", "uid-1", step=20)
    changed = checkpoints.refresh_progress(client, run_dir, again)
    assert changed.progress is not None and changed.progress.step == 20
    assert changed.progress_generation != first.progress_generation


def test_a_stopping_workers_last_record_reaches_status_with_no_worker_left_running(
    operator, cluster, unique_name, fake_gcs_server
):
    """Suspended: the worker is stopping (its pod being deleted) and writes its last record after its
    SIGTERM save; status shows that step, though no worker runs any more."""
    bucket = storage.Client(project="t", credentials=checkpoints.AnonymousCredentials()).bucket(TEST_BUCKET)
    run = f"runs/{cluster.namespace}/{unique_name}"
    created = cluster.apply(
        training_job_manifest(unique_name, tpu={"accelerator": "tpu-v5p-slice", "topology": "2x2x1", "slices": 1})
    )
    jobset = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    _running_worker(cluster, jobset)
    _write_progress(bucket, run, created["metadata"]["uid"], step=10)
    eventually(lambda: cluster.status(unique_name).get("step") == 10, what="step 10")
    cluster.patch_spec(unique_name, {"suspend": True})
    eventually(lambda: cluster.status(unique_name).get("phase") == "Suspended", what="Suspended")
    # What the Job controller does to a suspended Job's pod (no kubelet here: it stays terminating).
    cluster.core.delete_namespaced_pod(f"{unique_name}-a0-slice-0-0", cluster.namespace, grace_period_seconds=0)
    time.sleep(3)  # the save on SIGTERM
    _write_progress(bucket, run, created["metadata"]["uid"], step=25)
    eventually(lambda: cluster.status(unique_name).get("step") == 25, timeout=30, what="the last record's step 25")
