"""The own-loop example (examples/own-loop: a Flax NNX loop on real text, protected by the trainer library)
as the TrainingJob it ships with, on the devcluster, on both rungs at once: a worker's process is killed,
the job comes back by itself (in place from node memory; recreated from GCS), only the kill is counted,
it ends Succeeded at its final step, committed, and its goodput ledger adds up to the apiserver's clock."""

from __future__ import annotations

import os
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from tpujob_devcluster.cluster import BUCKET
from tpujob_devcluster.harness import trainer_pid
from tpujob_operator import api

from .conftest import E2E, run_side_by_side

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-loop" / "trainingjob.yaml"
STEPS = 160
KILL_AFTER = 40  # steps trained, and a GCS commit, before the kill


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _apply_example(e2e: E2E, name: str, strategy: str) -> None:
    """The example's manifest as shipped, on two 1-host v5e slices, into the e2e bucket, shorter."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = name
    spec = manifest["spec"]
    spec["args"] = ["--steps", str(STEPS), "--batch-size", "8", "--log-every", "10"]
    spec["tpu"] = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 2}
    spec["checkpoint"]["directory"] = f"gs://{BUCKET}/e2e"
    spec["restart"] = {**spec["restart"], "strategy": strategy, "backoffSeconds": 1}
    e2e.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, e2e.namespace, api.PLURAL, manifest)


def _killed_once_and_succeeded(e2e: E2E, name: str) -> dict[str, Any]:
    e2e.wait(
        name,
        lambda s: (s.get("step") or 0) >= KILL_AFTER and (e2e.latest_committed(name) or 0) > 0,
        300,
        "training with a committed step",
        cap=900,
    )
    victim = e2e.running_pod(f"{name}-a0-slice-1-0")
    os.kill(trainer_pid(e2e.cluster.state_dir, e2e.namespace, victim, program="train.py"), signal.SIGKILL)
    status = e2e.wait(name, lambda s: s.get("phase") == "Succeeded", 300, "Succeeded", cap=900)

    failure = status["lastFailure"]
    assert (failure["kind"], failure["reason"], failure["counted"]) == ("ApplicationError", "ExitCode137", True)
    assert (status["restarts"], status["countedRestarts"]) == (1, 1), status  # the kill, and nothing else
    assert status["step"] == STEPS and e2e.latest_committed(name) == STEPS, status
    ledger = status["goodput"]
    parts = ledger["productiveSeconds"] + sum(ledger["badput"].values())
    body: Any = e2e.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, e2e.namespace, api.PLURAL, name)
    created = _time(body["metadata"]["creationTimestamp"])  # the apiserver's clock
    wall = (_time(status["completionTime"]) - created).total_seconds()
    assert abs(ledger["wallSeconds"] - parts) < 0.01 and abs(parts - wall) <= 0.02 * wall + 2, (parts, wall, ledger)
    # Training time was counted (the trainer's blocked save time is moved out of it: on a loaded machine
    # a short job's continuous saves can take all of it), and so was the restore.
    training = ledger["productiveSeconds"] + ledger["badput"]["checkpointSaveSeconds"]
    assert training > 0 and ledger["badput"]["restoreSeconds"] > 0, ledger
    return status


def _in_place(e2e: E2E) -> None:
    _apply_example(e2e, "ownloop", "InPlace")
    status = _killed_once_and_succeeded(e2e, "ownloop")
    assert (status["attempt"], status["inPlaceRestarts"], status["lastFailure"]["rung"]) == (0, 1, "InPlace")
    record = e2e.progress("ownloop")
    # From memory: each process's own tier, or, where the kill cut the killed process's local save short
    # while the other slice committed that step, the other slice's (a newer step: peer). The bucket only
    # where its newest step is one the local tier never saves (it saves multiples of its interval, the GCS
    # tier continuously): then no memory held a step that new.
    assert record is not None and record.restored_step is not None, record
    local_every = yaml.safe_load(EXAMPLE.read_text())["spec"]["checkpoint"]["local"]["intervalSteps"]
    from_memory = record.restored_from in ("local", "peer")
    assert from_memory or (record.restored_from == "gcs" and record.restored_step % local_every != 0), record


def _recreate(e2e: E2E) -> None:
    _apply_example(e2e, "ownloop", "Recreate")
    status = _killed_once_and_succeeded(e2e, "ownloop")
    assert (status["attempt"], status["inPlaceRestarts"]) == (1, 0), status
    record = e2e.progress("ownloop")
    assert record is not None and record.restored_from == "gcs", record  # new pods: from the bucket


def test_the_own_loop_example_survives_a_killed_worker_on_both_rungs(devcluster, capsys):
    scenarios = {"inplace": (_in_place, "ownloop"), "recreate": (_recreate, "ownloop")}
    run_side_by_side(devcluster, scenarios, "ownloop", budget_s=1500, capsys=capsys)
