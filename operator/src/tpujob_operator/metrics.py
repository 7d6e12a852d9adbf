"""Prometheus metrics (`/metrics`, the official prometheus_client), named like Kueue's and JobSet's.

Everything is derived from what a reconcile wrote: `observe_reconcile` compares the status the
reconcile read (`before`) with the one it wrote (`after`). A restart is therefore counted once, by
the process that decided it: a decision made on a stale read is refused by the apiserver (409)
before it is observed, and the next reader sees the restart already in `before`.

Cardinality stays bounded by the live jobs:
- per-job gauges (goodput, badput, checkpoint age) and `tpujob_jobs` are produced at scrape time
  from the last status seen of each live job; `forget` (the job ended or was deleted) drops them;
- per-job counters keep their final value for `COUNTER_RETENTION_SECONDS` after the job ended, so
  that a scrape still sees its last increment, and are removed after that (at the next reconcile or
  `forget`; an idle operator keeps them until it restarts). Counters start from zero when the
  operator process restarts, as every Prometheus counter does.

No module-level instance: `__main__` builds one on `process_registry()` and hands it to the runtime;
tests build their own on a fresh CollectorRegistry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from . import api
from .api import RECREATE
from .status import decided_failure, failure_identity, parse_time

log = logging.getLogger("tpujob.metrics")

DEFAULT_PORT = 8081
JOB_LABELS = ("namespace", "name")
# Phases of a live job: a Succeeded or Failed job is forgotten.
LIVE_PHASES: tuple[api.Phase, ...] = ("Pending", "Running", "Restarting", "Suspended")
# `cause` label values: the api.Badput field names without `_seconds` (scheduling, checkpoint_save, ...).
BADPUT_CAUSES: dict[str, str] = {field: field.removesuffix("_seconds") for field in api.Badput.model_fields}
# Each cause as ml-goodput-measurement's BadputType names it, where one matches (its startup is our
# startup: we cannot tell TPU initialization from program start-up); waiting for capacity, for quota
# and in suspension are not in its taxonomy (it starts counting when the program does): "".
GOODPUT_BADPUT_TYPES: dict[str, str] = {
    "scheduling": "",
    "startup": "PROGRAM_STARTUP",
    "restore": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "checkpoint_save": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "wasted_progress": "WASTED_PROGRESS_FROM_DISRUPTION",
    "infrastructure_recovery": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "suspended": "",
    "queued": "",
    "reduced_size": "",
}
COUNTER_RETENTION_SECONDS = 900.0
# Per live job, what the alert rules compare with: `tpujob_<field>` (a _Limits field), its help.
LIMIT_GAUGES: dict[str, str] = {
    "hang_timeout_seconds": "spec.restart.hangTimeoutSeconds of a live TrainingJob.",
    "max_restarts": "spec.restart.maxRestarts of a live TrainingJob: the restart budget.",
    "counted_restarts": "Restarts of a live TrainingJob that counted against its budget (status.countedRestarts).",
    "checkpoint_interval_seconds": "Seconds between checkpoint save starts in force for a live TrainingJob's "
    "current attempt (status.checkpointCadence.intervalSeconds); absent before the trainer reports it.",
    "checkpoint_save_seconds": "Measured cost of one checkpoint save (status.checkpointCadence.saveCostSeconds).",
    "checkpoint_overhead_ratio": "Measured step-time overhead of saving in the current attempt, as a ratio "
    "(status.checkpointCadence.overheadPercent / 100).",
    "slices": "Slices a live TrainingJob's current attempt runs on (status.slices): spec.tpu.slices, or fewer "
    "while spec.elastic shrank it.",
    "full_slices": "spec.tpu.slices of a live TrainingJob: the size its training math is defined for.",
}

# Failure (the failed pod's finish time, whole seconds) -> the reconcile that decided: seconds.
DETECTION_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)
# Failure -> first step trained by the replacement: restore and compilation dominate.
RECOVERY_BUCKETS = (5, 10, 20, 30, 60, 120, 180, 300, 600, 900, 1800, 3600)
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True, slots=True)
class _Goodput:
    """The ledger's numbers the gauges show (not the status model: 4 KB a job, kept for every live job)."""

    ratio: float | None
    productive_seconds: float
    badput: tuple[float, ...]  # in BADPUT_CAUSES' order

    @classmethod
    def of(cls, goodput: api.Goodput | None) -> _Goodput | None:
        if goodput is None:
            return None
        badput = tuple(float(getattr(goodput.badput, field)) for field in BADPUT_CAUSES)
        return cls(goodput.ratio, goodput.productive_seconds, badput)


@dataclass(frozen=True, slots=True)
class _Limits:
    """What the alert rules compare a job's numbers with: its spec's limits, its cadence in force."""

    hang_timeout_seconds: float
    max_restarts: int
    counted_restarts: int
    checkpoint_interval_seconds: float | None
    checkpoint_save_seconds: float | None
    checkpoint_overhead_ratio: float | None
    slices: int
    full_slices: int

    @classmethod
    def of(cls, spec: api.TrainingJobSpec | None, status: api.TrainingJobStatus) -> _Limits | None:
        if spec is None:
            return None
        cadence = status.checkpoint_cadence
        overhead = cadence.overhead_percent if cadence is not None else None
        return cls(
            hang_timeout_seconds=float(spec.restart.hang_timeout_seconds),
            max_restarts=spec.restart.max_restarts,
            counted_restarts=status.counted_restarts,
            checkpoint_interval_seconds=cadence.interval_seconds if cadence is not None else None,
            checkpoint_save_seconds=cadence.save_cost_seconds if cadence is not None else None,
            checkpoint_overhead_ratio=overhead / 100 if overhead is not None else None,
            slices=status.slices or spec.tpu.slices,
            full_slices=spec.tpu.slices,
        )


@dataclass(frozen=True, slots=True)
class _LiveJob:
    """What the scrape-time gauges need of one live job's last status (and its spec's limits)."""

    phase: api.Phase | None
    goodput: _Goodput | None
    checkpoint_time: datetime | None
    progress_time: datetime | None = None
    limits: _Limits | None = None


def detection_seconds(failure: api.FailureRecord, now: datetime) -> float | None:
    """Failure (its timeline's `failed`, else its time) -> detection (timeline's `detected`, else now)."""
    failed = parse_time(failure.timeline.failed) or parse_time(failure.time)
    detected = parse_time(failure.timeline.detected) or now
    if failed is None:
        return None
    return max(0.0, (detected - failed).total_seconds())


# A recovery's stages: the timeline's stamp that ends each one (it starts at the previous stamp present).
RECOVERY_STAGES: dict[str, str] = {
    "detect": "detected",
    "replace": "job_set_created",
    "schedule": "pods_scheduled",
    "restore": "restored",
    "first_step": "first_new_step",
}


def recovery_stages(timeline: api.FailureTimeline) -> dict[str, float]:
    """Seconds of each stage of a recovery, from the failure to the first new step. A stage whose end
    was not recorded (InPlace creates no JobSet) is left out, and the next one starts where the last
    recorded one ended, so the stages add up to the whole recovery."""
    stages: dict[str, float] = {}
    start = parse_time(timeline.failed)
    for stage, stamp in RECOVERY_STAGES.items():
        end = parse_time(getattr(timeline, stamp))
        if end is None:
            continue
        if start is not None:
            stages[stage] = max(0.0, (end - start).total_seconds())
        start = end
    return stages


def first_recovery(before: api.TrainingJobStatus, after: api.TrainingJobStatus) -> float | None:
    """lastFailure.recoverySeconds in the reconcile that first set it, else None."""
    failure = after.last_failure
    if failure is None or failure.recovery_seconds is None:
        return None
    previous = before.last_failure
    if previous is None or previous.recovery_seconds is None:
        return failure.recovery_seconds
    return None if failure_identity(previous) == failure_identity(failure) else failure.recovery_seconds


class OperatorMetrics:
    """The operator's metrics, registered on `registry` (a private CollectorRegistry in tests)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.time,
        counter_retention: float = COUNTER_RETENTION_SECONDS,
    ) -> None:
        self.registry = registry
        self._clock = clock
        self._counter_retention = counter_retention
        self._lock = threading.Lock()
        self._live: dict[tuple[str, str], _LiveJob] = {}
        self._expiring: dict[tuple[str, str], float] = {}  # ended job -> when its counters go
        self.restarts = Counter(
            "tpujob_restarts_total",
            "Restarts of TrainingJobs decided by this operator process, by failure kind, whether the restart "
            "counted against spec.restart.maxRestarts, and the rung of the restart ladder it took (InPlace, Recreate).",
            [*JOB_LABELS, "kind", "counted", "rung"],
            registry=registry,
        )
        self.lost_steps = Counter(
            "tpujob_lost_steps_total",
            "Steps trained but not checkpointed, lost to failures decided by this operator process.",
            JOB_LABELS,
            registry=registry,
        )
        self.resizes = Counter(
            "tpujob_resizes_total",
            "Slice-count changes of TrainingJobs by spec.elastic decided by this operator process, by direction "
            "(shrink: a slice stayed unschedulable; grow: TPU node pools were ready again).",
            [*JOB_LABELS, "direction"],
            registry=registry,
        )
        self.failure_detection = Histogram(
            "tpujob_failure_detection_seconds",
            "Failure (the failed worker's finish time) to the reconcile that decided on it, by failure kind.",
            ["kind"],
            buckets=DETECTION_BUCKETS,
            registry=registry,
        )
        self.recovery = Histogram(
            "tpujob_recovery_seconds",
            "Failure to the first step trained after the restart (status.lastFailure.recoverySeconds), by failure "
            "kind and the rung of the restart ladder (InPlace: restarted workers; Recreate: a new JobSet).",
            ["kind", "rung"],
            buckets=RECOVERY_BUCKETS,
            registry=registry,
        )
        self.recovery_stage = Histogram(
            "tpujob_recovery_stage_seconds",
            "One stage of a recovery (status.lastFailure.timeline): detect (failure to decision), replace (to the "
            "new JobSet), schedule (to every pod placed), restore (to the checkpoint restored), first_step (to "
            "the first step trained), by stage and rung.",
            ["stage", "rung"],
            buckets=RECOVERY_BUCKETS,
            registry=registry,
        )
        self.reconcile_duration = Histogram(
            "tpujob_reconcile_duration_seconds",
            "Duration of one reconcile of one TrainingJob (API reads, checkpoint storage reads, writes).",
            buckets=RECONCILE_BUCKETS,
            registry=registry,
        )
        self.leader = Gauge(
            "tpujob_leader",
            "1 while this operator process leads (holds the Lease, or runs without election) and reconciles.",
            registry=registry,
        )
        self.reconcile_errors = Counter(
            "tpujob_reconcile_errors_total",
            "Reconciles that ended in an error (retried at the next event or poll).",
            registry=registry,
        )
        registry.register(_LiveJobsCollector(self))

    def observe_reconcile(
        self,
        namespace: str,
        name: str,
        before: api.TrainingJobStatus,
        after: api.TrainingJobStatus,
        now: datetime,
        spec: api.TrainingJobSpec | None = None,
    ) -> None:
        """A reconcile read `before` and wrote `after` (its decision is stored): count what changed.
        `spec` gives the limits the alert rules compare with (hang timeout, restart budget)."""
        key = (namespace, name)
        failure = decided_failure(before, after)
        if after.restarts > before.restarts:
            kind = failure.kind if failure is not None else "Unknown"
            counted = failure.counted if failure is not None else after.counted_restarts > before.counted_restarts
            rung = (failure.rung if failure is not None else None) or RECREATE
            self.restarts.labels(namespace, name, kind, str(counted).lower(), rung).inc(
                after.restarts - before.restarts
            )
        resize = after.last_resize
        if after.resizes > before.resizes and resize is not None:
            direction = "shrink" if resize.to_slices < resize.from_slices else "grow"
            self.resizes.labels(namespace, name, direction).inc(after.resizes - before.resizes)
        lost = self.lost_steps.labels(namespace, name)  # present (0) for every job seen, so increase() sees the first
        if after.lost_steps > before.lost_steps:
            lost.inc(after.lost_steps - before.lost_steps)
        if failure is not None and (seconds := detection_seconds(failure, now)) is not None:
            self.failure_detection.labels(failure.kind).observe(seconds)
        recovery = first_recovery(before, after)
        if recovery is not None and after.last_failure is not None:
            rung = after.last_failure.rung or RECREATE
            self.recovery.labels(after.last_failure.kind, rung).observe(recovery)
            for stage, seconds in recovery_stages(after.last_failure.timeline).items():
                self.recovery_stage.labels(stage, rung).observe(seconds)
        checkpoint = after.latest_checkpoint
        with self._lock:
            self._expiring.pop(key, None)
            if after.phase in api.TERMINAL_PHASES:
                self._end(key)
            else:
                self._live[key] = _LiveJob(
                    phase=after.phase,
                    goodput=_Goodput.of(after.goodput),
                    checkpoint_time=parse_time(checkpoint.time) if checkpoint is not None else None,
                    progress_time=parse_time(after.last_progress_time),
                    limits=_Limits.of(spec, after),
                )
            self._purge()

    @contextlib.contextmanager
    def reconciling(self) -> Iterator[None]:
        """Time one reconcile; count it as an error if it raises."""
        started = time.perf_counter()
        try:
            yield
        except Exception:
            self.observe_error()
            raise
        finally:
            self.reconcile_duration.observe(time.perf_counter() - started)

    def mark_leading(self) -> None:
        """This process leads from now on (it exits when it loses the Lease, so there is no way back to 0)."""
        self.leader.set(1)

    def observe_error(self) -> None:
        """A reconcile failed (an exception the caller caught or re-raises)."""
        self.reconcile_errors.inc()

    def forget(self, namespace: str, name: str) -> None:
        """The job ended or was deleted: its gauges go now, its counters after the retention time."""
        with self._lock:
            self._end((namespace, name))
            self._purge()

    def live_jobs(self) -> int:
        """How many jobs the metrics hold gauges for (0 once every job ended or was deleted)."""
        with self._lock:
            return len(self._live)

    def serve(self, port: int, addr: str = "0.0.0.0") -> WSGIServer:
        """Serve /metrics on addr:port from a daemon thread (prometheus_client's own server)."""
        server, _ = start_http_server(port, addr, registry=self.registry)
        log.info("serving metrics on http://%s:%d/metrics", addr, server.server_port)
        return server

    def _end(self, key: tuple[str, str]) -> None:
        self._live.pop(key, None)
        self._expiring.setdefault(key, self._clock() + self._counter_retention)

    def _purge(self) -> None:
        now = self._clock()
        for (namespace, name), due in list(self._expiring.items()):
            if due <= now:
                labels = {"namespace": namespace, "name": name}
                self.restarts.remove_by_labels(labels)
                self.lost_steps.remove_by_labels(labels)
                self.resizes.remove_by_labels(labels)
                del self._expiring[(namespace, name)]

    def _snapshot(self) -> dict[tuple[str, str], _LiveJob]:
        with self._lock:
            return dict(self._live)

    def gauges(self, jobs: dict[tuple[str, str], _LiveJob] | None = None) -> list[Metric]:
        """The scrape-time gauges: per live job, and live jobs per phase."""
        jobs = self._snapshot() if jobs is None else jobs
        now = self._clock()
        by_phase = GaugeMetricFamily(
            "tpujob_jobs", "Live TrainingJobs by phase, as this operator process last saw them.", labels=["phase"]
        )
        tally = Tally(job.phase for job in jobs.values())
        for phase in LIVE_PHASES:
            by_phase.add_metric([phase], tally.get(phase, 0))
        ratio = GaugeMetricFamily(
            "tpujob_goodput_ratio",
            "Productive seconds / wall seconds of a live TrainingJob, across attempts (status.goodput.ratio).",
            labels=JOB_LABELS,
        )
        productive = GaugeMetricFamily(
            "tpujob_productive_seconds",
            "Seconds a live TrainingJob trained productively, across attempts (status.goodput.productiveSeconds).",
            labels=JOB_LABELS,
        )
        badput = GaugeMetricFamily(
            "tpujob_badput_seconds",
            "Seconds of a live TrainingJob's wall time that did not train, by cause (status.goodput.badput), "
            "with ml-goodput-measurement's BadputType of the cause where one matches (badput_type).",
            labels=[*JOB_LABELS, "cause", "badput_type"],
        )
        since = GaugeMetricFamily(
            "tpujob_seconds_since_committed_checkpoint",
            "Seconds since the operator first saw a live TrainingJob's latest committed checkpoint "
            "(status.latestCheckpoint.time); absent before the first one.",
            labels=JOB_LABELS,
        )
        since_progress = GaugeMetricFamily(
            "tpujob_seconds_since_progress",
            "Seconds since a Running TrainingJob's trainer last reported a step (status.lastProgressTime); "
            "absent in other phases, where no step is expected.",
            labels=JOB_LABELS,
        )
        limits = {
            field: GaugeMetricFamily(f"tpujob_{field}", help_text, labels=JOB_LABELS)
            for field, help_text in LIMIT_GAUGES.items()
        }
        for (namespace, name), job in sorted(jobs.items()):
            if job.phase == "Running" and job.progress_time is not None:
                since_progress.add_metric([namespace, name], max(0.0, now - job.progress_time.timestamp()))
            if job.limits is not None:
                for field, family in limits.items():
                    if (value := getattr(job.limits, field)) is not None:
                        family.add_metric([namespace, name], float(value))
            if job.goodput is not None:
                if job.goodput.ratio is not None:
                    ratio.add_metric([namespace, name], job.goodput.ratio)
                productive.add_metric([namespace, name], job.goodput.productive_seconds)
                for cause, seconds in zip(BADPUT_CAUSES.values(), job.goodput.badput, strict=True):
                    badput.add_metric([namespace, name, cause, GOODPUT_BADPUT_TYPES[cause]], seconds)
            if job.checkpoint_time is not None:
                since.add_metric([namespace, name], max(0.0, now - job.checkpoint_time.timestamp()))
        return [by_phase, ratio, productive, badput, since, since_progress, *limits.values()]


class _LiveJobsCollector(Collector):
    def __init__(self, metrics: OperatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics.gauges()

    def describe(self) -> Iterable[Metric]:
        return self._metrics.gauges({})


def process_registry() -> CollectorRegistry:
    """A registry with what prometheus_client's default one holds: the process and Python collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
