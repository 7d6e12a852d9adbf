"""The local checkpoint tier (issue 19 item 3): real trainer processes (CPU JAX, gloo), the real GCS
emulator, and a local directory per process standing in for the pod's memory-backed emptyDir.

A restart with the same local directory restores from it when every process holds the same
committed step at or after GCS's latest, and trains on to the same bits as an uninterrupted run; a
local directory that is missing, half-written, damaged or another job's restores from GCS instead.
The truth: the progress record in the bucket, the processes' logs, the bytes of the final step.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tpujob_contract as contract
from tpujob import local_tier
from tpujob.config import ConfigError, LocalTierConfig
from tpujob.peer import LocalPlan, carried, first_sources, local_plans, slice_of_process
from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_trainer.config import parse_config

from tests.trainer.procs import Attempt, Job

M = 30
# Steps of a few tens of milliseconds: the local tier gets ahead of GCS for several steps at a time.
ARGS = ["--steps", str(M), "--batch-size", "16", "--seq-len", "64"]
GCS_EVERY_10 = {"TPUJOB_CHECKPOINT_POLICY": "interval", "TPUJOB_CHECKPOINT_INTERVAL_STEPS": "10"}


def _local_env(directory: Path, every: int = 2, budget: str = "0", buddies: bool = True) -> dict[str, str]:
    """The local tier every `every` steps; no overhead budget unless given (these steps are so short
    that a budget would stretch the interval, and these tests need the local tier ahead of GCS)."""
    return {
        contract.Env.LOCAL_CHECKPOINT_DIR: str(directory),
        contract.Env.LOCAL_CHECKPOINT_INTERVAL_STEPS: str(every),
        contract.Env.LOCAL_CHECKPOINT_OVERHEAD_BUDGET_PERCENT: budget,
        contract.Env.LOCAL_CHECKPOINT_BUDDY_COPIES: str(buddies).lower(),
    }


def local_steps(directory: Path) -> list[int]:
    """The committed steps of one process's local directory: Orbax's finalized (renamed) step dirs."""
    steps = directory / "checkpoints"
    return sorted(int(p.name) for p in steps.iterdir() if p.name.isdigit()) if steps.is_dir() else []


def _kill_ahead_of_gcs(job: Job, attempt: Attempt, dirs: list[Path]) -> tuple[int, list[list[int]]]:
    """SIGKILL the attempt once the local directories of all its processes hold two committed steps in
    common past GCS's latest; checked again with every process frozen (SIGSTOP), so that no save
    finalizes or is deleted between the check and the kill. Returns GCS's latest and each one's steps."""

    def ahead() -> list[int]:
        committed = job.committed_steps()
        common = set.intersection(*(set(local_steps(d)) for d in dirs))
        return sorted(s for s in common if committed and s > committed[-1])

    while True:
        attempt.wait_until(lambda: len(ahead()) >= 2, quiet=120, poll=0.02)
        attempt.signal(signal.SIGSTOP)
        if len(ahead()) >= 2:
            break
        attempt.signal(signal.SIGCONT)
    attempt.signal(signal.SIGKILL)
    attempt.wait(30)
    return job.committed_steps()[-1], [local_steps(d) for d in dirs]


def _reference_and_interrupted(
    gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path, run_name: str
) -> tuple[Job, Job]:
    """An uninterrupted run (the truth) and the run the test interrupts, each with its own logs."""
    reference = Job(gcs, trainer_env, tmp_path / "reference", f"{run_name}-ref")
    job = Job(gcs, trainer_env, tmp_path / "interrupted", run_name)
    reference.log_dir.mkdir()
    job.log_dir.mkdir()
    return reference, job


def _restored(job: Job) -> tuple[str | None, int | None]:
    record = job.progress()
    return record.get("restored_from"), record.get("restored_step")


@pytest.mark.timeout(240)
def test_a_killed_run_restores_from_the_local_tier_ahead_of_gcs_and_ends_bitwise_equal(
    gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path, run_name: str
) -> None:
    reference, job = _reference_and_interrupted(gcs, trainer_env, tmp_path, run_name)
    local = tmp_path / "local"
    try:
        assert reference.start(ARGS, GCS_EVERY_10).wait(120) == [0]
        env = GCS_EVERY_10 | _local_env(local)
        gcs_step, [held] = _kill_ahead_of_gcs(job, job.start(ARGS, env), [local])
        resumed = job.start(ARGS, env)
        assert resumed.wait(120) == [0], resumed.output()
        # The newest local step, past GCS's latest: the steps between are not trained again.
        assert _restored(job) == ("local", held[-1]) and held[-1] > gcs_step
        assert f"resume: restoring step {held[-1]} from the local tier" in resumed.output()
        assert job.digest(M) == reference.digest(M)
    finally:
        reference.kill_all()
        job.kill_all()


def _half_written(directory: Path, newest: int) -> None:
    """Only the newest step, and that one as Orbax leaves a save cut short: not finalized."""
    for step in local_steps(directory):
        if step != newest:
            shutil.rmtree(directory / "checkpoints" / str(step))
    (directory / "checkpoints" / str(newest)).rename(directory / "checkpoints" / f"{newest}.orbax-checkpoint-tmp-1")


def _damaged(directory: Path, newest: int) -> None:
    """Only the newest step, committed, with its array data gone (what a torn copy would leave)."""
    for step in local_steps(directory):
        if step != newest:
            shutil.rmtree(directory / "checkpoints" / str(step))
    data = [p for p in (directory / "checkpoints" / str(newest)).rglob("*") if p.is_file() and "ocdbt" in str(p)]
    assert data, sorted((directory / "checkpoints" / str(newest)).rglob("*"))
    for p in data:
        p.unlink()


def _foreign(directory: Path, newest: int) -> None:
    """Intact, but written by another incarnation of the job (another uid)."""
    marker = directory / "tpujob-local-identity.json"
    identity = json.loads(marker.read_text())
    marker.write_text(json.dumps({**identity, "uid": "another-incarnation"}))


@pytest.mark.timeout(240)
def test_a_missing_half_written_damaged_foreign_or_unusable_local_directory_restores_from_gcs(
    job: Job, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    _, [held] = _kill_ahead_of_gcs(job, job.start(ARGS, GCS_EVERY_10 | _local_env(local)), [local])
    newest = held[-1]
    # The spoiled copies first, while the local step they hold is still ahead of GCS's latest.
    for case, spoil in (("half-written", _half_written), ("damaged", _damaged), ("foreign", _foreign),
                        ("missing", None), ("unusable", None)):  # fmt: skip
        directory = tmp_path / f"local-{case}"
        if case == "unusable":
            directory.write_text("a file where the directory should be")
        elif spoil is not None:
            shutil.copytree(local, directory)
            spoil(directory, newest)
        latest = job.committed_steps()[-1]
        # Each restart trains one step past GCS's latest and saves it there: the local step stays ahead.
        short = ["--steps", str(latest + 1), *ARGS[2:]]
        resumed = job.start(short, GCS_EVERY_10 | _local_env(directory))
        assert resumed.wait(120) == [0], f"{case}:\n{resumed.output()}"
        assert _restored(job) == ("gcs", latest), f"{case}:\n{resumed.output()}"
        assert spoil is None or latest < newest
        nothing = "no slice's local tiers hold a step"
        why = {"missing": nothing, "half-written": nothing,
               "damaged": f"local step {newest} could not be restored here", "foreign": "not this run",
               "unusable": "local tier: off for this attempt"}  # fmt: skip
        assert why[case] in resumed.output(), f"{case}:\n{resumed.output()}"


@pytest.mark.timeout(300)
def test_two_processes_restore_the_newest_local_step_both_hold_never_a_mix(
    gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path, run_name: str
) -> None:
    reference, job = _reference_and_interrupted(gcs, trainer_env, tmp_path, run_name)
    dirs = [tmp_path / "local-0", tmp_path / "local-1"]
    try:
        # One slice over both processes: each process's local directory holds only its own shards (no
        # buddy copies here: test_buddy.py has them). The uninterrupted run beside the first attempt: its
        # start-up overlaps (the test's time).
        uninterrupted = reference.start(ARGS, GCS_EVERY_10, processes=2, slices=1)
        gcs_step, held = _kill_ahead_of_gcs(job, _start_two(job, dirs, buddies=False), dirs)
        assert uninterrupted.wait(180) == [0, 0]
        # Process 1 lost the newest step both held (the node was replaced between two saves, say).
        older, newest = sorted(set(held[0]) & set(held[1]))[-2:]
        shutil.rmtree(dirs[1] / "checkpoints" / str(newest))
        assert older > gcs_step
        resumed = _start_two(job, dirs, buddies=False)
        assert resumed.wait(180) == [0, 0], resumed.output(0) + resumed.output(1)
        assert _restored(job) == ("local", older)
        for index in (0, 1):
            assert f"resume: restoring step {older} from the local tier" in resumed.output(index)
        assert job.digest(M) == reference.digest(M)
    finally:
        reference.kill_all()
        job.kill_all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sender", ["intact", "damaged"])
def test_a_process_whose_memory_volume_is_new_receives_the_newest_local_step_from_the_other_slice(
    sender: str, gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path, run_name: str
) -> None:
    """Two slices of one process each (the state is replicated over the slices). Process 1's node is
    replaced between two attempts: its local directory is new. Process 0 sends it the newest local step,
    a step GCS never had (so no byte of it came from the bucket), and the run ends on the bits of an
    uninterrupted one. If process 0 cannot read that step (damaged), both processes say so, nobody
    waits for the other in a copy that will not come, and both restore GCS's latest."""
    reference, job = _reference_and_interrupted(gcs, trainer_env, tmp_path, run_name)
    dirs = [tmp_path / "local-0", tmp_path / "local-1"]
    try:
        uninterrupted = reference.start(ARGS, GCS_EVERY_10, processes=2, slices=2)
        gcs_step, held = _kill_ahead_of_gcs(job, _start_two(job, dirs, slices=2), dirs)
        assert uninterrupted.wait(180) == [0, 0]
        shutil.rmtree(dirs[1])  # a new, empty memory volume
        newest = held[0][-1]
        if sender == "damaged":
            _damaged(dirs[0], newest)
        resumed = _start_two(job, dirs, slices=2)
        assert resumed.wait(180) == [0, 0], resumed.output(0) + resumed.output(1)
        outputs = [resumed.output(0), resumed.output(1)]
        assert newest > gcs_step and newest not in job.committed_steps()
        for index, role in enumerate(("sending", "receiving")):
            assert f"resume: restoring step {newest} from the local tiers of slice 0 ({role})" in outputs[index]
        if sender == "intact":
            assert _restored(job) == ("peer", newest), outputs
        else:
            assert _restored(job) == ("gcs", gcs_step), outputs
            assert all(f"local step {newest} not restored on every process" in out for out in outputs), outputs
        assert job.digest(M) == reference.digest(M)
    finally:
        reference.kill_all()
        job.kill_all()


def _start_two(job: Job, dirs: list[Path], slices: int = 1, buddies: bool = True) -> Attempt:
    """Two processes, each with its own local directory (its own node's emptyDir)."""
    return job.start(
        ARGS, GCS_EVERY_10, processes=2, slices=slices, process_env=lambda i: _local_env(dirs[i], buddies=buddies)
    )


@pytest.mark.timeout(240)
def test_two_processes_stretch_the_local_interval_alike_to_stay_within_the_budget(job: Job, tmp_path: Path) -> None:
    """A budget of 0.1% of step time, far below what a local save costs (tens of ms against steps of
    tens of ms, or more on a loaded machine): at a re-choice (the 3rd due save, step 6, or the 10th,
    step 20, where the 3rd came before enough steps without a save in flight to price one) both
    processes stretch the interval from 2 steps to the same N and hold off to the same step, save
    nothing between, and hold the same steps."""
    dirs = [tmp_path / "local-0", tmp_path / "local-1"]
    attempt = job.start(
        ARGS, GCS_EVERY_10, processes=2, slices=1, process_env=lambda i: _local_env(dirs[i], every=2, budget="0.1")
    )
    assert attempt.wait(180) == [0, 0], attempt.output(0) + attempt.output(1)
    rechosen = r"local tier: every (\d+) steps from step (\d+), none before step (\d+) "
    chosen = [re.findall(rechosen, attempt.output(i)) for i in (0, 1)]
    rechoices = {str(2 * n) for n in local_tier.RECHOOSE_AT_SAVES}
    assert chosen[0] == chosen[1] and chosen[0] and chosen[0][0][1] in rechoices, chosen
    intervals = [int(every) for every, _, _ in chosen[0]]
    assert all(every > 2 and every % 2 == 0 for every in intervals), intervals
    held = [local_steps(d) for d in dirs]
    stretched_at, held_until = int(chosen[0][0][1]), int(chosen[0][0][2])
    assert held[0] == held[1] and held[0], held
    later = [s for s in held[0] if s > stretched_at]
    assert all(s >= held_until and any(s % every == 0 for every in intervals) for s in later), (chosen, held)


def test_the_budget_prices_the_slowdown_beside_a_local_save_not_only_its_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process's tier in this process, fed steps of 10 ms that take 100 ms more each while a local
    save is in flight (5 steps after every save: 0.5 s a save, where the loop is blocked a few ms). At
    the third due save the interval must pay for that 0.5 s within the budget as planned (HEADROOM of
    2%): at least 2780 steps. Pricing the blocking alone (what a save costs a host whose cores
    training leaves idle) gave a few hundred."""
    import jax.numpy as jnp
    from tpujob.cadence import HEADROOM

    tier = local_tier.LocalTier(LocalTierConfig(str(tmp_path), 10, 2.0), str(tmp_path / "run"), "uid", 1)
    saved_at, now = -100, 0
    # A stand-in for when the background write ends, and only that: the real write of 8 floats ends
    # within the step, so the steps beside it could not be chosen; the saves themselves are Orbax's.
    monkeypatch.setattr(tier.manager, "is_saving_in_progress", lambda: now < saved_at + 5)
    # What each save really blocked the loop for (Orbax's blocking part: a loaded machine's is longer).
    blocked: list[float] = []
    meter_saved = tier.meter.saved

    def saved(seconds: float) -> None:
        blocked.append(seconds)
        meter_saved(seconds)

    monkeypatch.setattr(tier.meter, "saved", saved)
    state = {"w": jnp.arange(8.0)}
    try:
        for now in range(2, 31):  # step 1 compiles: the loop times none
            assert tier.measuring
            tier.step(0.110 if saved_at < now <= saved_at + 5 else 0.010)
            if tier.save(now, state):
                saved_at = now
    finally:
        tier.close()
    plan = 2.0 / 100 * HEADROOM
    assert tier.meter.baseline_s == pytest.approx(0.010) and tier.meter.cost_s is not None
    assert tier.meter.cost_s >= 0.5
    assert tier.interval_steps >= 10 * math.ceil(0.5 / (plan * 10 * 0.010)) == 2780
    assert tier.interval_steps % 10 == 0 and local_steps(tmp_path) == [10, 20]  # step 30: not due any more
    # The two saves spent over 1 s where 22 steps of 10 ms were trained: no save until enough steps
    # were trained to bring what the saves cost back within the plan.
    spent_s, trained_s = 2 * 0.5, 0.22
    assert spent_s / (trained_s + (tier.hold_until - 30) * 0.010) <= plan
    # Not more: the slowdown and the blocking it measured, nothing else.
    assert len(blocked) == 2 and tier.hold_until - 30 <= math.ceil((spent_s + sum(blocked)) / plan / 0.010) + 1


def test_the_local_interval_is_the_smallest_multiple_within_the_budget() -> None:
    assert local_tier.budgeted_interval(10, 0.030, 0.011, 2.0) == 140  # 30 ms per save: >= 1.5 s apart
    assert local_tier.budgeted_interval(10, 0.030, 1.0, 2.0) == 10  # 1 s steps: 0.3% at the floor
    assert local_tier.budgeted_interval(10, 0.200, 1.0, 2.0) == 10  # exactly 2%
    assert local_tier.budgeted_interval(10, 0.201, 1.0, 2.0) == 20
    assert local_tier.budgeted_interval(10, 0.030, 0.011, 0.0) == 10  # no budget
    assert local_tier.budgeted_interval(10, 0.0, 0.011, 2.0) == 10  # nothing measured
    assert local_tier.budgeted_interval(1, 100.0, 0.001, 2.0) == local_tier.MAX_STRETCH
    assert local_tier.debt_steps(1.0, 0.010) == 100  # 1 s owed: 100 steps of 10 ms
    assert local_tier.debt_steps(0.0, 0.010) == 0 and local_tier.debt_steps(1.0, 0.0) == 0  # nothing owed, measured


def test_the_agreed_step_is_the_newest_some_slice_holds_whole_and_own_tiers_come_next() -> None:
    one_slice, two_slices = [0, 0], [0, 1]
    assert local_plans([[4, 6], [4, 6]], one_slice, None) == [LocalPlan(6, None)]
    # Process 1 lost step 6: in one slice nobody else has its shards, both restore 4 from their own.
    assert local_plans([[4, 6], [4]], one_slice, None) == [LocalPlan(4, None)]
    assert local_plans([[6], [4]], one_slice, None) == []  # nothing in common: GCS
    assert local_plans([[6], []], one_slice, None) == []
    # Two slices: slice 0 sends 6 to process 1; if that cannot be, both hold 4.
    assert local_plans([[4, 6], [4]], two_slices, None) == [LocalPlan(6, 0), LocalPlan(4, None)]
    assert local_plans([[6], []], two_slices, 4) == [LocalPlan(6, 0)]  # a new memory volume
    assert local_plans([[4], [6]], two_slices, None) == [LocalPlan(6, 1)]  # from the lowest slice holding it
    assert local_plans([[4, 6], [4, 6]], two_slices, 6) == [LocalPlan(6, None)]  # at GCS's: local wins
    assert local_plans([[4, 6], [4, 6]], two_slices, 8) == []  # GCS is newer
    # Two processes per slice: a slice offers only the steps all its processes hold.
    assert local_plans([[6], [4], [4, 6], [4, 6]], [0, 0, 1, 1], None) == [LocalPlan(6, 1)]
    assert local_plans([[6], [4], [4], [4, 6]], [0, 0, 1, 1], None) == [LocalPlan(4, 1)]
    assert [slice_of_process(p, 4, 2) for p in range(4)] == [0, 0, 1, 1]


def test_each_replica_group_takes_its_first_holding_device_or_there_is_no_plan() -> None:
    # A (data=2, fsdp=2) mesh whose row 0 (slice 0) holds the step.
    holds = np.array([[True, True], [False, False]])
    # Sharded over fsdp, replicated over data: each column's source is its slice-0 device.
    assert first_sources(holds, [0]).tolist() == [[True, True], [False, False]]  # type: ignore[union-attr]
    # Replicated over both (a scalar): one source for all four devices.
    assert first_sources(holds, [0, 1]).tolist() == [[True, False], [False, False]]  # type: ignore[union-attr]
    # Sharded over data (not replicated over the slices): row 1's shards are held nowhere.
    assert first_sources(holds, [1]) is None
    assert first_sources(holds, []) is None
    assert first_sources(np.ones((2, 2), bool), []).tolist() == [[True, True], [True, True]]  # type: ignore[union-attr]
    # What travels as int32 bits: not 64-bit numbers, nor PRNG keys (such a state restores from its own or GCS).
    assert all(carried(t) for t in (np.float32, np.int8, np.bool_, jnp.bfloat16))
    assert not carried(np.float64) and not carried(jax.random.key(0).dtype)


def test_the_local_tier_is_off_without_its_directory_and_its_interval_is_checked() -> None:
    env = {"TPUJOB_RUN_DIR": "gs://b/ns/name"}
    assert parse_config([], env).local_tier is None  # today's behaviour
    on = parse_config([], env | {contract.Env.LOCAL_CHECKPOINT_DIR: "/local/"})
    assert on.local_tier == LocalTierConfig("/local", contract.DEFAULT_LOCAL_INTERVAL_STEPS)
    assert parse_config([], {contract.Env.LOCAL_CHECKPOINT_DIR: "/local"}).local_tier is None  # no GCS tier
    budget = contract.Env.LOCAL_CHECKPOINT_OVERHEAD_BUDGET_PERCENT
    assert on.local_tier.overhead_budget_percent == contract.DEFAULT_LOCAL_OVERHEAD_BUDGET_PERCENT == 2.0
    off = parse_config([], env | {contract.Env.LOCAL_CHECKPOINT_DIR: "/local", budget: "0"}).local_tier
    assert off is not None and off.overhead_budget_percent == 0
    buddies = contract.Env.LOCAL_CHECKPOINT_BUDDY_COPIES
    assert on.local_tier.buddy_copies is True
    alone = parse_config([], env | {contract.Env.LOCAL_CHECKPOINT_DIR: "/local", buddies: "false"}).local_tier
    assert alone is not None and alone.buddy_copies is False
    for bad in (
        {contract.Env.LOCAL_CHECKPOINT_INTERVAL_STEPS: "0"}, {contract.Env.LOCAL_CHECKPOINT_DIR: "gs://b/x"},
        {budget: "101"}, {budget: "-1"}, {buddies: "sometimes"},
    ):  # fmt: skip
        with pytest.raises(ConfigError):
            parse_config([], env | {contract.Env.LOCAL_CHECKPOINT_DIR: "/local"} | bad)


def test_a_record_says_its_tier_and_an_older_record_still_parses() -> None:
    record = contract.ProgressRecord(step=7, attempt=1, updated_at=contract.now_rfc3339(), restored_step=6,
                                     restored_from=contract.RESTORED_FROM_LOCAL)  # fmt: skip
    assert contract.from_json(contract.to_json(record)) == record
    older = json.loads(contract.to_json(record))
    del older["restored_from"]
    assert contract.from_json(json.dumps(older)).restored_from is None


def test_a_local_tier_too_small_for_its_three_copies_says_so_and_saves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The volume holds the two newest local steps and the one being written: a sizeLimit that fits
    fewer is refused at the first due save with what to raise it to, and the tier saves nothing more
    (it used to start saving and fail, or be evicted, once the third copy was written)."""
    import jax.numpy as jnp

    state = {"w": jnp.zeros((1024, 256), dtype=jnp.float32)}  # 1 MiB on this process
    assert local_tier.host_bytes(state) == 2**20
    assert local_tier.room_problem(2**20, 3 * 2**20) is None
    problem = local_tier.room_problem(2**20, 2 * 2**20 + 1)
    assert problem is not None and "3 copies of this host's 1Mi state (3Mi) but its volume has 2Mi" in problem
    assert "sizeLimit to at least 3Mi" in problem  # a quantity the user can set, rounded up

    tier = local_tier.LocalTier(LocalTierConfig(str(tmp_path), 10, 0.0), str(tmp_path / "run"), "uid", 1)
    monkeypatch.setattr(local_tier, "volume_bytes", lambda directory: 2 * 2**20)  # a 2 MiB tmpfs
    try:
        assert not tier.save(5, state)  # not due
        with pytest.raises(local_tier.Undersized, match="holds up to 3 copies"):
            tier.save(10, state)
        assert not tier.save(20, state) and tier.off
    finally:
        tier.close()
    assert local_steps(tmp_path) == []
