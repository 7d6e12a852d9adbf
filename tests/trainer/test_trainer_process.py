"""The trainer as the operator runs it: real processes, the real GCS emulator, real exit codes."""

from __future__ import annotations

import datetime
import re
import signal
from pathlib import Path

import pytest

from tests.trainer.procs import BUCKET, Job

TINY = ["--steps", "12", "--batch-size", "4", "--seq-len", "32"]


@pytest.mark.timeout(180)
def test_run_to_completion_writes_checkpoints_and_progress(job: Job) -> None:
    attempt = job.start(TINY)
    assert attempt.wait(150) == [0], attempt.output()
    committed = job.committed_steps()
    assert committed[-1] == 12 and len(committed) <= 3  # final step always saved; LatestN(3) by default
    record = job.progress()
    assert record["state"] == "succeeded"
    assert (record["step"], record["last_committed_step"], record["attempt"]) == (12, 12, 0)
    assert record["resumed_from_step"] is None and record["loss"] > 0 and record["steps_per_second"] > 0
    assert datetime.datetime.fromisoformat(record["updated_at"]).tzinfo is not None
    out = attempt.output()
    assert "resume: no committed checkpoint, fresh start from step 0" in out
    assert "step 12/12 loss " in out and " last_committed " in out


@pytest.mark.timeout(180)
def test_sigterm_saves_the_current_step_and_exits_143(job: Job) -> None:
    attempt = job.start(["--steps", "100000", "--batch-size", "4", "--seq-len", "32"])
    attempt.wait_until(lambda: attempt.last_step() >= 3, quiet=120)
    attempt.signal(signal.SIGTERM)
    assert attempt.wait(60) == [143], attempt.output()
    record = job.progress()
    stopped_at = record["step"]
    assert record["state"] == "preempted"
    assert stopped_at >= 3 and stopped_at in job.committed_steps()
    assert record["last_committed_step"] == stopped_at
    assert f"SIGTERM: stopping at step {stopped_at} (checkpoint of it: True)" in attempt.output()


def _copy_step_without_marker(job: Job, source: int, target: int) -> None:
    """Leave behind what a save killed before its commit looks like: the files, no commit_success.txt."""
    src, dst = f"{job.prefix}/checkpoints/{source}/", f"{job.prefix}/checkpoints/{target}/"
    for name in job.gcs.list_objects(BUCKET, src):
        relative = name[len(src) :]
        if relative != "commit_success.txt":
            job.gcs.upload(BUCKET, dst + relative, job.gcs.download(BUCKET, name))


@pytest.mark.timeout(300)
def test_restart_restores_latest_committed_never_a_partial_step(job: Job) -> None:
    assert job.start(TINY).wait(150) == [0]
    _copy_step_without_marker(job, source=12, target=50)
    assert job.step_dirs()[50] is False

    resumed = job.start(["--steps", "14", "--batch-size", "4", "--seq-len", "32"])
    assert resumed.wait(150) == [0], resumed.output()
    assert "resume: restoring step 12 (latest committed)" in resumed.output()
    assert job.progress()["resumed_from_step"] == 12
    assert 50 not in job.step_dirs()  # the partial directory was cleaned up, never restored

    pinned_missing = job.start(TINY, {"TPUJOB_RESUME_STEP": "50"})
    assert pinned_missing.wait(60) == [2]
    assert "TPUJOB_RESUME_STEP=50: no committed checkpoint at or after it" in pinned_missing.output()

    latest = job.committed_steps()[-1]  # 14: the resume above went on from 12
    pinned = job.start(["--steps", str(latest), "--batch-size", "4", "--seq-len", "32"], {"TPUJOB_RESUME_STEP": "12"})
    assert pinned.wait(150) == [0], pinned.output()
    assert f"resume: restoring step {latest} (newest committed, at or after TPUJOB_RESUME_STEP=12)" in pinned.output()


@pytest.mark.timeout(240)
def test_local_run_dir_skips_unrenamed_tmp_step(job: Job, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = job.start(TINY, {"TPUJOB_RUN_DIR": str(run_dir)})
    assert first.wait(150) == [0], first.output()
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "12").is_dir() and (run_dir / "progress.json").is_file()
    (checkpoints / "40.orbax-checkpoint-tmp").mkdir()  # a save killed before its atomic rename
    second = job.start(["--steps", "13", "--batch-size", "4", "--seq-len", "32"], {"TPUJOB_RUN_DIR": str(run_dir)})
    assert second.wait(150) == [0], second.output()
    assert "resume: restoring step 12 (latest committed)" in second.output()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unreachable endpoint", "did not answer"),
        ("missing bucket", "not writable"),
        ("local path under a file", "not writable"),
    ],
)
def test_unusable_storage_fails_fast_with_exit_3(job: Job, tmp_path: Path, case: str, expected: str) -> None:
    # A short wait: storage that stays unusable is given up on after TPUJOB_STORAGE_WAIT_SECONDS.
    env: dict[str, str] = {"TPUJOB_STORAGE_TIMEOUT_SECONDS": "8", "TPUJOB_STORAGE_WAIT_SECONDS": "3"}
    if case == "unreachable endpoint":
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        env |= {"STORAGE_EMULATOR_HOST": dead, "TENSORSTORE_GCS_HTTP_URL": dead}
    elif case == "missing bucket":
        env |= {"TPUJOB_RUN_DIR": f"gs://no-such-bucket-{job.name}/x/y"}
    else:
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        env |= {"TPUJOB_RUN_DIR": str(blocker / "run")}
    attempt = job.start(TINY, env)
    codes = attempt.wait(90)
    out = attempt.output()
    assert codes == [3], out
    assert "checkpoint storage unusable at start" in out
    assert re.search(r"gave up after \d+ probes in 3s", out), out  # the wait the env gives, not the default 120 s
    if case != "unreachable endpoint":  # refused connections may also surface as an error, not a timeout
        assert expected in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--model", "huge"], {}, "unknown model 'huge'"),
        ([], {"TPUJOB_CHECKPOINT_POLICY": "sometimes"}, "want continuous|interval|adaptive"),
        ([], {"TPUJOB_CHECKPOINT_KEEP_LATEST": "x"}, "is not an integer"),
        (["--batch-size", "3"], {}, "not divisible by the 2 devices"),
    ],
)
def test_bad_configuration_exits_2(job: Job, args: list[str], env: dict[str, str], message: str) -> None:
    attempt = job.start(["--steps", "2", *args], env)
    assert attempt.wait(50) == [2]
    assert message in attempt.output()
