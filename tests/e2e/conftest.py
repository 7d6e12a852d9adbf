"""E2E tier: the whole loop on the devcluster (real scheduler, JobSet controller, kwok nodes, pod
runner, GCS emulator), with the operator installed by its Helm chart and run as a pod.

Stand-ins, named as such: the pod runner replaces kubelet + container runtime (pods run as local
processes), kwok replaces node VMs, TPU chips are CPU devices, fake-gcs-server replaces GCS.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from kubernetes import client, config
from tpujob_contract import JOBSET_GROUP, JOBSET_VERSION, ProgressRecord
from tpujob_devcluster.cluster import BUCKET, DevCluster
from tpujob_devcluster.harness import cpu_seconds, helm_install_operator, pod_pids, signal_pod
from tpujob_devcluster.kueue import HIGH_PRIORITY, LOW_PRIORITY
from tpujob_operator import api, checkpoints

E2E_POOLS = {
    # 2 jobs x 2 slices at once, plus a spare for a restart; v5e pools for the 1-host failure tests.
    "pools": [{"name": f"v5p-{c}", "accelerator": "tpu-v5p-slice", "topology": "2x2x2"} for c in "abcde"]
    # v5e d-g: the fault matrix runs five 1-host jobs side by side, each with a spare pool for its
    # restart (a replacement slice may be placed while the failed one's pod is still terminating).
    + [{"name": f"v5e-{c}", "accelerator": "tpu-v5-lite-podslice", "topology": "2x2"} for c in "abcdefg"]
    # v4: the hot-spare test's own shape (no other test asks for it, and v6e must stay absent for the
    # fault matrix's long scheduling), full with its 2-slice job and one spare placeholder.
    + [{"name": f"v4-{c}", "accelerator": "tpu-v4-podslice", "topology": "2x2x1"} for c in "abc"],
    "system_nodes": 1,
}


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    state = tmp_path_factory.mktemp("devcluster")
    pools = state / "pools.yaml"
    pools.write_text(yaml.safe_dump(E2E_POOLS))
    # Kueue runs for every e2e test: jobs without its queue label must behave exactly as without it. A job of
    # several processes reads what the same process index compiled before, as TPU hosts read the slice's
    # shared cache (podrunner.process_compile_cache; an InPlace job's pods keep their own volume's).
    compiled = tmp_path_factory.mktemp("process-compile-cache")
    cluster = DevCluster(state, pools, kueue=True, process_compile_cache=compiled).start()
    try:
        # Status follows the trainer within 5 s (the default, 60 s, would add up to a minute to every wait).
        # The devcluster's WorkloadPriorityClasses, which tests/e2e/test_kueue.py labels its jobs with.
        priorities = f"policy.allowedPriorityClasses={{{LOW_PRIORITY},{HIGH_PRIORITY}}}"
        helm_install_operator(cluster.kubeconfig, "kueue.enabled=true", "reconcile.progressCheckSeconds=5", priorities)
        yield cluster
    finally:
        cluster.stop()


# Steps of at least 50 ms: the tiny model's own take a few ms, so an unpaced job of the same length
# would train 5-10 times as many steps, each about 24 ms of CPU, and starve the tests beside it.
PACED = 0.05


def trainer_args(steps: int, min_step_seconds: float = 0.0) -> list[str]:
    """The built-in trainer's arguments for an e2e job. `min_step_seconds` pads each step (its
    --min-step-seconds): a job that must still be training when its test acts lasts at least steps x
    that on any machine, at a fraction of the CPU of the unpaced steps it would otherwise need."""
    paced = ["--min-step-seconds", str(min_step_seconds)] if min_step_seconds else []
    return ["--model", "tiny", "--steps", str(steps), "--batch-size", "8", "--log-every", "10", *paced]


class E2E:
    """Test-side view of the devcluster: the API, the bucket, the pod processes."""

    def __init__(self, cluster: DevCluster, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.api = config.new_client_from_config(str(cluster.kubeconfig))
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        assert cluster.gcs is not None
        self.gcs = storage.Client(
            project="e2e", credentials=AnonymousCredentials(), client_options={"api_endpoint": cluster.gcs.endpoint}
        )

    def apply(
        self,
        name: str,
        steps: int,
        accelerator: str = "tpu-v5p-slice",
        topology: str = "2x2x2",
        slices: int = 2,
        extra_args: list[str] | None = None,
        min_step_seconds: float = 0.0,
        **spec: Any,
    ) -> None:
        manifest = {
            "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "metadata": {"name": name},
            "spec": {
                "image": "tpujob-trainer:dev",
                "args": [*trainer_args(steps, min_step_seconds), *(extra_args or [])],
                "tpu": {"accelerator": accelerator, "topology": topology, "slices": slices},
                # Continuous, at least a second apart: back to back, the tiny model's saves cost a third of
                # its CPU and the emulator's; no test of the default asks for more than a commit a second.
                "checkpoint": {"directory": f"gs://{BUCKET}/e2e", "policy": "continuous", "minIntervalSeconds": 1},
                "restart": {"backoffSeconds": 1, **spec.pop("restart", {})},
                **spec,
            },
        }  # fmt: skip
        self.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, api.PLURAL, manifest)

    def status(self, name: str) -> dict[str, Any]:
        body: Any = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, api.PLURAL, name)
        return body.get("status") or {}

    def wait(
        self,
        name: str,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        cap: float | None = None,
    ) -> dict[str, Any]:
        """The job's status once `predicate` holds, within `timeout`. With `cap`, `timeout` counts from
        the last new step, at most `cap` in all: a loaded machine trains slower, and only a job that
        stops moving has failed."""
        started = time.monotonic()
        deadline = started + timeout
        status: dict[str, Any] = {}
        best = -1
        while time.monotonic() < deadline:
            status = self.status(name)
            if predicate(status):
                return status
            if status.get("phase") == "Failed" and "Failed" not in what:
                break
            if cap is not None and (status.get("step") or 0) > best:
                best = status.get("step") or 0
                deadline = min(time.monotonic() + timeout, started + cap)
            time.sleep(0.5)
        raise AssertionError(f"{name}: waiting for {what}; last status {status}\n{self.logs_tail(name)}")

    def cpu_seconds(self, name: str) -> float:
        """CPU time the job's pods have burnt so far (the pod runner's process groups): a trainer that
        compiles or restores in silence still burns it, one that waits on a dead peer does not."""
        total = 0.0
        for directory in self.pod_dirs(name):
            try:
                pids = pod_pids(self.cluster.state_dir, self.namespace, directory.name)
            except (OSError, ValueError):
                continue  # a pod not started, or gone
            total += sum(cpu_seconds(pid) for pid in pids)
        return total

    def wait_working(
        self, name: str, predicate: Callable[[dict[str, Any]], bool], what: str, quiet: float = 180, busy: float = 10
    ) -> dict[str, Any]:
        """The job's status once `predicate` holds; fails only on a stall: `quiet` seconds in which its
        step did not move and its pods burnt less than `busy` CPU seconds (a start-up's compile is
        silent in the log and in status, and takes what a loaded machine makes it take)."""
        status: dict[str, Any] = {}
        mark = (time.monotonic(), -1, self.cpu_seconds(name))
        while True:
            status = self.status(name)
            if predicate(status):
                return status
            if status.get("phase") == "Failed" and "Failed" not in what:
                break
            now, step, cpu = time.monotonic(), status.get("step") or 0, self.cpu_seconds(name)
            if step > mark[1] or cpu - mark[2] >= busy:
                mark = (now, step, cpu)
            elif now - mark[0] > quiet:
                break
            time.sleep(0.5)
        raise AssertionError(f"{name}: stalled waiting for {what}; last status {status}\n{self.logs_tail(name)}")

    @staticmethod
    def until(probe: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.5)

    def run_dir(self, name: str) -> str:
        return f"gs://{BUCKET}/e2e/{self.namespace}/{name}"

    def close(self) -> None:
        """The test is done with its namespace: delete it, and its runs leave the emulator
        (FakeGcsServer.forget: every listing walks the whole bucket)."""
        self.core.delete_namespace(self.namespace)
        assert self.cluster.gcs is not None
        self.cluster.gcs.forget(BUCKET, f"e2e/{self.namespace}")

    def latest_committed(self, name: str) -> int | None:
        return checkpoints.latest_committed_step(self.gcs, self.run_dir(name))

    def progress(self, name: str) -> ProgressRecord | None:
        return checkpoints.read_progress(self.gcs, self.run_dir(name))

    def object_names(self, name: str) -> list[str]:
        return [b.name for b in self.gcs.list_blobs(BUCKET, prefix=f"e2e/{self.namespace}/{name}/")]

    def pods(self, selector: str = "") -> list[Any]:
        return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)

    def pod_dirs(self, name: str) -> list[Path]:
        return sorted((self.cluster.state_dir / "pods" / self.namespace).glob(f"{name}-*"))

    def trainer_pids(self, pod_name: str) -> list[int]:
        return pod_pids(self.cluster.state_dir, self.namespace, pod_name)

    def signal_pod(self, pod_name: str, sig: signal.Signals) -> None:
        signal_pod(self.cluster.state_dir, self.namespace, pod_name, sig)

    def running_pod(self, prefix: str, timeout: float = 60) -> str:
        """A Running pod named `prefix`*: the pod runner reports a started pod Running a moment after the
        trainer's first record may already show, on a busy machine."""
        deadline = time.monotonic() + timeout
        while True:
            pods = [p for p in self.pods() if str(p.metadata.name).startswith(prefix)]
            for pod in pods:
                if pod.status.phase == "Running":
                    return str(pod.metadata.name)
            if time.monotonic() > deadline:
                raise AssertionError(f"no running pod {prefix}*: {[(p.metadata.name, p.status.phase) for p in pods]}")
            time.sleep(0.5)

    def logs_tail(self, name: str, lines: int = 15) -> str:
        out = []
        for directory in self.pod_dirs(name)[-4:]:
            text = (directory / "log").read_text(errors="replace").splitlines() if (directory / "log").exists() else []
            out.append(f"--- {directory.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def wait_events(self, name: str, reasons: set[str], uid: str | None = None, timeout: float = 30) -> set[str]:
        """The reasons of the Events about `name` (incarnation `uid` if given), once they include every
        one of `reasons`: the operator posts a decision's Events after it writes the status that shows it."""
        posted: set[str] = set()

        def all_posted() -> bool:
            posted.clear()
            posted.update(reason for reason, _ in self.event_records(name, uid))
            return reasons <= posted

        try:
            self.until(all_posted, timeout, f"{name}'s Events {sorted(reasons)}")
        except AssertionError as missing:
            raise AssertionError(f"{missing}; posted: {sorted(posted)}") from None
        return posted

    def event_records(self, name: str, uid: str | None = None) -> list[tuple[str, str]]:
        """(reason, message) of the Events about `name`, only those of incarnation `uid` if given."""
        selector = f"involvedObject.name={name}" + (f",involvedObject.uid={uid}" if uid else "")
        found = self.core.list_namespaced_event(self.namespace, field_selector=selector)
        return [(e.reason or "", e.message or "") for e in found.items]

    def uid(self, name: str) -> str:
        body: Any = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, api.PLURAL, name)
        return str(body["metadata"]["uid"])

    def patch_spec(self, name: str, **fields: Any) -> None:
        self.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, name, {"spec": fields}
        )

    def delete_job(self, name: str, propagation: str = "Background") -> None:
        self.custom.delete_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, name,
            body=client.V1DeleteOptions(propagation_policy=propagation),
        )  # fmt: skip

    def exists(self, name: str) -> bool:
        try:
            self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, api.PLURAL, name)
        except client.ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def jobsets(self) -> list[dict[str, Any]]:
        """Every JobSet in the namespace, as the apiserver has it now."""
        found: Any = self.custom.list_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.namespace, "jobsets")
        return list(found["items"])

    def committed_steps(self, name: str) -> list[int]:
        """Every committed step in the bucket (the step's own commit marker exists), ascending."""
        prefix = f"e2e/{self.namespace}/{name}/checkpoints/"
        steps = set()
        for blob in self.gcs.list_blobs(BUCKET, prefix=prefix):
            head, _, tail = blob.name[len(prefix) :].partition("/")
            if tail == checkpoints.COMMIT_MARKER and head.isdigit():
                steps.add(int(head))
        return sorted(steps)


# Every e2e namespace enforces the `restricted` Pod Security standard (the apiserver's PodSecurity
# admission): each job, failure and restart of the e2e tier shows the worker pods pass it.
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


def make_namespace(cluster: DevCluster, name: str) -> E2E:
    """A namespace of its own (ready for pods, enforcing `restricted`) and the test's view of it."""
    view = E2E(cluster, name)
    view.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=RESTRICTED)))
    # The ServiceAccount admission plugin needs the namespace's default ServiceAccount first.
    deadline = time.monotonic() + 30
    while not view.core.list_namespaced_service_account(name).items and time.monotonic() < deadline:
        time.sleep(0.2)
    return view


# name -> (the scenario, the TrainingJob it runs): scenarios that run side by side.
Scenarios = dict[str, tuple[Callable[[E2E], None], str]]


def run_side_by_side(cluster: DevCluster, scenarios: Scenarios, label: str, budget_s: float, capsys: Any) -> None:
    """Each scenario in its own namespace and thread, all at once; every failure is reported (with
    its job's status, Events and log tail), not only the first. Their waits overlap: on 2 cores a
    scenario mostly waits on timeouts, schedulers and restarts, not on the CPU."""
    views = {key: make_namespace(cluster, f"{label}-{key}-{uuid.uuid4().hex[:4]}") for key in scenarios}
    results: dict[str, tuple[str, float, str]] = {}

    def run(key: str) -> None:
        started = time.monotonic()
        try:
            scenarios[key][0](views[key])
            results[key] = ("passed", time.monotonic() - started, "")
        except BaseException:
            results[key] = ("FAILED", time.monotonic() - started, traceback.format_exc())

    threads = [threading.Thread(target=run, args=(key,), name=key, daemon=True) for key in scenarios]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + budget_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        summary = {k: results.get(k, ("TIMED OUT", float("nan"), "")) for k in scenarios}
        with capsys.disabled():
            for key, (outcome, seconds, _) in summary.items():
                print(f"\n{label}: {key:16} {outcome:9} {seconds:6.1f}s")
        failed = {k: v for k, v in summary.items() if v[0] != "passed"}
        details = []
        for key, (outcome, _, trace) in failed.items():
            view, job = views[key], scenarios[key][1]
            try:
                final = json.dumps(view.status(job), indent=1) if view.exists(job) else "(no TrainingJob)"
                events = "\n".join(f"{r}: {m}" for r, m in view.event_records(job))
            except Exception as error:  # the report must not hide the failure it reports
                final, events = repr(error), ""
            details.append(
                f"== {key}: {outcome}\n{trace}\nstatus: {final}\nevents:\n{events}\n{view.logs_tail(job, 25)}"
            )
        for view in views.values():
            view.close()
    assert not failed, "\n".join(details)


@pytest.fixture
def e2e(devcluster: DevCluster, unique_name: str) -> Iterator[E2E]:
    view = make_namespace(devcluster, unique_name)
    yield view
    view.close()
