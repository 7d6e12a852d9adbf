"""Shared by the demo, the e2e tests and the benchmarks: install the operator with its Helm chart, make
a namespace pods can run in, summarise measured times (quantiles), and reach the local processes
behind a pod (to inject failures the way a dying host would)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tpujob_contract as contract
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .controlplane import REPO_ROOT, free_port, tools_dir
from .pools import Pool, node_manifests

OPERATOR_NAMESPACE = "tpujob-system"


OPERATOR_RELEASE = "tpujob"
CHART = REPO_ROOT / "charts" / "tpujob"


# The devcluster's apiserver has the 1.35 alpha gates and its pod runner restarts all containers as such a
# kubelet does (controlplane.py, podrunner.py): InPlace jobs need no crash-loop back-off here.
DEVCLUSTER_RESTART_ACTION = "RestartAllContainers"


def helm_install_operator(
    kubeconfig: Path,
    *values: str,
    release: str = OPERATOR_RELEASE,
    chart: Path = CHART,
    namespace: str = OPERATOR_NAMESPACE,
    env: Mapping[str, str] | None = None,
    skip_crds: bool = False,
) -> None:
    """The chart as a user installs it; the image name maps to the local operator in images.yaml, and
    each install gets its own free liveness and metrics ports (several releases may share the cluster).
    `values`: more `--set` assignments (key=value); `env`: added to the operator's environment (the
    chart's extraEnv, as strings: a value that reads as a number stays one)."""
    sets = [
        "image.repository=tpujob-operator", "image.tag=dev", f"livenessPort={free_port()}",
        f"metrics.port={free_port()}", f"inPlaceRestart.restartAction={DEVCLUSTER_RESTART_ACTION}", *values,
    ]  # fmt: skip
    strings = [
        f"extraEnv[{i}].{field}={text}"
        for i, (name, value) in enumerate((env or {}).items())
        for field, text in (("name", name), ("value", value))
    ]
    result = subprocess.run(
        [str(tools_dir() / "helm"), "upgrade", "--install", release, str(chart), "--namespace", namespace,
         "--create-namespace", "--kubeconfig", str(kubeconfig), *(["--skip-crds"] if skip_crds else []),
         "--wait", "--timeout", "3m", *(arg for value in sets for arg in ("--set", value)),
         *(arg for value in strings for arg in ("--set-string", value))],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"helm install of {release} failed:\n{result.stderr}")


def render_template(template: str, *values: str, release: str = OPERATOR_RELEASE) -> dict[str, Any]:
    """One template of the chart as `helm install` of `release` renders it (`values`: --set
    assignments), e.g. the ServiceMonitor a devcluster Prometheus stands in for."""
    result = subprocess.run(
        [str(tools_dir() / "helm"), "template", release, str(CHART), "-n", OPERATOR_NAMESPACE,
         "-s", f"templates/{template}", *(arg for value in values for arg in ("--set", value))],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"helm template -s templates/{template} failed:\n{result.stderr}")
    document: dict[str, Any] = yaml.safe_load(result.stdout)
    return document


def quantiles(values: Iterable[float | None], points: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """p<point> for each point (numpy's default, linear interpolation between the closest ranks), max
    and n of the known values. With n < 100 the p99 lies between the two largest values: read it with n."""
    known = sorted(v for v in values if v is not None)
    found: dict[str, float | None] = dict.fromkeys([*(f"p{point}" for point in points), "max"])
    if known:
        for point in points:
            rank = (len(known) - 1) * point / 100
            low = math.floor(rank)
            high = min(low + 1, len(known) - 1)
            found[f"p{point}"] = round(known[low] + (rank - low) * (known[high] - known[low]), 3)
        found["max"] = round(known[-1], 3)
    return found | {"n": len(known)}


def pod_pids(state_dir: Path, namespace: str, pod_name: str) -> list[int]:
    """The pod runner starts each pod in its own process group, led by the pid it records."""
    leader = int((state_dir / "pods" / namespace / pod_name / "pid").read_text())
    return [pid for pid in _all_pids() if _pgid(pid) == leader]


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used (utime + stime from /proc); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def signal_pod(state_dir: Path, namespace: str, pod_name: str, sig: signal.Signals) -> None:
    for pid in pod_pids(state_dir, namespace, pod_name):
        os.kill(pid, sig)


@dataclass(frozen=True)
class LostNode:
    """A node deleted as GKE removes a failed VM (its pods go with it), and what brings it back."""

    name: str
    pool: Pool

    def restore(self, core: Any) -> None:
        """Create the node again as its pool presents it (the same name and labels)."""
        for manifest in node_manifests([self.pool], 0):
            if manifest["metadata"]["name"] == self.name:
                core.create_node(manifest)


def lose_node(core: Any, namespace: str, pod: str) -> LostNode:
    """Delete the node under `pod`."""
    node = core.read_node(core.read_namespaced_pod(pod, namespace).spec.node_name)
    labels = node.metadata.labels
    pool = Pool(labels[contract.NODE_POOL_LABEL], labels[contract.ACCELERATOR_LABEL], labels[contract.TOPOLOGY_LABEL])
    core.delete_node(node.metadata.name)
    return LostNode(str(node.metadata.name), pool)


def live_pod_uids(core: Any, namespace: str, jobset: str) -> dict[str, str]:
    """A JobSet's pods that have not failed, name -> uid: the same pods after an in-place restart."""
    pods = core.list_namespaced_pod(namespace, label_selector=f"{contract.JOBSET_NAME_LABEL}={jobset}").items
    return {str(p.metadata.name): str(p.metadata.uid) for p in pods if p.status.phase != "Failed"}


def trainer_pid(state_dir: Path, namespace: str, pod_name: str, program: str = "tpujob-train") -> int:
    """The trainer process of a pod (under JobSet's agent and its shell on the InPlace rung): killing it
    alone is a crash of the training process, the container's restart rules then decide what follows.
    `program`: what the Python process runs (the built-in trainer's script, or a user's file)."""
    for pid in pod_pids(state_dir, namespace, pod_name):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if Path(argv[0].decode()).name.startswith("python") and any(
            Path(arg.decode(errors="replace")).name == program for arg in argv[1:3]
        ):
            return pid
    raise RuntimeError(f"no trainer process in pod {namespace}/{pod_name}")


def _all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def ensure_namespace(core: Any, namespace: str, timeout: float = 60.0) -> None:
    """The namespace and its default ServiceAccount (pods are refused until the latter exists)."""
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    except ApiException as error:
        if error.status != 409:
            raise
    deadline = time.monotonic() + timeout
    while True:
        try:
            core.read_namespaced_service_account("default", namespace)
            return
        except ApiException as error:
            if error.status != 404:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {namespace} has no default ServiceAccount after {timeout:.0f} s")
        time.sleep(0.2)


def git(*args: str) -> str:
    """A git command in the repository; its stdout."""
    return subprocess.run(["git", *args], cwd=REPO_ROOT, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def worktree(rev: str, parent: Path) -> Iterator[tuple[str, Path]]:
    """REV checked out (detached) under parent, removed again (and forgotten by git) on the way out:
    a benchmark's baseline revision, next to the working tree."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = parent / f"tpujob-{commit[:12]}"
    git("worktree", "add", "--detach", str(path), commit)
    try:
        yield commit, path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO_ROOT, check=False)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO_ROOT, check=False)
