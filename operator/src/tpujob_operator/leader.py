"""One active operator: leader election on a coordination.k8s.io/v1 Lease.

The election itself is the kubernetes client's (`kubernetes.leaderelection`); this module only
configures it, bridges it to kopf's event loop, and makes losing the Lease fatal. Candidates that do
not lead run nothing but the election and a liveness endpoint.

Two gaps in the client's elector (kubernetes==37.0.2) are closed here:
- `LeaseLock.get/create/update` catch only `ApiException`. A connection error (urllib3's
  `MaxRetryError`, e.g. the apiserver restarting) escapes `renew_loop`, so `run()` raises and
  `onstopped_leading` is never called: the process would keep reconciling without renewing.
  `_Lock` turns every error into a failed attempt (retried until the deadline, as client-go does),
  and `Elector` treats any end of the election thread as lost leadership.
- Its API calls carry no timeout and the renew deadline is only checked between calls, so one hung
  request outlives the deadline (and the Lease). `_Lock` bounds every call, and a watchdog exits
  once no renewal has succeeded for `renew_deadline` seconds, measured from when the last
  successful renewal was *sent*, which is never later than the apiserver stored it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

log = logging.getLogger("tpujob.leader")
DEFAULT_LEASE_NAME = "tpujob-operator"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# Exit status when leadership is lost: the Deployment restarts the pod, which campaigns again.
LOST_EXIT_CODE = 3


@dataclass(frozen=True)
class ElectionSettings:
    namespace: str
    identity: str
    lease_name: str = DEFAULT_LEASE_NAME
    # client-go's defaults. Whole seconds: the client stores str(lease_duration) and int()s it back.
    lease_duration: int = 15
    renew_deadline: int = 10
    retry_period: int = 2

    def problem(self) -> str | None:
        """What `electionconfig.Config` would reject (it calls sys.exit), as a message."""
        if self.retry_period < 1:
            return "retry period must be at least 1 s"
        if self.renew_deadline <= 1.2 * self.retry_period:  # the client's jitter factor
            return "renew deadline must exceed 1.2 x retry period"
        if self.lease_duration <= self.renew_deadline:
            return "lease duration must exceed renew deadline"
        return None

    @property
    def request_timeout(self) -> float:
        # Two calls (get + update) per attempt, and at least one more attempt before the deadline.
        return max(1.0, self.renew_deadline / 4)


def lease_namespace(flag: str | None, environ: Mapping[str, str], sa_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """--leader-election-namespace, else POD_NAMESPACE (downward API), else the pod's own, else default."""
    if flag:
        return flag
    if environ.get("POD_NAMESPACE"):
        return environ["POD_NAMESPACE"]
    try:
        return sa_file.read_text().strip() or "default"
    except OSError:
        return "default"


def make_identity(environ: Mapping[str, str], hostname: str, suffix: str) -> str:
    """Pod name (or host name) plus a random suffix: a restarted container never inherits a lease."""
    return f"{environ.get('POD_NAME') or hostname}_{suffix}"


def default_identity() -> str:
    return make_identity(os.environ, socket.gethostname(), secrets.token_hex(4))


def parse_endpoint(url: str) -> tuple[str, int, str]:
    """(host, port, path) of a liveness URL, read the way kopf reads it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"unsupported liveness endpoint: {url}")
    return parts.hostname or "127.0.0.1", parts.port or 80, parts.path or "/"


class _Lock:
    """The client's LeaseLock with bounded calls and no escaping exceptions; records renewals."""

    def __init__(self, settings: ElectionSettings) -> None:
        self._lease = LeaseLock(settings.lease_name, settings.namespace, settings.identity)
        self._timeout = settings.request_timeout
        self.name, self.namespace, self.identity = settings.lease_name, settings.namespace, settings.identity
        self.last_success = time.monotonic()  # when the last successful create/update was sent

    def get(self, name: str, namespace: str) -> tuple[bool, Any]:
        try:
            lease = self._lease.api_instance.read_namespaced_lease(name, namespace, _request_timeout=self._timeout)
        except ApiException as error:
            return False, error  # the elector creates the Lease on a 404 only
        except Exception as error:
            log.warning("reading Lease %s/%s failed: %s", namespace, name, error)
            return False, error
        self._lease.lease_reference = lease
        return True, self._lease.get_lock_object(lease)

    def create(self, name: str, namespace: str, election_record: Any) -> bool:
        sent = time.monotonic()
        body = client.V1Lease(metadata=client.V1ObjectMeta(name=name), spec=self._lease.get_lease_spec(election_record))
        try:
            created = self._lease.api_instance.create_namespaced_lease(namespace, body, _request_timeout=self._timeout)
        except Exception as error:
            log.info("creating Lease %s/%s failed: %s", namespace, name, error)
            return False
        self._lease.lease_reference = created
        self.last_success = sent
        return True

    def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        reference = self._lease.lease_reference
        if reference is None:
            return False
        sent = time.monotonic()
        # replace carries the resourceVersion just read: a concurrent writer makes this fail, never both win.
        reference.spec = self._lease.get_lease_spec(updated_record, reference.spec)
        try:
            self._lease.api_instance.replace_namespaced_lease(
                name=name, namespace=namespace, body=reference, _request_timeout=self._timeout
            )
        except Exception as error:
            log.info("updating Lease %s/%s failed: %s", namespace, name, error)
            return False
        self.last_success = sent
        return True


def exit_now(reason: str) -> None:
    """Leave at once: kopf's graceful shutdown would let in-flight reconciles keep writing."""
    log.critical("leadership lost (%s): exiting", reason)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(LOST_EXIT_CODE)


class Elector:
    """Runs the client's election in a daemon thread; `leading` is set once this process leads."""

    def __init__(self, settings: ElectionSettings, on_lost: Callable[[str], None] = exit_now) -> None:
        self.settings = settings
        self.leading = threading.Event()
        self._on_lost = on_lost
        self._lock = _Lock(settings)
        self._config = electionconfig.Config(
            self._lock,
            settings.lease_duration,
            settings.renew_deadline,
            settings.retry_period,
            self._started_leading,
            lambda: self._on_lost("Lease not renewed"),
        )

    def start(self) -> Elector:
        threading.Thread(target=self._campaign, name="leader-election", daemon=True).start()
        return self

    def _campaign(self) -> None:
        try:
            leaderelection.LeaderElection(self._config).run()  # returns only after onstopped_leading
        except BaseException:
            log.exception("leader election failed")
        # Whatever ended the loop, this process neither leads nor campaigns any more.
        self._on_lost("election loop ended")

    def _started_leading(self) -> None:
        # Called in the client's own short-lived thread: hand over to kopf and start the watchdog.
        log.info("leading: %s holds Lease %s/%s", self.settings.identity, self.namespace, self.lease_name)
        threading.Thread(target=self._watch, name="leader-watchdog", daemon=True).start()
        self.leading.set()

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            silent = time.monotonic() - self._lock.last_success
            if silent > self.settings.renew_deadline:
                self._on_lost(f"no renewal for {silent:.1f}s")
                return

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @property
    def lease_name(self) -> str:
        return self.settings.lease_name


async def wait_until_leading(elector: Elector, liveness: str | None) -> None:
    """Answer liveness probes (kopf does once it runs) until this process leads, then free the port."""
    runner: web.AppRunner | None = None
    if liveness:
        host, port, path = parse_endpoint(liveness)

        async def healthz(_: web.Request) -> web.Response:
            return web.json_response({"leading": False, "identity": elector.settings.identity})

        app = web.Application()
        app.router.add_get(path, healthz)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as error:
            # Only where pods share a network (the devcluster's pod runner) is the leader's port taken;
            # on Kubernetes a follower without this endpoint would fail its probe and be restarted.
            log.warning("liveness endpoint %s unavailable while following: %s", liveness, error)
    try:
        # A threading.Event cannot be awaited; polling it costs nothing and keeps the loop cancellable.
        while not elector.leading.is_set():
            await asyncio.sleep(0.1)
    finally:
        if runner is not None:
            await runner.cleanup()
