"""The operator <-> trainer seam, crossed for real: what build_jobset sets is what the trainer parses,
and what the trainer writes is what the operator reads."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import tpujob_contract as contract
from hypothesis import given
from hypothesis import strategies as st
from tpujob.progress import ProgressWriter
from tpujob_operator.api import OPERATOR_ENV_NAMES, OPERATOR_ENV_PREFIXES, FailureRecord, TrainingJobStatus
from tpujob_operator.facts import Observed
from tpujob_operator.jobset import build_jobset
from tpujob_operator.status import with_observations
from tpujob_trainer.config import parse_config

from .factories import training_job


def _pod_env(manifest: dict[str, Any], slice_index: int, completion_index: int) -> dict[str, str]:
    """The container env as kubelet resolves it for one pod (downward API and the Job's index)."""
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    annotations = {contract.JOB_INDEX_ANNOTATION: str(slice_index)}
    env = {"JOB_COMPLETION_INDEX": str(completion_index)}
    for entry in pod["spec"]["containers"][0]["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == f"metadata.annotations['{contract.JOB_INDEX_ANNOTATION}']"
            env[entry["name"]] = annotations[contract.JOB_INDEX_ANNOTATION]
    return env


@pytest.mark.parametrize("resume_step", [None, 0, 1200])
def test_the_trainer_parses_what_the_operator_sets(resume_step):
    tj = training_job(
        slices=2,
        checkpoint={"directory": "gs://acme-ckpt/runs/", "policy": "interval", "intervalSteps": 50,
                    "keep": {"latest": 4, "everySteps": 1000}, "saveOnPreemption": False},
    )  # fmt: skip
    manifest = build_jobset(tj, attempt=3, resume_step=resume_step)
    cfg = parse_config([], _pod_env(manifest, slice_index=1, completion_index=1))
    assert (cfg.job_name, cfg.job_namespace, cfg.job_uid, cfg.attempt) == ("llama", "ml", "0000-1111", 3)
    assert cfg.run_dir == tj.run_dir == "gs://acme-ckpt/runs/ml/llama"
    hosts = 2  # v5p 2x2x2: 2 hosts per slice
    assert (cfg.topology.num_processes, cfg.topology.process_id, cfg.topology.num_slices) == (2 * hosts, 3, 2)
    assert cfg.topology.coordinator_address == "llama-a3-slice-0-0.llama-a3:8476"
    ckpt = cfg.checkpoint
    assert ckpt is not None
    assert (ckpt.policy, ckpt.interval_steps, ckpt.keep_latest, ckpt.keep_every_steps) == ("interval", 50, 4, 1000)
    assert ckpt.save_on_preemption is False
    assert ckpt.resume == (contract.LATEST if resume_step is None else contract.Resume.at(resume_step))


def test_every_variable_the_operator_sets_is_a_contract_name_users_cannot_set():
    adaptive = {
        "directory": "gs://acme-ckpt/runs",
        "policy": "adaptive",
        "maxIntervalSeconds": 600,
        "local": {"sizeLimit": "16Gi"},
    }
    manifest = build_jobset(training_job(checkpoint=adaptive), attempt=0, resume_step=None)
    set_by_operator = set(_pod_env(manifest, 0, 0)) - {"JOB_COMPLETION_INDEX"}
    # An InPlace job's workers also get their own compilation cache (besides the restart agent's env).
    in_place = build_jobset(training_job(restart={"strategy": "InPlace"}), attempt=0, resume_step=None)
    container = in_place["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    set_by_operator |= {e["name"] for e in container["env"] if e["name"].startswith("TPUJOB_")}
    assert set_by_operator == set(contract.Env.names())
    for name in set_by_operator:
        assert name in OPERATOR_ENV_NAMES or name.startswith(OPERATOR_ENV_PREFIXES)


def test_the_operator_reads_what_the_trainer_writes(tmp_path: Path):
    record = contract.ProgressRecord(
        step=130, attempt=2, updated_at=contract.now_rfc3339(), state="running", uid="0000-1111", loss=2.5,
        steps_per_second=4.0, resumed_from_step=100, restored_step=100,
        restore_failures=(contract.RestoreFailure(120, "OSError: gone"),), save_failures=1,
        process_started_at="2026-11-30T12:00:00.000000Z", storage_ready_at="2026-11-30T12:00:02.500000Z",
        restore_started_at="2026-11-30T12:00:03.000000Z", restore_finished_at="2026-11-30T12:00:09.000000Z",
        first_step_at="2026-11-30T12:00:21.000000Z", save_blocking_seconds=1.25,
    )  # fmt: skip
    writer = ProgressWriter(str(tmp_path), committed=lambda step: step == 125)
    writer.saved(125)
    writer.close(record)
    written = Path(contract.progress_path(str(tmp_path))).read_bytes()
    progress = contract.from_json(written)
    assert progress == dataclasses.replace(record, last_committed_step=125)  # the writer checked the commit rule
    assert contract.parse_time(progress.restore_started_at) == datetime(2026, 11, 30, 12, 0, 3, tzinfo=UTC)
    # and the operator shows it: the current attempt's step, loss and failed saves
    shown = with_observations(TrainingJobStatus(attempt=2), Observed(now=progress.updated, progress=progress))
    assert (shown.step, shown.loss, shown.resumed_from_step) == (130, 2.5, 100)
    assert shown.model_dump(by_alias=True, exclude_none=True)["saveFailures"] == 1


def test_the_trainer_parses_the_adaptive_policy_the_operator_sets():
    checkpoint = {"directory": "gs://acme-ckpt/runs", "policy": "adaptive", "overheadBudgetPercent": 7.5,
                  "minIntervalSeconds": 2, "maxIntervalSeconds": 600}  # fmt: skip
    tj = training_job(checkpoint=checkpoint, status={"restarts": 1})
    env = _pod_env(build_jobset(tj, attempt=1, resume_step=None), 0, 0)
    cfg = parse_config([], env)
    assert cfg.checkpoint is not None and cfg.checkpoint.policy == "adaptive"
    assert float(env[contract.Env.CHECKPOINT_OVERHEAD_BUDGET_PERCENT]) == 7.5
    assert float(env[contract.Env.CHECKPOINT_MAX_INTERVAL_SECONDS]) == 600
    assert float(env[contract.Env.MTBF_SECONDS]) == (0 + 6 * 3600) / 2  # no ledger yet: the prior over 2


def test_the_operator_reads_the_adaptive_cadence_the_trainer_reports():
    record = contract.ProgressRecord(
        step=10, attempt=0, updated_at=contract.now_rfc3339(), checkpoint_interval_seconds=12.5,
        checkpoint_interval_bound="young_daly", save_cost_seconds=0.4, checkpoint_overhead_percent=3.2,
        mtbf_seconds=21600.0,
    )  # fmt: skip

    def shown(written: contract.ProgressRecord) -> TrainingJobStatus:
        read = contract.from_json(contract.to_json(written).encode())
        return with_observations(TrainingJobStatus(), Observed(now=read.updated, progress=read))

    cadence = shown(record).checkpoint_cadence
    assert cadence is not None
    assert (cadence.interval_seconds, cadence.bound, cadence.save_cost_seconds) == (12.5, "young_daly", 0.4)
    assert (cadence.overhead_percent, cadence.mtbf_seconds) == (3.2, 21600.0)
    plain = contract.ProgressRecord(step=10, attempt=0, updated_at=contract.now_rfc3339())
    assert shown(plain).checkpoint_cadence is None


def test_a_record_of_an_older_trainer_is_still_read():
    old = {"step": 7, "attempt": 1, "updated_at": "2026-11-30T12:00:00Z", "resumed_from_step": 5, "extra": 1}
    progress = contract.from_json(json.dumps(old).encode())
    assert (progress.step, progress.uid, progress.resumed_from_step, progress.first_step_at) == (7, "", 5, None)


@pytest.mark.parametrize("raw", [b"{}", b"[]", b"not json", b'{"step": "x", "updated_at": "now"}'])
def test_a_malformed_record_is_refused(raw: bytes):
    with pytest.raises(ValueError):
        contract.from_json(raw)


@given(st.one_of(st.just(contract.LATEST), st.just(contract.FRESH), st.integers(0, 10**12).map(contract.Resume.at)))
def test_resume_values_survive_the_environment(resume: contract.Resume):
    assert contract.Resume.parse(resume.encode()) == resume


def test_the_run_directory_layout():
    run = contract.run_dir("gs://b/p/", "ns", "job")
    assert run == "gs://b/p/ns/job"
    assert contract.commit_marker(run, 40) == "gs://b/p/ns/job/checkpoints/40/commit_success.txt"
    assert contract.progress_path(run) == "gs://b/p/ns/job/progress.json"
    assert [contract.step_of(e) for e in ("40/", "gs://b/p/ns/job/checkpoints/7", "40.orbax-checkpoint-tmp-1/")] == [
        40,
        7,
        None,
    ]


def test_quarantined_steps_and_a_storage_denial_round_trip_and_older_records_still_read():
    record = contract.ProgressRecord(
        step=20, attempt=3, updated_at=contract.now_rfc3339(), state="running", restored_step=20,
        restore_failures=(contract.RestoreFailure(30, "ValueError: OUT_OF_RANGE: ..."),),
        quarantined=(contract.QuarantinedStep(30, "gs://b/ns/job/quarantine/30"),),
        storage_denied="gs://b as trainer@p.iam.gserviceaccount.com: OSError: Forbidden",
    )  # fmt: skip
    back = contract.from_json(contract.to_json(record))
    assert back == record
    shown = with_observations(TrainingJobStatus(attempt=3), Observed(now=back.updated, progress=back))
    assert shown.quarantined_checkpoints == [30]  # what the operator names
    older = json.loads(contract.to_json(record))
    del older["quarantined"], older["storage_denied"]  # a trainer from before these fields
    read = contract.from_json(json.dumps(older))
    assert (read.quarantined, read.storage_denied) == ((), None)
    assert contract.ExitCode.STORAGE_PERMISSION_DENIED == 5


@pytest.mark.parametrize("policy", contract.CHECKPOINT_POLICIES)
def test_a_spec_that_sets_only_the_policy_gets_the_trainers_own_defaults(policy: contract.CheckpointPolicy):
    """The CRD's defaults, passed in the env, are what the trainer takes when the env says nothing."""
    checkpoint: dict[str, Any] = {"directory": "gs://acme-ckpt/runs", "policy": policy}
    if policy == "interval":  # required there (CEL); the trainer's default is for local runs
        checkpoint["intervalSteps"] = contract.DEFAULT_INTERVAL_STEPS
    env = _pod_env(build_jobset(training_job(checkpoint=checkpoint), attempt=0, resume_step=None), 0, 0)
    from_operator = parse_config([], env).checkpoint
    own = {k: v for k, v in env.items() if not k.startswith("TPUJOB_CHECKPOINT_") or k.endswith("_POLICY")}
    from_defaults = parse_config([], own).checkpoint
    assert from_operator is not None and from_defaults is not None
    if policy != "interval":  # the operator sends 0 outside policy interval
        from_defaults = dataclasses.replace(from_defaults, interval_steps=0)
    assert from_defaults == from_operator


def test_the_failure_says_which_tier_its_in_place_recovery_restored_from():
    """The record of the process restarted after an in-place failure names its tier; the record of a
    process that started before the failure (the failed round's own) does not decide it."""
    failure = FailureRecord(time="2026-12-06T10:00:00Z", kind="NodeLost", reason="NodeGone", rung="InPlace",
                            resume_step=100)  # fmt: skip
    status = TrainingJobStatus(attempt=0, last_failure=failure)

    def record(started: str) -> contract.ProgressRecord:
        return contract.ProgressRecord(
            step=126, attempt=0, updated_at="2026-12-06T10:00:30Z", process_started_at=started,
            restored_step=125, restored_from=contract.RESTORED_FROM_PEER,
        )  # fmt: skip

    def shown(progress: contract.ProgressRecord) -> FailureRecord | None:
        read = contract.from_json(contract.to_json(progress).encode())
        return with_observations(status, Observed(now=read.updated, progress=read)).last_failure

    after = shown(record("2026-12-06T10:00:10Z"))
    assert after is not None and (after.restored_from, after.resume_step) == ("peer", 125)
    assert after.model_dump(by_alias=True, exclude_none=True)["restoredFrom"] == "peer"
    before = shown(record("2026-12-06T09:00:00Z"))
    assert before is not None and before.restored_from is None
