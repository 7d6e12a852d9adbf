"""Your own loop, protected (issue 31): the Flax NNX example (examples/own-loop/train.py) on the
tpujob library, 2 jax.distributed processes on CPU against the GCS emulator, SIGKILLed at three random
steps and SIGTERMed once, restarted each time as the operator would (the same run directory,
TPUJOB_ATTEMPT one more), ends with parameters, optimizer state and each process's Grain iterator
position bitwise equal to an uninterrupted run's. Also: the library refuses bad input at start.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tpujob import data
from tpujob_devcluster.fakegcs import FakeGcsServer

from tests.trainer.procs import Attempt, Job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-loop" / "train.py"
COMMAND = (sys.executable, str(EXAMPLE))
M = 40  # steps; global batch 16 of 64 bytes: 640 windows of the standard library's sources
ARGS = ["--steps", str(M), "--batch-size", "16", "--seq-len", "64", "--log-every", "1"]
STALL_S = 240.0  # a wait that ends only when something is stuck, never a speed test


def _latest(job: Job) -> int:
    committed = job.committed_steps()
    return committed[-1] if committed else 0


def _interrupt(job: Job, rng: random.Random, sig: signal.Signals) -> tuple[Attempt, int, int]:
    """Start the next attempt, let it train a few random steps past what it restored and commit one
    of its own, then send `sig` to every process; returns (attempt, restorable step, signalled at)."""
    restorable = _latest(job)
    attempt = job.start(ARGS, processes=2, command=COMMAND)
    target = rng.randint(restorable + 3, restorable + 7)
    attempt.wait_until(lambda: attempt.last_step() >= target and _latest(job) > restorable, quiet=STALL_S)
    at = attempt.last_step()
    attempt.signal(sig)
    return attempt, restorable, at


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_example_killed_three_times_and_stopped_once_ends_bitwise_equal_to_an_uninterrupted_run(
    gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    rng = random.Random(20261206)
    reference = Job(gcs, trainer_env, tmp_path_factory.mktemp("ref"), f"own-ref-{rng.randrange(10**8)}")
    job = Job(gcs, trainer_env, tmp_path_factory.mktemp("int"), f"own-int-{rng.randrange(10**8)}")
    try:
        assert reference.start(ARGS, processes=2, command=COMMAND).wait(STALL_S) == [0, 0]
        history: list[str] = []
        for _ in range(3):
            attempt, restorable, at = _interrupt(job, rng, signal.SIGKILL)
            assert attempt.wait(30) == [-signal.SIGKILL] * 2
            if restorable:
                assert f"resume: restoring step {restorable} (latest committed)" in attempt.output(0)
            history.append(f"SIGKILL at step {at} (restored {restorable})")

        attempt, restorable, at = _interrupt(job, rng, signal.SIGTERM)
        assert attempt.wait(STALL_S) == [143, 143], attempt.output(0)[-3000:]
        stopped = job.progress()
        assert stopped["state"] == "preempted" and stopped["restored_step"] == restorable
        assert stopped["step"] in job.committed_steps(), "the SIGTERM step is saved and committed"
        history.append(f"SIGTERM at step {at}, stopped and saved at {stopped['step']}")

        final = job.start(ARGS, processes=2, command=COMMAND)
        assert final.wait(STALL_S) == [0, 0], final.output(0)[-3000:]
        assert f"resume: restoring step {stopped['step']} (latest committed)" in final.output(0)
        done = job.progress()
        assert (done["state"], done["step"], done["attempt"], done["last_committed_step"]) == ("succeeded", M, 4, M)

        tmp = tmp_path_factory.mktemp("digest")
        expected, got = reference.digest(M, tmp / "ref.npz"), job.digest(M, tmp / "int.npz")
        assert any("opt_state" in leaf for leaf in got) and "['data']" in got and "['step']" in got
        assert got == expected, f"not bitwise equal after {history}"
        rows = np.load(tmp / "int.npz")["['data']"]
        # Each process's Grain iterator, positioned after its M local batches.
        assert [data.decode(row) for row in rows] == [{"next_index": M}] * 2
    finally:
        reference.kill_all()
        job.kill_all()


def _bad_input(job: Job, program: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", program], env=job.env(**env), capture_output=True, text=True, timeout=STALL_S
    )


BAD_LEAF = """
import numpy as np, tpujob
run = tpujob.start(steps=3)
run.restore({"params": {"w": np.zeros(3, np.float32), "act": print}})
"""

BAD_ITERATOR = """
import numpy as np, tpujob
run = tpujob.start(steps=3)
run.restore({"w": np.zeros(3, np.float32)}, iter(range(10)))
"""

OTHER_MODEL = """
import numpy as np, tpujob
run = tpujob.start(steps=1)
state = run.restore({"w": np.zeros(%d, np.float32)})
run.step_done(1, state)
run.finish(state)
"""


def test_bad_input_is_refused_at_start_with_its_path_and_another_model_is_exit_4(job: Job) -> None:
    leaf = _bad_input(job, BAD_LEAF)
    assert leaf.returncode == 2 and "state leaf ['params']['act'] is a builtin_function_or_method" in leaf.stderr
    iterator = _bad_input(job, BAD_ITERATOR)
    assert iterator.returncode == 2 and "data iterator (range_iterator) has no get_state()" in iterator.stderr
    assert job.committed_steps() == []

    assert _bad_input(job, OTHER_MODEL % 3).returncode == 0
    assert job.committed_steps() == [1]
    other = _bad_input(job, OTHER_MODEL % 5)
    assert other.returncode == 4, other.stderr[-3000:]
    assert "(5,)" in other.stderr and "(3,)" in other.stderr, other.stderr[-3000:]
    assert job.committed_steps() == [1], "nothing committed is touched"
    assert job.progress()["state"] == "incompatible"


def test_data_iterator_states_round_trip_as_json_or_bytes_and_too_large_is_refused() -> None:
    for state in ({"next_index": 7}, b"\x00grain\xff", [1, "two"], None):
        row = np.zeros(data.CAPACITY, np.uint8)
        raw = data.encode(state)
        row[: len(raw)] = np.frombuffer(raw, np.uint8)
        assert data.decode(row) == state
    with pytest.raises(ValueError, match="more than"):
        data.encode("x" * data.CAPACITY)


def test_an_elastic_attempt_on_half_the_slices_accumulates_two_microbatches(job: Job) -> None:
    program = "import tpujob; print('microbatches', tpujob.start(steps=1).microbatches)"
    full = _bad_input(job, program)
    half = _bad_input(job, program, TPUJOB_NUM_SLICES="1", TPUJOB_FULL_SLICES="2")
    assert "microbatches 1" in full.stdout and "microbatches 2" in half.stdout, half.stderr[-2000:]
