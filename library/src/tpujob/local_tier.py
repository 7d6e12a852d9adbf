"""The local checkpoint tier: frequent saves to node-local memory (a memory-backed emptyDir), restored
ahead of GCS when every process holds the same committed step and it is at least as new as GCS's.

Why not Orbax's emergency.CheckpointManager (orbax-checkpoint 0.12.8): with one slice it drops the
local directory and saves to the persistent one alone (`del local_directory`), so a single-slice job
would get no local tier; with several it saves the persistent tier from the primary slice only and
the local tier from the other slices only, under its own interval policy, replacing this trainer's
GCS tier (its policies, preemption save, quarantine and commit rule). What it does for the local
side is plain Orbax, and this module does the same: a CheckpointManager with no primary host (each
process is its own, `enable_per_process_directory_creation`), whose ArrayHandler writes and reads
only this process's shards. A step is committed when Orbax's finalize renamed its temporary
directory (a local path: AtomicRenameTemporaryPath); Orbax lists nothing else.

Identity: the directory outlives a container (an in-place restart keeps it), so its steps are used
only when an identity file written beside them names this run directory, job uid and process
layout; otherwise they are removed before anything is saved there (a cache: GCS keeps the truth).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as cm
from orbax.checkpoint import type_handlers

from tpujob import buddy, checkpointing
from tpujob.cadence import HEADROOM, SaveCostMeter
from tpujob.config import LocalTierConfig

log = logging.getLogger("tpujob")

KEEP = 2  # committed local steps kept: the newest, and the one before while the next is written
COPIES = KEEP + 1  # what the volume holds at most: the kept steps and the one being written
IDENTITY_FILE = "tpujob-local-identity.json"
STEPS_DIR = "checkpoints"
_AGREE_SLOTS = 8  # newest committed local steps each process offers to the agreement
# The due saves at which the interval is chosen again from what the saves so far cost (the cost is the
# median of the last cadence.COST_WINDOW_SAVES, so the first save's warm-up only counts at the 3rd).
RECHOOSE_AT_SAVES = (3, 10)
# Steps with no local save in flight before a slowdown is priced: the steps before the first save are
# idle ones, and there are intervalSteps - 1 of them (the first step compiles).
MIN_IDLE_STEPS = 5
MAX_STRETCH = 1000  # the interval is at most this many times intervalSteps
_MAX_INTERVAL = 2**31 - 1  # what the processes' agreement (an int32 allgather) carries: past any run's end


def budgeted_interval(floor_steps: int, cost_s: float, step_s: float, budget_percent: float) -> int:
    """The smallest multiple of `floor_steps` at which a local save that costs `cost_s` of the loop's
    time costs at most `budget_percent` of the time the steps between two saves take (`step_s` each);
    `floor_steps` itself with no budget (0) or nothing measured."""
    if budget_percent <= 0 or cost_s <= 0 or step_s <= 0:
        return floor_steps
    multiple = math.ceil(cost_s / (budget_percent / 100 * floor_steps * step_s))
    return min(floor_steps * min(max(multiple, 1), MAX_STRETCH), _MAX_INTERVAL)


def debt_steps(debt_s: float, step_s: float) -> int:
    """The steps that take `debt_s` of productive time (none when nothing is owed or measured)."""
    if debt_s <= 0 or step_s <= 0:
        return 0
    return min(math.ceil(debt_s / step_s), _MAX_INTERVAL)


def identity(run_dir: str, job_uid: str, num_slices: int, process: int | None = None) -> dict[str, Any]:
    """What a local step of `process` (this one by default) must have been written by to be restored
    here: the same run (the GCS tier's own identity), the same TrainingJob incarnation, and the same
    process layout and mesh (each process holds only its own shards; an elastic attempt on another
    slice count has another mesh)."""
    return {"run_dir": run_dir, "uid": job_uid,
            "process_index": jax.process_index() if process is None else process,
            "process_count": jax.process_count(), "device_count": jax.device_count(),
            "num_slices": num_slices}  # fmt: skip


class Undersized(RuntimeError):
    """The local tier's volume cannot hold the copies it keeps of this host's state."""


def host_bytes(state: Any) -> int:
    """The bytes of the state this process writes: the first replica of each shard on its devices."""
    leaves = jax.tree.leaves(state)
    on_devices = sum(
        int(shard.data.nbytes)
        for leaf in leaves
        if isinstance(leaf, jax.Array)
        for shard in leaf.addressable_shards
        if shard.replica_id == 0
    )
    return on_devices + sum(int(np.asarray(leaf).nbytes) for leaf in leaves if not isinstance(leaf, jax.Array))


def volume_bytes(directory: str) -> int:
    """The size of the filesystem under `directory` (a memory-backed emptyDir is a tmpfs of its sizeLimit)."""
    found = os.statvfs(directory)
    return found.f_blocks * found.f_frsize


def room_problem(state_bytes: int, volume: int, buddy_copies: bool = False) -> str | None:
    """Why a volume of `volume` bytes cannot hold the local tier's COPIES of a `state_bytes` state (and
    as many of its ward's, as large, with `buddy_copies`); None if it can."""
    copies = 2 * COPIES if buddy_copies else COPIES
    needed = copies * state_bytes
    if needed <= volume:
        return None
    wards = f" and {COPIES} of its ward's" if buddy_copies else ""
    off = "buddy copies are off, local saves go on" if buddy_copies else "local saves are off, GCS saves go on"
    return (
        f"the local tier holds up to {COPIES} copies of this host's {_mebibytes(state_bytes)} state{wards} "
        f"({_mebibytes(needed)}) but its volume has {volume // 2**20}Mi: raise "
        f"spec.checkpoint.local.sizeLimit to at least {_mebibytes(needed)} (and the node's memory with it); {off}"
    )


def _mebibytes(size: int) -> str:
    """A size as a Kubernetes quantity, rounded up to whole MiB (what sizeLimit takes)."""
    return f"{math.ceil(size / 2**20)}Mi"


def prepare(directory: str, want: dict[str, Any]) -> Path:
    """The steps directory, emptied first unless the identity file beside it is `want`."""
    root = Path(directory)
    steps = root / STEPS_DIR
    marker = root / IDENTITY_FILE
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):
        found = None
    if found != want:
        if steps.exists():
            log.warning("local tier: %s was written by %s, not this run (%s); removing its steps", root, found, want)
            shutil.rmtree(steps)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{IDENTITY_FILE}.tmp"
        tmp.write_text(json.dumps(want, sort_keys=True))
        tmp.replace(marker)
    steps.mkdir(parents=True, exist_ok=True)
    return steps


def _handler(processes: set[int]) -> ocp.PyTreeCheckpointHandler:
    """Emergency checkpointing's local handler: every process writes and reads its own shards."""
    registry = type_handlers.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False))
    )
    return ocp.PyTreeCheckpointHandler(
        use_ocdbt=True,
        use_zarr3=True,
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=None, active_processes=processes, barrier_sync_key_prefix="tpujob-local"
        ),
        type_handler_registry=registry,
    )


class _LocalManager(ocp.CheckpointManager):  # type: ignore[misc]  # orbax ships no type hints
    """Never asks JAX's preemption sync, which only the training loop may feed (checkpointing.PreemptionNotice);
    the local tier makes no preemption save."""

    def reached_preemption(self, step: int) -> bool:
        del step
        return False


def _quiet_orbax(record: logging.LogRecord) -> bool:
    """Orbax warns twice per save without a primary host that it does not log object sizes: noise."""
    return not str(record.msg).startswith("Global object size logging disabled")


class LocalTier:
    """One process's local checkpoint manager (every process opens one, at the same steps)."""

    def __init__(self, cfg: LocalTierConfig, run_dir: str, job_uid: str, num_slices: int):
        self.cfg = cfg
        self.num_slices = num_slices
        absl_log = logging.getLogger("absl")
        if _quiet_orbax not in absl_log.filters:
            absl_log.addFilter(_quiet_orbax)
        processes = set(range(jax.process_count()))
        self._identity = functools.partial(identity, run_dir, job_uid, num_slices)
        steps = prepare(cfg.directory, self._identity())
        # Removes what a killed attempt left half-written (not committed: never listed anyway).
        for tmp in steps.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)
        options = ocp.CheckpointManagerOptions(
            # A fixed step interval: every process decides alike without a collective.
            save_decision_policy=cm.FixedIntervalPolicy(cfg.interval_steps),
            preservation_policy=cm.LatestN(n=KEEP),
            enable_async_checkpointing=True,
            create=False,
            cleanup_tmp_directories=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=None, active_processes=processes, barrier_sync_key_prefix="tpujob-local"
            ),
            single_host_load_and_broadcast=False,
            enable_background_delete=False,
            save_root_metadata=False,
            enable_per_process_directory_creation=True,
            async_options=checkpointing.synchronous_directories(),
        )
        self.manager = _LocalManager(steps, options=options, item_handlers=_handler(processes))
        # The interval in force: a multiple of cfg.interval_steps (the manager's own policy), the same on
        # every process, re-chosen at the RECHOOSE_AT_SAVES-th due save.
        self.interval_steps = cfg.interval_steps
        # No save before this step: what the saves made before the interval was priced spent beyond the
        # budget is paid back first, as the GCS tier's adaptive policy pays its debt (the same on every process).
        self.hold_until = 0
        self._due_saves = 0
        self.off = False  # its volume is too small for its copies (Undersized): GCS alone
        self.buddies: buddy.Buddies | None = None  # start_buddies
        self.meter = SaveCostMeter(min_idle_steps=MIN_IDLE_STEPS)
        budget = f"{cfg.overhead_budget_percent:g}% of step time" if cfg.overhead_budget_percent else "no budget"
        log.info("local tier: %s, every %d steps at most (%s)", steps, cfg.interval_steps, budget)

    def wants_buddies(self) -> bool:
        """Whether this process's steps should be kept by a buddy: on, and no other slice holds its shards
        (one slice of several hosts); the same answer on every process."""
        topology = jax.process_count(), self.num_slices
        return (
            self.cfg.buddy_copies
            and self.num_slices == 1
            and buddy.buddy_of(jax.process_index(), *topology) is not None
        )

    def start_buddies(self, store: buddy.KeyValueStore) -> None:
        """Keep the ward's steps and send this process's to its buddy (buddy.py); collective through the
        key-value store (process 0 hands out the token)."""
        root = Path(self.cfg.directory) / buddy.KEPT_DIR
        ward = buddy.ward_of(jax.process_index(), jax.process_count(), self.num_slices)
        kept = prepare(str(root), self._identity(ward))
        self.buddies = buddy.Buddies(
            kept, Path(self.manager.directory), store, jax.process_index(), (jax.process_count(), self.num_slices),
            self._identity, KEEP,
        )  # fmt: skip
        log.info("local tier: buddy copies on: process %d keeps process %d's steps, process %d keeps ours",
                 jax.process_index(), self.buddies.ward, self.buddies.buddy)  # fmt: skip

    def stop_buddies(self) -> None:
        if self.buddies:
            self.buddies.close()
            self.buddies = None

    def kept_steps(self) -> list[int]:
        """The ward's committed steps this process keeps (none without buddy copies)."""
        return self.buddies.keeper.steps() if self.buddies else []

    def committed_steps(self) -> list[int]:
        self.manager.reload()
        return sorted(int(s) for s in self.manager.all_steps())

    @property
    def measuring(self) -> bool:
        """A re-choice of the interval is ahead: the loop times every step for it (see step)."""
        return bool(self.cfg.overhead_budget_percent) and self._due_saves < RECHOOSE_AT_SAVES[-1]

    def step(self, seconds: float) -> None:
        """One step took `seconds` of its own compute (not the loop's saves or reports), while measuring:
        a step beside a local save in flight (or its buddy copy) is charged its slowdown against the steps
        with none."""
        copying = self.buddies is not None and self.buddies.sender.busy
        self.meter.step(seconds, self.manager.is_saving_in_progress() or copying)

    def save(self, step: int, state: Any) -> bool:
        """Start an async save if the interval says so (blocking only for the copy off the devices,
        and for a previous local save still in flight). Called at every step on every process.
        Raises Undersized at the first due save when a process's volume cannot hold COPIES of its state."""
        # The interval first: Orbax's own decision costs a little Python on every step.
        if self.off or not self._due(step):
            return False
        if self._due_saves == 0:
            state_bytes, volume = host_bytes(state), volume_bytes(self.cfg.directory)
            mine = room_problem(state_bytes, volume)
            if not checkpointing.agree_all(mine is None):  # saves are collective: all save, or none
                self.off = True
                self.stop_buddies()
                raise Undersized(mine or "the local tier of another process is too small for its state")
            if self.buddies:
                with_buddies = room_problem(state_bytes, volume, buddy_copies=True)
                if not checkpointing.agree_all(with_buddies is None):
                    log.warning("local tier: %s", with_buddies or "another process's volume cannot keep buddy copies"
                                "; buddy copies are off, local saves go on")  # fmt: skip
                    self.stop_buddies()
        self._due_saves += 1
        if self.cfg.overhead_budget_percent and self._due_saves in RECHOOSE_AT_SAVES:
            self._rechoose(step)
            if not self._due(step):
                return False
        if not self.manager.should_save(step):
            return False
        if not self.measuring:
            return self._saved(step, bool(self.manager.save(step, args=ocp.args.PyTreeSave(state))))
        jax.block_until_ready(state)  # type: ignore[no-untyped-call]  # steps still computing: training time
        started = time.monotonic()
        saved = bool(self.manager.save(step, args=ocp.args.PyTreeSave(state)))
        if saved:
            self.meter.saved(time.monotonic() - started)
        return self._saved(step, saved)

    def _saved(self, step: int, saved: bool) -> bool:
        if saved and self.buddies:
            self.buddies.sender.offer(step)  # sent once committed, in the background
        return saved

    def _due(self, step: int) -> bool:
        """At the interval in force, and nothing left to pay back."""
        return step % self.interval_steps == 0 and step >= self.hold_until

    def _rechoose(self, step: int) -> None:
        """The interval from what the saves so far cost (blocking plus the slowdown of the steps beside
        their background write), planned at cadence.HEADROOM of the budget as the GCS tier's adaptive
        policy is, and the steps that pay back what they spent beyond it; each agreed by every process
        (the longest proposed)."""
        cost_s, step_s = self.meter.cost_s or 0.0, self.meter.baseline_s or 0.0
        budget = self.cfg.overhead_budget_percent
        plan = budget * HEADROOM
        agreed = checkpointing.agree_max(budgeted_interval(self.cfg.interval_steps, cost_s, step_s, plan))
        owed = checkpointing.agree_max(debt_steps(self.meter.debt_s(plan / 100), step_s))
        if agreed != self.interval_steps or owed:
            log.info(
                "local tier: every %d steps from step %d, none before step %d (a save costs %.0f ms, a step"
                " takes %.1f ms; budget %g%%)", agreed, step, step + owed, 1000 * cost_s, 1000 * step_s, budget,
            )  # fmt: skip
        self.interval_steps, self.hold_until = agreed, step + owed

    def forget_after(self, step: int | None) -> None:
        """Remove this process's local steps newer than `step` (None: all): the attempt goes on from
        `step`, and a later save of the same step must not find an older trajectory's there."""
        removed = [s for s in self.committed_steps() if step is None or s > step]
        for s in removed:
            shutil.rmtree(Path(self.manager.directory) / str(s))
        if removed:
            log.info("local tier: removed steps %s (training goes on from %s)", removed, step)
            self.manager.reload()
        if self.buddies:  # a ward's newer steps are of the same abandoned trajectory
            self.buddies.keeper.forget_after(step)

    def fetch_from_buddy(self, step: int) -> None:
        """This process's copy of `step`, from its buddy into its own tier (then restored as its own)."""
        assert self.buddies
        self.buddies.fetch(step)
        self.manager.reload()

    def restore(self, step: int, abstract_state: Any) -> Any:
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        return self.manager.restore(step, args=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args))

    def restore_alone(self, step: int, abstract_state: Any) -> Any:
        """This process's shards of `step`, with no barrier: the processes that do not hold it (a peer
        restore's receivers) do not call this."""
        me = {jax.process_index()}
        options = ocp.options.MultiprocessingOptions(
            primary_host=None, active_processes=me, barrier_sync_key_prefix="tpujob-peer"
        )
        with ocp.Checkpointer(_handler(me), multiprocessing_options=options) as checkpointer:
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
            item = Path(self.manager.directory) / str(step) / ocp.checkpoint_manager.DEFAULT_ITEM_NAME
            args = ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args)
            return checkpointer.restore(item, args=args)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        self.stop_buddies()


def gather_steps(mine: Sequence[int]) -> list[list[int]]:
    """Every process's newest committed local steps, by process (a collective with >1 process)."""
    newest = sorted(mine, reverse=True)[:_AGREE_SLOTS]
    if jax.process_count() == 1:
        return [newest]
    padded = np.full(_AGREE_SLOTS, -1, dtype=np.int32)
    padded[: len(newest)] = newest
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), _AGREE_SLOTS)
    return [[int(s) for s in row if s >= 0] for row in gathered]
