"""Elastic slice count: a 2-slice run that shrinks to 1 slice at a committed step N and grows back
at a committed step M ends with the parameters of an uninterrupted 2-slice run.

Real processes (one per slice, 2 CPU devices each, gloo collectives, the GCS emulator): the shrunk
attempt is one process with TPUJOB_NUM_SLICES=1, TPUJOB_FULL_SLICES=2, as the operator starts it,
and restores a checkpoint written on the 2-slice mesh; the last attempt restores its 1-slice one.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from tpujob import local_tier
from tpujob.config import ConfigError, topology_from_env
from tpujob_contract import Env
from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_trainer.config import parse_config
from tpujob_trainer.data import batch_for_step
from tpujob_trainer.train import Trainer, make_mesh

from tests.trainer.procs import Attempt, Job

STEPS = 30
ARGS = ["--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32"]
# Saves every 10 steps (not every step: the test's time) and the step each SIGTERM stops at.
# Each process (slice) keeps 2 devices: the shrunk run is one slice of the same shape.
EVERY_10 = {
    Env.CHECKPOINT_POLICY: "interval",
    Env.CHECKPOINT_INTERVAL_STEPS: "10",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
}
SHRUNK = {**EVERY_10, Env.NUM_SLICES: "1", Env.FULL_SLICES: "2"}
_LOSS = re.compile(r"^step (\d+)/\d+ loss ([\d.]+) ", re.MULTILINE)

# The elastic run's final state against the uninterrupted one's, leaf by leaf: |diff| at most
# SCALE_TOL x the leaf's largest |value|. Not bitwise: a shrunk step sums two microbatch gradients
# (each a mean over 4 rows, reduced over 2 devices) where the full-size step reduces one mean over
# 8 rows across 4 devices, so float32 rounding differs; Adam's moments and the parameters carry
# that to the end. Measured (N=11, M=22 of 30): at most 3e-7 of the leaf's scale (params 1.5e-8
# on weights of ~0.1, one ulp on the norm scales; moments alike); step, data position, optimizer
# counts and some leaves bitwise equal. 1e-5 leaves 30x headroom and is still ~1000x below what
# a wrong schedule, batch, data order or a lost or repeated step does (one step moves weights by
# ~lr = 3e-3, i.e. ~3e-2 of their scale).
SCALE_TOL = 1e-5


def _stop_at_committed_step(job: Job, attempt: Attempt, after: int) -> int:
    """SIGTERM once the attempt is past `after`: it saves the step it stops at; returns that step."""
    attempt.wait_until(lambda: attempt.last_step() > after, quiet=120)
    attempt.signal(signal.SIGTERM)
    codes = attempt.wait(90)
    assert set(codes) == {143}, attempt.output(0)
    record = job.progress()
    assert record["state"] == "preempted" and record["step"] in job.committed_steps(), record
    step: int = record["step"]
    return step


def _losses(attempt: Attempt) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in _LOSS.findall(attempt.output(0))}


def _restored(job: Job) -> int | None:
    """The restored step in the attempt's own progress record."""
    step: int | None = job.progress().get("restored_step")
    return step


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shrink_to_one_slice_and_grow_back_ends_where_the_uninterrupted_run_does(
    gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path, run_name: str
) -> None:
    reference = Job(gcs, trainer_env, tmp_path / "reference", f"{run_name}-reference")
    job = Job(gcs, trainer_env, tmp_path / "elastic", f"{run_name}-elastic")
    for j in (reference, job):
        j.log_dir.mkdir()
    try:
        uninterrupted = reference.start(ARGS, env=EVERY_10, processes=2, slices=2)
        assert uninterrupted.wait(180) == [0, 0]

        full = job.start(ARGS, env=EVERY_10, processes=2, slices=2)
        n = _stop_at_committed_step(job, full, after=6)
        assert "elastic:" not in full.output(0)

        shrunk = job.start(ARGS, env=SHRUNK, processes=1)
        m = _stop_at_committed_step(job, shrunk, after=n + 8)
        out = shrunk.output(0)
        assert re.search(r"process 0/1, 2 devices", out), out[-3000:]
        assert "elastic: 1 of 2 slices, 2 microbatches per step" in out, out[-3000:]
        assert f"resume: restoring step {n} (latest committed)" in out, out[-3000:]
        assert _restored(job) == n
        # The loss it reports is the full-size step's (the mean of its microbatches' losses).
        shrunk_losses, reference_losses = _losses(shrunk), _losses(uninterrupted)
        assert set(range(n + 1, m)) <= set(shrunk_losses) <= set(range(n + 1, m + 1))  # m: stopped before its line
        for step, loss in shrunk_losses.items():
            assert loss == pytest.approx(reference_losses[step], abs=2e-4), step  # printed to 4 decimals

        grown = job.start(ARGS, env=EVERY_10, processes=2, slices=2)
        assert grown.wait(180) == [0, 0], grown.output(0)
        assert "elastic:" not in grown.output(0)
        assert f"resume: restoring step {m} (latest committed)" in grown.output(0)
        assert _restored(job) == m
        assert 0 < n < m < STEPS

        want, got = tmp_path / "reference.npz", tmp_path / "elastic.npz"
        ours, theirs = job.digest(STEPS, got), reference.digest(STEPS, want)
        same = sorted(k for k, v in ours.items() if theirs[k] == v)
        ref, ela = np.load(want), np.load(got)
        assert sorted(ref.files) == sorted(ela.files)
        for key in ("['step']", "['data_position']"):
            assert ref[key] == ela[key] == STEPS
        worst = {
            k: float(np.max(np.abs(ref[k] - ela[k])) / max(float(np.max(np.abs(ref[k]))), 1e-30)) for k in ref.files
        }
        print(f"elastic N={n} M={m}: worst |diff| / scale {max(worst.values()):.2g}; bitwise equal: {same}")
        assert max(worst.values()) <= SCALE_TOL, worst
    finally:
        reference.kill_all()
        job.kill_all()


def _topology(**env: str) -> dict[str, str]:
    return {Env.COORDINATOR_ADDRESS: "127.0.0.1:1234", **env}


@pytest.mark.parametrize(
    ("num", "full", "microbatches"), [("2", None, 1), ("2", "2", 1), ("1", "2", 2), ("2", "4", 2), ("1", "3", 3)]
)
def test_microbatches_are_full_over_num_slices(num: str, full: str | None, microbatches: int) -> None:
    env = _topology(**{Env.NUM_SLICES: num}, **({Env.FULL_SLICES: full} if full else {}))
    topo = topology_from_env(env)
    assert topo.microbatches == microbatches
    assert topo.full_slices == int(full or num)


@pytest.mark.parametrize(("num", "full"), [("2", "3"), ("4", "2"), ("3", "4")])
def test_a_slice_count_that_does_not_divide_the_full_one_is_refused(num: str, full: str) -> None:
    with pytest.raises(ConfigError, match=rf"{Env.FULL_SLICES}={full} is not a multiple of {Env.NUM_SLICES}={num}"):
        topology_from_env(_topology(**{Env.NUM_SLICES: num, Env.FULL_SLICES: full}))


def test_an_accumulated_step_is_the_full_batch_step_in_half_the_activation_memory() -> None:
    """In this process (one CPU device): two steps with 2 microbatches against two plain steps of
    the same global batches; and what XLA itself says each step needs in temporary memory."""
    cfg = parse_config(["--steps", "30", "--batch-size", "16", "--seq-len", "32"], {}).train
    plain, accumulated = Trainer(cfg, make_mesh(1)), Trainer(cfg, make_mesh(1), microbatches=2)
    a, b = plain.init(), accumulated.init()
    batches = [batch_for_step(cfg.seed, s, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size) for s in range(2)]
    micro = accumulated.device_batch(batches[0])
    assert micro.shape == (2, 8, 32) and np.array_equal(np.asarray(micro).reshape(16, 32), batches[0])  # rows in order
    # Compiled once each (the same executables Trainer.step runs), for the steps and the memory figure.
    step_a = plain._step.lower(a, plain.device_batch(batches[0])).compile()
    step_b = accumulated._step.lower(b, micro).compile()
    analyses = [step.memory_analysis() for step in (step_a, step_b)]
    temp_a, temp_b = (m.temp_size_in_bytes for m in analyses if m is not None)
    for tokens in batches:
        (a, loss_a), (b, loss_b) = step_a(a, plain.device_batch(tokens)), step_b(b, accumulated.device_batch(tokens))
        assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-6)
    assert int(b["step"]) == int(b["data_position"]) == 2
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-7)
    assert temp_b < 0.6 * temp_a, (temp_a, temp_b)


def test_a_batch_that_does_not_split_into_microbatches_is_refused() -> None:
    cfg = parse_config(["--batch-size", "6"], {}).train
    with pytest.raises(ConfigError, match="batch size 6 is not divisible into 4 microbatches"):
        Trainer(cfg, make_mesh(1), 4)


def test_local_steps_written_at_another_slice_count_are_removed_not_restored(tmp_path: Path) -> None:
    """Each process's local tier holds only its own shards of its mesh: a step written on another
    slice count (same processes and devices, another mesh) must never be read back here."""
    run_dir, uid = "gs://bucket/ns/job", "uid-1"
    written = local_tier.prepare(str(tmp_path), local_tier.identity(run_dir, uid, num_slices=2))
    (written / "20").mkdir()
    assert local_tier.prepare(str(tmp_path), local_tier.identity(run_dir, uid, num_slices=2)) == written
    assert (written / "20").is_dir()  # same layout: kept
    local_tier.prepare(str(tmp_path), local_tier.identity(run_dir, uid, num_slices=1))
    assert not (written / "20").exists()
