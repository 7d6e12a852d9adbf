"""The world around the operator, modelled: the apiserver's objects, the JobSet controller, the
scheduler and the nodes, the kubelet, the trainer's processes and checkpoint storage.

Only the world is modelled. The operator's own code decides: the real JobSet builder and decoders
(jobset.build_jobset, jobset_facts, pod_facts), the real observation rule for earlier attempts' pods
(observe), the real `reconcile` with its status and policy functions. The model is deterministic: one
schedule of events always gives one history.

What it models, and how coarsely:
- time in whole seconds; the operator reconciles on every change of what it watches and when its
  requeue is due, as the real runtime's watch and schedule do;
- one node per TPU node pool, one host per slice; the scheduler binds a pod to a free pool (exclusive
  placement: a pool holding any pod that has not ended is not free, another tenant may hold one);
- a pod's deletion gives its trainer the deletion's grace, then SIGKILL; a pod on a partitioned node
  is never seen to end (the apiserver cannot hear its kubelet) while its trainer runs on;
- a trainer group is the processes of one JobSet run: they start when all are Running, clean the
  run directory's uncommitted step directories (Orbax's start-up), restore the newest committed step
  (the pin rule: that step or a newer one), train one step a second, save asynchronously every
  `save_every` steps (a save commits `save_seconds` later, unless its directory was removed under it:
  then the step is committed but damaged), keep the newest `keep` committed steps, write the progress
  record, save their step on SIGTERM when all of them are healthy, and exit 0 once the final step's save
  (`final_save_seconds`, which may outlast the hang timeout) commits, writing the record meanwhile for at
  most the hang timeout;
- storage can be unreadable to the operator, or unreachable for the workers: then their saves and
  records hang until it is back, a trainer waits for it at start, and a training one gives up with
  exit 3 after `record_unwritable_limit_seconds` (the trainer library's rule, trainer_image/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import tpujob_contract as contract
from tpujob_contract import ANNOTATION_RESUME_STEP, JOB_INDEX_ANNOTATION, LABEL_ATTEMPT, LABEL_UID, QUEUE_LABEL
from tpujob_operator.jobset import (
    IN_PLACE_RESTART_ATTEMPT_ANNOTATION,
    IN_PLACE_RESTART_EXIT_CODE,
    IN_PLACE_STRATEGY,
    JOB_NAME_LABEL,
    JOB_UID_LABEL,
    TERMINATION_GRACE_SECONDS,
    slice_job_name,
)
from tpujob_operator.restarts import NOT_RESTARTED_EXIT_CODES

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ACCELERATOR, TOPOLOGY = "tpu-v5-lite-podslice", "2x2"  # one host a slice
JOB_POD_FAILURE_BACKOFF_SECONDS, JOB_POD_FAILURE_BACKOFF_MAX_SECONDS = 10, 600  # the Job controller's

Cause = Literal["job", "infrastructure"]
# What a fault does to the trainer: ends one of its processes, stops its progress (a hang), or neither
# (a partitioned node's process trains on: only the node's signals show it).
Effect = Literal["ends", "stalls", "signals"]
# What the kubelet writes on the pods it ends itself.
POD_MESSAGES = {
    "Evicted": "The node was low on resource: memory. Threshold quantity: 100Mi, available: 51Mi.",
    "Terminated": "Pod was terminated in response to imminent node shutdown.",
}


def at(second: int) -> datetime:
    return T0 + timedelta(seconds=second)


def stamp(second: int) -> str:
    return contract.format_time(at(second))


@dataclass
class Node:
    name: str
    pool: int
    exists: bool = True
    reachable: bool = True  # False: partitioned, its kubelet cannot reach the apiserver (NotReady)
    tenant_until: int = -1  # another tenant's pod holds the pool until then
    deleted_at: int = 0
    unreachable_since: int = 0


@dataclass
class Pod:
    name: str
    jobset: str
    attempt: int
    uid: str
    slice: int
    run: int  # the JobSet's run (a resumed JobSet starts a new one): the trainer group
    created: int
    node: str | None = None
    phase: str = "Pending"
    scheduled_at: int | None = None
    running_at: int | None = None
    exit_code: int | None = None
    reason: str | None = None  # container terminated reason or pod reason (Evicted, Terminated)
    disruption: str | None = None  # DisruptionTarget reason
    finished_at: int | None = None
    deleting_until: int | None = None  # deletion asked: SIGKILL at this second
    unschedulable: bool = False  # the scheduler found no free pool for it
    process_alive: bool = False  # its trainer process runs (it can write to storage)
    gone: bool = False  # removed from the apiserver
    # Restarted in place (JobSet's InPlaceRestart): its container's restarts, how the run before the last
    # one ended, and the in-place round its agent is at (None: no agent has started yet).
    restart_count: int = 0
    last_exit_code: int | None = None
    last_finished_at: int | None = None
    in_place_attempt: int | None = None  # its annotation (it outlives the container that set it)
    agent_joined: bool = False  # the agent of its current container has annotated the round it joins
    job_uid: str = ""  # the uid of the slice Job that made it

    @property
    def job(self) -> str:
        return slice_job_name(self.jobset, self.slice)

    def ended(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def body(self) -> dict[str, Any]:
        """The pod as the apiserver returns it (the fields jobset.pod_facts and observe read)."""
        conditions: list[dict[str, Any]] = []
        if self.scheduled_at is not None:
            conditions.append(
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp(self.scheduled_at)}
            )
        elif self.unschedulable:
            conditions.append(
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 node(s) didn't match pod anti-affinity rules.",
                }
            )
        if self.disruption is not None:
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": self.disruption,
                    "lastTransitionTime": stamp(self.finished_at or self.created),
                }
            )
        state: dict[str, Any] = {}
        if self.exit_code is not None:
            # The kubelet ends an evicted or shut-down pod's container like any other kill.
            container_reason = "Error" if self.reason in ("Evicted", "Terminated") else self.reason
            terminated: dict[str, Any] = {"exitCode": self.exit_code, "finishedAt": stamp(self.finished_at or 0)}
            if container_reason:
                terminated["reason"] = container_reason
            state = {"terminated": terminated}
        elif self.phase == "Running":
            state = {"running": {}}
        container: dict[str, Any] = {"name": "trainer", "state": state, "restartCount": self.restart_count}
        if self.last_exit_code is not None:
            last = {"exitCode": self.last_exit_code, "finishedAt": stamp(self.last_finished_at or 0), "reason": "Error"}
            container["lastState"] = {"terminated": last}
        status: dict[str, Any] = {"phase": self.phase, "conditions": conditions, "containerStatuses": [container]}
        if self.reason in POD_MESSAGES:  # the kubelet's pod-level reasons
            status["reason"], status["message"] = self.reason, POD_MESSAGES[self.reason]
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": "ml",
            "creationTimestamp": stamp(self.created),
            "labels": {
                LABEL_ATTEMPT: str(self.attempt),
                LABEL_UID: self.uid,
                JOB_INDEX_ANNOTATION: str(self.slice),
                JOB_NAME_LABEL: self.job,
                JOB_UID_LABEL: self.job_uid,
            },
            "annotations": {JOB_INDEX_ANNOTATION: str(self.slice)},
        }
        if self.in_place_attempt is not None:
            metadata["annotations"][IN_PLACE_RESTART_ATTEMPT_ANNOTATION] = str(self.in_place_attempt)
        if self.deleting_until is not None:
            metadata["deletionTimestamp"] = stamp(self.deleting_until)
        spec = {"nodeName": self.node} if self.node else {}
        return {"metadata": metadata, "spec": spec, "status": status}


@dataclass
class JobSet:
    manifest: dict[str, Any]
    created: int
    run: int = 0
    state: str = "Active"  # Active, Completed, Failed
    ended_at: int = 0  # when it became Completed or Failed
    resumed_at: int | None = None
    admitted_at: int | None = None  # Kueue admitted its Workload (a queued JobSet)
    evicted: str | None = None  # why Kueue evicted its Workload
    held_until: int = 0  # Kueue admits it no sooner (the workload that preempted it holds the quota)
    current_round: int | None = None  # status.currentInPlaceRestartAttempt: the round all agents reached
    job_generations: dict[int, int] = field(default_factory=dict)  # slice -> how often its Job was recreated
    previous_round: int | None = None  # status.previousInPlaceRestartAttempt: agents below it restart

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])

    def job_uid(self, index: int) -> str:
        """The uid of slice `index`'s Job as it is now (JobSet recreates a deleted one: a new uid)."""
        return f"{self.uid}-{self.attempt}-{index}-{self.job_generations.get(index, 0)}"

    @property
    def suspended(self) -> bool:
        return bool(self.manifest["spec"].get("suspend"))

    @property
    def attempt(self) -> int:
        return int(self.manifest["metadata"]["labels"][LABEL_ATTEMPT])

    @property
    def uid(self) -> str:
        return str(self.manifest["metadata"]["labels"][LABEL_UID])

    @property
    def slices(self) -> int:
        return sum(int(rj.get("replicas", 1)) for rj in self.manifest["spec"]["replicatedJobs"])

    @property
    def in_place(self) -> bool:
        return bool(self.manifest["spec"]["failurePolicy"].get("restartStrategy") == IN_PLACE_STRATEGY)

    @property
    def max_restarts(self) -> int:
        return int(self.manifest["spec"]["failurePolicy"].get("maxRestarts", 0))

    @property
    def queued(self) -> bool:
        return QUEUE_LABEL in self.manifest["metadata"]["labels"]

    @property
    def waits_for_old_pods(self) -> bool:
        """Its Jobs' podReplacementPolicy Failed: a slice's pod is replaced only once the old one has ended."""
        template = self.manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
        return template.get("podReplacementPolicy") == "Failed"

    def workload(self) -> dict[str, Any]:
        """Its Kueue Workload as the apiserver returns it (the conditions jobset.workload_admission reads)."""
        conditions: list[dict[str, Any]] = []
        if self.admitted_at is not None:
            conditions.append({"type": "Admitted", "status": "True", "lastTransitionTime": stamp(self.admitted_at)})
        elif self.evicted is not None:
            conditions.append({"type": "Evicted", "status": "True", "reason": "Preempted", "message": self.evicted})
        return {"metadata": {"name": f"jobset-{self.name}"}, "status": {"conditions": conditions}}

    @property
    def pin(self) -> int | None:
        value = int(self.manifest["metadata"].get("annotations", {}).get(ANNOTATION_RESUME_STEP, "-1"))
        return None if value < 0 else value

    def body(self) -> dict[str, Any]:
        metadata = {**self.manifest["metadata"], "creationTimestamp": stamp(self.created)}
        conditions: list[dict[str, Any]] = []
        if self.state in ("Completed", "Failed"):
            conditions.append(
                {
                    "type": self.state,
                    "status": "True",
                    "reason": self.state,
                    "message": "",
                    "lastTransitionTime": stamp(self.ended_at),
                }
            )
        if self.resumed_at is not None:
            conditions.append({"type": "Suspended", "status": "False", "lastTransitionTime": stamp(self.resumed_at)})
        elif self.suspended:
            conditions.append({"type": "Suspended", "status": "True", "lastTransitionTime": stamp(self.created)})
        status: dict[str, Any] = {"conditions": conditions}
        if self.current_round is not None:
            status["currentInPlaceRestartAttempt"] = self.current_round
        if self.previous_round is not None:
            status["previousInPlaceRestartAttempt"] = self.previous_round
        return {"metadata": metadata, "spec": self.manifest["spec"], "status": status}


@dataclass
class Save:
    step: int
    group: tuple[str, int]
    commits_at: int
    began: int
    cut: bool = False  # its directory was removed under it (another trainer's start-up)


@dataclass
class Group:
    """The trainer processes of one JobSet run."""

    key: tuple[str, int]
    attempt: int
    uid: str
    pods: list[str]
    started: int | None = None  # all processes up: the restore happened
    step: int = 0
    restored: int | None = None
    stopping_at: int | None = None  # the step all agreed to stop at (SIGTERM save)
    first_step_at: int | None = None  # its first step finished (the record says so from then on)
    hung: bool = False
    done: bool = False  # trained its final step; its final save is in flight until it exits


@dataclass
class Storage:
    committed: set[int] = field(default_factory=set)
    damaged: set[int] = field(default_factory=set)
    removed_by_keep: set[int] = field(default_factory=set)
    in_flight: dict[int, Save] = field(default_factory=dict)
    progress: contract.ProgressRecord | None = None
    operator_outage_until: int = -1
    workers_outage: tuple[int, int] | None = None  # (from, until): the workers' writes hang
    workers_denied_until: int = -1  # storage answers the workers' identity 403 (an IAM binding removed)

    def blind_for_workers(self, now: int) -> bool:
        return self.workers_outage is not None and self.workers_outage[0] <= now < self.workers_outage[1]

    def latest(self) -> int | None:
        return max(self.committed, default=None)


@dataclass(frozen=True)
class Config:
    """The job and the world's constants (a schedule's first draw)."""

    slices: int = 2
    spare_pools: int = 1
    final_step: int = 120
    save_every: int = 10
    save_seconds: int = 3  # an async save's write, also the SIGTERM save's
    final_save_seconds: int = 0  # the final step's save (0: save_seconds); a big model's on slow storage is longer
    startup_seconds: int = 4  # image, JAX start-up, restore, compilation
    keep: int = 3
    backoff_seconds: int = 0
    max_restarts: int = 3
    hang_timeout_seconds: int = 60
    repair_seconds: int = 30  # a deleted node's replacement joins its pool
    elastic: bool = False  # spec.elastic: minSlices 1
    shrink_after_seconds: int = 20
    grow_after_seconds: int = 30  # the least spec.elastic.growAfterSeconds allows
    auto_repair_seconds: int = 600  # GKE deletes a node that stays NotReady this long
    pod_gc_seconds: int = 40  # the pod GC marks pods of a deleted node Failed after its quarantine
    pod_watch_lag_seconds: int = 0  # the operator's pod cache shows the pods as they were this long ago
    kueue: bool = False  # the job's JobSets go through a Kueue LocalQueue
    in_place: bool = False  # spec.restart.strategy InPlace: JobSet restarts the workers on their nodes
    in_place_max_restarts: int = 2
    storage_wait_seconds: int = 600  # TPUJOB_STORAGE_WAIT_SECONDS' default
    trainer_gives_up_on_storage: bool = True  # False: the trainer before issue 30's item 7 (python -m tests.sim.hunt)
    # A trainer blocked in its final save writes its record again, for at most the hang timeout (the trainer
    # library's KeepFresh). False: the trainer before it, whose record stays silent (python -m tests.sim.hunt).
    trainer_keeps_record_fresh_in_saves: bool = True

    @property
    def record_unwritable_limit_seconds(self) -> int:
        """The trainer library's RunConfig.record_unwritable_limit_seconds for this job."""
        return min(self.storage_wait_seconds, self.hang_timeout_seconds // 2)


@dataclass(frozen=True)
class Fault:
    time: int
    cause: Cause
    what: str
    effect: Effect


@dataclass
class Truth:
    """What really happened, which the operator can only infer."""

    faults: dict[tuple[str, int], list[Fault]] = field(default_factory=dict)  # per trainer group, in order
    killed_saving: list[str] = field(default_factory=list)  # a healthy trainer killed before its save committed
    overlaps: list[str] = field(default_factory=list)


class World:
    def __init__(self, config: Config, training_job: dict[str, Any]) -> None:
        self.config = config
        self.version = 0  # counts changes (`changed` set)
        self._changed = True
        self.now = 0
        self._serial = 0
        self.nodes: dict[str, Node] = {}
        for pool in range(config.slices + config.spare_pools):
            self._add_node(pool)
        self.jobsets: dict[str, JobSet] = {}
        self.pods: dict[str, Pod] = {}
        self.groups: dict[tuple[str, int], Group] = {}
        self.storage = Storage()
        self.training_job: dict[str, Any] | None = training_job
        self.training_job_name: str = training_job["metadata"]["name"]
        self.truth = Truth()
        # The pods' bodies at the end of each second, with the world's version then (unchanged: not rebuilt).
        self.pod_history: dict[int, tuple[int, list[dict[str, Any]]]] = {}
        self._later: list[tuple[int, Callable[[], None]]] = []  # what someone does at a given second

    # -- the objects -------------------------------------------------------------------------------

    def _add_node(self, pool: int) -> None:
        self._serial += 1
        node = Node(f"pool{pool}-n{self._serial}", pool)
        self.nodes[node.name] = node
        self.changed = True

    def node_body(self, node: Node) -> dict[str, Any]:
        ready = "True" if node.reachable else "Unknown"
        return {
            "metadata": {
                "name": node.name,
                "labels": {
                    contract.NODE_POOL_LABEL: f"pool{node.pool}",
                    contract.ACCELERATOR_LABEL: ACCELERATOR,
                    contract.TOPOLOGY_LABEL: TOPOLOGY,
                },
            },
            "spec": {},
            "status": {
                "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": stamp(node.unreachable_since)}]
            },
        }

    def live_pods(self) -> list[Pod]:
        return [p for p in self.pods.values() if not p.gone]

    def live_jobsets(self) -> list[JobSet]:
        return list(self.jobsets.values())

    def create_jobset(self, manifest: dict[str, Any]) -> bool:
        """The apiserver's create: False when the name is taken (the caller adopts it if it is its own)."""
        name = manifest["metadata"]["name"]
        if name in self.jobsets:
            return False
        self.jobsets[name] = JobSet(manifest, self.now)
        self.changed = True
        return True

    def delete_jobset(self, name: str, grace: int | None) -> None:
        """Delete a JobSet (propagation Background: it goes at once, the garbage collector deletes its
        Jobs' pods after it); its pods with `grace` (None: their own)."""
        js = self.jobsets.pop(name, None)
        if js is None:
            return
        for pod in self._pods_of(js):
            self._delete_pod(pod, TERMINATION_GRACE_SECONDS if grace is None else grace)
        self.changed = True

    def set_suspend(self, name: str, suspend: bool) -> None:
        js = self.jobsets.get(name)
        if js is None:
            return
        was = js.suspended
        js.manifest["spec"]["suspend"] = suspend
        js.manifest["metadata"].setdefault("annotations", {})[contract.ANNOTATION_SUSPENDED] = str(suspend).lower()
        if was and not suspend:
            js.resumed_at, js.run = self.now, js.run + 1
        self.changed = True

    def fail_pod_on_gone_node(self, name: str, node: str) -> None:
        pod = self.pods.get(name)
        if pod is None or pod.gone or (node in self.nodes and self.nodes[node].exists):
            return
        self._end(pod, "Failed", None, "NodeLost", disruption="NodeGone")

    def delete_slice_job(self, name: str, uid: str) -> None:
        """Delete a slice's Job if it is that uid (propagation Background: the garbage collector deletes its
        pods with their own grace); JobSet recreates it under its name (a new uid) at its next reconcile."""
        for js in self.jobsets.values():
            for index in range(js.slices):
                if slice_job_name(js.name, index) == name and js.job_uid(index) == uid:
                    js.job_generations[index] = js.job_generations.get(index, 0) + 1
                    for pod in self._pods_of(js):
                        if pod.job_uid == uid:
                            self._delete_pod(pod, TERMINATION_GRACE_SECONDS)
                    self.changed = True

    def delete_ended_pod(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is not None:
            pod.gone = True
            self.changed = True

    def _pods_of(self, js: JobSet) -> list[Pod]:
        return [p for p in self.live_pods() if p.jobset == js.name]

    def _delete_pod(self, pod: Pod, grace: int) -> None:
        deadline = self.now + grace
        if pod.deleting_until is not None and pod.deleting_until <= deadline:
            return
        first = pod.deleting_until is None
        pod.deleting_until = deadline
        self.changed = True
        if not self._kubelet_hears(pod) and pod.node is not None:
            return  # no kubelet hears of it: the pod stays, Terminating, and its process runs on
        if pod.ended() or not pod.process_alive:
            pod.gone = True
        elif first:
            self._sigterm(pod)

    def _kubelet_hears(self, pod: Pod) -> bool:
        node = self.nodes.get(pod.node or "")
        return node is not None and node.exists and node.reachable

    def _end(
        self, pod: Pod, phase: str, exit_code: int | None, reason: str | None, disruption: str | None = None
    ) -> None:
        pod.phase, pod.exit_code, pod.reason, pod.finished_at = phase, exit_code, reason, self.now
        if disruption is not None:
            pod.disruption = disruption
        pod.process_alive = False
        self.changed = True

    # -- the trainer -------------------------------------------------------------------------------

    def _group_of(self, pod: Pod) -> Group | None:
        return self.groups.get((pod.jobset, pod.run))

    def _processes(self, group: Group) -> list[Pod]:
        """The group's pods whose process is the group's (an in-place round restarts them as a newer group)."""
        return [self.pods[n] for n in group.pods if self.pods[n].run == group.key[1]]

    def _all_alive(self, group: Group) -> bool:
        processes = self._processes(group)
        return len(processes) == len(group.pods) and all(p.process_alive for p in processes)

    def _healthy(self, group: Group) -> bool:
        return group.started is not None and not group.hung and self._all_alive(group)

    def _sigterm(self, pod: Pod) -> None:
        """The trainer's SIGTERM: all processes agree on a step and save it (checkpoint.saveOnPreemption),
        then exit 143; a trainer that cannot (a peer is gone, it hangs, it has not started) exits at once."""
        group = self._group_of(pod)
        if group is None or not self._healthy(group):
            if pod.process_alive:
                self._process_exits(pod, 143)
            return
        if group.stopping_at is None:
            group.stopping_at = group.step
            if group.step not in self.storage.committed and group.step not in self.storage.in_flight:
                self._begin_save(group, group.step)

    def _process_exits(self, pod: Pod, code: int) -> None:
        pod.process_alive = False
        js = self.jobsets.get(pod.jobset)
        restarted = js is not None and js.in_place and code not in NOT_RESTARTED_EXIT_CODES
        if restarted and pod.deleting_until is None:
            self._container_restarts(pod, code)
            return
        if pod.deleting_until is not None:
            if self._kubelet_hears(pod):
                pod.gone = True
                self.changed = True
            return
        self._end(pod, "Succeeded" if code == 0 else "Failed", code, "Completed" if code == 0 else "Error")

    def _begin_save(self, group: Group, step: int, seconds: int | None = None) -> None:
        self.storage.in_flight[step] = Save(step, group.key, self.now + (seconds or self.config.save_seconds), self.now)

    def _keep_record_fresh(self, group: Group) -> None:
        """A trainer blocked in its final save writes its record again each second, for at most the hang
        timeout of that save (KeepFresh); past it, its silence is the hang clock's to judge."""
        save = self.storage.in_flight.get(group.step)
        if not self.config.trainer_keeps_record_fresh_in_saves or save is None or save.group != group.key:
            return
        if self.now - save.began <= self.config.hang_timeout_seconds and self._healthy(group):
            self._write_progress(group)

    def _start(self, group: Group, pin: int | None) -> None:
        """Orbax's start-up removes every uncommitted step directory; the restore takes the newest committed
        step (the pin rule: the pinned step or a newer one)."""
        for save in self.storage.in_flight.values():
            if save.group != group.key:
                save.cut = True
        alive = [  # a group with a dead process is stuck in its collectives: it writes nothing more
            other.key
            for other in self.groups.values()
            if other.key != group.key
            and (other.attempt < group.attempt or (other.key[0] == group.key[0] and other.key[1] < group.key[1]))
            and self._all_alive(other)
        ]
        if alive:
            self.truth.overlaps.append(f"t={self.now}: attempt {group.attempt} started while {alive} still ran")
        latest = self.storage.latest()
        group.started, group.restored = self.now, latest
        group.step = latest or 0
        del pin  # the newest committed step is at least the pin: the pin rule never goes back
        self._write_progress(group)

    def _write_progress(self, group: Group) -> None:
        if self.storage.blind_for_workers(self.now):
            return  # the write hangs; the next one after the outage carries the news
        started = stamp(group.started or self.now)
        self.storage.progress = contract.ProgressRecord(
            step=group.step,
            attempt=group.attempt,
            updated_at=stamp(self.now),
            uid=group.uid,
            last_committed_step=self.storage.latest(),
            resumed_from_step=group.restored,
            restored_step=group.restored,
            restored_from="gcs" if group.restored is not None else None,
            process_started_at=started,
            restore_started_at=started,
            restore_finished_at=started,
            first_step_at=None if group.first_step_at is None else stamp(group.first_step_at),
        )

    def _commit_saves(self) -> None:
        for step, save in sorted(self.storage.in_flight.items()):
            if self.storage.blind_for_workers(self.now):
                save.commits_at = max(save.commits_at, self.now + 1)  # its writes hang until storage is back
            if save.commits_at > self.now:
                continue
            del self.storage.in_flight[step]
            group = self.groups[save.group]
            if not self._all_alive(group):
                continue  # a process died before the commit (it needs every one): the step stays uncommitted
            self.storage.committed.add(step)
            if save.cut:
                self.storage.damaged.add(step)
            for old in sorted(self.storage.committed)[: -self.config.keep]:
                self.storage.committed.discard(old)
                self.storage.removed_by_keep.add(old)
            if group.stopping_at == step or (group.done and step == group.step):
                for pod in self._processes(group):
                    if pod.process_alive:
                        self._process_exits(pod, 0 if group.done else 143)

    def _train(self, group: Group) -> None:
        if group.done:
            self._keep_record_fresh(group)
        if group.started is None or group.done or group.hung or group.stopping_at is not None:
            return
        if not self._healthy(group):
            return  # a peer is gone: the others wait in a collective
        group.step += 1
        if group.first_step_at is None:
            group.first_step_at = self.now
        self._write_progress(group)
        if group.step >= self.config.final_step:
            group.done = True
            self._begin_save(group, group.step, self.config.final_save_seconds)
        elif group.step % self.config.save_every == 0 and not any(
            s.group == group.key for s in self.storage.in_flight.values()
        ):
            self._begin_save(group, group.step)

    # -- one second --------------------------------------------------------------------------------

    def later(self, seconds: int, action: Callable[[], None]) -> None:
        self._later.append((self.now + seconds, action))

    def tick(self) -> None:
        self.now += 1
        due = [action for at_second, action in self._later if at_second <= self.now]
        self._later = [(t, a) for t, a in self._later if t > self.now]
        for action in due:
            action()
        self._nodes()
        self._kueue()
        self._jobset_controller()
        self._scheduler()
        self._kubelets()
        self._commit_saves()
        self._trainers_give_up_on_storage()
        self._trainers_denied()
        for group in list(self.groups.values()):
            self._train(group)
        if self.config.pod_watch_lag_seconds:
            last = self.pod_history.get(self.now - 1)
            if last is None or last[0] != self.version:
                last = (self.version, [p.body() for p in self.live_pods()])
            self.pod_history[self.now] = last
            self.pod_history.pop(self.now - self.config.pod_watch_lag_seconds - 2, None)

    @property
    def changed(self) -> bool:
        """Something the operator watches changed (a watch event is due); setting it counts a version."""
        return self._changed

    @changed.setter
    def changed(self, value: bool) -> None:
        self.version += int(value)
        self._changed = value

    def pods_seen(self) -> list[dict[str, Any]]:
        """The pods as the operator's watch has delivered them (its lag behind the apiserver)."""
        lag = self.config.pod_watch_lag_seconds
        if not lag:
            return [p.body() for p in self.live_pods()]
        return self.pod_history.get(max(0, self.now - lag), (0, []))[1]

    def pods_seen_changed(self) -> bool:
        """Whether the lagging pod watch delivers news this second (a watch event)."""
        lag = self.config.pod_watch_lag_seconds
        if not lag:
            return False
        seen, before = self.pod_history.get(self.now - lag), self.pod_history.get(self.now - lag - 1)
        return seen is not None and (before is None or seen[0] != before[0])

    def _nodes(self) -> None:
        """The pod GC marks the pods of a deleted node Failed after its quarantine (its delete that follows
        is not modelled: the operator keeps what an ended pod said)."""
        for pod in self.live_pods():
            node = self.nodes.get(pod.node or "")
            if node is None or node.exists:
                continue
            pod.process_alive = False
            if pod.deleting_until is not None:
                pod.gone = True
                self.changed = True
            elif not pod.ended() and self.now - node.deleted_at >= self.config.pod_gc_seconds:
                self._end(pod, "Failed", None, "NodeLost", disruption="DeletionByPodGC")

    def _jobset_controller(self) -> None:
        for js in list(self.jobsets.values()):
            pods = self._pods_of(js)
            if self.training_job is None:  # the garbage collector follows the owner reference
                self.delete_jobset(js.name, None)
                continue
            if js.state != "Active":  # a finished JobSet is left as it is, suspended or not
                continue
            if js.suspended:
                for pod in pods:
                    self._delete_pod(pod, TERMINATION_GRACE_SECONDS)
                continue
            if js.in_place:
                self._in_place_rounds(js, pods)
                continue
            run = [p for p in pods if p.run == js.run]
            if any(p.phase == "Failed" for p in run) or self._deleted_unended(js):
                js.state, js.ended_at = "Failed", self.now  # failurePolicy maxRestarts 0: the Jobs' other pods
                # get their own grace
                for pod in run:
                    if not pod.ended():
                        self._delete_pod(pod, TERMINATION_GRACE_SECONDS)
                self.changed = True
                continue
            if len(run) == js.slices and all(p.phase == "Succeeded" for p in run):
                js.state, js.ended_at = "Completed", self.now
                self.changed = True
                continue
            have = {p.slice for p in run}
            for index in range(js.slices):
                if index not in have and not any(
                    p.jobset == js.name and p.slice == index and p.run == js.run for p in self.pods.values()
                ):
                    if js.waits_for_old_pods and any(p.slice == index and not p.ended() for p in pods):
                        continue  # the previous run's pod of this slice still terminates
                    pod = self._create_pod(js, index)
                    key = (js.name, js.run)
                    group = self.groups.setdefault(key, Group(key, js.attempt, js.uid, []))
                    group.pods.append(pod.name)

    def _create_pod(self, js: JobSet, index: int) -> Pod:
        """The Job controller's pod for slice `index` of the JobSet's current run."""
        self._serial += 1
        pod = Pod(f"{js.name}-slice-{index}-0-{self._serial}", js.name, js.attempt, js.uid, index, js.run, self.now)
        pod.job_uid = js.job_uid(index)
        self.pods[pod.name] = pod
        self.changed = True
        return pod

    def _in_place_rounds(self, js: JobSet, pods: list[Pod]) -> None:
        """JobSet's InPlaceRestart with its agents (JobSet v0.12, pkg/controllers/in_place_restart.go and
        cmd/in-place-restart-agent): a failed pod is replaced by its Job (podReplacementPolicy Failed); each
        agent, on its start, annotates its pod with the round it joins (0 first, then the JobSet's current
        round + 1) and holds the worker at a barrier; when every pod is at one round the controller makes it
        current and the workers start (a new trainer group); while they disagree it marks the round below
        the highest as previous, and an agent at or below it restarts its container (exit 86). A container
        restarted more often than failurePolicy.maxRestarts, or a round past it, fails the JobSet."""
        done = {p.slice for p in pods if p.phase == "Succeeded"}
        if len(done) == js.slices:
            js.state, js.ended_at = "Completed", self.now
            self.changed = True
            return
        for index in range(js.slices):  # each slice's Job replaces its own pods only, after its back-off
            job_uid = js.job_uid(index)
            running = any(p.job_uid == job_uid and not p.ended() for p in pods)
            if index not in done and not running and self.now >= self._job_backoff_ends(job_uid):
                self._create_pod(js, index)
        live = [p for p in self._pods_of(js) if p.phase != "Failed"]
        rounds = [p.in_place_attempt for p in live if p.in_place_attempt is not None]
        restarts = max((p.restart_count for p in live), default=0)
        if restarts > js.max_restarts or max(rounds, default=0) > js.max_restarts:
            js.state, js.ended_at = "Failed", self.now  # ReachedMaxRestarts
            self.changed = True
            return
        for pod in live:  # the agents
            if pod.phase != "Running" or not self._kubelet_hears(pod):
                continue
            if not pod.agent_joined:
                pod.in_place_attempt = 0 if js.current_round is None else js.current_round + 1
                pod.agent_joined = True
                self.changed = True
            elif js.previous_round is not None and (pod.in_place_attempt or 0) <= js.previous_round:
                self._container_restarts(pod, IN_PLACE_RESTART_EXIT_CODE)
            elif not pod.process_alive and pod.in_place_attempt == js.current_round and pod.run == js.run:
                pod.process_alive, pod.running_at = True, self.now  # the barrier lifts: its worker starts
                self.changed = True
        rounds = [p.in_place_attempt for p in live if p.in_place_attempt is not None]
        if len(rounds) == len(live) == js.slices and len(set(rounds)) == 1:
            if js.current_round != rounds[0]:
                if js.current_round is not None:
                    js.run += 1  # a new round: its workers are a new trainer group
                js.current_round = rounds[0]
                key = (js.name, js.run)
                self.groups[key] = Group(key, js.attempt, js.uid, [p.name for p in live])
                for pod in live:
                    pod.run = js.run
                self.changed = True
        elif rounds and max(rounds) > 0 and js.previous_round != max(rounds) - 1:
            js.previous_round = max(rounds) - 1
            self.changed = True

    def _job_backoff_ends(self, job_uid: str) -> int:
        """When the Job controller creates a Job's next pod (pkg/controller/job/backoff_utils.go): 10 s after
        its last failed pod ended, doubled at each failure of that Job, at most 600 s. The record is the
        Job's (kept in the controller's memory, dropped with the Job)."""
        failed = [p for p in self.pods.values() if p.job_uid == job_uid and p.phase == "Failed"]
        if not failed:
            return 0
        last = max(p.finished_at or p.created for p in failed)
        return last + min(JOB_POD_FAILURE_BACKOFF_SECONDS * 2 ** (len(failed) - 1), JOB_POD_FAILURE_BACKOFF_MAX_SECONDS)

    def _container_restarts(self, pod: Pod, code: int) -> None:
        """The kubelet restarts the worker container on its node (its restart rules); the agent that starts
        in it has joined no round yet."""
        pod.process_alive = False
        pod.restart_count += 1
        pod.last_exit_code, pod.last_finished_at = code, self.now
        pod.agent_joined = False
        self.changed = True

    def _kueue(self) -> None:
        """Kueue admits a queued JobSet (resumes it) once no workload holds its quota and, after an
        eviction, once the JobSet has stopped (no pod of it left that is not being deleted: Job
        status.active); the operator never resumes one."""
        for js in self.jobsets.values():
            waiting = js.queued and js.state == "Active" and js.suspended and js.admitted_at is None
            stopped = all(p.ended() or p.deleting_until is not None for p in self._pods_of(js))
            if waiting and stopped and self.now >= js.held_until:
                js.admitted_at, js.evicted = self.now, None
                self.set_suspend(js.name, False)

    def _deleted_unended(self, js: JobSet) -> bool:
        """The Job controller counts a pod of its own that was deleted before it ended as failed (an
        eviction's, a preemption's): with backoffLimit 0 the Job, and so the JobSet, fails."""
        return any(
            p.gone and not p.ended() and p.jobset == js.name and p.run == js.run and p.created >= js.created
            for p in self.pods.values()
        )

    def _scheduler(self) -> None:
        for pod in sorted(self.live_pods(), key=lambda p: p.name):
            if pod.node is not None or pod.deleting_until is not None:
                continue
            free = next((n for n in sorted(self.nodes.values(), key=lambda n: n.name) if self._free(n)), None)
            if free is not None:
                pod.node, pod.scheduled_at, pod.unschedulable = free.name, self.now, False
                self.changed = True
            elif not pod.unschedulable:
                pod.unschedulable = True
                self.changed = True

    def _free(self, node: Node) -> bool:
        if not (node.exists and node.reachable) or node.tenant_until >= self.now:
            return False
        return not any(p.node == node.name and not p.gone and not p.ended() for p in self.pods.values())

    def _note_cut_save(self, pod: Pod) -> None:
        group = self._group_of(pod)
        if self.storage.blind_for_workers(self.now):
            return  # no grace could have let the save commit
        if group is not None and not self._all_alive(group):
            return  # a peer died first: the save, which needs every process, could never commit
        if group is not None and group.stopping_at is not None and group.stopping_at not in self.storage.committed:
            step = group.stopping_at
            self.truth.killed_saving.append(
                f"t={self.now}: {pod.name} killed before its SIGTERM save of {step} committed"
            )

    def _kubelets(self) -> None:
        for pod in self.live_pods():
            killed = pod.deleting_until is not None and pod.process_alive and self.now >= pod.deleting_until
            if killed and self._kubelet_hears(pod):  # SIGKILL
                self._note_cut_save(pod)
                pod.process_alive, pod.gone = False, True
                self.changed = True
            starts = pod.phase == "Pending" and pod.node is not None and pod.deleting_until is None
            if starts and self._kubelet_hears(pod):
                js = self.jobsets.get(pod.jobset)
                barrier = js is not None and js.in_place  # its agent holds the worker until the round starts
                pod.phase, pod.running_at, pod.process_alive = "Running", self.now, not barrier
                self.changed = True
        for group in self.groups.values():
            if group.started is not None:
                continue
            pods = self._processes(group)
            js = self.jobsets.get(group.key[0])
            if (
                js is None
                or len(pods) < js.slices
                or not all(p.process_alive and p.running_at is not None for p in pods)
            ):
                continue
            if self.storage.blind_for_workers(self.now):
                continue  # its storage probe waits (the outages modelled end within the storage wait)
            if self.now - max(p.running_at or 0 for p in pods) >= self.config.startup_seconds:
                self._start(group, js.pin)

    def _trainers_give_up_on_storage(self) -> None:
        """A training trainer whose record has been unwritable for the limit exits 3 (every process:
        process 0 first, the others as its collateral)."""
        outage = self.storage.workers_outage
        if (
            not self.config.trainer_gives_up_on_storage
            or outage is None
            or not self.storage.blind_for_workers(self.now)
        ):
            return
        if self.now - outage[0] < self.config.record_unwritable_limit_seconds:
            return
        for group in self.groups.values():
            if group.started is None:
                continue  # its final save too: the watchdog watches until the record's last write
            for pod in self._processes(group):
                if pod.process_alive:  # a stopping one too: its SIGTERM save cannot land either
                    self._blame(pod, "infrastructure", "storage lost for the workers")
                    self._process_exits(pod, 3)

    def _trainers_denied(self) -> None:
        """Storage refuses the workers' identity: a starting trainer's probe, or a training one's next
        write, gets 403, and every process exits 5 (no restart can fix it)."""
        if self.now >= self.storage.workers_denied_until:
            return
        for group in self.groups.values():
            for pod in self._processes(group):
                if pod.process_alive and pod.running_at is not None:
                    self._blame(pod, "infrastructure", "storage refused the workers (403)")
                    self._process_exits(pod, int(contract.ExitCode.STORAGE_PERMISSION_DENIED))

    # -- faults ------------------------------------------------------------------------------------

    def _target(self, index: int) -> Pod | None:
        running = sorted(
            (p for p in self.live_pods() if p.process_alive and p.deleting_until is None), key=lambda p: p.name
        )
        return running[index % len(running)] if running else None

    def _blame(self, pod: Pod, cause: Cause, what: str, effect: Effect = "ends") -> None:
        self.truth.faults.setdefault((pod.jobset, pod.run), []).append(Fault(self.now, cause, what, effect))

    def crash(self, index: int) -> None:
        if (pod := self._target(index)) is not None:
            self._blame(pod, "job", "crash")
            self._process_exits(pod, 1)

    def evict_for_memory(self, index: int) -> None:
        """Node-pressure eviction: the job's own memory (or its local tier's tmpfs) filled the node."""
        if (pod := self._target(index)) is not None:
            self._blame(pod, "job", "node-pressure eviction")
            self._end(pod, "Failed", 137, "Evicted", disruption="TerminationByKubelet")

    def drain(self, index: int) -> None:
        """A drain (maintenance, an upgrade) evicts a worker through the Eviction API: a DisruptionTarget,
        then the pod's deletion with its own grace, which its SIGTERM save may use; once it has ended
        the pod is gone from the apiserver, and its DisruptionTarget with it."""
        if (pod := self._target(index)) is not None:
            self._blame(pod, "infrastructure", "evicted by a drain")
            pod.disruption = "EvictionByEvictionAPI"
            self._delete_pod(pod, TERMINATION_GRACE_SECONDS)

    def kueue_preempt(self, seconds: int) -> None:
        """A higher-priority workload takes the queue's quota: Kueue evicts the admitted JobSet (suspends
        it: its workers get their grace to save) and admits it again once that workload is done."""
        for js in self.jobsets.values():
            if js.queued and js.state == "Active" and js.admitted_at is not None:
                for pod in self._pods_of(js):
                    if pod.process_alive:
                        self._blame(pod, "infrastructure", "preempted by Kueue")
                js.admitted_at, js.held_until = None, self.now + seconds
                js.evicted = "Preempted to accommodate a workload (UID: w-2) due to prioritization in the ClusterQueue"
                self.set_suspend(js.name, True)

    def node_shutdown(self, index: int) -> None:
        """Graceful node shutdown (spot reclaim, maintenance): the kubelet ends the pod, the node goes."""
        if (pod := self._target(index)) is not None:
            self._blame(pod, "infrastructure", "node shutdown")
            self._end(pod, "Failed", 143, "Terminated", disruption="TerminationByKubelet")
            self._replace_node(self.nodes[pod.node or ""])

    def node_lost(self, index: int) -> None:
        if (pod := self._target(index)) is not None:
            self._blame(pod, "infrastructure", "node lost")
            self._replace_node(self.nodes[pod.node or ""])

    def partition(self, index: int) -> None:
        """The node's kubelet loses the apiserver; its trainer runs on (and writes to storage)."""
        if (pod := self._target(index)) is not None:
            self._blame(pod, "infrastructure", "node partitioned", "signals")
            node = self.nodes[pod.node or ""]
            node.reachable, node.unreachable_since = False, self.now
            self.changed = True

    def heal_partitions(self) -> None:
        for node in self.nodes.values():
            if node.exists and not node.reachable:
                node.reachable, node.unreachable_since = True, self.now
                for pod in self.live_pods():  # the kubelet hears of the deletions it missed
                    if pod.node != node.name or pod.deleting_until is None:
                        continue
                    if pod.deleting_until <= self.now or not pod.process_alive:
                        pod.process_alive, pod.gone = False, True
                    else:
                        self._sigterm(pod)
        self.changed = True

    def auto_repair(self) -> None:
        """GKE deletes nodes that stayed NotReady (node auto-repair) and brings new ones."""
        for node in list(self.nodes.values()):
            if node.exists and not node.reachable:
                for pod in self.live_pods():
                    if pod.node == node.name and pod.process_alive:
                        self._blame(pod, "infrastructure", "node repaired")
                self._replace_node(node)

    def _replace_node(self, node: Node) -> None:
        """The node goes; its replacement joins the pool repair_seconds later."""
        node.exists, node.deleted_at = False, self.now
        for pod in self.live_pods():
            if pod.node == node.name:
                pod.process_alive = False
        self.later(self.config.repair_seconds, lambda: self._add_node(node.pool))
        self.changed = True

    def hang(self, index: int) -> None:
        if (pod := self._target(index)) is not None and (group := self._group_of(pod)) is not None:
            self._blame(pod, "job", "hang", "stalls")
            group.hung = True

    def other_tenant(self, pool: int, seconds: int) -> None:
        """Another team's batch job takes a free pool's TPUs for a while."""
        node = next((n for n in self.nodes.values() if n.exists and n.pool == pool), None)
        if node is not None and self._free(node):
            node.tenant_until = self.now + seconds
            self.changed = True

            def gone() -> None:
                self.changed = True

            self.later(seconds + 1, gone)

    def occupied_nodes(self) -> set[str]:
        """Nodes where a pod holding TPU chips runs (another tenant's, or any of the job's not yet ended)."""
        held = {n.name for n in self.nodes.values() if n.tenant_until >= self.now}
        return held | {p.node for p in self.live_pods() if p.node is not None and not p.ended()}

    def storage_outage(self, seconds: int) -> None:
        """Checkpoint storage refuses the operator's reads (the workers still reach it)."""
        self.storage.operator_outage_until = self.now + seconds

    def workers_storage_outage(self, seconds: int) -> None:
        """Checkpoint storage hangs for the workers (the operator still reads it): a network path of
        the node pools alone. One that begins while another lasts extends it: storage never answered
        in between, so the trainer's watchdog counts from the first."""
        begins, ends = self.now, self.now + seconds
        if self.storage.blind_for_workers(self.now) and self.storage.workers_outage is not None:
            begins, ends = self.storage.workers_outage[0], max(ends, self.storage.workers_outage[1])
        self.storage.workers_outage = (begins, ends)
        for group in self.groups.values():  # their records go silent: a hang as the operator sees it
            if group.started is not None and not group.done and seconds > 0:
                for pod in (p for p in self._processes(group) if p.process_alive):
                    self._blame(pod, "infrastructure", "storage lost for the workers", "stalls")

    def workers_denied(self, seconds: int) -> None:
        """The workers' identity loses its grant on the bucket for a while (the operator's keeps it)."""
        self.storage.workers_denied_until = self.now + seconds

    def set_job_suspend(self, suspend: bool) -> None:
        if self.training_job is not None and bool(self.training_job["spec"].get("suspend")) != suspend:
            self.training_job["spec"]["suspend"] = suspend
            self.training_job["metadata"]["generation"] += 1
            self.changed = True

    def delete_job(self) -> None:
        self.training_job = None
        self.changed = True
