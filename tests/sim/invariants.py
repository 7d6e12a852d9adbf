"""The operator's promises (docs/concepts/invariants.md), checked against the simulated world after
every second. Each returns the violations it finds, as sentences; none is a pass."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpujob_operator.jobset import TERMINATION_GRACE_SECONDS, jobset_name
from tpujob_operator.nodes import NODE_FAILURE_WINDOW_SECONDS

from .control import Decision, Operator
from .world import Fault, World

# How long a job that ended Failed, or was deleted, may still hold a JobSet or a pod (invariant 6).
RELEASE_SECONDS = 60
EFFECT_ORDER = ("ends", "stalls", "signals")  # which fault a failure is put down to first


@dataclass
class Watch:
    """What the checks remember between seconds."""

    ever_committed: set[int] = field(default_factory=set)
    ended_at: int | None = None  # Failed, or deleted
    saves_blocked_since_end: bool = False  # the workers' storage hung, or a save outlasted the bound, after the end
    checked_decisions: int = 0
    checked_recoveries: int = 0


def check(world: World, operator: Operator, watch: Watch) -> list[str]:
    found: list[str] = []
    found += _checkpoints_kept(world, watch)
    found += [f"2. attempts overlap: {o}" for o in world.truth.overlaps]
    found += _save_grace(world, operator)
    found += _failures_charged_truly(world, operator, watch)
    found += _resizes_bounded(world, operator)
    found += _released(world, watch)
    found += _succeeded_only_when_committed(world)
    found += [f"9. a restarted operator decides otherwise: {m}" for m in operator.mismatches]
    found += _resume_points_true(operator, watch)
    return found


def _checkpoints_kept(world: World, watch: Watch) -> list[str]:
    """1. No committed step is removed except by the preservation policy; none is damaged."""
    storage = world.storage
    watch.ever_committed |= storage.committed
    found = [f"1. committed step {s} was damaged (written by two trainers)" for s in sorted(storage.damaged)]
    lost = watch.ever_committed - storage.committed - storage.removed_by_keep
    found += [f"1. committed step {s} was removed outside the preservation policy" for s in sorted(lost)]
    return found


def _phase(world: World) -> str | None:
    return None if world.training_job is None else (world.training_job.get("status") or {}).get("phase")


def _save_grace(world: World, operator: Operator) -> list[str]:
    """3. A stop that is not a give-up gives the workers their save grace: no healthy trainer is killed in
    the middle of its SIGTERM save while the job is not Failed."""
    if _phase(world) == "Failed":
        return []
    return [f"3. save cut short: {k}" for k in world.truth.killed_saving]


def _failures_charged_truly(world: World, operator: Operator, watch: Watch) -> list[str]:
    """4 and 8. A failure the job caused is counted; an infrastructure failure never is."""
    found: list[str] = []
    for decision in operator.decisions[watch.checked_decisions :]:
        found += _charged(world, decision)
    watch.checked_decisions = len(operator.decisions)
    return found


def _charged(world: World, decision: Decision) -> list[str]:
    before, after = decision.before, decision.status
    failure = after.last_failure
    if failure is None or (before.last_failure is not None and before.last_failure.time == failure.time):
        return []
    if decision.applied == 0:
        return []  # the operator died before it wrote the record: the next one decides again
    name = jobset_name(world.training_job_name, before.attempt)
    runs = sorted(run for js, run in world.truth.faults if js == name)
    if not runs:
        # No fault in that run: a timeout may still fire (capacity never came), but a hang cannot, since
        # no trainer hung (a save slower than the hang timeout is storage's speed, not the job's failure).
        if failure.kind == "Hang" and failure.counted:
            return [f"8. t={decision.time}: no fault in {name}, charged as {failure.kind}/{failure.reason}"]
        return []
    # An in-place round keeps the pods and their nodes: a node fault of a round before is still evidence.
    earlier = [f for run in runs[:-1] for f in world.truth.faults[(name, run)]] if world.config.in_place else []
    causes = _causes(world.truth.faults[(name, runs[-1])], earlier)
    what = " or ".join(f"{f.what} ({f.cause})" for f in causes)
    # An in-place restart that trained no step by its deadline climbs to Recreate uncounted whatever held
    # it (a hang of the restarted trainer, or a host the rung left unusable: the operator cannot tell them
    # apart before a step): bounded, since the Recreate attempt's own silence is counted.
    stalled_in_place = failure.reason == "InPlaceRestartStalled"
    if all(f.cause == "job" for f in causes) and not failure.counted and not stalled_in_place:
        return [f"4. t={decision.time}: {what} recorded as {failure.kind}/{failure.reason}, not counted"]
    if all(f.cause == "infrastructure" for f in causes) and failure.counted:
        return [f"8. t={decision.time}: {what} charged as {failure.kind}/{failure.reason}"]
    return []


def _causes(faults: list[Fault], earlier: list[Fault]) -> list[Fault]:
    """What a failure may fairly be put down to: the first fault that ended a process (else the first
    that stalled it, else the first node signal), and every fault of the other side before it or within
    the nodes' evidence window after it (a crash beside a node that went away or unreachable may be
    either's: the operator gives the job the benefit of the doubt); of `earlier` runs' faults, those
    within the window before it."""
    first = min(faults, key=lambda f: (EFFECT_ORDER.index(f.effect), f.time))
    latest = first.time + NODE_FAILURE_WINDOW_SECONDS
    recent = [f for f in earlier if f.time >= first.time - NODE_FAILURE_WINDOW_SECONDS]
    return [first, *(f for f in [*recent, *faults] if f.cause != first.cause and f.time <= latest)]


def _resizes_bounded(world: World, operator: Operator) -> list[str]:
    """5. Resizes are bounded in any window: at most as many in any growAfterSeconds as there are sizes
    to shrink through, plus one grow (2 slices, minSlices 1: 2)."""
    times = [d.time for d in operator.decisions if d.applied and d.status.resizes > d.before.resizes]
    window, most = world.config.grow_after_seconds, 2
    crowded = [t for i, t in enumerate(times) if i >= most and t - times[i - most] < window]
    return [f"5. t={crowded[0]}: {most + 1} resizes within {window}s: {times}"] if crowded else []


def _released(world: World, watch: Watch) -> list[str]:
    """6. A job that ended Failed, or was deleted, holds no JobSet and no pod RELEASE_SECONDS later (a pod
    on a node its kubelet cannot hear from is the node's to end)."""
    if watch.ended_at is None and (world.training_job is None or _phase(world) == "Failed"):
        watch.ended_at = world.now
    if watch.ended_at is not None and (
        world.storage.blind_for_workers(world.now)
        or any(s.commits_at > watch.ended_at + RELEASE_SECONDS for s in world.storage.in_flight.values())
    ):
        watch.saves_blocked_since_end = True
    # A SIGTERM save that storage cannot take, or takes slowly, holds its pod until the pod's grace ends.
    bound = TERMINATION_GRACE_SECONDS if watch.saves_blocked_since_end else RELEASE_SECONDS
    if watch.ended_at is None or world.now - watch.ended_at < bound:
        return []
    held = [js.name for js in world.live_jobsets()]
    held += [
        p.name
        for p in world.live_pods()
        if not p.ended() and (p.node is None or (world.nodes[p.node].exists and world.nodes[p.node].reachable))
    ]
    return [f"6. t={world.now}: ended at {watch.ended_at}, still holds {held}"] if held else []


def _succeeded_only_when_committed(world: World) -> list[str]:
    """7. Succeeded only when the final step is committed."""
    if _phase(world) != "Succeeded" or world.config.final_step in world.storage.committed:
        return []
    return [f"7. t={world.now}: Succeeded without the final step {world.config.final_step} committed"]


def _resume_points_true(operator: Operator, watch: Watch) -> list[str]:
    """10. A failure's record says where its recovery resumed: once the recovery is measured (from the
    restarted trainer's record), its resume step is the step that trainer restored."""
    found: list[str] = []
    for decision in operator.decisions[watch.checked_recoveries :]:
        failure, progress = decision.status.last_failure, decision.progress
        before = decision.before.last_failure
        measured_now = (
            failure is not None
            and failure.recovery_seconds is not None
            and (before is None or before.time != failure.time or before.recovery_seconds is None)
        )
        if decision.applied and measured_now and progress is not None and progress.restored_step is not None:
            assert failure is not None
            if failure.resume_step != progress.restored_step:
                found.append(
                    f"10. t={decision.time}: {failure.kind} on the {failure.rung} rung resumed from step "
                    f"{progress.restored_step}, its record says {failure.resume_step}"
                )
    watch.checked_recoveries = len(operator.decisions)
    return found
