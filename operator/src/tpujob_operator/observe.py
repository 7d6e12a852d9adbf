"""Observe: the watch snapshot, what is remembered of a job and the storage reads, turned into `facts.Observed`.

`Snapshot` copies a job's cached objects (and our own writes the watch has not delivered) on the
event loop; `Observer.observe` reads storage only when the work says something may have changed
(`storage_reads`), asks Events and Kueue only while a question is open (`SLOW_LOOKUP_SECONDS`), and
returns plain facts for `reconcile` to decide on. The slim_* copies are what the caches keep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar, cast

import tpujob_contract as contract
from tpujob_contract import LABEL_ATTEMPT, QUEUE_LABEL

from . import api, checkpoints, elastic, frameworks, nodes
from .facts import POD_ENDED_PHASES, JobSetFacts, NodeFacts, Observed, Worker, still_writing
from .jobset import expected_pods, incarnation_uid, jobset_facts, queue_name, workload_admission
from .kube import Cluster
from .memory import JobMemory, Lookup
from .reads import BoundedReads
from .schedule import JobKey, Lane
from .status import parse_time
from .tpu import slice_shape

T = TypeVar("T")
# Reads closer together than this reuse the last one (a burst of pod events is one read).
FRESH_SECONDS = 2.0
# Lookups that only Events or Kueue can answer (why pods are not created, why a job waits in its
# queue) are LISTs: at most one per job per this long, and only while the question is open.
SLOW_LOOKUP_SECONDS = 30.0
# A JobSet's pods normally appear within seconds: only after this long is a refusal looked for.
POD_CREATION_GRACE_SECONDS = 10.0
# After a worker was seen stopping, its job's record is read every ENDING_CHECK_SECONDS for this long:
# a worker stopped by a suspension or a preemption saves first and writes its last record as it exits.
ENDING_READ_SECONDS = 60.0
ENDING_CHECK_SECONDS = 5.0
# Kopf's indexes (handlers.py) by our name: trainingjobs, jobsets, pods (by job), workloads (by
# JobSet uid), nodes (by node name).
Indexes = dict[str, Mapping[Any, Iterable[dict[str, Any]]]]


# -- what the caches keep -------------------------------------------------------------------------------


def slim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a worker pod (metadata, status, the node it is bound to): kept per cached pod."""
    meta = body.get("metadata") or {}
    kept = ("name", "namespace", "labels", "annotations", "creationTimestamp", "deletionTimestamp", "uid")
    slim = {"metadata": {k: meta[k] for k in kept if k in meta}, "status": dict(body.get("status") or {})}
    node = (body.get("spec") or {}).get("nodeName")
    return {**slim, "spec": {"nodeName": node}} if node else slim


def without_managed_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """A cached object without metadata.managedFields (server-side apply's bookkeeping: often the
    largest part of an object, and nothing the operator reads)."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    return {**body, "metadata": meta}


def slim_jobset(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a JobSet: metadata, suspend, the pod count, the restart strategy, the
    conditions and the in-place restart counters."""
    spec = body.get("spec") or {}
    replicated = [
        {
            "replicas": rj.get("replicas", 1),
            "template": {"spec": {"parallelism": ((rj.get("template") or {}).get("spec") or {}).get("parallelism", 1)}},
        }
        for rj in spec.get("replicatedJobs") or []
    ]
    status = body.get("status") or {}
    slim: dict[str, Any] = {
        "metadata": without_managed_fields(body)["metadata"],
        "spec": {"suspend": spec.get("suspend"), "replicatedJobs": replicated},
        "status": {"conditions": list(status.get("conditions") or [])},
    }
    strategy = (spec.get("failurePolicy") or {}).get("restartStrategy")
    if strategy:
        slim["spec"]["failurePolicy"] = {"restartStrategy": strategy}
    for counter in ("currentInPlaceRestartAttempt", "previousInPlaceRestartAttempt"):
        if status.get(counter) is not None:
            slim["status"][counter] = status[counter]
    return slim


def slim_workload(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a Kueue Workload: its creation time and conditions."""
    meta = body.get("metadata") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "creationTimestamp") if k in meta},
        "status": {"conditions": list((body.get("status") or {}).get("conditions") or [])},
    }


# -- the snapshot ------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """A job's objects as the caches showed them when its reconcile started (copied on the event loop)."""

    key: JobKey
    body: dict[str, Any]
    jobsets: list[dict[str, Any]]
    pods: list[dict[str, Any]]
    # Kueue's newest Workload per queued JobSet uid (None: no index; the Workload is then LISTed)
    workloads: dict[str, dict[str, Any] | None] | None = None
    # The Nodes the pods are bound to, by name (a name bound but absent: gone); None: no node index.
    nodes: dict[str, dict[str, Any]] | None = None
    # Every cached Node, for a job that counts spare TPU node pools (elastic.wants_pools); else None.
    all_nodes: list[dict[str, Any]] | None = None


def merged_jobsets(
    cached: Iterable[dict[str, Any]], created: Mapping[str, dict[str, Any]], deleted: set[str]
) -> list[dict[str, Any]]:
    """The JobSets of a job as the cache shows them, plus what this operator created and minus what it
    deleted that the watch has not delivered yet (a reconcile right after its own write must not
    create the attempt twice or delete a JobSet again)."""
    seen = {js["metadata"]["name"]: js for js in cached}
    return [js for name, js in seen.items() if name not in deleted] + [
        js for name, js in created.items() if name not in seen and name not in deleted
    ]


def newest(*bodies: dict[str, Any] | None) -> dict[str, Any] | None:
    """The body with the highest resourceVersion (etcd's revision; the watch may lag our own write)."""

    def revision(body: dict[str, Any]) -> int:
        try:
            return int(body["metadata"].get("resourceVersion") or 0)
        except (TypeError, ValueError):
            return 0

    present = [b for b in bodies if b is not None]
    return max(present, key=revision, default=None)


def snapshot(key: JobKey, indexes: Indexes, job: JobMemory | None) -> Snapshot | None:
    """Copies of the job's cached objects with our own writes laid over them (on the event loop, which
    alone changes the caches). Overlays the watch has caught up with are dropped from `job`."""
    written = job.written if job is not None else None
    body = newest(*indexes.get("trainingjobs", {}).get(key, ()), written)
    if body is None:
        return None
    cached_jobsets = list(indexes.get("jobsets", {}).get(key, ()))
    created: dict[str, dict[str, Any]] = {}
    deleted: set[str] = set()
    if job is not None:
        if written is not None and body is not written:
            job.written = None  # the watch caught up with our write
        names = {js["metadata"]["name"] for js in cached_jobsets}
        for name in [n for n in job.created if n in names]:
            del job.created[name]  # the watch has it now
        job.deleted &= names  # gone from the cache: nothing left to hide
        created, deleted = job.created, job.deleted
    jobsets = merged_jobsets(cached_jobsets, created, deleted)
    live = {p["metadata"]["name"]: p for p in indexes.get("pods", {}).get(key, ())}
    ended = job.ended_pods if job is not None else {}
    pods = list({**ended, **live}.values())
    workloads = None
    if "workloads" in indexes:
        queued = [js["metadata"].get("uid") for js in jobsets if QUEUE_LABEL in (js["metadata"].get("labels") or {})]
        workloads = {uid: _newest_workload(indexes["workloads"].get(uid, ())) for uid in queued if uid}
    every_node = None
    if "nodes" in indexes and elastic.wants_pools(body):
        every_node = [n for found in indexes["nodes"].values() for n in found]
    return Snapshot(key, dict(body), jobsets, pods, workloads, _nodes_under(indexes, pods), every_node)


def _earlier_writers(pods: Iterable[Mapping[str, Any]], attempt: int, bodies: Mapping[str, Any] | None) -> int:
    """Worker pods of attempts before `attempt` that may still write their run directory
    (facts.still_writing; `bodies`: the Nodes under the job's pods; None: no node index, any node counts)."""
    workers = []
    for pod in pods:
        label = str((pod.get("metadata", {}).get("labels") or {}).get(LABEL_ATTEMPT, ""))
        if label.isdigit() and int(label) < attempt:
            node = (pod.get("spec") or {}).get("nodeName")
            workers.append(Worker(int(label), (pod.get("status") or {}).get("phase"), node))
    found = None if bodies is None else {name: nodes.node_facts(body) for name, body in bodies.items()}
    return still_writing(workers, found)


def _nodes_under(indexes: Indexes, pods: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """The cached Nodes the pods are bound to (only those: the index holds every node of the cluster)."""
    if "nodes" not in indexes:
        return None
    bound = {str(node) for p in pods if (node := (p.get("spec") or {}).get("nodeName"))}
    index = cast(Mapping[str, Iterable[dict[str, Any]]], indexes["nodes"])  # keyed by node name
    found = {name: next(iter(index.get(name, ())), None) for name in bound}
    return {name: body for name, body in found.items() if body is not None}


def _newest_workload(workloads: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    return max(workloads, key=lambda w: str(w["metadata"].get("creationTimestamp", "")), default=None)


# -- which reads -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reads:
    progress: bool
    listing: bool


def storage_reads(
    view: checkpoints.RunView,
    *,
    workers_running: bool,
    deciding: bool,
    workers_ending: bool = False,
    progress_age: float | None,
    check_seconds: float,
) -> Reads:
    """Which GCS reads a reconcile makes (`progress_age`: seconds since the last read, None: never). Nothing is
    read while no worker runs (a job waiting for capacity or its queue writes nothing), except for a
    decision (a restart, a new attempt, a resume, the end), which reads everything again, and while
    workers are ending (`ENDING_READ_SECONDS` after a worker was seen stopping: its last record, after
    a suspension's or a preemption's save, is news). A running
    job's record is checked every `check_seconds` (the job's timer; events may bring it forward); the
    checkpoints are listed only when never listed: between decisions the record tells of new commits
    (`checkpoints.with_reported_commit`)."""
    freshness = min(FRESH_SECONDS, check_seconds)

    def fresh(age: float | None) -> bool:
        return age is not None and age < freshness

    if deciding:  # whatever the last read: the trainer may have written its last record since
        return Reads(progress=True, listing=True)
    if workers_ending and not fresh(progress_age):  # a stopping worker saves, then writes its last record
        return Reads(progress=True, listing=not view.listed)
    progress = workers_running and not fresh(progress_age)
    return Reads(progress=progress, listing=progress and not view.listed)


def workers_ending(job: JobMemory | None) -> bool:
    """A worker of the job was seen stopping or gone in the last ENDING_READ_SECONDS."""
    since = job.ending_since if job is not None else None
    if since is None:
        return False
    if time.monotonic() - since > ENDING_READ_SECONDS:
        assert job is not None
        job.ending_since = None
        return False
    return True


def just_stopped(status: api.TrainingJobStatus) -> bool:
    """Suspended or queued (a preemption) in the last ENDING_READ_SECONDS: the workers stopped by it
    save and write their last records meanwhile, whatever pod events the operator saw."""
    started = parse_time(status.stage_start_time)
    if status.stage not in ("Suspended", "Queued") or started is None:
        return False
    return (datetime.now(UTC) - started).total_seconds() < ENDING_READ_SECONDS


def _age(jobset: dict[str, Any]) -> float:
    moment = parse_time(jobset["metadata"].get("creationTimestamp"))
    return (datetime.now(UTC) - moment).total_seconds() if moment else 0.0


# -- observe -----------------------------------------------------------------------------------------------


class Observer:
    """Turns a job's snapshot, its memory and the storage reads into `Observed`."""

    def __init__(
        self,
        *,
        cluster: Callable[[], Cluster],
        storage: Callable[[], Any],
        reads: BoundedReads,
        lane: Callable[[JobKey], Lane],
        check_seconds: float,
        default_queue: str | None,
    ) -> None:
        self.cluster = cluster
        self.storage = storage
        self.reads = reads
        self.lane = lane
        self.check_seconds = check_seconds
        self.default_queue = default_queue

    def observe(self, key: JobKey, job: JobMemory, tj: api.TrainingJob, snapshot: Snapshot, deciding: bool) -> Observed:
        uid = tj.metadata.get("uid")
        attempt = str(tj.status.attempt)
        pods = snapshot.pods
        ours = [p for p in pods if incarnation_uid(p) in (None, uid)]
        foreign_running = [
            p
            for p in pods
            if incarnation_uid(p) not in (None, uid) and (p.get("status") or {}).get("phase") not in POD_ENDED_PHASES
        ]
        attempt_pods = [p for p in ours if (p["metadata"].get("labels") or {}).get(LABEL_ATTEMPT) == attempt]
        workers_running = any((p.get("status") or {}).get("phase") == "Running" for p in attempt_pods)
        view, reads = self._read_storage(key, job, tj, workers_running, deciding)
        progress, error, denied = view.progress, view.error, view.denied
        facts = []
        for js in snapshot.jobsets:
            labels = js["metadata"].get("labels") or {}
            current = labels.get(LABEL_ATTEMPT) == attempt and incarnation_uid(js) == uid
            spec = js.get("spec") or {}
            live = current and not js["metadata"].get("deletionTimestamp") and not spec.get("suspend")
            refused = None
            if live and len(attempt_pods) < expected_pods(js) and _age(js) > POD_CREATION_GRACE_SECONDS:
                name = js["metadata"]["name"]  # only then can a refusal be the reason
                refused = self._slowly(job, f"refusal:{name}", self.cluster().pod_creation_refusal, key[0], name)
            admission: tuple[datetime | None, str | None] = (None, None)
            if current and labels.get(QUEUE_LABEL):
                js_uid = js["metadata"].get("uid")
                if snapshot.workloads is not None:
                    workload = snapshot.workloads.get(js_uid)
                else:
                    question = f"workload:{js_uid}:{spec.get('suspend')}"  # asked afresh when the suspension flips
                    workload = self._slowly(job, question, self.cluster().workload_of, key[0], js_uid)
                admission = workload_admission(workload) if workload else (None, None)
            facts.append(jobset_facts(js, attempt_pods if current else [], refused, admission))
        news = reads.listing or deciding or view.progress is None
        framework = frameworks.for_job(tj)
        if framework.progress_from_listing and error is None and news:  # it writes no record
            try:
                read = partial(self._framework_progress, framework, tj, view.latest_committed_step, list(facts))
                progress = self._bounded(key, tj, f"reading {tj.run_dir}", read)
                job.run = replace(view, progress=progress)
            except checkpoints.StorageError as failure:
                error, denied = str(failure), isinstance(failure, checkpoints.StoragePermissionError)
        return Observed(
            now=datetime.now(UTC),
            jobsets=tuple(facts),
            latest_committed_step=view.latest_committed_step,
            progress=progress,
            storage_error=error,
            storage_denied=denied and error is not None,
            foreign_pods=len(foreign_running),
            earlier_pods=_earlier_writers(ours, tj.status.attempt, snapshot.nodes),
            spare_pools=self._spare_pools(job, tj, snapshot, attempt_pods),
            queue_name=queue_name(tj, self.default_queue),
            nodes=self._node_facts(snapshot, facts, tj.status.in_place_round),
        )

    def _spare_pools(
        self, job: JobMemory, tj: api.TrainingJob, snapshot: Snapshot, attempt_pods: list[dict[str, Any]]
    ) -> int | None:
        """Ready pools of the job's shape that no pod holding TPU chips occupies: the nodes look free, and
        only then are their pods listed (one LIST a node, remembered a while), since the operator's
        caches hold its own pods alone and another tenant's would keep a grown attempt from scheduling."""
        if snapshot.all_nodes is None:
            return None
        hosts = slice_shape(tj.spec.tpu.accelerator, tj.spec.tpu.topology).hosts
        busy = [node for p in attempt_pods if (node := (p.get("spec") or {}).get("nodeName"))]
        pools = elastic.spare_pool_nodes(tj, snapshot.all_nodes, hosts, busy)
        names = sorted(name for pool in pools for name in pool)
        occupied = self._slowly(job, f"occupied:{','.join(names)}", self.cluster().nodes_holding_tpus, names)
        return elastic.spare_pools(pools, occupied if names else ())

    def _read_storage(
        self, key: JobKey, job: JobMemory, tj: api.TrainingJob, workers_running: bool, deciding: bool
    ) -> tuple[checkpoints.RunView, Reads]:
        view = job.run if job.run is not None else checkpoints.RunView()
        now = time.monotonic()
        reads = storage_reads(
            view,
            workers_running=workers_running,
            deciding=deciding,
            workers_ending=workers_ending(job) or just_stopped(tj.status),
            progress_age=None if job.read_at is None else now - job.read_at,
            check_seconds=self.check_seconds,
        )
        if frameworks.for_job(tj).progress_from_listing:  # no record to read: its progress is the listing's
            reads = Reads(progress=False, listing=reads.progress or reads.listing)
        if reads.progress or reads.listing:
            job.read_at = time.monotonic()

        def refresh(view: checkpoints.RunView) -> checkpoints.RunView:
            if reads.progress:
                view = checkpoints.refresh_progress(self.storage(), tj.run_dir, view)
            if reads.listing:
                view = checkpoints.refresh_latest(self.storage(), tj.run_dir, view)
            return view

        try:
            if reads.progress or reads.listing:  # bounded: a failure's decision never waits long (reads.py)
                view = self._bounded(key, tj, f"reading {tj.run_dir}", partial(refresh, view))
            view = checkpoints.with_reported_commit(view, tj.metadata.get("uid"), tj.status.attempt, reads.listing)
        except checkpoints.StorageError as failure:
            view = replace(view, error=str(failure), denied=isinstance(failure, checkpoints.StoragePermissionError))
        job.run = view
        return view, reads

    def _framework_progress(
        self, framework: frameworks.Framework, tj: api.TrainingJob, latest: int | None, facts: list[JobSetFacts]
    ) -> contract.ProgressRecord | None:
        return framework.read_progress(self.storage(), tj, latest, facts)  # the client is made in the read's thread

    def _bounded(self, key: JobKey, tj: api.TrainingJob, what: str, read: Callable[[], T]) -> T:
        """A GCS read that waits as long as the job's run may (schedule lane: news briefly)."""
        bucket, _ = checkpoints.split_gs_path(tj.run_dir)
        return self.reads.read(bucket, what, read, news=self.lane(key) == "news")

    def _node_facts(
        self, snapshot: Snapshot, jobsets: list[JobSetFacts], recorded_round: int
    ) -> dict[str, NodeFacts] | None:
        """The Nodes under the pods; beside a failed pod (or in an in-place restart round status has not
        recorded), the Lease renewals of the nodes whose pods still run (one GET each, only then: a failure
        that would count waits for them, nodes.verdict_wait)."""
        if snapshot.nodes is None:
            return None
        found = {name: nodes.node_facts(body) for name, body in snapshot.nodes.items()}
        awaited = (nodes.awaited_nodes(js.pods, js.in_place and js.in_place_round > recorded_round) for js in jobsets)
        for name in set().union(*awaited) & found.keys():
            found[name] = replace(found[name], renewed=self.cluster().node_lease_renewed(name))
        return found

    def _slowly(self, job: JobMemory, what: str, look: Callable[..., Any], *args: Any) -> Any:
        """A LIST-backed lookup, answered from memory if it was made in the last SLOW_LOOKUP_SECONDS. The
        `what` names the question (a new JobSet, a changed suspension asks afresh)."""
        found = job.lookups.get(what)
        now = time.monotonic()
        if found is None or now - found.at >= SLOW_LOOKUP_SECONDS:
            found = job.lookups[what] = Lookup(now, look(*args))
        return found.answer
