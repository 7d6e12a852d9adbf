"""kopf glue over a runtime (runtime.py): `register` defines the handlers on a kopf registry.

kopf's watch streams fill four indexes (TrainingJobs, their JobSets, their worker pods, the Nodes) that the
runtime reads instead of the apiserver; kopf starts no handler before every index holds its initial
listing, so a reconcile never decides on a half-filled cache. Every trigger (a TrainingJob seen or
changed, a JobSet or worker pod event, the job's own next check) asks the runtime's schedule to run
the same level-triggered reconcile of that job. No module state: the runtime is built in `__main__`
(or by a test) and handed in.
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

from . import api, policy
from .nodes import slim_node
from .observe import slim_jobset, slim_pod, slim_workload, without_managed_fields
from .runtime import Runtime

log = logging.getLogger("tpujob")
JobKey = tuple[str, str]
# kopf's index ids (the keyword each handler receives its index by) -> the runtime's index names.
INDEXES = {
    "tpujob_trainingjobs": "trainingjobs",
    "tpujob_jobsets": "jobsets",
    "tpujob_pods": "pods",
    "tpujob_nodes": "nodes",
    "tpujob_workloads": "workloads",
}


def configure(settings: kopf.OperatorSettings) -> None:
    # Watches reconnect regularly and API calls cannot hang: a silent network drop costs minutes, not hours.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    # Only problems become Events from logs; the reconciler posts its own Events for transitions.
    settings.posting.level = logging.WARNING


def attach(runtime: Runtime, indexes: dict[str, Any], type_: str | None) -> None:
    """Hand kopf's index objects (passed to every handler) to the runtime, once; tell its resync of the
    event (`type_` None: a listing; one for an object already seen means a relist, resync.py)."""
    if not runtime.indexes:
        runtime.resync.start()
        runtime.indexes = {ours: indexes[kopfs] for kopfs, ours in INDEXES.items() if kopfs in indexes}
    runtime.resync.notice(type_, indexes.get("memo"))


def register(runtime: Runtime, registry: kopf.OperatorRegistry) -> None:
    """Define the operator's indexes and handlers on `registry`, all of them over `runtime`.
    Index functions and handlers are coroutines: kopf runs plain functions in a thread pool, one hop per event."""

    # kopf's own default registry logs in through the kubernetes client's configuration; a registry
    # of our own must say so (the same kopf function, errors ignored as there).
    kopf.on.login(registry=registry, id="login_via_client", errors=kopf.ErrorsMode.IGNORED)(kopf.login_via_client)

    @kopf.on.startup(registry=registry, id="configure")
    def on_startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    @kopf.on.probe(registry=registry, id="reconciles")
    def liveness(**_: Any) -> int:
        return len(runtime.watched)

    # -- the caches: kopf keeps each index current from its watch stream -------------------------------

    @kopf.index(api.GROUP, api.VERSION, api.PLURAL, registry=registry, id="tpujob_trainingjobs")
    async def tpujob_trainingjobs(
        namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> dict[JobKey, dict[str, Any]]:
        return {(namespace or "", name): without_managed_fields(body)}

    @kopf.index(
        JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, labels={LABEL_NAME: kopf.PRESENT}, registry=registry,
        id="tpujob_jobsets",
    )  # fmt: skip
    async def tpujob_jobsets(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[JobKey, Any]:
        return {(namespace or "", labels[LABEL_NAME]): slim_jobset(body)}

    pod_labels = {LABEL_NAME: kopf.PRESENT, LABEL_ATTEMPT: kopf.PRESENT}

    @kopf.index("", "v1", "pods", labels=pod_labels, registry=registry, id="tpujob_pods")
    async def tpujob_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[JobKey, Any]:
        return {(namespace or "", labels[LABEL_NAME]): slim_pod(body)}

    @kopf.index("", "v1", "nodes", registry=registry, id="tpujob_nodes")
    async def tpujob_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
        # Every node of the cluster, slimmed (nodes.slim_node): whose failure a failed attempt was
        # (nodes.py) is told by the nodes under its pods, which outlive the operator's memory.
        return {name: slim_node(body)}

    if runtime.settings.watch_kueue_workloads:
        # Only where the operator may watch them (the chart's kueue.enabled): kopf holds every handler
        # until each index has its initial listing, so a forbidden watch would stop the operator.
        # Without it, a queued job's Workload is LISTed (at most every 30 s while it waits).
        @kopf.index(
            KUEUE_GROUP, KUEUE_VERSION, "workloads", labels={KUEUE_JOB_UID_LABEL: kopf.PRESENT}, registry=registry,
            id="tpujob_workloads",
        )  # fmt: skip
        async def tpujob_workloads(labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[str, Any]:
            return {labels[KUEUE_JOB_UID_LABEL]: slim_workload(body)}

    # -- triggers ----------------------------------------------------------------------------------------

    @kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, registry=registry, id="on_training_job")
    async def on_training_job(
        type: str, namespace: str | None, name: str, status: kopf.Status, meta: kopf.Meta, **kwargs: Any
    ) -> None:
        # Event handlers, not create/update/timer handlers: those make kopf put a finalizer on every
        # TrainingJob, and deleting one would then hang while the operator is down. Cleanup needs no
        # finalizer here: the JobSet is owned and garbage-collected. Timers would need one too, and run
        # on a fixed interval; the runtime's schedule runs each job when its own next check is due.
        attach(runtime, kwargs, type)
        key = (namespace or "default", name)
        if type == "DELETED":
            runtime.forget(key)
            return
        if status.get("phase") in api.TERMINAL_PHASES:
            # A finished job is reconciled while the cache holds a JobSet of it: it must hold nothing (an
            # operator that died between the Failed status and the delete cleans up when it is back).
            if key not in runtime.watched and runtime.holds_jobsets(key):
                runtime.watch(key)
                runtime.request(key)
            return
        # New, seen at start-up (type None: the initial listing) or spec changed: reconcile now; so is a
        # Kueue priority label outside the policy that the status does not warn of yet (a label change
        # makes no new generation). Status-only changes (our own writes) change nothing to decide on.
        if (
            key not in runtime.watched
            or meta.get("generation") != status.get("observedGeneration")
            or policy.unheeded_priority_label(meta.get("labels") or {}, status.get("conditions") or [],
                                              runtime.settings.policy)
        ):  # fmt: skip
            runtime.watch(key)
            runtime.request(key)

    @kopf.on.event(
        JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, labels={LABEL_NAME: kopf.PRESENT}, registry=registry,
        id="on_jobset_event",
    )  # fmt: skip
    async def on_jobset_event(type: str | None, namespace: str | None, labels: kopf.Labels, **kwargs: Any) -> None:
        # A JobSet changed (e.g. it failed): react now.
        attach(runtime, kwargs, type)
        runtime.request((namespace or "", labels[LABEL_NAME]))

    @kopf.on.event("", "v1", "pods", labels=pod_labels, registry=registry, id="on_worker_pod_event")
    async def on_worker_pod_event(
        type: str, body: kopf.Body, namespace: str | None, labels: kopf.Labels, **kwargs: Any
    ) -> None:
        attach(runtime, kwargs, type)
        status = body.get("status") or {}
        disrupted = any(c.get("type") == "DisruptionTarget" for c in status.get("conditions") or [])
        ended = status.get("phase") in ("Failed", "Succeeded") or disrupted or body["metadata"].get("deletionTimestamp")
        key = (namespace or "", labels[LABEL_NAME])
        # Only live jobs are remembered: pods of finished or deleted jobs must not accumulate.
        if key in runtime.watched and (ended or type == "DELETED"):
            runtime.worker_ended(key, slim_pod(body))
        runtime.request(key)  # scheduled, running, failed: react now

    @kopf.on.event("", "v1", "nodes", registry=registry, id="on_node_event")
    async def on_node_event(type: str | None, name: str, **kwargs: Any) -> None:
        # A deleted node (a lost VM) reports nothing more of its pods, which stay Running in the API:
        # its jobs decide now (reconcile marks those pods Failed) rather than at their next check.
        attach(runtime, kwargs, type)
        if type == "DELETED":
            for key in runtime.jobs_on_node(name):
                runtime.request(key)

    @kopf.on.cleanup(registry=registry, id="stop")
    async def stop(**_: Any) -> None:
        runtime.close()
