"""Slow storage never delays a failure reaction (issue 17, item 10): the operator, in-process, against a
real kube-apiserver, with its GCS endpoint blackholed (a loopback listener that accepts connections
and never answers: what a GCS brownout looks like to the client, whose reads then take 10-30 s).

More running jobs than reconcile slots, each checked every second: before, every check held a slot
for its read's full timeout, and a worker's failure waited behind them (then for its own reads)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from kubernetes import client
from tpujob_operator.runtime import RuntimeSettings

from .conftest import eventually, training_job_manifest
from .test_fleet import _running_worker
from .test_operator import Cluster

JOBS = 12  # more than the 8 slots the jobs' checks share
# A reconcile waits this long for a progress check's read (reads.py's 5 s, longer here): a reaction that
# waited for one would come after it. Before: at least one blackholed read's timeout, in practice 30 s or more.
CHECK_READ_SECONDS = 20.0
REACTION_LIMIT_SECONDS = CHECK_READ_SECONDS / 2


@pytest.fixture
def cluster(kube: client.ApiClient, namespace: str) -> Cluster:
    return Cluster(kube, namespace)


@pytest.fixture
def blackhole() -> Iterator[str]:
    """host:port of a listener that accepts every connection and never answers (nor closes it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stopping = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stopping.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stopping.set()
    thread.join(2)
    for connection in held:
        connection.close()
    listener.close()


def _fail_worker(cluster: Cluster, jobset_name: str) -> None:
    """What kubelet reports when the worker process exits 1 (the pod `_running_worker` made)."""
    finished = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    terminated = {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": finished}}
    container = {"name": "trainer", "image": "x", "imageID": "", "ready": False, "restartCount": 0}
    cluster.core.patch_namespaced_pod_status(
        f"{jobset_name}-slice-0-0",
        cluster.namespace,
        {"status": {"phase": "Failed", "containerStatuses": [{**container, "state": terminated}]}},
    )


def test_a_failure_is_acted_on_within_seconds_while_the_operators_storage_does_not_answer(
    start_operator, cluster, unique_name, blackhole, monkeypatch
):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", blackhole)  # the operator's GCS client, made lazily, uses it
    operator = start_operator(RuntimeSettings(progress_check_seconds=1.0))  # every job's check is due all the time
    operator.runtime.reads.check_seconds = CHECK_READ_SECONDS
    names = [f"{unique_name}-{i}" for i in range(JOBS)]
    one_slice = {"accelerator": "tpu-v5p-slice", "topology": "2x2x1", "slices": 1}
    for name in names:
        cluster.apply(training_job_manifest(name, tpu=one_slice))
    for name in names:
        jobset = eventually(lambda n=name: cluster.jobset(f"{n}-a0"), timeout=180, what=f"JobSet {name}-a0")
        _running_worker(cluster, jobset)
    for name in names:  # storage unknown: no clock decides, the job says why
        eventually(
            lambda n=name: cluster.status(n).get("checkpointStorageError"), timeout=180, what=f"{name} storage error"
        )
    time.sleep(3)  # the checks keep coming, each wanting a read of the blackholed bucket

    victim = names[JOBS // 2]
    failed_at = time.monotonic()
    _fail_worker(cluster, f"{victim}-a0")
    replacement = eventually(lambda: cluster.jobset(f"{victim}-a1"), timeout=120, interval=0.05, what="JobSet a1")
    reaction = time.monotonic() - failed_at

    assert reaction < REACTION_LIMIT_SECONDS, f"the replacement came {reaction:.1f} s after the failure"
    # Decided with storage unknown: the new attempt is not pinned; its trainer restores the latest
    # committed step itself (never a deletion: the operator only reads the bucket).
    assert replacement["metadata"]["annotations"]["tpujob.dev/resume-step"] == "-1"
    status = cluster.status(victim)
    assert (status["attempt"], status["lastFailure"]["kind"]) == (1, "ApplicationError")
    assert "is not answering" in status["checkpointStorageError"]
