"""Everything about checkpoints: Orbax policies from the contract, the manager, restore choice,
the start-up storage probe, and the commit rule the operator shares.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as cm
from tpujob_contract import COMMIT_MARKER, RestoreFailure, Resume

from tpujob_trainer.bounded import StorageTimeout, bounded
from tpujob_trainer.cadence import Cadence, Interval, changed_materially
from tpujob_trainer.config import CheckpointConfig, ConfigError
from tpujob_trainer.progress import short_error

log = logging.getLogger("tpujob_trainer")

# Orbax 0.12.8's marker for a finalized step on gs:// (CommitFileTemporaryPath). On a local path
# the marker is the rename of `<step>.orbax-checkpoint-tmp` to `<step>` (AtomicRenameTemporaryPath).
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class StorageError(RuntimeError):
    """The checkpoint storage is unreachable or unwritable (exit code 3)."""


class CheckpointIncompatible(RuntimeError):
    """No committed step could be restored (exit code 4): the checkpoints do not fit this trainer
    (another --model, say) or are all damaged. Nothing was deleted."""

    def __init__(self, failures: Sequence[RestoreFailure]):
        self.failures = tuple(failures)
        tried = ", ".join(f"{f.step} ({f.error})" for f in self.failures)
        super().__init__(f"no committed checkpoint could be restored; tried {tried}")


# Orbax's continuous policy compares its minimum interval with a timedelta, which takes no infinity:
# "hold every save" is this many seconds (31 years).
HOLD_SECONDS = 10**9


@dataclasses.dataclass(frozen=True)
class _AttemptStart:
    """Stands in for the previous checkpoint when nothing is committed (cm.PolicyCheckpointInfo)."""

    step: int
    time: datetime
    metrics: dict[str, Any] | None = None


@dataclasses.dataclass(kw_only=True)
class AdaptivePolicy(cm.ContinuousCheckpointingPolicy):  # type: ignore[misc]  # orbax ships no type hints
    """Orbax's continuous policy, with a minimum interval that AdaptiveCadence moves as it measures.

    Orbax decides on the primary host (process 0) and broadcasts the decision, so process 0's
    interval is the one in force. It starts held (no save before a baseline step time exists).
    With nothing committed yet the interval counts from the attempt's start instead of allowing a
    save at once (Orbax's rule): step 0 needs no checkpoint to be recovered.
    """

    minimum_interval_secs: Any = HOLD_SECONDS
    started: datetime = dataclasses.field(default_factory=lambda: datetime.now(UTC))

    def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
        previous = previous_steps or [_AttemptStart(0, self.started)]
        return bool(super().should_save(step, previous, context=context))


def save_policy(cfg: CheckpointConfig) -> cm.SaveDecisionPolicy:
    """continuous -> ContinuousCheckpointingPolicy; interval -> FixedIntervalPolicy;
    adaptive -> AdaptivePolicy; OR preemption."""
    base: cm.SaveDecisionPolicy
    if cfg.policy == "continuous":
        # Orbax types the interval as int but only compares it with a timedelta; keep sub-second values.
        interval: Any = cfg.min_interval_seconds or None
        base = cm.ContinuousCheckpointingPolicy(minimum_interval_secs=interval)
    elif cfg.policy == "adaptive":
        base = AdaptivePolicy()
    else:
        base = cm.FixedIntervalPolicy(cfg.interval_steps)
    policies: list[cm.SaveDecisionPolicy] = [base]
    if cfg.save_on_preemption:
        policies.append(cm.PreemptionCheckpointingPolicy())
    return cm.AnySavePolicy(policies)


def adaptive_policy(options: ocp.CheckpointManagerOptions) -> AdaptivePolicy | None:
    """The AdaptivePolicy inside the options' save decision policy, if any (the one to drive)."""
    decision = options.save_decision_policy
    found = [p for p in getattr(decision, "policies", [decision]) if isinstance(p, AdaptivePolicy)]
    return found[0] if found else None


class AdaptiveCadence:
    """Feeds the trainer's measurements to a Cadence and its interval to the AdaptivePolicy.

    The loop calls step() after every timed step and saved() after every save it started.
    """

    def __init__(self, cfg: CheckpointConfig, policy: AdaptivePolicy, announce: bool = True):
        self.cadence = Cadence(
            budget=cfg.overhead_budget_percent / 100,
            mtbf_s=cfg.mtbf_seconds,
            min_s=cfg.min_interval_seconds,
            max_s=cfg.max_interval_seconds,
        )
        self._policy = policy
        self._announce = announce  # log interval changes (process 0)
        self._blocking_s = 0.0
        self.in_force: Interval | None = None

    def saved(self, blocking_s: float) -> None:
        self.cadence.meter.saved(blocking_s)
        self._blocking_s = blocking_s

    def step(self, seconds: float, saving: bool) -> None:
        meter = self.cadence.meter
        extra_before = meter.extra_s
        meter.step(seconds, saving)
        if meter.extra_s != extra_before:
            log.debug("checkpoint cadence: a save settled, cost %.3fs (baseline step %.4fs)",
                      meter.extra_s - extra_before, meter.baseline_s or 0.0)  # fmt: skip
        due = self.cadence.due_after_s()
        # Orbax counts from the end of the previous save's blocking part, the cadence from its start.
        self._policy.minimum_interval_secs = HOLD_SECONDS if due is None else max(0.0, due - self._blocking_s)
        chosen = self.cadence.interval()
        if self._announce and chosen is not None and changed_materially(self.in_force, chosen):
            log.info(
                "checkpoint cadence: every %.2fs (%s bound; save cost %.3fs, overhead so far %.1f%%, MTBF %s)",
                chosen.seconds, chosen.bound, meter.cost_s, 100 * (meter.overhead or 0.0),
                "none" if self.cadence.mtbf_s is None else f"{self.cadence.mtbf_s:.0f}s",
            )  # fmt: skip
        self.in_force = chosen

    def record_fields(self) -> dict[str, Any]:
        """The progress record's adaptive fields (the interval and cost stay None until a save is priced)."""
        meter = self.cadence.meter
        cost, overhead = meter.cost_s, meter.overhead
        return {
            "checkpoint_interval_seconds": None if self.in_force is None else round(self.in_force.seconds, 3),
            "checkpoint_interval_bound": None if self.in_force is None else self.in_force.bound,
            "save_cost_seconds": None if cost is None else round(cost, 4),
            "checkpoint_overhead_percent": None if overhead is None else round(100 * overhead, 3),
            "mtbf_seconds": self.cadence.mtbf_s,
        }


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
    """Orbax's manager, with preemption decided by PreemptionNotice (also for a single process),
    and a save that can fail without wedging the continuous policy."""

    def __init__(self, directory: str, options: ocp.CheckpointManagerOptions, notice: PreemptionNotice):
        self._notice = notice
        super().__init__(directory, options=options)

    def reached_preemption(self, step: int) -> bool:
        reached = self._notice.reached(step)
        return reached

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        try:
            return bool(super().save(step, *args, **kwargs))
        except BaseException:
            # Orbax 0.12.8 marks "save in progress" before the blocking part of a save and clears it
            # only in the finalize thread; if the blocking part raises, no thread ever clears it and
            # ContinuousCheckpointingPolicy would never save again.
            if not self._finalize_thread.map(lambda t: t is not None and t.is_alive()):
                self._save_progress_tracker.set(False)
            raise


def restore_candidates(committed: Sequence[int], resume: Resume) -> list[int]:
    """The chosen step (pinned or latest, see choose_restore_step) first, then older committed
    steps, newest first: where a failed restore falls back to."""
    chosen = choose_restore_step(committed, resume)
    if chosen is None:
        return []
    return [chosen, *sorted((s for s in committed if s < chosen), reverse=True)]


class _Verdict(enum.IntEnum):
    """One restore try, as one process saw it; the largest over all processes wins."""

    OK = 0
    BROKEN = 1  # this step cannot be restored: try an older one
    OUTAGE = 2  # storage itself failed: wait for it and try the same step again


def _agree(verdict: _Verdict) -> _Verdict:
    """Every process must take the same branch (restore is collective): the worst verdict wins."""
    if jax.process_count() == 1:
        return verdict
    return _Verdict(int(np.max(multihost_utils.process_allgather(np.int32(verdict)))))


def agree_all(ok: bool) -> bool:
    """True iff `ok` on every process (a collective when there is more than one)."""
    return _agree(_Verdict.OK if ok else _Verdict.BROKEN) == _Verdict.OK


def restore_with_fallback(
    restore: Callable[[int], Any],
    candidates: Sequence[int],
    storage_ok: Callable[[], bool],
    wait_for_storage: Callable[[], None],
    max_outages: int = 5,
) -> tuple[Any, int, list[RestoreFailure]]:
    """Restore the first candidate that works: (state, step, the failures of newer candidates).

    A step is only given up for an older one when storage itself answers (storage_ok()): a failed
    read during an outage says nothing about the checkpoint. Raises CheckpointIncompatible when no
    candidate works, StorageError when storage stays down.
    """
    failures: list[RestoreFailure] = []
    for step in candidates:
        for _ in range(max_outages + 1):
            error: BaseException | None = None
            try:
                state = restore(step)
                verdict = _Verdict.OK
            except Exception as err:
                error = err
                verdict = _Verdict.BROKEN if storage_ok() else _Verdict.OUTAGE
            verdict = _agree(verdict)
            if verdict == _Verdict.OK:
                return state, step, failures
            if verdict == _Verdict.BROKEN:
                text = short_error(error) if error else "failed on another process"
                log.warning("resume: step %d cannot be restored (%s); trying an older committed step", step, text)
                failures.append(RestoreFailure(step, text))
                break
            log.warning("resume: storage failed while restoring step %d; waiting for it, then retrying", step)
            wait_for_storage()
        else:
            raise StorageError(f"storage kept failing while restoring step {step}")
    raise CheckpointIncompatible(failures)


def choose_restore_step(committed: Sequence[int], resume: Resume) -> int | None:
    """A pinned step: exactly that committed step; latest: the latest committed step, or None;
    fresh: None (step 0, whatever is committed)."""
    if resume.kind == "step":
        assert resume.step is not None
        if resume.step not in committed:
            raise ConfigError(
                f"TPUJOB_RESUME_STEP={resume.step} is not a committed checkpoint; committed steps: {sorted(committed)}"
            )
        return resume.step
    if resume.kind == "fresh":
        return None
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


def backoff_delays(first_s: float = 1.0, cap_s: float = 30.0) -> Iterator[float]:
    """1, 2, 4, ... seconds, capped at cap_s."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, cap_s)


def wait_for_storage(
    run_dir: str,
    name: str,
    timeout_s: float,
    wait_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Probe storage until it works, retrying with exponential backoff (1 s doubling to 30 s).

    A bucket that is briefly unreachable (a network blip, a restarting proxy) must not cost a job
    its attempt; one that stays unusable for wait_s seconds (plus one probe) raises StorageError.
    """
    deadline = clock() + wait_s
    delays = backoff_delays()
    failures = 0
    while True:
        try:
            probe_storage(run_dir, name, timeout_s)
        except StorageError as err:
            failures += 1
            remaining = deadline - clock()
            if remaining <= 0:
                raise StorageError(f"{err}; gave up after {failures} probes in {wait_s:.0f}s") from err
            delay = min(next(delays), remaining)
            log.warning("storage probe %d failed: %s; retrying in %.1fs", failures, err, delay)
            sleep(delay)
            continue
        if failures:
            log.info("storage answers again after %d failed probes", failures)
        return


def probe_storage(run_dir: str, name: str, timeout_s: float) -> None:
    """Write, read back and delete a small object under run_dir, or raise StorageError within timeout_s.

    Runs in a daemon thread because GCS clients retry unreachable endpoints for minutes; the
    trainer must fail fast and clearly instead of hanging before its first step.
    """
    try:
        bounded(lambda: _probe(run_dir, f"{name}-{uuid.uuid4().hex[:8]}"), timeout_s, f"checkpoint storage {run_dir}")
    except StorageTimeout as err:
        raise StorageError(f"{err} (unreachable?)") from err
    except Exception as err:
        raise StorageError(f"checkpoint storage {run_dir} is not writable: {type(err).__name__}: {err}") from err
