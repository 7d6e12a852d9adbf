"""contract.ProgressRecord reporting: a human line on stdout and a machine-readable `progress.json` for the operator.

Why a JSON object in the run directory (and not a patch of the TrainingJob status or a pod
annotation): the trainer then needs no Kubernetes credentials or RBAC, only the GCS access it
already has (Workload Identity) for checkpoints; the record survives pod deletion and restarts;
and the operator already reads this bucket prefix to find the latest committed step. Process 0
alone writes it, at most every TPUJOB_PROGRESS_INTERVAL_SECONDS and once more on exit, from a
background thread so that a slow bucket never stalls a training step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import tpujob_contract as contract
from etils import epath

if TYPE_CHECKING:  # checkpointing imports this module
    from tpujob.checkpointing import AdaptiveCadence

log = logging.getLogger("tpujob")


@dataclasses.dataclass
class SaveBlock:
    """How long one save blocked the loop, known once it ended."""

    seconds: float = 0.0


class AttemptProgress:
    """The current attempt's contract.ProgressRecord as the trainer builds it up: its fields are the
    record's own (declared once, in the contract), set with `update` as they become known. Only the
    step, which changes on every training step, is kept aside and folded in by `record`, with the
    time, the state and the adaptive cadence's numbers of the moment."""

    def __init__(self, attempt: int, uid: str, process_started_at: str) -> None:
        self.record_so_far = contract.ProgressRecord(
            step=0,
            attempt=attempt,
            uid=uid,
            updated_at=process_started_at,
            state="failed",  # until the attempt ends otherwise
            process_started_at=process_started_at,
        )
        self.step = 0
        self.cadence: AdaptiveCadence | None = None  # policy "adaptive"
        self._blocked_since: float | None = None  # monotonic: when the loop entered the save it is blocked in

    @contextlib.contextmanager
    def blocked_in_save(self) -> Iterator[SaveBlock]:
        """The loop is blocked in a checkpoint save meanwhile: the record says since when, and the time
        it took is added to save_blocking_seconds (the goodput ledger's checkpoint-save badput)."""
        block = SaveBlock()
        since = self._blocked_since = time.monotonic()
        self.update(blocked_in_save_at=contract.now_rfc3339())
        try:
            yield block
        finally:
            block.seconds = time.monotonic() - since
            self._blocked_since = None
            self.update(blocked_in_save_at=None)
            self.save_blocked(block.seconds)

    def blocked_seconds(self) -> float | None:
        """How long the loop has been blocked in the current save (None: it is not in one)."""
        since = self._blocked_since
        return None if since is None else time.monotonic() - since

    def update(self, **fields: Any) -> None:
        """Set record fields (dataclasses.replace refuses a name the record does not have)."""
        self.record_so_far = dataclasses.replace(self.record_so_far, **fields)

    def save_failed(self) -> None:
        self.update(save_failures=self.record_so_far.save_failures + 1)

    def save_blocked(self, seconds: float) -> None:
        self.update(save_blocking_seconds=self.record_so_far.save_blocking_seconds + seconds)

    def restored(
        self, step: int | None, failures: tuple[contract.RestoreFailure, ...], tier: contract.RestoredFrom | None = None
    ) -> None:
        self.update(restored_step=step, resumed_from_step=step, restore_failures=failures, restored_from=tier)

    def moved_to_quarantine(self, step: int, where: str) -> None:
        moved = (*self.record_so_far.quarantined, contract.QuarantinedStep(step, where))
        self.update(quarantined=moved)

    def record(self, state: contract.State | None = None) -> contract.ProgressRecord:
        """The record to publish now (`state`: the record's own when None)."""
        so_far = self.record_so_far
        return dataclasses.replace(
            so_far,
            step=self.step,
            updated_at=contract.now_rfc3339(),
            state=state or so_far.state,
            save_blocking_seconds=round(so_far.save_blocking_seconds, 3),
            **(self.cadence.record_fields() if self.cadence else {}),
        )


def progress_line(step: int, total: int, loss: float, steps_per_second: float, last_committed: int | None) -> str:
    committed = "none" if last_committed is None else str(last_committed)
    return f"step {step}/{total} loss {loss:.4f} steps/s {steps_per_second:.2f} last_committed {committed}"


def write_atomically(path: epath.Path, text: str) -> None:
    """A GCS object upload is atomic by itself; on a filesystem write a temp file and rename it."""
    if str(path).startswith("gs://"):
        path.write_text(text)
        return
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """When storage has failed every try for `after_seconds` (record writes that fail or hang, and
    `probe`s made when no write has landed lately), `action(seconds)` runs."""

    after_seconds: float
    probe: Callable[[], None]  # a small write to the run directory; raises when storage fails it
    action: Callable[[float], None]


@dataclasses.dataclass(frozen=True)
class KeepFresh:
    """While the loop is blocked in a save, the record is written again every `interval_seconds`, for
    at most `limit_seconds` of one save. The operator's hang clock reads the record's silence, and a
    save longer than the hang timeout (a big model's, a loaded machine's, a final save that first
    waits for the one in flight) is no hang. Past the limit the silence counts again, so a save that
    never ends (a peer hung before its barrier) is still found."""

    status: AttemptProgress
    interval_seconds: float
    limit_seconds: float


class ProgressWriter:
    """Writes the newest published contract.ProgressRecord from a background thread, and a final one on close().

    `committed` resolves the step of the last finished save to the step whose commit marker is
    actually in storage (a failed async save leaves none), off the training thread.

    With `give_up`, a watchdog thread of its own, which nothing in training can block, tells storage
    lost on the workers' side from a hang of the training itself: both leave the record silent, which
    the operator reads as a hang, but only the first fails the watchdog's probes too.
    """

    def __init__(
        self,
        run_dir: str,
        committed: Callable[[int], bool],
        give_up: GiveUp | None = None,
        keep_fresh: KeepFresh | None = None,
    ):
        self._path = epath.Path(contract.progress_path(run_dir))
        self._committed = committed
        self._cond = threading.Condition()
        self._pending: contract.ProgressRecord | None = None
        self._closed = False
        self._candidates: list[int] = []
        self.last_committed_step: int | None = None
        self._failing_since: float | None = None  # monotonic: storage's first failed try since one worked
        self._worked_at = time.monotonic()  # storage's last answer (a write landed, a probe passed)
        self._keep_fresh = keep_fresh
        self._written_at = time.monotonic()  # the last write tried
        self._thread = threading.Thread(target=self._run, name="tpujob-progress", daemon=True)
        self._thread.start()
        self._training_over = threading.Event()
        if give_up is not None:
            threading.Thread(target=self._watch, args=(give_up,), name="tpujob-storage-watchdog", daemon=True).start()

    def failing_seconds(self) -> float:
        """Seconds since storage's first failed try after its last answer (0: not failing)."""
        since = self._failing_since
        return 0.0 if since is None else time.monotonic() - since

    def _tried(self) -> None:
        if self._failing_since is None:
            self._failing_since = time.monotonic()

    def _worked(self) -> None:
        self._failing_since, self._worked_at = None, time.monotonic()

    def _watch(self, give_up: GiveUp) -> None:
        tick = min(5.0, max(give_up.after_seconds / 4, 0.05))
        while not self._training_over.wait(tick):
            if time.monotonic() - self._worked_at > 2 * tick:  # no write landed lately: ask storage itself
                self._tried()
                try:
                    give_up.probe()
                except Exception as err:
                    log.warning("storage watchdog: probe failed: %s", err)
                else:
                    self._worked()
            if (failing := self.failing_seconds()) > give_up.after_seconds and not self._training_over.is_set():
                give_up.action(failing)
                return

    def saved(self, step: int) -> None:
        """A save of `step` has finished (successfully or not): check its commit marker."""
        with self._cond:
            self._candidates.append(step)
            self._cond.notify()

    def publish(self, progress: contract.ProgressRecord) -> None:
        """Queue a record; the caller throttles to one per interval, an unwritten one is replaced."""
        with self._cond:
            self._pending = progress
            self._cond.notify()

    def _check(self, steps: list[int]) -> None:
        """Newest first: the latest of `steps` whose marker exists becomes last_committed_step."""
        for step in sorted(steps, reverse=True):
            if self.last_committed_step is not None and step <= self.last_committed_step:
                return
            try:
                if self._committed(step):
                    self.last_committed_step = step
                    return
            except Exception:
                log.warning("could not check the commit marker of step %d", step, exc_info=True)

    def _fresh(self) -> contract.ProgressRecord | None:
        """The record of the moment, when the loop is blocked in a save, within the limit, and nothing
        was written for an interval."""
        keep = self._keep_fresh
        if keep is None or time.monotonic() - self._written_at < keep.interval_seconds:
            return None
        blocked = keep.status.blocked_seconds()
        if blocked is None or blocked > keep.limit_seconds:
            return None
        return keep.status.record("running")

    def _write(self, progress: contract.ProgressRecord) -> None:
        progress = dataclasses.replace(progress, last_committed_step=self.last_committed_step)
        self._written_at = time.monotonic()
        self._tried()
        try:
            write_atomically(self._path, contract.to_json(progress))
        except Exception:
            log.warning("could not write %s", self._path, exc_info=True)
        else:
            self._worked()

    def _take(self) -> tuple[list[int], contract.ProgressRecord | None]:
        candidates, self._candidates = self._candidates, []
        pending, self._pending = self._pending, None
        return candidates, pending

    def _run(self) -> None:
        tick = max(self._keep_fresh.interval_seconds, 0.1) if self._keep_fresh else None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._candidates) or self._pending is not None, tick)
                if self._closed:
                    return
                candidates, pending = self._take()
            self._check(candidates)
            pending = pending or self._fresh()
            if pending is not None:
                self._write(pending)

    def close(self, final: contract.ProgressRecord, timeout_s: float = 30.0) -> None:
        """Stop the thread and write `final` (with the committed step re-checked) synchronously."""
        self._training_over.set()  # the record's silence can no longer be taken for a hang
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            candidates, _ = self._take()
        self._check(candidates)
        self._write(final)
