"""Progress reporting: a human line on stdout and a machine-readable `progress.json` for the operator.

Why a JSON object in the run directory (and not a patch of the TrainingJob status or a pod
annotation): the trainer then needs no Kubernetes credentials or RBAC, only the GCS access it
already has (Workload Identity) for checkpoints; the record survives pod deletion and restarts;
and the operator already reads this bucket prefix to find the latest committed step. Process 0
alone writes it, at most every TPUJOB_PROGRESS_INTERVAL_SECONDS and once more on exit, from a
background thread so that a slow bucket never stalls a training step.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Literal

from etils import epath

log = logging.getLogger("tpujob_trainer")

# incompatible: no committed checkpoint could be restored (exit code 4); see restore_failures.
State = Literal["running", "succeeded", "preempted", "failed", "incompatible"]
PROGRESS_FILE = "progress.json"
ERROR_TEXT_LIMIT = 200  # characters of an error kept in the record: enough to tell causes apart


@dataclasses.dataclass(frozen=True)
class RestoreFailure:
    """A committed step that could not be restored, and why (shortened)."""

    step: int
    error: str


@dataclasses.dataclass(frozen=True)
class Progress:
    step: int
    loss: float | None
    steps_per_second: float | None
    last_committed_step: int | None
    attempt: int
    resumed_from_step: int | None
    updated_at: str
    state: State
    uid: str = ""  # the TrainingJob's metadata.uid (TPUJOB_UID): which job wrote this record
    restored_step: int | None = None  # the step actually restored (an older one if newer ones failed)
    restore_failures: tuple[RestoreFailure, ...] = ()
    save_failures: int = 0  # saves of this attempt that raised; training went on and retried


def short_error(err: BaseException) -> str:
    """`Type: message` on one line, cut to ERROR_TEXT_LIMIT characters."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= ERROR_TEXT_LIMIT else text[: ERROR_TEXT_LIMIT - 3] + "..."


def rfc3339_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def to_json(progress: Progress) -> str:
    return json.dumps(dataclasses.asdict(progress), sort_keys=True)


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


class ProgressWriter:
    """Writes the newest published Progress from a background thread, and a final one on close().

    `committed` resolves the step of the last finished save to the step whose commit marker is
    actually in storage (a failed async save leaves none), off the training thread.
    """

    def __init__(self, run_dir: str, committed: Callable[[int], bool]):
        self._path = epath.Path(run_dir) / PROGRESS_FILE
        self._committed = committed
        self._cond = threading.Condition()
        self._pending: Progress | None = None
        self._closed = False
        self._candidates: list[int] = []
        self.last_committed_step: int | None = None
        self._thread = threading.Thread(target=self._run, name="tpujob-progress", daemon=True)
        self._thread.start()

    def saved(self, step: int) -> None:
        """A save of `step` has finished (successfully or not): check its commit marker."""
        with self._cond:
            self._candidates.append(step)
            self._cond.notify()

    def publish(self, progress: Progress) -> None:
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

    def _write(self, progress: Progress) -> None:
        progress = dataclasses.replace(progress, last_committed_step=self.last_committed_step)
        try:
            write_atomically(self._path, to_json(progress))
        except Exception:
            log.warning("could not write %s", self._path, exc_info=True)

    def _take(self) -> tuple[list[int], Progress | None]:
        candidates, self._candidates = self._candidates, []
        pending, self._pending = self._pending, None
        return candidates, pending

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._candidates) or self._pending is not None)
                if self._closed:
                    return
                candidates, pending = self._take()
            self._check(candidates)
            if pending is not None:
                self._write(pending)

    def close(self, final: Progress, timeout_s: float = 30.0) -> None:
        """Stop the thread and write `final` (with the committed step re-checked) synchronously."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            candidates, _ = self._take()
        self._check(candidates)
        self._write(final)
