"""A watch gap (issue 17, item 6): the operator is cut off from the apiserver, things change meanwhile,
and the apiserver restarts on a compacted etcd, so every watch resumes with 410 Gone and kopf
re-lists. kopf's relist never removes what was deleted in the gap; the resync (resync.py) must.

This module runs its own control plane (etcd + kube-apiserver + kube-controller-manager): it restarts
the apiserver, which the session's plane must not see. The operator reaches it through a relay that
the test can cut (a partition); the test itself talks to the apiserver directly. What the apiserver
answered the operator is read from its audit log.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from kubernetes import client, config
from kubernetes.config import kube_config
from tpujob_contract import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, LABEL_UID
from tpujob_devcluster.controlplane import Component, ControlPlane, build_binaries
from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_operator import api, checkpoints, resync

from ..conftest import REPO, TEST_BUCKET
from .conftest import OperatorThread, eventually, training_job_manifest
from .test_operator import Cluster

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {
            "level": "Metadata",
            "resources": [{"group": api.GROUP, "resources": ["trainingjobs", "trainingjobs/status"]}],
        },
        {"level": "None"},
    ],
}
ONE_SLICE = {"accelerator": "tpu-v5p-slice", "topology": "2x2x1", "slices": 1}


class Relay:
    """A TCP relay to the apiserver that can be cut (open connections closed, new ones refused) and healed."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.open = True
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                downstream.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                downstream.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets |= {downstream, upstream}
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                self._close(end)

    def _close(self, end: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(end)
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)
        end.close()

    def cut(self) -> None:
        self.open = False
        with self._lock:
            ends = list(self._sockets)
        for end in ends:
            self._close(end)

    def heal(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    bin_dir = build_binaries("etcd kube-apiserver kube-controller-manager")
    own = ControlPlane(workdir=tmp_path_factory.mktemp("gap-plane"), bin_dir=bin_dir, audit_policy=AUDIT_POLICY)
    own.start()
    try:
        own.apply_crd(bin_dir / "jobset-crd.yaml")
        own.apply_crd(REPO / "crds" / "trainingjob.yaml")
        yield own
    finally:
        for component in reversed(own.components):
            component.stop(grace=2.0)  # nothing here is worth the default 10 s of graceful shutdown
        own.stop()


@pytest.fixture(scope="module")
def relay(plane: ControlPlane) -> Iterator[Relay]:
    relay = Relay(plane.api_port)
    yield relay
    relay.close()


@pytest.fixture
def operator(
    plane: ControlPlane, relay: Relay, fake_gcs_server: FakeGcsServer, tmp_path: Path
) -> Iterator[OperatorThread]:
    """The in-process operator, configured to reach this module's apiserver through the relay."""
    kubeconfig = yaml.safe_load(plane.kubeconfig.read_text())
    kubeconfig["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
    relayed = tmp_path / "kubeconfig"
    relayed.write_text(yaml.safe_dump(kubeconfig))
    previous = os.environ.get("KUBECONFIG"), kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    default = client.Configuration.get_default_copy()  # the operator's login replaces the client's default
    os.environ["KUBECONFIG"] = kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(relayed)
    running = OperatorThread().start()  # its own runtime: clients made with the relayed kubeconfig
    try:
        yield running
    finally:
        running.stop()
        if previous[0] is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous[0]
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = previous[1]
        client.Configuration.set_default(default)


@pytest.fixture
def cluster(plane: ControlPlane, unique_name: str) -> Iterator[Cluster]:
    kube = config.new_client_from_config(str(plane.kubeconfig))
    core = client.CoreV1Api(kube)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=unique_name)))
    yield Cluster(kube, unique_name)
    core.delete_namespace(unique_name)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _running_worker(cluster: Cluster, jobset: Any) -> str:
    """What the scheduler and kubelet would report for slice 0's worker (none run in this tier)."""
    template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    name = f"{jobset['metadata']['name']}-slice-0-0"
    pod: Any = {
        "metadata": {"name": name, "labels": template["metadata"]["labels"]},
        "spec": {"containers": [{"name": "trainer", "image": template["spec"]["containers"][0]["image"]}]},
    }
    cluster.core.create_namespaced_pod(cluster.namespace, pod)
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
    cluster.core.patch_namespaced_pod_status(
        name, cluster.namespace, {"status": {"phase": "Running", "conditions": [scheduled]}}
    )
    return name


def _write_progress(run: str, uid: str, step: int) -> None:
    bucket = storage.Client(project="t", credentials=AnonymousCredentials()).bucket(TEST_BUCKET)
    record = {"step": step, "attempt": 0, "uid": uid, "updated_at": datetime.now(UTC).isoformat(), "loss": 1.0}
    bucket.blob(f"{run}/{checkpoints.PROGRESS_FILE}").upload_from_string(json.dumps(record))


def _compact_etcd(plane: ControlPlane) -> None:
    """Compact etcd to its current revision: no watch can resume from before it (410 Gone)."""

    def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{plane.etcd_port}{path}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return dict(json.loads(response.read()))

    revision = call("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"]
    call("/v3/kv/compaction", {"revision": revision, "physical": True})


def _restart_apiserver(plane: ControlPlane) -> None:
    old = next(c for c in plane.components if c.name == "kube-apiserver")
    old.stop(grace=1.0)  # (a crash, as far as its clients can tell)
    plane.components.remove(old)
    plane.launch(Component(old.name, old.argv, old.log_path), lambda: plane.api_ok("/readyz"))


def _status_writes_answered_404(plane: ControlPlane, namespace: str, name: str) -> int:
    assert plane.audit_log is not None
    count = 0
    for line in plane.audit_log.read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        if (ref.get("namespace"), ref.get("name"), ref.get("subresource")) != (namespace, name, "status"):
            continue
        if event.get("verb") in ("update", "patch") and (event.get("responseStatus") or {}).get("code") == 404:
            count += 1
    return count


def _delete(cluster: Cluster, name: str) -> None:
    cluster.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, cluster.namespace, api.PLURAL, name)


def test_after_a_watch_gap_the_operator_acts_on_what_exists(operator, cluster, plane, relay, unique_name):
    ns = cluster.namespace
    gone, again, lost, steady = (f"{unique_name}-{role}" for role in ("gone", "again", "lost", "steady"))
    for name in (again, lost, steady):
        cluster.apply(training_job_manifest(name, tpu=ONE_SLICE))
    cluster.apply(training_job_manifest(gone, tpu=ONE_SLICE, restart={"backoffSeconds": 15}))
    names = (gone, again, lost, steady)
    jobsets = {n: eventually(lambda n=n: cluster.jobset(f"{n}-a0"), what=f"JobSet {n}-a0") for n in names}
    stale_pod = _running_worker(cluster, jobsets[again])
    _running_worker(cluster, jobsets[steady])
    steady_uid = cluster.training_job(steady)["metadata"]["uid"]
    _write_progress(f"runs/{ns}/{steady}", steady_uid, step=10)
    eventually(lambda: cluster.status(steady).get("phase") == "Running", what=f"{steady} Running")
    pods = operator.runtime.indexes["pods"]
    eventually(lambda: (ns, again) in pods, what=f"the operator sees {again}'s worker")
    before = {"steady": cluster.status(steady), "lost": cluster.jobset(f"{lost}-a0")["metadata"]["uid"]}
    # `gone` is backing off when the gap starts: the restart it then wants is due in the gap or soon after.
    cluster.fail_slice(jobsets[gone], slice_index=0, exit_code=1)
    eventually(lambda: cluster.status(gone).get("stage") == "BackingOff", what=f"{gone} backing off")

    # The gap: the operator is cut off; meanwhile one job is deleted, one deleted (with its worker
    # gone) and created again, one loses its JobSet. Then the apiserver restarts on a compacted etcd.
    relay.cut()
    _delete(cluster, gone)
    _delete(cluster, again)
    cluster.core.delete_namespaced_pod(stale_pod, ns, grace_period_seconds=0)
    cluster.custom.delete_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, ns, JOBSET_PLURAL, f"{lost}-a0", propagation_policy="Background"
    )
    eventually(lambda: cluster.jobset(f"{again}-a0") is None, what="the deleted job's JobSet collected")
    recreated = cluster.apply(training_job_manifest(again, tpu=ONE_SLICE))
    _compact_etcd(plane)
    _restart_apiserver(plane)
    healed = time.monotonic()
    relay.heal()

    # The re-created job starts in its normal time: its predecessor's pod is no orphan to wait for.
    new = eventually(lambda: cluster.jobset(f"{again}-a0"), timeout=45, what=f"{again}-a0 of the new incarnation")
    assert new["metadata"]["labels"][LABEL_UID] == recreated["metadata"]["uid"]
    # The lost JobSet is created again (it was not alive, whatever the cache said).
    eventually(
        lambda: (js := cluster.jobset(f"{lost}-a0")) and js["metadata"]["uid"] != before["lost"],
        timeout=45,
        what=f"{lost}-a0 created again",
    )
    # The deleted job is forgotten: nothing remembered, and its due restart is never attempted.
    eventually(lambda: operator.runtime.remembered((ns, gone)) == 0, timeout=30, what=f"{gone} forgotten")
    time.sleep(max(0.0, healed + 15 - time.monotonic()))  # past its due restart, and a retry of it
    assert _status_writes_answered_404(plane, ns, gone) <= 1
    assert cluster.jobset(f"{gone}-a1") is None  # nothing created for a job that no longer exists
    assert operator.runtime.resync.asked["relist"] >= 1  # kopf's relist was noticed (whatever came first)
    # The apiserver restart cost the running job nothing.
    after = cluster.status(steady)
    assert (after["phase"], after["attempt"], after["restarts"]) == ("Running", 0, 0)
    assert after.get("lastFailure") == before["steady"].get("lastFailure")
    assert [js["metadata"]["name"] for js in cluster.jobsets() if js["metadata"]["name"].startswith(steady)] == [
        f"{steady}-a0"
    ]


def test_the_resync_lists_page_by_page_and_a_kind_it_cannot_list_is_left_out(plane, cluster, monkeypatch):
    for i in range(3):
        pod: Any = {
            "metadata": {"name": f"w{i}", "labels": {"tpujob.dev/name": "j", "tpujob.dev/attempt": "0"}},
            "spec": {"containers": [{"name": "trainer", "image": "x"}]},
        }
        cluster.core.create_namespaced_pod(cluster.namespace, pod)
    created = {p.metadata.uid for p in cluster.core.list_namespaced_pod(cluster.namespace).items}
    monkeypatch.setattr(resync, "PAGE", 2)
    kinds = {"pods": resync.KINDS["pods"], "absent": resync.Kind("nowhere.example", "v1", "things")}
    listed = resync.list_uids(cluster.custom.api_client, kinds, [cluster.namespace])
    assert listed.uids == {"pods": created} and len(created) == 3
    assert set(listed.failed) == {"absent"}
