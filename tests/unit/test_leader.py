"""Leader election: settings, flags, and the elector over an in-memory Lease API."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock
from tpujob_operator import leader
from tpujob_operator.__main__ import election_settings, parse_args


def test_defaults_are_client_gos():
    args = parse_args([])
    assert args.leader_elect is True
    settings = election_settings(args, identity="me")
    assert (settings.lease_duration, settings.renew_deadline, settings.retry_period) == (15, 10, 2)
    assert settings.lease_name == "tpujob-operator"
    assert parse_args(["--no-leader-elect"]).leader_elect is False


def test_bad_timings_are_refused_by_the_parser():
    with pytest.raises(SystemExit):
        parse_args(["--lease-duration", "10", "--renew-deadline", "10"])
    # Without election the timings do not matter.
    assert parse_args(["--no-leader-elect", "--lease-duration", "1"]).leader_elect is False


@pytest.mark.parametrize("lease", [1, 2, 3, 4, 15])
@pytest.mark.parametrize("renew", [1, 2, 3, 10])
@pytest.mark.parametrize("retry", [0, 1, 2])
def test_problem_agrees_with_the_clients_config(lease, renew, retry):
    settings = leader.ElectionSettings("ns", "me", lease_duration=lease, renew_deadline=renew, retry_period=retry)
    try:
        electionconfig.Config(object(), lease, renew, retry, lambda: None, None)
        accepted = True
    except SystemExit:
        accepted = False
    assert (settings.problem() is None) == accepted


def test_lease_namespace_precedence(tmp_path: Path):
    sa = tmp_path / "namespace"
    sa.write_text("from-token\n")
    assert leader.lease_namespace("flag", {"POD_NAMESPACE": "env"}, sa) == "flag"
    assert leader.lease_namespace(None, {"POD_NAMESPACE": "env"}, sa) == "env"
    assert leader.lease_namespace(None, {}, sa) == "from-token"
    assert leader.lease_namespace(None, {}, tmp_path / "missing") == "default"


def test_identity_is_pod_name_plus_suffix():
    assert leader.make_identity({"POD_NAME": "op-7f"}, "host", "ab12") == "op-7f_ab12"
    assert leader.make_identity({}, "host", "ab12") == "host_ab12"
    assert leader.default_identity() != leader.default_identity()


def test_parse_endpoint():
    assert leader.parse_endpoint("http://0.0.0.0:8080/healthz") == ("0.0.0.0", 8080, "/healthz")
    assert leader.parse_endpoint("http://127.0.0.1:9/") == ("127.0.0.1", 9, "/")
    with pytest.raises(ValueError):
        leader.parse_endpoint("https://x/healthz")


class FakeLeaseApi:
    """Enough of CoordinationV1Api for one Lease, with resourceVersion conflicts, and a switch to fail."""

    def __init__(self) -> None:
        self.lease: Any = None
        self.version = 0
        self.broken: Exception | None = None
        self.mutex = threading.Lock()

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> Any:
        self._check()
        with self.mutex:
            if self.lease is None:
                missing = ApiException(status=404, reason="NotFound")
                missing.body = '{"kind": "Status", "code": 404}'  # what the apiserver sends
                raise missing
            return copy.deepcopy(self.lease)

    def create_namespaced_lease(self, namespace: str, body: Any, **_: Any) -> Any:
        self._check()
        with self.mutex:
            if self.lease is not None:
                raise ApiException(status=409, reason="AlreadyExists")
            self.version += 1
            body.metadata.resource_version = str(self.version)
            self.lease = copy.deepcopy(body)
            return copy.deepcopy(body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **_: Any) -> Any:
        self._check()
        with self.mutex:
            if body.metadata.resource_version != self.lease.metadata.resource_version:
                raise ApiException(status=409, reason="Conflict")
            self.version += 1
            body.metadata.resource_version = str(self.version)
            self.lease = copy.deepcopy(body)
            return copy.deepcopy(body)


def _with_fake_api(elector: leader.Elector, api: Any) -> leader.Elector:
    elector._lock._lease.api_instance = api
    return elector


FAST = {"lease_duration": 3, "renew_deadline": 2, "retry_period": 1}


def test_one_leader_and_loss_on_connection_errors():
    api = FakeLeaseApi()
    lost: list[str] = []
    first = _with_fake_api(leader.Elector(leader.ElectionSettings("ns", "a", **FAST), lost.append), api).start()
    assert first.leading.wait(5)
    second = _with_fake_api(leader.Elector(leader.ElectionSettings("ns", "b", **FAST), lost.append), api).start()
    time.sleep(2.5)
    assert not second.leading.is_set() and api.lease.spec.holder_identity == "a"
    # Not an ApiException: the client's own LeaseLock lets this escape its renew loop.
    api.broken = ConnectionError("apiserver unreachable")
    deadline = time.monotonic() + FAST["renew_deadline"] + 1.5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost, "leadership loss not reported within the renew deadline"
    assert not second.leading.is_set()


def test_the_clients_own_lock_lets_connection_errors_escape():
    """Why leader._Lock exists: with the stock LeaseLock, run() raises and onstopped_leading never runs."""
    api = FakeLeaseApi()
    lock = LeaseLock("lease", "ns", "a")
    lock.api_instance = api
    stopped = threading.Event()

    def started() -> None:
        api.broken = ConnectionError("apiserver unreachable")

    config = electionconfig.Config(lock, 3, 2, 1, started, stopped.set)
    with pytest.raises(ConnectionError):
        leaderelection.LeaderElection(config).run()
    assert not stopped.is_set()


def test_a_stolen_lease_is_lost():
    api = FakeLeaseApi()
    lost: list[str] = []
    elector = _with_fake_api(leader.Elector(leader.ElectionSettings("ns", "a", **FAST), lost.append), api).start()
    assert elector.leading.wait(5)
    with api.mutex:
        api.version += 1
        api.lease.metadata.resource_version = str(api.version)
        api.lease.spec.holder_identity = "intruder"
    deadline = time.monotonic() + FAST["renew_deadline"] + 1.5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost
    assert isinstance(api.lease, client.V1Lease) and api.lease.spec.holder_identity == "intruder"
