"""How a job's progress is read is its framework's (frameworks/): the observation over real GCS
(fake-gcs-server) reads the trainer's progress record for a tpujob job and, for a MaxText job, which
writes none, the commit time of its newest step and its gcs_metrics files. No apiserver: the JobSet is
the builder's, as the watch would show it."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import tpujob_contract as contract
from tpujob_operator import checkpoints
from tpujob_operator.jobset import build_jobset
from tpujob_operator.memory import JobMemory
from tpujob_operator.observe import Observer, Snapshot
from tpujob_operator.reads import BoundedReads

from ..conftest import TEST_BUCKET
from ..unit.factories import training_job


def _observe(tj: Any) -> Any:
    jobset = build_jobset(tj, attempt=1, resume_step=20)
    started = datetime.now(UTC) - timedelta(seconds=60)  # the attempt's JobSet, created before its evidence
    jobset["metadata"].update(uid="js-uid", creationTimestamp=started.strftime("%Y-%m-%dT%H:%M:%SZ"))
    jobset["spec"]["suspend"] = True  # not live: no question to the apiserver about refused pods

    def no_cluster() -> Any:
        raise AssertionError("the observation asked the apiserver")

    client = checkpoints.make_client()
    observer = Observer(
        cluster=no_cluster,
        storage=lambda: client,
        reads=BoundedReads(),
        lane=lambda key: "checks",
        check_seconds=1.0,
        default_queue=None,
    )
    key = (tj.namespace, tj.name)
    snapshot = Snapshot(key=key, body={}, jobsets=[jobset], pods=[])
    return observer.observe(key, JobMemory(), tj, snapshot, deciding=True)


def _write_run(run: str, *, record_step: int | None) -> None:
    """A run directory as MaxText (Orbax, gcs_metrics=true) leaves it, plus a record if one is given."""
    bucket = checkpoints.make_client().bucket(TEST_BUCKET)
    committed_at = int(datetime.now(UTC).timestamp() * 1e9)
    bucket.blob(f"{run}/checkpoints/20/{contract.COMMIT_MARKER}").upload_from_string(b"")
    metadata = json.dumps({"commit_timestamp_nsecs": committed_at})
    bucket.blob(f"{run}/checkpoints/20/_CHECKPOINT_METADATA").upload_from_string(metadata)
    for step in range(20, 24):
        bucket.blob(f"{run}/metrics/metrics_step_{step:06}_to_step_{step:06}.txt").upload_from_string(b"{}")
    if record_step is not None:
        record = contract.ProgressRecord(
            step=record_step, attempt=1, updated_at=contract.now_rfc3339(), uid="0000-1111", last_committed_step=20
        )
        bucket.blob(f"{run}/{contract.PROGRESS_FILE}").upload_from_string(contract.to_json(record))


def test_maxtexts_progress_comes_from_its_newest_commit_and_metrics_files(fake_gcs_server, unique_name):
    args = ["steps=50", "gcs_metrics=true", "log_period=1"]
    tj = training_job(
        name=unique_name, framework="maxtext", image="maxtext:0.2.5", args=args, status={"attempt": 1},
        checkpoint={"directory": f"gs://{TEST_BUCKET}/runs"},
    )  # fmt: skip
    _write_run(f"runs/ml/{unique_name}", record_step=None)
    observed = _observe(tj)
    assert observed.storage_error is None and observed.latest_committed_step == 20
    assert observed.progress is not None
    assert (observed.progress.step, observed.progress.attempt, observed.progress.last_committed_step) == (23, 1, 20)


def test_the_trainers_progress_is_its_record(fake_gcs_server, unique_name):
    tj = training_job(name=unique_name, status={"attempt": 1}, checkpoint={"directory": f"gs://{TEST_BUCKET}/runs"})
    _write_run(f"runs/ml/{unique_name}", record_step=31)  # metrics files mean nothing to it
    observed = _observe(tj)
    assert observed.storage_error is None and observed.latest_committed_step == 20
    assert observed.progress is not None and observed.progress.step == 31
