"""The operator's runtime: its clients, what it remembers of live jobs, and one reconcile of a job.

The kopf handlers (handlers.py) feed it: TrainingJobs, JobSets and worker pods arrive through kopf's
watch streams into kopf indexes, and a reconcile reads a snapshot of them, not the apiserver. The
apiserver sees writes and watches; GCS is read only when the work says something may have changed
(`storage_reads`). Everything kept per job is dropped when the job ends or is deleted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar, cast

import tpujob_contract as contract
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from tpujob_contract import LABEL_ATTEMPT, QUEUE_LABEL

from . import api, checkpoints, maxtext, nodes, policy
from .facts import Actions, JobSetFacts, NodeFacts, Observed
from .jobset import (
    build_jobset,
    expected_pods,
    incarnation_uid,
    jobset_facts,
    queue_name,
    workload_admission,
)
from .kube import Cluster, Conflict, load_config
from .metrics import METRICS
from .reads import BoundedReads
from .reconcile import TERMINAL_PHASES, reconcile, release, with_creation_refused
from .resync import Resync
from .schedule import JobKey, Schedule
from .status import parse_time, rfc3339, with_phase

log = logging.getLogger("tpujob")
T = TypeVar("T")
# A conflicting status write means someone else changed the job: read and decide again, a few times.
CONFLICT_RETRIES = 3
# Refusals that only a spec change can fix; others (quota: 403, overload: 429/5xx) may pass later.
_PERMANENT_REFUSALS = (400, 422)
# How often a training job's progress record is checked without other news (one GCS metadata read
# when it has not changed): the freshness of status.step, and the GCS cost of an idle job.
PROGRESS_CHECK_SECONDS = 60.0
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
# A training job's checks while its bucket does not answer (reads.py): one probe at a time reads it.
SLOW_STORAGE_CHECK_SECONDS = 30.0
# Status that differs only in the goodput ledger's clock is written at most this often.
GOODPUT_WRITE_SECONDS = 60.0


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
    """What the operator reads of a JobSet: metadata, suspend, the pod count, the conditions."""
    spec = body.get("spec") or {}
    replicated = [
        {
            "replicas": rj.get("replicas", 1),
            "template": {"spec": {"parallelism": ((rj.get("template") or {}).get("spec") or {}).get("parallelism", 1)}},
        }
        for rj in spec.get("replicatedJobs") or []
    ]
    return {
        "metadata": without_managed_fields(body)["metadata"],
        "spec": {"suspend": spec.get("suspend"), "replicatedJobs": replicated},
        "status": {"conditions": list((body.get("status") or {}).get("conditions") or [])},
    }


def slim_workload(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a Kueue Workload: its creation time and conditions."""
    meta = body.get("metadata") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "creationTimestamp") if k in meta},
        "status": {"conditions": list((body.get("status") or {}).get("conditions") or [])},
    }


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


@dataclass
class Lookup:
    """A slow lookup's last answer and when it was made (monotonic seconds)."""

    at: float
    answer: Any


class Runtime:
    """The operator's clients and its memory of live jobs (nothing here outlives a job)."""

    def __init__(self) -> None:
        self._cluster: Cluster | None = None
        self._storage: Any = None
        self.watched: set[JobKey] = set()
        # kopf's indexes (handlers.py), keyed by job: TrainingJob bodies, JobSets, worker pods.
        self.indexes: dict[str, Mapping[JobKey, Iterable[dict[str, Any]]]] = {}
        # The last state of each worker pod that ended or was deleted: evicted, preempted or
        # garbage-collected pods leave the cache, but what they said on the way out classifies a failure.
        self.ended_pods: defaultdict[JobKey, dict[str, dict[str, Any]]] = defaultdict(dict)
        # Our own writes the watch has not delivered yet.
        self.written: dict[JobKey, dict[str, Any]] = {}  # the TrainingJob as our last status write returned it
        self.created: defaultdict[JobKey, dict[str, dict[str, Any]]] = defaultdict(dict)
        self.deleted: defaultdict[JobKey, set[str]] = defaultdict(set)
        self.runs: dict[JobKey, checkpoints.RunView] = {}  # the last GCS reads of each run directory
        self.read_at: dict[JobKey, float] = {}  # when the job's progress record was last read (monotonic)
        self.ending_since: dict[JobKey, float] = {}  # a worker was last seen stopping or gone (monotonic)
        self.lookups: dict[tuple[JobKey, str], Lookup] = {}
        self.policy = policy.Policy()  # what a job may ask for (the chart's `policy` values, as flags)
        self.default_queue: str | None = None  # Kueue LocalQueue for jobs without the queue label
        self.progress_check_seconds = PROGRESS_CHECK_SECONDS
        self.schedule = Schedule(self.reconcile)
        self._executor: ThreadPoolExecutor | None = None
        self.resync = Resync(self)  # after a watch gap, drops what no longer exists (resync.py)
        self.reads = BoundedReads()  # GCS reads a reconcile waits for only so long (reads.py)

    # -- clients -----------------------------------------------------------------------------------

    def cluster(self) -> Cluster:
        if self._cluster is None:
            load_config(pool_size=self.schedule.slots + 2)
            self._cluster = Cluster()
        return self._cluster

    def storage(self) -> Any:
        if self._storage is None:
            self._storage = checkpoints.make_client()
        return self._storage

    def close(self) -> None:
        """The operator stops: no more checks are due; reconciles in flight finish on their own."""
        for key in list(self.schedule.due):
            self.schedule.cancel(key)
        self.resync.stop()
        self.reads.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    # -- memory of jobs ----------------------------------------------------------------------------

    def watch(self, key: JobKey) -> None:
        self.watched.add(key)

    def forget(self, key: JobKey) -> None:
        """The job ended or was deleted: keep nothing of it."""
        self.watched.discard(key)
        self.schedule.cancel(key)
        memories = (
            self.ended_pods,
            self.written,
            self.created,
            self.deleted,
            self.runs,
            self.read_at,
            self.ending_since,
        )
        for memory in memories:
            memory.pop(key, None)
        for lookup in [k for k in self.lookups if k[0] == key]:
            del self.lookups[lookup]
        METRICS.forget(*key)

    def remembered(self, key: JobKey) -> int:
        """How many things the runtime holds for a job (0 once it ended or was deleted)."""
        held = int(key in self.watched) + len(self.ended_pods.get(key, {})) + int(key in self.schedule.due)
        stores = (self.written, self.created, self.deleted, self.runs, self.read_at, self.ending_since)
        return held + sum(int(key in s) for s in stores) + sum(1 for k in self.lookups if k[0] == key)

    def keep_only_attempt(self, key: JobKey, uid: str | None, attempt: int) -> None:
        """Drop remembered pods of earlier attempts and other incarnations: they decide nothing any more."""
        pods = self.ended_pods.get(key)
        if pods is None:
            return
        for name, body in list(pods.items()):
            labels = body["metadata"].get("labels") or {}
            owner = incarnation_uid(body)
            if labels.get(LABEL_ATTEMPT) != str(attempt) or (owner is not None and owner != uid):
                del pods[name]
        if not pods:
            del self.ended_pods[key]

    def holds_jobsets(self, key: JobKey) -> bool:
        """Whether the cache holds a JobSet labelled with the job's name (of any incarnation)."""
        return any(True for _ in self.indexes.get("jobsets", {}).get(key, ()))

    def request(self, key: JobKey, delay: float = 0.0) -> None:
        if key in self.watched:
            self.schedule.request(key, delay)

    # -- one reconcile -----------------------------------------------------------------------------

    def snapshot(self, key: JobKey) -> Snapshot | None:
        """Copies of the job's cached objects (taken on the event loop, which alone changes them)."""
        cached_bodies = list(self.indexes.get("trainingjobs", {}).get(key, ()))
        body = newest(*cached_bodies, self.written.get(key))
        if body is None:
            return None
        if key in self.written and body is not self.written[key]:
            del self.written[key]  # the watch caught up with our write
        cached_jobsets = list(self.indexes.get("jobsets", {}).get(key, ()))
        names = {js["metadata"]["name"] for js in cached_jobsets}
        created, deleted = self.created.get(key, {}), self.deleted.get(key, set())
        for name in [n for n in created if n in names]:
            del created[name]  # the watch has it now
        deleted &= names  # gone from the cache: nothing left to hide
        jobsets = merged_jobsets(cached_jobsets, created, deleted)
        live = {p["metadata"]["name"]: p for p in self.indexes.get("pods", {}).get(key, ())}
        pods = list({**self.ended_pods.get(key, {}), **live}.values())
        workloads = None
        if "workloads" in self.indexes:
            queued = [
                js["metadata"].get("uid") for js in jobsets if QUEUE_LABEL in (js["metadata"].get("labels") or {})
            ]
            workloads = {uid: _newest_workload(self.indexes["workloads"].get(uid, ())) for uid in queued if uid}
        return Snapshot(key, dict(body), jobsets, pods, workloads, self._nodes_under(pods))

    def _nodes_under(self, pods: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
        """The cached Nodes the pods are bound to (only those: the index holds every node of the cluster)."""
        if "nodes" not in self.indexes:
            return None
        bound = {str(node) for p in pods if (node := (p.get("spec") or {}).get("nodeName"))}
        index = cast(Mapping[str, Iterable[dict[str, Any]]], self.indexes["nodes"])  # keyed by node name
        found = {name: next(iter(index.get(name, ())), None) for name in bound}
        return {name: body for name, body in found.items() if body is not None}

    async def reconcile(self, key: JobKey) -> float | None:
        """Reconcile one job (in a worker thread); the delay of its next check, None if none is due."""
        if key not in self.watched:
            self.forget(key)  # what a run that was in flight when it was forgotten left behind
            return None
        snapshot = self.snapshot(key)
        if snapshot is None:
            self.forget(key)
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.schedule.slots, thread_name_prefix="reconcile")
        loop = asyncio.get_running_loop()
        try:
            with METRICS.reconciling():
                delay = await loop.run_in_executor(self._executor, self.reconcile_sync, key, snapshot)
        except Exception:
            if key in self.watched:
                raise
            delay = None  # deleted while it ran (its status write found nothing): nothing to retry
        if key not in self.watched:  # deleted or ended while it ran: keep nothing it remembered
            self.forget(key)
            return None
        return delay

    def reconcile_sync(self, key: JobKey, snapshot: Snapshot) -> float | None:
        body = snapshot.body
        for _ in range(CONFLICT_RETRIES):
            try:
                return self._reconcile_once(key, body, snapshot)
            except Conflict as conflict:
                log.info("%s: re-reading and deciding again", conflict)
                fresh = self.cluster().get_training_job(*key)
                if fresh is None:
                    self.forget(key)
                    return None
                body = self.written[key] = fresh
        return 1.0

    def _reconcile_once(self, key: JobKey, body: dict[str, Any], snapshot: Snapshot) -> float | None:
        if body["metadata"].get("deletionTimestamp"):
            self.forget(key)
            return None
        uid = body["metadata"].get("uid")
        try:
            tj = api.TrainingJob.model_validate(body)
        except ValidationError as error:
            return self._release(key, uid, self._report_invalid(key, body, error), snapshot)
        if tj.status.phase in TERMINAL_PHASES:
            return self._release(key, uid, tj.status, snapshot)
        # A job that breaks the policy is refused, unless its attempt already runs: that one goes on
        # (never stopped unsaved by a tightened policy), and the job is not restarted outside the policy.
        problems = policy.violations(tj, self.policy)
        if problems and policy.running_attempt(tj, snapshot.jobsets) is None:
            return self._release(key, uid, self._refuse_for_policy(key, body, tj, problems), snapshot)
        observed = self._observe(key, tj, snapshot, deciding=False)
        status, actions = reconcile(tj, observed)
        if _changes_the_world(actions) or status.phase in TERMINAL_PHASES or actions.fresh_storage:
            # A decision reads storage afresh (the resume step, the steps lost, the final step) and is
            # made again on it.
            observed = self._observe(key, tj, snapshot, deciding=True)
            status, actions = reconcile(tj, observed)
        if (within := policy.while_running(tj, status, actions, problems, datetime.now(UTC))) is None:
            return self._release(key, uid, self._refuse_for_policy(key, body, tj, problems), snapshot)
        status, actions = within
        self._apply(key, tj, body, status, actions, observed.queue_name)
        if status.phase != tj.status.phase:
            log.info(
                "%s/%s: %s -> %s (attempt %d, step %s)", *key, tj.status.phase, status.phase, status.attempt,
                status.step,
            )  # fmt: skip
        if status.phase in TERMINAL_PHASES:
            if actions.delete or actions.stop:  # watched until its JobSets are gone (`_release`)
                return actions.requeue_after
            self.forget(key)
            return None
        self.keep_only_attempt(key, tj.metadata.get("uid"), status.attempt)
        return self._next_check(status, actions, snapshot, tj.run_dir)

    def _release(self, key: JobKey, uid: str | None, status: api.TrainingJobStatus, snapshot: Snapshot) -> float | None:
        """A finished job: delete what is left of it (`reconcile.release`); forgotten once nothing is."""
        facts = tuple(jobset_facts(js, []) for js in snapshot.jobsets)
        actions = release(uid, status, facts)
        if not (actions.delete or actions.stop):
            self.forget(key)
            return None
        self._tear_down(key, actions)
        return actions.requeue_after

    def _next_check(
        self, status: api.TrainingJobStatus, actions: Actions, snapshot: Snapshot, run_dir: str
    ) -> float | None:
        """The reconciler's own deadline; for a training job no later than its next progress check, and
        while workers are ending, soon (their last records). While its bucket is known slow
        (reads.py), a training job's checks, which could read nothing, back off: no clock decides
        while progress is unknown, and news (a failure) does not wait for a check."""
        delay = actions.requeue_after
        if status.stage == "Training":
            delay = min(delay if delay is not None else self.progress_check_seconds, self.progress_check_seconds)
        if self._workers_ending(snapshot.key) or _just_stopped(status):
            delay = min(delay if delay is not None else ENDING_CHECK_SECONDS, ENDING_CHECK_SECONDS)
        if status.stage == "Training" and delay is not None and self.reads.slow(checkpoints.split_gs_path(run_dir)[0]):
            delay = max(delay, SLOW_STORAGE_CHECK_SECONDS)
        return delay

    def _workers_ending(self, key: JobKey) -> bool:
        since = self.ending_since.get(key)
        if since is None:
            return False
        if time.monotonic() - since > ENDING_READ_SECONDS:
            del self.ending_since[key]
            return False
        return True

    def worker_ending(self, key: JobKey) -> None:
        """A worker pod of the job is stopping, ended or gone."""
        self.ending_since[key] = time.monotonic()

    # -- observe -----------------------------------------------------------------------------------

    def _read_storage(
        self, key: JobKey, tj: api.TrainingJob, workers_running: bool, deciding: bool
    ) -> tuple[checkpoints.RunView, Reads]:
        view = self.runs.get(key, checkpoints.RunView())
        now = time.monotonic()
        read_at = self.read_at.get(key)
        reads = storage_reads(
            view,
            workers_running=workers_running,
            deciding=deciding,
            workers_ending=self._workers_ending(key) or _just_stopped(tj.status),
            progress_age=None if read_at is None else now - read_at,
            check_seconds=self.progress_check_seconds,
        )
        if tj.spec.framework == maxtext.FRAMEWORK:  # MaxText's progress is read from the listing
            reads = Reads(progress=False, listing=reads.progress or reads.listing)
        if reads.progress or reads.listing:  # (MaxText's progress is its listing)
            self.read_at[key] = time.monotonic()

        def refresh(view: checkpoints.RunView) -> checkpoints.RunView:
            if reads.progress:
                view = checkpoints.refresh_progress(self.storage(), tj.run_dir, view)
            if reads.listing:
                view = checkpoints.refresh_latest(self.storage(), tj.run_dir, view)
            return view

        try:
            if reads.progress or reads.listing:  # bounded: a failure's decision never waits long (reads.py)
                view = self._bounded(tj, f"reading {tj.run_dir}", partial(refresh, view), key)
            view = checkpoints.with_reported_commit(view, tj.metadata.get("uid"), tj.status.attempt, reads.listing)
        except checkpoints.StorageError as failure:
            view = replace(view, error=str(failure), denied=isinstance(failure, checkpoints.StoragePermissionError))
        self.runs[key] = view
        return view, reads

    def _maxtext_progress(
        self, tj: api.TrainingJob, latest: int | None, facts: list[JobSetFacts]
    ) -> contract.ProgressRecord | None:
        return maxtext.read_progress(self.storage(), tj, latest, facts)

    def _bounded(self, tj: api.TrainingJob, what: str, read: Callable[[], T], key: JobKey) -> T:
        """A GCS read that waits as long as the job's run may (schedule lane: news briefly)."""
        bucket, _ = checkpoints.split_gs_path(tj.run_dir)
        return self.reads.read(bucket, what, read, news=self.schedule.lane(key) == "news")

    def _observe(self, key: JobKey, tj: api.TrainingJob, snapshot: Snapshot, deciding: bool) -> Observed:
        uid = tj.metadata.get("uid")
        attempt = str(tj.status.attempt)
        pods = snapshot.pods
        ours = [p for p in pods if incarnation_uid(p) in (None, uid)]
        foreign_running = [
            p
            for p in pods
            if incarnation_uid(p) not in (None, uid)
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        attempt_pods = [p for p in ours if (p["metadata"].get("labels") or {}).get(LABEL_ATTEMPT) == attempt]
        workers_running = any((p.get("status") or {}).get("phase") == "Running" for p in attempt_pods)
        view, reads = self._read_storage(key, tj, workers_running, deciding)
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
                refused = self._slowly(key, f"refusal:{name}", self.cluster().pod_creation_refusal, key[0], name)
            admission: tuple[datetime | None, str | None] = (None, None)
            if current and labels.get(QUEUE_LABEL):
                js_uid = js["metadata"].get("uid")
                if snapshot.workloads is not None:
                    workload = snapshot.workloads.get(js_uid)
                else:
                    question = f"workload:{js_uid}:{spec.get('suspend')}"  # asked afresh when the suspension flips
                    workload = self._slowly(key, question, self.cluster().workload_of, key[0], js_uid)
                admission = workload_admission(workload) if workload else (None, None)
            facts.append(jobset_facts(js, attempt_pods if current else [], refused, admission))
        maxtext_news = reads.listing or deciding or view.progress is None
        if tj.spec.framework == maxtext.FRAMEWORK and error is None and maxtext_news:  # it writes no record
            try:
                read = partial(self._maxtext_progress, tj, view.latest_committed_step, list(facts))
                progress = self._bounded(tj, f"reading {tj.run_dir}", read, key)
                self.runs[key] = replace(view, progress=progress)
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
            queue_name=queue_name(tj, self.default_queue),
            nodes=self._node_facts(snapshot, facts),
        )

    def _node_facts(self, snapshot: Snapshot, jobsets: list[JobSetFacts]) -> dict[str, NodeFacts] | None:
        """The Nodes under the pods; beside a failed pod, the Lease renewals of the nodes whose pods still
        run (one GET each, only then: a failure that would count waits for them, nodes.verdict_wait)."""
        if snapshot.nodes is None:
            return None
        found = {name: nodes.node_facts(body) for name, body in snapshot.nodes.items()}
        for name in set().union(*(nodes.awaited_nodes(js.pods) for js in jobsets)) & found.keys():
            found[name] = replace(found[name], renewed=self.cluster().node_lease_renewed(name))
        return found

    def _slowly(self, key: JobKey, what: str, look: Callable[..., Any], *args: Any) -> Any:
        """A LIST-backed lookup, answered from memory if it was made in the last SLOW_LOOKUP_SECONDS. The
        `what` names the question (a new JobSet, a changed suspension asks afresh)."""
        found = self.lookups.get((key, what))
        now = time.monotonic()
        if found is None or now - found.at >= SLOW_LOOKUP_SECONDS:
            found = self.lookups[(key, what)] = Lookup(now, look(*args))
        return found.answer

    # -- apply -------------------------------------------------------------------------------------

    def _write_status(self, key: JobKey, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        try:
            written = self.written[key] = self.cluster().replace_status(body, status)
        except ApiException as error:
            if error.status == 404:  # deleted, perhaps in a watch gap: the resync forgets it (and what it left)
                self.resync.request("404")
            raise
        return written

    def _apply(
        self,
        key: JobKey,
        tj: api.TrainingJob,
        body: dict[str, Any],
        status: api.TrainingJobStatus,
        actions: Actions,
        queue: str | None,
    ) -> None:
        kube = self.cluster()
        # Status first, on the version the decision was made from: if anyone changed the job since, the
        # write fails (Conflict) and nothing below runs. If a later step fails, the next reconcile still
        # knows the attempt it is on. Status that changed only by the goodput clock waits a while.
        if status_worth_writing(body.get("status") or {}, _dump(status), _is_acting(actions)):
            body = self._write_status(key, body, _dump(status))
        METRICS.observe_reconcile(tj.namespace, tj.name, tj.status, status, datetime.now(UTC))
        self._tear_down(key, actions)
        if actions.create_attempt is not None:
            manifest = build_jobset(tj, actions.create_attempt, actions.resume_step, queue)
            try:
                name = manifest["metadata"]["name"]
                created = kube.create_jobset(tj.namespace, manifest)
                if created is None:  # one of that name exists: ours only if it carries this job's uid
                    created = kube.get_jobset(tj.namespace, name)
                    owner = incarnation_uid(created) if created is not None else None
                    if created is not None and owner != tj.metadata.get("uid"):
                        message = f"a JobSet named {name} already exists and is not this TrainingJob's " + (
                            f"(it belongs to TrainingJob uid {owner})" if owner else "(no TrainingJob owns it)"
                        )
                        refused = with_creation_refused(status, message, False, datetime.now(UTC))
                        self._write_status(key, body, _dump(refused))
                        self._post_event(body, "Warning", "JobSetRefused", message)
                        created = None
                    elif created is not None:
                        log.info("JobSet %s already exists (adopted: it carries this job's uid)", name)
                if created is not None:
                    self.created[key][name] = slim_jobset(created)
            except ApiException as error:
                if error.status is None or error.status >= 500 or error.status == 429:
                    raise
                message = _refusal_message(error)
                refused = with_creation_refused(status, message, error.status in _PERMANENT_REFUSALS, datetime.now(UTC))
                self._write_status(key, body, _dump(refused))
                self._post_event(body, "Warning", "JobSetRefused", message)
        # Events before the suspension they announce: an operator that dies after the status write
        # leaves it undone, and the next reconcile (or replica) decides it again, Event included.
        for event in actions.events:
            self._post_event(body, event.type, event.reason, event.message)
        if actions.set_suspend is not None:
            kube.set_jobset_suspend(tj.namespace, *actions.set_suspend)

    def _tear_down(self, key: JobKey, actions: Actions) -> None:
        kube = self.cluster()
        for name in actions.delete:
            kube.delete_jobset(key[0], name)
            self.deleted[key].add(name)
        for name in actions.stop:
            kube.delete_jobset(key[0], name, save=True)
            self.deleted[key].add(name)

    def _post_event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Events are told, never required: one that cannot be posted (a namespace being deleted, an
        overloaded apiserver) is logged and the reconcile goes on."""
        try:
            self.cluster().post_event(body, type_, reason, message)
        except ApiException as error:
            log.warning(
                "%s/%s: Event %s not posted: %s",
                body["metadata"].get("namespace"),
                body["metadata"]["name"],
                reason,
                error.reason,
            )

    def _fail(
        self, key: JobKey, body: dict[str, Any], status: api.TrainingJobStatus, reason: str, message: str
    ) -> api.TrainingJobStatus:
        """End the job Failed for `reason`, with an Event saying why."""
        failed = with_phase(status, "Failed", reason, message, datetime.now(UTC))
        self._write_status(key, body, _dump(failed))
        self._post_event(body, "Warning", reason, message)
        return failed

    def _report_invalid(self, key: JobKey, body: dict[str, Any], error: ValidationError) -> api.TrainingJobStatus:
        """A spec that slipped past the CRD's validation (e.g. an older CRD): report it, never crash."""
        message = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
        current = api.TrainingJobStatus.model_validate(body.get("status") or {})
        if current.phase != "Failed":
            return self._fail(key, body, current, "InvalidSpec", message)
        return current

    def _refuse_for_policy(
        self, key: JobKey, body: dict[str, Any], tj: api.TrainingJob, problems: list[str]
    ) -> api.TrainingJobStatus:
        """A job that breaks the multi-tenant policy: Failed, an Event; nothing is created for it and its
        checkpoint directory is never read. Its JobSets (if a spec change made it violate) are then
        released, its workers with their save grace (`_release`)."""
        update = {
            "stage": "Finished",
            "stage_start_time": rfc3339(datetime.now(UTC)),
            "observed_generation": tj.metadata.get("generation"),
        }
        return self._fail(key, body, tj.status.model_copy(update=update), policy.REASON, "; ".join(problems))


def _just_stopped(status: api.TrainingJobStatus) -> bool:
    """Suspended or queued (a preemption) in the last ENDING_READ_SECONDS: the workers stopped by it
    save and write their last records meanwhile, whatever pod events the operator saw."""
    started = parse_time(status.stage_start_time)
    if status.stage not in ("Suspended", "Queued") or started is None:
        return False
    return (datetime.now(UTC) - started).total_seconds() < ENDING_READ_SECONDS


def _newest_workload(workloads: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    return max(workloads, key=lambda w: str(w["metadata"].get("creationTimestamp", "")), default=None)


def _age(jobset: dict[str, Any]) -> float:
    moment = parse_time(jobset["metadata"].get("creationTimestamp"))
    return (datetime.now(UTC) - moment).total_seconds() if moment else 0.0


def _changes_the_world(actions: Actions) -> bool:
    return bool(actions.create_attempt is not None or actions.delete or actions.stop or actions.set_suspend)


def _is_acting(actions: Actions) -> bool:
    return _changes_the_world(actions) or bool(actions.events)


def status_worth_writing(stored: dict[str, Any], decided: dict[str, Any], acting: bool) -> bool:
    """Write a changed status, except one that changed only by the goodput ledger's clock while that
    was written less than GOODPUT_WRITE_SECONDS ago (the next write accounts for the time between:
    the ledger advances from what is stored)."""
    if stored == decided:
        return False
    if acting or {k: v for k, v in stored.items() if k != "goodput"} != {
        k: v for k, v in decided.items() if k != "goodput"
    }:
        return True
    before = parse_time((stored.get("goodput") or {}).get("updatedAt"))
    after = parse_time((decided.get("goodput") or {}).get("updatedAt"))
    return before is None or after is None or (after - before).total_seconds() >= GOODPUT_WRITE_SECONDS


def _refusal_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except (TypeError, ValueError):
        return str(error.reason or error)


def _dump(status: api.TrainingJobStatus) -> dict[str, Any]:
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")
