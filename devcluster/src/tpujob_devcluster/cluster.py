"""The local simulated GKE TPU cluster: the control plane plus kube-scheduler, the JobSet controller
(with its webhooks served locally), kwok for node objects and heartbeats, TPU node pools labelled as
GKE labels them, the GCS emulator with a bucket, the pod runner and, optionally, Kueue with the
queues of examples/kueue/ (see kueue.py).

`make up` / `make down` drive it through `python -m tpujob_devcluster`; the e2e tests use it
directly. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from tpujob_contract import JOBSET_NAME_LABEL

from .certs import issue_serving_cert
from .controlplane import (
    IMAGE_BIN_DIR,
    JOBSET_FEATURE_GATES,
    REPO_ROOT,
    Component,
    ControlPlane,
    build_binaries,
    free_port,
    http_ok,
)
from .fakegcs import FakeGcsServer, start_fake_gcs
from .kueue import Kueue
from .podrunner import NODE_LABEL
from .pools import POOLS_FILE, Pool, load_pools, node_manifests

DEFAULT_STATE_DIR = REPO_ROOT / ".devcluster"
IMAGES_FILE = REPO_ROOT / "devcluster" / "images.yaml"
BUCKET = "tpujob-demo"
# kwok must keep nodes alive but leave pods to the pod runner: one Pod stage that matches nothing
# replaces kwok's default pod stages (kwok uses its defaults only for kinds with no stage at all).
KWOK_CONFIG = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pods-belong-to-the-pod-runner
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchLabels: {tpujob.dev/never: "kwok"}
  next: {}
"""


def jobset_webhooks(bin_dir: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """JobSet's webhook configurations from its module, pointed at the locally served webhooks.
    The pod webhooks get JobSet's own objectSelector (only pods of a JobSet)."""
    docs = [d for d in yaml.safe_load_all((bin_dir / "jobset-webhooks.yaml").read_text()) if d]
    result = []
    for doc in docs:
        doc = copy.deepcopy(doc)
        doc["metadata"]["name"] = f"jobset-{doc['metadata']['name']}"
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
            if "pod" in hook["name"]:
                hook["objectSelector"] = {"matchExpressions": [{"key": JOBSET_NAME_LABEL, "operator": "Exists"}]}
        result.append(doc)
    return result


class DevCluster:
    def __init__(
        self,
        state_dir: Path = DEFAULT_STATE_DIR,
        pools_file: Path = POOLS_FILE,
        detached: bool = False,
        kueue: bool = False,
        kueue_tpu_quota: int | Mapping[str, int] | None = None,
        audit_policy: dict[str, Any] | None = None,
        pod_runner_interval: float | None = None,
        process_compile_cache: Path | None = None,
    ) -> None:
        """detached: outlive this process (`make up`); otherwise stop() or this process's exit ends it.
        kueue: run Kueue and create its queues, with `kueue_tpu_quota` TPU chips per flavor (see
        kueue.queue_manifests; default: the chips of the pools); set_kueue_quota() changes it later.
        audit_policy: write the apiserver's audit log under this policy (ControlPlane.audit_policy;
        the log is at `self.plane.audit_log`). pod_runner_interval: seconds between the pod runner's
        passes over the pods (default: its own, 0.3 s); longer spares CPU with many pods and nodes.
        process_compile_cache: a folder outside state_dir where the JAX processes of several-process jobs
        keep their compilations across jobs, as a TPU slice's hosts share theirs (podrunner.process_compile_cache)."""
        self.state_dir = state_dir
        self.detached = detached
        self.kueue_enabled = kueue
        self.kueue_tpu_quota = kueue_tpu_quota
        self.kueue: Kueue | None = None
        self.pools, self.system_nodes = load_pools(pools_file)
        self.bin_dir = build_binaries("devcluster kueue" if kueue else "devcluster")
        self.plane = ControlPlane(
            workdir=state_dir, bin_dir=self.bin_dir, service_account_admission=True, audit_policy=audit_policy
        )
        self.pod_runner_interval = pod_runner_interval
        self.process_compile_cache = process_compile_cache
        self.gcs: FakeGcsServer | None = None
        # The nodes' kubelet port (kwok writes it into node status): the pod runner's logs endpoint.
        self.kubelet_port = free_port()

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    def start(self, timeout: float = 180.0) -> DevCluster:
        # The devcluster is ephemeral: every start begins from empty etcd, bucket and pod folders.
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        self.state_dir.mkdir(parents=True)
        self.plane.start(timeout)
        self.plane.apply_crd(self.bin_dir / "jobset-crd.yaml")
        self.plane.apply_crd(REPO_ROOT / "crds" / "trainingjob.yaml")
        self._start_scheduler(timeout)
        self._start_jobset(timeout)
        if self.kueue_enabled:
            self.kueue = Kueue(self.plane, self.bin_dir / "kueue", self.state_dir, self.pools)
            self.kueue.start(timeout, self.kueue_tpu_quota)
        self._start_kwok_and_nodes(timeout)
        self.gcs = start_fake_gcs(self.state_dir / "gcs", die_with_parent=not self.detached)
        self.gcs.create_bucket(BUCKET)
        self._start_pod_runner(timeout)
        self._write_state()
        return self

    def _component(self, name: str, argv: list[str]) -> Component:
        return Component(name, argv, self.logs / f"{name}.log")

    def _start_scheduler(self, timeout: float) -> None:
        scheduler = self._component(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                "--v=1",
            ],
        )
        self.plane.launch(scheduler, lambda: self.plane.api_ok("/api/v1/namespaces/default"), timeout)

    def _start_jobset(self, timeout: float) -> None:
        assert self.plane.pki is not None
        webhook_port, health_port = free_port(), free_port()
        cert_dir = self.state_dir / "jobset-webhook"
        issue_serving_cert(self.plane.pki, cert_dir, "jobset-webhook")
        config_file = self.state_dir / "jobset-config.yaml"
        config_file.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
                    "kind": "Configuration",
                    "leaderElection": {"leaderElect": False},
                    "internalCertManagement": {"enable": False},
                    "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
                    "metrics": {"bindAddress": "0"},
                    "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
                    "featureGates": JOBSET_FEATURE_GATES,
                }
            )
        )
        jobset = self._component(
            "jobset-controller",
            [
                str(self.bin_dir / "jobset"),
                f"--config={config_file}",
                f"--kubeconfig={self.kubeconfig}",
                "--zap-log-level=info",
            ],
        )
        self.plane.launch(jobset, lambda: http_ok(f"http://127.0.0.1:{health_port}/readyz"), timeout)
        ca_bundle = __import__("base64").b64encode(self.plane.pki.ca_cert.read_bytes()).decode()
        for config in jobset_webhooks(self.bin_dir, webhook_port, ca_bundle):
            self.plane.register_webhook(config)

    def _start_kwok_and_nodes(self, timeout: float) -> None:
        config_file = self.state_dir / "kwok.yaml"
        config_file.write_text(KWOK_CONFIG)
        kwok = self._component(
            "kwok",
            [
                str(self.bin_dir / "kwok"),
                f"--kubeconfig={self.kubeconfig}",
                f"--config={config_file}",
                f"--manage-nodes-with-label-selector={NODE_LABEL}",
                "--node-ip=127.0.0.1",
                f"--node-port={self.kubelet_port}",
                f"--server-address=127.0.0.1:{free_port()}",
                "--node-lease-duration-seconds=40",
            ],
        )
        self.plane.launch(kwok, lambda: True, timeout)
        for node in node_manifests(self.pools, self.system_nodes):
            code, body = self.plane.request("POST", "/api/v1/nodes", node)
            if code == 409:
                continue
            if code >= 300:
                raise RuntimeError(f"creating node {node['metadata']['name']}: {body.get('message')}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, nodes = self.plane.request("GET", f"/api/v1/nodes?labelSelector={NODE_LABEL}")
            ready = [
                n
                for n in nodes["items"]
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in (n.get("status") or {}).get("conditions") or []
                )
            ]
            if len(ready) == len(nodes["items"]) > 0:
                return
            time.sleep(0.5)
        raise RuntimeError("kwok did not make the nodes Ready")

    def _start_pod_runner(self, timeout: float) -> None:
        assert self.gcs is not None and self.plane.pki is not None
        env_args = [f"--env={k}={v}" for k, v in self.gcs.env().items()]
        cert, key = issue_serving_cert(self.plane.pki, self.state_dir / "kubelet-serving", "pod-runner")
        runner = self._component(
            "pod-runner",
            [
                sys.executable,
                "-m",
                "tpujob_devcluster.podrunner",
                f"--kubeconfig={self.kubeconfig}",
                f"--state-dir={self.state_dir}",
                f"--images={IMAGES_FILE}",
                f"--api-port={self.plane.api_port}",
                f"--image-bin-dir={self.bin_dir / 'agent'}",
                f"--image-bin-dir={IMAGE_BIN_DIR}",
                f"--logs-port={self.kubelet_port}",
                f"--tls-cert={cert}",
                f"--tls-key={key}",
                f"--client-ca={self.plane.pki.ca_cert}",
                *env_args,
                *([f"--interval={self.pod_runner_interval}"] if self.pod_runner_interval is not None else []),
                *([f"--process-compile-cache={self.process_compile_cache}"] if self.process_compile_cache else []),
            ],
        )
        self.plane.launch(runner, lambda: True, timeout)

    def add_pools(self, pools: list[Pool], timeout: float = 300.0) -> None:
        """More TPU node pools on the running cluster (e.g. a scale test's one pool per job): their
        nodes are created and this returns once kwok reports every one of them Ready."""
        names = set()
        for node in node_manifests(pools, 0):
            names.add(node["metadata"]["name"])
            code, body = self.plane.request("POST", "/api/v1/nodes", node)
            if code >= 300 and code != 409:
                raise RuntimeError(f"creating node {node['metadata']['name']}: {body.get('message')}")
        self.pools.extend(pools)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, nodes = self.plane.request("GET", f"/api/v1/nodes?labelSelector={NODE_LABEL}")
            ready = {
                n["metadata"]["name"]
                for n in nodes["items"]
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in (n.get("status") or {}).get("conditions") or []
                )
            }
            if names <= ready:
                return
            time.sleep(1.0)
        raise RuntimeError(f"kwok did not make {len(names - ready)} of {len(names)} new nodes Ready in {timeout}s")

    def set_kueue_quota(self, tpu_quota: int | Mapping[str, int] | None) -> None:
        """The ClusterQueue's `google.com/tpu` quota: chips per flavor (an int: every flavor; a mapping
        by flavor name, e.g. kueue.flavor_name("tpu-v5p-slice", "2x2x2"); None: the pools' chips)."""
        if self.kueue is None:
            raise RuntimeError("this devcluster runs without Kueue (DevCluster(kueue=True))")
        self.kueue.apply_queues(tpu_quota)

    def kill_gcs(self) -> None:
        """Crash the GCS emulator (SIGKILL); restart_gcs() brings it back with the same objects."""
        assert self.gcs is not None
        self.gcs.kill()

    def restart_gcs(self) -> None:
        """The GCS emulator again, on the same port and data directory (every pod is already pointed
        at that endpoint). Call from the thread that started the cluster: the server dies with it."""
        assert self.gcs is not None
        self.gcs.restart(die_with_parent=not self.detached)
        self._write_state()

    def _write_state(self) -> None:
        pids = {c.name: c.process.pid for c in self.plane.components if c.process is not None}
        if self.gcs is not None:
            pids["fake-gcs-server"] = self.gcs.pid
        state = {
            "pids": pids,
            "kubeconfig": str(self.kubeconfig),
            "logs": str(self.logs),
            "gcs": self.gcs.endpoint if self.gcs else None,
            "bucket": BUCKET,
            "api": self.plane.server,
            "kueue": self.kueue is not None,
        }
        (self.state_dir / "state.json").write_text(json.dumps(state, indent=2))

    def stop(self) -> None:
        self.plane.stop()  # the pod runner stops its pods on SIGTERM
        if self.gcs is not None:
            self.gcs.stop()
        (self.state_dir / "state.json").unlink(missing_ok=True)


def read_state(state_dir: Path = DEFAULT_STATE_DIR) -> dict[str, Any] | None:
    path = state_dir / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


def stop_from_state(state_dir: Path = DEFAULT_STATE_DIR) -> list[str]:
    """`make down`: stop what `make up` started (in reverse), then any pod process left behind."""
    state = read_state(state_dir)
    stopped = []
    for name, pid in reversed(list((state or {}).get("pids", {}).items())):
        if _kill_group(pid, grace=10):
            stopped.append(name)
    for pid_file in (state_dir / "pods").glob("*/*/pid") if (state_dir / "pods").exists() else []:
        _kill_group(int(pid_file.read_text()), grace=0)
        pid_file.unlink()
    (state_dir / "state.json").unlink(missing_ok=True)
    return stopped


def _kill_group(pid: int, grace: float) -> bool:
    """SIGTERM the process group led by `pid` (or the lone process), SIGKILL after `grace` seconds."""

    def send(sig: int) -> bool:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, sig)
                return True
            except ProcessLookupError:
                continue
        return False

    if not send(signal.SIGTERM):
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and send(0):
        time.sleep(0.1)
    send(signal.SIGKILL)
    return True
