"""Everything about checkpoints: Orbax policies from the contract, the manager, restore choice,
the start-up storage probe, and the commit rule the operator shares.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
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
from tpujob_contract import COMMIT_MARKER, QuarantinedStep, RestoreFailure, Resume

from tpujob.bounded import StorageTimeout, bounded
from tpujob.cadence import Cadence, Interval, changed_materially
from tpujob.config import CheckpointConfig, ConfigError
from tpujob.failures import Kind, classify, named_step_files, short_error, undecodable

log = logging.getLogger("tpujob")

# Orbax 0.12.8's marker for a finalized step on gs:// (CommitFileTemporaryPath). On a local path
# the marker is the rename of `<step>.orbax-checkpoint-tmp` to `<step>` (AtomicRenameTemporaryPath).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
RESTORE_RETRIES = 5  # a transient restore error: retried 1 s, 2 s, 4 s, 8 s, 16 s later, then exit 1


class StorageError(RuntimeError):
    """The checkpoint storage is unreachable or unwritable (exit code 3)."""


class StoragePermissionDenied(RuntimeError):
    """Storage refused this process's identity (401/403, exit 5): waiting cannot fix it."""


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
        async_options=synchronous_directories(),
    )


def synchronous_directories() -> ocp.AsyncOptions:
    """Step directories created in the save's blocking part, between two barriers. With Orbax
    0.12.8's asynchronous creation a process other than the primary learns from a key-value
    "contract" what to wait for before it writes; when it reads the contract before the primary
    wrote it, it waits for nothing, writes its shards, and the primary then finds the step's
    directory "existing", removes it and commits the step without them (seen on GCS with two
    processes: a committed checkpoint missing process 1's arrays)."""
    return ocp.AsyncOptions(create_directories_asynchronously=False)


class PreemptionNotice:
    """Whether training has reached the step at which to stop for a SIGTERM.

    Multi-process: JAX's preemption service (started by jax.distributed.initialize) catches
    SIGTERM and agrees on one sync step across all processes, so every host saves the same step.
    It takes the step it was last given as this process's position and stops everyone one step past
    the furthest: only the training loop may give it steps (`reached`, once per step, in order). Orbax's
    managers ask too, from their finalize threads with the step of an older save, which would make
    every process report a step it has passed and never reach the agreed one: they get `stops_at`.
    Single process: no coordination service exists, so a Python SIGTERM handler sets a flag.
    """

    def __init__(self, distributed: bool):
        self._distributed = distributed
        self._flag = threading.Event()
        self._stop_step: int | None = None
        if not distributed:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._flag.set()

    def reached(self, step: int) -> bool:
        """The training loop's question, once per step: whether to stop (and save) at `step`."""
        if self._distributed:
            try:
                reached: bool = multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # the preemption service is disabled (jax_enable_preemption_service)
                reached = False
        else:
            reached = self._flag.is_set()
        if reached:
            self._stop_step = step
        return reached

    def stops_at(self, step: int) -> bool:
        """Whether the training loop stops at `step`, for anyone else (any thread, any step)."""
        return self._stop_step == step


class CheckpointManager(ocp.CheckpointManager):  # type: ignore[misc]  # orbax ships no type hints
    """Orbax's manager, with preemption decided by PreemptionNotice (also for a single process),
    and a save that can fail without wedging the continuous policy."""

    def __init__(self, directory: str, options: ocp.CheckpointManagerOptions, notice: PreemptionNotice):
        self._notice = notice
        super().__init__(directory, options=options)

    def reached_preemption(self, step: int) -> bool:
        return self._notice.stops_at(step)

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
    """The chosen step (see choose_restore_step) first, then older committed steps, newest first:
    where a restore falls back to when a step's data is damaged."""
    chosen = choose_restore_step(committed, resume)
    if chosen is None:
        return []
    return [chosen, *sorted((s for s in committed if s < chosen), reverse=True)]


class _Verdict(enum.IntEnum):
    """One restore try, as one process saw it; the largest over all processes wins."""

    OK = 0
    GONE = 1  # the step's directory is gone (an older attempt's `keep` removed it): try an older one
    MISMATCH = 2  # the step does not fit this trainer: try an older one, leave it in place
    DAMAGED = 3  # the step's own files, read back, are unreadable: quarantine it, try an older one
    TRANSIENT = 4  # back off and try the same step again
    OUTAGE = 5  # storage itself fails its probe: wait for it and try the same step again
    DENIED = 6  # storage refused our identity: exit 5


@dataclasses.dataclass(frozen=True)
class StepFiles:
    """What a step's own files say when read back after a restore error that blamed the data."""

    gone: bool = False  # no file left under the step's directory
    damage: str | None = None  # the evidence: a file that does not read back, or bytes that do not decode

    @staticmethod
    def read_back(step_dir: str, error: BaseException) -> StepFiles:
        """Read back the files the error names under `step_dir`, then every file of the step (the
        metadata must parse); a file missing or unreadable, or an error saying the bytes themselves do
        not decode, is damage. A restore error that names none of the step's files and that they
        contradict (a local file, XLA's INVALID_ARGUMENT) is not the data's."""
        root = epath.Path(step_dir)
        files = _files_under(root) if root.exists() else []
        if not files:
            return StepFiles(gone=True)
        for name in named_step_files(error, step_dir):
            path = root / name
            if not path.exists():
                return StepFiles(damage=f"{name} is missing ({short_error(error)})")
            if path.is_file() and (unread := _unreadable(path)):
                return StepFiles(damage=f"{name}: {unread}")
        for path in files:
            if unread := _unreadable(path):
                return StepFiles(damage=f"{path.relative_to(root)}: {unread}")
        return StepFiles(damage=short_error(error) if undecodable(error) else None)


def _files_under(root: epath.Path) -> list[epath.Path]:
    """Every file under `root`, sorted (no recursive glob: epath refuses one on gs://)."""
    found: list[epath.Path] = []
    folders = [root]
    while folders:
        for path in folders.pop().iterdir():
            (folders if path.is_dir() else found).append(path)
    return sorted(found)


def _unreadable(path: epath.Path) -> str | None:
    """Why a file of a step does not read back whole (its bytes; a metadata file must parse as JSON)."""
    try:
        data = path.read_bytes()
        if path.name in _JSON_METADATA or path.suffix == ".json":
            json.loads(data)
    except Exception as err:
        return short_error(err)
    return None


_JSON_METADATA = frozenset({"_METADATA", "_CHECKPOINT_METADATA", "_sharding", "_ROOT_METADATA"})


_VERDICTS = {Kind.MISMATCH: _Verdict.MISMATCH, Kind.DAMAGED: _Verdict.DAMAGED, Kind.TRANSIENT: _Verdict.TRANSIENT,
             Kind.DENIED: _Verdict.DENIED}  # fmt: skip


def agree_max(mine: int) -> int:
    """The largest of every process's `mine`, an int32 (a collective when there is more than one)."""
    if jax.process_count() == 1:
        return mine
    return int(np.max(multihost_utils.process_allgather(np.int32(mine))))


def _agree(verdict: _Verdict) -> _Verdict:
    """Every process must take the same branch (restore is collective): the worst verdict wins."""
    return _Verdict(agree_max(verdict))


def agree_all(ok: bool) -> bool:
    """True iff `ok` on every process (a collective when there is more than one)."""
    return _agree(_Verdict.OK if ok else _Verdict.MISMATCH) == _Verdict.OK


def agree_steps(steps: Sequence[int]) -> list[int]:
    """Process 0's list of steps, on every process: each process lists storage itself, and a step
    committed between two listings must not make them restore different steps."""
    if jax.process_count() == 1:
        return sorted(steps)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(steps))))
    if not n:
        return []
    # Padded to a power of two: a shape per count of steps would be a new program (a compile, which a
    # restart's compilation cache cannot have seen) whenever another step is committed.
    width = max(8, 1 << (n - 1).bit_length())
    mine = np.zeros(width, dtype=np.int32)
    if jax.process_index() == 0:
        mine[:n] = sorted(steps)
    return [int(s) for s in multihost_utils.broadcast_one_to_all(mine)[:n]]


@dataclasses.dataclass
class Restored:
    state: Any
    step: int
    failures: list[RestoreFailure]  # the newer candidates that could not be restored, and why
    quarantined: list[QuarantinedStep]  # of those, the ones moved to quarantine/


def restore_with_fallback(
    restore: Callable[[int], Any],
    candidates: Sequence[int],
    storage_ok: Callable[[], bool],
    wait_for_storage: Callable[[], None],
    quarantine: Callable[[int], str],
    inspect: Callable[[int, BaseException], StepFiles],
    max_retries: int = RESTORE_RETRIES,
    sleep: Callable[[float], None] = time.sleep,
) -> Restored:
    """Restore the first candidate that works, falling back to an older one only for what the
    data says: an error that blames the data (failures.classify) condemns a step only when its own
    files, read back (`inspect(step, error)`: StepFiles.read_back), confirm it; otherwise it is
    retried like any transient error. A damaged step, or one that does not fit this trainer, is
    quarantined (`quarantine(step)`, a collective that moves it and returns where to) only once an
    older step restored (training goes on from there, so it can never be restored again); when none
    did, every step stays where it is (exit 4: one cause never sets every step aside, and the
    trainer may be the one that changed). A step whose directory is gone (an older attempt's keep)
    is passed over. A transient error is retried with backoff (1 s doubling, max_retries times), a
    storage outage waited out (wait_for_storage); neither ever gives a step up.

    Raises StoragePermissionDenied (exit 5), CheckpointIncompatible when no candidate works (exit
    4), StorageError when storage stays down (exit 3), or the last transient error when its
    retries are spent (exit 1).
    """
    failures: list[RestoreFailure] = []
    condemned: list[int] = []  # damaged or misfit: set aside once an older step restored
    for step in candidates:
        delays = backoff_delays()
        for attempt in range(max_retries + 1):
            error: BaseException | None = None
            evidence: str | None = None
            try:
                state = restore(step)
                verdict = _Verdict.OK
            except Exception as err:
                error = err
                verdict = _VERDICTS[classify(err)]
                if verdict in (_Verdict.DAMAGED, _Verdict.TRANSIENT) and not storage_ok():
                    verdict = _Verdict.OUTAGE
                elif verdict == _Verdict.DAMAGED:
                    files = inspect(step, err)
                    evidence = files.damage
                    verdict = _Verdict.GONE if files.gone else _Verdict.DAMAGED if evidence else _Verdict.TRANSIENT
            verdict = _agree(verdict)
            text = evidence or (short_error(error) if error else "failed on another process")
            if verdict == _Verdict.OK:
                quarantined = [QuarantinedStep(s, quarantine(s)) for s in condemned]
                return Restored(state, step, failures, quarantined)
            if verdict == _Verdict.DENIED:
                raise StoragePermissionDenied(text)
            if verdict in (_Verdict.GONE, _Verdict.DAMAGED, _Verdict.MISMATCH):
                what = {_Verdict.GONE: "is gone", _Verdict.DAMAGED: "is damaged"}.get(verdict, "does not fit")
                log.warning("resume: step %d %s (%s); trying an older committed step", step, what, text)
                failures.append(RestoreFailure(step, text if verdict != _Verdict.GONE else f"gone: {text}"))
                if verdict != _Verdict.GONE:
                    condemned.append(step)
                break
            if attempt == max_retries:
                if verdict == _Verdict.OUTAGE:
                    raise StorageError(f"storage kept failing while restoring step {step}: {text}")
                log.error("resume: restoring step %d kept failing (%s); giving up, the step is kept", step, text)
                if error is not None:
                    raise error
                raise RuntimeError(f"restoring step {step} kept failing on another process")
            if verdict == _Verdict.OUTAGE:
                log.warning("resume: storage failed while restoring step %d; waiting for it, then retrying", step)
                wait_for_storage()
            else:
                delay = next(delays)
                log.warning("resume: restoring step %d failed (%s), not the data's fault; retry %d/%d in %.0fs",
                            step, text, attempt + 1, max_retries, delay)  # fmt: skip
                sleep(delay)
    raise CheckpointIncompatible(failures)


def choose_restore_step(committed: Sequence[int], resume: Resume) -> int | None:
    """A pinned step N: the newest committed step at or after N (the pin is where the operator
    saw the run; a save that committed since is newer work, never to be thrown away); latest:
    the latest committed step, or None; fresh: None (step 0)."""
    if resume.kind == "step":
        assert resume.step is not None
        newer = [s for s in committed if s >= resume.step]
        if not newer:
            raise ConfigError(
                f"TPUJOB_RESUME_STEP={resume.step}: no committed checkpoint at or after it; "
                f"committed steps: {sorted(committed)}"
            )
        return max(newer)
    if resume.kind == "fresh":
        return None
    return max(committed) if committed else None


def move_step(checkpoint_dir: str, to_dir: str, step: int, timeout_s: float) -> str:
    """Move committed step `step` out of checkpoint_dir to <to_dir>/<step> (or <step>.1, ... if
    taken), bytes kept, and return where it went. Local: one rename. gs:// has no rename: every
    object is copied and the copies checked first; then the commit marker is deleted (from that
    moment no listing sees the step), then the rest of the original."""
    return bounded(lambda: _move_step(checkpoint_dir, to_dir, step), timeout_s, f"moving step {step} to {to_dir}")


def _move_step(checkpoint_dir: str, to_dir: str, step: int) -> str:
    src = epath.Path(checkpoint_dir) / str(step)
    root = epath.Path(to_dir)
    dst, n = root / str(step), 0
    while dst.exists():
        n += 1
        dst = root / f"{step}.{n}"
    if not checkpoint_dir.startswith("gs://"):
        root.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
        return str(dst)
    import gcsfs  # the backend epath uses for gs:// here (EPATH_USE_TF=false)

    fs = gcsfs.GCSFileSystem()
    src_key, dst_key = str(src)[len("gs://") :], str(dst)[len("gs://") :]
    sizes = {name[len(src_key) :]: info["size"] for name, info in fs.find(src_key, detail=True).items()}
    for rel in sizes:
        fs.copy(src_key + rel, dst_key + rel)
    copied = {name[len(dst_key) :]: info["size"] for name, info in fs.find(dst_key, detail=True).items()}
    if copied != sizes:
        raise OSError(f"copy of {src} to {dst} is incomplete: {sorted(set(sizes) - set(copied))}")
    marker = f"/{COMMIT_MARKER}"
    if marker in sizes:
        fs.rm_file(src_key + marker)
    fs.rm([src_key + rel for rel in sizes if rel != marker])
    return str(dst)


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
        if classify(err) == Kind.DENIED:  # an answer, not an outage: no wait can fix it
            raise StoragePermissionDenied(short_error(err)) from err
        raise StorageError(f"checkpoint storage {run_dir} is not writable: {type(err).__name__}: {err}") from err


def bucket_of(path: str) -> str:
    """gs://bucket of a gs:// path; a local path as it is."""
    return "gs://" + path[len("gs://") :].split("/", 1)[0] if path.startswith("gs://") else path


def identity(timeout_s: float = 5.0) -> str:
    """Who this process is to storage, as far as it can tell: GOOGLE_SERVICE_ACCOUNT if set, else
    the default credentials' service account (on GKE: Workload Identity's, from the metadata
    server, bounded), else "unknown"."""
    if named := os.environ.get("GOOGLE_SERVICE_ACCOUNT", "").strip():
        return named

    def from_credentials() -> str:
        import google.auth
        import google.auth.transport.requests

        credentials, _ = google.auth.default()  # type: ignore[no-untyped-call]
        email = getattr(credentials, "service_account_email", None)
        if email in (None, "default") and hasattr(credentials, "refresh"):
            credentials.refresh(google.auth.transport.requests.Request())  # resolves "default" on GCE/GKE
            email = getattr(credentials, "service_account_email", None)
        return str(email) if email and email != "default" else "unknown"

    try:
        return bounded(from_credentials, timeout_s, "reading the credentials")
    except Exception:
        return "unknown"
