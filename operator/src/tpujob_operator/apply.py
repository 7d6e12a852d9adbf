"""Apply: a decision's status and `Actions` turned into API calls, and nothing else.

What the watch has not delivered yet of our own writes is remembered (`JobMemory.written`, `created`,
`deleted`) so that the next snapshot shows it. A JobSet the apiserver refuses (4xx, or a foreign JobSet
holding its name) is recorded as an observation (`JobMemory.refused`) for the next decision
(`reconcile.after_creation_refused`); apply decides nothing about it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException
from tpujob_contract import LABEL_NAME, LABEL_UID

from . import api
from .facts import Actions, CreationRefused, Event
from .jobset import InPlaceRestartAction, build_jobset, incarnation_uid, owner_reference
from .kube import Cluster
from .memory import JobMemory
from .observe import slim_jobset, without_managed_fields
from .schedule import JobKey
from .status import parse_time

log = logging.getLogger("tpujob")
# Status that differs only in the goodput ledger's clock is written at most this often.
GOODPUT_WRITE_SECONDS = 60.0
# What an InPlace attempt's pods may do (read their JobSet, annotate their pod): a ClusterRole the chart
# installs, bound by the operator to the pods' ServiceAccount in the job's namespace, one RoleBinding per
# job, owned by it (the garbage collector removes it with the job) and deleted when the job ends. The
# chart's admission policy (templates/inplaceagentpolicy.yaml) limits its pod patch to the caller's own pod.
IN_PLACE_AGENT_ROLE = "tpujob-in-place-restart-agent"
MANAGED_BY = {"app.kubernetes.io/managed-by": "tpujob"}


def agent_role_binding(tj: api.TrainingJob, role: str) -> dict[str, Any]:
    """The job's RoleBinding of its pods' ServiceAccount to the agent's ClusterRole. Its name is the job's
    and a digest of its uid and account: a same-name successor, or a changed account, gets its own."""
    account = tj.spec.service_account_name or "default"
    uid = str(tj.metadata["uid"])
    digest = hashlib.sha256(f"{uid}/{account}".encode()).hexdigest()[:8]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {
            "name": f"tpujob-agent-{tj.name}-{digest}",
            "labels": MANAGED_BY | {LABEL_NAME: tj.name, LABEL_UID: uid},
            "ownerReferences": [owner_reference(tj)],
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": tj.namespace}],
    }


def agent_bindings_selector(uid: str) -> str:
    """The label selector of a job incarnation's agent RoleBindings (all its accounts')."""
    return ",".join(f"{k}={v}" for k, v in (MANAGED_BY | {LABEL_UID: uid}).items())


def changes_the_world(actions: Actions) -> bool:
    return bool(actions.create_attempt is not None or actions.delete or actions.stop or actions.set_suspend)


def is_acting(actions: Actions) -> bool:
    return changes_the_world(actions) or bool(actions.events)


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


def dump(status: api.TrainingJobStatus) -> dict[str, Any]:
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")


def refusal_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except (TypeError, ValueError):
        return str(error.reason or error)


class Applier:
    """The API calls of a decision; the runtime makes them in the order `Actions` names (status
    first, on the version the decision was made from)."""

    def __init__(
        self,
        cluster: Callable[[], Cluster],
        on_gone: Callable[[], None],
        agent_role: str = IN_PLACE_AGENT_ROLE,
        restart_action: InPlaceRestartAction = "Restart",
    ) -> None:
        self.cluster = cluster
        self.on_gone = on_gone  # a status write answered 404: the job is gone, perhaps in a watch gap
        self.agent_role = agent_role  # the ClusterRole JobSet's in-place restart agent needs (the chart's)
        self.restart_action = restart_action  # what the cluster's nodes can do (jobset.InPlaceRestartAction)

    def status(
        self, job: JobMemory, body: dict[str, Any], decided: api.TrainingJobStatus, acting: bool
    ) -> dict[str, Any]:
        """Write the decided status if it is worth a write; the body as it now stands. If anyone changed
        the job since it was read, the write fails (Conflict) and nothing else is applied."""
        if status_worth_writing(body.get("status") or {}, dump(decided), acting):
            return self.write_status(job, body, decided)
        return body

    def write_status(self, job: JobMemory, body: dict[str, Any], status: api.TrainingJobStatus) -> dict[str, Any]:
        try:
            # Kept until the watch delivers it: without managedFields, which nothing reads (22 KB a job).
            written = job.written = without_managed_fields(self.cluster().replace_status(body, dump(status)))
        except ApiException as error:
            if error.status == 404:  # deleted, perhaps in a watch gap: the resync forgets it (and what it left)
                self.on_gone()
            raise
        return written

    def announce(self, tj: api.TrainingJob, body: dict[str, Any], actions: Actions) -> None:
        """The decision's Events, then its suspension: an operator that dies after the status write
        leaves both undone, and the next reconcile (or replica) decides them again, Events included."""
        for event in actions.events:
            self.post_event(body, event)
        if actions.set_suspend is not None:
            self.cluster().set_jobset_suspend(tj.namespace, *actions.set_suspend)

    def tear_down(self, key: JobKey, job: JobMemory, actions: Actions) -> None:
        kube = self.cluster()
        for name in actions.delete:
            kube.delete_jobset(key[0], name)
            job.deleted.add(name)
        for name in actions.stop:
            kube.delete_jobset(key[0], name, save=True)
            job.deleted.add(name)
        for pod, node in actions.fail_on_gone_nodes:
            if not kube.node_exists(node):  # the cache may not yet hold a node just added
                log.info("%s/%s: pod %s is bound to node %s, which is gone: marking it Failed", *key, pod, node)
                kube.fail_pod_on_gone_node(key[0], pod, node)
        # A lost slice's Job before its pods: an operator that dies between the two still finds the pods,
        # and so the Job to delete, in its next decision (the other way round it would find neither).
        for job_name, job_uid in actions.recreate_lost_slices:
            log.info("%s/%s: deleting Job %s, all its pods lost with their nodes: JobSet recreates it", *key, job_name)
            kube.delete_job(key[0], job_name, job_uid)
        for pod in actions.remove_from_gone_nodes:
            log.info("%s/%s: removing pod %s, failed on a node that is gone (its failure is recorded)", *key, pod)
            kube.delete_pod(key[0], pod)

    def create(
        self,
        job: JobMemory,
        tj: api.TrainingJob,
        attempt: int,
        resume: int | None,
        queue: str | None,
        slices: int | None = None,
    ) -> None:
        """Create the attempt's JobSet; a refusal is remembered (`job.refused`), an overload (429/5xx) raised."""
        kube = self.cluster()
        manifest = build_jobset(tj, attempt, resume, queue, self.restart_action, slices)
        name = manifest["metadata"]["name"]
        existing = False
        if tj.spec.restart.strategy == api.IN_PLACE and not self._agent_may_run(job, tj):
            return
        try:
            created = kube.create_jobset(tj.namespace, manifest)
            if created is None:  # one of that name exists: ours only if it carries this job's uid
                existing, created = True, kube.get_jobset(tj.namespace, name)
        except ApiException as error:
            if error.status is None or error.status >= 500 or error.status == 429:
                raise
            job.refused = CreationRefused(refusal_message(error), error.status)
            return
        if existing and created is not None:
            owner = incarnation_uid(created)
            if owner != tj.metadata.get("uid"):
                job.refused = CreationRefused(
                    f"a JobSet named {name} already exists and is not this TrainingJob's "
                    + (f"(it belongs to TrainingJob uid {owner})" if owner else "(no TrainingJob owns it)")
                )
                return
            log.info("JobSet %s already exists (adopted: it carries this job's uid)", name)
        if created is not None:
            job.created[name] = slim_jobset(created)

    def _agent_may_run(self, job: JobMemory, tj: api.TrainingJob) -> bool:
        """Bind the pods' ServiceAccount to the agent's ClusterRole; a refusal is remembered as the JobSet's."""
        binding = agent_role_binding(tj, self.agent_role)
        try:
            self.cluster().ensure_role_binding(tj.namespace, binding)
        except ApiException as error:
            if error.status is None or error.status >= 500 or error.status == 429:
                raise
            account = binding["subjects"][0]["name"]
            why = f"binding ServiceAccount {account} to ClusterRole {self.agent_role} (JobSet's in-place restart agent)"
            job.refused = CreationRefused(f"{why}: {refusal_message(error)}", error.status)
            return False
        return True

    def unbind_agent(self, tj: api.TrainingJob) -> None:
        """The job ended: its pods' agent rights go now, not at its deletion (the garbage collector's
        turn). Told, never required: a failure is logged, and the owner reference still removes them."""
        if tj.spec.restart.strategy != api.IN_PLACE or not tj.metadata.get("uid"):
            return
        try:
            self.cluster().delete_role_bindings(tj.namespace, agent_bindings_selector(str(tj.metadata["uid"])))
        except ApiException as error:
            log.warning("%s/%s: agent RoleBindings not deleted (%s): removed with the job", tj.namespace, tj.name,
                        error.reason)  # fmt: skip

    def post_event(self, body: dict[str, Any], event: Event) -> None:
        """Events are told, never required: one that cannot be posted (a namespace being deleted, an
        overloaded apiserver) is logged and the reconcile goes on."""
        try:
            self.cluster().post_event(body, event.type, event.reason, event.message)
        except ApiException as error:
            log.warning(
                "%s/%s: Event %s not posted: %s",
                body["metadata"].get("namespace"),
                body["metadata"]["name"],
                event.reason,
                error.reason,
            )
