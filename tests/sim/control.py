"""The operator in the simulated world: the real observation rules, the real `reconcile`, and its
actions applied in the runtime's order (status, delete, stop, pods on gone nodes, create, Events,
suspension), any of which an operator crash may cut short. The operator keeps no memory between
reconciles: every decision is a restarted operator's."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import tpujob_contract as contract
from tpujob_contract import LABEL_ATTEMPT, LABEL_UID
from tpujob_operator import api, elastic
from tpujob_operator import observe as observe_module
from tpujob_operator.apply import dump
from tpujob_operator.facts import Actions, Observed
from tpujob_operator.jobset import build_jobset, jobset_facts, queue_name, workload_admission
from tpujob_operator.kube import FAILED_ATTEMPT_GRACE_SECONDS
from tpujob_operator.nodes import node_facts
from tpujob_operator.reconcile import reconcile

from .world import World, at

# The runtime reconciles a job on every watch event and when its own requeue is due; without either it
# still checks progress this often (runtime.PROGRESS_CHECK_SECONDS).
PROGRESS_CHECK_SECONDS = 60


@dataclass
class Decision:
    time: int
    before: api.TrainingJobStatus
    status: api.TrainingJobStatus
    actions: Actions
    applied: int  # how many of its API calls were made before the operator died (all: len(calls))
    calls: int
    progress: contract.ProgressRecord | None = None  # the trainer's record it decided on


@dataclass
class Operator:
    world: World
    crash_after: int | None = None  # the next reconcile dies after this many API calls
    next_at: int = 0
    decisions: list[Decision] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # a restarted operator decided otherwise
    _kept: api.TrainingJobStatus | None = None  # the status the last complete reconcile decided, in memory

    def maybe_reconcile(self) -> None:
        world = self.world
        if world.training_job is None:
            return
        if not world.changed and not world.pods_seen_changed() and world.now < self.next_at:
            return
        world.changed = False
        self.reconcile()

    def observe(self, tj: api.TrainingJob) -> Observed:
        world = self.world
        uid = tj.metadata.get("uid")
        attempt = tj.status.attempt
        pods = [p for p in world.pods_seen() if p["metadata"]["labels"][LABEL_UID] == uid]
        bound = {p["spec"].get("nodeName") for p in pods} - {None}
        node_bodies = {n.name: world.node_body(n) for n in world.nodes.values() if n.exists and n.name in bound}
        attempt_pods = [p for p in pods if p["metadata"]["labels"][LABEL_ATTEMPT] == str(attempt)]
        facts = []
        for js in world.live_jobsets():
            current = js.attempt == attempt and js.uid == uid
            admission = workload_admission(js.workload()) if js.queued else (None, None)
            facts.append(jobset_facts(js.body(), attempt_pods if current else [], None, admission))
        outage = world.now < world.storage.operator_outage_until
        nodes = {  # a partitioned kubelet stops renewing its Lease
            name: replace(node_facts(body), renewed=at(world.now) if world.nodes[name].reachable else at(0))
            for name, body in node_bodies.items()
        }
        return Observed(
            spare_pools=self._spare_pools(tj, [p for p in attempt_pods if p["metadata"]["labels"]]),
            now=at(world.now),
            jobsets=tuple(facts),
            latest_committed_step=None if outage else world.storage.latest(),
            progress=None if outage else world.storage.progress,
            storage_error="storage unreachable (simulated outage)" if outage else None,
            earlier_pods=_earlier_pods(pods, attempt, node_bodies),
            nodes=nodes,
            queue_name=queue_name(tj, None),
        )

    def _spare_pools(self, tj: api.TrainingJob, attempt_pods: list[dict[str, Any]]) -> int | None:
        """As observe.Observer._spare_pools: asked only for an elastic job below its full size."""
        world = self.world
        if not elastic.wants_pools(world.training_job or {}):
            return None
        bodies = [world.node_body(n) for n in world.nodes.values() if n.exists]
        busy = [node for p in attempt_pods if (node := p["spec"].get("nodeName"))]
        if not hasattr(elastic, "spare_pool_nodes"):  # an operator from before issue 30 (tests.sim.hunt)
            return int(elastic.spare_pools(tj, bodies, 1, busy))  # type: ignore[arg-type, call-arg]
        pools = elastic.spare_pool_nodes(tj, bodies, 1, busy)
        return elastic.spare_pools(pools, world.occupied_nodes())

    def reconcile(self) -> None:
        world = self.world
        body = world.training_job
        assert body is not None
        tj = api.TrainingJob.model_validate(body)
        observed = self.observe(tj)
        status, actions = reconcile(tj, observed)
        if self._kept is not None:  # the same operator, had it not restarted, decides the same
            kept_status, kept_actions = reconcile(tj.model_copy(update={"status": self._kept}), observed)
            if dump(kept_status) != dump(status) or kept_actions != actions:
                self.mismatches.append(f"t={world.now}: {dump(kept_status)} / {actions} != {actions}")
        calls = self._calls(tj, status, actions)
        limit = len(calls) if self.crash_after is None else min(self.crash_after, len(calls))
        for call in calls[:limit]:
            call()
        self.decisions.append(Decision(world.now, tj.status, status, actions, limit, len(calls), observed.progress))
        self._kept = status if limit == len(calls) else None
        self.crash_after = None
        self.next_at = world.now + int(min(actions.requeue_after or PROGRESS_CHECK_SECONDS, PROGRESS_CHECK_SECONDS))
        if limit < len(calls):
            self.next_at = world.now + 1  # the next replica (or the restarted one) takes over at once

    def _calls(self, tj: api.TrainingJob, status: api.TrainingJobStatus, actions: Actions) -> list[Any]:
        world = self.world
        written = dump(status)

        def write_status() -> None:
            if world.training_job is not None:
                world.training_job["status"] = written

        calls: list[Any] = [write_status]
        calls += [lambda n=name: world.delete_jobset(n, FAILED_ATTEMPT_GRACE_SECONDS) for name in actions.delete]
        calls += [lambda n=name: world.delete_jobset(n, None) for name in actions.stop]
        calls += [lambda p=pod, n=node: world.fail_pod_on_gone_node(p, n) for pod, node in actions.fail_on_gone_nodes]
        calls += [lambda j=job, u=uid: world.delete_slice_job(j, u) for job, uid in actions.recreate_lost_slices]
        calls += [lambda p=pod: world.delete_ended_pod(p) for pod in actions.remove_from_gone_nodes]
        if actions.create_attempt is not None:
            queue = queue_name(tj, None)
            manifest = build_jobset(
                tj, actions.create_attempt, actions.resume_step, queue, "Restart", actions.create_slices
            )
            calls.append(lambda: world.create_jobset(manifest))
        if actions.set_suspend is not None:
            name, value = actions.set_suspend
            calls.append(lambda: world.set_suspend(name, value))
        return calls


def _earlier_pods(pods: list[dict[str, Any]], attempt: int, node_bodies: dict[str, Any]) -> int:
    """observe's count of earlier attempts' pods that may still write (its rule before issue 30 for an
    older operator under tests.sim.hunt)."""
    if hasattr(observe_module, "_earlier_writers"):
        return int(observe_module._earlier_writers(pods, attempt, node_bodies))
    older = observe_module._earlier_and_running  # type: ignore[attr-defined]
    return len([p for p in pods if older(p, attempt, node_bodies)])
