"""Thin kopf handlers: gather facts, call the pure reconciler, apply its actions.

Every trigger (a new or changed TrainingJob, the initial listing after an operator restart, a JobSet
event, a worker pod event, the periodic poller) runs the same level-triggered `reconcile_job`,
serialised per TrainingJob by a lock. Everything the operator keeps between reconciles lives in one
`Runtime` and is dropped when the job ends or is deleted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from . import api, checkpoints, maxtext, policy
from .facts import Actions, Observed
from .jobset import LABEL_ATTEMPT, LABEL_NAME, build_jobset, queue_name
from .kube import Cluster, Conflict, expected_pods, incarnation_uid, jobset_facts, load_config, workload_admission
from .metrics import METRICS
from .reconcile import POLL_SECONDS, TERMINAL_PHASES, reconcile, with_creation_refused
from .status import rfc3339, with_phase

log = logging.getLogger("tpujob")
JobKey = tuple[str, str]  # (namespace, name)
# A conflicting status write means someone else changed the job: read and decide again, a few times.
CONFLICT_RETRIES = 3
# Refusals that only a spec change can fix; others (quota: 403, overload: 429/5xx) may pass later.
_PERMANENT_REFUSALS = (400, 422)


class Runtime:
    """The operator's clients and its memory of live jobs (nothing here outlives a job)."""

    def __init__(self) -> None:
        self._cluster: Cluster | None = None
        self._storage: Any = None
        self.locks: defaultdict[JobKey, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.watched: set[JobKey] = set()
        # The last state of each worker pod that ended or is being deleted. Evicted, preempted or
        # garbage-collected pods are often gone from the API by the time the failure is handled;
        # what they said on the way out is what classifies it.
        self.ended_pods: defaultdict[JobKey, dict[str, dict[str, Any]]] = defaultdict(dict)
        self.wakeups: dict[JobKey, asyncio.TimerHandle] = {}  # reconciles due before the next poll
        self.policy = policy.Policy()  # what a job may ask for (the chart's `policy` values, as flags)
        self.default_queue: str | None = None  # Kueue LocalQueue for jobs without the queue label

    def cluster(self) -> Cluster:
        if self._cluster is None:
            load_config()
            self._cluster = Cluster()
        return self._cluster

    def storage(self) -> Any:
        if self._storage is None:
            self._storage = checkpoints.make_client()
        return self._storage

    def forget(self, key: JobKey) -> None:
        """The job ended or was deleted: keep nothing of it."""
        self.watched.discard(key)
        self.ended_pods.pop(key, None)
        self.locks.pop(key, None)
        self.wakeups.pop(key, None)  # (may run in a worker thread: a wake-up left armed finds the job gone)
        METRICS.forget(*key)

    def remembered(self, key: JobKey) -> int:
        """How many things the runtime holds for a job (0 once it ended or was deleted)."""
        held = int(key in self.watched) + len(self.ended_pods.get(key, {})) + int(key in self.locks)
        return held + int(key in self.wakeups)

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


RUNTIME = Runtime()


def reset_clients() -> None:
    """Start from nothing (tests run the operator against fresh endpoints)."""
    global RUNTIME
    RUNTIME = Runtime()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Watches reconnect regularly and API calls cannot hang: a silent network drop costs minutes, not hours.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    # Only problems become Events from logs; the reconciler posts its own Events for transitions.
    settings.posting.level = logging.WARNING
    RUNTIME.locks.clear()  # locks belong to the previous event loop, if any


@kopf.on.probe(id="reconciles")
def liveness(**_: Any) -> int:
    return len(RUNTIME.watched)


def _read_storage(tj: api.TrainingJob) -> tuple[int | None, Any, str | None]:
    try:
        client = RUNTIME.storage()
        latest = checkpoints.latest_committed_step(client, tj.run_dir)
        return latest, checkpoints.read_progress(client, tj.run_dir), None
    except checkpoints.StorageError as failure:
        return None, None, str(failure)


def _observe(tj: api.TrainingJob, raw_jobsets: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Observed:
    uid = tj.metadata.get("uid")
    latest, progress, error = _read_storage(tj)
    attempt = str(tj.status.attempt)
    ours = [p for p in pods if incarnation_uid(p) in (None, uid)]
    foreign_running = [
        p
        for p in pods
        if incarnation_uid(p) not in (None, uid) and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]
    attempt_pods = [p for p in ours if (p["metadata"].get("labels") or {}).get(LABEL_ATTEMPT) == attempt]
    facts = []
    for js in raw_jobsets:
        labels = js["metadata"].get("labels") or {}
        current = labels.get(LABEL_ATTEMPT) == attempt and incarnation_uid(js) == uid
        refused = None
        live = current and not js["metadata"].get("deletionTimestamp") and not (js.get("spec") or {}).get("suspend")
        if live and len(attempt_pods) < expected_pods(js):  # only then can a refusal be the reason
            refused = RUNTIME.cluster().pod_creation_refusal(tj.namespace, js["metadata"]["name"])
        admission: tuple[datetime | None, str | None] = (None, None)
        if current and labels.get(api.QUEUE_LABEL):
            workload = RUNTIME.cluster().workload_of(tj.namespace, js["metadata"]["uid"])
            admission = workload_admission(workload) if workload else (None, None)
        facts.append(jobset_facts(js, attempt_pods if current else [], refused, admission))
    if tj.spec.framework == maxtext.FRAMEWORK and error is None:  # MaxText writes no progress record
        try:
            progress = maxtext.read_progress(RUNTIME.storage(), tj, latest, facts)
        except checkpoints.StorageError as failure:
            error = str(failure)
    return Observed(
        now=datetime.now(UTC),
        jobsets=tuple(facts),
        latest_committed_step=latest,
        progress=progress,
        storage_error=error,
        foreign_pods=len(foreign_running),
        queue_name=queue_name(tj, RUNTIME.default_queue),
    )


def _refusal_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except (TypeError, ValueError):
        return str(error.reason or error)


def _dump(status: api.TrainingJobStatus) -> dict[str, Any]:
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")


def _apply(tj: api.TrainingJob, body: dict[str, Any], status: api.TrainingJobStatus, actions: Actions) -> None:
    kube = RUNTIME.cluster()
    # Status first, on the version the decision was made from: if anyone changed the job since, the
    # write fails (Conflict) and nothing below runs. If a later step fails, the next reconcile still
    # knows the attempt it is on. Unchanged status is not written, so idle jobs cost only reads.
    if _dump(status) != (body.get("status") or {}):
        body = kube.replace_status(body, _dump(status))
    METRICS.observe_reconcile(tj.namespace, tj.name, tj.status, status, datetime.now(UTC))  # the decision is stored
    for name in actions.delete:
        kube.delete_jobset(tj.namespace, name)
    for name in actions.stop:
        kube.delete_jobset(tj.namespace, name, save=True)
    if actions.create_attempt is not None:
        queue = queue_name(tj, RUNTIME.default_queue)
        manifest = build_jobset(tj, actions.create_attempt, actions.resume_step, queue)
        try:
            if not kube.create_jobset(tj.namespace, manifest):
                log.info("JobSet %s already exists (adopted)", manifest["metadata"]["name"])
        except ApiException as error:
            if error.status is None or error.status >= 500 or error.status == 429:
                raise
            message = _refusal_message(error)
            refused = with_creation_refused(status, message, error.status in _PERMANENT_REFUSALS, datetime.now(UTC))
            kube.replace_status(body, _dump(refused))
            kube.post_event(body, "Warning", "JobSetRefused", message)
    if actions.set_suspend is not None:
        kube.set_jobset_suspend(tj.namespace, *actions.set_suspend)
    for event in actions.events:
        kube.post_event(body, event.type, event.reason, event.message)


def _report_invalid(body: dict[str, Any], error: ValidationError) -> None:
    """A spec that slipped past the CRD's validation (e.g. an older CRD): report it, never crash."""
    message = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
    current = api.TrainingJobStatus.model_validate(body.get("status") or {})
    if current.phase == "Failed":
        return
    status = with_phase(current, "Failed", "InvalidSpec", message, datetime.now(UTC))
    RUNTIME.cluster().replace_status(body, _dump(status))
    RUNTIME.cluster().post_event(body, "Warning", "InvalidSpec", message)


def _refuse_for_policy(body: dict[str, Any], tj: api.TrainingJob, problems: list[str]) -> None:
    """A job that breaks the multi-tenant policy: Failed, an Event, its JobSets (if a spec change
    made it violate) deleted; nothing is created for it and its checkpoint directory is never read."""
    kube = RUNTIME.cluster()
    message = "; ".join(problems)
    now = datetime.now(UTC)
    status = with_phase(tj.status, "Failed", policy.REASON, message, now)
    update = {
        "stage": "Finished",
        "stage_start_time": rfc3339(now),
        "observed_generation": tj.metadata.get("generation"),
    }
    status = status.model_copy(update=update)
    kube.replace_status(body, _dump(status))
    kube.post_event(body, "Warning", policy.REASON, message)
    for js in kube.list_jobsets(tj.namespace, tj.name):
        if incarnation_uid(js) == tj.metadata.get("uid") and not js["metadata"].get("deletionTimestamp"):
            kube.delete_jobset(tj.namespace, js["metadata"]["name"])


def _reconcile_once(namespace: str, name: str) -> float | None:
    kube = RUNTIME.cluster()
    key = (namespace, name)
    body = kube.get_training_job(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        RUNTIME.forget(key)
        return None
    try:
        tj = api.TrainingJob.model_validate(body)
    except ValidationError as error:
        _report_invalid(body, error)
        RUNTIME.forget(key)
        return None
    if tj.status.phase in TERMINAL_PHASES:
        RUNTIME.forget(key)
        return None
    if problems := policy.violations(tj, RUNTIME.policy):
        _refuse_for_policy(body, tj, problems)
        RUNTIME.forget(key)
        return None
    raw_jobsets = kube.list_jobsets(namespace, name)
    listed = {p["metadata"]["name"]: p for p in kube.list_pods(namespace, name)}
    pods = list({**RUNTIME.ended_pods.get(key, {}), **listed}.values())
    status, actions = reconcile(tj, _observe(tj, raw_jobsets, pods))
    _apply(tj, body, status, actions)
    if status.phase != tj.status.phase:
        log.info(
            "%s/%s: %s -> %s (attempt %d, step %s)", namespace, name, tj.status.phase, status.phase, status.attempt,
            status.step,
        )  # fmt: skip
    if status.phase in TERMINAL_PHASES:
        RUNTIME.forget(key)
    else:
        RUNTIME.keep_only_attempt(key, tj.metadata.get("uid"), status.attempt)
    return actions.requeue_after


def reconcile_sync(namespace: str, name: str) -> float | None:
    for _ in range(CONFLICT_RETRIES):
        try:
            return _reconcile_once(namespace, name)
        except Conflict as conflict:
            log.info("%s: re-reading and deciding again", conflict)
    return 1.0


async def reconcile_job(namespace: str, name: str) -> float | None:
    async with RUNTIME.locks[(namespace, name)]:
        with METRICS.reconciling():
            requeue = await asyncio.to_thread(reconcile_sync, namespace, name)
    _schedule(namespace, name, requeue)
    return requeue


_running: set[asyncio.Future[None]] = set()


def _schedule(namespace: str, name: str, requeue: float | None) -> None:
    """A decision due sooner than the next poll (a backoff that ends in 1 s) is re-examined then,
    not up to a poll interval late; one pending wake-up per job, dropped with the job."""
    key = (namespace, name)
    if requeue is None or requeue >= POLL_SECONDS / 2 or key not in RUNTIME.watched:
        return
    pending = RUNTIME.wakeups.pop(key, None)
    if pending is not None:
        pending.cancel()

    def wake() -> None:
        if RUNTIME.wakeups.pop(key, None) is not None and key in RUNTIME.watched:
            task = asyncio.ensure_future(_reconcile_logged(namespace, name))
            _running.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(_running.discard)

    RUNTIME.wakeups[key] = asyncio.get_running_loop().call_later(max(requeue, 0.05), wake)


async def _reconcile_logged(namespace: str, name: str) -> None:
    try:
        await reconcile_job(namespace, name)
    except Exception:  # a wake-up's failure is the poller's to retry
        log.exception("reconcile of %s/%s failed", namespace, name)


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
async def on_training_job(
    type: str, namespace: str | None, name: str, status: kopf.Status, meta: kopf.Meta, **_: Any
) -> None:
    # Event handlers, not create/update/timer handlers: those make kopf put a finalizer on every
    # TrainingJob, and deleting one would then hang while the operator is down. Cleanup needs no
    # finalizer here: the JobSet is owned and garbage-collected.
    key = (namespace or "default", name)
    if type == "DELETED":
        RUNTIME.forget(key)
        return
    if status.get("phase") in TERMINAL_PHASES:
        return
    RUNTIME.watched.add(key)
    # New, seen at start-up (type None: the initial listing) or spec changed: reconcile now.
    # Status-only changes (our own writes) wait for the poller.
    if type in (None, "ADDED") or meta.get("generation") != status.get("observedGeneration"):
        await reconcile_job(*key)


@kopf.on.event("jobset.x-k8s.io", "v1alpha2", "jobsets", labels={LABEL_NAME: kopf.PRESENT})
async def on_jobset_event(type: str, namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    # A JobSet changed (e.g. it failed): react now rather than at the next poll.
    key = (namespace or "", labels[LABEL_NAME])
    if type in ("MODIFIED", "DELETED") and namespace and key in RUNTIME.watched:
        await reconcile_job(*key)


@kopf.on.event("", "v1", "pods", labels={LABEL_NAME: kopf.PRESENT, LABEL_ATTEMPT: kopf.PRESENT})
async def on_worker_pod_event(type: str, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    status = body.get("status") or {}
    disrupted = any(c.get("type") == "DisruptionTarget" for c in status.get("conditions") or [])
    ended = status.get("phase") in ("Failed", "Succeeded") or disrupted or body["metadata"].get("deletionTimestamp")
    key = (namespace or "", labels[LABEL_NAME])
    # Only live jobs are remembered: pods of finished or deleted jobs must not accumulate.
    if namespace and key in RUNTIME.watched and (ended or type == "DELETED"):
        RUNTIME.ended_pods[key][body["metadata"]["name"]] = dict(body)
        if status.get("phase") == "Failed":  # a worker died: react now, not at the next poll
            await reconcile_job(*key)


async def _poll_forever() -> None:
    """Re-examine every live TrainingJob regularly: progress, clocks, backoff expiry, new checkpoints."""
    while True:
        await asyncio.sleep(POLL_SECONDS / 2)
        for namespace, name in sorted(RUNTIME.watched):
            try:
                await reconcile_job(namespace, name)
            except Exception:  # one job's trouble must not stop the others from being polled
                log.exception("reconcile of %s/%s failed", namespace, name)


_poller: asyncio.Task[None] | None = None


@kopf.on.startup()
async def start_poller(**_: Any) -> None:
    global _poller
    _poller = asyncio.get_running_loop().create_task(_poll_forever(), name="tpujob-poller")


@kopf.on.cleanup()
async def stop_poller(**_: Any) -> None:
    if _poller is not None:
        _poller.cancel()
