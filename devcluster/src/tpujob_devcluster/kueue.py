"""Kueue in the devcluster (optional: `DevCluster(kueue=True)`, on for `make up`).

The real Kueue manager, built by devcluster/build.sh from the Go module proxy, runs on loopback like
the JobSet controller: its webhooks (and the CRDs' conversion webhook) are served on 127.0.0.1 with
a certificate the devcluster issues, metrics and the visibility API server are off, and only the
JobSet integration is enabled, with `manageJobsWithoutQueueName: false`: a JobSet without the
`kueue.x-k8s.io/queue-name` label is left alone.

The queues are examples/kueue/queues.yaml (the README's manifests): a ResourceFlavor per TPU pool
type, the ClusterQueue `tpu` (TPU quota, preemption of lower priorities within it), the LocalQueue
`tpu` in `default`, and the WorkloadPriorityClasses `low` and `high`. The devcluster applies that
file with the TPU quota of each flavor set by the caller (default: the chips of the pools).
"""

from __future__ import annotations

import base64
import copy
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from tpujob_contract import ACCELERATOR_LABEL, JOBSET_GROUP, KUEUE_GROUP, KUEUE_VERSION, TOPOLOGY_LABEL, TPU_RESOURCE

from .certs import issue_serving_cert
from .controlplane import REPO_ROOT, Component, ControlPlane, ControlPlaneError, free_port, http_ok

if TYPE_CHECKING:
    from .pools import Pool

QUEUES_FILE = REPO_ROOT / "examples" / "kueue" / "queues.yaml"
CLUSTER_QUEUE = "tpu"
LOCAL_QUEUE = "tpu"
LOW_PRIORITY, HIGH_PRIORITY = "low", "high"
NAMESPACE = "kueue-system"
# Kueue reads its metrics serving certificate from this fixed path whenever its internal certificate
# management is off (even with metrics disabled); its process gets the devcluster's there, by a bind
# mount in a private mount namespace, as the pod runner does for /etc/hosts.
METRICS_CERT_PATH = "/etc/kueue/metrics/certs"
# The kinds whose v1beta2 is a conversion hub (Kueue's own kustomization patches these CRDs to call
# its /convert webhook); the other kinds' versions share one schema.
CONVERTED_CRDS = {
    f"{plural}.{KUEUE_GROUP}"
    for plural in ("clusterqueues", "cohorts", "localqueues", "multikueueclusters", "workloads")
}
PLURALS = {
    "ResourceFlavor": "resourceflavors",
    "ClusterQueue": "clusterqueues",
    "LocalQueue": "localqueues",
    "WorkloadPriorityClass": "workloadpriorityclasses",
}
FIELD_MANAGER = "tpujob-devcluster"


def flavor_name(accelerator: str, topology: str) -> str:
    """A ResourceFlavor's name for a TPU pool type, as in examples/kueue/queues.yaml."""
    return f"{accelerator}-{topology}"


def _flavor(accelerator: str, topology: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
        "kind": "ResourceFlavor",
        "metadata": {"name": flavor_name(accelerator, topology)},
        "spec": {"nodeLabels": {ACCELERATOR_LABEL: accelerator, TOPOLOGY_LABEL: topology}},
    }


def pool_chips(pools: Sequence[Pool]) -> dict[str, int]:
    """TPU chips per flavor: every host of every pool of that type."""
    chips: dict[str, int] = {}
    for pool in pools:
        name = flavor_name(pool.accelerator, pool.topology)
        chips[name] = chips.get(name, 0) + pool.shape.hosts * pool.shape.chips_per_host
    return chips


def queue_manifests(
    pools: Sequence[Pool], tpu_quota: int | Mapping[str, int] | None = None, path: Path = QUEUES_FILE
) -> list[dict[str, Any]]:
    """examples/kueue/queues.yaml for these pools: a flavor per pool type (the file's, or one of the
    same form for a type it lacks), and the ClusterQueue's flavors with `google.com/tpu` quota
    `tpu_quota`: chips per flavor (an int: the same for every flavor; a mapping by flavor name,
    0 for the flavors it leaves out; None: the chips of the pools). The other objects as in the file."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    listed = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceFlavor"}
    capacity = pool_chips(pools)
    flavors: list[dict[str, Any]] = []
    for pool in pools:
        name = flavor_name(pool.accelerator, pool.topology)
        if name not in {f["metadata"]["name"] for f in flavors}:
            flavors.append(copy.deepcopy(listed.get(name) or _flavor(pool.accelerator, pool.topology)))
    queues = [d for d in docs if d["kind"] == "ClusterQueue"]
    if len(queues) != 1 or len(queues[0]["spec"]["resourceGroups"]) != 1:
        raise ValueError(f"{path}: expected one ClusterQueue with one resource group")
    queue = copy.deepcopy(queues[0])
    group = queue["spec"]["resourceGroups"][0]
    template = group["flavors"][0]["resources"]  # cpu/memory as the file gives them
    group["flavors"] = []
    for flavor in flavors:
        name = flavor["metadata"]["name"]
        if tpu_quota is None:
            chips = capacity[name]
        elif isinstance(tpu_quota, int):
            chips = tpu_quota
        else:
            chips = tpu_quota.get(name, 0)
        resources = [
            {"name": r["name"], "nominalQuota": chips if r["name"] == TPU_RESOURCE else r["nominalQuota"]}
            for r in template
        ]
        group["flavors"].append({"name": name, "resources": resources})
    others = [copy.deepcopy(d) for d in docs if d["kind"] not in ("ResourceFlavor", "ClusterQueue")]
    return [*flavors, queue, *others]


def kueue_config(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration: loopback only, nothing served but the webhooks and the health probes."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "integrations": {"frameworks": ["jobset.x-k8s.io/jobset"]},
        # The on-demand visibility API is an aggregated API server on all interfaces: not wanted.
        "featureGates": {"VisibilityOnDemand": False},
    }


def kueue_webhooks(kueue_dir: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations from its module, pointed at the locally served webhooks: only
    the hooks for Kueue's own kinds and for JobSets (the other integrations are off)."""
    docs = [d for d in yaml.safe_load_all((kueue_dir / "webhooks.yaml").read_text()) if d]
    result = []
    for doc in docs:
        doc = copy.deepcopy(doc)
        doc["metadata"]["name"] = f"kueue-{doc['metadata']['name']}"
        hooks = []
        for hook in doc["webhooks"]:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if not groups & {KUEUE_GROUP, JOBSET_GROUP}:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
            hooks.append(hook)
        doc["webhooks"] = hooks
        result.append(doc)
    return result


def kueue_crds(kueue_dir: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's CRDs from its module; the converted kinds call the local /convert webhook."""
    crds = [d for d in yaml.safe_load_all((kueue_dir / "crds.yaml").read_text()) if d]
    for crd in crds:
        if crd["metadata"]["name"] in CONVERTED_CRDS:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": f"https://127.0.0.1:{port}/convert", "caBundle": ca_bundle},
                    "conversionReviewVersions": ["v1"],
                },
            }
    return crds


def object_path(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    namespace = f"/namespaces/{meta['namespace']}" if meta.get("namespace") else ""
    return f"/apis/{KUEUE_GROUP}/{KUEUE_VERSION}{namespace}/{PLURALS[obj['kind']]}/{meta['name']}"


class Kueue:
    """Kueue's manager for a devcluster's control plane, and the queues it admits from."""

    def __init__(self, plane: ControlPlane, kueue_dir: Path, state_dir: Path, pools: Sequence[Pool]) -> None:
        self.plane = plane
        self.kueue_dir = kueue_dir
        self.state_dir = state_dir
        self.pools = list(pools)

    def start(self, timeout: float = 180.0, tpu_quota: int | Mapping[str, int] | None = None) -> Kueue:
        """Install the CRDs, start the manager, register its webhooks, apply the queues."""
        assert self.plane.pki is not None
        webhook_port, health_port = free_port(), free_port()
        ca_bundle = base64.b64encode(self.plane.pki.ca_cert.read_bytes()).decode()
        crd_dir = self.state_dir / "kueue-crds"
        crd_dir.mkdir(parents=True, exist_ok=True)
        for crd in kueue_crds(self.kueue_dir, webhook_port, ca_bundle):
            path = crd_dir / f"{crd['metadata']['name']}.yaml"
            path.write_text(yaml.safe_dump(crd))
            self.plane.apply_crd(path)
        code, body = self.plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        if code >= 300 and code != 409:
            raise ControlPlaneError(f"creating namespace {NAMESPACE}: {body.get('message')}")
        cert_dir = self.state_dir / "kueue-webhook"
        issue_serving_cert(self.plane.pki, cert_dir, "kueue-webhook")
        metrics_cert_dir = self.state_dir / "kueue-metrics"
        issue_serving_cert(self.plane.pki, metrics_cert_dir, "kueue-metrics")
        config_file = self.state_dir / "kueue-config.yaml"
        config_file.write_text(yaml.safe_dump(kueue_config(webhook_port, health_port, cert_dir)))
        mount = f'mkdir -p {METRICS_CERT_PATH} && mount --bind "$0" {METRICS_CERT_PATH} && exec "$@"'
        manager = Component(
            "kueue",
            [
                "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", mount, str(metrics_cert_dir),
                str(self.kueue_dir / "manager"), f"--config={config_file}", f"--kubeconfig={self.plane.kubeconfig}",
                "--zap-log-level=info",
            ],
            self.state_dir / "logs" / "kueue.log",
        )  # fmt: skip
        self.plane.launch(manager, lambda: http_ok(f"http://127.0.0.1:{health_port}/readyz"), timeout)
        for config in kueue_webhooks(self.kueue_dir, webhook_port, ca_bundle):
            self.plane.register_webhook(config)
        self.apply_queues(tpu_quota, timeout)
        return self

    def apply_queues(self, tpu_quota: int | Mapping[str, int] | None = None, timeout: float = 60.0) -> None:
        """Apply examples/kueue/queues.yaml with this TPU quota (see queue_manifests) and wait until
        the ClusterQueue is active. Changing the quota of a running queue evicts nothing."""
        for obj in queue_manifests(self.pools, tpu_quota):
            self.apply(obj)
        self.wait_active(timeout)

    def add_local_queue(self, namespace: str, name: str = LOCAL_QUEUE) -> None:
        """A LocalQueue in `namespace` pointing at the ClusterQueue (the file's is in `default`)."""
        self.apply(
            {
                "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
                "kind": "LocalQueue",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"clusterQueue": CLUSTER_QUEUE},
            }
        )

    def wait_active(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        conditions: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            _, queue = self.plane.request("GET", f"/apis/{KUEUE_GROUP}/{KUEUE_VERSION}/clusterqueues/{CLUSTER_QUEUE}")
            conditions = (queue.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Active" and c["status"] == "True" for c in conditions):
                return
            time.sleep(0.2)
        raise ControlPlaneError(f"ClusterQueue {CLUSTER_QUEUE} not active after {timeout}s: {conditions}")

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply, as `kubectl apply --server-side --force-conflicts` does."""
        url = f"{self.plane.server}{object_path(obj)}?fieldManager={FIELD_MANAGER}&force=true"
        request = urllib.request.Request(
            url,
            data=json.dumps(obj).encode(),
            method="PATCH",
            headers={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
        )
        context: ssl.SSLContext = self.plane.ssl_context()
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as response:
                result: dict[str, Any] = json.loads(response.read() or b"{}")
                return result
        except urllib.error.HTTPError as error:
            body = json.loads(error.read() or b"{}")
            raise ControlPlaneError(
                f"applying {obj['kind']} {obj['metadata']['name']}: HTTP {error.code}: {body.get('message')}"
            ) from error
