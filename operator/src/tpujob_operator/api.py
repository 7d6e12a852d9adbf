"""TrainingJob API (tpujob.dev/v1alpha1): the single source of truth for the CRD and the operator.

The CRD schema is generated from these models (see crd.py); CEL rules that cannot be expressed in
plain OpenAPI are attached with `cel(...)` next to the field they guard, so the rule, its message
and the field live together.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.alias_generators import to_camel

from .tpu import ACCELERATORS

GROUP = "tpujob.dev"
VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SHORT_NAMES = ["tj"]
# The JobSet is named <name>-a<attempt> and its pods <jobset>-slice-<j>-<p>: keep the pod
# hostname under the 63-character DNS label limit for up to 999 attempts and slices.
MAX_NAME_LENGTH = 40

Accelerator = Literal["tpu-v4-podslice", "tpu-v5p-slice", "tpu-v5-lite-podslice", "tpu-v6e-slice"]
assert set(Accelerator.__args__) == set(ACCELERATORS), "Accelerator literal drifted from tpu.ACCELERATORS"  # type: ignore[attr-defined]

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
FailureKind = Literal["Preemption", "ApplicationError", "Hang", "NodeLost", "Unknown"]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, JsonValue]:
    """One x-kubernetes-validations entry; the message always names the field it is about."""
    validation: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        validation["fieldPath"] = field_path
    return validation


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are refused by the CRD schema."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class EnvVar(ApiModel):
    name: str = Field(min_length=1, description="Environment variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None, description="Source of the value, as in a Pod's env[].valueFrom (secretKeyRef, fieldRef, ...)."
    )


class Resources(ApiModel):
    requests: dict[str, int | str] | None = Field(
        default=None,
        description="Extra container resource requests (cpu, memory). google.com/tpu is set by the operator.",
    )
    limits: dict[str, int | str] | None = Field(
        default=None, description="Extra container resource limits. google.com/tpu is set by the operator."
    )


class TpuSpec(ApiModel):
    # One rule per accelerator, so the message lists exactly the shapes that accelerator offers.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"self.accelerator != '{family.accelerator}' || self.topology in {list(family.topologies)}",
                    f"spec.tpu.topology must be one of {', '.join(family.topologies)} for {family.accelerator}",
                    ".topology",
                )
                for family in ACCELERATORS.values()
            ]
        }
    )

    accelerator: Accelerator = Field(
        description="GKE TPU accelerator, as on the node label cloud.google.com/gke-tpu-accelerator."
    )
    topology: str = Field(
        pattern=r"^[0-9]+x[0-9]+(x[0-9]+)?$",
        description="Slice topology, as on the node label cloud.google.com/gke-tpu-topology (e.g. 2x2x2, 4x4).",
    )
    slices: int = Field(default=1, ge=1, le=256, description="Number of TPU slices (one JobSet child Job each).")


class KeepSpec(ApiModel):
    latest: int = Field(default=3, ge=1, description="Keep the latest N committed checkpoints.")
    every_steps: int | None = Field(
        default=None, ge=1, description="Also keep every checkpoint whose step is a multiple of this, forever."
    )


class CheckpointSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.policy != 'interval' || has(self.intervalSteps)",
                    "spec.checkpoint.intervalSteps is required when spec.checkpoint.policy is interval",
                    ".intervalSteps",
                )
            ]
        }
    )

    directory: str = Field(
        pattern=r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$",
        max_length=1024,
        description=(
            "GCS location, gs://bucket[/prefix]. Checkpoints are written under "
            "<directory>/<namespace>/<name>/checkpoints/<step>."
        ),
    )
    policy: Literal["continuous", "interval"] = Field(
        default="continuous",
        description=(
            "continuous: start a new async save as soon as the previous one finished (no more often than "
            "minIntervalSeconds); interval: save every intervalSteps steps."
        ),
    )
    min_interval_seconds: float = Field(
        default=0, ge=0, description="Floor between two continuous saves, in seconds (0: back to back)."
    )
    interval_steps: int | None = Field(default=None, ge=1, description="Steps between saves for the interval policy.")
    async_: bool = Field(
        default=True, alias="async", description="Save asynchronously (training continues while the save is written)."
    )
    keep: KeepSpec = Field(
        default_factory=KeepSpec,
        description="Which committed checkpoints to keep.",
        json_schema_extra={"default": {}},  # lets the apiserver fill in (and show) the nested defaults
    )
    save_on_preemption: bool = Field(
        default=True, description="On SIGTERM (preemption, maintenance), save the current step before exiting."
    )


class RestartSpec(ApiModel):
    max_restarts: int = Field(
        default=3, ge=0, description="Restarts allowed for failures that count against the budget."
    )
    backoff_seconds: int = Field(
        default=10, ge=0, description="Wait before the first restart; doubles with each counted restart."
    )
    max_backoff_seconds: int = Field(default=300, ge=0, description="Upper bound of the restart backoff.")
    count_preemptions: bool = Field(
        default=False, description="Whether preemptions and maintenance events count against maxRestarts."
    )
    hang_timeout_seconds: int = Field(
        default=1800,
        ge=0,
        description="No step progress for this long while running counts as a failure (0 disables hang detection).",
    )


class TrainingJobSpec(ApiModel):
    image: str = Field(min_length=1, description="Trainer container image.")
    command: list[str] | None = Field(default=None, description="Container entrypoint (defaults to the image's).")
    args: list[str] | None = Field(default=None, description="Arguments to the entrypoint.")
    env: list[EnvVar] | None = Field(default=None, description="Extra environment for the trainer container.")
    resources: Resources | None = Field(default=None, description="Extra container resources besides the TPU chips.")
    service_account_name: str | None = Field(
        default=None,
        description="Kubernetes ServiceAccount of the workers (bind it to a GCP one with Workload Identity).",
    )
    tpu: TpuSpec = Field(
        description="TPU slice shape and count. Immutable after creation.",
        json_schema_extra={"x-kubernetes-validations": [cel("self == oldSelf", "spec.tpu is immutable")]},
    )
    checkpoint: CheckpointSpec = Field(description="Where and how the trainer checkpoints.")
    restart: RestartSpec = Field(
        default_factory=RestartSpec, description="Automatic restart policy.", json_schema_extra={"default": {}}
    )
    suspend: bool = Field(default=False, description="Suspend the job: workers are stopped, checkpoints kept.")


class Condition(ApiModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class CheckpointRef(ApiModel):
    step: int = Field(description="Latest committed checkpoint step in GCS.")
    time: str | None = Field(default=None, description="When the operator first saw it committed.")


class FailureRecord(ApiModel):
    time: str
    kind: FailureKind
    reason: str
    message: str = ""
    slice: int | None = Field(default=None, description="Index of the slice that failed, when known.")
    step: int | None = Field(default=None, description="Last step reported before the failure.")
    resume_step: int | None = Field(default=None, description="Committed step the next attempt resumes from.")
    lost_steps: int | None = Field(default=None, description="Steps trained but not checkpointed, lost by the failure.")
    counted: bool = Field(default=True, description="Whether this failure counted against spec.restart.maxRestarts.")
    recovery_seconds: float | None = Field(
        default=None, description="Failure -> first step trained by the replacement attempt, in seconds."
    )


class TrainingJobStatus(ApiModel):
    phase: Phase | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    attempt: int = Field(default=0, description="Current JobSet attempt (0 is the first).")
    restarts: int = Field(default=0, description="Restarts performed after failures, of any kind.")
    counted_restarts: int = Field(default=0, description="Restarts that counted against spec.restart.maxRestarts.")
    job_set_name: str | None = None
    step: int | None = Field(default=None, description="Last step reported by the trainer.")
    loss: float | None = None
    resumed_from_step: int | None = None
    latest_checkpoint: CheckpointRef | None = None
    last_failure: FailureRecord | None = None
    lost_steps: int = Field(default=0, description="Steps lost to failures over the job's life.")
    start_time: str | None = None
    completion_time: str | None = None
    next_restart_time: str | None = None
    last_progress_time: str | None = None
    checkpoint_storage_error: str | None = Field(
        default=None, description="Why the checkpoint directory could not be read, while it cannot."
    )


class TrainingJob(ApiModel):
    api_version: str = f"{GROUP}/{VERSION}"
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: TrainingJobSpec
    status: TrainingJobStatus = Field(default_factory=TrainingJobStatus)

    @property
    def name(self) -> str:
        return str(self.metadata["name"])

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace", "default"))

    @property
    def run_dir(self) -> str:
        """gs://bucket/prefix/<namespace>/<name>: this job's own subtree; nothing else is ever touched."""
        return f"{self.spec.checkpoint.directory.rstrip('/')}/{self.namespace}/{self.name}"
