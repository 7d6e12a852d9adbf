"""The shell's pure rules: which GCS reads a reconcile makes (observe.py), how the caches and our own
writes combine, which status is worth a write (apply.py); what the runtime remembers of a job."""

from datetime import UTC, datetime
from typing import Any

import kopf
import pytest
from tpujob_operator import api, handlers
from tpujob_operator.apply import status_worth_writing
from tpujob_operator.checkpoints import RunView, with_reported_commit
from tpujob_operator.facts import CreationRefused
from tpujob_operator.observe import Reads, merged_jobsets, newest, slim_jobset, slim_pod, storage_reads
from tpujob_operator.reconcile import after_creation_refused
from tpujob_operator.runtime import PROGRESS_CHECK_SECONDS, Runtime, RuntimeSettings

from .factories import progress_record, training_job

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
LISTED = RunView(latest_committed_step=100, listed=True)


@pytest.mark.parametrize(
    ("view", "running", "deciding", "ages", "expected"),
    [
        # waiting for capacity or a queue: no worker writes anything, nothing is read
        (RunView(), False, False, (None, None), Reads(progress=False, listing=False)),
        (LISTED, False, False, (300.0, 300.0), Reads(progress=False, listing=False)),
        # a decision (restart, new attempt, resume, the end) reads everything, even right after a read:
        # the trainer's last record (written as it exits) may have landed since
        (LISTED, False, True, (300.0, 300.0), Reads(progress=True, listing=True)),
        (LISTED, True, True, (0.1, 0.1), Reads(progress=True, listing=True)),
        # training: the record is checked; the checkpoints listed only if never listed
        (RunView(), True, False, (None, None), Reads(progress=True, listing=True)),
        (LISTED, True, False, (61.0, 3000.0), Reads(progress=True, listing=False)),
        # a burst of events right after a read reuses it
        (LISTED, True, False, (0.5, 0.5), Reads(progress=False, listing=False)),
    ],
)
def test_storage_reads_follow_the_work(view, running, deciding, ages, expected):
    reads = storage_reads(view, workers_running=running, deciding=deciding, progress_age=ages[0], check_seconds=60)
    assert reads == expected


def test_while_workers_end_their_last_records_are_read():
    # suspended: no worker runs any more, but the one stopping saves and then writes its record
    ending = {"workers_running": False, "deciding": False, "workers_ending": True, "check_seconds": 60}
    assert storage_reads(LISTED, progress_age=5.0, **ending) == Reads(progress=True, listing=False)
    assert storage_reads(LISTED, progress_age=0.5, **ending) == Reads(progress=False, listing=False)  # just read


@pytest.mark.parametrize(
    ("reported", "listed", "latest"),
    [(None, 100, 100), (100, 100, 100), (90, 100, 100), (120, 100, 120), (5, None, 5)],
)
def test_a_newer_commit_the_trainer_reports_is_the_latest_without_a_listing(reported, listed, latest):
    progress = progress_record(step=130, attempt=0, updated_at=T0, last_committed_step=reported, uid="u")
    view = with_reported_commit(RunView(latest_committed_step=listed, listed=True, progress=progress), "u", 0, False)
    assert view.latest_committed_step == latest


def test_only_this_jobs_current_record_reports_a_commit_and_never_against_a_listing():
    progress = progress_record(step=130, attempt=1, updated_at=T0, last_committed_step=300, uid="u")
    view = RunView(latest_committed_step=100, listed=True, progress=progress)
    assert with_reported_commit(view, "u", 1, listed_now=False).latest_committed_step == 300
    assert with_reported_commit(view, "other-uid", 1, listed_now=False).latest_committed_step == 100  # foreign
    assert with_reported_commit(view, "u", 2, listed_now=False).latest_committed_step == 100  # stale attempt
    assert with_reported_commit(view, "u", 1, listed_now=True).latest_committed_step == 100  # the listing wins


def _js(name, rv="1"):
    return {"metadata": {"name": name, "resourceVersion": rv}}


def test_our_own_writes_show_until_the_watch_delivers_them():
    cached = [_js("llama-a0"), _js("llama-a1")]
    created = {"llama-a2": _js("llama-a2"), "llama-a1": _js("llama-a1", "0")}
    merged = merged_jobsets(cached, created, deleted={"llama-a0"})
    # a0 deleted by us is hidden; a1 comes from the cache, not from our copy; a2 is not in the cache yet
    assert [(j["metadata"]["name"], j["metadata"]["resourceVersion"]) for j in merged] == [
        ("llama-a1", "1"),
        ("llama-a2", "1"),
    ]


def test_the_newest_body_is_the_one_with_the_highest_resource_version():
    watched, written = _js("llama", "41"), _js("llama", "42")
    assert newest(watched, written) is written and newest(written, None) is written and newest(None) is None
    assert newest(_js("x", "9"), _js("x", "10"))["metadata"]["resourceVersion"] == "10"  # numeric, not text


def test_slim_copies_keep_what_the_decoders_read():
    pod = {
        "metadata": {"name": "p", "labels": {"a": "b"}, "managedFields": [{"huge": True}]},
        "spec": {"containers": [{"env": ["..."]}]},
        "status": {"phase": "Running"},
    }
    assert slim_pod(pod) == {"metadata": {"name": "p", "labels": {"a": "b"}}, "status": {"phase": "Running"}}
    jobset = {
        "metadata": {"name": "j"},
        "spec": {"suspend": True, "replicatedJobs": [{"replicas": 2, "template": {"spec": {"parallelism": 4}}}]},
        "status": {"conditions": [{"type": "Completed", "status": "True"}], "replicatedJobsStatus": []},
    }
    slim = slim_jobset(jobset)
    assert slim["spec"] == {
        "suspend": True,
        "replicatedJobs": [{"replicas": 2, "template": {"spec": {"parallelism": 4}}}],
    }
    assert slim["status"] == {"conditions": [{"type": "Completed", "status": "True"}]}


def _status(step, goodput_at):
    return {"phase": "Running", "step": step, "goodput": {"updatedAt": goodput_at, "wallSeconds": 1.0}}


@pytest.mark.parametrize(
    ("stored", "decided", "acting", "write"),
    [
        (_status(5, "2026-11-30T12:00:00Z"), _status(5, "2026-11-30T12:00:00Z"), False, False),  # unchanged
        (_status(5, "2026-11-30T12:00:00Z"), _status(6, "2026-11-30T12:00:10Z"), False, True),  # news
        (_status(5, "2026-11-30T12:00:00Z"), _status(5, "2026-11-30T12:00:10Z"), False, False),  # only the clock
        (_status(5, "2026-11-30T12:00:00Z"), _status(5, "2026-11-30T12:01:00Z"), False, True),  # clock, a minute on
        (_status(5, "2026-11-30T12:00:00Z"), _status(5, "2026-11-30T12:00:10Z"), True, True),  # a decision
    ],
)
def test_status_that_changed_only_by_the_goodput_clock_is_written_at_most_once_a_minute(stored, decided, acting, write):
    assert status_worth_writing(stored, decided, acting) is write


def test_a_snapshot_joins_the_caches_with_our_own_writes_and_each_queued_jobset_with_its_newest_workload():
    key = ("ml", "llama")
    queued = {"metadata": {"name": "llama-a1", "uid": "js-1", "labels": {"kueue.x-k8s.io/queue-name": "q"}}}
    old_workload = {"metadata": {"name": "w0", "creationTimestamp": "2026-11-30T12:00:00Z"}}
    new_workload = {"metadata": {"name": "w1", "creationTimestamp": "2026-11-30T12:05:00Z"}}
    runtime = Runtime()
    runtime.indexes = {
        "trainingjobs": {key: [{"metadata": {"name": "llama", "resourceVersion": "7"}}]},
        "jobsets": {key: [{"metadata": {"name": "llama-a0"}}, queued]},
        "pods": {key: [{"metadata": {"name": "llama-a1-slice-0-0"}, "status": {"phase": "Pending"}}]},
        "workloads": {"js-1": [old_workload, new_workload]},
    }
    job = runtime.memory.of(key)
    job.written = {"metadata": {"name": "llama", "resourceVersion": "9"}}  # our status write
    job.deleted = {"llama-a0", "llama-a-gone"}
    job.ended_pods["llama-a0-slice-0-0"] = {"metadata": {"name": "llama-a0-slice-0-0"}}
    snapshot = runtime.snapshot(key)
    assert snapshot is not None and snapshot.body["metadata"]["resourceVersion"] == "9"
    assert [js["metadata"]["name"] for js in snapshot.jobsets] == ["llama-a1"]
    assert job.deleted == {"llama-a0"}  # gone from the cache: no longer hidden
    assert sorted(p["metadata"]["name"] for p in snapshot.pods) == ["llama-a0-slice-0-0", "llama-a1-slice-0-0"]
    assert snapshot.workloads == {"js-1": new_workload}
    runtime.forget(key)
    assert runtime.remembered(key) == 0 and runtime.snapshot(("ml", "other")) is None


def test_what_is_remembered_of_a_job_is_one_object_dropped_with_one_forget():
    key, other = ("ml", "llama"), ("ml", "other")
    runtime = Runtime()
    runtime.watch(key)
    runtime.worker_ended(key, {"metadata": {"name": "llama-a0-slice-0-0"}, "status": {"phase": "Failed"}})
    job = runtime.memory.of(key)
    job.read_at, job.created["llama-a1"] = 1.0, _js("llama-a1")
    runtime.memory.of(other).read_at = 2.0
    # watched, the ended pod, when it was seen ending, the read, the creation
    assert runtime.remembered(key) == 5 and job.ending_since is not None
    runtime.forget(key)
    assert runtime.remembered(key) == 0 and runtime.memory.get(key) is None
    assert runtime.memory.held(other) == 1  # another job's memory is its own


def test_a_deleted_node_names_the_watched_jobs_with_a_pod_bound_to_it():
    def pod(name: str, node: str | None) -> dict[str, Any]:
        return {"metadata": {"name": name}, **({"spec": {"nodeName": node}} if node else {})}

    on_it, elsewhere, unwatched = ("ml", "llama"), ("ml", "gemma"), ("ml", "old")
    runtime = Runtime()
    runtime.indexes = {
        "pods": {
            on_it: [pod("llama-a0-slice-0-0", "host-1"), pod("llama-a0-slice-1-0", "host-7")],
            elsewhere: [pod("gemma-a0-slice-0-0", "host-2"), pod("gemma-a1-slice-0-0", None)],
            unwatched: [pod("old-a0-slice-0-0", "host-7")],
        }
    }
    for key in (on_it, elsewhere):
        runtime.watch(key)
    assert runtime.jobs_on_node("host-7") == [on_it]
    assert runtime.jobs_on_node("host-9") == []


def test_a_refused_jobset_is_decided_by_the_apiservers_answer():
    status = api.TrainingJobStatus(phase="Pending", attempt=1, job_set_name="llama-a1")
    for code, phase in ((422, "Failed"), (400, "Failed"), (403, "Pending"), (None, "Pending")):
        decided, told = after_creation_refused(status, CreationRefused("no", code), T0)
        assert decided.phase == phase, code
        assert [(e.type, e.reason, e.message) for e in told.events] == [("Warning", "JobSetRefused", "no")]
        assert (told.create_attempt, told.delete, told.set_suspend) == (None, [], None)  # nothing else to do


def test_each_runtime_has_its_own_handlers_settings_and_metrics():
    quick, plain = Runtime(RuntimeSettings(progress_check_seconds=1.0, watch_kueue_workloads=True)), Runtime()
    registries = kopf.OperatorRegistry(), kopf.OperatorRegistry()
    handlers.register(quick, registries[0])
    handlers.register(plain, registries[1])
    indexes = [[h.id for h in r._indexing.get_all_handlers()] for r in registries]
    assert indexes[0] == [*indexes[1], "tpujob_workloads"]  # only where the flag asks for the Workloads watch
    assert quick.metrics.registry is not plain.metrics.registry
    assert (quick.observer.check_seconds, plain.observer.check_seconds) == (1.0, PROGRESS_CHECK_SECONDS)


class _Apiserver:
    """Stand-in for the apiserver's answer to one GET: the cache lagging a JobSet that runs cannot be
    staged against a real one on demand."""

    def __init__(self, jobset: dict[str, Any] | None) -> None:
        self.jobset = jobset

    def get_jobset(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.jobset if self.jobset and self.jobset["metadata"]["name"] == name else None


_MINE = {"name": "llama-a0", "labels": {"tpujob.dev/uid": "0000-1111"}}


@pytest.mark.parametrize(
    ("live", "runs"),
    [
        ({"metadata": _MINE, "spec": {}}, True),
        ({"metadata": _MINE, "spec": {"suspend": True}}, False),
        ({"metadata": {**_MINE, "deletionTimestamp": "2026-11-30T12:00:00Z"}, "spec": {}}, False),
        ({"metadata": {"name": "llama-a0", "labels": {"tpujob.dev/uid": "another incarnation"}}, "spec": {}}, False),
        (None, False),
    ],
)
def test_a_policy_refusal_reads_the_running_attempt_from_the_apiserver_not_the_cache(live, runs):
    """A refusal releases the job's JobSets: one the cache does not show yet but the apiserver has, not
    suspended and of this incarnation, runs, and the job goes on with a warning instead."""
    runtime = Runtime()
    runtime._cluster = _Apiserver(live)  # type: ignore[assignment]
    tj = training_job(status={"phase": "Running", "jobSetName": "llama-a0"})
    assert runtime._attempt_runs(tj) is runs
