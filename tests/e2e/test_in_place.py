"""The restart ladder's InPlace rung on the devcluster: JobSet's InPlaceRestart with its real agent, the
pod runner restarting containers as a 1.35 kubelet does, the trainer's local tier in a memory emptyDir."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any

import yaml
from kubernetes import client, utils, watch
from tpujob_devcluster.cluster import BUCKET
from tpujob_devcluster.controlplane import tools_dir
from tpujob_devcluster.harness import CHART, live_pod_uids, lose_node, trainer_pid

V5E_TWO_SLICES: dict[str, Any] = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 2}
V4_TWO_SLICES: dict[str, Any] = {"accelerator": "tpu-v4-podslice", "topology": "2x2x1", "slices": 2}  # hot spares' own
LOCAL_INTERVAL = 5
GCS_INTERVAL = 100  # far apart: the local tier is ahead of GCS when the trainer is killed


def _apply_in_place(e2e: Any, name: str, gcs_interval: int, shape: dict[str, Any] = V5E_TWO_SLICES) -> None:
    """A 600-step 2-slice job on the InPlace rung, with the local tier every LOCAL_INTERVAL steps."""
    e2e.apply(
        name,
        600,
        restart={"strategy": "InPlace"},
        checkpoint={
            "directory": f"gs://{BUCKET}/e2e",
            "policy": "interval",
            "intervalSteps": gcs_interval,
            # No budget: the tiny model's steps are shorter than a local save blocks, and this test
            # needs the local tier every LOCAL_INTERVAL steps.
            "local": {"sizeLimit": "256Mi", "intervalSteps": LOCAL_INTERVAL, "overheadBudgetPercent": 0},
        },
        **shape,
    )


def _wait_local_ahead_of_gcs(e2e: Any, name: str) -> None:
    """Until the job trains several local intervals past GCS's first save."""
    past = GCS_INTERVAL + 4 * LOCAL_INTERVAL
    e2e.wait(name, lambda s: s.get("phase") == "Running" and (s.get("step") or 0) > past, 300, "training")


def test_a_crashed_trainer_restarts_in_place_from_the_local_tier(e2e):
    _apply_in_place(e2e, "inplace", GCS_INTERVAL)
    _wait_local_ahead_of_gcs(e2e, "inplace")
    before = live_pod_uids(e2e.core, e2e.namespace, "inplace-a0")
    assert len(before) == 2, before
    victim = e2e.running_pod("inplace-a0-slice-1-0")

    os.kill(trainer_pid(e2e.cluster.state_dir, e2e.namespace, victim), signal.SIGKILL)

    status = e2e.wait("inplace", lambda s: s.get("phase") == "Succeeded", 300, "Succeeded")
    failure = status["lastFailure"]
    assert (status["restarts"], status["inPlaceRestarts"], status["attempt"]) == (1, 1, 0), status
    assert (failure["rung"], failure["kind"], failure["reason"]) == ("InPlace", "ApplicationError", "ExitCode137")
    # The same pods on the same nodes: nothing was deleted, rescheduled or recreated.
    assert live_pod_uids(e2e.core, e2e.namespace, "inplace-a0") == before
    assert [js["metadata"]["name"] for js in e2e.jobsets()] == ["inplace-a0"]
    restarts = {p.metadata.name: p.status.container_statuses[0].restart_count for p in e2e.pods()}
    assert all(count >= 1 for count in restarts.values()), restarts  # every worker restarted, in place
    # Restored from node memory, ahead of GCS: at most the local save in flight and the one before it
    # lost (GCS alone would have lost every step since its last save), and the recovery measured. From
    # its own tier, or the other slice's where the kill cut the victim's own local save short (peer).
    record = e2e.progress("inplace")
    assert record is not None and record.restored_from in ("local", "peer"), record
    assert record.restored_step is not None and record.restored_step > GCS_INTERVAL, record
    assert failure["resumeStep"] == record.restored_step and failure["lostSteps"] <= 2 * LOCAL_INTERVAL, failure
    assert failure["recoverySeconds"] is not None and failure["timeline"]["restored"] is not None
    e2e.wait_events("inplace", {"RestartingInPlace"})


def _watch_pod_until(e2e, name: str, since: str | None, done: Any, quiet: float = 60, **selector: str) -> Any:
    """The first state of pod `name` (or of any pod the `selector` selects) after resourceVersion `since`
    that is `done` (the watch ends after `quiet` s). `since` None: from now, the pods as they are first."""
    selector = selector or {"field_selector": f"metadata.name={name}"}
    if since is None:
        listed = e2e.core.list_namespaced_pod(e2e.namespace, **selector)
        if found := [p for p in listed.items if done(p)]:
            return found[0]
        since = listed.metadata.resource_version
    stream = watch.Watch().stream(
        e2e.core.list_namespaced_pod, e2e.namespace, resource_version=since, timeout_seconds=int(quiet), **selector
    )
    for event in stream:
        if done(event["object"]):
            return event["object"]
    raise AssertionError(f"pod {name}: no state that ends the wait, and nothing for {quiet} s")


def test_an_evicted_worker_saves_its_step_on_sigterm_and_the_job_loses_nothing(e2e):
    """A drain or a preemption: SIGTERM reaches the trainer under JobSet's agent (through tpujob-init),
    which saves the step it is at to GCS, where its replacement pod restores it from. Evicted early
    (the job ends before the eviction otherwise), most often before GCS's first periodic save."""
    _apply_in_place(e2e, "inplaceevict", GCS_INTERVAL)
    e2e.wait("inplaceevict", lambda s: s.get("phase") == "Running" and (s.get("step") or 0) >= 20, 300, "training")
    evicted = e2e.running_pod("inplaceevict-a0-slice-1-0")
    e2e.core.create_namespaced_pod_eviction(
        evicted, e2e.namespace, client.V1Eviction(metadata=client.V1ObjectMeta(name=evicted, namespace=e2e.namespace))
    )
    status = e2e.wait("inplaceevict", lambda s: s.get("phase") == "Succeeded", 300, "Succeeded")
    assert "lastFailure" in status, f"the job ended before the eviction took effect: {status}"
    failure = status["lastFailure"]
    assert (failure["rung"], failure["kind"], failure["counted"]) == ("InPlace", "Preemption", False), failure
    assert (status["countedRestarts"], status["attempt"]) == (0, 0), status
    # The SIGTERM save covered the step training was at: nothing it had reported was lost.
    assert failure["resumeStep"] >= failure["step"] and failure["lostSteps"] == 0, failure
    # The replacement pod's memory volume is new: every process restored the SIGTERM save from GCS.
    record = e2e.progress("inplaceevict")
    assert record is not None and record.restored_from == "gcs", record


def _render_spares(e2e: Any, accelerator: str, topology: str, hosts: int) -> list[dict[str, Any]]:
    """The chart's hot spares (values.yaml: spares), rendered by helm for the test's namespace."""
    sets = {"name": "s", "accelerator": accelerator, "topology": topology, "hosts": hosts}
    args = [a for key, value in sets.items() for a in ("--set", f"spares.pools[0].{key}={value}")]
    helm = [str(tools_dir() / "helm"), "template", "tpujob", str(CHART), "-n", e2e.namespace]
    rendered = subprocess.run(
        [*helm, "-s", "templates/spares.yaml", *args], check=True, capture_output=True, text=True
    ).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


SPARE_SELECTOR = "app.kubernetes.io/component=spare"


def _spare_pods(e2e: Any) -> list[Any]:
    return e2e.core.list_namespaced_pod(e2e.namespace, label_selector=SPARE_SELECTOR).items


def test_a_lost_node_is_replaced_on_a_hot_spare_restored_from_the_other_slice_and_the_rest_restart_in_place(e2e):
    """No free host of the job's shape: the chart's spare placeholder holds the third v4 host. A node is
    lost: the operator marks its pod Failed at once and, once the failure is recorded, deletes the
    slice's Job for JobSet to recreate (no Job back-off). The replacement preempts the placeholder (the
    real kube-scheduler: priority -1000 below the workers' 0) and starts on its host, and receives the
    newest local step from the other slice; the other pod restarts in place. The spare Deployment's new
    placeholder is unschedulable while no host is free, and runs again once the job ends."""
    docs = _render_spares(e2e, V4_TWO_SLICES["accelerator"], V4_TWO_SLICES["topology"], hosts=1)
    try:
        for doc in docs:
            utils.create_from_dict(e2e.core.api_client, doc, namespace=e2e.namespace)

        def holding() -> list[Any]:
            return [p for p in _spare_pods(e2e) if p.status.phase == "Running" and p.spec.node_name]

        e2e.until(lambda: bool(holding()), 120, "the spare placeholder Running on a host")
        [spare] = holding()
        _apply_in_place(e2e, "inplacenode", GCS_INTERVAL, V4_TWO_SLICES)
        _wait_local_ahead_of_gcs(e2e, "inplacenode")
        before = live_pod_uids(e2e.core, e2e.namespace, "inplacenode-a0")
        assert len(before) == 2, before
        job_hosts = {e2e.core.read_namespaced_pod(n, e2e.namespace).spec.node_name for n in before}
        assert spare.spec.node_name not in job_hosts
        lost = e2e.running_pod("inplacenode-a0-slice-1-0")
        [kept] = [name for name in before if name != lost]
        lost_pod = e2e.core.read_namespaced_pod(lost, e2e.namespace)
        spare = e2e.core.read_namespaced_pod(spare.metadata.name, e2e.namespace)  # a resourceVersion of now
        node = lose_node(e2e.core, e2e.namespace, lost)
        try:
            # The operator marks the pod Failed (NodeGone) as soon as its node is gone (the pod garbage
            # collector would mark it DeletionByPodGC, only after its 40 s orphan quarantine), then removes
            # it once the failure is recorded: the pod's watch shows every state it went through.
            failed = _watch_pod_until(
                e2e, lost, lost_pod.metadata.resource_version, lambda p: p.status.phase == "Failed"
            )
            assert [c.reason for c in failed.status.conditions if c.type == "DisruptionTarget"] == ["NodeGone"]
            preempted = _watch_pod_until(
                e2e, spare.metadata.name, spare.metadata.resource_version,
                lambda p: any(c.type == "DisruptionTarget" for c in p.status.conditions or []),
            )  # fmt: skip
            [reason] = [c.reason for c in preempted.status.conditions if c.type == "DisruptionTarget"]
            assert reason == "PreemptionByScheduler", preempted.status.conditions

            # The Deployment's new placeholder finds no free host (the job's two and the spare's are taken)...
            def unschedulable(p: Any) -> bool:
                scheduled = [(c.status, c.reason) for c in p.status.conditions or [] if c.type == "PodScheduled"]
                return p.metadata.name != spare.metadata.name and scheduled == [("False", "Unschedulable")]

            since = preempted.metadata.resource_version
            waiting = _watch_pod_until(e2e, "a new spare", since, unschedulable, label_selector=SPARE_SELECTOR)
            status = e2e.wait("inplacenode", lambda s: s.get("phase") == "Succeeded", 360, "Succeeded")
            failure = status["lastFailure"]
            assert (failure["rung"], failure["kind"], failure["counted"]) == ("InPlace", "NodeLost", False), failure
            assert (status["restarts"], status["inPlaceRestarts"], status["attempt"]) == (1, 1, 0), status
            assert [js["metadata"]["name"] for js in e2e.jobsets()] == ["inplacenode-a0"]
            # The lost node's pod alone was replaced, on the spare's host; the other is the same pod, its
            # containers restarted in place.
            after = live_pod_uids(e2e.core, e2e.namespace, "inplacenode-a0")
            assert after[kept] == before[kept] and lost not in after and len(after) == 2, (before, after)
            [replacement] = [e2e.core.read_namespaced_pod(n, e2e.namespace) for n in after if n != kept]
            assert replacement.spec.node_name == spare.spec.node_name
            survivor = e2e.core.read_namespaced_pod(kept, e2e.namespace)
            assert survivor.status.container_statuses[0].restart_count >= 1, survivor.status.container_statuses
            # ... by its slice's Job recreated (the operator deleted the Job whose only pod was lost, JobSet
            # made it again): a new Job has none of the old one's pod failure back-off (10 s, doubled at each loss).
            job_name, job_uid = "batch.kubernetes.io/job-name", "batch.kubernetes.io/controller-uid"
            lost_job = lost_pod.metadata.labels
            assert replacement.metadata.labels[job_name] == lost_job[job_name] == "inplacenode-a0-slice-1"
            recreated = client.BatchV1Api(e2e.core.api_client).read_namespaced_job(lost_job[job_name], e2e.namespace)
            assert recreated.metadata.uid == replacement.metadata.labels[job_uid] != lost_job[job_uid]
            # The replacement's memory volume is new: the survivor's slice sent it the newest local step, a
            # step the bucket never had (no byte of the restore came from GCS).
            record = e2e.progress("inplacenode")
            assert record is not None and record.restored_from == "peer", record
            assert record.restored_step is not None and record.restored_step not in e2e.committed_steps("inplacenode")
            assert failure["resumeStep"] == record.restored_step and failure["lostSteps"] <= 2 * LOCAL_INTERVAL
            assert failure["restoredFrom"] == "peer", failure
            # ... and the spare is back by itself once the job has ended and freed its hosts.
            back = _watch_pod_until(
                e2e, waiting.metadata.name, None, lambda p: p.status.phase == "Running" and bool(p.spec.node_name)
            )
            assert back.spec.node_name in job_hosts | {spare.spec.node_name}
        finally:
            node.restore(e2e.core)
    finally:
        for doc in docs:
            if doc["kind"] == "PriorityClass":  # cluster-wide: the namespace's deletion leaves it
                with contextlib.suppress(client.ApiException):
                    client.SchedulingV1Api(e2e.core.api_client).delete_priority_class(doc["metadata"]["name"])
