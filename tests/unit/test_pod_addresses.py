"""Pod addresses are unique on the machine, across devclusters (issue 17, item 14).

Every devcluster's pods share the host's loopback, every JAX coordinator listens on the same port,
and gRPC binds with SO_REUSEPORT: two pods given one address by two pod runners would both bind
<address>:8476 and the kernel would deal one job's workers to the other's coordinator.
Real pod runner address pools, real locks, real sockets.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from tpujob_devcluster.podrunner import REPO_ROOT, AddressPool, PodRunner

IMAGES = REPO_ROOT / "devcluster" / "images.yaml"


def test_two_devclusters_never_hand_out_the_same_address():
    first, second = AddressPool(), AddressPool()  # two pod runners on this machine, running at once
    try:
        ours = {first.take() for _ in range(300)}
        theirs = {second.take() for _ in range(300)}
        assert len(ours) == len(theirs) == 300
        assert not ours & theirs, sorted(ours & theirs)[:5]
        assert all(ipaddress.IPv4Address(a).is_loopback and a != "127.0.0.1" for a in ours | theirs)
    finally:
        for pool in (first, second):
            getattr(pool, "close", lambda: None)()


def test_an_address_a_live_process_still_holds_is_skipped():
    """A pod of a runner that died (its block free again) may still listen, as JAX does: on [::ffff:ip]."""
    pool = AddressPool()
    try:
        taken = ipaddress.IPv4Address(pool.take())
        held = str(taken + 1)  # the address the pool would hand out next
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as orphan:
            orphan.bind((f"::ffff:{held}", 0))
            orphan.listen()
            following = pool.take()
        assert following != held
        assert ipaddress.IPv4Address(following) > taken
    finally:
        getattr(pool, "close", lambda: None)()


def test_hosts_files_name_only_running_pods(tmp_path: Path):
    """An earlier runner's hosts files are gone when a runner starts (their addresses may be another
    pod's now), and a pod that ended leaves its subdomain's hosts file."""
    stale = tmp_path / "hosts" / "default_job-a0"
    stale.parent.mkdir()
    stale.write_text("127.0.0.1 localhost\n127.1.0.9 job-a0-slice-0-0.job-a0\n")
    runner = PodRunner(tmp_path, IMAGES, {}, api_port=1, cpu_devices_per_pod=1)
    try:
        assert not stale.exists()
        hosts = runner._hosts_path("default", "job-a0", "job-a0-slice-0-0-x")
        first, second = runner.addresses.take(), runner.addresses.take()
        runner._add_host(hosts, first, ["job-a0-slice-0-0.job-a0.default.svc.cluster.local", "job-a0-slice-0-0.job-a0"])
        runner._add_host(
            hosts, second, ["job-a0-slice-0-1.job-a0.default.svc.cluster.local", "job-a0-slice-0-1.job-a0"]
        )
        runner._remove_host(hosts, first)
        lines = hosts.read_text().splitlines()
        assert lines[0] == "127.0.0.1 localhost" and len(lines) == 2 and lines[1].startswith(f"{second} ")
    finally:
        runner.addresses.close()
