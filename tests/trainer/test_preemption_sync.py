"""A SIGTERM to one process of two (a preempted or drained host): JAX's preemption sync stops both at
one step, which is saved. Real trainer processes (CPU JAX, gloo), the real GCS emulator.

JAX's protocol takes the step each process last passed to reached_preemption_sync_point as its
position, and stops everyone one step past the furthest: every process must pass it each step, in
order, from the training loop. An observer (sitecustomize in the trainer processes, wrapping the
function without changing it) records every call with its thread; Orbax's managers used to call it
too, from their finalize threads with an older save's step, and a SIGTERM that came just after such
a call set a stop step both processes had passed: they trained to the end without saving it.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.trainer.procs import Job
from tests.trainer.test_local_tier import GCS_EVERY_10, _local_env

OBSERVER = """
import os, threading
from jax.experimental import multihost_utils

_reached = multihost_utils.reached_preemption_sync_point
_calls = open(os.environ["SYNC_CALLS_FILE"], "a", buffering=1)


def _observed(step_id):
    _calls.write(f"{threading.current_thread().name} {step_id}\\n")
    return _reached(step_id)


multihost_utils.reached_preemption_sync_point = _observed
"""
_STOPPED_AT = re.compile(r"SIGTERM: stopping at step (\d+) \(checkpoint of it: True\)")


@pytest.mark.timeout(300)
def test_a_sigterm_to_one_process_stops_both_at_one_saved_step(job: Job, tmp_path: Path) -> None:
    observer = tmp_path / "observer"
    observer.mkdir()
    (observer / "sitecustomize.py").write_text(OBSERVER)
    calls = [tmp_path / f"sync-calls-{i}" for i in range(2)]

    def process_env(index: int) -> dict[str, str]:
        # GCS every 10 steps and the local tier every 2: both managers finalize saves all the time.
        return _local_env(tmp_path / f"local{index}", every=2) | {
            "PYTHONPATH": str(observer),
            "SYNC_CALLS_FILE": str(calls[index]),
        }

    attempt = job.start(
        ["--steps", "100000", "--batch-size", "8", "--seq-len", "64"],
        env=GCS_EVERY_10,
        processes=2,
        slices=2,
        process_env=process_env,
    )
    attempt.wait_until(lambda: attempt.last_step() >= 40, quiet=240)
    attempt.procs[1].send_signal(signal.SIGTERM)
    assert attempt.wait(120) == [143, 143], attempt.output(1)[-3000:]

    stops = [_STOPPED_AT.findall(attempt.output(i)) for i in range(2)]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    stop = int(stops[0][0])
    assert stop in job.committed_steps() and job.progress()["state"] == "preempted"
    for path in calls:
        # From the training loop alone, once per step, in order, up to the step both stopped at.
        assert path.read_text().splitlines() == [f"MainThread {s}" for s in range(1, stop + 1)], path.name
