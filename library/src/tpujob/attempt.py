"""One attempt's protection, for any JAX training loop: what the operator relies on, once.

Start (jax.distributed with the operator's timeouts, the coordinator-address check, the storage
probe), restore (the pin rule, the local tier then GCS, quarantine, retries), save (the policy's
decision, the local tier, the final and the SIGTERM save with retries, commit markers), close, and
the exit codes of the contract. The built-in trainer (tpujob_trainer.main) and the public API
(tpujob.start, tpujob/_run.py) are both made of these functions; trainer_image/README.md is the
contract they keep.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import jax
import orbax.checkpoint as ocp
import tpujob_contract as contract
from jax.experimental import multihost_utils
from tpujob_contract import ExitCode

from tpujob import buddy, checkpointing, failures, local_tier, peer, progress
from tpujob.checkpointing import (
    CheckpointIncompatible,
    CheckpointManager,
    PreemptionNotice,
    StorageError,
    StoragePermissionDenied,
)
from tpujob.config import ConfigError, RunConfig
from tpujob.failures import CheckpointMismatch, Kind, classify
from tpujob.local_tier import LocalTier
from tpujob.progress import AttemptProgress, ProgressWriter

log = logging.getLogger("tpujob")
FINAL_SAVE_TRIES = 5  # the final / SIGTERM save: tries, 2 s doubling to 16 s apart
MOVE_TIMEOUT_S = 600.0  # moving a step aside (gs://: a copy of every object, then the deletes)

S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class StateModel(Generic[S]):
    """What a restore needs to know of the caller's state: its abstract form (shapes, dtypes and
    shardings: the restore lands on them), how to build it fresh, and the step a restored state holds
    (checked against the step it was listed under: a step holding another step is damage)."""

    abstract_state: Any
    init: Callable[[], S]
    step_of: Callable[[S], int]


def scalar(x: jax.Array) -> float:
    """Value of a replicated scalar; works when the array spans other processes' devices too."""
    return float(x.addressable_data(0))


class DistributedStartupError(RuntimeError):
    """JAX's distributed runtime could not start here (exit 6): not the job's failure."""


def init_distributed(cfg: RunConfig) -> bool:
    # Gloo gives CPU processes cross-process collectives (tests, local runs); TPUs ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    topo = cfg.topology
    if topo.num_processes == 1:
        return False
    assert topo.coordinator_address  # config.topology_from_env requires it with >1 process
    bind = _own_bind_address(topo.coordinator_address)
    if topo.process_id == 0:
        _check_coordinator_address_free(bind or f"[::]:{topo.coordinator_address.rpartition(':')[2]}")
    try:
        jax.distributed.initialize(
            coordinator_address=topo.coordinator_address,
            num_processes=topo.num_processes,
            process_id=topo.process_id,
            coordinator_bind_address=bind,
            # The operator's env says everything: no cluster auto-detection. JAX's Kubernetes detection
            # (when the `kubernetes` package is importable) needs an API token, which workers do not mount.
            cluster_detection_method="deactivate",
            # Wait for peers as long as the operator's scheduling and start-up clocks allow: those
            # clocks decide a slow start (a slice that waits for capacity), not JAX's 300 s default.
            initialization_timeout=topo.init_timeout_seconds,
        )
    except Exception as err:  # e.g. the service could not bind; JAX's own fatal errors end the process
        raise DistributedStartupError(f"JAX distributed runtime did not start: {failures.short_error(err)}") from err
    return True


def _check_coordinator_address_free(bind_address: str) -> None:
    """Process 0 is about to serve the coordinator at `bind_address`. gRPC listens with SO_REUSEPORT:
    if another process (a stale peer, another job's coordinator on a shared network) already serves
    it, JAX would bind it too without a word and the kernel would deal connections between the two
    services, each killing the other's job on a foreign registration. A bind without SO_REUSEPORT
    fails on any live listener there (SO_REUSEADDR: a closed socket's TIME_WAIT does not)."""
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as err:
            raise DistributedStartupError(
                f"the coordinator address {bind_address} is already served by another process ({err.strerror}); "
                "not starting JAX there"
            ) from err


def _own_bind_address(coordinator_address: str | None) -> str | None:
    """Process 0 serves the coordinator at the address the others dial; bind exactly that address,
    not every interface, so jobs whose pods share a network (the devcluster's loopback pods,
    hostNetwork pods) never collide on the port. None keeps JAX's default ([::]:port)."""
    if not coordinator_address:
        return None
    host, _, port = coordinator_address.rpartition(":")
    try:
        return f"{socket.gethostbyname(host)}:{port}"
    except OSError:
        return None


def open_manager(cfg: RunConfig, notice: PreemptionNotice, status: AttemptProgress) -> CheckpointManager | None:
    if not (cfg.run_dir and cfg.checkpoint):
        log.warning("TPUJOB_RUN_DIR is not set: training without checkpoints")
        return None
    wait_for_storage(cfg)
    status.update(storage_ready_at=contract.now_rfc3339())
    log.info("checkpoints: %s, %s", contract.checkpoints_dir(cfg.run_dir), cfg.checkpoint)
    options = checkpointing.manager_options(cfg.checkpoint)
    if policy := checkpointing.adaptive_policy(options):
        status.cadence = checkpointing.AdaptiveCadence(cfg.checkpoint, policy, announce=jax.process_index() == 0)
    return CheckpointManager(contract.checkpoints_dir(cfg.run_dir), options, notice)


def open_local(cfg: RunConfig) -> LocalTier | None:
    """The local tier, on every process or on none (its saves are collective): a directory that one
    process cannot use costs the job its local tier, not its attempt."""
    if not (cfg.local_tier and cfg.run_dir):
        return None
    local: LocalTier | None = None
    try:
        local = LocalTier(cfg.local_tier, cfg.run_dir, cfg.job_uid, cfg.topology.num_slices)
    except Exception as err:
        log.warning("local tier: %s unusable (%s)", cfg.local_tier.directory, failures.short_error(err))
    if checkpointing.agree_all(local is not None):
        assert local is not None
        start_buddies(local)
        return local
    log.warning("local tier: off for this attempt (not usable on every process); GCS alone")
    if local:
        close_local(local)
    return None


def start_buddies(local: LocalTier) -> None:
    """Buddy copies on every process or on none (buddy.py): one that cannot start costs the job its
    buddy copies, not its local tier."""
    if not local.wants_buddies():  # the same answer on every process
        return
    started = False
    try:
        if (store := buddy.distributed_store()) is None:
            raise RuntimeError("no JAX distributed runtime")
        local.start_buddies(store)
        started = True
    except Exception as err:
        log.warning("local tier: buddy copies could not start here (%s)", failures.short_error(err))
    if not checkpointing.agree_all(started):
        log.warning("local tier: buddy copies off for this attempt (not started on every process)")
        local.stop_buddies()


def wait_for_storage(cfg: RunConfig) -> None:
    """Probe the run directory until it works, for at most TPUJOB_STORAGE_WAIT_SECONDS (StorageError)."""
    assert cfg.run_dir
    name = f"process-{jax.process_index()}"
    checkpointing.wait_for_storage(cfg.run_dir, name, cfg.storage_timeout_seconds, cfg.storage_wait_seconds)


def storage_ok(cfg: RunConfig) -> bool:
    assert cfg.run_dir
    try:
        checkpointing.probe_storage(cfg.run_dir, f"process-{jax.process_index()}", cfg.storage_timeout_seconds)
    except StorageError as err:
        log.warning("storage probe failed: %s", err)
        return False
    return True


def restore_or_init(
    cfg: RunConfig,
    model: StateModel[S],
    mngr: CheckpointManager | None,
    status: AttemptProgress,
    local: LocalTier | None = None,
) -> S:
    """Restore the committed step the resume value names, falling back to older ones only when its
    data is damaged; or a fresh state. Never deletes a committed step: one that is given up is
    moved aside, bytes kept (checkpointing.restore_with_fallback, _move_aside).

    Sets the record's restored step, restore failures and quarantined steps; raises CheckpointIncompatible
    (exit 4) when no committed step can be restored.
    """
    resume = cfg.checkpoint.resume if cfg.checkpoint else contract.LATEST
    if mngr is None:
        log.info("resume: no checkpoints, fresh start from step 0")
        return model.init()
    committed = checkpointing.agree_steps(mngr.all_steps())
    if resume == contract.FRESH:
        for s in committed:  # another trajectory's: set aside, never deleted
            where = move_aside(cfg, mngr, s, contract.SUPERSEDED_DIR)
            log.warning("resume: fresh start asked for; committed step %d set aside to %s", s, where)
        log.info("resume: fresh start from step 0, as TPUJOB_RESUME_STEP=fresh asks")
        if local:
            local.forget_after(None)
        return model.init()
    candidates = checkpointing.restore_candidates(committed, resume)
    if local and (from_local := restore_local(model, local, candidates[0] if candidates else None, status)):
        return from_local
    if not candidates:
        log.info("resume: no committed checkpoint, fresh start from step 0")
        if local:
            local.forget_after(None)
        return model.init()
    if resume.kind != "step":
        why = "latest committed"
    elif candidates[0] == resume.step:
        why = "pinned by TPUJOB_RESUME_STEP"
    else:
        why = f"newest committed, at or after TPUJOB_RESUME_STEP={resume.step}"
    log.info("resume: restoring step %d (%s) from %s", candidates[0], why, mngr.directory)

    def restore(step: int) -> S:
        if step != candidates[0]:
            log.info("resume: restoring step %d (older committed step)", step)
        state: S = mngr.restore(step, args=ocp.args.StandardRestore(model.abstract_state))
        if (held := model.step_of(state)) != step:
            raise CheckpointMismatch(f"checkpoint {step} holds step {held}")
        return state

    def quarantine(step: int) -> str:
        where = move_aside(cfg, mngr, step, contract.QUARANTINE_DIR)
        status.moved_to_quarantine(step, where)
        return where

    status.update(restore_started_at=contract.now_rfc3339())
    try:
        restored = checkpointing.restore_with_fallback(
            restore,
            candidates,
            lambda: storage_ok(cfg),
            lambda: wait_for_storage(cfg),
            quarantine,
            lambda step, error: checkpointing.StepFiles.read_back(str(mngr.directory / str(step)), error),
        )
    except CheckpointIncompatible as err:
        status.update(restore_failures=tuple(err.failures))
        raise
    status.update(restore_finished_at=contract.now_rfc3339())
    status.restored(restored.step, tuple(restored.failures), contract.RESTORED_FROM_GCS)
    if local:
        local.forget_after(restored.step)
    state: S = restored.state
    return state


def restore_local(model: StateModel[S], local: LocalTier, gcs_step: int | None, status: AttemptProgress) -> S | None:
    """The state of the newest committed local step at least as new as GCS's choice (`gcs_step`) that
    every process of some slice holds: from each process's own tier when all hold it, else copied from
    that slice's processes to the others (peer.py). None when no plan restores on every process
    (restore from GCS). Every process takes the same plans, in the same order."""
    topology = jax.process_count(), local.num_slices
    slices = [peer.slice_of_process(p, *topology) for p in range(jax.process_count())]
    own = local_tier.gather_steps(local.committed_steps())
    plans = peer.local_plans(own, slices, gcs_step)
    if local.buddies is not None:  # on every process, or on none (start_buddies)
        kept = local_tier.gather_steps(local.kept_steps())
        found = buddy.buddy_plan(own, kept, local.buddies.buddies(), gcs_step)
        if found and (not plans or found.step > plans[0].step):
            plans.insert(0, peer.LocalPlan(found.step, None, found.fetchers))
    if not plans:
        log.info("resume: no slice's local tiers hold a step at or after GCS's %s", gcs_step)
        return None
    for plan in plans:
        if (state := _restore_plan(model, local, plan, slices, status)) is not None:
            local.forget_after(plan.step)
            return state
    return None


def _restore_plan(
    model: StateModel[S], local: LocalTier, plan: peer.LocalPlan, slices: list[int], status: AttemptProgress
) -> S | None:
    step, me = plan.step, jax.process_index()
    if plan.fetchers and not _fetch_from_buddies(local, plan):
        return None
    if plan.source_slice is None:
        log.info("resume: restoring step %d from the local tier %s", step, local.manager.directory)
        tables = None
    else:
        sources = frozenset(p for p, s in enumerate(slices) if s == plan.source_slice)
        if (tables := peer.peer_tables(model.abstract_state, sources)) is None:
            log.info("resume: step %d is held by slice %d alone, and the state is not replicated across the"
                     " slices (a per-process leaf): not from a peer", step, plan.source_slice)  # fmt: skip
            return None
        role = "sending" if me in sources else "receiving"
        log.info("resume: restoring step %d from the local tiers of slice %d (%s)", step, plan.source_slice, role)
    status.update(restore_started_at=contract.now_rfc3339())
    state: S | None = None
    try:
        if tables is None:
            state = _holding(model, local.restore(step, model.abstract_state), step)
        elif me in sources:
            state = local.restore_alone(step, model.abstract_state)
        else:
            state = peer.zeros_like_abstract(model.abstract_state)
    except Exception as err:
        log.warning("resume: local step %d could not be restored here (%s)", step, failures.short_error(err))
    if not checkpointing.agree_all(state is not None):
        log.warning("resume: local step %d not restored on every process", step)
        return None
    if tables is not None:  # the copy is a collective: every process is here, or none is
        try:
            state = _holding(model, peer.copy_from_sources(state, tables), step)
        except Exception as err:
            log.warning("resume: local step %d not received from slice %d (%s)", step, plan.source_slice,
                        failures.short_error(err))  # fmt: skip
            state = None
        if not checkpointing.agree_all(state is not None):
            return None
    assert state is not None
    status.update(restore_finished_at=contract.now_rfc3339())
    peered = tables is not None or bool(plan.fetchers)
    status.restored(step, (), contract.RESTORED_FROM_PEER if peered else contract.RESTORED_FROM_LOCAL)
    return state


def _fetch_from_buddies(local: LocalTier, plan: peer.LocalPlan) -> bool:
    """The plan's fetchers receive their own copies of its step from their buddies, into their own
    tiers; True when every process has the step in its own tier (a collective)."""
    me, fetched = jax.process_index(), True
    log.info("resume: step %d: processes %s receive their copies from their buddies", plan.step, sorted(plan.fetchers))
    if me in plan.fetchers:
        try:
            local.fetch_from_buddy(plan.step)
        except Exception as err:
            log.warning("resume: local step %d not received from the buddy (%s)", plan.step, failures.short_error(err))
            fetched = False
    if not checkpointing.agree_all(fetched):
        log.warning("resume: local step %d not received by every process that lacks it", plan.step)
        return False
    return True


def _holding(model: StateModel[S], state: S, step: int) -> S:
    if (held := model.step_of(state)) != step:
        raise CheckpointMismatch(f"local checkpoint {step} holds step {held}")
    return state


def move_aside(cfg: RunConfig, mngr: CheckpointManager, step: int, folder: str) -> str:
    """Move committed `step` to <run dir>/<folder>/ (process 0, after every process agreed), and
    have every process forget it; returns where it went. A move that fails leaves the step in
    place (logged): it is tried again by the next attempt that gives it up."""
    assert cfg.run_dir
    where = f"{cfg.run_dir}/{folder}/{step}"
    if jax.process_index() == 0:
        try:
            where = checkpointing.move_step(str(mngr.directory), f"{cfg.run_dir}/{folder}", step, MOVE_TIMEOUT_S)
            log.warning("checkpoint: step %d moved to %s, bytes kept", step, where)
        except Exception as err:
            log.error("checkpoint: could not move step %d to %s (%s); it stays", step, where, failures.short_error(err))
            where = f"(not moved: {failures.short_error(err)})"
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"tpujob-move-{folder}-{step}")
    mngr.reload()
    return where


def save(mngr: CheckpointManager, step: int, state: Any, status: AttemptProgress) -> float | None:
    """One save decision: the seconds the loop was blocked if a save started, else None. A failed
    save is logged and counted, and the next decision retries.

    Orbax 0.12.8 surfaces a failed async save as an exception from the *next* save() (or
    wait_until_finished()), raised once; a failure of the blocking part raises from this save().
    """
    try:
        if not mngr.is_saving_in_progress():
            # Raise a finished save's error here rather than from inside save(), after Orbax's
            # first barrier, where other processes would wait for this one.
            mngr.wait_until_finished()
        if not mngr.should_save(step):
            return None
        # The step is dispatched asynchronously: wait for it first, so that the time below is the
        # save's blocking part alone (the goodput ledger's checkpoint-save badput).
        jax.block_until_ready(state)  # type: ignore[no-untyped-call]
        with status.blocked_in_save() as block:  # Orbax waits here for the save in flight, if any
            started = mngr.save(step, args=ocp.args.StandardSave(state))
        return block.seconds if started else None
    except Exception as err:
        status.save_failed()
        if classify(err) == Kind.DENIED:  # no retry can fix a refusal: end the attempt (exit 5)
            raise StoragePermissionDenied(failures.short_error(err)) from err
        log.warning("checkpoint: save failed (%s); training goes on, the next save retries", failures.short_error(err))
        return None


def save_local(local: LocalTier, step: int, state: Any, status: AttemptProgress) -> None:
    """A local save at its interval, after the GCS tier's decision (which it never delays); one that
    fails is logged, and the GCS tier goes on as if there were none."""
    try:
        blocked_from = time.monotonic()
        if local.save(step, state):
            status.save_blocked(time.monotonic() - blocked_from)
            status.update(local_tier_problem=None)
    except local_tier.Undersized as err:
        log.error("local tier: %s", err)
        status.update(local_tier_problem=str(err))
    except Exception as err:
        log.warning("local tier: save of step %d failed (%s); GCS saves go on", step, failures.short_error(err))
        status.update(local_tier_problem=f"the save of step {step} failed: {failures.short_error(err)}")


def committed(mngr: CheckpointManager, step: int) -> bool:
    try:
        return checkpointing.is_committed(str(mngr.directory), step)
    except Exception as err:
        log.warning("checkpoint: could not check the commit marker of step %d: %s", step, failures.short_error(err))
        return False


def save_final(mngr: CheckpointManager, step: int, state: Any, status: AttemptProgress) -> bool:
    """Make sure `step` is committed (the final step, or the SIGTERM step): retry a bounded number
    of times, because this checkpoint is the one a restart or the user will want."""
    delays = checkpointing.backoff_delays(2.0, 16.0)
    with status.blocked_in_save():
        return _save_final_tries(mngr, step, state, status, delays)


def _save_final_tries(
    mngr: CheckpointManager, step: int, state: Any, status: AttemptProgress, delays: Iterator[float]
) -> bool:
    for attempt in range(1, FINAL_SAVE_TRIES + 1):
        try:
            # Every process decides alike whether to save again, on what storage holds once every
            # save in flight ended (the primary's commit included: agree_all is a collective). A
            # process that skipped a save the others make would leave Orbax's barriers, which are
            # collectives here, paired with the wrong calls.
            mngr.wait_until_finished()
            checkpointing.agree_all(True)
            mngr.reload()  # forget a step whose save failed after Orbax had listed it
            if not checkpointing.agree_all(step in mngr.all_steps()):
                mngr.save(step, args=ocp.args.StandardSave(state), force=True)
                mngr.wait_until_finished()
            if checkpointing.agree_all(committed(mngr, step)):
                return True
            error = "no commit marker after the save"
        except Exception as err:
            if classify(err) == Kind.DENIED:
                status.save_failed()
                raise StoragePermissionDenied(failures.short_error(err)) from err
            error = failures.short_error(err)
        status.save_failed()
        log.warning("checkpoint: save of step %d, try %d/%d, failed: %s", step, attempt, FINAL_SAVE_TRIES, error)
        if attempt < FINAL_SAVE_TRIES:
            time.sleep(next(delays))
    return False


def denied(cfg: RunConfig, err: StoragePermissionDenied, status: AttemptProgress) -> None:
    """Say which bucket refused which identity: the log, the progress record, and the container's
    termination message (`kubectl describe pod`; Kubernetes reads /dev/termination-log)."""
    denied = f"{checkpointing.bucket_of(cfg.run_dir or '')} as {checkpointing.identity()}: {err}"
    status.update(state="failed", storage_denied=denied)
    log.error("checkpoint storage refused this job's identity (exit 5): %s", denied)
    _termination_message(f"{contract.STORAGE_DENIED_PREFIX}{denied}")


def _termination_message(text: str) -> None:
    """The container's termination message (`kubectl describe pod`; Kubernetes reads /dev/termination-log)."""
    path = os.environ.get("TPUJOB_TERMINATION_MESSAGE_PATH", "/dev/termination-log")
    if os.path.exists(path):
        try:
            with open(path, "w") as out:
                out.write(text[:4096])
        except OSError:
            pass


def progress_writer(cfg: RunConfig, mngr: CheckpointManager, status: AttemptProgress) -> ProgressWriter:
    """Process 0's progress record writer. Storage lost on the workers' side while training (the
    operator may still read the bucket) leaves the record silent, which the operator's hang clock
    would charge to the job: after `record_unwritable_limit_seconds` the process ends with exit 3
    instead (StorageUnavailable: restarted, not counted; the operator bounds its streak). A save
    that blocks the loop keeps the record fresh for up to the hang timeout (KeepFresh)."""
    run_dir, where = cfg.run_dir, str(mngr.directory)
    assert run_dir is not None

    def probe() -> None:
        checkpointing.probe_storage(run_dir, "watchdog", cfg.storage_timeout_seconds)

    give_up = progress.GiveUp(cfg.record_unwritable_limit_seconds, probe, _storage_lost)
    keep_fresh = None
    if cfg.hang_timeout_seconds > 0:
        keep_fresh = progress.KeepFresh(status, cfg.progress_interval_seconds, cfg.hang_timeout_seconds)
    return ProgressWriter(run_dir, lambda s: checkpointing.is_committed(where, s), give_up, keep_fresh)


def _storage_lost(seconds: float) -> None:
    what = f"checkpoint storage lost while training: the progress record could not be written for {seconds:.0f} s"
    log.error("%s (exit 3: the attempt is restarted, not counted)", what)
    _termination_message(what)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # From the watchdog thread, past whatever holds the training thread (a save hung on storage):
    # nothing this process still holds can be committed without storage.
    os._exit(ExitCode.STORAGE)


def close_local(local: LocalTier) -> None:
    try:
        local.close()
    except Exception as err:
        log.warning("local tier: closing failed: %s", failures.short_error(err))


def close(mngr: CheckpointManager, writer: ProgressWriter | None) -> None:
    """Report the latest step and close the manager; an error of a save already given up on is
    only logged, so that it never changes the outcome."""
    try:
        latest = mngr.latest_step()
        if writer and latest is not None:
            writer.saved(latest)
        mngr.close()
    except Exception as err:
        log.warning("checkpoint: closing the manager failed: %s", failures.short_error(err))


# The failures main() knows, first match wins: what it logs and the exit code the operator classifies by.
KNOWN_FAILURES: tuple[tuple[type[Exception], str, ExitCode], ...] = (
    (ConfigError, "bad configuration: %s", ExitCode.BAD_CONFIG),
    (StorageError, "checkpoint storage unusable at start: %s", ExitCode.STORAGE),
    (DistributedStartupError, "%s (exit 6: the attempt is restarted, not counted)", ExitCode.DISTRIBUTED_STARTUP),
    (StoragePermissionDenied, "checkpoint storage refused this job's identity: %s", ExitCode.STORAGE_PERMISSION_DENIED),
)


class StepHook:
    """The per-step part of an attempt, after each update, on every process: one place for every loop
    (the built-in trainer's, tpujob.Run's). Times the step when a policy prices saves, asks whether a
    SIGTERM stops training here, lets the save policy and the local tier decide, reports finished
    saves to the progress record, and makes the stop step's save. This is where what a later version
    watches per step (a hang's stacks, a straggler, silent corruption) goes."""

    def __init__(
        self,
        cfg: RunConfig,
        notice: PreemptionNotice,
        status: AttemptProgress,
        mngr: CheckpointManager | None,
        local: LocalTier | None,
        writer: ProgressWriter | None,
    ):
        self.cfg, self.notice, self.status = cfg, notice, status
        self.mngr, self.local, self.writer = mngr, local, writer
        self._pending_save: int | None = None
        self._timed_from: float | None = None  # when the step being timed began (None: compiling)

    def after_step(self, step: int, payload: Any, done: Any) -> bool:
        """`step` updates are done; `payload` is what a save of it holds (None without a run
        directory) and `done` a value to wait for to know the step has run (its loss, or the state). Returns True
        when every process stops at this step (its save made when save-on-preemption is on)."""
        status, mngr, local = self.status, self.mngr, self.local
        cadence = status.cadence
        status.step = step
        # Adaptive, and the local tier while it prices its saves, need each step's real time: JAX
        # dispatches asynchronously, so such a step is waited for, which costs the host its head start
        # on dispatching the next one (bench/checkpoint_policies.py measures it).
        timed = cadence is not None or (local is not None and local.measuring)
        if status.record_so_far.first_step_at is None or timed:
            jax.block_until_ready(done)  # type: ignore[no-untyped-call]  # after the first: compiled
            if status.record_so_far.first_step_at is None:
                status.update(first_step_at=contract.now_rfc3339())
        step_s = time.monotonic() - self._timed_from if timed and self._timed_from is not None else None
        # Before any save: a save at the step JAX's preemption sync agrees on is the preemption save.
        stopping = self.notice.reached(step)
        if not mngr:
            return stopping
        saving = mngr.is_saving_in_progress()
        # Report a finished save before the policy may start the next one.
        if self._pending_save is not None and not saving:
            if self.writer:
                self.writer.saved(self._pending_save)
            self._pending_save = None
        if cadence and step_s is not None:
            cadence.step(step_s, saving)
        blocked = save(mngr, step, payload, status)
        if blocked is not None:
            # Orbax started this save once the one in flight had finished: report that one first.
            if self._pending_save is not None and self.writer:
                self.writer.saved(self._pending_save)
            self._pending_save = step
            if cadence:
                cadence.saved(blocked)
        # Not at the stop step: the signalled pod leaves with its memory volume, so no process restores it.
        if local and not stopping:
            if local.measuring and step_s is not None:
                local.step(step_s)
            save_local(local, step, payload, status)
        if stopping:
            saved = self.cfg.checkpoint is not None and self.cfg.checkpoint.save_on_preemption
            saved = saved and save_final(mngr, step, payload, status)
            log.warning("SIGTERM: stopping at step %d (checkpoint of it: %s)", step, saved)
        return stopping

    def next_step_begins(self) -> None:
        """The next step's time starts now (it excludes this one's save and report)."""
        self._timed_from = time.monotonic()


def configure_logging(*names: str, tag: str = "tpujob") -> None:
    """A stderr handler of our own on these loggers (and the library's): absl, imported by Orbax,
    has already claimed the root logger. TPUJOB_LOG_LEVEL (INFO) sets the level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{tag}] %(message)s"))
    for name in dict.fromkeys(("tpujob", *names)):
        logger = logging.getLogger(name)
        if any(getattr(h, "_tpujob", False) for h in logger.handlers):
            continue
        handler._tpujob = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("TPUJOB_LOG_LEVEL", "INFO"))
        logger.propagate = False


def exit_code_of(err: Exception) -> ExitCode | None:
    """The contract's exit code for a failure the library knows (logged here), or None."""
    for kind, message, code in KNOWN_FAILURES:
        if isinstance(err, kind):
            log.error(message, err)
            return code
    return None
