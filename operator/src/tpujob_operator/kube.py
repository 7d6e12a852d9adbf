"""The API calls the operator makes: reading the objects (jobset.py decodes them into facts) and
applying the reconciler's actions.

Blocking kubernetes-client calls; handlers run them in a worker thread.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tpujob_contract import (
    ANNOTATION_SUSPENDED,
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    KUEUE_GROUP,
    KUEUE_JOB_UID_LABEL,
    KUEUE_VERSION,
    TPU_RESOURCE,
)

from . import api
from .nodes import NODE_GONE_DISRUPTION

log = logging.getLogger(__name__)
# Every API call carries a timeout, so a stuck connection cannot stall a reconcile forever.
REQUEST_TIMEOUT_SECONDS = 30
# Enough to finish writing a commit marker, not enough to block the next attempt: the other workers
# of a failed attempt cannot finish a collective save without their dead peer anyway, and with
# exclusive placement the replacement waits for them to leave the node pools (the demo measured
# 14 s of a 32 s recovery at 15 s of grace).
FAILED_ATTEMPT_GRACE_SECONDS = 5
JOB_CREATION_FAILED = "JobCreationFailed"  # the JobSet controller's Event when the apiserver refuses a Job
NODE_LEASE_NAMESPACE = "kube-node-lease"  # each kubelet's heartbeat: a Lease named after its node


def load_config(pool_size: int | None = None) -> None:
    """In-cluster credentials, else the kubeconfig; `pool_size` connections for as many concurrent calls."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    if pool_size is not None:
        configuration = client.Configuration.get_default_copy()
        configuration.connection_pool_maxsize = pool_size
        client.Configuration.set_default(configuration)


class Conflict(RuntimeError):
    """The object changed since it was read: re-read and decide again."""


class Cluster:
    """The handful of API calls the operator makes (the ClusterRole in the chart lists exactly these)."""

    def __init__(self) -> None:
        self.custom = client.CustomObjectsApi()
        self.coordination = client.CoordinationV1Api()

    def _core(
        self, method: str, path: str, query: list[tuple[str, Any]] | None = None, body: Any = None
    ) -> dict[str, Any]:
        """A core/v1 call through the generic client, its JSON answer as a dict. Not client.CoreV1Api:
        that module alone is about 20 MB of the operator's memory, for the few calls made here."""
        return self._call(method, f"/api/v1/{path}", query, body)

    def _call(
        self,
        method: str,
        path: str,
        query: list[tuple[str, Any]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        api_client = self.custom.api_client
        headers = {"Accept": "application/json"} | ({"Content-Type": content_type} if body is not None else {})
        request = api_client.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )  # fmt: skip
        response = api_client.call_api(*request, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return cast(dict[str, Any], json.loads(response.data or b"{}"))

    def get_training_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = self.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
            return cast(dict[str, Any], found)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def nodes_holding_tpus(self, nodes: list[str]) -> set[str]:
        """Of `nodes`, those where a pod that has not ended asks for TPU chips (any namespace, any owner):
        a slice of this job cannot schedule there now. Without the right to list pods cluster-wide (a
        chart scoped by watchNamespaces), nothing is known to be occupied."""
        occupied = set()
        for node in nodes:
            selector = f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
            try:
                pods = self._core("GET", "pods", [("fieldSelector", selector)]).get("items") or []
            except ApiException as error:
                if error.status == 403:
                    return set()
                raise
            if any(_asks_for_tpus(p) for p in pods):
                occupied.add(node)
        return occupied

    def pod_creation_refusal(self, namespace: str, jobset_name: str) -> str | None:
        """The newest FailedCreate the Job controller reported for this JobSet's Jobs (a quota, Pod
        Security admission, a webhook), or JobCreationFailed the JobSet controller reported for the
        JobSet (the apiserver refused its Jobs: a pod template the Job API rejects, retried forever):
        pods or Jobs that are refused never exist, so only Events say why."""
        events = f"namespaces/{namespace}/events"
        found = self._core("GET", events, [("fieldSelector", "involvedObject.kind=Job,reason=FailedCreate")])
        mine = [
            e
            for e in found.get("items") or []
            if str((e.get("involvedObject") or {}).get("name") or "").startswith(f"{jobset_name}-")
        ]
        selector = f"involvedObject.kind=JobSet,involvedObject.name={jobset_name},reason={JOB_CREATION_FAILED}"
        mine += self._core("GET", events, [("fieldSelector", selector)]).get("items") or []
        if not mine:
            return None

        def when(event: dict[str, Any]) -> str:
            created = (event.get("metadata") or {}).get("creationTimestamp")
            return str(event.get("lastTimestamp") or event.get("eventTime") or created)

        newest = max(mine, key=when)
        return str(newest.get("message") or "the Job controller could not create a worker pod")

    def workload_of(self, namespace: str, jobset_uid: str) -> dict[str, Any] | None:
        """Kueue's Workload for a JobSet (label kueue.x-k8s.io/job-uid); None without Kueue or RBAC for it."""
        try:
            found = self.custom.list_namespaced_custom_object(
                KUEUE_GROUP,
                KUEUE_VERSION,
                namespace,
                "workloads",
                label_selector=f"{KUEUE_JOB_UID_LABEL}={jobset_uid}",
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
        except ApiException as error:
            if error.status in (403, 404):  # Kueue not installed, or the chart did not grant it
                return None
            raise
        items = list(cast(dict[str, Any], found).get("items", []))
        return max(items, key=lambda w: str(w["metadata"].get("creationTimestamp", "")), default=None)

    def node_lease_renewed(self, node: str) -> datetime | None:
        """When the node's kubelet last renewed its Lease (every 10 s while it lives); None without a
        Lease or without RBAC for it (a failure then waits the whole nodes.NODE_VERDICT_WAIT_SECONDS)."""
        try:
            lease = self.coordination.read_namespaced_lease(
                node, NODE_LEASE_NAMESPACE, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except ApiException as error:
            if error.status in (403, 404):
                return None
            raise
        renewed = lease.spec.renew_time if lease.spec is not None else None
        return renewed if isinstance(renewed, datetime) else None

    def node_exists(self, name: str) -> bool:
        try:
            self._core("GET", f"nodes/{name}")
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def fail_pod_on_gone_node(self, namespace: str, pod: str, node: str) -> None:
        """Mark a pod whose node is gone Failed, with a DisruptionTarget condition, as the pod garbage
        collector does (after its 40 s quarantine): its Job replaces it and its failure is decided now.
        A strategic merge keeps the pod's other conditions; a pod already gone is left alone."""
        moment = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": NODE_GONE_DISRUPTION,
            "message": f"tpujob-operator: node {node} no longer exists",
            "lastTransitionTime": moment,
        }
        patch = {"status": {"phase": "Failed", "conditions": [condition]}}
        try:
            path = f"/api/v1/namespaces/{namespace}/pods/{pod}/status"
            self._call("PATCH", path, body=patch, content_type="application/strategic-merge-patch+json")
        except ApiException as error:
            if error.status != 404:
                raise

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete a pod at once (grace 0: it has ended, and no kubelet is left to confirm it)."""
        try:
            self._core("DELETE", f"namespaces/{namespace}/pods/{name}", [("gracePeriodSeconds", 0)])
        except ApiException as error:
            if error.status != 404:
                raise

    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        """Delete a Job if it is still the one of that uid (a Job recreated under its name is left alone);
        its pods are the garbage collector's (propagation Background)."""
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "preconditions": {"uid": uid},
            "propagationPolicy": "Background",
        }
        try:
            self._call("DELETE", f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}", None, body)
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    def replace_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """Write the whole status (no stale nested fields survive) on the object as it was read: its
        resourceVersion makes the apiserver refuse the write if anyone changed it since (Conflict)."""
        meta = body["metadata"]
        request = {
            "apiVersion": body.get("apiVersion", f"{api.GROUP}/{api.VERSION}"),
            "kind": body.get("kind", api.KIND),
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "resourceVersion": meta["resourceVersion"],
            },
            "spec": body.get("spec"),
            "status": status,
        }
        try:
            written = self.custom.replace_namespaced_custom_object_status(
                api.GROUP,
                api.VERSION,
                meta["namespace"],
                api.PLURAL,
                meta["name"],
                request,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
            return cast(dict[str, Any], written)
        except ApiException as error:
            if error.status == 409:
                raise Conflict(f"{meta['namespace']}/{meta['name']} changed since it was read") from error
            raise

    def create_jobset(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """The JobSet as created, or None when one of that name already exists (whose: see `get_jobset`). Any
        other refusal (invalid, forbidden by a quota or an admission policy) raises ApiException for the caller."""
        try:
            created = self.custom.create_namespaced_custom_object(
                JOBSET_GROUP,
                JOBSET_VERSION,
                namespace,
                JOBSET_PLURAL,
                manifest,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
            return cast(dict[str, Any], created)
        except ApiException as error:
            if error.status == 409:
                return None
            raise

    def ensure_role_binding(self, namespace: str, binding: dict[str, Any]) -> None:
        """Create the RoleBinding `binding` in `namespace`, unless one of its name exists. Raises
        ApiException when the operator may not (403: no `bind` on its role)."""
        try:
            self._call("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", body=binding)
        except ApiException as error:
            if error.status != 409:
                raise

    def delete_role_bindings(self, namespace: str, label_selector: str) -> None:
        """Delete the RoleBindings of `namespace` that `label_selector` selects (deletecollection: their
        names are the operator's own, but which exist is not remembered across restarts)."""
        path = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings"
        try:
            self._call("DELETE", path, [("labelSelector", label_selector)])
        except ApiException as error:
            if error.status != 404:
                raise

    def get_jobset(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = self.custom.get_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
            return cast(dict[str, Any], found)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def delete_jobset(self, namespace: str, name: str, save: bool = False) -> None:
        """Tear down an attempt: the JobSet (Jobs and pods follow by owner reference) and, unless the
        workers are to save on SIGTERM (`save`), its pods with a short grace. Workers of a failed
        attempt are usually stuck in a collective with a dead peer; left to the pod template's long
        grace (meant for a preemption save) they would hold their node pools and keep the
        replacement from scheduling for minutes."""
        try:
            if not save:
                query = [
                    ("labelSelector", f"{JOBSET_NAME_LABEL}={name}"),
                    ("gracePeriodSeconds", FAILED_ATTEMPT_GRACE_SECONDS),
                ]
                self._core("DELETE", f"namespaces/{namespace}/pods", query)
        except ApiException as error:
            if error.status != 404:
                raise
        try:
            self.custom.delete_namespaced_custom_object(
                JOBSET_GROUP,
                JOBSET_VERSION,
                namespace,
                JOBSET_PLURAL,
                name,
                body=client.V1DeleteOptions(propagation_policy="Background"),
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def post_event(self, involved: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about a TrainingJob, as `kubectl describe` shows them. Posted directly (not
        through kopf) so any thread or task can report, including the poller."""
        meta = involved["metadata"]
        moment = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", f"{api.GROUP}/{api.VERSION}"),
                "kind": involved.get("kind", api.KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "tpujob-operator"},
            "reportingComponent": "tpujob-operator",
            "firstTimestamp": moment,
            "lastTimestamp": moment,
            "count": 1,
        }
        self._core("POST", f"namespaces/{meta['namespace']}/events", body=event)

    def set_jobset_suspend(self, namespace: str, name: str, suspend: bool) -> None:
        annotations = {ANNOTATION_SUSPENDED: str(suspend).lower()}
        patch = {"metadata": {"annotations": annotations}, "spec": {"suspend": suspend}}
        self.custom.patch_namespaced_custom_object(
            JOBSET_GROUP,
            JOBSET_VERSION,
            namespace,
            JOBSET_PLURAL,
            name,
            patch,
            _request_timeout=REQUEST_TIMEOUT_SECONDS,
        )


def _asks_for_tpus(pod: dict[str, Any]) -> bool:
    containers = (pod.get("spec") or {}).get("containers") or []
    return any(TPU_RESOURCE in (((c.get("resources") or {}).get("limits")) or {}) for c in containers)
