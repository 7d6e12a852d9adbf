"""kopf glue over the runtime (runtime.py).

kopf's watch streams fill four indexes (TrainingJobs, their JobSets, their worker pods, the Nodes) that the
runtime reads instead of the apiserver; kopf starts no handler before every index holds its initial
listing, so a reconcile never decides on a half-filled cache. Every trigger (a TrainingJob seen or
changed, a JobSet or worker pod event, the job's own next check) asks the runtime's schedule to run
the same level-triggered reconcile of that job.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from tpujob_contract import (
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    KUEUE_GROUP,
    KUEUE_JOB_UID_LABEL,
    KUEUE_VERSION,
    LABEL_ATTEMPT,
    LABEL_NAME,
)

from . import api
from .nodes import slim_node
from .reconcile import TERMINAL_PHASES
from .runtime import Runtime, slim_jobset, slim_pod, slim_workload, without_managed_fields

log = logging.getLogger("tpujob")
JobKey = tuple[str, str]

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


@kopf.on.probe(id="reconciles")
def liveness(**_: Any) -> int:
    return len(RUNTIME.watched)


# Index functions and handlers are coroutines: kopf runs plain functions in a thread pool, one hop per event.


# -- the caches: kopf keeps each index current from its watch stream ---------------------------------


@kopf.index(api.GROUP, api.VERSION, api.PLURAL)
async def tpujob_trainingjobs(
    namespace: str | None, name: str, body: kopf.Body, **_: Any
) -> dict[JobKey, dict[str, Any]]:
    return {(namespace or "", name): without_managed_fields(body)}


@kopf.index(JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, labels={LABEL_NAME: kopf.PRESENT})
async def tpujob_jobsets(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[JobKey, Any]:
    return {(namespace or "", labels[LABEL_NAME]): slim_jobset(body)}


@kopf.index("", "v1", "pods", labels={LABEL_NAME: kopf.PRESENT, LABEL_ATTEMPT: kopf.PRESENT})
async def tpujob_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[JobKey, Any]:
    return {(namespace or "", labels[LABEL_NAME]): slim_pod(body)}


@kopf.index("", "v1", "nodes")
async def tpujob_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
    # Every node of the cluster, slimmed (nodes.slim_node): whose failure a failed attempt was
    # (nodes.py) is told by the nodes under its pods, which outlive the operator's memory.
    return {name: slim_node(body)}


async def tpujob_workloads(labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[str, Any]:
    return {labels[KUEUE_JOB_UID_LABEL]: slim_workload(body)}


def watch_kueue_workloads() -> None:
    """Keep Kueue's Workloads (by the uid of their JobSet) in an index too. Only where the operator may
    watch them (the chart's kueue.enabled): kopf holds every handler until each index has its initial
    listing, so a forbidden watch would stop the operator. Without it, a queued job's Workload is
    LISTed (at most every 30 s while it waits)."""
    labels = {KUEUE_JOB_UID_LABEL: kopf.PRESENT}
    kopf.index(KUEUE_GROUP, KUEUE_VERSION, "workloads", labels=labels, id="tpujob_workloads")(tpujob_workloads)


def _attach(indexes: dict[str, Any], type_: str | None) -> None:
    """Hand kopf's index objects (passed to every handler) to the runtime, once; tell its resync of the
    event (`type_` None: a listing; one for an object already seen means a relist, resync.py)."""
    if not RUNTIME.indexes:
        RUNTIME.resync.start()
        names = {
            "tpujob_trainingjobs": "trainingjobs",
            "tpujob_jobsets": "jobsets",
            "tpujob_pods": "pods",
            "tpujob_nodes": "nodes",
        }
        RUNTIME.indexes = {ours: indexes[kopfs] for kopfs, ours in names.items()}
        if "tpujob_workloads" in indexes:
            RUNTIME.indexes["workloads"] = indexes["tpujob_workloads"]
    RUNTIME.resync.notice(type_, indexes.get("memo"))


# -- triggers ------------------------------------------------------------------------------------------


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
async def on_training_job(
    type: str, namespace: str | None, name: str, status: kopf.Status, meta: kopf.Meta, **kwargs: Any
) -> None:
    # Event handlers, not create/update/timer handlers: those make kopf put a finalizer on every
    # TrainingJob, and deleting one would then hang while the operator is down. Cleanup needs no
    # finalizer here: the JobSet is owned and garbage-collected. Timers would need one too, and run
    # on a fixed interval; the runtime's schedule runs each job when its own next check is due.
    _attach(kwargs, type)
    key = (namespace or "default", name)
    if type == "DELETED":
        RUNTIME.forget(key)
        return
    if status.get("phase") in TERMINAL_PHASES:
        # A finished job is reconciled while the cache holds a JobSet of it: it must hold nothing (an
        # operator that died between the Failed status and the delete cleans up when it is back).
        if key not in RUNTIME.watched and RUNTIME.holds_jobsets(key):
            RUNTIME.watch(key)
            RUNTIME.request(key)
        return
    # New, seen at start-up (type None: the initial listing) or spec changed: reconcile now.
    # Status-only changes (our own writes) change nothing to decide on.
    if key not in RUNTIME.watched or meta.get("generation") != status.get("observedGeneration"):
        RUNTIME.watch(key)
        RUNTIME.request(key)


@kopf.on.event(JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, labels={LABEL_NAME: kopf.PRESENT})
async def on_jobset_event(type: str | None, namespace: str | None, labels: kopf.Labels, **kwargs: Any) -> None:
    # A JobSet changed (e.g. it failed): react now.
    _attach(kwargs, type)
    RUNTIME.request((namespace or "", labels[LABEL_NAME]))


@kopf.on.event("", "v1", "pods", labels={LABEL_NAME: kopf.PRESENT, LABEL_ATTEMPT: kopf.PRESENT})
async def on_worker_pod_event(
    type: str, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **kwargs: Any
) -> None:
    _attach(kwargs, type)
    status = body.get("status") or {}
    disrupted = any(c.get("type") == "DisruptionTarget" for c in status.get("conditions") or [])
    ended = status.get("phase") in ("Failed", "Succeeded") or disrupted or body["metadata"].get("deletionTimestamp")
    key = (namespace or "", labels[LABEL_NAME])
    # Only live jobs are remembered: pods of finished or deleted jobs must not accumulate.
    if key in RUNTIME.watched and (ended or type == "DELETED"):
        RUNTIME.ended_pods[key][body["metadata"]["name"]] = slim_pod(body)
        RUNTIME.worker_ending(key)
    RUNTIME.request(key)  # scheduled, running, failed: react now


@kopf.on.cleanup()
async def stop(**_: Any) -> None:
    RUNTIME.close()
