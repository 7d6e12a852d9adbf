"""TrainingJob API (tpujob.dev/v1alpha1): the single source of truth for the CRD and the operator.

The CRD schema is generated from these models (see crd.py); CEL rules that cannot be expressed in
plain OpenAPI are attached with `cel(...)` next to the field they guard, so the rule, its message
and the field live together.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any, Literal

import tpujob_contract as contract
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from .frameworks import admission
from .tpu import ACCELERATORS, slice_shape

# The API's identity is the contract's (the trainer, the devcluster and the benches name it too);
# these short names stay because the CRD, the client calls and the tests use them everywhere.
GROUP, VERSION = contract.TRAININGJOB_GROUP, contract.TRAININGJOB_VERSION
KIND, PLURAL = contract.TRAININGJOB_KIND, contract.TRAININGJOB_PLURAL
SHORT_NAMES = ["tj"]
# The JobSet is named <name>-a<attempt> and JobSet's webhook refuses it unless its longest pod name,
# <name>-a<attempt>-slice-<slice>-<host>-xxxxx (the Job controller's 5-character suffix), is a DNS-1035
# label (at most 63 characters). The longest name a spec allows (max_name_length) leaves room for up to
# 999 attempts (uncounted restarts included), or spec.restart.maxRestarts if that is more.
DNS_LABEL_LENGTH = 63
MIN_RESERVED_ATTEMPTS = 999
# "-a" + "-slice-" + "-" + "-xxxxx": what the name of the longest pod adds besides its numbers.
POD_NAME_OVERHEAD = len("-a") + len("-slice-") + len("-") + len("-xxxxx")
DNS_1035_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_DNS_MESSAGE = (
    "metadata.name must start with a lowercase letter and consist of lowercase letters, digits and '-' "
    "(no dots, ending with a letter or digit): the JobSet, its Service and its pods are named after it"
)
NAME_LENGTH_MESSAGE = (
    "metadata.name must be at most {limit} characters for this spec: its longest pod name, "
    "<name>-a<attempt>-slice-<slice>-<host>-xxxxx, must fit in 63 characters, with attempts up to "
    "max(999, spec.restart.maxRestarts)"
)

# Upper bounds of the spec's numbers: every value the operator computes with (backoff, deadlines,
# datetimes) stays in range, and the CEL cost estimate of every rule stays within budget.
MAX_SECONDS = 7 * 24 * 3600  # restart backoff and every stage timeout: at most a week
MAX_MIN_INTERVAL_SECONDS = 24 * 3600
MAX_RESTARTS = 10_000
# The restart ladder's rungs (spec.restart.strategy): the first a failure takes. Recreate, the default,
# runs on every cluster; InPlace needs alpha feature gates and JobSet's agent in the image.
RestartStrategy = Literal["InPlace", "Recreate"]
RECREATE: RestartStrategy = "Recreate"
IN_PLACE: RestartStrategy = "InPlace"
MAX_KEEP_LATEST = 1000
MAX_STEPS = 1_000_000_000
MAX_ENV = 256
MAX_ENV_NAME_LENGTH = 256
MAX_COMMAND = 256
MAX_ARGS = 1024
MAX_RESOURCES = 32
MAX_QUANTITY_LENGTH = 64
MAX_SLICES = 256
MAX_IMAGE_LENGTH = 1024  # a registry/repository:tag@digest reference fits in far less

# Environment variables the operator sets in every worker (jobset.trainer_env): the contract's
# names, outside the reserved prefixes. spec.env may not name them; a test builds a JobSet and
# checks that every variable the operator adds is covered here, so the two cannot drift.
OPERATOR_ENV_PREFIXES: tuple[str, ...] = ("TPUJOB_CHECKPOINT_", "MEGASCALE_")
OPERATOR_ENV_NAMES: tuple[str, ...] = tuple(
    n for n in contract.Env.names() if not n.startswith(("TPUJOB_CHECKPOINT_", "MEGASCALE_"))
)
# Kubernetes' rule for container env names.
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


def is_operator_env(name: str) -> bool:
    """Whether the operator itself sets this variable in the trainer container."""
    return name in OPERATOR_ENV_NAMES or name.startswith(OPERATOR_ENV_PREFIXES)


Accelerator = Literal["tpu-v4-podslice", "tpu-v5p-slice", "tpu-v5-lite-podslice", "tpu-v6e-slice"]
assert set(Accelerator.__args__) == set(ACCELERATORS), "Accelerator literal drifted from tpu.ACCELERATORS"  # type: ignore[attr-defined]

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
TERMINAL_PHASES: tuple[Phase, ...] = ("Succeeded", "Failed")  # decided for good: nothing runs again
FailureKind = Literal[
    "Preemption",
    "ApplicationError",
    "Hang",
    "StartupTimeout",
    "SchedulingTimeout",
    "NodeLost",
    "StorageUnavailable",
    "CheckpointIncompatible",
    "StoragePermissionDenied",
    "StartupFailure",
    "Unknown",
]
# Which clock a live job is on; each has its own deadline (spec.restart.*TimeoutSeconds).
Stage = Literal["Queued", "Scheduling", "StartingUp", "Training", "BackingOff", "Suspended", "Finished"]


def cel(
    rule: str, message: str, field_path: str | None = None, message_expression: str | None = None
) -> dict[str, JsonValue]:
    """One x-kubernetes-validations entry; the message always names the field it is about.

    A messageExpression (CEL, evaluated on a failure) can name the offending value; the static
    message stays as the fallback the apiserver uses when the expression cannot be evaluated.
    """
    validation: dict[str, JsonValue] = {"rule": rule, "message": message}
    if message_expression:
        validation["messageExpression"] = message_expression
    if field_path:
        validation["fieldPath"] = field_path
    return validation


def _dns_subdomain_rule(field: str) -> dict[str, JsonValue]:
    return cel(f"self.matches('{DNS_SUBDOMAIN_PATTERN}')", DNS_SUBDOMAIN_MESSAGE.format(field=field))


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


RESERVED_ENV_MESSAGE = "spec.env[].name must not name a variable the operator sets: " + ", ".join(
    [*OPERATOR_ENV_NAMES, *(f"{p}*" for p in OPERATOR_ENV_PREFIXES)]
)
ENV_VALUE_AND_VALUE_FROM_MESSAGE = "spec.env[].value and spec.env[].valueFrom are mutually exclusive"
# A Pod's env[].valueFrom sources: exactly one of them (the Job controller refuses the pods otherwise).
VALUE_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")
VALUE_FROM_MESSAGE = "spec.env[].valueFrom must set exactly one of " + ", ".join(VALUE_SOURCES)
ENV_NAME_MESSAGE = "spec.env[].name must consist of letters, digits, '_', '-' and '.', and must not start with a digit"
IMAGE_MESSAGE = "spec.image must not have leading or trailing whitespace"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
DNS_SUBDOMAIN_MESSAGE = (
    "spec.{field} must be lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
)
TPU_RESOURCE_MESSAGE = (
    f"spec.resources.{{field}} must not set {contract.TPU_RESOURCE}: the operator requests the slice's TPU chips itself"
)
LOCAL_SIZE_MESSAGE = "spec.checkpoint.local.sizeLimit must be a positive Kubernetes quantity (e.g. 64Gi)"
QUANTITY_MESSAGE = "spec.resources.{field} values must be non-negative Kubernetes quantities (e.g. 4, 500m, 16Gi, 1.5)"
# The apiserver names a map value's key in its path (spec.resources.requests[cpu]); so does the model.
QUANTITY_KEY_MESSAGE = "spec.resources.{field}[{key}]: " + QUANTITY_MESSAGE
REQUEST_ABOVE_LIMIT_MESSAGE = "spec.resources.requests.{key} must not exceed spec.resources.limits.{key}"
# Resources whose request-above-limit refusal names them; any other is refused as "a resource".
NAMED_RESOURCES = ("cpu", "memory", "ephemeral-storage")
# gs://bucket[/prefix], for RE2 and Python alike (\S: ASCII whitespace in RE2, and in Python with re.ASCII).
DIRECTORY_PATTERN = r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/\S*)?$"
DIRECTORY_MESSAGE = (
    "spec.checkpoint.directory must be gs://BUCKET or gs://BUCKET/PREFIX: the bucket name is 3-222 lowercase "
    "letters, digits, dots, dashes and underscores, starting and ending with a letter or digit, and the path "
    "has no whitespace"
)
DIRECTORY_IMMUTABLE_MESSAGE = (
    "spec.checkpoint.directory is immutable: the run's checkpoints are under it (another location is another "
    "TrainingJob)"
)
FRAMEWORK_IMMUTABLE_MESSAGE = (
    "spec.framework is immutable: the run's checkpoints and progress are laid out by it (another framework is "
    "another TrainingJob)"
)
TOPOLOGY_PATTERN = r"^[0-9]+x[0-9]+(x[0-9]+)?$"
TOPOLOGY_MESSAGE = "spec.tpu.topology must be two or three numbers joined by x, e.g. 2x2x2 or 4x4"
DIRECTORY_EMPTY_SEGMENT_MESSAGE = "spec.checkpoint.directory must not contain an empty path segment (//)"
DIRECTORY_DOT_SEGMENT_MESSAGE = "spec.checkpoint.directory must not contain a . or .. path segment"
BACKOFF_MESSAGE = "spec.restart.maxBackoffSeconds must be at least spec.restart.backoffSeconds"
ADAPTIVE_ONLY_MESSAGE = "spec.checkpoint.{field} applies only to spec.checkpoint.policy adaptive"
MAX_INTERVAL_MESSAGE = "spec.checkpoint.maxIntervalSeconds must be at least spec.checkpoint.minIntervalSeconds"
ELASTIC_BELOW_FULL_MESSAGE = (
    "spec.elastic.minSlices must be less than spec.tpu.slices: an elastic job runs on fewer slices than its full size"
)
ELASTIC_DIVISOR_MESSAGE = (
    "spec.elastic.minSlices: no slice count from minSlices up to below spec.tpu.slices divides spec.tpu.slices "
    "(a reduced size must divide it: each step then accumulates tpu.slices / size microbatches of the full-size shape)"
)
MAX_OVERHEAD_BUDGET_PERCENT = 50.0

# What k8s.io/apimachinery resource.ParseQuantity (and so CEL isQuantity()) accepts: an optionally
# signed decimal number, then a binary-SI suffix, a decimal-SI suffix or a decimal exponent. Like
# Kubernetes, the digits may be missing ("Gi", "m" and "." parse as zero), but not the whole string.
_QUANTITY = re.compile(r"^[+-]?([0-9]*(\.[0-9]*)?)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?\Z")


def is_quantity(value: int | str) -> bool:
    """A non-negative Kubernetes quantity (what the CRD's isQuantity()/isLessThan() rule accepts)."""
    if isinstance(value, int):
        return value >= 0
    match = _QUANTITY.match(value)
    if not value or len(value) > MAX_QUANTITY_LENGTH or match is None:
        return False
    return not (value.startswith("-") and any(c in "123456789" for c in match.group(1)))


# Binary and decimal SI suffixes (resource.Quantity's), for comparing a request with its limit.
_SUFFIXES: dict[str, int | Decimal] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_SUFFIXES |= {s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9),
              ("T", 12), ("P", 15), ("E", 18))}  # fmt: skip


def quantity_value(value: int | str) -> Decimal:
    """The number a Kubernetes quantity stands for (is_quantity(value) must hold)."""
    if isinstance(value, int):
        return Decimal(value)
    match = _QUANTITY.match(value)
    assert match is not None, value
    digits = match.group(1)
    number = Decimal(value[: match.start(3)] if match.start(3) >= 0 else value) if digits.strip(".") else Decimal(0)
    suffix = match.group(3) or ""
    if suffix and suffix not in _SUFFIXES:  # a decimal exponent, e.g. 1e3 (E alone is exa)
        return number * Decimal(10) ** int(suffix[1:])
    return number * _SUFFIXES.get(suffix, 1)


# On each value of the map, so that the apiserver's path names the key (a messageExpression that
# named it would cost too much: a map key's length has no bound CEL can know).
def _quantity_rule(field: str) -> dict[str, JsonValue]:
    return cel(
        # int-or-string: an integer arrives as a CEL int, anything else as a string.
        "type(self) == int ? self >= 0 "
        ": (isQuantity(string(self)) && !quantity(string(self)).isLessThan(quantity('0')))",
        QUANTITY_MESSAGE.format(field=field),
    )


def _resource_rules(field: str) -> list[dict[str, JsonValue]]:
    return [cel(f"!('{contract.TPU_RESOURCE}' in self)", TPU_RESOURCE_MESSAGE.format(field=field))]


def _request_within_limit_rules() -> list[dict[str, JsonValue]]:
    """One rule per named resource (its message names it), one for every other resource."""

    def exceeds(key: str) -> str:
        request, limit = f"string(self.requests[{key}])", f"string(self.limits[{key}])"
        return (
            f"{key} in self.requests && {key} in self.limits && isQuantity({request}) && isQuantity({limit}) "
            f"&& quantity({request}).compareTo(quantity({limit})) > 0"
        )

    both = "!has(self.requests) || !has(self.limits) || "
    named = [
        cel(f"{both}!({exceeds(repr(key))})", REQUEST_ABOVE_LIMIT_MESSAGE.format(key=key)) for key in NAMED_RESOURCES
    ]
    other = cel(
        f"{both}!self.requests.exists(k, !(k in {_cel_list(NAMED_RESOURCES)}) && {exceeds('k')})",
        REQUEST_ABOVE_LIMIT_MESSAGE.replace(".{key}", "") + " for any resource",
    )
    return [*named, other]


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are refused by the CRD schema."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class EnvVar(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    f"!(self.name in {_cel_list(OPERATOR_ENV_NAMES)})"
                    + "".join(f" && !self.name.startsWith('{p}')" for p in OPERATOR_ENV_PREFIXES),
                    RESERVED_ENV_MESSAGE,
                    ".name",
                    message_expression=(
                        "'spec.env[].name ' + self.name + ' is set by the operator and cannot be set in spec.env'"
                    ),
                ),
                cel(
                    "!has(self.valueFrom) || !has(self.value) || size(self.value) == 0",
                    ENV_VALUE_AND_VALUE_FROM_MESSAGE,
                    ".valueFrom",
                ),
                cel(
                    "!has(self.valueFrom) || "
                    + " + ".join(f"(has(self.valueFrom.{source}) ? 1 : 0)" for source in VALUE_SOURCES)
                    + " == 1",
                    VALUE_FROM_MESSAGE,
                    ".valueFrom",
                ),
            ]
        }
    )

    name: str = Field(
        min_length=1,
        max_length=MAX_ENV_NAME_LENGTH,
        json_schema_extra={"x-kubernetes-validations": [cel(f"self.matches('{ENV_NAME_PATTERN}')", ENV_NAME_MESSAGE)]},
        description=(
            "Environment variable name. Names the operator sets (TPUJOB_NAME, TPUJOB_RUN_DIR, ..., "
            "TPUJOB_CHECKPOINT_*, MEGASCALE_*) are refused; trainer knobs such as TPUJOB_MODEL are allowed."
        ),
    )
    value: str | None = Field(default=None, description="Literal value.")
    # The sources are typed (each as the Pod API has it, checked by the Job controller), so that a rule
    # can count them; anything else under valueFrom is pruned by the apiserver.
    value_from: Annotated[
        dict[str, Any] | None,
        WithJsonSchema(
            {
                "type": "object",
                "properties": {
                    source: {"type": "object", "x-kubernetes-preserve-unknown-fields": True} for source in VALUE_SOURCES
                },
            }
        ),
    ] = Field(
        default=None,
        description="Source of the value, as in a Pod's env[].valueFrom: exactly one of " + ", ".join(VALUE_SOURCES),
    )

    @field_validator("name")
    @classmethod
    def _not_set_by_the_operator(cls, name: str) -> str:
        if not re.match(ENV_NAME_PATTERN, name):
            raise ValueError(ENV_NAME_MESSAGE)
        if is_operator_env(name):
            raise ValueError(RESERVED_ENV_MESSAGE)
        return name

    @model_validator(mode="after")
    def _value_or_value_from(self) -> EnvVar:
        if self.value and self.value_from is not None:
            raise ValueError(ENV_VALUE_AND_VALUE_FROM_MESSAGE)
        if self.value_from is not None and sum(source in self.value_from for source in VALUE_SOURCES) != 1:
            raise ValueError(VALUE_FROM_MESSAGE)
        return self


# A resource quantity given as a string (500m, 16Gi); an integer needs no bound on its length.
Quantity = Annotated[str, Field(max_length=MAX_QUANTITY_LENGTH)]


class Resources(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": _request_within_limit_rules()}  # type: ignore[dict-item]
    )

    requests: (
        dict[
            str,
            Annotated[
                int | Quantity, Field(json_schema_extra={"x-kubernetes-validations": [_quantity_rule("requests")]})
            ],
        ]
        | None
    ) = Field(
        default=None,
        max_length=MAX_RESOURCES,
        description=(
            "Extra container resource requests (cpu, memory), as Kubernetes quantities. "
            "google.com/tpu is set by the operator and refused here."
        ),
        json_schema_extra={"x-kubernetes-validations": _resource_rules("requests")},  # type: ignore[dict-item]
    )
    limits: (
        dict[
            str,
            Annotated[
                int | Quantity, Field(json_schema_extra={"x-kubernetes-validations": [_quantity_rule("limits")]})
            ],
        ]
        | None
    ) = Field(
        default=None,
        max_length=MAX_RESOURCES,
        description=(
            "Extra container resource limits, as Kubernetes quantities. "
            "google.com/tpu is set by the operator and refused here."
        ),
        json_schema_extra={"x-kubernetes-validations": _resource_rules("limits")},  # type: ignore[dict-item]
    )

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, values: dict[str, int | str] | None, info: ValidationInfo) -> dict[str, int | str] | None:
        field = str(info.field_name)
        if values is not None and contract.TPU_RESOURCE in values:
            raise ValueError(TPU_RESOURCE_MESSAGE.format(field=field))
        bad = [key for key, value in (values or {}).items() if not is_quantity(value)]
        if bad:
            raise ValueError("; ".join(QUANTITY_KEY_MESSAGE.format(field=field, key=key) for key in bad))
        return values

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        requests, limits = self.requests or {}, self.limits or {}
        above = [k for k, v in requests.items() if k in limits and quantity_value(v) > quantity_value(limits[k])]
        if above:
            raise ValueError("; ".join(REQUEST_ABOVE_LIMIT_MESSAGE.format(key=key) for key in above))
        return self


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
        max_length=32,
        description="Slice topology, as on the node label cloud.google.com/gke-tpu-topology (e.g. 2x2x2, 4x4).",
        json_schema_extra={"x-kubernetes-validations": [cel(f"self.matches('{TOPOLOGY_PATTERN}')", TOPOLOGY_MESSAGE)]},
    )
    slices: int = Field(default=1, ge=1, le=MAX_SLICES, description="Number of TPU slices (one JobSet child Job each).")

    @field_validator("topology")
    @classmethod
    def _topology_shape(cls, topology: str) -> str:
        if not re.match(TOPOLOGY_PATTERN, topology):
            raise ValueError(TOPOLOGY_MESSAGE)
        return topology


class KeepSpec(ApiModel):
    latest: int = Field(
        default=contract.DEFAULT_KEEP_LATEST,
        ge=1,
        le=MAX_KEEP_LATEST,
        description="Keep the latest N committed checkpoints.",
    )
    every_steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STEPS,
        description="Also keep every checkpoint whose step is a multiple of this, forever.",
    )


class LocalCheckpointSpec(ApiModel):
    """The local tier: each worker also saves to a memory-backed emptyDir on its node, which outlives an
    in-place restart (spec.restart.strategy InPlace) but not the pod; GCS stays the persistent tier."""

    interval_steps: int = Field(
        default=contract.DEFAULT_LOCAL_INTERVAL_STEPS,
        ge=1,
        le=MAX_STEPS,
        description=(
            "Steps between local saves at the most (each save starts when the last one finished); the trainer "
            "saves every multiple of it that keeps the saves within overheadBudgetPercent."
        ),
    )
    overhead_budget_percent: float = Field(
        default=contract.DEFAULT_LOCAL_OVERHEAD_BUDGET_PERCENT,
        ge=0,
        le=100,
        description=(
            "Step time the local saves may cost, in percent: after its first saves the trainer measures what a "
            "save costs (the loop blocked in it, and the steps beside its background write slowed) and what a "
            "step takes, saves every smallest multiple of intervalSteps that stays within it, and first pays back "
            "what the first saves spent beyond it (every process alike). 0: every intervalSteps steps whatever "
            "it costs."
        ),
    )
    size_limit: Quantity = Field(
        description=(
            "sizeLimit of the memory-backed emptyDir (e.g. 64Gi): three copies of one host's checkpoint state "
            "(the two newest local steps and the one being written), six with buddyCopies on a one-slice job of "
            "several hosts (each also keeps its buddy's); it counts against the node's memory. Too small, the "
            "local tier does not save (condition LocalCheckpointTierSaving False) and GCS saves go on; too small "
            "for the buddy copies alone, those are off."
        ),
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))", LOCAL_SIZE_MESSAGE)
            ]
        },
    )

    buddy_copies: bool = Field(
        default=contract.DEFAULT_LOCAL_BUDDY_COPIES,
        description=(
            "On a job of one slice of several hosts, where no other slice holds a host's shards: each host also "
            "keeps the next host's newest local steps (sent over the pod network after each local save), so a "
            "host whose node was replaced restores from its buddy's memory instead of GCS. Takes as much room "
            "again in sizeLimit."
        ),
    )

    @field_validator("size_limit")
    @classmethod
    def _positive_quantity(cls, value: str) -> str:
        if not is_quantity(value) or quantity_value(value) <= 0:
            raise ValueError(LOCAL_SIZE_MESSAGE)
        return value


class CheckpointSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.policy != 'interval' || has(self.intervalSteps)",
                    "spec.checkpoint.intervalSteps is required when spec.checkpoint.policy is interval",
                    ".intervalSteps",
                ),
                *(
                    cel(
                        f"self.policy == 'adaptive' || !has(self.{field})",
                        ADAPTIVE_ONLY_MESSAGE.format(field=field),
                        f".{field}",
                    )
                    for field in ("overheadBudgetPercent", "maxIntervalSeconds")
                ),
                cel(
                    "!has(self.maxIntervalSeconds) || !has(self.minIntervalSeconds) "
                    "|| self.maxIntervalSeconds >= self.minIntervalSeconds",
                    MAX_INTERVAL_MESSAGE,
                    ".maxIntervalSeconds",
                ),
            ]
        }
    )

    directory: str = Field(
        max_length=1024,
        description=(
            "GCS location, gs://bucket[/prefix]. Checkpoints are written under "
            "<directory>/<namespace>/<name>/checkpoints/<step>. Empty (//), . and .. path segments are "
            "refused; a single trailing slash is allowed and ignored (gs://b/p/ is the same as gs://b/p). "
            "Immutable: the run's checkpoints are under it."
        ),
        json_schema_extra={
            "x-kubernetes-validations": [
                # A CEL raw string: the pattern reaches RE2 as written.
                cel(f"self.matches(r'{DIRECTORY_PATTERN}')", DIRECTORY_MESSAGE),
                cel("self == oldSelf", DIRECTORY_IMMUTABLE_MESSAGE),
                cel("!self.matches('^gs://.*//')", DIRECTORY_EMPTY_SEGMENT_MESSAGE),
                cel("!self.matches('/[.][.]?(/|$)')", DIRECTORY_DOT_SEGMENT_MESSAGE),
            ]
        },
    )
    policy: contract.CheckpointPolicy = Field(
        default=contract.DEFAULT_CHECKPOINT_POLICY,
        description=(
            "continuous: start a new async save as soon as the previous one finished (no more often than "
            "minIntervalSeconds); interval: save every intervalSteps steps; adaptive: the shortest interval "
            "whose measured step-time cost stays within overheadBudgetPercent, and never shorter than the "
            "Young/Daly optimum for the job's failure rate."
        ),
    )
    min_interval_seconds: float = Field(
        default=contract.DEFAULT_MIN_INTERVAL_SECONDS,
        ge=0,
        le=MAX_MIN_INTERVAL_SECONDS,
        description="Floor between two continuous or adaptive saves, in seconds (0: back to back).",
    )
    overhead_budget_percent: float | None = Field(
        default=None,
        gt=0,
        le=MAX_OVERHEAD_BUDGET_PERCENT,
        description=(
            f"adaptive: step-time overhead allowed for checkpointing, in percent (default "
            f"{contract.DEFAULT_OVERHEAD_BUDGET_PERCENT:g})."
        ),
    )
    max_interval_seconds: float | None = Field(
        default=None,
        gt=0,
        le=MAX_MIN_INTERVAL_SECONDS,
        description="adaptive: ceiling on the interval between two saves, in seconds (default: none).",
    )
    interval_steps: int | None = Field(
        default=None, ge=1, le=MAX_STEPS, description="Steps between saves for the interval policy."
    )
    async_: bool = Field(
        default=contract.DEFAULT_ASYNC_SAVE,
        alias="async",
        description="Save asynchronously (training continues while the save is written).",
    )
    local: LocalCheckpointSpec | None = Field(
        default=None,
        description="A local tier in node memory, restored first after an in-place restart (absent: GCS only).",
    )
    keep: KeepSpec = Field(
        default_factory=KeepSpec,
        description="Which committed checkpoints to keep.",
        json_schema_extra={"default": {}},  # lets the apiserver fill in (and show) the nested defaults
    )
    save_on_preemption: bool = Field(
        default=contract.DEFAULT_SAVE_ON_PREEMPTION,
        description="On SIGTERM (preemption, maintenance), save the current step before exiting.",
    )

    @field_validator("directory")
    @classmethod
    def _clean_path(cls, directory: str) -> str:
        if not re.match(DIRECTORY_PATTERN, directory, re.ASCII):
            raise ValueError(DIRECTORY_MESSAGE)
        path = directory.removeprefix("gs://")
        if "//" in path:
            raise ValueError(DIRECTORY_EMPTY_SEGMENT_MESSAGE)
        if any(segment in (".", "..") for segment in path.split("/")):
            raise ValueError(DIRECTORY_DOT_SEGMENT_MESSAGE)
        return directory

    @model_validator(mode="after")
    def _adaptive_fields(self) -> CheckpointSpec:
        """The CEL rules above, for objects that reach the operator without the apiserver (tests, old CRDs)."""
        if self.policy != "adaptive":
            for field, value in (("overheadBudgetPercent", self.overhead_budget_percent),
                                 ("maxIntervalSeconds", self.max_interval_seconds)):  # fmt: skip
                if value is not None:
                    raise ValueError(ADAPTIVE_ONLY_MESSAGE.format(field=field))
        if self.max_interval_seconds is not None and self.max_interval_seconds < self.min_interval_seconds:
            raise ValueError(MAX_INTERVAL_MESSAGE)
        return self


class InPlaceSpec(ApiModel):
    max_restarts: int = Field(
        default=3,
        ge=0,
        le=MAX_RESTARTS,
        description=(
            "In-place restarts one attempt may take; the failure after them recreates the JobSet (the Recreate "
            "rung), whose attempt starts counting again."
        ),
    )
    recovery_deadline_seconds: int = Field(
        default=300,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "An in-place restart that has not trained a new step this long after the failure is abandoned: the "
            "JobSet is recreated (0 disables)."
        ),
    )


class RestartSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                # has(): the apiserver also checks the `default: {}` of spec.restart, before nested defaulting.
                cel(
                    "!has(self.maxBackoffSeconds) || !has(self.backoffSeconds) "
                    "|| self.maxBackoffSeconds >= self.backoffSeconds",
                    BACKOFF_MESSAGE,
                    ".maxBackoffSeconds",
                )
            ]
        }
    )

    strategy: RestartStrategy = Field(
        default=RECREATE,
        description=(
            "How a failed attempt restarts. Recreate: a new JobSet, every pod rescheduled. InPlace: JobSet's "
            "in-place restart (every worker container restarts on its node, pods and volumes kept; a pod whose "
            "node is gone is recreated), climbing to Recreate after inPlace.maxRestarts or "
            "inPlace.recoveryDeadlineSeconds. InPlace needs JobSet's InPlaceRestart and Kubernetes' "
            "ContainerRestartRules feature gates and the agent in the image (docs/concepts/restart-ladder.md)."
        ),
    )
    in_place: InPlaceSpec = Field(
        default_factory=InPlaceSpec,
        description="The in-place rung of the restart ladder (strategy InPlace).",
        json_schema_extra={"default": {}},
    )
    max_restarts: int = Field(
        default=3, ge=0, le=MAX_RESTARTS, description="Restarts allowed for failures that count against the budget."
    )
    backoff_seconds: int = Field(
        default=10,
        ge=0,
        le=MAX_SECONDS,
        description="Wait before the first restart; doubles with each counted restart.",
    )
    max_backoff_seconds: int = Field(
        default=300, ge=0, le=MAX_SECONDS, description="Upper bound of the restart backoff."
    )
    count_preemptions: bool = Field(
        default=False, description="Whether preemptions and maintenance events count against maxRestarts."
    )
    hang_timeout_seconds: int = Field(
        default=1800,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "Training stage: no new step for this long counts as a Hang (0 disables). Its clock starts at the "
            "attempt's first step and never runs while checkpoint storage is unreachable; a checkpoint save that "
            "blocks training holds it for up to this long."
        ),
    )
    startup_timeout_seconds: int = Field(
        default=3600,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "Start-up stage (all pods scheduled, no step yet: image pull, restore, compilation): a limit on its "
            "length, counted as a StartupTimeout (0 disables)."
        ),
    )
    scheduling_timeout_seconds: int = Field(
        default=0,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "Scheduling stage (not every worker pod scheduled yet, e.g. waiting for TPU capacity): a limit on its "
            "length, counted as a SchedulingTimeout. 0 (the default) waits for capacity forever."
        ),
    )

    @model_validator(mode="after")
    def _backoff_within_bound(self) -> RestartSpec:
        if self.max_backoff_seconds < self.backoff_seconds:
            raise ValueError(BACKOFF_MESSAGE)
        return self


class ElasticSpec(ApiModel):
    min_slices: int = Field(
        ge=1,
        le=MAX_SLICES,
        description=(
            "The fewest slices the job trains on while capacity is lost; a reduced size divides spec.tpu.slices "
            "(its steps accumulate gradients over tpu.slices / size microbatches, so the training math is that "
            "of the full size)."
        ),
    )
    shrink_after_seconds: int = Field(
        default=600,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "How long a slice may stay unschedulable before the job goes on with fewer slices; it grows back "
            "when the node pools are ready again."
        ),
    )
    grow_after_seconds: int = Field(
        default=600,
        ge=30,
        le=MAX_SECONDS,
        description=(
            "The least time between a resize and a grow (a grow restarts the job): the job resizes at most "
            "twice per growAfterSeconds + shrinkAfterSeconds, however capacity comes and goes. It grows only "
            "into ready node pools on which no pod holds TPU chips."
        ),
    )


def elastic_sizes(full: int, minimum: int) -> tuple[int, ...]:
    """The slice counts an elastic job may run on, largest first: the divisors of `full` from `minimum` up."""
    return tuple(d for d in range(full, 0, -1) if full % d == 0 and d >= minimum)


def _elastic_rules() -> list[dict[str, JsonValue]]:
    divisors = list(range(1, MAX_SLICES // 2 + 1))  # a proper divisor is at most half
    return [
        cel(
            "!has(self.elastic) || self.elastic.minSlices < self.tpu.slices",
            ELASTIC_BELOW_FULL_MESSAGE,
            ".elastic.minSlices",
        ),
        cel(
            f"!has(self.elastic) || self.elastic.minSlices >= self.tpu.slices || {divisors}.exists(d, "
            "d >= self.elastic.minSlices && d < self.tpu.slices && self.tpu.slices % d == 0)",
            ELASTIC_DIVISOR_MESSAGE,
            ".elastic.minSlices",
        ),
    ]


class TrainingJobSpec(ApiModel):
    # What a framework cannot honour is refused (frameworks/admission.py: CEL_RULES, refusals).
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [*admission.CEL_RULES, *_elastic_rules()]})

    image: str = Field(
        min_length=1,
        max_length=MAX_IMAGE_LENGTH,
        description="Trainer container image.",
        json_schema_extra={"x-kubernetes-validations": [cel("self == self.trim()", IMAGE_MESSAGE)]},
    )
    framework: Literal["tpujob", "maxtext"] = Field(
        default="tpujob",
        description=(
            "tpujob: the image runs the project's trainer contract (TPUJOB_* env, progress record). maxtext: "
            "the image runs MaxText (python -m maxtext.trainers.pre_train.train) unchanged; the operator "
            "appends MaxText's checkpoint flags to args and sets XPK's start-up env (docs/guides/maxtext.md). "
            "Immutable: the run's checkpoint layout depends on it."
        ),
        json_schema_extra={"x-kubernetes-validations": [cel("self == oldSelf", FRAMEWORK_IMMUTABLE_MESSAGE)]},
    )
    command: list[str] | None = Field(
        default=None, max_length=MAX_COMMAND, description="Container entrypoint (defaults to the image's)."
    )
    args: list[str] | None = Field(default=None, max_length=MAX_ARGS, description="Arguments to the entrypoint.")
    env: list[EnvVar] | None = Field(
        default=None,
        max_length=MAX_ENV,
        description=(
            "Extra environment for the trainer container. Variables the operator sets (the trainer contract) "
            "cannot be set here."
        ),
    )
    resources: Resources | None = Field(default=None, description="Extra container resources besides the TPU chips.")
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        json_schema_extra={"x-kubernetes-validations": [_dns_subdomain_rule("serviceAccountName")]},
        description=(
            "Kubernetes ServiceAccount of the workers (bind it to a GCP one with Workload Identity). Only "
            "those the operator's policy lists are allowed (policy.allowedServiceAccounts); never one in the "
            "operator's own namespace."
        ),
    )
    automount_service_account_token: bool = Field(
        default=False,
        description=(
            "Mount the ServiceAccount's Kubernetes API token into the workers. Off by default: the trainer "
            "needs no Kubernetes credentials (GKE's Workload Identity does not need the token either)."
        ),
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
    elastic: ElasticSpec | None = Field(
        default=None,
        description=(
            "Keep training on fewer slices while a slice's capacity is lost (off when absent): after "
            "shrinkAfterSeconds of a slice unschedulable the next attempt runs on the largest size that fits "
            "(at least minSlices), restored from the latest committed step; it grows back to spec.tpu.slices "
            "once enough TPU node pools are ready, the running workers saving first."
        ),
    )
    priority_class_name: str | None = Field(
        default=None,
        max_length=253,
        json_schema_extra={"x-kubernetes-validations": [_dns_subdomain_rule("priorityClassName")]},
        description=(
            "PriorityClass of the worker pods (the scheduler's preemption; Kueue's too, unless the "
            "kueue.x-k8s.io/priority-class label names a WorkloadPriorityClass). Only those the operator's "
            "policy lists are allowed (policy.allowedPriorityClasses), here and in that label alike."
        ),
    )

    @field_validator("image")
    @classmethod
    def _image_trimmed(cls, image: str) -> str:
        if image != image.strip():
            raise ValueError(IMAGE_MESSAGE)
        return image

    @field_validator("service_account_name", "priority_class_name")
    @classmethod
    def _dns_subdomain(cls, name: str | None, info: ValidationInfo) -> str | None:
        if name is not None and not re.match(DNS_SUBDOMAIN_PATTERN, name):
            raise ValueError(DNS_SUBDOMAIN_MESSAGE.format(field=to_camel(str(info.field_name))))
        return name

    @model_validator(mode="after")
    def _framework_can_honour_the_policy(self) -> TrainingJobSpec:
        """admission.CEL_RULES and the elastic rules, for objects that reach the operator without the apiserver."""
        refused = admission.refusals(self)
        if self.elastic is not None and self.elastic.min_slices >= self.tpu.slices:
            refused.append(ELASTIC_BELOW_FULL_MESSAGE)
        elif self.elastic is not None and len(elastic_sizes(self.tpu.slices, self.elastic.min_slices)) < 2:
            refused.append(ELASTIC_DIVISOR_MESSAGE)
        if refused:
            raise ValueError("; ".join(refused))
        return self


def _kept_if_unknown(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A status value a newer operator wrote (a phase, stage or failure kind this one does not know) is
    kept as it is: status is read, never refused (an operator rolled back must go on reconciling)."""
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, str):
            return value
        raise


def _closed(schema: dict[str, Any]) -> None:
    schema.pop("additionalProperties", None)  # what status keeps changes nothing in the CRD's schema


class StatusModel(ApiModel):
    """Status, written by the operator: fields a newer one added are kept and written back, not dropped."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_closed)


KeptPhase = Annotated[Phase, WrapValidator(_kept_if_unknown)]
KeptStage = Annotated[Stage, WrapValidator(_kept_if_unknown)]
KeptFailureKind = Annotated[FailureKind, WrapValidator(_kept_if_unknown)]


class Condition(StatusModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class CheckpointRef(StatusModel):
    step: int = Field(description="Latest committed checkpoint step in GCS.")
    time: str | None = Field(default=None, description="When the operator first saw it committed.")


class FailureTimeline(StatusModel):
    """When each stage of one recovery happened (RFC 3339); absent until it has."""

    failed: str | None = Field(default=None, description="The first worker failed (its pod's finish time).")
    detected: str | None = Field(default=None, description="The operator saw the failure and decided the restart.")
    job_set_created: str | None = Field(default=None, description="The replacement JobSet was created.")
    pods_scheduled: str | None = Field(default=None, description="Every pod of the replacement was scheduled.")
    restored: str | None = Field(default=None, description="The replacement restored its checkpoint (trainer).")
    first_new_step: str | None = Field(default=None, description="The replacement trained its first step.")


class Badput(StatusModel):
    """Seconds of the job's wall time that did not train, by cause (ml-goodput-measurement's categories)."""

    scheduling_seconds: float = Field(default=0, description="Waiting for pods to be scheduled (capacity).")
    startup_seconds: float = Field(
        default=0, description="Pods placed to first step, restore excluded: image pull, process start, compilation."
    )
    restore_seconds: float = Field(default=0, description="Restoring checkpoints (the trainer's measurement).")
    checkpoint_save_seconds: float = Field(default=0, description="Training loop blocked by checkpoint saves.")
    wasted_progress_seconds: float = Field(default=0, description="Re-training the steps that failures lost.")
    infrastructure_recovery_seconds: float = Field(
        default=0,
        description="A failure until its replacement's pods are all scheduled (detection, backoff, teardown).",
    )
    suspended_seconds: float = Field(default=0, description="Suspended (spec.suspend or another controller).")
    queued_seconds: float = Field(default=0, description="Waiting in a Kueue queue for admission (quota).")
    reduced_size_seconds: float = Field(
        default=0,
        description="Training on fewer slices than spec.tpu.slices (spec.elastic): the share of the missing slices.",
    )


class Goodput(StatusModel):
    """The job's time ledger, across attempts: wall time = productive + every badput cause."""

    ratio: float | None = Field(default=None, description="Productive seconds / wall seconds.")
    wall_seconds: float = 0
    productive_seconds: float = 0
    badput: Badput = Field(default_factory=Badput)
    updated_at: str | None = Field(default=None, description="The ledger counts time up to here.")
    # Bookkeeping for the current attempt: what of its trainer's cumulative numbers is counted already.
    attempt: int = 0
    attempt_save_seconds: float = 0
    attempt_restore_seconds: float = 0


class FailureEvidence(StatusModel):
    """The node signal that made a failure the infrastructure's (see the operator's nodes.py)."""

    node: str = Field(description="The node one of the attempt's pods was bound to.")
    pod: str = Field(description="The pod on that node.")
    signal: str = Field(
        description="NodeGone, NodeDeleting, NodeNotReady, NodeUnreachable, NodeOutOfService, NodeTerminating, "
        "NodeDrained or NodeMaintenance."
    )
    detail: str = Field(default="", description="What the node said: its Ready condition, the taint or the label.")
    since: str | None = Field(
        default=None,
        description="When the signal began (RFC 3339), or when the operator saw it if the node does not say.",
    )


class FailureRecord(StatusModel):
    time: str
    kind: KeptFailureKind
    reason: str
    message: str = ""
    slice: int | None = Field(default=None, description="Index of the slice that failed, when known.")
    step: int | None = Field(default=None, description="Last step reported before the failure.")
    resume_step: int | None = Field(default=None, description="Committed step the next attempt resumes from.")
    lost_steps: int | None = Field(default=None, description="Steps trained but not checkpointed, lost by the failure.")
    counted: bool = Field(default=True, description="Whether this failure counted against spec.restart.maxRestarts.")
    rung: RestartStrategy | None = Field(
        default=None,
        description="How the job restarted after it: InPlace (same pods) or Recreate (a new JobSet); none if it ended.",
    )
    recovery_seconds: float | None = Field(
        default=None, description="Failure -> first step trained by the replacement attempt, in seconds."
    )
    restored_from: contract.RestoredFrom | None = Field(
        default=None,
        description="Where the replacement's processes restored resumeStep from (the trainer's record): local "
        "(each its own local tier), peer (another slice's local tiers, over the network) or gcs.",
    )
    timeline: FailureTimeline = Field(default_factory=FailureTimeline, description="The recovery, stage by stage.")
    evidence: FailureEvidence | None = Field(
        default=None, description="The node signal that made it NodeLost or Preemption, when the nodes decided it."
    )


class CheckpointCadence(StatusModel):
    """The adaptive policy's interval in force, as the current attempt's trainer reports it."""

    interval_seconds: float | None = Field(default=None, description="Seconds between save starts now.")
    bound: str | None = Field(
        default=None, description="What sets the interval: budget, young_daly, min or max (the spec's bounds)."
    )
    save_cost_seconds: float | None = Field(
        default=None, description="Measured cost of one save: loop blocked + steps slowed while it wrote."
    )
    overhead_percent: float | None = Field(
        default=None, description="Measured step-time overhead of saving in this attempt, in percent."
    )
    mtbf_seconds: float | None = Field(
        default=None, description="The operator's mean-time-between-failures estimate this attempt was given."
    )


class ResizeRecord(StatusModel):
    """A change of the slice count by spec.elastic: not a failure, never counted against the restart budget."""

    time: str
    from_slices: int = Field(description="Slices before.")
    to_slices: int = Field(description="Slices of the attempt that follows.")
    reason: str = Field(description="CapacityLost (a slice stayed unschedulable) or CapacityReturned.")
    message: str = ""
    attempt: int = Field(description="The attempt that runs on to_slices.")
    step: int | None = Field(default=None, description="Latest committed step when it was decided.")


class QueueStatus(StatusModel):
    """Kueue admission of the current attempt (jobs with a queue only)."""

    name: str = Field(description="The LocalQueue (label kueue.x-k8s.io/queue-name, or the operator's default).")
    admitted: bool = Field(default=False, description="Kueue has admitted the current attempt's JobSet.")
    admission_time: str | None = Field(default=None, description="When Kueue admitted it.")
    reason: str | None = Field(default=None, description="Why it waits, as Kueue says it.")


class TrainingJobStatus(StatusModel):
    phase: KeptPhase | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    attempt: int = Field(default=0, description="Current JobSet attempt (0 is the first).")
    restarts: int = Field(default=0, description="Restarts performed after failures, of any kind.")
    counted_restarts: int = Field(default=0, description="Restarts that counted against spec.restart.maxRestarts.")
    uncounted_restarts_without_progress: int = Field(
        default=0,
        description=(
            "Uncounted restarts in a row (infrastructure failures) with no newer committed step between them; "
            "past 10 the job ends Failed (reason RestartsWithoutProgress), still uncounted."
        ),
    )
    in_place_restarts: int = Field(
        default=0, description="Of the restarts, those done in place (the InPlace rung: pods and nodes kept)."
    )
    in_place_round: int = Field(
        default=0,
        description=(
            "In-place restart rounds of the current attempt's JobSet that status accounts for (JobSet's "
            "counter): a round above it is a failure not yet recorded."
        ),
    )
    job_set_name: str | None = None
    step: int | None = Field(default=None, description="Last step reported by the trainer.")
    loss: float | None = None
    save_failures: int | None = Field(
        default=None,
        description=(
            "Checkpoint saves that failed in the attempt that reported the step (training went on and "
            "retried at the next interval); absent when none did."
        ),
    )
    resumed_from_step: int | None = None
    latest_checkpoint: CheckpointRef | None = None
    quarantined_checkpoints: list[int] = Field(
        default_factory=list,
        description=(
            "Committed steps whose data a restore found damaged: moved to quarantine/ in the run directory "
            "(bytes kept), never restored again."
        ),
    )
    last_failure: FailureRecord | None = None
    lost_steps: int = Field(default=0, description="Steps lost to failures over the job's life.")
    start_time: str | None = None
    completion_time: str | None = None
    next_restart_time: str | None = None
    last_progress_time: str | None = None
    checkpoint_storage_error: str | None = Field(
        default=None, description="Why the checkpoint directory could not be read, while it cannot."
    )
    goodput: Goodput | None = Field(default=None, description="Where the job's wall time went, across attempts.")
    stage: KeptStage | None = Field(default=None, description="Which clock the job is on now.")
    stage_start_time: str | None = Field(
        default=None, description="When the current stage's clock started (restarts after a suspension ends)."
    )
    storage_recovery_time: str | None = Field(
        default=None,
        description="When checkpoint storage became readable again after an outage; no clock counts the outage.",
    )
    storage_unavailable_since: str | None = Field(
        default=None,
        description=(
            "When the first of the attempts that failed in a row for unreachable checkpoint storage (exit 3) "
            "failed; the job fails once they span more than an hour."
        ),
    )
    queue: QueueStatus | None = Field(default=None, description="Kueue admission, for jobs that use a queue.")
    checkpoint_cadence: CheckpointCadence | None = Field(
        default=None, description="checkpoint.policy adaptive: the interval in force and what it rests on."
    )
    slices: int | None = Field(
        default=None,
        description="Slices the current attempt runs on: spec.tpu.slices, or fewer while spec.elastic shrank it.",
    )
    resizes: int = Field(default=0, description="Times spec.elastic changed the slice count (neither is a restart).")
    last_resize: ResizeRecord | None = Field(default=None, description="The latest change of the slice count, and why.")


def max_name_length(spec: TrainingJobSpec) -> int:
    """The longest metadata.name JobSet's webhook accepts for every attempt of this spec."""
    hosts = slice_shape(spec.tpu.accelerator, spec.tpu.topology).hosts
    attempts = max(MIN_RESERVED_ATTEMPTS, spec.restart.max_restarts)
    numbers = len(str(attempts)) + len(str(spec.tpu.slices - 1)) + len(str(hosts - 1))
    return DNS_LABEL_LENGTH - POD_NAME_OVERHEAD - numbers


def name_refusals(name: str, spec: TrainingJobSpec) -> list[str]:
    """NAME_RULES, for objects that reach the operator without the apiserver."""
    refused = [] if re.match(DNS_1035_PATTERN, name) else [NAME_DNS_MESSAGE]
    if len(name) > (limit := max_name_length(spec)):
        refused.append(NAME_LENGTH_MESSAGE.format(limit=limit))
    return refused


def _name_rules() -> list[dict[str, JsonValue]]:
    """The CRD's root rules on metadata.name: max_name_length in CEL (a map holds the host digits), one
    rule per possible maximum so that each message says its number (a messageExpression that printed
    it would cost too much)."""
    host_digits = {
        f"{accelerator}/{topology}": len(str(slice_shape(accelerator, topology).hosts - 1))
        for accelerator, family in ACCELERATORS.items()
        for topology in family.topologies
    }
    table = "{" + ", ".join(f"'{shape}': {digits}" for shape, digits in host_digits.items()) + "}"
    shape = "self.spec.tpu.accelerator + '/' + self.spec.tpu.topology"
    restarts = "self.spec.restart.maxRestarts"
    limit = (
        f"({DNS_LABEL_LENGTH - POD_NAME_OVERHEAD}"
        f" - (has(self.spec.restart) && has({restarts}) && {restarts} > {MIN_RESERVED_ATTEMPTS}"
        f" ? size(string({restarts})) : {len(str(MIN_RESERVED_ATTEMPTS))})"
        " - (has(self.spec.tpu) && has(self.spec.tpu.slices) ? size(string(self.spec.tpu.slices - 1)) : 1)"
        f" - (has(self.spec.tpu) && ({shape}) in {table} ? {table}[{shape}] : 1))"
    )
    most_digits = len(str(MAX_RESTARTS)) + len(str(MAX_SLICES - 1)) + max(host_digits.values())
    least_digits = len(str(MIN_RESERVED_ATTEMPTS)) + 1 + min(host_digits.values())
    limits = range(
        DNS_LABEL_LENGTH - POD_NAME_OVERHEAD - most_digits, DNS_LABEL_LENGTH - POD_NAME_OVERHEAD - least_digits + 1
    )
    return [
        cel(
            f"self.metadata.name.matches('{DNS_1035_PATTERN}')",
            NAME_DNS_MESSAGE,
            message_expression=f"'metadata.name ' + self.metadata.name + ' is not valid: ' + {NAME_DNS_MESSAGE!r}",
        ),
        *(
            cel(f"size(self.metadata.name) <= {n} || {limit} != {n}", NAME_LENGTH_MESSAGE.format(limit=n))
            for n in limits
        ),
    ]


class TrainingJob(ApiModel):
    api_version: str = f"{GROUP}/{VERSION}"
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: TrainingJobSpec
    status: TrainingJobStatus = Field(default_factory=TrainingJobStatus)

    @model_validator(mode="after")
    def _name_fits(self) -> TrainingJob:
        refused = name_refusals(str(self.metadata["name"]), self.spec) if self.metadata.get("name") else []
        if refused:
            raise ValueError("; ".join(refused))
        return self

    @property
    def name(self) -> str:
        return str(self.metadata["name"])

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace", "default"))

    @property
    def run_dir(self) -> str:
        """gs://bucket/prefix/<namespace>/<name>: this job's own subtree; nothing else is ever touched."""
        return contract.run_dir(self.spec.checkpoint.directory, self.namespace, self.name)


# The CRD's rules at the root (crd.py): they see metadata.name and the spec together.
NAME_RULES = _name_rules()
