"""Entry point: `tpujob-train` / `python -m tpujob_trainer`. See README.md for the contract.

Exit codes (the operator classifies failures by them):
  0    all steps done and the final step committed;
  143  stopped by SIGTERM (after saving the current step when save-on-preemption is on);
  3    checkpoint storage unreachable or unwritable at start, after waiting TPUJOB_STORAGE_WAIT_SECONDS;
  4    no committed checkpoint could be restored (another --model, or all damaged); nothing deleted;
  5    checkpoint storage refused this job's identity (401/403: probe, restore or save);
  6    JAX's distributed runtime could not start (the coordinator address is another process's);
  2    bad configuration;
  1    anything else (including a final save that still failed after its retries).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
import tpujob_contract as contract
from tpujob import attempt, compile_cache, progress
from tpujob.checkpointing import CheckpointIncompatible, CheckpointManager, PreemptionNotice, StoragePermissionDenied
from tpujob.local_tier import LocalTier
from tpujob.progress import AttemptProgress
from tpujob_contract import ExitCode

from tpujob_trainer.config import Config, TrainConfig, parse_config
from tpujob_trainer.data import batch_for_step
from tpujob_trainer.train import State, Trainer, make_mesh

log = logging.getLogger("tpujob_trainer")


def _state_model(trainer: Trainer) -> attempt.StateModel[State]:
    """The built-in state ({params, opt_state, step, data_position}) as the library restores it."""
    return attempt.StateModel(trainer.abstract_state, trainer.init, lambda state: int(attempt.scalar(state["step"])))


def _batches(tc: TrainConfig) -> Callable[[int], np.ndarray]:
    """step -> the global batch of that step: the corpus's with --data, else synthetic."""
    if tc.data:
        from tpujob_trainer import corpus  # imports Grain: only real-data runs pay its start-up cost

        return corpus.batches(tc)
    return lambda step: batch_for_step(tc.seed, step, tc.batch_size, tc.seq_len, tc.model.vocab_size)


def _train(
    cfg: Config,
    batch_of_step: Callable[[int], np.ndarray],
    trainer: Trainer,
    state: State,
    mngr: CheckpointManager | None,
    notice: PreemptionNotice,
    writer: progress.ProgressWriter | None,
    status: AttemptProgress,
    local: LocalTier | None = None,
) -> bool:
    """Train from status.step to the last step; returns True if stopped by SIGTERM."""
    tc = cfg.train
    hook = attempt.StepHook(cfg, notice, status, mngr, local, writer)
    window_start, window_steps, last_publish = time.monotonic(), 0, float("-inf")
    for step in range(status.step + 1, tc.steps + 1):
        step_began = time.monotonic()
        # The update producing `step` consumes batch step-1: data position == step.
        batch = trainer.device_batch(batch_of_step(step - 1))
        state, loss = trainer.step(state, batch)
        window_steps += 1
        if hook.after_step(step, state, loss):
            return True
        now = time.monotonic()
        due_log = step % tc.log_every == 0 or step == tc.steps
        due_publish = writer is not None and now - last_publish >= cfg.progress_interval_seconds
        if due_log or due_publish:
            loss_now = attempt.scalar(loss)  # waits for the step: the rate below is real
            now = time.monotonic()
            rate = window_steps / max(now - window_start, 1e-9)
            status.update(loss=loss_now, steps_per_second=rate)
            window_start, window_steps = now, 0
            if due_log and jax.process_index() == 0:
                committed = writer.last_committed_step if writer else None
                print(progress.progress_line(step, tc.steps, loss_now, rate, committed), flush=True)
            if writer is not None and due_publish:
                writer.publish(status.record("running"))
                last_publish = now
        hook.next_step_begins()  # before the pad: a padded step is timed as the longer step it stands for
        if tc.min_step_seconds:
            time.sleep(max(0.0, step_began + tc.min_step_seconds - time.monotonic()))
    if mngr and not attempt.save_final(mngr, status.step, state, status):  # the final model, always
        raise RuntimeError(f"the final step {status.step} could not be checkpointed")
    return False


def run(cfg: Config, process_started_at: str | None = None) -> ExitCode:
    batch_of_step = _batches(cfg.train)  # a bad --data exits 2 here, before any peer or storage waits on it
    cache = compile_cache.install(
        cfg.compilation_cache_dir, cfg.storage_timeout_seconds, local_directory=cfg.local_compilation_cache_dir
    )  # before any compile
    distributed = attempt.init_distributed(cfg)
    notice = PreemptionNotice(distributed)
    tc = cfg.train
    who = f"{cfg.job_namespace}/{cfg.job_name}" if cfg.job_name else "local run"
    log.info(
        "%s attempt %d: process %d/%d, %d devices (%s), model %s (%.1fM params), steps %d, batch %d x %d",
        who, cfg.attempt, jax.process_index(), jax.process_count(), jax.device_count(), jax.devices()[0].platform,
        tc.model.name, tc.model.num_params() / 1e6, tc.steps, tc.batch_size, tc.seq_len,
    )  # fmt: skip
    status = AttemptProgress(cfg.attempt, cfg.job_uid, process_started_at or contract.now_rfc3339())
    try:
        mngr = attempt.open_manager(cfg, notice, status)
        local = attempt.open_local(cfg) if mngr else None
    except StoragePermissionDenied as err:
        attempt.denied(cfg, err, status)  # no record: storage refuses it too
        return ExitCode.STORAGE_PERMISSION_DENIED
    if cache:
        cache.prefetch()  # list the cache while the restore runs; storage has answered its probe by now
    writer = None
    if mngr and cfg.run_dir and jax.process_index() == 0:
        writer = attempt.progress_writer(cfg, mngr, status)
    try:
        topo = cfg.topology
        if topo.microbatches > 1:
            log.info("elastic: %d of %d slices, %d microbatches per step (the full-size run's batch and schedule)",
                     topo.num_slices, topo.full_slices, topo.microbatches)  # fmt: skip
        trainer = Trainer(tc, make_mesh(topo.num_slices), topo.microbatches)
        try:
            state = attempt.restore_or_init(cfg, _state_model(trainer), mngr, status, local)
        except CheckpointIncompatible as err:
            log.error("resume: %s; nothing was deleted", err)
            status.update(state="incompatible")
            return ExitCode.CHECKPOINT_INCOMPATIBLE
        status.step = status.record_so_far.restored_step or 0
        preempted = _train(cfg, batch_of_step, trainer, state, mngr, notice, writer, status, local)
        status.update(state="preempted" if preempted else "succeeded")
    except StoragePermissionDenied as err:
        attempt.denied(cfg, err, status)  # the record below says so, if storage still takes it
        return ExitCode.STORAGE_PERMISSION_DENIED
    finally:
        if local:
            attempt.close_local(local)
        if mngr:
            attempt.close(mngr, writer)
        if writer:
            writer.close(status.record())
        if cache:
            cache.flush(cfg.storage_timeout_seconds)
            log.info("compile cache: %s", cache.summary())
    if preempted:
        return ExitCode.PREEMPTED
    log.info("done: step %d", status.step)
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    started = contract.now_rfc3339()  # before the imports' and JAX's start-up cost is paid below
    attempt.configure_logging("tpujob_trainer", tag="tpujob_trainer")
    try:
        cfg = parse_config(sys.argv[1:] if argv is None else argv, os.environ)
        return run(cfg, started)
    except Exception as err:
        if (code := attempt.exit_code_of(err)) is not None:
            return code
        log.exception("training failed")
        return ExitCode.FAILED
