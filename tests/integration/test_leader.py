"""One active operator: real `python -m tpujob_operator` processes competing for the Lease on a real apiserver.

Short lease timings keep the tests quick; the Lease lives in the test's namespace and each operator
watches only that namespace, so tests never see each other's operators.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tpujob_contract import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, LABEL_NAME
from tpujob_devcluster.controlplane import ControlPlane, free_port
from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_operator import leader

from .conftest import eventually, training_job_manifest
from .test_operator import Cluster

LEASE = leader.DEFAULT_LEASE_NAME
LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD = 4, 3, 1
# A follower takes over one lease duration after it last saw a renewal, at its next retry. The bounds
# below rule out "never" and "after the lease's own duration again"; the rest is room for a busy machine.
TAKEOVER_SECONDS = 2 * LEASE_DURATION + RETRY_PERIOD + 5


class OperatorProcess:
    """`python -m tpujob_operator` with leader election, as the Deployment runs it."""

    def __init__(self, namespace: str, log_path: Path, pod_name: str) -> None:
        self.log_path = log_path
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        env = {**os.environ, "POD_NAME": pod_name, "PYTHONUNBUFFERED": "1"}
        argv = [
            *(sys.executable, "-m", "tpujob_operator", "--liveness", self.liveness),
            *("--namespace", namespace, "--leader-election-namespace", namespace),
            *("--lease-duration", str(LEASE_DURATION), "--renew-deadline", str(RENEW_DEADLINE)),
            *("--retry-period", str(RETRY_PERIOD)),
        ]
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        found = eventually(
            lambda: re.search(r"campaigning as (\S+) for Lease", self.log()), timeout=60, what=f"{pod_name} starts"
        )
        self.identity = found.group(1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def leads(self) -> bool:
        return f"leading: {self.identity} holds Lease" in self.log()

    def health(self) -> Any:
        with urllib.request.urlopen(self.liveness, timeout=5) as response:
            return json.load(response)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def start_operator(
    control_plane: ControlPlane, fake_gcs_server: FakeGcsServer, namespace: str, tmp_path: Path
) -> Iterator[Callable[[], OperatorProcess]]:
    started: list[OperatorProcess] = []

    def start() -> OperatorProcess:
        operator = OperatorProcess(namespace, tmp_path / f"operator-{len(started)}.log", f"op-{len(started)}")
        started.append(operator)
        return operator

    yield start
    for operator in started:
        if operator.alive():
            operator.kill()
    for operator in started:  # shown by pytest when the test failed
        print(f"--- {operator.identity} (exit {operator.process.returncode})\n{operator.log()[-4000:]}")


def lease_holder(kube: client.ApiClient, namespace: str) -> str | None:
    try:
        lease = client.CoordinationV1Api(kube).read_namespaced_lease(LEASE, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return lease.spec.holder_identity if lease.spec else None


def the_leader(kube: client.ApiClient, namespace: str, candidates: list[OperatorProcess]) -> OperatorProcess:
    """The live candidate the Lease names, once it has also started kopf."""
    by_identity = {c.identity: c for c in candidates if c.alive()}

    def leading() -> OperatorProcess | None:
        found = by_identity.get(lease_holder(kube, namespace) or "")
        return found if found is not None and found.leads() else None

    return eventually(leading, timeout=TAKEOVER_SECONDS + 30, what="a leader among the live candidates")


def jobsets_of(kube: client.ApiClient, namespace: str, name: str) -> list[dict[str, Any]]:
    found: Any = client.CustomObjectsApi(kube).list_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, label_selector=f"{LABEL_NAME}={name}"
    )
    return [js for js in found["items"] if not js["metadata"].get("deletionTimestamp")]


def test_one_leads_and_the_other_takes_over_when_it_is_killed(kube, namespace, start_operator, unique_name):
    operators = [start_operator(), start_operator()]
    first = the_leader(kube, namespace, operators)
    [follower] = [o for o in operators if o is not first]
    time.sleep(2 * RETRY_PERIOD)  # several renewal rounds: the Lease stays put and only one runs kopf
    assert lease_holder(kube, namespace) == first.identity
    assert not follower.leads() and follower.alive()
    # Both answer liveness probes: the follower from its own endpoint, the leader from kopf's.
    assert follower.health() == {"leading": False, "identity": follower.identity}
    assert "leading" not in first.health()
    cluster = Cluster(kube, namespace)
    cluster.apply(training_job_manifest(unique_name))
    eventually(lambda: jobsets_of(kube, namespace, unique_name), what="JobSet of the first job")

    first.kill()
    killed_at = time.monotonic()
    during = f"{unique_name}-b"
    cluster.apply(training_job_manifest(during))  # created while nobody leads
    second = the_leader(kube, namespace, operators)
    took = time.monotonic() - killed_at
    assert second is follower and lease_holder(kube, namespace) == follower.identity
    assert took < TAKEOVER_SECONDS, f"takeover took {took:.1f}s"

    eventually(lambda: jobsets_of(kube, namespace, during), what="JobSet of the job created during the handover")
    time.sleep(2)  # a second creator, if any, would show up by now
    assert [js["metadata"]["name"] for js in jobsets_of(kube, namespace, during)] == [f"{during}-a0"]
    assert [js["metadata"]["name"] for js in jobsets_of(kube, namespace, unique_name)] == [f"{unique_name}-a0"]


def test_a_leader_whose_lease_is_taken_exits_at_once(kube, namespace, start_operator):
    operator = start_operator()
    the_leader(kube, namespace, [operator])
    coordination = client.CoordinationV1Api(kube)

    def taken() -> bool:
        """Take the Lease on the version just read; the leader renewing it in between (409) means read again."""
        lease = coordination.read_namespaced_lease(LEASE, namespace)
        lease.spec.holder_identity = "intruder"
        try:
            coordination.replace_namespaced_lease(LEASE, namespace, lease)
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        return True

    eventually(taken, 10 * RETRY_PERIOD, interval=0.05, what="the Lease taken")
    taken_at = time.monotonic()
    assert operator.process.wait(60) == leader.LOST_EXIT_CODE
    # at its next renewal, not after its renew deadline (it stops leading before another may lead)
    assert time.monotonic() - taken_at < LEASE_DURATION + RETRY_PERIOD + 5
    assert "leadership lost" in operator.log()


class LiveJobSetWatch:
    """Polls the job's JobSets in the background and keeps the most that were ever live at once."""

    def __init__(self, kubeconfig: Path, namespace: str, name: str) -> None:
        self.kube = config.new_client_from_config(str(kubeconfig))  # its own client: not shared across threads
        self.namespace, self.name = namespace, name
        self.most: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            names = [js["metadata"]["name"] for js in jobsets_of(self.kube, self.namespace, self.name)]
            if len(names) > len(self.most):
                self.most = names

    def __enter__(self) -> LiveJobSetWatch:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.mark.slow
def test_restarts_are_counted_once_while_the_leader_is_killed_mid_restart(
    kube, control_plane, namespace, start_operator, unique_name
):
    rounds = 4
    # How long after the failure the leader dies: before it saw the failure, mid-reconcile, after it.
    kill_delays = [0.0, 0.15, 0.4, 1.0]
    cluster = Cluster(kube, namespace)
    operators = [start_operator(), start_operator()]
    current = the_leader(kube, namespace, operators)
    cluster.apply(training_job_manifest(unique_name, restart={"backoffSeconds": 0, "maxRestarts": 10}))
    with LiveJobSetWatch(control_plane.kubeconfig, namespace, unique_name) as watch:
        for attempt in range(rounds):
            jobset = eventually(lambda a=attempt: cluster.jobset(f"{unique_name}-a{a}"), what=f"JobSet a{attempt}")
            eventually(lambda a=attempt: cluster.status(unique_name).get("attempt", 0) == a, what=f"attempt {attempt}")
            cluster.fail_slice(jobset, slice_index=0, exit_code=1)
            time.sleep(kill_delays[attempt])
            current.kill()
            operators.append(start_operator())  # two candidates again
            current = the_leader(kube, namespace, operators)
        eventually(lambda: cluster.jobset(f"{unique_name}-a{rounds}"), what=f"JobSet a{rounds}")
        status = eventually(
            lambda: (s := cluster.status(unique_name)).get("attempt") == rounds and s, what=f"attempt {rounds}"
        )
        time.sleep(2)  # any double-counting reconcile would land by now
    status = cluster.status(unique_name)
    assert (status["restarts"], status["attempt"]) == (rounds, rounds)
    assert [js["metadata"]["name"] for js in jobsets_of(kube, namespace, unique_name)] == [f"{unique_name}-a{rounds}"]
    assert len(watch.most) == 1, f"live JobSets at once: {watch.most}"
