"""The real Kueue in the devcluster admits, queues and preempts plain JobSets (no operator here).

Its own devcluster with Kueue on: two v5e 2x2 pools (4 chips each) and a ClusterQueue with TPU quota
for one 1-slice job, from examples/kueue/queues.yaml. The answers asserted are the apiserver's:
the JobSets' `spec.suspend` and Kueue's Workload objects and their conditions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client, config
from tpujob_contract import (
    ACCELERATOR_LABEL,
    JOBSET_GROUP,
    JOBSET_VERSION,
    KUEUE_GROUP,
    KUEUE_VERSION,
    PRIORITY_CLASS_LABEL,
    QUEUE_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
)
from tpujob_devcluster.cluster import DevCluster
from tpujob_devcluster.kueue import (
    CLUSTER_QUEUE,
    HIGH_PRIORITY,
    LOCAL_QUEUE,
    LOW_PRIORITY,
    QUEUES_FILE,
    flavor_name,
    queue_manifests,
)
from tpujob_devcluster.pools import load_pools

T = TypeVar("T")

POOLS = {
    "pools": [{"name": f"v5e-{c}", "accelerator": "tpu-v5-lite-podslice", "topology": "2x2"} for c in "ab"],
    "system_nodes": 1,
}
V5E = flavor_name("tpu-v5-lite-podslice", "2x2")
NAMESPACE = "default"


@pytest.fixture(scope="module")
def kueue_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    state = tmp_path_factory.mktemp("kueue-devcluster")
    pools = state / "pools.yaml"
    pools.write_text(yaml.safe_dump(POOLS))
    cluster = DevCluster(state, pools, kueue=True, kueue_tpu_quota=4).start()
    try:
        yield cluster
    finally:
        cluster.stop()


class Api:
    def __init__(self, cluster: DevCluster) -> None:
        self.api = config.new_client_from_config(str(cluster.kubeconfig))
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)

    def create_jobset(self, name: str, labels: dict[str, str], tpu: bool = True) -> None:
        """One replicated job of one pod: a v5e 2x2 host (4 chips) when `tpu`, else a system pod."""
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "tpujob-trainer:dev", "command": ["sleep", "600"]}],
        }
        if tpu:
            pod_spec["nodeSelector"] = {ACCELERATOR_LABEL: "tpu-v5-lite-podslice", TOPOLOGY_LABEL: "2x2"}
            pod_spec["tolerations"] = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
            pod_spec["containers"][0]["resources"] = {"requests": {TPU_RESOURCE: 4}, "limits": {TPU_RESOURCE: 4}}
        jobset = {
            "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
            "kind": "JobSet",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "suspend": bool(labels),  # as Kueue wants a queued JobSet created (its webhook would do it)
                "replicatedJobs": [
                    {
                        "name": "slice",
                        "replicas": 1,
                        "template": {
                            "spec": {
                                "parallelism": 1,
                                "completions": 1,
                                "backoffLimit": 0,
                                "template": {"spec": pod_spec},
                            }
                        },
                    }
                ],
            },
        }
        self.custom.create_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, NAMESPACE, "jobsets", jobset)

    def jobset(self, name: str) -> dict[str, Any]:
        found: Any = self.custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, NAMESPACE, "jobsets", name)
        return dict(found)

    def suspended(self, name: str) -> bool:
        return bool(self.jobset(name)["spec"].get("suspend"))

    def workload(self, jobset: str) -> dict[str, Any] | None:
        """Kueue's Workload for a JobSet: the one it owns."""
        found: Any = self.custom.list_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, NAMESPACE, "workloads")
        for item in found["items"]:
            owners = item["metadata"].get("ownerReferences") or []
            if any(o["kind"] == "JobSet" and o["name"] == jobset for o in owners):
                return dict(item)
        return None

    def pods(self, jobset: str) -> list[Any]:
        return list(
            self.core.list_namespaced_pod(NAMESPACE, label_selector=f"jobset.sigs.k8s.io/jobset-name={jobset}").items
        )


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for item in ((obj or {}).get("status") or {}).get("conditions") or []:
        if item["type"] == kind:
            return dict(item)
    return {}


def admitted(workload: dict[str, Any] | None) -> bool:
    return condition(workload, "Admitted").get("status") == "True"


def eventually(probe: Callable[[], T], timeout: float = 30.0, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    last: T = probe()
    while not last and time.monotonic() < deadline:
        time.sleep(0.25)
        last = probe()
    assert last, f"timed out after {timeout}s waiting for {what}"
    return last


def test_the_devcluster_applies_the_example_queues() -> None:
    """For the default pools, what the devcluster applies is examples/kueue/queues.yaml as written."""
    pools, _ = load_pools()
    written = [d for d in yaml.safe_load_all(QUEUES_FILE.read_text()) if d]
    assert queue_manifests(pools) == written
    kinds = {(d["kind"], d["metadata"]["name"]) for d in written}
    assert {("ClusterQueue", CLUSTER_QUEUE), ("LocalQueue", LOCAL_QUEUE)} <= kinds
    assert {("WorkloadPriorityClass", LOW_PRIORITY), ("WorkloadPriorityClass", HIGH_PRIORITY)} <= kinds
    # A caller's quota replaces only the TPU chips.
    queue = next(d for d in queue_manifests(pools, 16) if d["kind"] == "ClusterQueue")
    quotas = [
        {r["name"]: r["nominalQuota"] for r in f["resources"]} for f in queue["spec"]["resourceGroups"][0]["flavors"]
    ]
    assert [q[TPU_RESOURCE] for q in quotas] == [16, 16]
    assert all(q["cpu"] == "1000" for q in quotas)


@pytest.mark.slow  # its devcluster starts in 20-60 s (machine load)
def test_kueue_admits_within_quota_queues_beyond_it_and_preempts_lower_priority(kueue_cluster: DevCluster) -> None:
    api = Api(kueue_cluster)
    queue = {QUEUE_LABEL: LOCAL_QUEUE}

    # Within quota: Kueue admits the suspended JobSet and unsuspends it; the JobSet controller runs it.
    api.create_jobset("first", {**queue, PRIORITY_CLASS_LABEL: LOW_PRIORITY})
    eventually(lambda: admitted(api.workload("first")), what="first's Workload Admitted")
    first = api.workload("first")
    assert first is not None
    assert first["status"]["admission"]["clusterQueue"] == CLUSTER_QUEUE
    assignment = first["status"]["admission"]["podSetAssignments"][0]
    assert assignment["name"] == "slice" and assignment["flavors"] == {TPU_RESOURCE: V5E}
    assert first["spec"]["priorityClassRef"]["name"] == LOW_PRIORITY and first["spec"]["priority"] == 100
    eventually(lambda: not api.suspended("first"), what="first unsuspended by Kueue")
    eventually(lambda: api.pods("first"), what="first's pod")

    # Beyond quota: the second stays suspended, its Workload pending for want of TPU quota.
    api.create_jobset("second", {**queue, PRIORITY_CLASS_LABEL: LOW_PRIORITY})
    reserved = eventually(lambda: condition(api.workload("second"), "QuotaReserved"), what="second's QuotaReserved")
    assert reserved["status"] == "False" and reserved["reason"] == "Pending"
    assert "insufficient unused quota" in reserved["message"] and TPU_RESOURCE in reserved["message"]
    assert V5E in reserved["message"]
    time.sleep(2)
    assert api.suspended("second") and not api.pods("second")
    assert not admitted(api.workload("second"))

    # Without the queue label Kueue leaves a JobSet alone (manageJobsWithoutQueueName: false).
    api.create_jobset("unqueued", {}, tpu=False)
    eventually(lambda: api.pods("unqueued"), what="the unqueued JobSet's pod")
    assert not api.suspended("unqueued") and api.workload("unqueued") is None

    # A higher priority preempts the low one: Kueue evicts its Workload and suspends its JobSet.
    api.create_jobset("urgent", {**queue, PRIORITY_CLASS_LABEL: HIGH_PRIORITY})
    eventually(lambda: admitted(api.workload("urgent")), 60, "urgent admitted")
    evicted = condition(api.workload("first"), "Evicted")
    assert evicted["status"] == "True" and evicted["reason"] == "Preempted", evicted
    preempted = condition(api.workload("first"), "Preempted")
    assert preempted["status"] == "True" and preempted["reason"] == "InClusterQueue", preempted
    eventually(lambda: api.suspended("first"), what="first suspended by Kueue")
    assert not api.suspended("urgent")
    eventually(lambda: not api.pods("first"), what="first's pod gone")

    # More quota: the queued ones are admitted with no other change.
    kueue_cluster.set_kueue_quota(12)
    eventually(lambda: not api.suspended("first") and not api.suspended("second"), 60, "both admitted")
    assert admitted(api.workload("first")) and admitted(api.workload("second"))
