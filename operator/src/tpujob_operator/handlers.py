"""Thin kopf handlers: gather facts, call the pure reconciler, apply its actions.

Every trigger (a new or changed TrainingJob, the initial listing after an operator restart, a JobSet
event, the periodic poller) runs the same level-triggered `reconcile_job`, serialised per
TrainingJob by a lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from . import api, checkpoints
from .facts import Actions, Observed
from .jobset import LABEL_ATTEMPT, LABEL_NAME, build_jobset
from .kube import Cluster, jobset_facts, load_config
from .reconcile import POLL_SECONDS, TERMINAL_PHASES, reconcile
from .status import with_phase

log = logging.getLogger("tpujob")
_locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
_cluster: Cluster | None = None
_storage: Any = None
_watched: set[tuple[str, str]] = set()
# The last state of each worker pod that ended or is being deleted, by (namespace, job, attempt).
# Evicted, preempted or garbage-collected pods are often gone from the API by the time their JobSet
# is marked Failed; what they said on the way out is what classifies the failure.
_ended_pods: defaultdict[tuple[str, str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
_poller: asyncio.Task[None] | None = None


def reset_clients() -> None:
    """Forget cached API/GCS clients (tests start the operator against fresh endpoints)."""
    global _cluster, _storage
    _cluster, _storage = None, None
    _locks.clear()
    _watched.clear()
    _ended_pods.clear()


def cluster() -> Cluster:
    global _cluster
    if _cluster is None:
        load_config()
        _cluster = Cluster()
    return _cluster


def storage_client() -> Any:
    global _storage
    if _storage is None:
        _storage = checkpoints.make_client()
    return _storage


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Watches reconnect regularly and API calls cannot hang: a silent network drop costs minutes, not hours.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    # Only problems become Events from logs; the reconciler posts its own Events for transitions.
    settings.posting.level = logging.WARNING
    _locks.clear()  # locks belong to the previous event loop, if any


@kopf.on.probe(id="reconciles")
def liveness(**_: Any) -> int:
    return len(_locks)


def _observe(tj: api.TrainingJob, raw_jobsets: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Observed:
    latest, progress, error = None, None, None
    try:
        client = storage_client()
        latest = checkpoints.latest_committed_step(client, tj.run_dir)
        progress = checkpoints.read_progress(client, tj.run_dir)
    except checkpoints.StorageError as failure:
        error = str(failure)
    attempt = tj.status.attempt
    facts = tuple(
        jobset_facts(js, pods if js["metadata"].get("labels", {}).get(LABEL_ATTEMPT) == str(attempt) else [])
        for js in raw_jobsets
    )
    return Observed(
        now=datetime.now(UTC),
        jobsets=facts,
        latest_committed_step=latest,
        progress=progress,
        storage_error=error,
    )


def _apply(tj: api.TrainingJob, body: dict[str, Any], status: api.TrainingJobStatus, actions: Actions) -> None:
    kube = cluster()
    # Status first: if a later step fails, the next reconcile still knows the attempt it is on.
    # Unchanged status is not written, so idle jobs cost the apiserver only reads.
    new_status = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    old_status = body.get("status") or {}
    if new_status != old_status:
        # A merge patch keeps keys it does not mention: cleared fields must be sent as null.
        cleared = {key: None for key in old_status if key not in new_status}
        kube.patch_status(tj.namespace, tj.name, {**cleared, **new_status})
    for name in actions.delete:
        kube.delete_jobset(tj.namespace, name)
    if actions.create_attempt is not None:
        manifest = build_jobset(tj, actions.create_attempt, actions.resume_step)
        if not kube.create_jobset(tj.namespace, manifest):
            log.info("JobSet %s already exists (adopted)", manifest["metadata"]["name"])
    if actions.set_suspend is not None:
        kube.set_jobset_suspend(tj.namespace, *actions.set_suspend)
    for event in actions.events:
        kube.post_event(body, event.type, event.reason, event.message)


def _report_invalid(body: dict[str, Any], error: ValidationError) -> None:
    """A spec that slipped past the CRD's validation (e.g. an older CRD): report it, never crash."""
    meta = body["metadata"]
    message = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
    current = api.TrainingJobStatus.model_validate(body.get("status") or {})
    if current.phase == "Failed":
        return
    status = with_phase(current, "Failed", "InvalidSpec", message, datetime.now(UTC))
    cluster().patch_status(
        meta["namespace"], meta["name"], status.model_dump(by_alias=True, exclude_none=True, mode="json")
    )
    cluster().post_event(body, "Warning", "InvalidSpec", message)


def reconcile_sync(namespace: str, name: str) -> float | None:
    kube = cluster()
    body = kube.get_training_job(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        tj = api.TrainingJob.model_validate(body)
    except ValidationError as error:
        _report_invalid(body, error)
        return None
    if tj.status.phase in TERMINAL_PHASES:
        _watched.discard((namespace, name))
        return None
    raw_jobsets = kube.list_jobsets(namespace, name)
    listed = kube.list_pods(namespace, name, tj.status.attempt)
    remembered = _ended_pods.get((namespace, name, str(tj.status.attempt)), {})
    pods = list({**remembered, **{p["metadata"]["name"]: p for p in listed}}.values())
    for key in [k for k in _ended_pods if k[:2] == (namespace, name) and k[2] != str(tj.status.attempt)]:
        del _ended_pods[key]
    status, actions = reconcile(tj, _observe(tj, raw_jobsets, pods))
    _apply(tj, body, status, actions)
    if status.phase != tj.status.phase:
        log.info(
            "%s/%s: %s -> %s (attempt %d, step %s)",
            namespace,
            name,
            tj.status.phase,
            status.phase,
            status.attempt,
            status.step,
        )
    return actions.requeue_after


async def reconcile_job(namespace: str, name: str) -> float | None:
    async with _locks[(namespace, name)]:
        return await asyncio.to_thread(reconcile_sync, namespace, name)


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
async def on_training_job(
    type: str, namespace: str | None, name: str, status: kopf.Status, meta: kopf.Meta, **_: Any
) -> None:
    # Event handlers, not create/update/timer handlers: those make kopf put a finalizer on every
    # TrainingJob, and deleting one would then hang while the operator is down. Cleanup needs no
    # finalizer here: the JobSet is owned and garbage-collected.
    key = (namespace or "default", name)
    if type == "DELETED":
        _watched.discard(key)
        return
    _watched.add(key)
    # New, seen at start-up (type None: the initial listing) or spec changed: reconcile now.
    # Status-only changes (our own writes) wait for the poller.
    if type in (None, "ADDED") or meta.get("generation") != status.get("observedGeneration"):
        await reconcile_job(*key)


@kopf.on.event("jobset.x-k8s.io", "v1alpha2", "jobsets", labels={LABEL_NAME: kopf.PRESENT})
async def on_jobset_event(type: str, namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    # A JobSet changed (e.g. it failed): react now rather than at the next poll.
    if type in ("MODIFIED", "DELETED") and namespace:
        await reconcile_job(namespace, labels[LABEL_NAME])


@kopf.on.event("", "v1", "pods", labels={LABEL_NAME: kopf.PRESENT, LABEL_ATTEMPT: kopf.PRESENT})
async def on_worker_pod_event(type: str, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    status = body.get("status") or {}
    disrupted = any(c.get("type") == "DisruptionTarget" for c in status.get("conditions") or [])
    ended = status.get("phase") in ("Failed", "Succeeded") or disrupted or body["metadata"].get("deletionTimestamp")
    if namespace and (ended or type == "DELETED"):
        key = (namespace, labels[LABEL_NAME], labels[LABEL_ATTEMPT])
        _ended_pods[key][body["metadata"]["name"]] = dict(body)
        if status.get("phase") == "Failed":  # a worker died: react now, not at the next poll
            await reconcile_job(namespace, labels[LABEL_NAME])


async def _poll_forever() -> None:
    """Re-examine every live TrainingJob regularly: progress, hangs, backoff expiry, new checkpoints."""
    while True:
        await asyncio.sleep(POLL_SECONDS / 2)
        for namespace, name in sorted(_watched):
            try:
                await reconcile_job(namespace, name)
            except Exception:  # one job's trouble must not stop the others from being polled
                log.exception("reconcile of %s/%s failed", namespace, name)


@kopf.on.startup()
async def start_poller(**_: Any) -> None:
    global _poller
    _poller = asyncio.get_running_loop().create_task(_poll_forever(), name="tpujob-poller")


@kopf.on.cleanup()
async def stop_poller(**_: Any) -> None:
    if _poller is not None:
        _poller.cancel()
