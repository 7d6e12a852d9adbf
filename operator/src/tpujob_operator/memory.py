"""What the operator remembers of each live job: one `JobMemory` per job, in one dict, dropped with one call.

Nothing here outlives the job: `Memory.forget` drops all of it when the job ends or is deleted. The
rest of the operator's knowledge comes from the watch-fed caches (handlers.py) and storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tpujob_contract import LABEL_ATTEMPT

from .checkpoints import RunView
from .facts import CreationRefused
from .jobset import incarnation_uid
from .schedule import JobKey


@dataclass(slots=True)
class Lookup:
    """A slow lookup's last answer and when it was made (monotonic seconds)."""

    at: float
    answer: Any


@dataclass(slots=True)
class JobMemory:
    """Everything kept of one job between its reconciles."""

    # The last state of each worker pod that ended or was deleted: evicted, preempted or
    # garbage-collected pods leave the cache, but what they said on the way out classifies a failure.
    ended_pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Our own writes the watch has not delivered yet: the TrainingJob as our last status write
    # returned it, the JobSets we created and the names of those we deleted.
    written: dict[str, Any] | None = None
    created: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)
    run: RunView | None = None  # the last GCS reads of the run directory
    read_at: float | None = None  # when the progress record was last read (monotonic)
    ending_since: float | None = None  # a worker was last seen stopping or gone (monotonic)
    lookups: dict[str, Lookup] = field(default_factory=dict)  # LIST-backed answers, by question
    # The apiserver refused the JobSet apply tried to create: an observation the next decision reads.
    refused: CreationRefused | None = None

    def held(self) -> int:
        """How many things are kept (0: nothing)."""
        singles = (self.written, self.run, self.read_at, self.ending_since, self.refused)
        return (
            len(self.ended_pods)
            + sum(x is not None for x in singles)
            + int(bool(self.created))
            + int(bool(self.deleted))
            + len(self.lookups)
        )

    def keep_only_attempt(self, uid: str | None, attempt: int) -> None:
        """Drop remembered pods of earlier attempts and other incarnations: they decide nothing any more."""
        for name, body in list(self.ended_pods.items()):
            labels = body["metadata"].get("labels") or {}
            owner = incarnation_uid(body)
            if labels.get(LABEL_ATTEMPT) != str(attempt) or (owner is not None and owner != uid):
                del self.ended_pods[name]


class Memory:
    """The memories of live jobs, by job. Written from the event loop and the reconcile threads: each
    job's reconciles never overlap (schedule.py), and dict operations are atomic."""

    def __init__(self) -> None:
        self._jobs: dict[JobKey, JobMemory] = {}

    def of(self, key: JobKey) -> JobMemory:
        """The job's memory, new if nothing was kept of it."""
        found = self._jobs.get(key)
        return found if found is not None else self._jobs.setdefault(key, JobMemory())

    def get(self, key: JobKey) -> JobMemory | None:
        return self._jobs.get(key)

    def forget(self, key: JobKey) -> None:
        self._jobs.pop(key, None)

    def held(self, key: JobKey) -> int:
        found = self._jobs.get(key)
        return found.held() if found is not None else 0

    def items(self) -> Iterator[tuple[JobKey, JobMemory]]:
        """A copy's items: safe while jobs come and go."""
        return iter(list(self._jobs.items()))

    def __len__(self) -> int:
        return len(self._jobs)
