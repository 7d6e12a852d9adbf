"""Everything about checkpoints: Orbax policies from the contract, the manager, restore choice,
the start-up storage probe, and the commit rule the operator shares.
"""

from __future__ import annotations

import signal
import threading
import uuid
from collections.abc import Sequence
from types import FrameType
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as cm

from tpujob_trainer.config import CheckpointConfig, ConfigError

# Orbax 0.12.8's marker for a finalized step on gs:// (CommitFileTemporaryPath). On a local path
# the marker is the rename of `<step>.orbax-checkpoint-tmp` to `<step>` (AtomicRenameTemporaryPath).
COMMIT_MARKER = "commit_success.txt"
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class StorageError(RuntimeError):
    """The checkpoint storage is unreachable or unwritable (exit code 3)."""


def save_policy(cfg: CheckpointConfig) -> cm.SaveDecisionPolicy:
    """continuous -> ContinuousCheckpointingPolicy; interval -> FixedIntervalPolicy; OR preemption."""
    base: cm.SaveDecisionPolicy
    if cfg.policy == "continuous":
        # Orbax types the interval as int but only compares it with a timedelta; keep sub-second values.
        interval: Any = cfg.min_interval_seconds or None
        base = cm.ContinuousCheckpointingPolicy(minimum_interval_secs=interval)
    else:
        base = cm.FixedIntervalPolicy(cfg.interval_steps)
    policies: list[cm.SaveDecisionPolicy] = [base]
    if cfg.save_on_preemption:
        policies.append(cm.PreemptionCheckpointingPolicy())
    return cm.AnySavePolicy(policies)


def preservation_policy(cfg: CheckpointConfig) -> cm.PreservationPolicy:
    """Keep the latest N, plus (optionally) every step that is a multiple of keep_every_steps."""
    policies: list[cm.PreservationPolicy] = [cm.LatestN(n=cfg.keep_latest)]
    if cfg.keep_every_steps:
        policies.append(cm.EveryNSteps(interval_steps=cfg.keep_every_steps))
    return cm.AnyPreservationPolicy(policies)


def manager_options(cfg: CheckpointConfig) -> ocp.CheckpointManagerOptions:
    return ocp.CheckpointManagerOptions(
        save_decision_policy=save_policy(cfg),
        preservation_policy=preservation_policy(cfg),
        enable_async_checkpointing=cfg.async_save,
        # Partial step directories left by a killed attempt are never restored (Orbax lists only
        # finalized steps); removing them at start keeps the bucket tidy across many restarts.
        cleanup_tmp_directories=True,
    )


class PreemptionNotice:
    """Whether training has reached the step at which to stop for a SIGTERM.

    Multi-process: JAX's preemption service (started by jax.distributed.initialize) catches
    SIGTERM and agrees on one sync step across all processes, so every host saves the same step.
    Single process: no coordination service exists, so a Python SIGTERM handler sets a flag.
    """

    def __init__(self, distributed: bool):
        self._distributed = distributed
        self._flag = threading.Event()
        if not distributed:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._flag.set()

    def reached(self, step: int) -> bool:
        if self._distributed:
            try:
                reached: bool = multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # the preemption service is disabled (jax_enable_preemption_service)
                return False
            return reached
        return self._flag.is_set()


class CheckpointManager(ocp.CheckpointManager):  # type: ignore[misc]  # orbax ships no type hints
    """Orbax's manager, with preemption decided by PreemptionNotice (also for a single process)."""

    def __init__(self, directory: str, options: ocp.CheckpointManagerOptions, notice: PreemptionNotice):
        self._notice = notice
        super().__init__(directory, options=options)

    def reached_preemption(self, step: int) -> bool:
        reached = self._notice.reached(step)
        return reached


def choose_restore_step(committed: Sequence[int], resume_step: int) -> int | None:
    """resume_step >= 0: exactly that committed step; -1: the latest committed step, or None."""
    if resume_step >= 0:
        if resume_step not in committed:
            raise ConfigError(
                f"TPUJOB_RESUME_STEP={resume_step} is not a committed checkpoint; committed steps: {sorted(committed)}"
            )
        return resume_step
    return max(committed) if committed else None


def is_committed(checkpoint_dir: str, step: int) -> bool:
    """The operator's rule, from storage alone (see README.md, "Committed checkpoints")."""
    step_dir = epath.Path(checkpoint_dir) / str(step)
    if checkpoint_dir.startswith("gs://"):
        return bool((step_dir / COMMIT_MARKER).exists())
    return bool(step_dir.is_dir())


def _probe(run_dir: str, name: str) -> None:
    probe = epath.Path(run_dir) / ".tpujob-probe" / name
    payload = f"tpujob storage probe {name}"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text(payload)
    if probe.read_text() != payload:
        raise OSError(f"read back different content from {probe}")
    probe.unlink()


def probe_storage(run_dir: str, name: str, timeout_s: float) -> None:
    """Write, read back and delete a small object under run_dir, or raise StorageError within timeout_s.

    Runs in a daemon thread because GCS clients retry unreachable endpoints for minutes; the
    trainer must fail fast and clearly instead of hanging before its first step.
    """
    errors: list[BaseException] = []

    def target() -> None:
        try:
            _probe(run_dir, f"{name}-{uuid.uuid4().hex[:8]}")
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=target, name="tpujob-storage-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StorageError(f"checkpoint storage {run_dir} did not answer within {timeout_s:.0f}s (unreachable?)")
    if errors:
        err = errors[0]
        raise StorageError(f"checkpoint storage {run_dir} is not writable: {type(err).__name__}: {err}") from err
