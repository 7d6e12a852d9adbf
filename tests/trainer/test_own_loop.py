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
from tpujob import StepBatches, data
from tpujob_contract import Env
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
        # The data position: M global batches read, one state for every process.
        assert data.decode(np.load(tmp / "int.npz")["['data']"]) == {"step": M}
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


# The elastic run's final state against the uninterrupted one's, leaf by leaf: |diff| at most SCALE_TOL x
# the leaf's largest |value|. Not bitwise: a shrunk step sums two microbatch gradients where the full-size
# step takes one mean over the global batch, so float32 rounding differs (tests/trainer/test_elastic.py
# measures the built-in trainer; this example's figure is printed). A wrong batch, data order, or a lost
# or repeated step moves weights by about the learning rate, 1e-3 of their scale and more.
SCALE_TOL = 1e-5
EVERY_5 = {Env.CHECKPOINT_POLICY: "interval", Env.CHECKPOINT_INTERVAL_STEPS: "5"}


def _stop(job: Job, attempt: Attempt, after: int) -> int:
    """SIGTERM once the attempt is past `after`; it saves the step it stops at: returns that step."""
    attempt.wait_until(lambda: attempt.last_step() > after, quiet=STALL_S)
    attempt.signal(signal.SIGTERM)
    assert set(attempt.wait(STALL_S)) == {143}, attempt.output(0)[-3000:]
    record = job.progress()
    assert record["state"] == "preempted" and record["step"] in job.committed_steps(), record
    return int(record["step"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_example_shrunk_to_one_slice_and_grown_back_ends_where_the_uninterrupted_run_does(
    gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """2 slices -> 1 (one process, TPUJOB_NUM_SLICES=1 of TPUJOB_FULL_SLICES=2: two microbatches per
    step) -> 2, stopped by SIGTERM at each resize as the operator does: the data position carries
    across process counts, and the state ends within the elastic tolerance of an uninterrupted run's."""
    reference = Job(gcs, trainer_env, tmp_path_factory.mktemp("ref"), "own-elastic-ref")
    job = Job(gcs, trainer_env, tmp_path_factory.mktemp("ela"), "own-elastic")
    try:
        uninterrupted = reference.start(ARGS, env=EVERY_5, processes=2, slices=2, command=COMMAND)
        assert uninterrupted.wait(STALL_S) == [0, 0], uninterrupted.output(0)[-3000:]
        n = _stop(job, job.start(ARGS, env=EVERY_5, processes=2, slices=2, command=COMMAND), after=6)
        shrunk = job.start(ARGS, env={**EVERY_5, Env.NUM_SLICES: "1", Env.FULL_SLICES: "2"}, command=COMMAND)
        m = _stop(job, shrunk, after=n + 6)
        assert job.progress()["restored_step"] == n
        grown = job.start(ARGS, env=EVERY_5, processes=2, slices=2, command=COMMAND)
        assert grown.wait(STALL_S) == [0, 0], grown.output(0)[-3000:]
        assert job.progress()["restored_step"] == m and 0 < n < m < M

        tmp = tmp_path_factory.mktemp("digest")
        reference.digest(M, tmp / "ref.npz")
        job.digest(M, tmp / "ela.npz")
        ref, ela = np.load(tmp / "ref.npz"), np.load(tmp / "ela.npz")
        assert sorted(ref.files) == sorted(ela.files)
        assert data.decode(ela["['data']"]) == data.decode(ref["['data']"]) == {"step": M}
        worst = {
            k: float(np.max(np.abs(ref[k] - ela[k])) / max(float(np.max(np.abs(ref[k]))), 1e-30))
            for k in ref.files
            if k != "['data']"
        }
        print(f"own-loop elastic N={n} M={m}: worst |diff| / scale {max(worst.values()):.2g}")
        assert max(worst.values()) <= SCALE_TOL, worst
    finally:
        reference.kill_all()
        job.kill_all()


def test_step_batches_read_each_global_batch_in_order_and_resume_from_the_step_alone() -> None:
    dataset = [np.full(3, i) for i in range(100)]
    batches = StepBatches(dataset, 4)  # one process here: it reads whole global batches
    assert [int(row[0]) for row in next(batches)] == [0, 1, 2, 3]
    assert [int(row[0]) for row in next(batches)] == [4, 5, 6, 7]
    assert batches.get_state() == {"step": 2} and data.position_is_global(batches)
    resumed = StepBatches(dataset, 4)
    resumed.set_state({"step": 5})
    assert [int(row[0]) for row in next(resumed)] == [20, 21, 22, 23]
    with pytest.raises(ValueError, match="not a positive multiple"):
        StepBatches(dataset, 0)


def test_an_elastic_attempt_on_half_the_slices_accumulates_two_microbatches(job: Job) -> None:
    program = "import tpujob; print('microbatches', tpujob.start(steps=1).microbatches)"
    full = _bad_input(job, program)
    half = _bad_input(job, program, TPUJOB_NUM_SLICES="1", TPUJOB_FULL_SLICES="2")
    assert "microbatches 1" in full.stdout and "microbatches 2" in half.stdout, half.stderr[-2000:]
