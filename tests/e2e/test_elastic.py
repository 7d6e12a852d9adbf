"""spec.elastic on the devcluster: a 2-slice job whose second node pool is lost goes on with 1 slice,
grows back to 2 when the pool returns, and ends Succeeded at its final step.

The job's shape (v6e 1x1: one host, one chip a slice) is one no other test asks for, and its two
pools are this test's own: losing one leaves the job no spare to restart on, as on a reserved fleet.
GKE's node pool repair is stood in for by deleting the pool's node and creating it again.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kubernetes import client
from tpujob_devcluster.pools import Pool, node_manifests

from .conftest import E2E, PACED

# Paced: at least 75 s of steps, of which the shrunk attempt's 50 and the grow's wait (GROW_AFTER) spend
# about 35 s; the rest is margin on any machine (a loaded one only trains slower).
STEPS = 1500
SHRINK_AFTER = 10
GROW_AFTER = 30  # the least the API allows: the pool comes back well after that
# Node loss to training on 1 slice: detection (the node is gone) + a new attempt that waits
# SHRINK_AFTER + the smaller attempt's start (process start, restore, compilation) on a busy 2-core machine.
SHRINK_BOUND_SECONDS = SHRINK_AFTER + 150


def _pools(namespace: str) -> list[Pool]:
    return [Pool(f"v6e1-{namespace}-{c}", "tpu-v6e-slice", "1x1") for c in "ab"]


def test_a_lost_pool_shrinks_the_job_and_its_return_grows_it_back(e2e: E2E) -> None:
    name = "elastic"
    pools = _pools(e2e.namespace)
    nodes = {n["metadata"]["name"]: n for n in node_manifests(pools, 0)}
    for node in nodes.values():
        e2e.core.create_node(node)  # type: ignore[arg-type]  # the client posts a dict as it is
    try:
        _lose_and_regain(e2e, name, pools, nodes)
    finally:
        for node_name in nodes:
            with contextlib.suppress(client.ApiException):  # gone already
                e2e.core.delete_node(node_name)


def _lose_and_regain(e2e: E2E, name: str, pools: list[Pool], nodes: dict[str, dict[str, Any]]) -> None:
    e2e.apply(
        name,
        STEPS,
        accelerator=pools[0].accelerator,
        topology=pools[0].topology,
        slices=2,
        elastic={"minSlices": 1, "shrinkAfterSeconds": SHRINK_AFTER, "growAfterSeconds": GROW_AFTER},
        min_step_seconds=PACED,
    )
    status = e2e.wait(
        name,
        lambda s: s.get("phase") == "Running" and (s.get("latestCheckpoint") or {}).get("step", 0) >= 20,
        300,
        "training with a committed step",
    )
    assert status.get("slices") in (None, 2), status
    lost_pod: Any = e2e.core.read_namespaced_pod(e2e.running_pod(f"{name}-a0-slice-1-0"), e2e.namespace)
    lost_node = str(lost_pod.spec.node_name)
    e2e.core.delete_node(lost_node)
    lost_at = time.monotonic()

    status = e2e.wait(
        name,
        lambda s: s.get("slices") == 1 and s.get("phase") == "Running" and s.get("attempt", 0) >= 2,
        SHRINK_BOUND_SECONDS + 60,
        "training on 1 slice",
    )
    shrunk_after = time.monotonic() - lost_at
    resize = status["lastResize"]
    assert (resize["reason"], resize["fromSlices"], resize["toSlices"]) == ("CapacityLost", 2, 1), resize
    assert status["lastFailure"]["kind"] == "NodeLost" and status["countedRestarts"] == 0, status
    assert shrunk_after <= SHRINK_BOUND_SECONDS, (shrunk_after, status)
    attempt = status["attempt"]
    live = [p for p in e2e.pods(f"tpujob.dev/name={name},tpujob.dev/attempt={attempt}")]
    assert len(live) == 1, [p.metadata.name for p in live]  # one slice of one host
    step_at_shrink = status["step"]

    # The shrunk attempt trains, then the pool comes back.
    e2e.wait(name, lambda s: (s.get("step") or 0) >= step_at_shrink + 50, 240, "50 steps on 1 slice")
    e2e.core.create_node(nodes[lost_node])  # type: ignore[arg-type]
    status = e2e.wait(
        name,
        lambda s: s.get("slices") == 2 and s.get("phase") == "Running" and s.get("resizes") == 2,
        300,
        "training on 2 slices again",
    )
    resize = status["lastResize"]
    assert (resize["reason"], resize["fromSlices"], resize["toSlices"]) == ("CapacityReturned", 1, 2), resize

    status = e2e.wait(name, lambda s: s.get("phase") == "Succeeded", 600, "Succeeded")
    assert status["step"] == STEPS and e2e.latest_committed(name) == STEPS, status
    assert (status["resizes"], status["restarts"], status["countedRestarts"]) == (2, 1, 0), status
    # The growing stop saved on SIGTERM: the grown attempt resumed from where the small one stopped.
    grown = status["lastResize"]["attempt"]
    assert e2e.progress(name) is not None
    reasons = [r for r, _ in e2e.event_records(name)]
    assert reasons.count("Resized") == 2, reasons
    small_log = next(d for d in e2e.pod_dirs(name) if d.name.startswith(f"{name}-a{attempt}-"))
    assert "elastic: 1 of 2 slices" in (small_log / "log").read_text(), small_log
    goodput = status["goodput"]
    assert goodput["badput"]["reducedSizeSeconds"] > 0, goodput
    assert grown == attempt + 1, status
    print(f"elastic: node lost -> training on 1 slice in {shrunk_after:.1f}s; goodput {goodput}")
