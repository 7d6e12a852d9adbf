"""A restore never destroys a committed checkpoint, only the data condemns one, and a refusal by
storage is not an outage: real trainer processes, the real emulator, and a FaultProxy in front of
it for the HTTP errors the emulator cannot produce (503, 403). Bytes are read from the emulator."""

from __future__ import annotations

import pytest

from tests.trainer.faults import FaultProxy
from tests.trainer.procs import BUCKET, Job

SHAPE = ["--batch-size", "4", "--seq-len", "32"]
EVERY_2 = {"TPUJOB_CHECKPOINT_POLICY": "interval", "TPUJOB_CHECKPOINT_INTERVAL_STEPS": "2"}


def _bytes(job: Job, folder: str) -> dict[str, bytes]:
    """{name under <run dir>/<folder>/: its bytes}."""
    prefix = f"{job.prefix}/{folder}/"
    return {name[len(prefix) :]: job.gcs.download(BUCKET, name) for name in job.gcs.list_objects(BUCKET, prefix)}


def _steps_2_4_6(job: Job) -> dict[str, bytes]:
    assert job.start(["--steps", "6", *SHAPE], EVERY_2).wait(150) == [0]
    assert job.committed_steps() == [2, 4, 6]
    return _bytes(job, "checkpoints")


@pytest.mark.timeout(300)
def test_a_stale_pin_restores_the_newest_committed_step_and_deletes_none(job: Job) -> None:
    before = _steps_2_4_6(job)
    # A pin older than what committed since (a JobSet unsuspended or resumed long after it was made).
    resumed = job.start(["--steps", "7", *SHAPE], {"TPUJOB_RESUME_STEP": "2", "TPUJOB_CHECKPOINT_KEEP_LATEST": "10"})
    assert resumed.wait(150) == [0], resumed.output()
    assert "resume: restoring step 6 (newest committed, at or after TPUJOB_RESUME_STEP=2)" in resumed.output()
    assert job.progress()["restored_step"] == 6
    assert job.committed_steps() == [2, 4, 6, 7]
    after = _bytes(job, "checkpoints")
    assert {name: after.get(name) for name in before} == before  # every byte of 2, 4 and 6 still there


@pytest.mark.timeout(300)
def test_a_5xx_while_restoring_is_retried_never_a_fallback(proxied_job: Job, proxy: FaultProxy) -> None:
    job = proxied_job
    before = _steps_2_4_6(job)
    # Every read of step 6's metadata answers 503 until gcsfs, after its own 6 tries (about 30 s),
    # raises and the trainer has decided what to do about it.
    proxy.fail(
        503, lambda method, path: "checkpoints%2F6%2Fdefault%2F_METADATA" in path or "6/default/_METADATA" in path
    )
    resumed = job.start(["--steps", "7", *SHAPE])
    resumed.wait_until(lambda: "not the data's fault; retry 1/5" in resumed.output(), quiet=120, poll=0.2)
    proxy.heal()
    assert resumed.wait(120) == [0], resumed.output()
    assert "resume: restoring step 6 failed (HttpError" in resumed.output() and proxy.answered[503] >= 6
    record = job.progress()
    assert (record["restored_step"], record["restore_failures"], record["quarantined"]) == (6, [], [])
    after = _bytes(job, "checkpoints")
    assert {name: after[name] for name in before if not name.startswith("2/")} == {
        name: data for name, data in before.items() if not name.startswith("2/")
    }  # 4 and 6 kept (2 went by keep-latest-3 when 7 committed)


@pytest.mark.timeout(120)
def test_a_403_at_start_exits_5_at_once_naming_bucket_and_identity(proxied_job: Job, proxy: FaultProxy) -> None:
    proxy.fail(403)
    account = "trainer@tpujob-test.iam.gserviceaccount.com"
    # TPUJOB_STORAGE_WAIT_SECONDS is 120 here: an outage would be waited out far past the timeout.
    attempt = proxied_job.start(["--steps", "4", *SHAPE], {"GOOGLE_SERVICE_ACCOUNT": account})
    assert attempt.wait(60) == [5], attempt.output()
    assert f"gs://{BUCKET} as {account}: " in attempt.output() and "Forbidden" in attempt.output()
    assert "storage probe 1 failed" not in attempt.output()  # not waited out as an outage


@pytest.mark.timeout(240)
def test_a_403_on_a_save_exits_5_and_says_so_in_the_record(proxied_job: Job, proxy: FaultProxy) -> None:
    # tensorstore's array uploads into checkpoints/ are refused; the probe and progress.json pass.
    proxy.fail(403, lambda method, path: method in ("POST", "PUT") and "checkpoints" in path)
    attempt = proxied_job.start(["--steps", "30", *SHAPE], EVERY_2)
    assert attempt.wait(200) == [5], attempt.output()
    record = proxied_job.progress()
    assert record["state"] == "failed" and record["storage_denied"].startswith(f"gs://{BUCKET} as ")
    assert proxied_job.committed_steps() == []


@pytest.mark.slow  # two processes compile without the cache: about 2.5 min here
@pytest.mark.timeout(400)
def test_two_processes_agree_to_quarantine_a_step_damaged_for_one_of_them(job: Job) -> None:
    args = ["--steps", "6", "--batch-size", "8", "--seq-len", "32"]
    assert job.start(args, EVERY_2, processes=2, slices=2).wait(200) == [0, 0]
    assert job.committed_steps() == [2, 4, 6]
    # Only process 1's own store of step 6 loses its largest data file.
    store = f"{job.prefix}/checkpoints/6/default/ocdbt.process_1/d/"
    victim = max(job.gcs.list_objects(BUCKET, store), key=lambda name: len(job.gcs.download(BUCKET, name)))
    job.gcs.delete_object(BUCKET, victim)
    damaged = _bytes(job, "checkpoints/6")

    resumed = job.start(["--steps", "7", "--batch-size", "8", "--seq-len", "32"], processes=2, slices=2)
    assert resumed.wait(200) == [0, 0], resumed.output(0) + resumed.output(1)
    record = job.progress()
    assert (record["restored_step"], [f["step"] for f in record["restore_failures"]]) == (4, [6])
    assert record["quarantined"] == [{"step": 6, "path": f"{job.run_dir}/quarantine/6"}]
    assert _bytes(job, "quarantine/6") == damaged
    assert job.committed_steps()[-1] == 7
