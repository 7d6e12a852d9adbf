"""/metrics of the in-process operator on a real apiserver: a worker fails, the job restarts, the
restart is counted under the right labels, and the job's series go when it is deleted."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from prometheus_client.parser import text_string_to_metric_families
from tpujob_devcluster.controlplane import free_port
from tpujob_operator import api, checkpoints
from tpujob_operator.metrics import BADPUT_CAUSES, OperatorMetrics

from ..conftest import TEST_BUCKET
from .conftest import OperatorThread, eventually, training_job_manifest
from .test_operator import Cluster


@pytest.fixture
def cluster(kube, namespace) -> Cluster:
    return Cluster(kube, namespace)


@pytest.fixture
def metrics_server(operator: OperatorThread) -> Iterator[WSGIServer]:
    """The operator's own registry, served the way `--metrics-port` serves it (on a free loopback port)."""
    server = operator.runtime.metrics.serve(0, "127.0.0.1")
    yield server
    server.shutdown()
    server.server_close()


def scrape(server: WSGIServer) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: OperatorMetrics, registry_name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(registry_name, labels) or 0.0


def test_a_failed_worker_is_scraped_as_one_counted_application_error_restart(
    operator, cluster, unique_name, metrics_server
):
    job = {"namespace": cluster.namespace, "name": unique_name}
    restart = {**job, "kind": "ApplicationError", "counted": "true", "rung": "Recreate"}
    metrics = operator.runtime.metrics
    detections = value(metrics, "tpujob_failure_detection_seconds_count", kind="ApplicationError")
    bucket = storage.Client(project="t", credentials=AnonymousCredentials()).bucket(TEST_BUCKET)
    run = f"runs/{cluster.namespace}/{unique_name}/checkpoints/100"
    bucket.blob(f"{run}/state/manifest.ocdbt").upload_from_string(b"x" * 64)
    bucket.blob(f"{run}/{checkpoints.COMMIT_MARKER}").upload_from_string(b"")
    cluster.apply(training_job_manifest(unique_name))
    first = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")

    cluster.fail_pod(first, slice_index=1, exit_code=1)

    eventually(lambda: cluster.jobset(f"{unique_name}-a1"), what="JobSet a1")
    status = cluster.status(unique_name)
    assert (status["restarts"], status["lastFailure"]["kind"]) == (1, "ApplicationError")
    assert value(metrics, "tpujob_restarts_total", **restart) == 1
    assert value(metrics, "tpujob_failure_detection_seconds_count", kind="ApplicationError") == detections + 1

    scraped = scrape(metrics_server)
    assert scraped[("tpujob_restarts_total", frozenset(restart.items()))] == 1
    assert ("tpujob_restarts_total", frozenset({**restart, "counted": "false"}.items())) not in scraped
    assert scraped[("tpujob_lost_steps_total", frozenset(job.items()))] == 0  # no step was reported
    assert ("tpujob_seconds_since_committed_checkpoint", frozenset(job.items())) in scraped
    # The ledger's gauges follow status.goodput (nothing trained here: no productive time).
    goodput = api.Goodput.model_validate(cluster.status(unique_name)["goodput"])
    assert scraped[("tpujob_productive_seconds", frozenset(job.items()))] == goodput.productive_seconds == 0
    causes = {
        dict(labels)["cause"]
        for name, labels in scraped
        if name == "tpujob_badput_seconds" and ("name", unique_name) in labels
    }
    assert causes == set(BADPUT_CAUSES.values())  # every cause, 0 or not
    live = sum(scraped[("tpujob_jobs", frozenset({("phase", p)}))] for p in ("Pending", "Restarting", "Running"))
    assert live >= 1
    assert scraped[("tpujob_reconcile_duration_seconds_count", frozenset())] >= 3

    cluster.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, cluster.namespace, api.PLURAL, unique_name)

    gone = ("tpujob_seconds_since_committed_checkpoint", frozenset(job.items()))
    eventually(lambda: gone not in scrape(metrics_server), what="the deleted job's gauges gone")
    # Counters keep their final value for a while, so that the last increment is scraped.
    assert scrape(metrics_server)[("tpujob_restarts_total", frozenset(restart.items()))] == 1


def test_the_operator_process_serves_metrics_once_it_leads(control_plane, fake_gcs_server, namespace, tmp_path):
    """`python -m tpujob_operator --metrics-port`, as the chart runs it: /metrics answers once it leads."""
    port, log_path = free_port(), tmp_path / "operator.log"
    argv = [
        *(sys.executable, "-m", "tpujob_operator", "--liveness", f"http://127.0.0.1:{free_port()}/healthz"),
        *("--namespace", namespace, "--leader-election-namespace", namespace, "--metrics-port", str(port)),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env={**os.environ, "POD_NAME": "op-0"}, stdout=log, stderr=subprocess.STDOUT)
    try:

        def metrics() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    return str(response.read().decode())
            except (urllib.error.URLError, ConnectionError):
                assert process.poll() is None, log_path.read_text()
                return None

        text = eventually(metrics, timeout=60, what="/metrics of the leading operator process")
        log = log_path.read_text()
        assert log.index("leading: op-0_") < log.index(f"serving metrics on http://0.0.0.0:{port}/metrics")
        families = {f.name for f in text_string_to_metric_families(text)}
        assert {"tpujob_jobs", "tpujob_reconcile_duration_seconds", "process_resident_memory_bytes"} <= families
    finally:
        process.kill()
        process.wait(10)
