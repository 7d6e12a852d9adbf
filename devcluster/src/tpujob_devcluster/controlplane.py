"""Start and stop a real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager (and, for the devcluster, more components), the way controller-runtime's
envtest does it, with binaries built by devcluster/build.sh.

Used by the pytest fixtures (tests/conftest.py) and by `make up` / `make down`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from .certs import PkiFiles, make_pki

REPO_ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO_ROOT / "devcluster" / "build.sh"
# tpujob-init (trainer_image/init), which build.sh builds into its INIT_DIR, by default this folder.
IMAGE_BIN_DIR = REPO_ROOT / "build" / "image-bin"
TOOLS_SCRIPT = REPO_ROOT / "devcluster" / "tools.sh"
PROMETHEUS_SCRIPT = REPO_ROOT / "devcluster" / "prometheus.sh"
SERVICE_CIDR = "10.96.0.0/24"  # allocation range only: no traffic is ever sent to it
# Kubernetes 1.35's container restart rules (KEP-5307, beta, on by default in 1.35: named so that
# the apiserver never drops a container's restartPolicy/restartPolicyRules, as it does with the gate
# off) and their RestartAllContainers action (KEP-5532, alpha: refused by validation without it).
# The pod runner implements both as the 1.35 kubelet does with these gates. The action
# depends on NodeDeclaredFeatures (alpha; the apiserver refuses to start without it). The scheduler
# runs without these gates: with NodeDeclaredFeatures it would place a pod using the action only on a
# node whose status.declaredFeatures lists it (a 1.35 kubelet with the gate declares it; kwok's nodes
# declare nothing).
FEATURE_GATES = {
    "ContainerRestartRules": True,
    "RestartAllContainersOnContainerExits": True,
    "NodeDeclaredFeatures": True,
}
# JobSet's own gate (its Configuration's featureGates; the controller has no flag for it).
JOBSET_FEATURE_GATES = {"InPlaceRestart": True}


def feature_gates_flag(gates: dict[str, bool]) -> str:
    return "--feature-gates=" + ",".join(f"{name}={str(on).lower()}" for name, on in sorted(gates.items()))


class ControlPlaneError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _script_output_dir(script: Path, env: dict[str, str] | None = None) -> Path:
    """Run an install script (a no-op when its versioned cache is filled) and return the folder it prints."""
    result = subprocess.run(
        ["bash", str(script)], env={**os.environ, **(env or {})}, check=False, stdout=subprocess.PIPE, text=True
    )
    if result.returncode != 0:
        raise ControlPlaneError(f"{script} failed with exit code {result.returncode} (see its output above)")
    return Path(result.stdout.strip().splitlines()[-1])


def build_binaries(components: str | None = None) -> Path:
    """Control-plane binaries from devcluster/build.sh: etcd, kube-*, jobset, its agent, kwok, kueue; and
    tpujob-init into IMAGE_BIN_DIR. `components`: its names, or `devcluster` for all but Kueue."""
    env = {"INIT_DIR": str(IMAGE_BIN_DIR), **({"COMPONENTS": components} if components else {})}
    return _script_output_dir(BUILD_SCRIPT, env)


def tools_dir() -> Path:
    """kubectl and helm from devcluster/tools.sh."""
    return _script_output_dir(TOOLS_SCRIPT)


def prometheus_dir() -> Path:
    """prometheus and promtool from devcluster/prometheus.sh (built once, minutes)."""
    return _script_output_dir(PROMETHEUS_SCRIPT)


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_file = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.log_file is not None:
            self.log_file.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager in `workdir` (certs, data, logs, kubeconfig)."""

    workdir: Path
    bin_dir: Path
    # The endpoint controllers are off: they refuse the pod runner's loopback pod IPs and flood
    # `kubectl get events` with FailedToUpdateEndpoint warnings, while the pods' hosts files
    # already stand in for the headless Service's DNS.
    controllers: str = (
        "*,-nodeipam,-cloud-node-lifecycle,-service,-route,-persistentvolume-binder,-attachdetach,"
        "-endpoints-controller,-endpointslice-controller,-endpointslice-mirroring-controller"
    )
    # Off for the integration tier, which creates pods in namespaces younger than their default
    # ServiceAccount; on for the devcluster, whose pods get real ServiceAccount tokens.
    service_account_admission: bool = False
    # An apiserver audit policy (a dict: audit.k8s.io/v1 Policy): when set, the apiserver writes its
    # audit log (JSON lines) to `audit_log` (default <workdir>/logs/audit.log). Off by default.
    audit_policy: dict[str, Any] | None = None
    audit_log: Path | None = None
    components: list[Component] = field(default_factory=list)
    api_port: int = 0
    etcd_port: int = 0
    pki: PkiFiles | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    def start(self, timeout: float = 120.0) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        self.pki = make_pki(self.workdir / "pki")
        self.api_port = self.api_port or free_port()
        self.etcd_port = self.etcd_port or free_port()
        self._write_kubeconfig()
        etcd_flags = [
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
            "--unsafe-no-fsync",  # test data: durability is not worth the fsync latency on a shared disk
            "--log-level=warn",
        ]
        self.launch(
            self._binary("etcd", etcd_flags), lambda: http_ok(f"http://127.0.0.1:{self.etcd_port}/health"), timeout
        )
        self.launch(self._binary("kube-apiserver", self._apiserver_flags()), lambda: self.api_ok("/readyz"), timeout)
        kcm_flags = [
            f"--kubeconfig={self.kubeconfig}",
            f"--controllers={self.controllers}",
            f"--service-account-private-key-file={self.pki.sa_private}",
            f"--root-ca-file={self.pki.ca_cert}",
            "--leader-elect=false",
            "--secure-port=0",
            "--concurrent-gc-syncs=5",
            feature_gates_flag(FEATURE_GATES),
            "--v=1",
        ]
        self.launch(self._binary("kube-controller-manager", kcm_flags), self._namespace_default_ready, timeout)
        return self

    def _binary(self, name: str, flags: list[str]) -> Component:
        """One of the control plane's own binaries (bin_dir/<name>), logging to logs/<name>.log."""
        return Component(name, [str(self.bin_dir / name), *flags], self.workdir / "logs" / f"{name}.log")

    def _apiserver_flags(self) -> list[str]:
        assert self.pki is not None
        return [
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.api_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={self.pki.serving_cert}",
            f"--tls-private-key-file={self.pki.serving_key}",
            f"--client-ca-file={self.pki.ca_cert}",
            f"--service-account-key-file={self.pki.sa_public}",
            f"--service-account-signing-key-file={self.pki.sa_private}",
            f"--service-account-issuer=https://127.0.0.1:{self.api_port}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # pods/log goes to the node's kubelet port (the pod runner's logs endpoint), over TLS
            # verified both ways with the devcluster CA, as kube-apiserver talks to a kubelet.
            f"--kubelet-client-certificate={self.pki.admin_cert}",
            f"--kubelet-client-key={self.pki.admin_key}",
            f"--kubelet-certificate-authority={self.pki.ca_cert}",
            "--kubelet-preferred-address-types=InternalIP",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            # Kubernetes' default admission plugins stay on, PodSecurity and ValidatingAdmissionPolicy
            # among them: restricted namespaces and the chart's TrainingJob policy rely on them.
            *([] if self.service_account_admission else ["--disable-admission-plugins=ServiceAccount"]),
            "--enable-priority-and-fairness=false",
            feature_gates_flag(FEATURE_GATES),
            "--v=1",
            *self._audit_args(),
        ]

    def _audit_args(self) -> list[str]:
        if self.audit_policy is None:
            return []
        policy_file = self.workdir / "audit-policy.yaml"
        policy_file.write_text(yaml.safe_dump(self.audit_policy))
        self.audit_log = self.audit_log or self.workdir / "logs" / "audit.log"
        return [
            f"--audit-policy-file={policy_file}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",  # every event written (batch mode may drop when its buffer is full)
        ]

    def launch(self, component: Component, ready: Callable[[], bool], timeout: float = 120.0) -> None:
        """Start a component and wait until `ready()`; fail fast, with its log, if it exits."""
        component.start()
        self.components.append(component)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not component.alive():
                raise ControlPlaneError(f"{component.name} exited:\n{component.log_tail()}")
            if ready():
                return
            time.sleep(0.3)
        raise ControlPlaneError(f"{component.name} not ready after {timeout}s:\n{component.log_tail()}")

    def ssl_context(self) -> ssl.SSLContext:
        assert self.pki is not None
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        context.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return context

    def api_ok(self, path: str) -> bool:
        return http_ok(self.server + path, self.ssl_context())

    def _namespace_default_ready(self) -> bool:
        # The service-account controller (in kube-controller-manager) has run once it made this.
        return self.api_ok("/api/v1/namespaces/default/serviceaccounts/default")

    def _write_kubeconfig(self) -> None:
        assert self.pki is not None
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "devcluster",
                    "cluster": {"server": self.server, "certificate-authority": str(self.pki.ca_cert)},
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {"client-certificate": str(self.pki.admin_cert), "client-key": str(self.pki.admin_key)},
                }
            ],
            "contexts": [{"name": "devcluster", "context": {"cluster": "devcluster", "user": "admin"}}],
            "current-context": "devcluster",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))

    def apply_crd(self, crd_path: Path, timeout: float = 60.0) -> None:
        """Create (or replace) a CRD and wait until it is Established."""
        crd = yaml.safe_load(crd_path.read_text())
        name = crd["metadata"]["name"]
        base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        status, existing = self.request("GET", f"{base}/{name}")
        if status == 404:
            self._check(self.request("POST", base, crd), crd_path)
        else:
            crd["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
            self._check(self.request("PUT", f"{base}/{name}", crd), crd_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, current = self.request("GET", f"{base}/{name}")
            conditions = (current.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return
            time.sleep(0.2)
        raise ControlPlaneError(f"CRD {name} not established after {timeout}s")

    @staticmethod
    def _check(result: tuple[int, dict[str, Any]], what: Path) -> None:
        if result[0] >= 300:
            raise ControlPlaneError(f"applying {what} failed: HTTP {result[0]}: {result[1].get('message')}")

    def register_webhook(self, config: dict[str, Any]) -> None:
        """Create (or replace) a Validating/MutatingWebhookConfiguration."""
        base = f"/apis/admissionregistration.k8s.io/v1/{config['kind'].lower()}s"
        self.request("DELETE", f"{base}/{config['metadata']['name']}")
        code, body = self.request("POST", base, config)
        if code >= 300:
            raise ControlPlaneError(f"registering {config['metadata']['name']}: {body.get('message')}")

    def request(
        self, method: str, path: str, body: object | None = None, accept: str = "application/json"
    ) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": accept}
        request = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, context=self.ssl_context(), timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()
        self.components.clear()


def http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, context=context, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
