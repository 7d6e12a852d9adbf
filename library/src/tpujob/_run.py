"""The public API: `tpujob.start()` and the `Run` it returns (docs/guides/own-loop.md).

The loop stays the caller's::

    run = tpujob.start()
    state = run.restore(state, data_iterator)
    for step in range(run.first_step, run.final_step):
        state, metrics = train_step(state, next(data_iterator))
        run.step_done(step + 1, state, data_iterator, loss=metrics["loss"])
        if run.should_stop(step + 1):
            break
    run.finish(state, data_iterator)

Steps are counted as Orbax and the operator count them: `step_done(n, ...)` is called with the
state after n updates, so a checkpoint listed as step n holds the state a restart continues from,
and `run.first_step` is that n. Every call is made by every process, in the same order.

A failure the contract names ends the process with its exit code (SystemExit), after the progress
record says so: 2 bad configuration or bad input (a state leaf that cannot be saved, a data iterator
without state), 3 storage unreachable at start, 4 no committed checkpoint fits this state, 5 storage
refused this job's identity, 6 JAX's distributed runtime did not start, 143 stopped by SIGTERM
(its step saved), 1 a final save that failed after its retries.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, NoReturn, TypeVar

import jax
import numpy as np
import tpujob_contract as contract
from jax.sharding import Mesh
from tpujob_contract import ExitCode

from tpujob import attempt, checkpointing, compile_cache, data, progress
from tpujob.checkpointing import CheckpointIncompatible, CheckpointManager, PreemptionNotice
from tpujob.config import ConfigError, RunConfig, env_int, require, run_config
from tpujob.local_tier import LocalTier

log = logging.getLogger("tpujob")
T = TypeVar("T")

# What a state leaf may be: Orbax's StandardSave writes these (arrays, numbers, strings).
SAVABLE = (jax.Array, np.ndarray, np.generic, int, float, str)


def start(*, steps: int | None = None, env: Mapping[str, str] | None = None) -> Run:
    """Begin this process's attempt: the first call, before any other JAX call.

    Reads the operator's TPUJOB_* environment (`env`, default os.environ); starts `jax.distributed`
    with its timeouts when there are several processes (process 0 first checks that no other process
    serves its coordinator address); installs the persistent compilation cache; probes the run
    directory's storage, waiting out an outage for TPUJOB_STORAGE_WAIT_SECONDS; opens the Orbax
    manager with the job's save policy, and the local tier. `steps` is the step to train to
    (`run.final_step`); default TPUJOB_STEPS (100). Exits 2, 3, 5 or 6 as the contract says.
    """
    started = contract.now_rfc3339()
    attempt.configure_logging()
    environ = os.environ if env is None else env
    try:
        cfg = run_config(environ)
        final = steps if steps is not None else env_int(environ, contract.STEPS_ENV, contract.DEFAULT_STEPS)
        require(final > 0, f"steps must be > 0, got {final}")
        return Run(cfg, final, started)
    except Exception as err:
        _exit_for(err)


def _exit_for(err: Exception) -> NoReturn:
    code = attempt.exit_code_of(err)
    if code is None:
        raise err
    raise SystemExit(int(code))


class Run:
    """One attempt of a protected training loop; made by `start()`."""

    def __init__(self, cfg: RunConfig, final_step: int, process_started_at: str):
        self.config = cfg
        self.final_step = final_step
        self.first_step = 0  # the step restore() continues from
        self._cache = compile_cache.install(
            cfg.compilation_cache_dir, cfg.storage_timeout_seconds, local_directory=cfg.local_compilation_cache_dir
        )
        self._notice = PreemptionNotice(attempt.init_distributed(cfg))
        self._status = progress.AttemptProgress(cfg.attempt, cfg.job_uid, process_started_at)
        self._mngr: CheckpointManager | None = None
        self._local: LocalTier | None = None
        self._writer: progress.ProgressWriter | None = None
        self._stopped_at: int | None = None
        self._last_publish = float("-inf")
        self._window = (time.monotonic(), 0)
        self._last_loss: Any = None  # the last step's loss (a device value), read once at the end
        self._mesh: Mesh = data.process_mesh()
        try:
            self._mngr = attempt.open_manager(cfg, self._notice, self._status)
            self._local = attempt.open_local(cfg) if self._mngr else None
        except checkpointing.StoragePermissionDenied as err:
            attempt.denied(cfg, err, self._status)
            raise
        if self._cache:
            self._cache.prefetch()
        if self._mngr and cfg.run_dir and jax.process_index() == 0:
            self._writer = attempt.progress_writer(cfg, self._mngr, self._status)
        self._hook = attempt.StepHook(cfg, self._notice, self._status, self._mngr, self._local, self._writer)

    @property
    def microbatches(self) -> int:
        """Gradient-accumulation steps per update for this attempt: 1 at the job's full size; on an
        elastic attempt with fewer slices (TPUJOB_FULL_SLICES / TPUJOB_NUM_SLICES), accumulate this
        many microbatches of the global batch so that each step is the full-size run's step."""
        return self.config.topology.microbatches

    # -- restore ---------------------------------------------------------------------------------

    def restore(self, state: T, data_iterator: Any = None) -> T:
        """The state to train from: the committed step TPUJOB_RESUME_STEP names (the newest committed
        step at or after a pin; the latest by default), from the local tier when every process holds
        it, else from GCS; damaged steps are quarantined (bytes kept) and older ones tried; transient
        errors retried. The restored arrays land on `state`'s own shardings (any mesh the caller
        built), so `state` is the caller's freshly initialised pytree (a dict, Flax NNX state from
        `nnx.state(...)`, optax state; any pytree of arrays). `data_iterator` (Grain's, or anything
        with get_state()/set_state()) is set to the position it had at that step. Nothing committed:
        `state` is returned as is, and `run.first_step` is 0.

        Exits 2 when a leaf cannot be saved or the iterator has no state (the leaf's path is named),
        4 when no committed step fits `state` (another model: the shapes are named), 5 when storage
        refuses this job's identity.
        """
        try:
            self._check_savable(state, data_iterator)
            fresh = self._payload(state, data_iterator, 0)
            abstract = jax.tree.map(_abstract_leaf, fresh)
            abstract["step"] = data.abstract_step(self._mesh)
            if data_iterator is not None:
                abstract["data"] = data.abstract_position(self._mesh, data_iterator)
            model = attempt.StateModel(abstract, lambda: fresh, lambda c: _held_step(fresh, c))
            try:
                restored = attempt.restore_or_init(self.config, model, self._mngr, self._status, self._local)
            except CheckpointIncompatible as err:
                log.error("resume: %s; nothing was deleted", err)
                self._status.update(state="incompatible")
                self._close()
                raise SystemExit(int(ExitCode.CHECKPOINT_INCOMPATIBLE)) from err
        except checkpointing.StoragePermissionDenied as err:
            self._end_denied(err)
        except ConfigError as err:
            self._close()
            _exit_for(err)
        self.first_step = self._status.step = self._status.record_so_far.restored_step or 0
        if data_iterator is not None and self.first_step:
            data.restore_position(data_iterator, restored["data"])
        out: T = restored["state"]
        return out

    def _check_savable(self, state: Any, data_iterator: Any) -> None:
        leaves, _ = jax.tree_util.tree_flatten_with_path(state)
        require(bool(leaves), "the state to protect has no leaves")
        for path, leaf in leaves:
            require(
                isinstance(leaf, SAVABLE),
                f"state leaf {jax.tree_util.keystr(path) or '(root)'} is a {type(leaf).__name__}, which a "
                "checkpoint cannot hold (want arrays, numbers or strings)",
            )
        if data_iterator is None:
            return
        require(
            isinstance(data_iterator, data.Checkpointable),
            f"the data iterator ({type(data_iterator).__name__}) has no get_state()/set_state(): its position "
            "could not be restored (use Grain's iterator, or pass data_iterator=None for data that is a "
            "function of the step)",
        )
        try:
            data.encode(data_iterator.get_state())
        except (TypeError, ValueError) as err:
            raise ConfigError(f"the data iterator's state cannot be saved: {err}") from None

    def _payload(self, state: Any, data_iterator: Any, step: int) -> dict[str, Any]:
        payload: dict[str, Any] = {"state": state, "step": data.step_array(self._mesh, step)}
        if data_iterator is not None:
            payload["data"] = data.position_array(self._mesh, data_iterator)
        return payload

    # -- the loop --------------------------------------------------------------------------------

    def step_done(self, step: int, state: Any, data_iterator: Any = None, **metrics: Any) -> None:
        """Tell the run that `step` updates are done and `state` is their result (and
        `data_iterator` is positioned for the next one). Call it after every update, on every
        process. Saves when the job's policy says so (continuous, interval or adaptive, from the
        operator's env; the local tier at its own interval), agrees with the other processes
        whether a SIGTERM stops training here (then saves this step: see should_stop), and
        publishes the progress record at most every TPUJOB_PROGRESS_INTERVAL_SECONDS with the
        metrics given (`loss=` is shown by the operator; values are read from the device only when
        published). Never blocks on the device otherwise, except to time steps for the adaptive
        policy or the local tier's budget.

        The per-step hook: what a later version watches per step (a hang's stacks, a straggler,
        silent corruption) is added here, without another call in the loop.
        """
        try:
            payload = self._payload(state, data_iterator, step) if self._mngr else None
            stopping = self._hook.after_step(step, payload, state)
            self._last_loss = metrics.get("loss", self._last_loss)
            if stopping:
                self._stopped_at = step
                return
            self._report(step, metrics)
            self._hook.next_step_begins()
        except checkpointing.StoragePermissionDenied as err:
            self._end_denied(err)

    def _report(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = time.monotonic()
        start, steps = self._window
        self._window = (start, steps + 1)
        if self._writer is None or now - self._last_publish < self.config.progress_interval_seconds:
            return
        fields: dict[str, Any] = {}
        if "loss" in metrics:
            fields["loss"] = float(np.asarray(jax.device_get(metrics["loss"])))
        now = time.monotonic()
        rate = (steps + 1) / max(now - start, 1e-9)
        self._status.update(steps_per_second=rate, **fields)
        self._window = (now, 0)
        committed = self._writer.last_committed_step
        if "loss" in fields:
            log.info("%s", progress.progress_line(step, self.final_step, fields["loss"], rate, committed))
        self._writer.publish(self._status.record("running"))
        self._last_publish = now

    def should_stop(self, step: int) -> bool:
        """Whether training stops after `step`: a SIGTERM (a preemption, a drain, the operator's
        stop) arrived and every process agreed to stop at this step, whose save step_done made
        (when save-on-preemption is on). Break out of the loop and call finish()."""
        return self._stopped_at == step

    def finish(self, state: Any, data_iterator: Any = None) -> None:
        """End the attempt. After the last step: save it (retried; every process), wait for its
        commit, publish the record `succeeded` and return. After a stop: publish `preempted` and
        exit 143 (SystemExit), as the operator expects of a stopped worker. A final save that failed
        after its retries exits 1."""
        if self._stopped_at is not None:
            self._status.update(state="preempted")
            self._close()
            raise SystemExit(int(ExitCode.PREEMPTED))
        try:
            mngr, step = self._mngr, self._status.step
            if mngr and not attempt.save_final(mngr, step, self._payload(state, data_iterator, step), self._status):
                log.error("the final step %d could not be checkpointed", step)
                self._close()
                raise SystemExit(int(ExitCode.FAILED))
        except checkpointing.StoragePermissionDenied as err:
            self._end_denied(err)
        self._status.update(state="succeeded")
        self._close()
        log.info("done: step %d", self._status.step)

    # -- ending ----------------------------------------------------------------------------------

    def _end_denied(self, err: checkpointing.StoragePermissionDenied) -> NoReturn:
        attempt.denied(self.config, err, self._status)
        self._close()
        raise SystemExit(int(ExitCode.STORAGE_PERMISSION_DENIED))

    def _close(self) -> None:
        if self._last_loss is not None:
            try:
                self._status.update(loss=float(np.asarray(jax.device_get(self._last_loss))))
            except Exception as err:  # a device that failed: the record still goes out
                log.warning("progress: the last loss could not be read (%s)", err)
            self._last_loss = None
        if self._local:
            attempt.close_local(self._local)
            self._local = None
        if self._mngr:
            attempt.close(self._mngr, self._writer)
            self._mngr = None
        if self._writer:
            self._writer.close(self._status.record())
            self._writer = None
        if self._cache:
            self._cache.flush(self.config.storage_timeout_seconds)
            self._cache = None
        sys.stderr.flush()


def _held_step(fresh: Any, restored: Any) -> int:
    """The step a restored checkpoint holds, once every leaf is seen to have the shape and dtype of
    the caller's own (Orbax checks arrays it places, not host arrays and numbers): a checkpoint of
    another model is a misfit (exit 4 when no step fits), never a silent re-initialisation."""
    want, _ = jax.tree_util.tree_flatten_with_path(fresh)
    got = jax.tree_util.tree_leaves(restored)
    for (path, mine), theirs in zip(want, got, strict=True):
        shapes = (np.shape(mine), _dtype(mine)), (np.shape(theirs), _dtype(theirs))
        if shapes[0] != shapes[1]:
            raise ValueError(
                f"leaf {jax.tree_util.keystr(path)}: {shapes[0][0]} {shapes[0][1]} is not compatible with the stored "
                f"shape {shapes[1][0]} {shapes[1][1]}"
            )
    return int(attempt.scalar(restored["step"]))


def _dtype(leaf: Any) -> np.dtype[Any]:
    dtype = getattr(leaf, "dtype", None)  # never np.asarray of an array that spans other processes
    return np.dtype(dtype) if dtype is not None else np.asarray(leaf).dtype


def _abstract_leaf(leaf: Any) -> Any:
    """The restore target of one leaf: its shape, dtype and sharding (numbers and strings as they are)."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)  # type: ignore[no-untyped-call]
    return leaf
