"""What each framework refuses at admission, written once for both checks: CEL rules on
TrainingJobSpec for the apiserver (`CEL_RULES`, in the CRD schema) and `refusals` for a spec that
reaches the operator without it (tests, an older CRD), both used by api.py.

api.py imports this module, so it imports nothing of the operator (the spec is duck-typed). The names
a framework reserves live here because they are what its rules refuse; its adapter
(frameworks/maxtext.py) sets them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from pydantic import JsonValue

# --- MaxText (spec.framework: maxtext) ---------------------------------------------------------------

MAXTEXT = "maxtext"
# The TrainingJob field -> MaxText flag mapping (docs/guides/maxtext.md). Names from MaxText 0.2.5's
# configs/base.yml; `enable_autocheckpoint` is its save-at-the-preemption-step flag.
BASE_OUTPUT_DIRECTORY = "base_output_directory"
RUN_NAME = "run_name"
ENABLE_CHECKPOINTING = "enable_checkpointing"
CONTINUOUS = "enable_continuous_checkpointing"
PERIOD = "checkpoint_period"
KEEP = "max_num_checkpoints_to_keep"
ASYNC = "async_checkpointing"
SAVE_ON_PREEMPTION = "enable_autocheckpoint"
OPERATOR_KEYS: tuple[str, ...] = (
    BASE_OUTPUT_DIRECTORY,
    RUN_NAME,
    ENABLE_CHECKPOINTING,
    CONTINUOUS,
    PERIOD,
    KEEP,
    ASYNC,
    SAVE_ON_PREEMPTION,
)

# What XPK sets for MaxText's multi-host start-up on CPU (max_utils.initialize_jax_for_cpu reads them;
# process id = JOB_INDEX * PROCESSES_IN_JOB + JOB_COMPLETION_INDEX, coordinator <address>:1234). The Job
# controller itself sets JOB_COMPLETION_INDEX in Indexed Jobs. On TPU, jax.distributed.initialize()
# finds its peers from GKE's TPU env, and multislice from the contract's MEGASCALE_* variables.
JAX_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
JAX_PROCESS_COUNT = "JAX_PROCESS_COUNT"
PROCESSES_IN_JOB = "PROCESSES_IN_JOB"
JOB_INDEX = "JOB_INDEX"
XPK_ENV: tuple[str, ...] = (JAX_COORDINATOR_ADDRESS, JAX_PROCESS_COUNT, PROCESSES_IN_JOB, JOB_INDEX)
# MaxText reads M_<KEY> as an override of <key> (configs/pyconfig.py): those of the operator's keys too.
ENV_OVERRIDES: tuple[str, ...] = tuple(f"M_{key.upper()}" for key in OPERATOR_KEYS)
RESERVED_ENV: tuple[str, ...] = XPK_ENV + ENV_OVERRIDES

MIN_INTERVAL_MESSAGE = (
    "spec.checkpoint.minIntervalSeconds must be 0 with spec.framework maxtext: MaxText's continuous "
    "checkpointing has no minimum interval between saves"
)
EVERY_STEPS_MESSAGE = (
    "spec.checkpoint.keep.everySteps is not supported with spec.framework maxtext: MaxText keeps only the "
    "latest max_num_checkpoints_to_keep checkpoints"
)
ADAPTIVE_MESSAGE = (
    "spec.checkpoint.policy adaptive is not supported with spec.framework maxtext: MaxText saves either "
    "continuously or every checkpoint_period steps"
)
LOCAL_TIER_MESSAGE = (
    "spec.checkpoint.local is not supported with spec.framework maxtext: the local tier is the tpujob "
    "trainer's (MaxText's own emergency checkpointing is not wired to it)"
)
ELASTIC_MESSAGE = (
    "spec.elastic is not supported with spec.framework maxtext: its global batch would change with the slice "
    "count (the tpujob trainer accumulates gradients to keep it)"
)
ARGS_MESSAGE = (
    "spec.args must not set " + ", ".join(f"{k}=" for k in OPERATOR_KEYS) + " with spec.framework maxtext: "
    "the operator sets them from metadata and spec.checkpoint"
)
ENV_MESSAGE = (
    "spec.env must not set " + ", ".join(RESERVED_ENV) + " with spec.framework maxtext: the operator sets the "
    "start-up variables, and M_<KEY> would override a flag the operator sets from spec.checkpoint"
)
# An argument MaxText reads as one of the operator's keys (OmegaConf's dotlist: `key=value`). CEL's
# startsWith costs the length of its constant prefix only: the rule stays cheap over 1024 unbounded args.
_ARG_PREFIXES: tuple[str, ...] = tuple(f"{key}=" for key in OPERATOR_KEYS)
_MAXTEXT = "has(self.framework) && self.framework == 'maxtext'"


def _rule(rule: str, message: str, field_path: str) -> JsonValue:
    return {"rule": f"!({_MAXTEXT}) || ({rule})", "message": message, "fieldPath": field_path}


# Rules on spec (TrainingJobSpec): each names the field and why MaxText cannot honour it.
MAXTEXT_CEL_RULES: tuple[JsonValue, ...] = (
    _rule(
        "!has(self.checkpoint.minIntervalSeconds) || self.checkpoint.minIntervalSeconds == 0.0",
        MIN_INTERVAL_MESSAGE,
        ".checkpoint.minIntervalSeconds",
    ),
    _rule(
        "!has(self.checkpoint.keep) || !has(self.checkpoint.keep.everySteps)",
        EVERY_STEPS_MESSAGE,
        ".checkpoint.keep.everySteps",
    ),
    _rule(
        "!has(self.checkpoint.policy) || self.checkpoint.policy != 'adaptive'", ADAPTIVE_MESSAGE, ".checkpoint.policy"
    ),
    _rule("!has(self.checkpoint.local)", LOCAL_TIER_MESSAGE, ".checkpoint.local"),
    _rule("!has(self.elastic)", ELASTIC_MESSAGE, ".elastic"),
    _rule(
        "!has(self.args) || self.args.all(a, " + " && ".join(f"!a.startsWith('{p}')" for p in _ARG_PREFIXES) + ")",
        ARGS_MESSAGE,
        ".args",
    ),
    _rule(
        "!has(self.env) || !self.env.exists(e, e.name in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV) + "])",
        ENV_MESSAGE,
        ".env",
    ),
)


def maxtext_refusals(spec: Any) -> list[str]:
    """MAXTEXT_CEL_RULES in Python, for a spec of framework maxtext."""
    ckpt = spec.checkpoint
    found = []
    if ckpt.min_interval_seconds:
        found.append(MIN_INTERVAL_MESSAGE)
    if ckpt.keep.every_steps is not None:
        found.append(EVERY_STEPS_MESSAGE)
    if ckpt.policy == "adaptive":
        found.append(ADAPTIVE_MESSAGE)
    if ckpt.local is not None:
        found.append(LOCAL_TIER_MESSAGE)
    if getattr(spec, "elastic", None) is not None:
        found.append(ELASTIC_MESSAGE)
    if any(arg.startswith(_ARG_PREFIXES) for arg in spec.args or []):
        found.append(ARGS_MESSAGE)
    if any(e.name in RESERVED_ENV for e in spec.env or []):
        found.append(ENV_MESSAGE)
    return found


# --- every framework's, for api.py -------------------------------------------------------------------

# Each framework's rules test spec.framework themselves (the schema holds all of them).
CEL_RULES: list[JsonValue] = [*MAXTEXT_CEL_RULES]
# The project's trainer (tpujob) honours every spec the schema admits: it refuses nothing.
_REFUSALS: Mapping[str, Callable[[Any], list[str]]] = MappingProxyType({MAXTEXT: maxtext_refusals})


def refusals(spec: Any) -> list[str]:
    """CEL_RULES for a spec that reaches the operator without the apiserver."""
    check = _REFUSALS.get(getattr(spec, "framework", ""))
    return check(spec) if check else []
