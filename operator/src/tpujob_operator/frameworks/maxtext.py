"""MaxText as the trainer (spec.framework: maxtext), run unchanged, as a Framework (frameworks/__init__.py).

- The checkpoint policy becomes MaxText's own `key=value` flags, appended after the user's args
  (`maxtext_args`); the run directory is the operator's `<directory>/<namespace>/<name>`, so MaxText's
  `<base_output_directory>/<run_name>/checkpoints/<step>` is where the operator already looks.
- The environment XPK sets for MaxText's multi-host start-up (`maxtext_env`), next to the contract's.
- What MaxText cannot honour is refused at admission (frameworks/admission.py: the flags and env
  names it reserves, its CEL rules and their mirror).
- Progress without a progress record: MaxText writes none. `progress` turns what it leaves on storage
  (the newest committed step and its commit time, plus the metrics files of `gcs_metrics=true`) into
  the same `contract.ProgressRecord` the trainer writes; `read_progress` does the bounded GCS reads.

The spec types are imported for type checking only: api.py imports this package (admission.py).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import tpujob_contract as contract
from pydantic import JsonValue

from ..facts import JobSetFacts
from .admission import (
    ASYNC,
    BASE_OUTPUT_DIRECTORY,
    CONTINUOUS,
    ENABLE_CHECKPOINTING,
    JAX_COORDINATOR_ADDRESS,
    JAX_PROCESS_COUNT,
    JOB_INDEX,
    KEEP,
    MAXTEXT,
    MAXTEXT_CEL_RULES,
    PERIOD,
    PROCESSES_IN_JOB,
    RUN_NAME,
    SAVE_ON_PREEMPTION,
    maxtext_refusals,
)

if TYPE_CHECKING:
    from google.cloud import storage

    from ..api import TrainingJob

METADATA_FILE = "_CHECKPOINT_METADATA"  # Orbax's per-step metadata: commit_timestamp_nsecs
METRICS_DIR = "metrics"  # gcs_metrics=true: <run>/metrics/metrics_step_<first:06>_to_step_<last:06>.txt
_METRICS_NAME = re.compile(r"metrics_step_(\d+)_to_step_(\d+)\.txt$")
DEFAULT_LOG_PERIOD = 100  # MaxText's log_period: one metrics file per log_period steps


def _flag(value: bool | int | str) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def maxtext_args(tj: TrainingJob) -> list[str]:
    """MaxText's flags for the job's checkpoint policy, appended after the user's args."""
    ckpt = tj.spec.checkpoint
    flags: list[tuple[str, bool | int | str]] = [
        (BASE_OUTPUT_DIRECTORY, f"{ckpt.directory.rstrip('/')}/{tj.namespace}"),
        (RUN_NAME, tj.name),
        (ENABLE_CHECKPOINTING, True),
        (CONTINUOUS, ckpt.policy == "continuous"),
    ]
    if ckpt.policy == "interval":
        flags.append((PERIOD, ckpt.interval_steps or 0))
    flags += [(KEEP, ckpt.keep.latest), (ASYNC, ckpt.async_), (SAVE_ON_PREEMPTION, ckpt.save_on_preemption)]
    return [f"{key}={_flag(value)}" for key, value in flags]


def maxtext_env(tj: TrainingJob, coordinator: str, hosts_per_slice: int) -> list[dict[str, str]]:
    """XPK's start-up variables with literal values (JOB_INDEX, a fieldRef, is added by the builder)."""
    return [
        {"name": JAX_COORDINATOR_ADDRESS, "value": coordinator},
        {"name": JAX_PROCESS_COUNT, "value": str(tj.spec.tpu.slices * hosts_per_slice)},
        {"name": PROCESSES_IN_JOB, "value": str(hosts_per_slice)},
    ]


# --- progress from storage ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Commit:
    """A committed step, and when Orbax committed it (None: its metadata had no commit time)."""

    step: int
    committed_at: datetime | None


@dataclass(frozen=True)
class MetricsFile:
    """One of MaxText's gcs_metrics files: the last step it covers and when it was written."""

    last_step: int
    written_at: datetime


def commit_time(raw: bytes) -> datetime | None:
    """commit_timestamp_nsecs from a step's _CHECKPOINT_METADATA (Orbax's JSON), as a UTC datetime."""
    try:
        nanos = json.loads(raw).get("commit_timestamp_nsecs")
    except (ValueError, AttributeError):
        return None
    if not isinstance(nanos, int) or isinstance(nanos, bool) or nanos <= 0:
        return None
    return datetime.fromtimestamp(nanos / 1e9, UTC)


def metrics_last_step(name: str) -> int | None:
    match = _METRICS_NAME.search(name)
    return int(match.group(2)) if match else None


def progress(
    *,
    uid: str | None,
    attempt: int,
    attempt_started: datetime,
    resume_step: int | None,
    latest: Commit | None,
    metrics: Sequence[MetricsFile] = (),
) -> contract.ProgressRecord | None:
    """The current attempt's progress as far as storage shows it, or None before its first sign.

    Only what happened after the attempt started counts (a commit or metrics file of an earlier
    attempt says nothing about this one). Steps are MaxText's loop steps: checkpoint k holds the state
    after step k (a restore from it trains step k + 1 next), a metrics file "to_step_k" and the log's
    "completed step: k" say step k was done.
    - step: the newest of the attempt's commit and its metrics files;
    - updated_at: when that evidence was written (the hang clock runs from it);
    - restored_step: the step the attempt was started from (the operator's latest committed step,
      which is what MaxText restores: it resumes from the latest committed step of its run directory).
    """
    evidence: list[tuple[int, datetime]] = []
    if latest is not None and latest.committed_at is not None and latest.committed_at >= attempt_started:
        evidence.append((latest.step, latest.committed_at))
    evidence += [(m.last_step, m.written_at) for m in metrics if m.written_at >= attempt_started]
    if not evidence:
        return None
    return contract.ProgressRecord(
        step=max(step for step, _ in evidence),
        attempt=attempt,
        updated_at=contract.format_time(max(moment for _, moment in evidence)),
        uid=uid or "",
        restored_step=resume_step,
        resumed_from_step=resume_step,
        last_committed_step=latest.step if latest is not None else None,
        state="running",
    )


def _last_flag(args: Sequence[str], key: str) -> str | None:
    """The value MaxText reads for `key` from the args (OmegaConf: the last one wins)."""
    value = None
    for arg in args:
        if arg.startswith(f"{key}="):
            value = arg.partition("=")[2].strip()
    return value


# MaxText's `steps` when the args do not set it (configs/base.yml); -1 inherits learning_rate_schedule_steps.
DEFAULT_STEPS = 150_001


def final_step(args: Sequence[str]) -> int | None:
    """The step of MaxText's last checkpoint when it trains to the end: its loop runs steps 0 ..
    steps - 1 and saves the last one on completion. None when the args do not say (steps=-1, a value
    that is not a number, or save_checkpoint_on_completion=false: no final checkpoint is written)."""
    if (_last_flag(args, "save_checkpoint_on_completion") or "true").lower() in ("false", "0", "no"):
        return None
    try:
        steps = int((_last_flag(args, "steps") or str(DEFAULT_STEPS)).replace("_", ""))
    except ValueError:
        return None
    return steps - 1 if steps > 0 else None


def metrics_window(args: Sequence[str], latest_committed: int | None) -> tuple[bool, int]:
    """Whether gcs_metrics is on, and the first step of the metrics file that holds the latest commit
    (files are listed from there: bounded by the steps trained since the last commit)."""
    enabled = (_last_flag(args, "gcs_metrics") or "false").lower() in ("true", "1", "yes")
    try:
        period = max(1, int(_last_flag(args, "log_period") or DEFAULT_LOG_PERIOD))
    except ValueError:
        period = DEFAULT_LOG_PERIOD
    start = 0 if latest_committed is None else (latest_committed // period) * period
    return enabled, start


# --- the bounded GCS reads --------------------------------------------------------------------------

_COMMIT_TIMES: OrderedDict[tuple[str, int], datetime | None] = OrderedDict()
_COMMIT_TIMES_KEPT = 512  # a committed step's metadata never changes: read it once


def current_jobset(tj: TrainingJob, jobsets: Sequence[JobSetFacts]) -> JobSetFacts | None:
    uid = tj.metadata.get("uid")
    return next((js for js in jobsets if js.uid == uid and js.attempt == tj.status.attempt and not js.deleting), None)


def read_progress(
    client: storage.Client, tj: TrainingJob, latest: int | None, jobsets: Sequence[JobSetFacts]
) -> contract.ProgressRecord | None:
    """One metadata read for the newest committed step (cached), plus, with gcs_metrics=true, one
    listing of the metrics files from the latest commit's on. Raises checkpoints.StorageError."""
    # The GCS client stack only where storage is read: api.py (the CRD generator) imports this package.
    from google.api_core import exceptions as gcs_errors

    from .. import checkpoints

    # The same failures and bounds as every other read of the run directory.
    failures = checkpoints._STORAGE_FAILURES
    bounds: dict[str, Any] = {"timeout": checkpoints._TIMEOUT_SECONDS, "retry": checkpoints._RETRY}
    current = current_jobset(tj, jobsets)
    if current is None:
        return None
    bucket_name, prefix = checkpoints.split_gs_path(tj.run_dir)
    bucket = client.bucket(bucket_name)
    commit = None
    try:
        if latest is not None:
            key = (tj.run_dir, latest)
            if key not in _COMMIT_TIMES:
                blob = bucket.blob(f"{prefix}/{contract.CHECKPOINTS_DIR}/{latest}/{METADATA_FILE}")
                try:
                    raw = blob.download_as_bytes(**bounds)
                except gcs_errors.NotFound:
                    raw = b""
                _COMMIT_TIMES[key] = commit_time(raw)
                while len(_COMMIT_TIMES) > _COMMIT_TIMES_KEPT:
                    _COMMIT_TIMES.popitem(last=False)
            commit = Commit(latest, _COMMIT_TIMES[key])
        files = []
        enabled, start = metrics_window(tj.spec.args or [], latest)
        if enabled:
            names = f"{prefix}/{METRICS_DIR}/metrics_step_"
            listing = client.list_blobs(bucket, prefix=names, start_offset=f"{names}{start:06}", **bounds)
            for blob in listing:
                last = metrics_last_step(blob.name)
                if last is not None and blob.updated is not None:
                    files.append(MetricsFile(last, blob.updated))
    except failures as error:
        raise checkpoints.storage_error(f"reading MaxText's progress under {tj.run_dir}", tj.run_dir, error) from error
    return progress(
        uid=tj.metadata.get("uid"),
        attempt=current.attempt,
        attempt_started=current.resumed_at or current.created,
        resume_step=current.resume_step,
        latest=commit,
        metrics=files,
    )


class MaxText:
    name = MAXTEXT
    progress_from_listing = True  # it writes no progress record: read_progress derives one
    slice_index_env: tuple[str, ...] = (JOB_INDEX,)
    entrypoint: tuple[str, ...] = ("python3", "-m", "maxtext.trainers.pre_train.train")  # MaxText images
    cel_rules: Sequence[JsonValue] = MAXTEXT_CEL_RULES

    def refusals(self, spec: Any) -> list[str]:
        return maxtext_refusals(spec)

    def args(self, tj: TrainingJob) -> list[str]:
        """MaxText's checkpoint flags after the user's args (OmegaConf: the last one wins)."""
        return [*(tj.spec.args or []), *maxtext_args(tj)]

    def env(self, tj: TrainingJob, coordinator: str, hosts_per_slice: int) -> list[dict[str, Any]]:
        return list(maxtext_env(tj, coordinator, hosts_per_slice))

    def final_step(self, tj: TrainingJob) -> int | None:
        return final_step(tj.spec.args or [])

    def read_progress(
        self, client: storage.Client, tj: TrainingJob, latest: int | None, jobsets: Sequence[JobSetFacts]
    ) -> contract.ProgressRecord | None:
        return read_progress(client, tj, latest, jobsets)


ADAPTER = MaxText()
