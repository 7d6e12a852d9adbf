"""Faults that must cost a job nothing: storage down at start or in the middle of a run, a damaged
latest checkpoint, checkpoints of another model. Real trainer processes, a real fake-gcs-server
that the tests stop, restart (same port, same data) and hang (SIGSTOP)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
import tpujob_contract as contract
from tpujob.config import STORAGE_WAIT_ENV
from tpujob_devcluster.fakegcs import FakeGcsServer

from tests.trainer.faults import FaultProxy, RestartableGcs
from tests.trainer.procs import BUCKET, Attempt, Job

SHAPE = ["--batch-size", "4", "--seq-len", "32"]
# Steps of at least 50 ms for the runs that train until the test stops them: the faults' seconds cost a
# few hundred steps, not thousands (the math is the unpaced reference's).
PACED = ["--min-step-seconds", "0.05"]
TINY = ["--steps", "12", *SHAPE]


def _sleep_while_running(attempt: Attempt, seconds: float) -> None:
    """Sleep, but fail at once if the trainer dies meanwhile (today's failure mode)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert attempt.running(), f"trainer exited during the outage; output:\n{attempt.output()[-4000:]}"
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_storage_down_at_start_is_waited_out(faulty_job: Job, faulty_gcs: RestartableGcs) -> None:
    faulty_gcs.stop()
    attempt = faulty_job.start(TINY, {"TPUJOB_STORAGE_TIMEOUT_SECONDS": "3"})
    # Today's trainer gives up (exit 3) after the first probe; now it retries with backoff.
    attempt.wait_until(lambda: "storage probe 2 failed" in attempt.output(), quiet=120, poll=0.2)
    faulty_gcs.start()
    assert attempt.wait(150) == [0], attempt.output()
    assert "storage answers again after" in attempt.output()
    assert faulty_job.committed_steps()[-1] == 12
    assert faulty_job.progress()["state"] == "succeeded"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_storage_faults_mid_run_cost_nothing(
    faulty_job: Job, faulty_gcs: RestartableGcs, gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path
) -> None:
    """Three faults while a continuously checkpointing run trains: the bucket answering 404 (saves
    fail at once; today's trainer dies of it), the server down (15 s) and hung (15 s). The run trains
    through all three however fast the machine is (it has no end of its own: a SIGTERM after the
    faults stops it with the save of its step), and that step is bitwise the uninterrupted run's."""
    # A length no run reaches: the learning-rate schedule spans --steps, so the reference has it too.
    args = ["--steps", "100000000", *SHAPE, "--log-every", "50"]
    # One device per process: on 2 CPU devices, XLA's in-process all-gather of the fsdp step was
    # seen to abort ("Termination timeout for all gather", exit -6) in runs of thousands of steps
    # with continuous saves, with or without storage faults; that hazard is not this test's subject.
    # XLA's optimised steps: this run is long in steps, not in compiles (tests/conftest.py TEST_JAX_ENV).
    one_device = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}
    faulty_job.base_env = {**faulty_job.base_env, **one_device}
    attempt = faulty_job.start([*args, *PACED])
    _run_with_faults(faulty_job, faulty_gcs, attempt)
    attempt.signal(signal.SIGTERM)
    assert attempt.wait(quiet=120) == [143], attempt.output()[-4000:]
    stopped = faulty_job.progress()
    assert stopped["state"] == "preempted" and stopped["save_failures"] >= 1, stopped
    step = stopped["step"]
    assert faulty_job.committed_steps()[-1] == step == stopped["last_committed_step"], stopped

    # The uninterrupted run, on the session's healthy emulator, saves that step (its one multiple).
    (tmp_path / "reference").mkdir()
    reference = Job(gcs, {**trainer_env, **one_device}, tmp_path / "reference", f"ref-{faulty_job.name}")
    saves_at_step = {"TPUJOB_CHECKPOINT_POLICY": "interval", "TPUJOB_CHECKPOINT_INTERVAL_STEPS": str(step)}
    try:
        uninterrupted = reference.start(args, saves_at_step)
        uninterrupted.wait_until(lambda: step in reference.committed_steps(), quiet=120)
    finally:
        reference.kill_all()
    assert faulty_job.digest(step) == reference.digest(step)


@pytest.mark.timeout(300)
def test_a_save_that_blocks_the_loop_past_the_hang_timeout_keeps_the_record_fresh_for_that_long(
    proxied_job: Job, proxy: FaultProxy
) -> None:
    """Storage slow for checkpoints (every request of a save held back 1 s; the progress record's are
    not) makes the final save, which first waits for the one in flight, block the loop for several
    hang timeouts. The operator's hang clock reads the record's silence, so the record is written
    meanwhile, saying since when the loop is blocked, for up to the hang timeout and no longer (a
    save that never ends is still a hang). Stop 37's full run found it: a job that had committed its
    final step ended Failed/Hang."""
    job, hang = proxied_job, 1
    proxy.delay(1.0, lambda method, path: "checkpoints" in path and method != "GET")
    attempt = job.start(["--steps", "12", *SHAPE], {"TPUJOB_HANG_TIMEOUT_SECONDS": str(hang)})
    seen: dict[str, dict[str, object]] = {}  # the records read while it ran, by updated_at
    while attempt.running():
        with contextlib.suppress(Exception):  # not written yet, or read mid-upload
            record = job.progress()
            seen[str(record["updated_at"])] = record
        time.sleep(0.1)
    assert attempt.wait(quiet=120) == [0], attempt.output()[-4000:]
    assert job.committed_steps()[-1] == 12 and job.progress()["state"] == "succeeded"
    records = [contract.from_json(json.dumps(r)) for r in seen.values()]
    blocked = [(r.updated - _time(r.blocked_in_save_at)).total_seconds() for r in records if r.blocked_in_save_at]
    assert blocked and max(blocked) >= hang / 2, sorted(seen)  # written while blocked in a save
    assert max(blocked) <= hang + 1, blocked  # and not past the hang timeout of that save


@pytest.mark.timeout(300)
def test_storage_lost_while_training_ends_the_attempt_with_exit_3_before_the_hang_clock(
    faulty_job: Job, faulty_gcs: RestartableGcs
) -> None:
    """Storage hangs for the workers alone, mid-run (the operator may still read the bucket): the
    progress record goes silent, which the operator's hang clock would charge to the job as a Hang.
    The trainer gives up at half that clock (TPUJOB_HANG_TIMEOUT_SECONDS) with exit 3, which the
    operator restarts without counting; every step committed before stays committed."""
    # The default limit: a storage wait the job sets (the tier's 120 s) would be the limit instead.
    faulty_job.base_env = {k: v for k, v in faulty_job.base_env.items() if k != STORAGE_WAIT_ENV}
    attempt = faulty_job.start(
        ["--steps", "1000000", *SHAPE, "--log-every", "20", *PACED],
        {"TPUJOB_HANG_TIMEOUT_SECONDS": "16", "TPUJOB_STORAGE_TIMEOUT_SECONDS": "3"},
    )
    attempt.wait_until(lambda: len(faulty_job.committed_steps()) >= 2, quiet=120)
    committed = faulty_job.committed_steps()
    faulty_gcs.hang()
    try:
        codes = attempt.wait(quiet=120)
    finally:
        faulty_gcs.unhang()
    assert codes == [3], attempt.output()[-4000:]
    said = re.search(r"progress record could not be written for (\d+) s", attempt.output())
    # It waited out half the hang clock and gave up before the operator's clock (16 s) would count a Hang.
    assert said and 8 <= int(said.group(1)) < 16, attempt.output()[-4000:]
    assert set(committed) <= set(faulty_job.committed_steps())


def _time(text: str) -> datetime:
    moment = contract.parse_time(text)
    assert moment is not None
    return moment


def _run_with_faults(faulty_job: Job, faulty_gcs: RestartableGcs, attempt: Attempt) -> None:
    attempt.wait_until(lambda: bool(faulty_job.committed_steps()) and attempt.last_step() >= 100, quiet=120)
    faults = [f"bucket 404 from step {attempt.last_step()}"]
    faulty_gcs.hide_bucket(BUCKET)
    try:
        _sleep_while_running(attempt, 5)
    finally:
        faulty_gcs.restore_bucket(BUCKET)
    faults.append(f"server down from step {attempt.last_step()}")
    faulty_gcs.stop()
    try:
        _sleep_while_running(attempt, 15)
    finally:
        faulty_gcs.start()
    faults.append(f"server hung from step {attempt.last_step()}")
    faulty_gcs.hang()
    try:
        _sleep_while_running(attempt, 15)
    finally:
        faulty_gcs.unhang()
    # Trained on after the faults: a step newer than any before them is committed.
    before = attempt.last_step()
    attempt.wait_until(lambda: (faulty_job.committed_steps() or [0])[-1] > before, quiet=120)
    print("faults:", "; ".join(faults), f"; then step {attempt.last_step()} committed")
    assert "checkpoint: save failed" in attempt.output()


def _delete_one_array_object(job: Job, step: int) -> str:
    """Delete the largest data file of the step's OCDBT store: the one holding the arrays (the
    small ones may be b-tree nodes that a finished store no longer references)."""
    prefix = f"{job.prefix}/checkpoints/{step}/default/ocdbt.process_0/d/"
    victim = max(job.gcs.list_objects(BUCKET, prefix), key=lambda name: len(job.gcs.download(BUCKET, name)))
    job.gcs.delete_object(BUCKET, victim)
    return victim


def _step_bytes(job: Job, folder: str) -> dict[str, bytes]:
    prefix = f"{job.prefix}/{folder}/"
    return {name[len(prefix) :]: job.gcs.download(BUCKET, name) for name in job.gcs.list_objects(BUCKET, prefix)}


@pytest.mark.timeout(300)
def test_damaged_latest_step_is_quarantined_and_an_older_one_restored(job: Job) -> None:
    assert job.start(TINY).wait(150) == [0]
    committed = job.committed_steps()
    assert committed[-1] == 12 and len(committed) >= 2, committed
    _delete_one_array_object(job, 12)
    damaged = _step_bytes(job, "checkpoints/12")

    resumed = job.start(["--steps", "14", *SHAPE])
    assert resumed.wait(150) == [0], resumed.output()
    older = committed[-2]
    assert "resume: step 12 is damaged" in resumed.output()
    assert f"resume: restoring step {older} (older committed step)" in resumed.output()
    record = job.progress()
    assert (record["state"], record["restored_step"], record["resumed_from_step"]) == ("succeeded", older, older)
    assert [f["step"] for f in record["restore_failures"]] == [12] and record["restore_failures"][0]["error"]
    assert record["quarantined"] == [{"step": 12, "path": f"{job.run_dir}/quarantine/12"}]
    assert _step_bytes(job, "quarantine/12") == damaged  # moved, every byte kept, the marker too
    assert _step_bytes(job, "checkpoints/12") != damaged  # gone from checkpoints/ (or saved anew since)
    assert job.committed_steps()[-1] == 14


@pytest.mark.timeout(300)
def test_checkpoints_of_another_model_exit_4_and_delete_nothing(job: Job) -> None:
    assert job.start(TINY).wait(150) == [0]
    before = job.objects()
    committed = job.committed_steps()

    other = job.start([*TINY, "--model", "small"])
    assert other.wait(150) == [4], other.output()
    assert "no committed checkpoint could be restored" in other.output()
    record = job.progress()
    assert record["state"] == "incompatible" and record["restored_step"] is None
    assert [f["step"] for f in record["restore_failures"]] == sorted(committed, reverse=True)
    assert all(f["error"] for f in record["restore_failures"])
    assert job.objects() == before  # nothing deleted, nothing written under checkpoints/
