"""Checkpoint policies from the contract, exercised on Orbax's real CheckpointManager (local disk).

What is asserted comes from the bytes Orbax wrote: the step directories, and the init/commit
timestamps it records in each step's _CHECKPOINT_METADATA.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tpujob_contract as contract
from orbax.checkpoint import checkpoint_managers as cm
from tpujob.attempt import StepHook
from tpujob.checkpointing import (
    HOLD_SECONDS,
    AdaptivePolicy,
    CheckpointManager,
    PreemptionNotice,
    adaptive_policy,
    choose_restore_step,
    is_committed,
    manager_options,
    preservation_policy,
    save_policy,
)
from tpujob.config import CheckpointConfig, ConfigError, run_config
from tpujob.progress import AttemptProgress, ProgressWriter
from tpujob_contract import FRESH, LATEST, Env, Resume

BASE = CheckpointConfig(
    policy="continuous", min_interval_seconds=0.0, interval_steps=5, async_save=True,
    keep_latest=1000, keep_every_steps=0, save_on_preemption=True, resume=LATEST,
)  # fmt: skip


def _cfg(**changes: object) -> CheckpointConfig:
    return dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]


def _train(directory: Path, cfg: CheckpointConfig, steps: int, step_seconds: float, mb: int = 1) -> list[int]:
    """A stand-in training loop: `steps` steps of `step_seconds`, offering a save after each."""
    state = {"w": jnp.ones((mb * 256 * 1024,), jnp.float32), "step": jnp.zeros((), jnp.int32)}
    with CheckpointManager(str(directory), manager_options(cfg), PreemptionNotice(distributed=False)) as mngr:
        for step in range(1, steps + 1):
            time.sleep(step_seconds)
            state = {"w": state["w"] + 1, "step": jnp.asarray(step, jnp.int32)}
            mngr.save(step, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        steps_kept: list[int] = list(mngr.all_steps())
    return steps_kept


def _timestamps(directory: Path, step: int) -> tuple[float, float]:
    meta = json.loads((directory / str(step) / "_CHECKPOINT_METADATA").read_text())
    return meta["init_timestamp_nsecs"] / 1e9, meta["commit_timestamp_nsecs"] / 1e9


@pytest.fixture(autouse=True)
def _restore_sigterm_handler() -> Iterator[None]:
    # PreemptionNotice(distributed=False) installs a SIGTERM handler in this (pytest) process.
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_policy_construction_follows_the_contract() -> None:
    continuous = save_policy(_cfg(min_interval_seconds=2.5))
    assert isinstance(continuous, cm.AnySavePolicy)
    first, second = continuous.policies
    assert isinstance(first, cm.ContinuousCheckpointingPolicy) and first.minimum_interval_secs == 2.5
    assert isinstance(second, cm.PreemptionCheckpointingPolicy)
    assert save_policy(_cfg()).policies[0].minimum_interval_secs is None
    interval = save_policy(_cfg(policy="interval", interval_steps=7, save_on_preemption=False))
    assert [type(p) for p in interval.policies] == [cm.FixedIntervalPolicy]
    assert interval.policies[0].interval == 7
    keep = preservation_policy(_cfg(keep_latest=2, keep_every_steps=10))
    assert [type(p) for p in keep.policies] == [cm.LatestN, cm.EveryNSteps]
    assert [type(p) for p in preservation_policy(_cfg()).policies] == [cm.LatestN]


def test_adaptive_policy_is_a_held_continuous_policy_the_trainer_can_move() -> None:
    options = manager_options(_cfg(policy="adaptive"))
    policy = adaptive_policy(options)
    assert isinstance(policy, AdaptivePolicy) and isinstance(policy, cm.ContinuousCheckpointingPolicy)
    assert policy.minimum_interval_secs == HOLD_SECONDS
    decision = options.save_decision_policy
    assert [type(p) for p in decision.policies] == [AdaptivePolicy, cm.PreemptionCheckpointingPolicy]
    assert adaptive_policy(manager_options(_cfg())) is None


def test_adaptive_policy_saves_when_the_trainer_says_and_not_before(tmp_path: Path) -> None:
    options = manager_options(_cfg(policy="adaptive"))
    policy = adaptive_policy(options)
    assert policy is not None
    state = {"w": jnp.ones((1024,), jnp.float32)}
    with CheckpointManager(str(tmp_path), options, PreemptionNotice(distributed=False)) as mngr:
        # Held: nothing is saved, although nothing is committed (Orbax's own policy would save at once).
        assert not any(mngr.save(step, args=ocp.args.StandardSave(state)) for step in (1, 2, 3))
        policy.minimum_interval_secs = 3600.0
        assert not mngr.save(4, args=ocp.args.StandardSave(state))  # counted from the attempt's start
        policy.minimum_interval_secs = 0.0
        assert mngr.save(5, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        policy.minimum_interval_secs = 3600.0
        assert not mngr.save(6, args=ocp.args.StandardSave(state))  # an hour after step 5 at the earliest
        assert mngr.all_steps() == [5]


def test_interval_saves_exactly_on_multiples(tmp_path: Path) -> None:
    assert _train(tmp_path, _cfg(policy="interval", interval_steps=5), steps=23, step_seconds=0.0) == [5, 10, 15, 20]


def test_latest_n_keeps_n_plus_every_n_steps(tmp_path: Path) -> None:
    kept = _train(tmp_path, _cfg(policy="interval", interval_steps=5, keep_latest=2, keep_every_steps=10), 40, 0.0)
    assert kept == [10, 20, 30, 35, 40]
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == kept
    assert _train(tmp_path / "n3", _cfg(policy="interval", interval_steps=1, keep_latest=3), 9, 0.0) == [7, 8, 9]


def test_continuous_never_overlaps_saves_and_saves_back_to_back(tmp_path: Path) -> None:
    saved = _train(tmp_path, _cfg(), steps=60, step_seconds=0.01, mb=8)
    assert len(saved) >= 3 and saved[0] == 1
    stamps = [_timestamps(tmp_path, s) for s in saved]
    for (_, previous_commit), (init, _) in itertools.pairwise(stamps):
        assert init >= previous_commit  # a save starts only after the previous one committed
    steps_between = np.diff(saved)
    # Each save spans several steps (a save that happens to finish within one step may be followed
    # by the next one step later: the median, not the minimum, tells the policy's cadence).
    assert steps_between.max() < 60 and np.median(steps_between) > 1


def test_continuous_honours_the_minimum_interval(tmp_path: Path) -> None:
    saved = _train(tmp_path, _cfg(min_interval_seconds=0.4), steps=60, step_seconds=0.02)
    inits = [_timestamps(tmp_path, s)[0] for s in saved]
    assert len(saved) >= 2
    assert min(np.diff(inits)) >= 0.4 - 0.05


def test_sigterm_sets_the_single_process_preemption_flag() -> None:
    notice = PreemptionNotice(distributed=False)
    assert not notice.reached(3)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert not notice.stops_at(4)  # only the training loop's question decides the step
    assert notice.reached(4)
    # What Orbax's manager is told (CheckpointManager.reached_preemption), from any thread: that step alone.
    assert notice.stops_at(4) and not notice.stops_at(3) and not notice.stops_at(5)


@pytest.mark.parametrize(
    ("committed", "resume", "expected"),
    [
        ([], LATEST, None),
        ([3, 9, 6], LATEST, 9),
        ([3, 9], Resume.at(3), 9),  # a pin means "this step or a newer one": never throw newer work away
        ([3, 9], Resume.at(5), 9),
        ([3, 9], Resume.at(9), 9),
        ([3, 9], FRESH, None),
    ],
)
def test_choose_restore_step(committed: list[int], resume: Resume, expected: int | None) -> None:
    assert choose_restore_step(committed, resume) == expected


def test_choose_restore_step_refuses_a_pin_with_nothing_committed_at_or_after_it() -> None:
    with pytest.raises(ConfigError, match="TPUJOB_RESUME_STEP=10: no committed checkpoint at or after it"):
        choose_restore_step([3, 9], Resume.at(10))


def test_a_save_orbax_starts_after_waiting_for_the_one_in_flight_reports_that_one_committed(tmp_path: Path) -> None:
    """Interval saves longer than the interval: each save() first waits for the one in flight. The
    step hook reported a finished save only when none was in flight at the next step, so the record's
    last_committed_step stayed behind for the whole run (CI: 2701 at step 3500)."""
    env = {
        Env.RUN_DIR: str(tmp_path), Env.CHECKPOINT_POLICY: "interval", Env.CHECKPOINT_INTERVAL_STEPS: "1",
        Env.CHECKPOINT_SAVE_ON_PREEMPTION: "false",
    }  # fmt: skip
    cfg = run_config(env)
    assert cfg.checkpoint is not None and cfg.checkpoint.policy == "interval"
    directory = tmp_path / "checkpoints"
    status = AttemptProgress(attempt=0, uid="", process_started_at=contract.now_rfc3339())
    writer = ProgressWriter(str(tmp_path), lambda step: is_committed(str(directory), step))
    state = {"w": jnp.ones((8 * 256 * 1024,), jnp.float32), "step": jnp.zeros((), jnp.int32)}
    steps = 12
    notice = PreemptionNotice(distributed=False)
    with CheckpointManager(str(directory), manager_options(cfg.checkpoint), notice) as mngr:
        hook = StepHook(cfg, notice, status, mngr, None, writer)
        for step in range(1, steps + 1):
            state = {"w": state["w"] + 1, "step": jnp.asarray(step, jnp.int32)}
            assert not hook.after_step(step, state, state)
            hook.next_step_begins()
        # Step 12's save started once step 11's had ended, so 11 is committed and was reported.
        deadline = time.monotonic() + 30
        while writer.last_committed_step != steps - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer.last_committed_step == steps - 1, writer.last_committed_step
        mngr.wait_until_finished()
    writer.close(status.record("succeeded"))
