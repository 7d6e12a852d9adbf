"""JobSet's InPlaceRestart on the devcluster's real engine (no operator here): the real JobSet
controller (devcluster/build.sh's JOBSET_VERSION, its InPlaceRestart gate on), the real in-place-restart
agent built from the same module (in its main container mode: it runs WORKER_COMMAND itself), the real
apiserver with Kubernetes 1.35's container restart gates, and the pod runner restarting containers in
place as the kubelet does.

A hand-written JobSet of 2 replicatedJobs x 1 pod whose container is the agent; its WORKER_COMMAND
fails once on slice s0 (a marker in a memory-backed emptyDir says whether it ran before) and
succeeds the next time. The truth is the apiserver's: the same pod uids throughout, every pod's
restartCount 1, the JobSet's currentInPlaceRestartAttempt 1, the JobSet Completed; and the
machine's: the tmpfs mounted while the pods live and gone after, no worker left running.
Stand-ins, named as such: kwok nodes for TPU VMs, the pod runner for kubelet + container runtime.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tpujob_contract import ACCELERATOR_LABEL, JOBSET_GROUP, JOBSET_VERSION, TOPOLOGY_LABEL, TPU_RESOURCE
from tpujob_devcluster.cluster import DevCluster
from tpujob_devcluster.controlplane import tools_dir

T = TypeVar("T")

POOLS = {
    "pools": [{"name": f"v5e-{c}", "accelerator": "tpu-v5-lite-podslice", "topology": "2x2"} for c in "ab"],
    "system_nodes": 1,
}
RESTART_EXIT_CODE = 42
# The emptyDir's mountPath, created on the host by the pod runner's mkdir. Its own per run: the pod
# runner shares a host directory that already holds files instead of hiding it (podrunner.hides_the_host).
SCRATCH = f"/tmp/tpujob-in-place-scratch-{uuid.uuid4().hex[:8]}"
WORKER_SLEEP = "3017"  # a worker that would outlive the agent if its process group were not killed
# Runs under the agent (`sh -c`): the first run on s0 fails, every second run succeeds because the
# marker the first run left in the emptyDir is still there.
WORKER = f"""
if [ -e {SCRATCH}/ran ]; then echo "second run, marker: $(cat {SCRATCH}/ran)"; exit 0; fi
echo "first run of $SLICE" > {SCRATCH}/ran
if [ "$SLICE" = s0 ]; then sleep 3; echo "s0 fails"; exit 1; fi
sleep {WORKER_SLEEP}
"""
AGENT = "jobset.sigs.k8s.io"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    state = tmp_path_factory.mktemp("in-place-devcluster")
    pools = state / "pools.yaml"
    pools.write_text(yaml.safe_dump(POOLS))
    devcluster = DevCluster(state, pools, pod_runner_interval=0.2).start()
    try:
        yield devcluster
    finally:
        devcluster.stop()
        shutil.rmtree(SCRATCH, ignore_errors=True)


def eventually(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    last = probe()
    while not last and time.monotonic() < deadline:
        time.sleep(interval)
        last = probe()
    assert last, f"timed out after {timeout}s waiting for {what}"
    return last


def agent_rbac(rbac: client.RbacAuthorizationV1Api, core: client.CoreV1Api, namespace: str) -> str:
    """What the agent needs: watch its JobSet, server-side apply its own pod's annotation."""
    name = "in-place-restart-agent"
    account: Any = {"metadata": {"name": name}}
    core.create_namespaced_service_account(namespace, account)
    rules = [
        {"apiGroups": [JOBSET_GROUP], "resources": ["jobsets"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
    ]
    role: Any = {"metadata": {"name": name}, "rules": rules}
    rbac.create_namespaced_role(namespace, role)
    binding: Any = {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    rbac.create_namespaced_role_binding(namespace, binding)
    return name


def pod_spec(shape: str, service_account: str) -> dict[str, Any]:
    """The pod template. `on-failure`: JobSet v0.11.0's documented shape (pod restartPolicy
    OnFailure, any Kubernetes; v0.12.0's agent still serves it). `restart-rules`: Kubernetes 1.35's, a
    container restart rule whose RestartAllContainers action restarts the pod's containers in place,
    with no crash-loop back-off."""
    field = {"fieldRef": {"fieldPath": f"metadata.labels['{AGENT}/replicatedjob-name']"}}
    container: dict[str, Any] = {
        "name": "worker",
        "image": "tpujob-trainer:dev",
        "command": ["in-place-restart-agent"],
        "env": [
            {
                "name": "JOBSET_NAME",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{AGENT}/jobset-name']"}},
            },
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IN_PLACE_RESTART_EXIT_CODE", "value": str(RESTART_EXIT_CODE)},
            {"name": "WORKER_COMMAND", "value": WORKER},
            {"name": "SHELL", "value": "/bin/sh"},  # v0.12 runs $SHELL (else bash); the operator sets it
            {"name": "SLICE", "valueFrom": field},
        ],
        "resources": {"requests": {TPU_RESOURCE: 4}, "limits": {TPU_RESOURCE: 4}},
        "volumeMounts": [{"name": "local", "mountPath": SCRATCH}],
    }
    spec: dict[str, Any] = {
        "serviceAccountName": service_account,
        "terminationGracePeriodSeconds": 1,
        "nodeSelector": {ACCELERATOR_LABEL: "tpu-v5-lite-podslice", TOPOLOGY_LABEL: "2x2"},
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "local", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}],
        "containers": [container],
    }
    if shape == "on-failure":
        spec["restartPolicy"] = "OnFailure"
    else:
        spec["restartPolicy"] = "Never"
        container["restartPolicy"] = "Never"
        container["restartPolicyRules"] = [
            {"action": "RestartAllContainers", "exitCodes": {"operator": "NotIn", "values": [0]}}
        ]
    return spec


def jobset_manifest(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    job = {
        "parallelism": 1,
        "completions": 1,
        "backoffLimit": 2147483647,
        "podReplacementPolicy": "Failed",
        "template": {"spec": spec},
    }
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": {"restartStrategy": "InPlaceRestart", "maxRestarts": 3},
            "replicatedJobs": [{"name": s, "replicas": 1, "template": {"spec": job}} for s in ("s0", "s1")],
        },
    }


def tmpfs_mounts(under: Path) -> list[str]:
    with open("/proc/self/mounts") as mounts:
        return [
            f"{p[1]} {p[3]}"
            for p in (line.split() for line in mounts)
            if p[2] == "tmpfs" and p[1].startswith(str(under))
        ]


def worker_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().split(b"\0")[:2] == [
                b"sleep",
                WORKER_SLEEP.encode(),
            ]:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("shape", ["on-failure", "restart-rules"])
def test_jobset_restarts_every_pod_in_place_with_the_real_agent(cluster: DevCluster, shape: str) -> None:
    api = config.new_client_from_config(str(cluster.kubeconfig))
    core, custom, rbac = client.CoreV1Api(api), client.CustomObjectsApi(api), client.RbacAuthorizationV1Api(api)
    namespace, name = f"in-place-{shape}", "ipr"
    namespace_body: Any = {"metadata": {"name": namespace}}
    core.create_namespace(namespace_body)
    eventually(lambda: _default_account(core, namespace), 30, "the namespace's default ServiceAccount")
    account = agent_rbac(rbac, core, namespace)
    custom.create_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, namespace, "jobsets", jobset_manifest(name, pod_spec(shape, account))
    )
    selector = f"{AGENT}/jobset-name={name}"

    def pods() -> list[Any]:
        return list(core.list_namespaced_pod(namespace, label_selector=selector).items)

    def jobset() -> dict[str, Any]:
        found: Any = custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, namespace, "jobsets", name)
        return dict(found)

    def both_running() -> list[Any]:
        found = pods()
        return found if len(found) == 2 and all(p.status.phase == "Running" for p in found) else []

    running = eventually(both_running, 30, "both pods Running")
    uids = {p.metadata.name: p.metadata.uid for p in running}
    ips = {p.metadata.name: p.status.pod_ip for p in running}
    created = running[0].spec.containers[0]
    if shape == "restart-rules":  # the apiserver kept the rules (it drops them with ContainerRestartRules off)
        assert created.restart_policy == "Never" and created.restart_policy_rules[0].action == "RestartAllContainers"
    # Each pod's emptyDir (medium Memory) is a tmpfs of its sizeLimit, for as long as the pod lives.
    volumes = [cluster.state_dir / "pods" / namespace / pod / "volumes" / uid / "local" for pod, uid in uids.items()]
    mounted = tmpfs_mounts(cluster.state_dir / "pods" / namespace)
    assert sorted(m.split()[0] for m in mounted) == sorted(str(v) for v in volumes), mounted
    assert all("size=16384k" in m for m in mounted), mounted

    def completed() -> dict[str, Any] | None:
        found = jobset()
        conditions = (found.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Failed" and c["status"] == "True" for c in conditions):
            raise AssertionError(f"the JobSet failed: {conditions}")
        return found if any(c["type"] == "Completed" and c["status"] == "True" for c in conditions) else None

    done = eventually(completed, 45, "the JobSet Completed", interval=0.5)
    assert done["status"].get("currentInPlaceRestartAttempt") == 1, done["status"]
    after = pods()
    assert {p.metadata.name: p.metadata.uid for p in after} == uids  # the same pods: none recreated
    assert {p.metadata.name: p.status.pod_ip for p in after} == ips
    for pod in after:
        status = pod.status.container_statuses[0]
        assert pod.status.phase == "Succeeded", pod.status
        assert status.restart_count == 1, (pod.metadata.name, status)
        slice_name = pod.metadata.labels[f"{AGENT}/replicatedjob-name"]
        last = status.last_state.terminated
        # s0: its worker's exit code; s1: the agent told to restart (each container exited by itself, so
        # each keeps its own exit as its last state, also under RestartAllContainers)
        assert last.exit_code == (1 if slice_name == "s0" else RESTART_EXIT_CODE), (pod.metadata.name, last)
        if shape != "on-failure":
            conditions = {c.type: c.status for c in pod.status.conditions}
            assert conditions.get("AllContainersRestarting") == "False", conditions
        log = (cluster.state_dir / "pods" / namespace / pod.metadata.name / "log").read_text()
        # The second run found the first run's marker: the emptyDir outlived the container.
        assert f"second run, marker: first run of {slice_name}" in log, log[-2000:]
    assert not worker_processes(), "a worker outlived its agent"
    assert not Path(SCRATCH, "ran").exists(), "the workers wrote to the host, not to their volume"
    # The pods go, and their volumes with them. (The pods themselves, not the JobSet: the garbage
    # collector maps a new CRD's kind only at its next discovery pass, up to 30 s.)
    core.delete_collection_namespaced_pod(namespace, label_selector=selector)
    eventually(lambda: not pods(), 30, "the pods deleted")
    # The runner unmounts a pod's tmpfs volumes and then removes their directories: wait for both.
    eventually(
        lambda: not tmpfs_mounts(cluster.state_dir / "pods" / namespace) and not any(v.exists() for v in volumes),
        10,
        "the tmpfs volumes unmounted and their directories removed",
    )
    core.delete_namespace(namespace)


def _default_account(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.read_namespaced_service_account("default", namespace)
        return True
    except ApiException:
        return False


# The first run says so and fails; the run after its in-place restart ticks 5 times and succeeds.
LOGGED = f"""
if [ -e {SCRATCH}/logged ]; then
  echo "second run"; for i in 1 2 3 4 5; do echo "tick $i"; sleep 1; done; exit 0
fi
touch {SCRATCH}/logged; echo "first run"; exit 3
"""


def test_kubectl_logs_reads_the_pod_runner_through_the_apiserver_as_from_a_kubelet(cluster: DevCluster) -> None:
    """`kubectl logs` (the real kubectl, through the real apiserver's pods/log proxy, TLS verified both
    ways) against the pod runner's kubelet endpoint: the current container, --previous after a restart
    in place, -c, --tail, and -f that follows until the container exits."""
    api = config.new_client_from_config(str(cluster.kubeconfig))
    core = client.CoreV1Api(api)
    namespace, name = "kubectl-logs", "talker"
    namespace_body: Any = {"metadata": {"name": namespace}}
    core.create_namespace(namespace_body)
    eventually(lambda: _default_account(core, namespace), 30, "the namespace's default ServiceAccount")
    spec = pod_spec("on-failure", "default")
    container = spec["containers"][0]
    container.update(command=["sh", "-c", LOGGED], env=[])
    container["resources"] = {k: {TPU_RESOURCE: "4"} for k in ("requests", "limits")}  # the client types them str
    pod: Any = {"metadata": {"name": name}, "spec": spec}
    core.create_namespaced_pod(namespace, pod)
    kubectl = [str(tools_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "-n", namespace, "logs", name]

    def logs(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*kubectl, *args], capture_output=True, text=True, timeout=timeout)

    def restarted() -> bool:
        found: Any = core.read_namespaced_pod(name, namespace)
        statuses = found.status.container_statuses or []
        return bool(statuses) and statuses[0].restart_count == 1

    eventually(restarted, 45, "the container restarted in place")
    # -f from the second run's start: every tick, then the stream ends because the container exited.
    followed = logs("-f", "-c", "worker", timeout=60)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.splitlines() == ["second run", *(f"tick {i}" for i in range(1, 6))], followed.stdout
    previous = logs("--previous")
    assert previous.returncode == 0 and previous.stdout == "first run\n", (previous.stdout, previous.stderr)
    tail = logs("--tail=2")
    assert tail.stdout.splitlines() == ["tick 4", "tick 5"], tail.stdout
    wrong = logs("-c", "sidecar")  # the apiserver refuses it before it reaches the node, as on GKE
    assert wrong.returncode != 0 and "container sidecar is not valid for pod talker" in wrong.stderr, wrong.stderr
    core.delete_namespace(namespace)
