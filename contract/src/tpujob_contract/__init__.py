"""The operator <-> trainer contract, in one dependency-free module that both sides import.

- the environment the operator sets in every worker (`Env`), including the resume value (`Resume`);
- the run directory's layout: `<directory>/<namespace>/<name>/{checkpoints/<step>/, progress.json}`
  and the commit rule (a step is committed once Orbax wrote its marker);
- the progress record the trainer writes and the operator reads (`ProgressRecord`, JSON codec);
- the trainer's exit codes, which the operator classifies failures by (`ExitCode`);
- the values both sides and the tooling (devcluster, benches, tests) share: the checkpoint policy
  vocabulary and its defaults, the API groups/versions, the label and annotation keys, the TPU
  resource name.

Nothing here may import anything outside the standard library: it ships in both images.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal, get_args


class Env:
    """Names of the variables the operator sets in every worker container."""

    NAME: Final = "TPUJOB_NAME"
    NAMESPACE: Final = "TPUJOB_NAMESPACE"
    UID: Final = "TPUJOB_UID"  # the TrainingJob's metadata.uid: which incarnation a record belongs to
    ATTEMPT: Final = "TPUJOB_ATTEMPT"
    RESUME: Final = "TPUJOB_RESUME_STEP"  # Resume.encode(): a committed step, "latest" or "fresh"
    RUN_DIR: Final = "TPUJOB_RUN_DIR"
    NUM_SLICES: Final = "TPUJOB_NUM_SLICES"
    # spec.tpu.slices: the size the training math is defined for; an elastic attempt with fewer slices
    # (TPUJOB_NUM_SLICES) accumulates gradients over FULL/NUM microbatches, so each step is the full-size one
    FULL_SLICES: Final = "TPUJOB_FULL_SLICES"
    HOSTS_PER_SLICE: Final = "TPUJOB_HOSTS_PER_SLICE"
    SLICE_ID: Final = "TPUJOB_SLICE_ID"
    COORDINATOR_ADDRESS: Final = "TPUJOB_COORDINATOR_ADDRESS"
    MEGASCALE_COORDINATOR_ADDRESS: Final = "MEGASCALE_COORDINATOR_ADDRESS"
    MEGASCALE_NUM_SLICES: Final = "MEGASCALE_NUM_SLICES"
    MEGASCALE_SLICE_ID: Final = "MEGASCALE_SLICE_ID"
    CHECKPOINT_POLICY: Final = "TPUJOB_CHECKPOINT_POLICY"
    CHECKPOINT_MIN_INTERVAL_SECONDS: Final = "TPUJOB_CHECKPOINT_MIN_INTERVAL_SECONDS"
    CHECKPOINT_INTERVAL_STEPS: Final = "TPUJOB_CHECKPOINT_INTERVAL_STEPS"
    CHECKPOINT_ASYNC: Final = "TPUJOB_CHECKPOINT_ASYNC"
    CHECKPOINT_KEEP_LATEST: Final = "TPUJOB_CHECKPOINT_KEEP_LATEST"
    CHECKPOINT_KEEP_EVERY_STEPS: Final = "TPUJOB_CHECKPOINT_KEEP_EVERY_STEPS"
    CHECKPOINT_SAVE_ON_PREEMPTION: Final = "TPUJOB_CHECKPOINT_SAVE_ON_PREEMPTION"
    # policy "adaptive": the step-time budget for saves, and the bounds of the interval it picks
    CHECKPOINT_OVERHEAD_BUDGET_PERCENT: Final = "TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT"
    CHECKPOINT_MAX_INTERVAL_SECONDS: Final = "TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS"
    # the operator's estimate of the job's mean time between failures (seconds), for Young/Daly
    MTBF_SECONDS: Final = "TPUJOB_MTBF_SECONDS"
    # How long a process waits in JAX's distributed start-up for all its peers: as long as the
    # operator's scheduling and start-up clocks allow (0: for ever), so that those clocks decide
    DISTRIBUTED_INIT_TIMEOUT_SECONDS: Final = "TPUJOB_DISTRIBUTED_INIT_TIMEOUT_SECONDS"
    # spec.restart.hangTimeoutSeconds (0: none): a trainer that cannot write its progress record (storage
    # lost on the workers' side) gives up with exit 3 in half that time, before the operator's clock
    # would take the silence for a hang and charge it to the job
    HANG_TIMEOUT_SECONDS: Final = "TPUJOB_HANG_TIMEOUT_SECONDS"
    # spec.checkpoint.local: the local tier's directory (an emptyDir's mountPath; absent: GCS alone),
    # the steps between its saves, and the step time its saves may block (0: no budget)
    LOCAL_CHECKPOINT_DIR: Final = "TPUJOB_LOCAL_CHECKPOINT_DIR"
    LOCAL_CHECKPOINT_INTERVAL_STEPS: Final = "TPUJOB_LOCAL_CHECKPOINT_INTERVAL_STEPS"
    LOCAL_CHECKPOINT_OVERHEAD_BUDGET_PERCENT: Final = "TPUJOB_LOCAL_CHECKPOINT_OVERHEAD_BUDGET_PERCENT"
    LOCAL_CHECKPOINT_BUDDY_COPIES: Final = "TPUJOB_LOCAL_CHECKPOINT_BUDDY_COPIES"
    # InPlace jobs: the process's own compilation cache (an emptyDir's mountPath), read before the
    # shared one in the run directory; it outlives a restart in place, so the restarted process compiles nothing
    LOCAL_COMPILATION_CACHE_DIR: Final = "TPUJOB_LOCAL_COMPILATION_CACHE_DIR"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every name above: users may not set them (the CRD refuses them in spec.env)."""
        return tuple(v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str))


# The tpujob trainer's length of training: its --steps flag, else this variable (which users may set in
# spec.env), else the default. The operator reads the same to know a run's final step.
STEPS_ENV: Final = "TPUJOB_STEPS"
DEFAULT_STEPS: Final = 100
# More of the trainer's own variables that the tooling (the demo, the benches, the tests) sets:
# how often it writes its progress record, and where its compilation cache is ("off": none).
PROGRESS_INTERVAL_ENV: Final = "TPUJOB_PROGRESS_INTERVAL_SECONDS"
COMPILATION_CACHE_ENV: Final = "TPUJOB_COMPILATION_CACHE_DIR"
# The trainer's local checkpoint tier (spec.checkpoint.local): its default interval and where the
# operator mounts its memory-backed emptyDir (Env.LOCAL_CHECKPOINT_DIR points there).
DEFAULT_LOCAL_INTERVAL_STEPS: Final = 10  # spec.checkpoint.local.intervalSteps' default
DEFAULT_LOCAL_OVERHEAD_BUDGET_PERCENT: Final = 2.0  # spec.checkpoint.local.overheadBudgetPercent's default
DEFAULT_LOCAL_BUDDY_COPIES: Final = True  # spec.checkpoint.local.buddyCopies's default
LOCAL_CHECKPOINT_MOUNT: Final = "/tpujob/local-checkpoints"  # where the operator mounts the emptyDir
LOCAL_COMPILATION_CACHE_MOUNT: Final = "/tpujob/compile-cache"  # InPlace jobs: Env.LOCAL_COMPILATION_CACHE_DIR


@dataclass(frozen=True)
class Resume:
    """Where an attempt starts: exactly a committed step, the latest committed step, or step 0."""

    kind: Literal["step", "latest", "fresh"]
    step: int | None = None

    @staticmethod
    def at(step: int) -> Resume:
        if step < 0:
            raise ValueError(f"a resume step is >= 0, got {step}")
        return Resume("step", step)

    def encode(self) -> str:
        return str(self.step) if self.kind == "step" else self.kind

    @staticmethod
    def parse(text: str) -> Resume:
        """The operator's value; "-1" and "" mean latest (what operators before "latest" wrote)."""
        raw = text.strip().lower()
        if raw in ("", "latest", "-1"):
            return LATEST
        if raw == "fresh":
            return FRESH
        if raw.isdigit():
            return Resume.at(int(raw))
        raise ValueError(f"{Env.RESUME}={text!r}: want a committed step, 'latest' or 'fresh'")


LATEST: Final = Resume("latest")
FRESH: Final = Resume("fresh")

# --- values both sides and the tooling share --------------------------------------------------------

# The checkpoint policies (spec.checkpoint.policy, TPUJOB_CHECKPOINT_POLICY) and the defaults of the
# checkpoint settings: the CRD's defaults, and what the trainer takes when a variable is absent.
CheckpointPolicy = Literal["continuous", "interval", "adaptive"]
CHECKPOINT_POLICIES: Final[tuple[CheckpointPolicy, ...]] = get_args(CheckpointPolicy)
DEFAULT_CHECKPOINT_POLICY: Final[CheckpointPolicy] = "continuous"
DEFAULT_MIN_INTERVAL_SECONDS: Final = 0  # back to back (an int: the CRD shows `default: 0`)
DEFAULT_INTERVAL_STEPS: Final = 100  # policy "interval" without TPUJOB_CHECKPOINT_INTERVAL_STEPS (local runs)
DEFAULT_ASYNC_SAVE: Final = True
DEFAULT_KEEP_LATEST: Final = 3
DEFAULT_KEEP_EVERY_STEPS: Final = 0  # 0: none kept for ever
DEFAULT_SAVE_ON_PREEMPTION: Final = True
DEFAULT_OVERHEAD_BUDGET_PERCENT: Final = 5.0  # policy "adaptive"

# API groups, versions and plurals: the TrainingJob's own, and those of the JobSets and Kueue
# Workloads the operator creates and reads.
TRAININGJOB_GROUP: Final = "tpujob.dev"
TRAININGJOB_VERSION: Final = "v1alpha1"
TRAININGJOB_KIND: Final = "TrainingJob"
TRAININGJOB_PLURAL: Final = "trainingjobs"
JOBSET_GROUP: Final = "jobset.x-k8s.io"
JOBSET_VERSION: Final = "v1alpha2"
JOBSET_PLURAL: Final = "jobsets"
KUEUE_GROUP: Final = "kueue.x-k8s.io"
KUEUE_VERSION: Final = "v1beta2"

# The operator's labels and annotations on its JobSets and their pods.
LABEL_NAME: Final = f"{TRAININGJOB_GROUP}/name"
LABEL_ATTEMPT: Final = f"{TRAININGJOB_GROUP}/attempt"
LABEL_UID: Final = f"{TRAININGJOB_GROUP}/uid"  # the incarnation: a same-name successor never adopts what it labels
ANNOTATION_RESUME_STEP: Final = f"{TRAININGJOB_GROUP}/resume-step"
# "true" while the operator holds the JobSet suspended for spec.suspend; a suspension without it is
# someone else's (a queueing system's), which the operator never lifts.
ANNOTATION_SUSPENDED: Final = f"{TRAININGJOB_GROUP}/suspended"
# Kueue's labels: the LocalQueue a workload waits in, its WorkloadPriorityClass, and the uid of the
# job (here: the JobSet) a Workload stands for.
QUEUE_LABEL: Final = f"{KUEUE_GROUP}/queue-name"
PRIORITY_CLASS_LABEL: Final = f"{KUEUE_GROUP}/priority-class"
KUEUE_JOB_UID_LABEL: Final = f"{KUEUE_GROUP}/job-uid"
# JobSet's: the JobSet a Job or pod belongs to, and which of its child Jobs (here: the slice) it is.
JOBSET_NAME_LABEL: Final = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX_ANNOTATION: Final = "jobset.sigs.k8s.io/job-index"
# GKE's: the node pool and the TPU slice shape on every TPU node, and the TPU chips resource.
NODE_POOL_LABEL: Final = "cloud.google.com/gke-nodepool"
ACCELERATOR_LABEL: Final = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL: Final = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE: Final = "google.com/tpu"

# --- the run directory -------------------------------------------------------------------------------

CHECKPOINTS_DIR: Final = "checkpoints"
# Where the trainer moves a committed step it will never restore, bytes kept (no listing of
# checkpoints/ sees it again): quarantine/<step> a damaged one (or one newer than the step an
# attempt restored instead); superseded/<step> one that a fresh start (TPUJOB_RESUME_STEP=fresh)
# set aside. A name taken already gets a suffix: <step>.1, <step>.2, ...
QUARANTINE_DIR: Final = "quarantine"
SUPERSEDED_DIR: Final = "superseded"
PROGRESS_FILE: Final = "progress.json"
# The trainer's persistent JAX compilation cache, unless TPUJOB_COMPILATION_CACHE_DIR says otherwise.
COMPILATION_CACHE_DIR: Final = "jax-cache"
# Orbax 0.12 on GCS has no atomic rename: it writes the step directory in place and marks it committed
# by writing this file last. A step directory without it is partial (a save cut short).
COMMIT_MARKER: Final = "commit_success.txt"
_STEP_NAME = re.compile(r"^\d+$")


def run_dir(directory: str, namespace: str, name: str) -> str:
    """gs://bucket/prefix/<namespace>/<name>: one job's own subtree."""
    return f"{directory.rstrip('/')}/{namespace}/{name}"


def checkpoints_dir(run: str) -> str:
    return f"{run.rstrip('/')}/{CHECKPOINTS_DIR}"


def step_dir(run: str, step: int) -> str:
    return f"{checkpoints_dir(run)}/{step}"


def commit_marker(run: str, step: int) -> str:
    return f"{step_dir(run, step)}/{COMMIT_MARKER}"


def progress_path(run: str) -> str:
    return f"{run.rstrip('/')}/{PROGRESS_FILE}"


def step_of(entry: str) -> int | None:
    """The step a directory entry under checkpoints/ names, or None (Orbax's temporary directories,
    <step>.orbax-checkpoint-tmp-..., are not digits-only)."""
    name = entry.rstrip("/").rsplit("/", 1)[-1]
    return int(name) if _STEP_NAME.match(name) else None


# --- exit codes ----------------------------------------------------------------------------------------


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1
    BAD_CONFIG = 2
    STORAGE = 3  # checkpoint storage unreachable: at start, or for the progress record while training
    CHECKPOINT_INCOMPATIBLE = 4  # no committed checkpoint could be restored (e.g. a changed model)
    STORAGE_PERMISSION_DENIED = 5  # checkpoint storage answered 401/403: the workers' identity may not use it
    # JAX's distributed runtime could not start: the coordinator address is another process's (a
    # stale peer, another job's coordinator on a shared network), or the service failed to start
    DISTRIBUTED_STARTUP = 6
    PREEMPTED = 143  # 128 + SIGTERM: stopped by SIGTERM, after saving the current step


# How the trainer's termination message starts when it exits STORAGE_PERMISSION_DENIED; the rest is
# "<bucket> as <identity>: <error>", quoted by the operator in the failure's message.
STORAGE_DENIED_PREFIX: Final = "StoragePermissionDenied: "


# --- the progress record -----------------------------------------------------------------------------

State = Literal["starting", "running", "succeeded", "preempted", "failed", "incompatible"]
# The tier an attempt's restored step came from (ProgressRecord.restored_from).
RestoredFrom = Literal["local", "peer", "gcs"]
RESTORED_FROM_LOCAL: Final[RestoredFrom] = "local"  # each process's own local tier
RESTORED_FROM_PEER: Final[RestoredFrom] = "peer"  # a peer slice's local tiers, over the network
RESTORED_FROM_GCS: Final[RestoredFrom] = "gcs"
ERROR_TEXT_LIMIT: Final = 200


@dataclass(frozen=True)
class RestoreFailure:
    """A committed step that could not be restored, and why (shortened)."""

    step: int
    error: str


@dataclass(frozen=True)
class QuarantinedStep:
    """A committed step the trainer moved out of checkpoints/ because it could not be restored."""

    step: int
    path: str  # where its bytes are now: <run dir>/quarantine/<step>[.<n>]


@dataclass(frozen=True)
class ProgressRecord:
    """$TPUJOB_RUN_DIR/progress.json, written by process 0 of the current attempt.

    Times are RFC 3339 UTC strings. The start-up timestamps let the operator split an attempt's
    wall time into start-up, restore and training (the goodput ledger).
    """

    step: int
    attempt: int
    updated_at: str
    state: State = "running"
    uid: str = ""  # the TrainingJob's metadata.uid (TPUJOB_UID)
    loss: float | None = None
    steps_per_second: float | None = None
    last_committed_step: int | None = None
    resumed_from_step: int | None = None  # kept for readers of older records; same as restored_step
    restored_step: int | None = None  # the step actually restored (older than pinned if that one failed)
    restored_from: RestoredFrom | None = None  # its tier; None: nothing restored (or an older trainer)
    restore_failures: tuple[RestoreFailure, ...] = ()
    quarantined: tuple[QuarantinedStep, ...] = ()  # of restore_failures, the steps moved to quarantine/
    # Storage refused this attempt (401/403, exit 5): "gs://bucket as <identity>: <error>".
    storage_denied: str | None = None
    save_failures: int = 0  # saves of this attempt that raised; training went on and retried
    # Why the local tier (spec.checkpoint.local) does not save in this attempt: its volume is too small
    # for the copies it holds, or a save failed. None: it saves, or there is none.
    local_tier_problem: str | None = None
    process_started_at: str | None = None
    storage_ready_at: str | None = None  # the storage probe passed
    restore_started_at: str | None = None
    restore_finished_at: str | None = None
    first_step_at: str | None = None  # the first step of this attempt finished (compilation included)
    save_blocking_seconds: float = 0.0  # training loop blocked by checkpoint saves, this attempt, cumulative
    # The loop is blocked in a checkpoint save since then (None: it is not): the trainer keeps the
    # record fresh meanwhile, for at most the hang timeout, so that a long save is not taken for a hang.
    blocked_in_save_at: str | None = None
    # Policy "adaptive" (None otherwise): the interval between save starts in force, what bound it,
    # the measured cost of one save (blocking + slowdown of steps while it ran in the background),
    # the measured step-time overhead of saving so far, and the MTBF the interval was chosen for.
    checkpoint_interval_seconds: float | None = None
    checkpoint_interval_bound: str | None = None  # "budget", "young_daly", "min" or "max"
    save_cost_seconds: float | None = None
    checkpoint_overhead_percent: float | None = None
    mtbf_seconds: float | None = None

    @property
    def updated(self) -> datetime:
        """updated_at as a datetime (from_json refuses a record whose updated_at does not parse); the
        other times are optional: parse_time them where they are used."""
        moment = parse_time(self.updated_at)
        if moment is None:
            raise ValueError("a progress record without updated_at")
        return moment


def format_time(moment: datetime) -> str:
    """RFC 3339 UTC with microseconds: the record's times, and clocks that add up short intervals."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now_rfc3339() -> str:
    return format_time(datetime.now(UTC))


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def to_json(record: ProgressRecord) -> str:
    return json.dumps(dataclasses.asdict(record), sort_keys=True)


_FIELDS = {f.name for f in dataclasses.fields(ProgressRecord)}
_TIMES = tuple(sorted(name for name in _FIELDS if name.endswith("_at")))


def from_json(raw: str | bytes) -> ProgressRecord:
    """Read a record; unknown keys are ignored (a newer trainer), missing optional ones defaulted.
    Raises ValueError when it is not a record at all."""
    try:
        data: dict[str, Any] = json.loads(raw)
        fields = {k: v for k, v in data.items() if k in _FIELDS}
        fields["step"], fields["attempt"] = int(data["step"]), int(data.get("attempt", 0))
        fields["updated_at"] = str(data["updated_at"])
        for name in _TIMES:  # a reader parses them where it uses them: one that does not parse is refused here
            parse_time(fields.get(name))
        fields["restore_failures"] = tuple(
            RestoreFailure(step=int(f["step"]), error=str(f.get("error", ""))[:ERROR_TEXT_LIMIT])
            for f in data.get("restore_failures") or []
        )
        fields["quarantined"] = tuple(
            QuarantinedStep(step=int(q["step"]), path=str(q.get("path", ""))) for q in data.get("quarantined") or []
        )
        fields["uid"] = str(data.get("uid") or "")
        record = ProgressRecord(**fields)
        record.updated  # noqa: B018 (refuses an empty updated_at)
        return record
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not a progress record: {error!r}") from error
