"""Plain data the handlers gather from the API and GCS, and the pure modules decide on."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

JobSetState = Literal["Active", "Suspended", "Completed", "Failed"]


@dataclass(frozen=True)
class PodFacts:
    """What a worker pod tells about why it ended (or that it has not)."""

    name: str
    slice: int | None
    phase: str
    exit_code: int | None = None
    reason: str | None = None  # container terminated reason (Error, OOMKilled, ...) or pod reason
    disruption_reason: str | None = None  # DisruptionTarget condition reason, if any
    finished_at: datetime | None = None
    unschedulable_message: str | None = None  # PodScheduled=False/Unschedulable message


@dataclass(frozen=True)
class JobSetFacts:
    name: str
    attempt: int
    resume_step: int | None
    created: datetime
    state: JobSetState
    condition_reason: str = ""
    condition_message: str = ""
    failed_slice: int | None = None  # from the failed child Job, when JobSet's status names one
    pods: tuple[PodFacts, ...] = ()
    deleting: bool = False


@dataclass(frozen=True)
class Progress:
    """The trainer's progress record ($TPUJOB_RUN_DIR/progress.json)."""

    step: int
    attempt: int
    updated_at: datetime
    loss: float | None = None
    steps_per_second: float | None = None
    last_committed_step: int | None = None
    resumed_from_step: int | None = None
    state: str = "running"


@dataclass(frozen=True)
class Observed:
    now: datetime
    jobsets: tuple[JobSetFacts, ...] = ()
    latest_committed_step: int | None = None
    progress: Progress | None = None
    storage_error: str | None = None  # GCS could not be read: reported, never fatal


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Actions:
    """Side effects the handler performs, in this order: status, delete, create, suspend."""

    create_attempt: int | None = None
    resume_step: int | None = None
    delete: list[str] = field(default_factory=list)
    set_suspend: tuple[str, bool] | None = None
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
