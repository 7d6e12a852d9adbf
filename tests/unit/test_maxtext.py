"""spec.framework maxtext: the JobSet (golden manifests, flags, XPK's env), what admission refuses, and
progress derived from what MaxText leaves on storage."""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from tpujob_operator import api
from tpujob_operator.facts import JobSetFacts
from tpujob_operator.frameworks import admission, maxtext
from tpujob_operator.jobset import build_jobset, coordinator_host, jobset_name

from .factories import training_job

GOLDEN = Path(__file__).parent / "golden"
USER_ARGS = ["model_name=default", "override_model_config=true", "dataset_type=synthetic", "steps=1000"]
CASES: dict[str, dict[str, Any]] = {
    "maxtext-v5e-1-slice-2x2": dict(accelerator="tpu-v5-lite-podslice", topology="2x2", slices=1),
    "maxtext-v5p-2-slices-2x2x2": dict(
        accelerator="tpu-v5p-slice",
        topology="2x2x2",
        slices=2,
        checkpoint={"directory": "gs://acme-ckpt/runs/", "policy": "interval", "intervalSteps": 250, "async": False},
        env=[{"name": "LIBTPU_INIT_ARGS", "value": "--xla_tpu_enable_data_parallel_all_reduce_opt=true"}],
    ),
}


def maxtext_job(**spec: Any) -> api.TrainingJob:
    spec.setdefault("image", "us-docker.pkg.dev/acme/maxtext:0.2.5")
    spec.setdefault("args", USER_ARGS)
    return training_job(framework="maxtext", **spec)


def _container(manifest: dict[str, Any]) -> dict[str, Any]:
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return pod["containers"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", sorted(CASES))
def test_builder_matches_golden_manifest(case):
    manifest = build_jobset(maxtext_job(**CASES[case]), attempt=1, resume_step=400)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    assert manifest == yaml.safe_load(path.read_text())


def test_checkpoint_policy_becomes_maxtexts_flags_after_the_users_args():
    args = _container(build_jobset(maxtext_job(), attempt=0, resume_step=None))["args"]
    assert args[: len(USER_ARGS)] == USER_ARGS
    assert args[len(USER_ARGS) :] == [
        "base_output_directory=gs://acme-ckpt/runs/ml",  # <directory>/<namespace>: <run_name> = <name> follows
        "run_name=llama",
        "enable_checkpointing=true",
        "enable_continuous_checkpointing=true",
        "max_num_checkpoints_to_keep=3",
        "async_checkpointing=true",
        "enable_autocheckpoint=true",
    ]


def test_interval_policy_and_switches():
    checkpoint = {
        "directory": "gs://b-1/x",
        "policy": "interval",
        "intervalSteps": 50,
        "async": False,
        "saveOnPreemption": False,
        "keep": {"latest": 7},
    }
    args = _container(build_jobset(maxtext_job(checkpoint=checkpoint, args=None), attempt=0, resume_step=None))["args"]
    assert args == [
        "base_output_directory=gs://b-1/x/ml",
        "run_name=llama",
        "enable_checkpointing=true",
        "enable_continuous_checkpointing=false",
        "checkpoint_period=50",
        "max_num_checkpoints_to_keep=7",
        "async_checkpointing=false",
        "enable_autocheckpoint=false",
    ]


def test_run_directory_is_the_one_the_operator_reads():
    tj = maxtext_job(checkpoint={"directory": "gs://b-1/prefix/"})
    flags = dict(a.split("=", 1) for a in maxtext.maxtext_args(tj))
    assert f"{flags['base_output_directory']}/{flags['run_name']}" == tj.run_dir


def test_xpk_env_for_multi_host_start_up():
    tj = maxtext_job(slices=2)  # v5p 2x2x2: 2 hosts per slice
    name = jobset_name("llama", 2)
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(build_jobset(tj, 2, 10))["env"]}
    assert env["JAX_COORDINATOR_ADDRESS"] == coordinator_host(name)
    assert (env["JAX_PROCESS_COUNT"], env["PROCESSES_IN_JOB"]) == ("4", "2")
    assert env["JOB_INDEX"] == {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    # The contract's variables stay, so the operator's view (run dir, slices) is the same for both frameworks.
    assert env["TPUJOB_RUN_DIR"] == tj.run_dir and env["MEGASCALE_NUM_SLICES"] == "2"


def test_every_env_name_added_for_maxtext_is_reserved():
    plain = {e["name"] for e in _container(build_jobset(training_job(), 0, None))["env"]}
    added = {e["name"] for e in _container(build_jobset(maxtext_job(), 0, None))["env"]} - plain
    assert added and added <= set(admission.RESERVED_ENV)


def test_tpujob_framework_is_the_default_and_unchanged():
    tj = training_job(args=["checkpoint_period=5"], checkpoint={"directory": "gs://b-1/x", "minIntervalSeconds": 5})
    assert tj.spec.framework == "tpujob"
    container = _container(build_jobset(tj, 0, None))
    assert container["args"] == ["checkpoint_period=5"]
    assert "JAX_PROCESS_COUNT" not in {e["name"] for e in container["env"]}


REFUSED = [
    (
        "min interval",
        {"checkpoint": {"directory": "gs://b-1/x", "minIntervalSeconds": 30}},
        admission.MIN_INTERVAL_MESSAGE,
    ),
    (
        "keep every steps",
        {"checkpoint": {"directory": "gs://b-1/x", "keep": {"everySteps": 1000}}},
        admission.EVERY_STEPS_MESSAGE,
    ),
    ("adaptive", {"checkpoint": {"directory": "gs://b-1/x", "policy": "adaptive"}}, admission.ADAPTIVE_MESSAGE),
    ("checkpoint_period in args", {"args": ["steps=10", "checkpoint_period=5"]}, admission.ARGS_MESSAGE),
    ("base_output_directory in args", {"args": ["base_output_directory=gs://x/y"]}, admission.ARGS_MESSAGE),
    ("run_name in args", {"args": ["run_name=other"]}, admission.ARGS_MESSAGE),
    ("XPK variable in env", {"env": [{"name": "JAX_PROCESS_COUNT", "value": "9"}]}, admission.ENV_MESSAGE),
    ("MaxText env override", {"env": [{"name": "M_CHECKPOINT_PERIOD", "value": "9"}]}, admission.ENV_MESSAGE),
]


@pytest.mark.parametrize(("case", "spec", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_what_maxtext_cannot_honour_is_refused(case, spec, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        maxtext_job(**spec)
    training_job(**spec)  # the project's trainer honours all of it


def test_messages_name_the_field_and_the_reason():
    for _, _, message in REFUSED:
        assert message.startswith("spec.") and "framework maxtext: " in message


@pytest.mark.parametrize(
    "arg", ["steps=10", "checkpoint_periods=3", "my_run_name=x", "log_period=1", "enable_checkpointing_x=1"]
)
def test_other_args_are_left_to_the_user(arg):
    maxtext_job(args=[arg])


# --- progress from storage --------------------------------------------------------------------------

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_commit_time_is_read_from_orbax_metadata():
    raw = json.dumps({"init_timestamp_nsecs": 1, "commit_timestamp_nsecs": 1796064882912396033}).encode()
    assert maxtext.commit_time(raw) == datetime.fromtimestamp(1796064882.912396033, UTC)
    for broken in (b"", b"not json", b"[]", b'{"commit_timestamp_nsecs": null}', b'{"commit_timestamp_nsecs": "1"}'):
        assert maxtext.commit_time(broken) is None


def test_metrics_file_names():
    assert maxtext.metrics_last_step("r/metrics/metrics_step_000100_to_step_000199.txt") == 199
    assert maxtext.metrics_last_step("r/metrics/metrics_step_1000000_to_step_1000099.txt") == 1000099
    assert maxtext.metrics_last_step("r/metrics/other.txt") is None


def test_metrics_window_follows_log_period_and_the_latest_commit():
    assert maxtext.metrics_window(["steps=5"], 250) == (False, 200)
    assert maxtext.metrics_window(["gcs_metrics=true", "log_period=1"], 57) == (True, 57)
    assert maxtext.metrics_window(["gcs_metrics=true", "log_period=50", "log_period=20"], 57) == (True, 40)
    assert maxtext.metrics_window(["gcs_metrics=True", "log_period=x"], None) == (True, 0)


def test_commit_of_this_attempt_is_progress():
    commit = maxtext.Commit(step=120, committed_at=_at(30))
    progress = maxtext.progress(uid="u", attempt=1, attempt_started=_at(0), resume_step=100, latest=commit)
    assert progress is not None
    assert (progress.step, progress.attempt, progress.updated, progress.uid) == (120, 1, _at(30), "u")
    assert (progress.restored_step, progress.last_committed_step) == (100, 120)


def test_nothing_of_this_attempt_yet_is_no_progress():
    """The commit it restored was made by the previous attempt: this one has not trained a step yet."""
    old = maxtext.Commit(step=100, committed_at=_at(-5))
    stale_metrics = [maxtext.MetricsFile(last_step=107, written_at=_at(-4))]  # the steps the failure lost
    kwargs: dict[str, Any] = dict(uid="u", attempt=1, attempt_started=_at(0), resume_step=100)
    assert maxtext.progress(latest=old, metrics=stale_metrics, **kwargs) is None
    assert maxtext.progress(latest=None, **kwargs) is None
    assert maxtext.progress(latest=maxtext.Commit(100, None), **kwargs) is None


def test_metrics_files_report_steps_past_the_last_commit():
    commit = maxtext.Commit(step=120, committed_at=_at(30))
    files = [maxtext.MetricsFile(last_step=s, written_at=_at(20 + s - 115)) for s in range(115, 128)]
    progress = maxtext.progress(
        uid="u", attempt=1, attempt_started=_at(0), resume_step=100, latest=commit, metrics=files
    )
    assert progress is not None
    assert (progress.step, progress.updated, progress.last_committed_step) == (127, _at(32), 120)


def test_lost_steps_follow_from_the_reported_step():
    """What the reconciler computes at a failure: reported step - latest committed step."""
    commit = maxtext.Commit(step=120, committed_at=_at(30))
    files = [maxtext.MetricsFile(last_step=126, written_at=_at(31))]
    progress = maxtext.progress(
        uid="u", attempt=0, attempt_started=_at(0), resume_step=None, latest=commit, metrics=files
    )
    assert progress is not None and progress.step - commit.step == 6


def _jobset(attempt: int, uid: str = "0000-1111", deleting: bool = False) -> JobSetFacts:
    return JobSetFacts(
        name=f"llama-a{attempt}",
        attempt=attempt,
        resume_step=40,
        created=T0,
        state="Active",
        uid=uid,
        deleting=deleting,
    )


def test_current_jobset_is_this_incarnations_current_attempt():
    tj = maxtext_job(status={"attempt": 1})
    assert maxtext.current_jobset(tj, [_jobset(0), _jobset(1, uid="other"), _jobset(1, deleting=True)]) is None
    assert maxtext.current_jobset(tj, [_jobset(0), _jobset(1)]) == _jobset(1)


def test_example_is_a_valid_maxtext_job():
    """examples/maxtext.yaml, as the operator reads it (the e2e test runs the same model)."""
    manifest = yaml.safe_load((Path(__file__).parents[2] / "examples" / "maxtext.yaml").read_text())
    tj = api.TrainingJob.model_validate({**manifest, "metadata": {**manifest["metadata"], "uid": "u"}})
    assert tj.spec.framework == "maxtext" and tj.spec.image == "tpujob-maxtext:dev"
    args = _container(build_jobset(tj, 0, None))["args"]
    assert "dataset_type=synthetic" in args and "run_name=maxtext-tiny" in args


def test_devcluster_image_runs_the_venv_that_make_builds(monkeypatch):
    """devcluster/images.yaml's MaxText entry is the venv devcluster/maxtext_venv.sh links, by version."""
    from tpujob_devcluster.podrunner import container_argv, load_image_table

    root = Path(__file__).parents[2]
    [version] = re.findall(
        r'^MAXTEXT_VERSION="\$\{MAXTEXT_VERSION:-(.+)\}"$', (root / "devcluster/maxtext_venv.sh").read_text(), re.M
    )
    monkeypatch.setenv("TPUJOB_CACHE", "/cache")
    images = load_image_table(root / "devcluster" / "images.yaml")
    argv = container_argv({"image": "tpujob-maxtext:dev", "args": ["steps=5"]}, images, "/venv/python")
    assert argv == [f"/cache/maxtext/{version}/bin/python", "-m", "maxtext.trainers.pre_train.train", "steps=5"]
