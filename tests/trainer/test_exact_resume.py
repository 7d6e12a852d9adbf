"""Exact resume: a 2-process jax.distributed run (gloo on CPU, the GCS emulator) interrupted at
several moments and restarted each time reaches step M with the same bits as an uninterrupted run.

Kill points, all on one job in sequence (each restart resumes from the latest committed step):
  1. SIGKILL at a random step, after the first checkpoints;
  2. SIGKILL while an async save is in flight (its step directory exists without commit_success.txt);
  3. SIGKILL at a random moment during start-up (restore / compile), before any step of the attempt;
  4. SIGTERM at a random step: the preemption path, which saves that step and exits 143.
"""

from __future__ import annotations

import random
import re
import signal
import time

import pytest
from tpujob_devcluster.fakegcs import FakeGcsServer

from tests.trainer.procs import Attempt, Job

pytestmark = pytest.mark.slow

M = 40
ARGS = ["--steps", str(M), "--batch-size", "8", "--seq-len", "32"]


def _resumed_from(attempt: Attempt) -> int | None:
    found = re.search(r"resume: restoring step (\d+) \(latest committed\)", attempt.output(0))
    return int(found.group(1)) if found else None


def _restart(job: Job) -> tuple[Attempt, int]:
    committed = job.committed_steps()
    # data axis across the 2 processes, fsdp over the 2 CPU devices of each
    attempt = job.start(ARGS, processes=2, slices=2)
    return attempt, committed[-1] if committed else 0


def _in_flight_save(job: Job, after: int) -> int | None:
    partial = [step for step, done in job.step_dirs().items() if not done and step > after]
    return partial[0] if partial else None


@pytest.mark.timeout(900)
def test_killed_and_restarted_run_is_bitwise_equal_to_uninterrupted(
    gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    rng = random.Random(20261130)
    reference = Job(gcs, trainer_env, tmp_path_factory.mktemp("reference"), f"ref-{rng.randrange(10**8)}")
    job = Job(gcs, trainer_env, tmp_path_factory.mktemp("interrupted"), f"int-{rng.randrange(10**8)}")
    try:
        # The uninterrupted run beside the interrupted one (its waits are stall detectors, not clocks).
        uninterrupted = reference.start(ARGS, processes=2, slices=2)
        kills: list[str] = []

        # 1. SIGKILL at a random step once something is committed.
        attempt, _ = _restart(job)
        target = rng.randint(8, 16)
        attempt.wait_until(lambda: attempt.last_step() >= target and bool(job.committed_steps()), quiet=240)
        attempt.signal(signal.SIGKILL)
        attempt.wait(30)
        kills.append(f"SIGKILL at step {attempt.last_step()}")

        # 2. SIGKILL while a save is in flight.
        attempt, expected = _restart(job)
        # Once this attempt has printed a step, Orbax has removed the previous attempt's partial
        # directories (it does so before its first save), so a partial directory now is a live save.
        attempt.wait_until(
            lambda: attempt.last_step() > expected and _in_flight_save(job, expected) is not None,
            quiet=240,
            poll=0.01,
        )
        attempt.signal(signal.SIGKILL)
        attempt.wait(30)
        partial = _in_flight_save(job, expected)
        assert partial is not None, "the kill was meant to land during a save"
        assert _resumed_from(attempt) == expected
        kills.append(f"SIGKILL during the save of step {partial} (resumed from {expected})")

        # 3. SIGKILL at a random moment of start-up.
        attempt, expected = _restart(job)
        delay = rng.uniform(0.5, 4.0)
        time.sleep(delay)
        attempt.signal(signal.SIGKILL)
        attempt.wait(30)
        kills.append(f"SIGKILL {delay:.1f}s after launch, at step {attempt.last_step()}")

        # 4. SIGTERM at a random step: saves exactly that step, exits 143 on both processes.
        attempt, expected = _restart(job)
        target = expected + rng.randint(3, 8)
        attempt.wait_until(lambda: attempt.last_step() >= target, quiet=240)
        attempt.signal(signal.SIGTERM)
        assert attempt.wait(90) == [143, 143], attempt.output(0)
        assert _resumed_from(attempt) == expected
        record = job.progress()
        assert record["state"] == "preempted" and record["step"] in job.committed_steps()
        kills.append(f"SIGTERM at step {record['step']} (resumed from {expected})")

        # Last attempt runs to the end.
        attempt, expected = _restart(job)
        assert attempt.wait(300) == [0, 0], attempt.output(0)
        assert _resumed_from(attempt) == expected == record["step"]
        assert job.progress()["attempt"] == 4

        print("kill points:", "; ".join(kills))
        assert uninterrupted.wait(300) == [0, 0], uninterrupted.output(0)
        assert job.digest(M) == reference.digest(M)
    finally:
        reference.kill_all()
        job.kill_all()
