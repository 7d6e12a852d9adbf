"""Shared by the demo, the e2e tests and the benchmarks: install the operator with its Helm chart, make
a namespace pods can run in, and reach the local processes behind a pod (to inject failures the way a
dying host would)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .controlplane import REPO_ROOT, free_port, tools_dir

OPERATOR_NAMESPACE = "tpujob-system"


def helm_install_operator(kubeconfig: Path, *values: str) -> None:
    """The chart as a user installs it; the image name maps to the local operator in images.yaml.
    `values`: more `--set` assignments (key=value)."""
    result = subprocess.run(
        [str(tools_dir() / "helm"), "upgrade", "--install", "tpujob", str(REPO_ROOT / "charts" / "tpujob"),
         "--namespace", OPERATOR_NAMESPACE, "--create-namespace", "--kubeconfig", str(kubeconfig),
         "--set", "image.repository=tpujob-operator", "--set", "image.tag=dev",
         "--set", f"livenessPort={free_port()}", "--set", f"metrics.port={free_port()}",
         *(arg for value in values for arg in ("--set", value)), "--wait", "--timeout", "3m"],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"helm install of the operator failed:\n{result.stderr}")


def pod_pids(state_dir: Path, namespace: str, pod_name: str) -> list[int]:
    """The pod runner starts each pod in its own process group, led by the pid it records."""
    leader = int((state_dir / "pods" / namespace / pod_name / "pid").read_text())
    return [pid for pid in _all_pids() if _pgid(pid) == leader]


def signal_pod(state_dir: Path, namespace: str, pod_name: str, sig: signal.Signals) -> None:
    for pid in pod_pids(state_dir, namespace, pod_name):
        os.kill(pid, sig)


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
