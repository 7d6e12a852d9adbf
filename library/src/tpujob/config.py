"""The attempt's configuration, parsed from the operator's TPUJOB_* environment.

The operator's JobSet builder sets the TPUJOB_* environment (trainer_image/README.md, "Contract").
Parsing is a pure function of the environment so that every rule here is table-testable; invalid
input raises ConfigError, which becomes exit code 2. A trainer's own flags (the built-in trainer's
model and schedule) are parsed by the trainer, on top of this (tpujob_trainer.config).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import tpujob_contract as contract
from tpujob_contract import COMPILATION_CACHE_ENV, CheckpointPolicy, Env, Resume


class ConfigError(ValueError):
    """The configuration is invalid (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    policy: CheckpointPolicy
    min_interval_seconds: float
    interval_steps: int
    async_save: bool
    keep_latest: int
    keep_every_steps: int
    save_on_preemption: bool
    resume: Resume  # the operator's TPUJOB_RESUME_STEP: a committed step, the latest one, or fresh
    # adaptive: the step-time budget for saves (percent), the interval's upper bound (None: none;
    # min_interval_seconds is the lower one) and the operator's MTBF estimate (None: budget only)
    overhead_budget_percent: float = contract.DEFAULT_OVERHEAD_BUDGET_PERCENT
    max_interval_seconds: float | None = None
    mtbf_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class LocalTierConfig:
    """The local checkpoint tier (local_tier.py): where (an emptyDir's mountPath), how often at most,
    the share of step time its saves may block (the interval is stretched to stay within it), and
    whether the hosts of a slice keep each other's steps (buddy.py)."""

    directory: str
    interval_steps: int
    overhead_budget_percent: float = contract.DEFAULT_LOCAL_OVERHEAD_BUDGET_PERCENT
    buddy_copies: bool = contract.DEFAULT_LOCAL_BUDDY_COPIES


def local_tier_config(env: Mapping[str, str]) -> LocalTierConfig | None:
    """None (no local tier: GCS alone, as before) unless TPUJOB_LOCAL_CHECKPOINT_DIR is set."""
    directory = env.get(contract.Env.LOCAL_CHECKPOINT_DIR, "").strip().rstrip("/")
    if not directory:
        return None
    _require(not directory.startswith("gs://"), f"{contract.Env.LOCAL_CHECKPOINT_DIR}={directory!r}: a local path")
    interval = _int(env, contract.Env.LOCAL_CHECKPOINT_INTERVAL_STEPS, contract.DEFAULT_LOCAL_INTERVAL_STEPS)
    _require(interval >= 1, f"{contract.Env.LOCAL_CHECKPOINT_INTERVAL_STEPS} must be >= 1, got {interval}")
    budget_env = contract.Env.LOCAL_CHECKPOINT_OVERHEAD_BUDGET_PERCENT
    budget = _float(env, budget_env, contract.DEFAULT_LOCAL_OVERHEAD_BUDGET_PERCENT)
    _require(0 <= budget <= 100, f"{budget_env}={budget:g} must be in [0, 100]")
    buddy_copies = _bool(env, contract.Env.LOCAL_CHECKPOINT_BUDDY_COPIES, contract.DEFAULT_LOCAL_BUDDY_COPIES)
    return LocalTierConfig(directory, interval, budget, buddy_copies)


# JAX's own default wait for every peer at start-up (jax.distributed.initialize): what a process
# waits without the operator's word (local runs, an older operator).
DEFAULT_DISTRIBUTED_INIT_TIMEOUT_SECONDS = 300
# "0: for ever" as JAX takes it (whole seconds, a C int): 30 days, far past any clock of the operator.
FOREVER_SECONDS = 30 * 24 * 3600


@dataclasses.dataclass(frozen=True)
class Topology:
    coordinator_address: str | None
    process_id: int
    num_processes: int
    num_slices: int
    # How long JAX's start-up waits for all peers (Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS)
    init_timeout_seconds: int = DEFAULT_DISTRIBUTED_INIT_TIMEOUT_SECONDS
    # spec.tpu.slices (Env.FULL_SLICES), the size the training math is defined for; None: num_slices.
    # An elastic attempt on fewer slices accumulates gradients so that each step is the full-size one.
    full_slices: int | None = None

    @property
    def microbatches(self) -> int:
        """Gradient-accumulation steps per update: full_slices // num_slices (1 at full size)."""
        return (self.full_slices or self.num_slices) // self.num_slices


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What the operator's environment says about this attempt: everything but the model's own flags."""

    checkpoint: CheckpointConfig | None  # None: no TPUJOB_RUN_DIR, train without checkpoints
    topology: Topology
    run_dir: str | None
    job_name: str
    job_namespace: str
    job_uid: str  # the TrainingJob's metadata.uid; "" for local runs
    attempt: int
    progress_interval_seconds: float
    storage_timeout_seconds: float  # one storage probe
    storage_wait_seconds: float  # how long unreachable storage is waited out before exit 3
    # How long the progress record may go unwritten while training before the trainer gives up
    # (exit 3, not counted): record_unwritable_limit()
    record_unwritable_limit_seconds: float
    # spec.restart.hangTimeoutSeconds (0: no hang clock): how long a save blocking the loop keeps the
    # progress record fresh (ProgressWriter's keep-fresh)
    hang_timeout_seconds: float = 0.0
    compilation_cache_dir: str | None = None  # persistent JAX compilation cache; None = off
    local_compilation_cache_dir: str | None = None  # this process's own tier of it, read first; None = none
    local_tier: LocalTierConfig | None = None  # the local checkpoint tier; None = GCS alone


JAX_COMPILATION_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
STORAGE_WAIT_ENV = "TPUJOB_STORAGE_WAIT_SECONDS"  # a job may set it in spec.env
DEFAULT_STORAGE_WAIT_SECONDS = 600.0


def compilation_cache_dir(env: Mapping[str, str], run_dir: str | None) -> str | None:
    """TPUJOB_COMPILATION_CACHE_DIR if set ("" or "off": no cache), else JAX_COMPILATION_CACHE_DIR
    (a cache the user configured for JAX itself), else <run dir>/jax-cache; None = no cache."""
    if COMPILATION_CACHE_ENV in env:
        raw = env[COMPILATION_CACHE_ENV].strip()
        return None if raw.lower() in ("", "off") else raw.rstrip("/")
    jax_dir = env.get(JAX_COMPILATION_CACHE_ENV, "").strip()
    if jax_dir:
        return jax_dir.rstrip("/")
    return f"{run_dir}/{contract.COMPILATION_CACHE_DIR}" if run_dir else None


def local_compilation_cache_dir(env: Mapping[str, str]) -> str | None:
    """TPUJOB_LOCAL_COMPILATION_CACHE_DIR (the pod's own volume, which an in-place restart keeps), a local
    path; None when unset, or when TPUJOB_COMPILATION_CACHE_DIR turns the cache off ("" or "off")."""
    if COMPILATION_CACHE_ENV in env and env[COMPILATION_CACHE_ENV].strip().lower() in ("", "off"):
        return None
    directory = env.get(Env.LOCAL_COMPILATION_CACHE_DIR, "").strip().rstrip("/")
    if not directory:
        return None
    _require(not directory.startswith("gs://"), f"{Env.LOCAL_COMPILATION_CACHE_DIR}={directory!r}: a local path")
    return directory


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not finite")
    return value


def _optional_float(env: Mapping[str, str], name: str) -> float | None:
    """A number, or None when the variable is absent or empty."""
    return _float(env, name, math.nan) if env.get(name, "").strip() else None


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no"):
        return False
    raise ConfigError(f"{name}={raw!r} is not true/false")


def _resume(env: Mapping[str, str]) -> Resume:
    try:
        return Resume.parse(env.get(Env.RESUME, ""))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _checkpoint_config(env: Mapping[str, str]) -> CheckpointConfig:
    policies = contract.CHECKPOINT_POLICIES
    raw_policy = env.get(Env.CHECKPOINT_POLICY, "").strip() or contract.DEFAULT_CHECKPOINT_POLICY
    policy = next((p for p in policies if p == raw_policy), None)
    if policy is None:
        raise ConfigError(f"{Env.CHECKPOINT_POLICY}={raw_policy!r}: want {'|'.join(policies)}")
    cfg = CheckpointConfig(
        policy=policy,
        min_interval_seconds=_float(env, Env.CHECKPOINT_MIN_INTERVAL_SECONDS, contract.DEFAULT_MIN_INTERVAL_SECONDS),
        interval_steps=_int(env, Env.CHECKPOINT_INTERVAL_STEPS, contract.DEFAULT_INTERVAL_STEPS),
        async_save=_bool(env, Env.CHECKPOINT_ASYNC, contract.DEFAULT_ASYNC_SAVE),
        keep_latest=_int(env, Env.CHECKPOINT_KEEP_LATEST, contract.DEFAULT_KEEP_LATEST),
        keep_every_steps=_int(env, Env.CHECKPOINT_KEEP_EVERY_STEPS, contract.DEFAULT_KEEP_EVERY_STEPS),
        save_on_preemption=_bool(env, Env.CHECKPOINT_SAVE_ON_PREEMPTION, contract.DEFAULT_SAVE_ON_PREEMPTION),
        resume=_resume(env),
        overhead_budget_percent=_float(
            env, Env.CHECKPOINT_OVERHEAD_BUDGET_PERCENT, contract.DEFAULT_OVERHEAD_BUDGET_PERCENT
        ),
        max_interval_seconds=_optional_float(env, Env.CHECKPOINT_MAX_INTERVAL_SECONDS),
        mtbf_seconds=_optional_float(env, Env.MTBF_SECONDS),
    )
    _require(cfg.min_interval_seconds >= 0, "TPUJOB_CHECKPOINT_MIN_INTERVAL_SECONDS must be >= 0")
    budget = cfg.overhead_budget_percent
    _require(0 < budget <= 100, f"{Env.CHECKPOINT_OVERHEAD_BUDGET_PERCENT}={budget:g} must be in (0, 100]")
    if (top := cfg.max_interval_seconds) is not None:
        _require(top > 0, f"{Env.CHECKPOINT_MAX_INTERVAL_SECONDS} must be > 0")
        _require(
            top >= cfg.min_interval_seconds,
            f"{Env.CHECKPOINT_MAX_INTERVAL_SECONDS}={top:g} is below "
            f"{Env.CHECKPOINT_MIN_INTERVAL_SECONDS}={cfg.min_interval_seconds:g}",
        )
    _require(cfg.mtbf_seconds is None or cfg.mtbf_seconds > 0, f"{Env.MTBF_SECONDS} must be > 0")
    _require(cfg.policy != "interval" or cfg.interval_steps > 0, "TPUJOB_CHECKPOINT_INTERVAL_STEPS must be > 0")
    _require(cfg.keep_latest >= 1, "TPUJOB_CHECKPOINT_KEEP_LATEST must be >= 1")
    _require(cfg.keep_every_steps >= 0, "TPUJOB_CHECKPOINT_KEEP_EVERY_STEPS must be >= 0")
    return cfg


def topology_from_env(env: Mapping[str, str]) -> Topology:
    """process_id = slice_id * hosts_per_slice + JOB_COMPLETION_INDEX, unless overridden."""
    num_slices = _int(env, Env.NUM_SLICES, 1)
    hosts_per_slice = _int(env, Env.HOSTS_PER_SLICE, 1)
    slice_id = _int(env, Env.SLICE_ID, 0)
    completion_index = _int(env, "JOB_COMPLETION_INDEX", 0)
    _require(num_slices >= 1 and hosts_per_slice >= 1, "TPUJOB_NUM_SLICES and TPUJOB_HOSTS_PER_SLICE must be >= 1")
    _require(0 <= slice_id < num_slices, f"TPUJOB_SLICE_ID={slice_id} not in [0, {num_slices})")
    _require(
        0 <= completion_index < hosts_per_slice, f"JOB_COMPLETION_INDEX={completion_index} >= {hosts_per_slice} hosts"
    )
    process_id = _int(env, "TPUJOB_PROCESS_ID", slice_id * hosts_per_slice + completion_index)
    num_processes = _int(env, "TPUJOB_NUM_PROCESSES", num_slices * hosts_per_slice)
    _require(0 <= process_id < num_processes, f"process id {process_id} not in [0, {num_processes})")
    _require(num_processes % num_slices == 0, f"{num_processes} processes do not divide into {num_slices} slices")
    coordinator = env.get(Env.COORDINATOR_ADDRESS, "").strip() or None
    _require(num_processes == 1 or coordinator is not None, "TPUJOB_COORDINATOR_ADDRESS is required with >1 process")
    wait = _int(env, Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS, DEFAULT_DISTRIBUTED_INIT_TIMEOUT_SECONDS)
    _require(wait >= 0, f"{Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS}={wait} must be >= 0 (0: for ever)")
    full_slices = _int(env, Env.FULL_SLICES, num_slices)
    _require(
        num_slices <= full_slices and full_slices % num_slices == 0,
        f"{Env.FULL_SLICES}={full_slices} is not a multiple of {Env.NUM_SLICES}={num_slices} "
        "(an elastic attempt runs on a divisor of the full slice count, accumulating full/num microbatches)",
    )
    return Topology(
        coordinator, process_id, num_processes, num_slices, min(wait or FOREVER_SECONDS, FOREVER_SECONDS), full_slices
    )


def run_config(env: Mapping[str, str]) -> RunConfig:
    """The attempt's configuration from the operator's TPUJOB_* environment (README.md, "Contract")."""
    run_dir = env.get(Env.RUN_DIR, "").strip().rstrip("/") or None
    return RunConfig(
        checkpoint=_checkpoint_config(env) if run_dir else None,
        topology=topology_from_env(env),
        run_dir=run_dir,
        job_name=env.get(Env.NAME, ""),
        job_namespace=env.get(Env.NAMESPACE, ""),
        job_uid=env.get(Env.UID, "").strip(),
        attempt=_int(env, Env.ATTEMPT, 0),
        progress_interval_seconds=_float(env, contract.PROGRESS_INTERVAL_ENV, 5.0),
        storage_timeout_seconds=_storage_seconds(env, "TPUJOB_STORAGE_TIMEOUT_SECONDS", 30.0),
        storage_wait_seconds=_storage_seconds(env, STORAGE_WAIT_ENV, DEFAULT_STORAGE_WAIT_SECONDS),
        record_unwritable_limit_seconds=record_unwritable_limit(env),
        hang_timeout_seconds=_storage_seconds(env, Env.HANG_TIMEOUT_SECONDS, 0.0),
        compilation_cache_dir=compilation_cache_dir(env, run_dir),
        local_compilation_cache_dir=local_compilation_cache_dir(env),
        # Only beside the GCS tier: restoring it needs GCS's latest step to compare with.
        local_tier=local_tier_config(env) if run_dir else None,
    )


def record_unwritable_limit(env: Mapping[str, str]) -> float:
    """The storage wait when the job sets it (spec.env), else the default wait and at most half the
    operator's hang timeout, whose clock reads the record's silence as a hang (counted) when the
    operator itself still reads the bucket."""
    wait = _storage_seconds(env, STORAGE_WAIT_ENV, DEFAULT_STORAGE_WAIT_SECONDS)
    hang = _storage_seconds(env, Env.HANG_TIMEOUT_SECONDS, 0.0)
    if env.get(STORAGE_WAIT_ENV, "").strip() or hang <= 0:
        return wait
    return min(wait, hang / 2)


# For a trainer's own env fallbacks (tpujob_trainer.config): one parser of each kind.
env_int = _int
env_float = _float
require = _require


def _storage_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    value = _float(env, name, default)
    _require(value >= 0, f"{name} must be >= 0")
    return value
