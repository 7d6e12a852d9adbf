"""Pure pieces of the trainer: configuration, data, sharding rule, model/optimizer step, progress."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import tpujob_contract as contract
from etils import epath
from gcsfs.retry import HttpError
from jax.sharding import PartitionSpec
from tpujob import checkpointing, failures, progress
from tpujob.checkpointing import CheckpointIncompatible, StorageError
from tpujob.config import ConfigError, run_config, topology_from_env
from tpujob_contract import LATEST, QuarantinedStep, Resume
from tpujob_trainer import main
from tpujob_trainer.config import MODELS, Config, parse_config
from tpujob_trainer.data import batch_for_step
from tpujob_trainer.train import Trainer, make_mesh, partition_spec, resolve_dtype

RUN = {"TPUJOB_RUN_DIR": "gs://b/ns/job"}


def test_flags_beat_env_and_env_fills_in() -> None:
    cfg = parse_config(
        ["--steps", "7"], {**RUN, "TPUJOB_STEPS": "99", "TPUJOB_BATCH_SIZE": "16", "TPUJOB_MODEL": "small"}
    )
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.model.name) == (7, 16, "small")
    assert cfg.train.warmup_steps == 1 and cfg.run_dir == "gs://b/ns/job"
    assert cfg.checkpoint is not None and cfg.checkpoint.policy == "continuous" and cfg.checkpoint.async_save
    assert parse_config([], {}).checkpoint is None  # no run dir: no checkpointing


def test_checkpoint_env_contract() -> None:
    env = {
        **RUN,
        "TPUJOB_CHECKPOINT_POLICY": "interval",
        "TPUJOB_CHECKPOINT_INTERVAL_STEPS": "50",
        "TPUJOB_CHECKPOINT_MIN_INTERVAL_SECONDS": "1.5",
        "TPUJOB_CHECKPOINT_ASYNC": "false",
        "TPUJOB_CHECKPOINT_KEEP_LATEST": "4",
        "TPUJOB_CHECKPOINT_KEEP_EVERY_STEPS": "1000",
        "TPUJOB_CHECKPOINT_SAVE_ON_PREEMPTION": "false",
        "TPUJOB_RESUME_STEP": "300",
    }
    ckpt = parse_config([], env).checkpoint
    assert ckpt is not None
    assert (ckpt.policy, ckpt.interval_steps, ckpt.min_interval_seconds, ckpt.async_save) == (
        "interval",
        50,
        1.5,
        False,
    )
    assert (ckpt.keep_latest, ckpt.keep_every_steps, ckpt.save_on_preemption, ckpt.resume) == (
        4,
        1000,
        False,
        Resume.at(300),
    )


def test_adaptive_policy_env_contract() -> None:
    env = {
        **RUN,
        "TPUJOB_CHECKPOINT_POLICY": "adaptive",
        "TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT": "7.5",
        "TPUJOB_CHECKPOINT_MIN_INTERVAL_SECONDS": "10",
        "TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS": "600",
        "TPUJOB_MTBF_SECONDS": "86400",
    }
    ckpt = parse_config([], env).checkpoint
    assert ckpt is not None
    assert (ckpt.policy, ckpt.overhead_budget_percent, ckpt.min_interval_seconds) == ("adaptive", 7.5, 10.0)
    assert (ckpt.max_interval_seconds, ckpt.mtbf_seconds) == (600.0, 86400.0)
    # Absent or empty: 5%, no upper bound, no failure information (the budget bound alone).
    for empty in ({}, {"TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS": "", "TPUJOB_MTBF_SECONDS": " "}):
        ckpt = parse_config([], {**RUN, "TPUJOB_CHECKPOINT_POLICY": "adaptive", **empty}).checkpoint
        assert ckpt is not None
        assert (ckpt.overhead_budget_percent, ckpt.max_interval_seconds, ckpt.mtbf_seconds) == (5.0, None, None)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1)),
        (
            {
                "TPUJOB_NUM_SLICES": "2",
                "TPUJOB_HOSTS_PER_SLICE": "4",
                "TPUJOB_SLICE_ID": "1",
                "JOB_COMPLETION_INDEX": "3",
            },
            (7, 8),
        ),
        ({"TPUJOB_NUM_SLICES": "2", "TPUJOB_HOSTS_PER_SLICE": "1", "TPUJOB_SLICE_ID": "1"}, (1, 2)),
        ({"TPUJOB_PROCESS_ID": "2", "TPUJOB_NUM_PROCESSES": "3"}, (2, 3)),
    ],
)
def test_process_id_from_jobset_env(env: dict[str, str], expected: tuple[int, int]) -> None:
    env = {"TPUJOB_COORDINATOR_ADDRESS": "job-0-0.svc:8476", **env}
    topo = topology_from_env(env)
    assert (topo.process_id, topo.num_processes) == expected


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--model", "7b"], {}, "unknown model"),
        (["--steps", "0"], {}, "steps must be > 0"),
        (["--seq-len", "100000"], {}, "seq len"),
        (["--bogus"], {}, "unrecognized arguments"),
        ([], {**RUN, "TPUJOB_CHECKPOINT_ASYNC": "maybe"}, "not true/false"),
        ([], {**RUN, "TPUJOB_CHECKPOINT_MIN_INTERVAL_SECONDS": "-1"}, ">= 0"),
        ([], {**RUN, "TPUJOB_RESUME_STEP": "-2"}, "TPUJOB_RESUME_STEP"),
        ([], {"TPUJOB_NUM_SLICES": "2"}, "TPUJOB_COORDINATOR_ADDRESS is required"),
        ([], {"TPUJOB_SLICE_ID": "1"}, "TPUJOB_SLICE_ID=1 not in [0, 1)"),
        ([], {**RUN, "TPUJOB_CHECKPOINT_POLICY": "sometimes"}, "want continuous|interval|adaptive"),
        ([], {**RUN, "TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT": "0"}, "PERCENT=0 must be in (0, 100]"),
        ([], {**RUN, "TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT": "150"}, "PERCENT=150 must be in (0, 100]"),
        ([], {**RUN, "TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT": "five"}, "PERCENT='five' is not a number"),
        ([], {**RUN, "TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS": "0"}, "MAX_INTERVAL_SECONDS must be > 0"),
        (
            [],
            {**RUN, "TPUJOB_CHECKPOINT_MIN_INTERVAL_SECONDS": "60", "TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS": "30"},
            "TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS=30 is below TPUJOB_CHECKPOINT_MIN_INTERVAL_SECONDS=60",
        ),
        ([], {**RUN, "TPUJOB_MTBF_SECONDS": "-5"}, "TPUJOB_MTBF_SECONDS must be > 0"),
        ([], {**RUN, "TPUJOB_MTBF_SECONDS": "inf"}, "TPUJOB_MTBF_SECONDS='inf' is not finite"),
        (["--min-step-seconds", "-0.5"], {}, "min step seconds must be in [0, 60], got -0.5"),
        (["--min-step-seconds", "nan"], {}, "min step seconds must be in [0, 60], got nan"),
        ([], {"TPUJOB_MIN_STEP_SECONDS": "90"}, "min step seconds must be in [0, 60], got 90.0"),
    ],
)
def test_bad_configuration_is_refused(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_config(argv, env)


def test_model_sizes_span_tiny_to_about_1b() -> None:
    assert MODELS["tiny"].num_params() < 200_000
    assert 0.9e9 < MODELS["1b"].num_params() < 1.2e9


def test_data_is_a_pure_function_of_seed_and_step() -> None:
    a = batch_for_step(0, 5, 4, 16, 256)
    assert a.dtype == np.int32 and a.shape == (4, 16) and a.min() >= 0 and a.max() < 256
    np.testing.assert_array_equal(a, batch_for_step(0, 5, 4, 16, 256))
    assert not np.array_equal(a, batch_for_step(0, 6, 4, 16, 256))
    assert not np.array_equal(a, batch_for_step(1, 5, 4, 16, 256))
    stride = (a[:, 1] - a[:, 0]) % 256
    np.testing.assert_array_equal((a[:, 2] - a[:, 1]) % 256, stride)  # learnable: arithmetic progressions


@pytest.mark.parametrize(
    ("path", "shape", "fsdp", "expected"),
    [
        (("embed",), (256, 64), 4, PartitionSpec("fsdp", None)),
        (("layers", "wqkv"), (2, 64, 192), 4, PartitionSpec(None, None, "fsdp")),
        (("layers", "wqkv"), (8, 6, 6), 4, PartitionSpec()),  # never the stacked layer axis
        (("final_norm",), (64,), 1, PartitionSpec()),
        (("step",), (), 4, PartitionSpec()),
    ],
)
def test_partition_spec_rule(path: tuple[str, ...], shape: tuple[int, ...], fsdp: int, expected: PartitionSpec) -> None:
    keys = tuple(jax.tree_util.DictKey(k) for k in path)
    assert partition_spec(keys, shape, fsdp) == expected


def test_dtype_is_bf16_on_accelerators_only() -> None:
    assert resolve_dtype("auto", "tpu").name == "bfloat16" and resolve_dtype("auto", "gpu").name == "bfloat16"
    assert resolve_dtype("auto", "cpu").name == "float32" and resolve_dtype("bfloat16", "cpu").name == "bfloat16"


def test_train_step_learns_and_is_deterministic() -> None:
    cfg = parse_config(["--steps", "30", "--batch-size", "4", "--seq-len", "16", "--learning-rate", "1e-2"], {}).train
    trainer = Trainer(cfg, make_mesh(1))

    def losses() -> tuple[list[float], np.ndarray]:
        state, out = trainer.init(), []
        for step in range(cfg.steps):
            tokens = trainer.device_batch(batch_for_step(cfg.seed, step, 4, 16, cfg.model.vocab_size))
            state, loss = trainer.step(state, tokens)
            out.append(float(loss))
        assert int(state["step"]) == int(state["data_position"]) == cfg.steps
        return out, np.asarray(state["params"]["embed"])

    first, params = losses()
    again, params_again = losses()
    assert first == again and np.array_equal(params, params_again)
    assert np.mean(first[-5:]) < np.mean(first[:5]) - 0.5


def test_a_paced_loop_spends_at_least_min_step_seconds_on_each_step() -> None:
    """--min-step-seconds pads each step of the built-in loop (the e2e tier's jobs last long at little CPU)."""
    argv = ["--steps", "8", "--batch-size", "2", "--seq-len", "8"]
    unpaced, paced = parse_config(argv, {}), parse_config([*argv, "--min-step-seconds", "0.25"], {})
    assert (unpaced.train.min_step_seconds, paced.train.min_step_seconds) == (0.0, 0.25)
    assert parse_config(argv, {"TPUJOB_MIN_STEP_SECONDS": "0.1"}).train.min_step_seconds == 0.1
    trainer = Trainer(paced.train, make_mesh(1))
    handler = signal.getsignal(signal.SIGTERM)  # PreemptionNotice(False) installs its own in this process
    try:

        def train(cfg: Config) -> float:
            status = progress.AttemptProgress(0, "", contract.now_rfc3339())
            began = time.monotonic()
            notice = checkpointing.PreemptionNotice(distributed=False)
            stopped = main._train(cfg, main._batches(cfg.train), trainer, trainer.init(), None, notice, None, status)
            assert not stopped and status.step == cfg.train.steps
            return time.monotonic() - began

        train(unpaced)  # compiles: the paced run's time is its steps'
        assert train(paced) >= 8 * 0.25
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_progress_record_and_line() -> None:
    record = contract.ProgressRecord(
        step=12, loss=1.5, steps_per_second=3.0, last_committed_step=10, attempt=2,
        resumed_from_step=8, updated_at=contract.now_rfc3339(), state="running",
    )  # fmt: skip
    assert set(json.loads(contract.to_json(record))) == {
        "step", "loss", "steps_per_second", "last_committed_step", "attempt", "resumed_from_step", "updated_at",
        "state", "uid", "restored_step", "restored_from", "restore_failures", "quarantined", "storage_denied",
        "save_failures", "local_tier_problem", "process_started_at",
        "storage_ready_at", "restore_started_at", "restore_finished_at", "first_step_at", "save_blocking_seconds",
        "checkpoint_interval_seconds", "checkpoint_interval_bound", "save_cost_seconds",
        "checkpoint_overhead_percent", "mtbf_seconds", "blocked_in_save_at",
    }  # fmt: skip
    failed = contract.ProgressRecord(
        step=0, loss=None, steps_per_second=None, last_committed_step=None, attempt=1, resumed_from_step=None,
        updated_at=contract.now_rfc3339(), state="incompatible", uid="0b5e-uid",
        restore_failures=(contract.RestoreFailure(12, failures.short_error(ValueError("x" * 500))),), save_failures=2,
    )  # fmt: skip
    record_json = json.loads(contract.to_json(failed))
    assert (record_json["uid"], record_json["state"], record_json["save_failures"]) == ("0b5e-uid", "incompatible", 2)
    assert record_json["restore_failures"] == [{"step": 12, "error": "ValueError: " + "x" * 185 + "..."}]
    assert progress.progress_line(12, 100, 1.5, 3.0, None) == "step 12/100 loss 1.5000 steps/s 3.00 last_committed none"


def test_the_attempt_builds_the_contract_record_itself() -> None:
    status = progress.AttemptProgress(attempt=3, uid="0b5e-uid", process_started_at="2026-11-30T12:00:00.000000Z")
    assert status.record().state == "failed"  # until the attempt ends otherwise
    status.update(storage_ready_at="2026-11-30T12:00:02.000000Z")
    status.moved_to_quarantine(30, "gs://b/ns/job/quarantine/30")
    status.restored(20, (contract.RestoreFailure(30, "ValueError: broken"),))
    status.save_blocked(0.25)
    status.save_blocked(0.0004)
    status.save_failed()
    status.step = 25
    record = status.record("running")
    assert (record.step, record.attempt, record.uid, record.state) == (25, 3, "0b5e-uid", "running")
    assert (record.restored_step, record.resumed_from_step, record.save_failures) == (20, 20, 1)
    assert record.quarantined == (contract.QuarantinedStep(30, "gs://b/ns/job/quarantine/30"),)
    assert record.save_blocking_seconds == 0.25 and record.storage_ready_at == "2026-11-30T12:00:02.000000Z"
    assert contract.from_json(contract.to_json(record)) == record  # what the operator reads back
    with pytest.raises(TypeError):
        status.update(no_such_field=1)  # a field the contract does not declare is refused


def test_progress_writer_overwrites_atomically_and_checks_commit(tmp_path: Path) -> None:
    writer = progress.ProgressWriter(str(tmp_path), committed=lambda step: step == 10)
    base = dict(loss=1.0, steps_per_second=1.0, last_committed_step=None, attempt=0, resumed_from_step=None)
    writer.saved(10)
    writer.publish(contract.ProgressRecord(step=11, updated_at=contract.now_rfc3339(), state="running", **base))  # type: ignore[arg-type]
    writer.saved(12)  # not committed: must not be reported
    writer.close(contract.ProgressRecord(step=12, updated_at=contract.now_rfc3339(), state="succeeded", **base))  # type: ignore[arg-type]
    record = json.loads((tmp_path / "progress.json").read_text())
    assert (record["step"], record["state"], record["last_committed_step"]) == (12, "succeeded", 10)
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]  # no temp file left behind
    progress.write_atomically(epath.Path(tmp_path) / "progress.json", "{}")
    assert (tmp_path / "progress.json").read_text() == "{}"


def test_a_save_blocking_the_loop_keeps_the_record_fresh_for_at_most_the_hang_timeout(tmp_path: Path) -> None:
    """The operator's hang clock reads the record's silence: a save longer than the hang timeout (the
    final one, waiting for the save in flight first, on a loaded machine) was charged as a Hang."""
    limit = 1.0
    status = progress.AttemptProgress(attempt=0, uid="0b5e-uid", process_started_at=contract.now_rfc3339())
    status.step = 7
    keep = progress.KeepFresh(status, interval_seconds=0.1, limit_seconds=limit)
    writer = progress.ProgressWriter(str(tmp_path), committed=lambda step: False, keep_fresh=keep)
    path = tmp_path / "progress.json"

    def written() -> contract.ProgressRecord | None:
        return contract.from_json(path.read_bytes()) if path.exists() else None

    time.sleep(0.5)
    assert written() is None  # training: the loop alone publishes
    with status.blocked_in_save():
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while len(seen) < 3 and time.monotonic() < deadline:
            if (record := written()) is not None:
                seen.add(record.updated_at)
            time.sleep(0.05)
        assert len(seen) >= 3, seen  # rewritten, each time with the time of the moment
        record = written()
        assert record is not None and (record.step, record.state) == (7, "running")
        blocked_at = contract.parse_time(record.blocked_in_save_at)
        assert blocked_at is not None
        while (status.blocked_seconds() or 0) < limit + 1.5:
            time.sleep(0.1)
        # Past the limit the record is left silent: a save that never ends is still a hang.
        last = written()
        assert last is not None and (last.updated - blocked_at).total_seconds() <= limit + 1.0, last
    assert status.record().blocked_in_save_at is None
    writer.close(status.record("running"))


def test_the_storage_watchdog_gives_up_only_when_storage_fails_its_tries(tmp_path: Path) -> None:
    """A silent record (no write for many ticks) is a hang of the training itself while storage passes
    the watchdog's probes: nothing happens, and the operator's hang clock counts it. When the probes
    fail too, the action runs, with the seconds storage has been failing."""
    fired: list[float] = []
    answers = [True]

    def probe() -> None:
        if not answers[0]:
            raise OSError("storage unreachable (test probe)")

    give_up = progress.GiveUp(0.4, probe, fired.append)
    writer = progress.ProgressWriter(str(tmp_path), committed=lambda step: False, give_up=give_up)
    for _ in range(30):  # 30 ticks of silence with storage answering
        time.sleep(0.1)
    assert fired == [] and writer.failing_seconds() == 0.0
    answers[0] = False
    deadline = time.monotonic() + 60  # a wait for the event, not a speed limit
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(fired) == 1 and fired[0] > 0.4, fired


def test_the_record_may_stay_unwritten_for_the_storage_wait_and_by_default_at_most_half_the_hang_timeout() -> None:
    base = {"TPUJOB_RUN_DIR": "gs://b/ns/j"}
    hang = contract.Env.HANG_TIMEOUT_SECONDS
    assert run_config(base).record_unwritable_limit_seconds == 600
    assert run_config({**base, hang: "1800"}).record_unwritable_limit_seconds == 600
    assert run_config({**base, hang: "300"}).record_unwritable_limit_seconds == 150
    assert run_config({**base, hang: "0"}).record_unwritable_limit_seconds == 600
    assert (run_config({**base, hang: "300"}).hang_timeout_seconds, run_config(base).hang_timeout_seconds) == (300, 0)
    # The job's own storage wait (spec.env) is its choice, even past the hang clock.
    assert run_config({**base, hang: "30", "TPUJOB_STORAGE_WAIT_SECONDS": "300"}).record_unwritable_limit_seconds == 300


def test_identity_and_storage_wait_from_env() -> None:
    cfg = parse_config([], {**RUN, "TPUJOB_UID": " 6f1c-uid ", "TPUJOB_STORAGE_WAIT_SECONDS": "45"})
    assert (cfg.job_uid, cfg.storage_wait_seconds, cfg.storage_timeout_seconds) == ("6f1c-uid", 45.0, 30.0)
    defaults = parse_config([], RUN)
    assert (defaults.job_uid, defaults.storage_wait_seconds) == ("", 600.0)
    with pytest.raises(ConfigError, match="TPUJOB_STORAGE_WAIT_SECONDS must be >= 0"):
        parse_config([], {**RUN, "TPUJOB_STORAGE_WAIT_SECONDS": "-1"})


def test_storage_wait_backs_off_then_gives_up(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    with pytest.raises(StorageError, match="gave up after 9 probes in 100s"):
        checkpointing.wait_for_storage(str(blocker / "run"), "p0", 5.0, 100.0, sleep=sleep, clock=lambda: now[0])
    assert sleeps == [1, 2, 4, 8, 16, 30, 30, 9]  # doubling from 1 s, capped at 30 s, ending at the budget
    checkpointing.wait_for_storage(str(tmp_path / "run"), "p0", 5.0, 100.0, sleep=sleep)  # works: no wait


def test_restore_falls_back_to_older_steps_only_for_damage() -> None:
    assert checkpointing.restore_candidates([3, 9, 6], LATEST) == [9, 6, 3]
    assert checkpointing.restore_candidates([3, 9, 6], Resume.at(6)) == [9, 6, 3]  # the newest at or after 6
    assert checkpointing.restore_candidates([], LATEST) == []
    tried: list[int] = []
    moved: list[int] = []
    outage = [True]  # the first try of step 9 meets a storage outage; the retry finds it damaged
    slept: list[float] = []

    def restore(step: int) -> str:
        tried.append(step)
        if step == 3:
            return "state 3"
        if step == 6:
            raise ValueError("Requested shape: (8,) is not compatible with the stored shape: (4,).")
        raise FileNotFoundError(f"b/bucket/o/run%2Fcheckpoints%2F{step}%2F_METADATA")

    def storage_ok() -> bool:
        return not outage[0]

    def wait() -> None:
        outage[0] = False

    def quarantine(step: int) -> str:
        moved.append(step)
        return f"gs://b/run/quarantine/{step}"

    def read_back(step: int, error: BaseException) -> checkpointing.StepFiles:  # the data confirms it
        return checkpointing.StepFiles(damage=f"_METADATA is missing ({failures.short_error(error)})")

    got = checkpointing.restore_with_fallback(
        restore, [9, 6, 3], storage_ok, wait, quarantine, read_back, sleep=slept.append
    )
    assert (got.state, got.step, tried, slept) == ("state 3", 3, [9, 9, 6, 3], [])
    assert [f.step for f in got.failures] == [9, 6] and "_METADATA is missing" in got.failures[0].error
    # the damaged step and the misfit, once an older step restored (training goes on from there)
    assert moved == [9, 6]
    assert got.quarantined == [
        QuarantinedStep(9, "gs://b/run/quarantine/9"),
        QuarantinedStep(6, "gs://b/run/quarantine/6"),
    ]

    moved.clear()
    with pytest.raises(CheckpointIncompatible) as err:
        checkpointing.restore_with_fallback(restore, [6], lambda: True, wait, quarantine, read_back)
    assert [f.step for f in err.value.failures] == [6] and moved == []  # a misfit alone: left where it is
    with pytest.raises(StorageError):
        checkpointing.restore_with_fallback(restore, [9], lambda: False, lambda: None, quarantine, read_back)


def _unread(step: int, error: BaseException) -> checkpointing.StepFiles:
    raise AssertionError(f"step {step}'s files read back for {error!r}, which does not blame the data")


def test_one_misread_error_sets_no_step_aside(tmp_path: Path) -> None:
    """Errors that look like damage but are not the data's (a local file, XLA's INVALID_ARGUMENT, a step
    an older attempt's keep removed) condemn nothing: read back, the step's own files contradict them."""
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (3, 6, 9):
        (checkpoints / str(step) / "default").mkdir(parents=True)
        (checkpoints / str(step) / "_CHECKPOINT_METADATA").write_text(json.dumps({"step": step}))
        (checkpoints / str(step) / "default" / "manifest.ocdbt").write_bytes(b"\x00" * 64)

    def read_back(step: int, error: BaseException) -> checkpointing.StepFiles:
        return checkpointing.StepFiles.read_back(str(checkpoints / str(step)), error)

    moved: list[int] = []
    slept: list[float] = []

    def quarantine(step: int) -> str:
        moved.append(step)
        return f"quarantine/{step}"

    def misread(step: int) -> str:
        raise FileNotFoundError(2, "No such file or directory", "/tmp/jax-compilation-cache/xla_abc")

    with pytest.raises(FileNotFoundError):  # retried as transient, then exit 1: every step kept
        checkpointing.restore_with_fallback(
            misread, [9, 6, 3], lambda: True, lambda: None, quarantine, read_back, sleep=slept.append
        )
    assert moved == [] and len(slept) == checkpointing.RESTORE_RETRIES

    def xla(step: int) -> str:
        raise ValueError("INVALID_ARGUMENT: Executable expected parameter 0 of size 8 but got 16")

    with pytest.raises(ValueError):
        checkpointing.restore_with_fallback(
            xla, [9], lambda: True, lambda: None, quarantine, read_back, sleep=slept.append
        )
    assert moved == []

    # The same cause on every step never sets them all aside: none restored, all stay (exit 4).
    (checkpoints / "9" / "_CHECKPOINT_METADATA").write_text("{not json")
    (checkpoints / "6" / "_CHECKPOINT_METADATA").write_text("{not json")
    (checkpoints / "3" / "_CHECKPOINT_METADATA").write_text("{not json")

    def broken(step: int) -> str:
        raise ValueError(f"INVALID_ARGUMENT: Error parsing {checkpoints}/{step}/_CHECKPOINT_METADATA")

    with pytest.raises(CheckpointIncompatible) as err:
        checkpointing.restore_with_fallback(broken, [9, 6, 3], lambda: True, lambda: None, quarantine, read_back)
    assert [f.step for f in err.value.failures] == [9, 6, 3] and moved == []
    assert "_CHECKPOINT_METADATA" in err.value.failures[0].error

    # A step an older attempt's keep removed is passed over, nothing to set aside; a damaged one, read
    # back, is set aside once an older step restored.
    for path in sorted((checkpoints / "9").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (checkpoints / "3" / "_CHECKPOINT_METADATA").write_text('{"step": 3}')

    def gone_or_broken(step: int) -> str:
        if step == 3:
            return "state 3"
        raise FileNotFoundError(f"b/bucket/o/run%2Fcheckpoints%2F{step}%2F_CHECKPOINT_METADATA")

    got = checkpointing.restore_with_fallback(
        gone_or_broken, [9, 6, 3], lambda: True, lambda: None, quarantine, read_back
    )
    assert got.step == 3 and [f.step for f in got.failures] == [9, 6] and got.failures[0].error.startswith("gone")
    assert moved == [6]


def test_transient_restore_errors_are_retried_never_a_fallback() -> None:
    errors: list[BaseException] = [
        HttpError({"code": 503, "message": "backendError"}),
        MemoryError(),
        ValueError("DEADLINE_EXCEEDED: Barrier timed out"),
    ]
    slept: list[float] = []

    def restore(step: int) -> str:
        if errors:
            raise errors.pop(0)
        return f"state {step}"

    def quarantine(step: int) -> str:
        raise AssertionError(f"step {step} quarantined")

    got = checkpointing.restore_with_fallback(
        restore, [9, 6], lambda: True, lambda: None, quarantine, _unread, sleep=slept.append
    )
    assert (got.step, got.failures, slept) == (9, [], [1, 2, 4])

    def always(step: int) -> str:
        raise MemoryError()

    with pytest.raises(MemoryError):  # bounded: then the attempt fails (exit 1), the step kept
        checkpointing.restore_with_fallback(
            always, [9, 6], lambda: True, lambda: None, quarantine, _unread, sleep=slept.append
        )

    def forbidden(step: int) -> str:
        raise OSError("Forbidden: b/bucket/o")

    with pytest.raises(checkpointing.StoragePermissionDenied):
        checkpointing.restore_with_fallback(forbidden, [9], lambda: True, lambda: None, quarantine, _unread)


def test_a_step_moved_aside_keeps_its_bytes_and_a_taken_name_gets_a_suffix(tmp_path: Path) -> None:
    checkpoints, aside = tmp_path / "run" / "checkpoints", tmp_path / "run" / contract.QUARANTINE_DIR
    for attempt in range(2):
        (checkpoints / "5" / "default").mkdir(parents=True)
        (checkpoints / "5" / "default" / "array").write_bytes(b"bytes of attempt %d" % attempt)
        where = checkpointing.move_step(str(checkpoints), str(aside), 5, timeout_s=10)
        assert where == str(aside / ("5" if attempt == 0 else "5.1"))
        assert (Path(where) / "default" / "array").read_bytes() == b"bytes of attempt %d" % attempt
        assert not (checkpoints / "5").exists()
