"""Thin kopf handlers: gather facts, call the pure reconciler, apply its actions.

Every trigger (create, resume after an operator restart, spec update, a JobSet event, the periodic
timer) runs the same level-triggered `reconcile_job`, serialised per TrainingJob by a lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from datetime import datetime, timezone
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
    # Keep kopf's bookkeeping in annotations so status holds only the TrainingJob schema's fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=api.GROUP)
    settings.persistence.finalizer = f"{api.GROUP}/kopf-finalizer"
    # Watches reconnect regularly and API calls cannot hang: a silent network drop costs minutes, not hours.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.posting.level = logging.INFO


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
        now=datetime.now(timezone.utc), jobsets=facts, latest_committed_step=latest, progress=progress, storage_error=error
    )


def _apply(tj: api.TrainingJob, body: dict[str, Any], status: api.TrainingJobStatus, actions: Actions) -> None:
    kube = cluster()
    # Status first: if a later step fails, the next reconcile still knows the attempt it is on.
    kube.patch_status(tj.namespace, tj.name, status.model_dump(by_alias=True, exclude_none=True, mode="json"))
    for name in actions.delete:
        kube.delete_jobset(tj.namespace, name)
    if actions.create_attempt is not None:
        tj_with_uid = tj.model_copy(update={"metadata": body["metadata"]})
        manifest = build_jobset(tj_with_uid, actions.create_attempt, actions.resume_step)
        if not kube.create_jobset(tj.namespace, manifest):
            log.info("JobSet %s already exists (adopted)", manifest["metadata"]["name"])
    if actions.set_suspend is not None:
        kube.set_jobset_suspend(tj.namespace, *actions.set_suspend)
    for event in actions.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def _report_invalid(body: dict[str, Any], error: ValidationError) -> None:
    """A spec that slipped past the CRD's validation (e.g. an older CRD): report it, never crash."""
    meta = body["metadata"]
    message = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
    current = api.TrainingJobStatus.model_validate(body.get("status") or {})
    if current.phase == "Failed":
        return
    status = with_phase(current, "Failed", "InvalidSpec", message, datetime.now(timezone.utc))
    cluster().patch_status(meta["namespace"], meta["name"], status.model_dump(by_alias=True, exclude_none=True, mode="json"))
    kopf.event(body, type="Warning", reason="InvalidSpec", message=message)


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
        return None
    raw_jobsets = kube.list_jobsets(namespace, name)
    pods = kube.list_pods(namespace, name, tj.status.attempt)
    status, actions = reconcile(tj, _observe(tj, raw_jobsets, pods))
    _apply(tj, body, status, actions)
    if status.phase != tj.status.phase:
        log.info("%s/%s: %s -> %s (attempt %d, step %s)", namespace, name, tj.status.phase, status.phase, status.attempt, status.step)
    return actions.requeue_after


async def reconcile_job(namespace: str, name: str) -> float | None:
    async with _locks[(namespace, name)]:
        return await asyncio.to_thread(reconcile_sync, namespace, name)


@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, field="spec")
async def on_training_job(namespace: str, name: str, **_: Any) -> None:
    await reconcile_job(namespace, name)


@kopf.timer(api.GROUP, api.VERSION, api.PLURAL, interval=POLL_SECONDS / 2, initial_delay=POLL_SECONDS / 2)
async def poll(namespace: str, name: str, status: dict[str, Any], **_: Any) -> None:
    if status.get("phase") not in TERMINAL_PHASES:
        await reconcile_job(namespace, name)


@kopf.on.event("jobset.x-k8s.io", "v1alpha2", "jobsets", labels={LABEL_NAME: kopf.PRESENT})
async def on_jobset_event(namespace: str, labels: dict[str, str], type: str | None, **_: Any) -> None:
    # A JobSet changed (e.g. it failed): react now rather than at the next timer tick.
    if type in ("MODIFIED", "DELETED"):
        await reconcile_job(namespace, labels[LABEL_NAME])


