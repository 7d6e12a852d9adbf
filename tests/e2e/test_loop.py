"""The demo's loop, asserted: a slice dies mid-training, the job resumes by itself from the latest
committed step and ends bit-for-bit where an uninterrupted twin (running at the same time) ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from typing import Any

from tpujob_devcluster.cluster import BUCKET

from .conftest import E2E

# Long enough that the kill lands mid-training even when the operator reports the first commit late on
# a loaded machine (at 80 steps a CI run's faulty job had finished before the kill).
STEPS = 400
DIGEST = os.path.join(os.path.dirname(__file__), "..", "trainer", "digest.py")


def _placement(e2e: E2E, name: str) -> dict[int, set[str]]:
    """slice index -> node pools its pods ran on."""
    pools: dict[int, set[str]] = defaultdict(set)
    for pod in e2e.pods(f"tpujob.dev/name={name}"):
        if pod.spec.node_name:
            node: Any = e2e.core.read_node(pod.spec.node_name)
            index = int(pod.metadata.annotations["jobset.sigs.k8s.io/job-index"])
            pools[index].add(node.metadata.labels["cloud.google.com/gke-nodepool"])
    return dict(pools)


def _digest(e2e: E2E, name: str, step: int) -> dict[str, str]:
    assert e2e.cluster.gcs is not None
    env = {**os.environ, **e2e.cluster.gcs.env(), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, DIGEST, f"{e2e.run_dir(name)}/checkpoints", str(step)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_slice_failure_resumes_from_latest_committed_step_and_matches_an_uninterrupted_twin(e2e):
    e2e.apply("faulty", STEPS)
    e2e.apply("twin", STEPS)
    e2e.wait(
        "faulty", lambda s: s.get("phase") == "Running" and s.get("latestCheckpoint"), 300, "a committed checkpoint"
    )
    running_placement = {
        **{("faulty", k): v for k, v in _placement(e2e, "faulty").items()},
        **{("twin", k): v for k, v in _placement(e2e, "twin").items()},
    }
    committed_at_kill = e2e.latest_committed("faulty")
    e2e.signal_pod(e2e.running_pod("faulty-a0-slice-1-0"), signal.SIGKILL)

    restarted = e2e.wait("faulty", lambda s: s.get("attempt") == 1 and s.get("lastFailure"), 120, "the restart")
    failure = restarted["lastFailure"]
    assert (failure["kind"], failure["slice"], failure["reason"]) == ("ApplicationError", 1, "ExitCode137")
    # It resumes from what was committed in the bucket when it failed, or later: a save in flight at
    # the kill may commit before the next attempt is created, which then resumes from it.
    assert committed_at_kill is not None and failure["resumeStep"] >= committed_at_kill
    done = e2e.wait("faulty", lambda s: s.get("phase") == "Succeeded", 480, "Succeeded")
    twin = e2e.wait("twin", lambda s: s.get("phase") == "Succeeded", 300, "twin Succeeded")

    assert done["restarts"] == 1 and twin["restarts"] == 0
    resumed = done["lastFailure"]["resumeStep"]
    assert resumed >= failure["resumeStep"] and done["resumedFromStep"] == resumed
    progress = e2e.progress("faulty")
    assert progress is not None and progress.resumed_from_step == resumed and progress.step == STEPS
    assert done["lastFailure"]["recoverySeconds"] > 0
    e2e.wait_events("faulty", {"FailureDetected", "Restarting", "Restored", "Succeeded"})
    # Same data, same steps, exact resume: the final parameters and optimizer state are identical.
    assert _digest(e2e, "faulty", STEPS) == _digest(e2e, "twin", STEPS)
    # Exclusive placement: while both ran, every slice had a node pool of its own.
    pools = [next(iter(v)) for v in running_placement.values()]
    assert all(len(v) == 1 for v in running_placement.values()) and len(set(pools)) == 4, running_placement
    # Each job wrote only under its own run directory.
    for name in ("faulty", "twin"):
        names = e2e.object_names(name)
        assert names and all(n.startswith(f"e2e/{e2e.namespace}/{name}/") for n in names)
    assert BUCKET == "tpujob-demo"
