"""The operator's runtime: one reconcile of a job as observe (observe.py), decide (reconcile.py), apply (apply.py).

It holds the clients, kopf's watch-fed indexes (handlers.py), the memory of live jobs (memory.py) and
the schedule of their reconciles (schedule.py). A reconcile reads a snapshot of the caches, not the
apiserver; GCS is read only when the work says something may have changed. Everything kept per job is
dropped when the job ends or is deleted. `__main__` builds one from `RuntimeSettings` and hands it to
the handlers (`handlers.register`); tests build their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from . import api, checkpoints, policy
from .api import TERMINAL_PHASES
from .apply import IN_PLACE_AGENT_ROLE, Applier, changes_the_world, is_acting
from .facts import Actions, Event
from .jobset import InPlaceRestartAction, jobset_facts
from .kube import Cluster, Conflict, load_config
from .memory import JobMemory, Memory
from .metrics import OperatorMetrics
from .observe import (
    ENDING_CHECK_SECONDS,
    Indexes,
    Observer,
    Snapshot,
    just_stopped,
    snapshot,
    without_managed_fields,
    workers_ending,
)
from .reads import BoundedReads
from .reconcile import after_creation_refused, reconcile, release
from .resync import Resync
from .schedule import JobKey, Schedule
from .status import rfc3339, with_phase

log = logging.getLogger("tpujob")
# A conflicting status write means someone else changed the job: read and decide again, a few times.
CONFLICT_RETRIES = 3
# How often a training job's progress record is checked without other news (one GCS metadata read
# when it has not changed): the freshness of status.step, and the GCS cost of an idle job.
PROGRESS_CHECK_SECONDS = 60.0
# A training job's checks while its bucket does not answer (reads.py): one probe at a time reads it.
SLOW_STORAGE_CHECK_SECONDS = 30.0


@dataclass(frozen=True)
class RuntimeSettings:
    """What the operator's flags say about reconciling (`__main__.parse_args`)."""

    policy: policy.Policy = field(default_factory=policy.Policy)  # what a job may ask for (the chart's `policy`)
    default_queue: str | None = None  # Kueue LocalQueue for jobs without the queue label
    max_concurrent_reconciles: int = 8  # the jobs' own checks reconciled at once (schedule.py)
    progress_check_seconds: float = PROGRESS_CHECK_SECONDS
    watch_kueue_workloads: bool = False  # Kueue's Workloads in a watch-fed index (handlers.py)
    in_place_agent_role: str = IN_PLACE_AGENT_ROLE  # bound to InPlace jobs' pods (apply.py)
    in_place_restart_action: InPlaceRestartAction = "Restart"  # InPlace jobs' container restart rule (jobset.py)


class Runtime:
    """The operator's clients, caches and memory of live jobs (nothing here outlives a job)."""

    def __init__(self, settings: RuntimeSettings | None = None, metrics: OperatorMetrics | None = None) -> None:
        self.settings = settings = settings if settings is not None else RuntimeSettings()
        self.metrics = metrics if metrics is not None else OperatorMetrics(CollectorRegistry())
        self._cluster: Cluster | None = None
        self._storage: Any = None
        self.watched: set[JobKey] = set()
        self.indexes: Indexes = {}  # kopf's indexes (handlers.py), attached at the first event
        self.memory = Memory()
        self.schedule = Schedule(self.reconcile, limit=settings.max_concurrent_reconciles)
        self._executor: ThreadPoolExecutor | None = None
        self.resync = Resync(self)  # after a watch gap, drops what no longer exists (resync.py)
        self.reads = BoundedReads()  # GCS reads a reconcile waits for only so long (reads.py)
        self.observer = Observer(
            cluster=self.cluster,
            storage=self.storage,
            reads=self.reads,
            lane=self.schedule.lane,
            check_seconds=settings.progress_check_seconds,
            default_queue=settings.default_queue,
        )
        self.applier = Applier(
            self.cluster,
            on_gone=lambda: self.resync.request("404"),
            agent_role=settings.in_place_agent_role,
            restart_action=settings.in_place_restart_action,
        )

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

    # -- live jobs ---------------------------------------------------------------------------------

    def watch(self, key: JobKey) -> None:
        self.watched.add(key)

    def forget(self, key: JobKey) -> None:
        """The job ended or was deleted: keep nothing of it."""
        self.watched.discard(key)
        self.schedule.cancel(key)
        self.memory.forget(key)
        self.metrics.forget(*key)

    def remembered(self, key: JobKey) -> int:
        """How many things the runtime holds for a job (0 once it ended or was deleted)."""
        return int(key in self.watched) + int(key in self.schedule.due) + self.memory.held(key)

    def worker_ended(self, key: JobKey, pod: dict[str, Any]) -> None:
        """A worker pod of a watched job is stopping, ended or gone: what it said on the way out is kept
        (its pod may leave the cache), and its job's last records are read for a while."""
        job = self.memory.of(key)
        job.ended_pods[pod["metadata"]["name"]] = pod
        job.ending_since = time.monotonic()

    def holds_jobsets(self, key: JobKey) -> bool:
        """Whether the cache holds a JobSet labelled with the job's name (of any incarnation)."""
        return any(True for _ in self.indexes.get("jobsets", {}).get(key, ()))

    def jobs_on_node(self, node: str) -> list[JobKey]:
        """The watched jobs with a cached worker pod bound to `node`."""
        pods = cast(Mapping[JobKey, Iterable[dict[str, Any]]], self.indexes.get("pods", {}))
        return [
            key
            for key, found in pods.items()
            if key in self.watched and any((p.get("spec") or {}).get("nodeName") == node for p in found)
        ]

    def request(self, key: JobKey, delay: float = 0.0) -> None:
        if key in self.watched:
            self.schedule.request(key, delay)

    def snapshot(self, key: JobKey) -> Snapshot | None:
        """Copies of the job's cached objects and our own writes (on the event loop, which alone changes them)."""
        return snapshot(key, self.indexes, self.memory.get(key))

    # -- one reconcile -----------------------------------------------------------------------------

    async def reconcile(self, key: JobKey) -> float | None:
        """Reconcile one job (in a worker thread); the delay of its next check, None if none is due."""
        if key not in self.watched:
            self.forget(key)  # what a run that was in flight when it was forgotten left behind
            return None
        found = self.snapshot(key)
        if found is None:
            self.forget(key)
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.schedule.slots, thread_name_prefix="reconcile")
        loop = asyncio.get_running_loop()
        try:
            with self.metrics.reconciling():
                delay = await loop.run_in_executor(self._executor, self.reconcile_sync, key, found)
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
        job = self.memory.of(key)
        for _ in range(CONFLICT_RETRIES):
            try:
                return self._reconcile_once(key, job, body, snapshot)
            except Conflict as conflict:
                log.info("%s: re-reading and deciding again", conflict)
                fresh = self.cluster().get_training_job(*key)
                if fresh is None:
                    self.forget(key)
                    return None
                body = job.written = without_managed_fields(fresh)
        return 1.0

    def _reconcile_once(self, key: JobKey, job: JobMemory, body: dict[str, Any], snapshot: Snapshot) -> float | None:
        if body["metadata"].get("deletionTimestamp"):
            self.forget(key)
            return None
        uid = body["metadata"].get("uid")
        try:
            tj = api.TrainingJob.model_validate(body)
        except ValidationError as error:
            return self._release(key, job, uid, self._report_invalid(job, body, error), snapshot)
        if tj.status.phase in TERMINAL_PHASES:
            return self._release(key, job, uid, tj.status, snapshot, tj)
        # A job that breaks the policy is refused, unless its attempt already runs: that one goes on
        # (never stopped unsaved by a tightened policy), and the job is not restarted outside the policy.
        problems = policy.violations(tj, self.settings.policy)
        if problems and policy.running_attempt(tj, snapshot.jobsets) is None and not self._attempt_runs(tj):
            return self._release(key, job, uid, self._refuse_for_policy(job, body, tj, problems), snapshot, tj)
        observed = self.observer.observe(key, job, tj, snapshot, deciding=False)
        status, actions = reconcile(tj, observed)
        if changes_the_world(actions) or status.phase in TERMINAL_PHASES or actions.fresh_storage:
            # A decision reads storage afresh (the resume step, the steps lost, the final step) and is
            # made again on it.
            observed = self.observer.observe(key, job, tj, snapshot, deciding=True)
            status, actions = reconcile(tj, observed)
        if (within := policy.while_running(tj, status, actions, problems, datetime.now(UTC))) is None:
            return self._release(key, job, uid, self._refuse_for_policy(job, body, tj, problems), snapshot, tj)
        status, actions = within
        self._apply(key, job, tj, body, status, actions, observed.queue_name)
        if status.phase != tj.status.phase:
            log.info(
                "%s/%s: %s -> %s (attempt %d, step %s)", *key, tj.status.phase, status.phase, status.attempt,
                status.step,
            )  # fmt: skip
        if status.phase in TERMINAL_PHASES:
            self.applier.unbind_agent(tj)
            if actions.delete or actions.stop:  # watched until its JobSets are gone (`_release`)
                return actions.requeue_after
            self.forget(key)
            return None
        job.keep_only_attempt(tj.metadata.get("uid"), status.attempt)
        return self._next_check(job, status, actions, tj.run_dir)

    def _apply(
        self,
        key: JobKey,
        job: JobMemory,
        tj: api.TrainingJob,
        body: dict[str, Any],
        status: api.TrainingJobStatus,
        actions: Actions,
        queue: str | None,
    ) -> None:
        # Status first, on the version the decision was made from: if anyone changed the job since, the
        # write fails (Conflict) and nothing below runs. If a later step fails, the next reconcile still
        # knows the attempt it is on. Status that changed only by the goodput clock waits a while.
        body = self.applier.status(job, body, status, is_acting(actions))
        self.metrics.observe_reconcile(tj.namespace, tj.name, tj.status, status, datetime.now(UTC), tj.spec)
        # Then, in the order Actions names: the failed attempt's JobSet is gone before its replacement
        # exists; the Events come before the suspension they announce.
        self.applier.tear_down(key, job, actions)
        if actions.create_attempt is not None:
            self.applier.create(job, tj, actions.create_attempt, actions.resume_step, queue, actions.create_slices)
            if (refused := job.refused) is not None:  # what apply saw, decided on at once
                job.refused = None
                after, told = after_creation_refused(status, refused, datetime.now(UTC))
                self.applier.announce(tj, self.applier.write_status(job, body, after), told)
        self.applier.announce(tj, body, actions)

    def _release(
        self,
        key: JobKey,
        job: JobMemory,
        uid: str | None,
        status: api.TrainingJobStatus,
        snapshot: Snapshot,
        tj: api.TrainingJob | None = None,
    ) -> float | None:
        """A finished job: delete what is left of it (`reconcile.release`) and its agent's RoleBindings
        (`tj`, when it could be read); forgotten once nothing is. A finished job is reconciled only while a
        JobSet of it is cached (handlers.py), so a restarted operator does not go through every old job."""
        if tj is not None:
            self.applier.unbind_agent(tj)
        facts = tuple(jobset_facts(js, []) for js in snapshot.jobsets)
        actions = release(uid, status, facts)
        if not (actions.delete or actions.stop):
            self.forget(key)
            return None
        self.applier.tear_down(key, job, actions)
        return actions.requeue_after

    def _next_check(
        self, job: JobMemory, status: api.TrainingJobStatus, actions: Actions, run_dir: str
    ) -> float | None:
        """The reconciler's own deadline; for a training job no later than its next progress check, and
        while workers are ending, soon (their last records). While its bucket is known slow
        (reads.py), a training job's checks, which could read nothing, back off: no clock decides
        while progress is unknown, and news (a failure) does not wait for a check."""
        delay = actions.requeue_after
        check = self.settings.progress_check_seconds
        if status.stage == "Training":
            delay = min(delay if delay is not None else check, check)
        if workers_ending(job) or just_stopped(status):
            delay = min(delay if delay is not None else ENDING_CHECK_SECONDS, ENDING_CHECK_SECONDS)
        if status.stage == "Training" and delay is not None and self.reads.slow(checkpoints.split_gs_path(run_dir)[0]):
            delay = max(delay, SLOW_STORAGE_CHECK_SECONDS)
        return delay

    # -- failures the shell itself reports -----------------------------------------------------------

    def _fail(
        self, job: JobMemory, body: dict[str, Any], status: api.TrainingJobStatus, reason: str, message: str
    ) -> api.TrainingJobStatus:
        """End the job Failed for `reason`, with an Event saying why."""
        failed = with_phase(status, "Failed", reason, message, datetime.now(UTC))
        self.applier.write_status(job, body, failed)
        self.applier.post_event(body, Event("Warning", reason, message))
        return failed

    def _report_invalid(self, job: JobMemory, body: dict[str, Any], error: ValidationError) -> api.TrainingJobStatus:
        """A spec that slipped past the CRD's validation (e.g. an older CRD): report it, never crash."""
        message = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
        current = api.TrainingJobStatus.model_validate(body.get("status") or {})
        if current.phase != "Failed":
            return self._fail(job, body, current, "InvalidSpec", message)
        return current

    def _attempt_runs(self, tj: api.TrainingJob) -> bool:
        """Whether the job's current JobSet runs, read from the apiserver: a refusal releases it, and the
        cache may not show yet a JobSet that runs."""
        name = tj.status.job_set_name
        found = self.cluster().get_jobset(tj.metadata["namespace"], name) if name else None
        return found is not None and policy.running_attempt(tj, [found]) is not None

    def _refuse_for_policy(
        self, job: JobMemory, body: dict[str, Any], tj: api.TrainingJob, problems: list[str]
    ) -> api.TrainingJobStatus:
        """A job that breaks the multi-tenant policy: Failed, an Event; nothing is created for it and its
        checkpoint directory is never read. Its JobSets (if a spec change made it violate) are then
        released, its workers with their save grace (`_release`)."""
        update = {
            "stage": "Finished",
            "stage_start_time": rfc3339(datetime.now(UTC)),
            "observed_generation": tj.metadata.get("generation"),
        }
        return self._fail(job, body, tj.status.model_copy(update=update), policy.REASON, "; ".join(problems))
