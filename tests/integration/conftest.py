"""Integration tier: the operator runs in-process against a real kube-apiserver and fake-gcs-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kopf
import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tpujob_devcluster.controlplane import ControlPlane
from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_operator import api, handlers
from tpujob_operator.runtime import Runtime, RuntimeSettings

T = TypeVar("T")


@pytest.fixture(scope="session")
def kube(control_plane: ControlPlane) -> client.ApiClient:
    return config.new_client_from_config(str(control_plane.kubeconfig))


@pytest.fixture
def namespace(kube: client.ApiClient, unique_name: str) -> Iterator[str]:
    core = client.CoreV1Api(kube)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=unique_name)))
    yield unique_name
    core.delete_namespace(unique_name)


class OperatorThread:
    """The real operator (kopf + our handlers) on its own event loop in a background thread: a runtime
    of its own (`runtime`, fresh clients and memory, as a new operator process has), built from `settings`."""

    def __init__(self, settings: RuntimeSettings | None = None, namespaces: list[str] | None = None) -> None:
        self.namespaces = namespaces  # None: cluster-wide (the chart's default)
        self.runtime = Runtime(settings)
        self.registry = kopf.OperatorRegistry()
        handlers.register(self.runtime, self.registry)
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tpujob-operator", daemon=True)

    def _run(self) -> None:
        asyncio.run(
            kopf.operator(
                registry=self.registry,
                clusterwide=self.namespaces is None,
                namespaces=self.namespaces or [],
                standalone=True,
                stop_flag=self.stop_flag,
                ready_flag=self.ready_flag,
                liveness_endpoint=None,
            )
        )

    def start(self) -> OperatorThread:
        self.thread.start()
        if not self.ready_flag.wait(60):
            raise RuntimeError("operator did not become ready within 60 s")
        return self

    def stop(self) -> None:
        """Stop it for good: an operator left running after its test (cluster-wide, with that test's
        settings, a refusing policy say) would act on the next tests' jobs."""
        self.stop_flag.set()
        self.thread.join(300)  # kopf's shutdown under load takes seconds; this bounds a stuck one
        if self.thread.is_alive():
            raise RuntimeError("the operator thread did not stop within 300 s; later tests would meet it")


@pytest.fixture
def start_operator(
    control_plane: ControlPlane, fake_gcs_server: FakeGcsServer
) -> Iterator[Callable[..., OperatorThread]]:
    """Start an operator (each a new process, remembering nothing), optionally with its flags' settings."""
    started: list[OperatorThread] = []

    def start(settings: RuntimeSettings | None = None, namespaces: list[str] | None = None) -> OperatorThread:
        operator = OperatorThread(settings, namespaces).start()
        started.append(operator)
        return operator

    yield start
    for operator in started:
        operator.stop()


@pytest.fixture
def operator(start_operator: Callable[..., OperatorThread]) -> OperatorThread:
    return start_operator()


def eventually(probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.25, what: str = "") -> T:
    """Poll until `probe` returns something truthy; fail with the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except ApiException as error:
            last = error
        if last and not isinstance(last, ApiException):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or probe}: last={last!r}")


def training_job_manifest(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "image": "tpujob-trainer:dev",
        "args": ["--model", "tiny"],
        "tpu": {"accelerator": "tpu-v5p-slice", "topology": "2x2x2", "slices": 2},
        "checkpoint": {"directory": "gs://tpujob-tests/runs"},
        "restart": {"backoffSeconds": 0},
    }
    base.update(spec)
    return {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "metadata": {"name": name}, "spec": base}
