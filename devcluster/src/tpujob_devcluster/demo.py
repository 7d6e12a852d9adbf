"""`make demo`: a slice fails in the middle of training and the job comes back by itself.

devcluster up -> operator installed with the Helm chart (its pod runs through the pod runner) ->
examples/demo.yaml applied -> once the committed step in the bucket has advanced several times
and training is well under way, one slice's worker is SIGKILLed half a checkpoint interval after a
commit -> the operator restarts the workers from the latest committed step -> training completes.

The live view is a small key/value table when stdout is a terminal, plain progress lines when it
is not. The report at the end shows the steps lost (checked against the trainer's record and the
bucket), what a fixed-interval policy would have lost at the same step, the recovery stage by
stage, and the goodput ledger.

The functions above `run_demo` are pure (no cluster, no clock): tests/unit/test_demo_report.py.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import tpujob_contract as contract
import yaml
from kubernetes import client, config
from tpujob_operator.api import IN_PLACE
from tpujob_operator.checkpoints import make_client, read_progress, split_gs_path

from .cluster import BUCKET, DevCluster, read_state
from .controlplane import REPO_ROOT
from .harness import helm_install_operator, live_pod_uids, trainer_pid

NAMESPACE = "default"
# The demo's TrainingJobs: the custom-object calls' (group, version, namespace, plural)
TRAININGJOBS = (contract.TRAININGJOB_GROUP, contract.TRAININGJOB_VERSION, NAMESPACE, contract.TRAININGJOB_PLURAL)
DEMO_MANIFEST = REPO_ROOT / "examples" / "demo.yaml"
DEMO_TIMEOUT_S = 600
# The kill waits until the committed step has advanced this many times and training is this far along.
KILL_AFTER_ADVANCES = 3
KILL_AFTER_FRACTION = 0.4
# The trainer publishes progress.json this often (default 5 s): the reported step at the kill is fresh.
PROGRESS_INTERVAL_SECONDS = "1"
MAXTEXT_CHECKPOINT_PERIOD = 100  # MaxText's default `checkpoint_period`
LEDGER_TOLERANCE = 0.02  # the parts of the goodput ledger add up to the wall time within 2%
PLAIN_LINE_EVERY_S = 10.0
BADPUT_CAUSES = (
    ("schedulingSeconds", "scheduling"),
    ("startupSeconds", "start-up"),
    ("restoreSeconds", "restore"),
    ("checkpointSaveSeconds", "checkpoint save"),
    ("wastedProgressSeconds", "wasted progress"),
    ("infrastructureRecoverySeconds", "infrastructure recovery"),
    ("suspendedSeconds", "suspended"),
)


# --- pure: arithmetic ----------------------------------------------------------------------------------


def fixed_interval_loss(step_at_kill: int, period: int) -> tuple[int, int]:
    """(step it would resume from, steps lost) for a policy that commits every `period` steps:
    the last multiple of `period` at or below the step reached is what it would have committed."""
    if period <= 0:
        raise ValueError(f"a checkpoint period is > 0, got {period}")
    resumed = period * (step_at_kill // period)
    return resumed, step_at_kill - resumed


def mean_loss_over_kill_steps(intervals: list[int]) -> float | None:
    """Steps lost on average by a kill at a uniformly random step, saves committing every `intervals`
    steps in turn (a kill inside an interval of d steps loses 0..d-1 of them): sum(d(d-1)/2) / sum(d)."""
    total = sum(intervals)
    return round(sum(d * (d - 1) / 2 for d in intervals) / total, 1) if total else None


def commit_intervals(committed_steps: list[int]) -> list[int]:
    """Step deltas between consecutive distinct committed steps (in step order)."""
    steps = sorted(set(committed_steps))
    return [b - a for a, b in itertools.pairwise(steps)]


def p50_interval(committed_steps: list[int]) -> int | None:
    """The median step delta between commits (the lower middle value for an even count)."""
    deltas = commit_intervals(committed_steps)
    return statistics.median_low(deltas) if deltas else None


@dataclass(frozen=True)
class StageDuration:
    name: str  # the event that ends the stage
    at: datetime
    offset_seconds: float  # since the first event
    seconds: float | None  # since the previous event; None for the first


def stage_durations(events: list[tuple[str, datetime | None]]) -> list[StageDuration]:
    """Each dated event, in the order given, with its time since the first and since the previous one.
    Events not (yet) dated are skipped."""
    dated = [(name, at) for name, at in events if at is not None]
    if not dated:
        return []
    first = dated[0][1]
    out: list[StageDuration] = []
    for i, (name, at) in enumerate(dated):
        previous = dated[i - 1][1] if i else None
        seconds = round((at - previous).total_seconds(), 1) if previous else None
        out.append(StageDuration(name, at, round((at - first).total_seconds(), 1), seconds))
    return out


@dataclass(frozen=True)
class Ledger:
    ratio: float | None
    wall: float
    productive: float
    badput: tuple[tuple[str, float], ...]  # (cause, seconds), in BADPUT_CAUSES order

    @property
    def parts(self) -> float:
        return self.productive + sum(seconds for _, seconds in self.badput)

    @property
    def adds_up(self) -> bool:
        return self.wall > 0 and abs(self.parts - self.wall) <= LEDGER_TOLERANCE * self.wall


def ledger_of(goodput: dict[str, Any] | None) -> Ledger | None:
    if not goodput:
        return None
    badput = goodput.get("badput") or {}
    return Ledger(
        ratio=goodput.get("ratio"),
        wall=float(goodput.get("wallSeconds") or 0),
        productive=float(goodput.get("productiveSeconds") or 0),
        badput=tuple((label, float(badput.get(key) or 0)) for key, label in BADPUT_CAUSES),
    )


# --- pure: what the demo saw, and the report ------------------------------------------------------------


@dataclass(frozen=True)
class TrainerRun:
    """One run of the trainer: a process start. An in-place restart starts a new run in the same attempt."""

    attempt: int
    process_started_at: str | None  # the record's own RFC 3339 string, as the trainer wrote it


@dataclass
class Seen:
    """What the demo saw itself, in the bucket and the trainer's record (independently of the operator)."""

    committed: list[int] = field(default_factory=list)  # distinct committed steps, in the order first seen
    kill_time: datetime | None = None
    killed_pod: str | None = None
    committed_at_kill: int | None = None  # latest committed step in the bucket when the worker was killed
    trainer_step_before_kill: int | None = None
    trainer_last_step_of_killed_run: int | None = None  # the killed run's last progress record (after the kill too)
    resumed: contract.ProgressRecord | None = None  # the restarted run's record, once it trained a step
    # The worker pods (name -> uid) at the kill and once training resumed: the same on the InPlace rung.
    pods_at_kill: dict[str, str] = field(default_factory=dict)
    pods_resumed: dict[str, str] = field(default_factory=dict)
    failure: dict[str, Any] | None = None  # status.lastFailure of the kill (not of any later failure)
    # The picture's time series, in seconds since started_at (the demo's clock: the kill's, the trainer's
    # record's and the apiserver's times are all this host's): the trainer's (run, step) as its record
    # first showed it, run indexing runs, and each committed step as the demo first found it in the bucket.
    started_at: datetime | None = None
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds, run, step)
    runs: list[TrainerRun] = field(default_factory=list)  # in the order they started: run 0, 1, ...
    commits_at: list[tuple[float, int]] = field(default_factory=list)  # (seconds, committed step)

    def saw_failure(self, failure: dict[str, Any] | None) -> None:
        """Follow the first failure recorded after the kill as the operator completes its timeline."""
        if self.kill_time is None or not failure:
            return
        if self.failure is None or self.failure.get("time") == failure.get("time"):
            self.failure = failure

    def saw_commits(self, steps: list[int], at: datetime | None = None) -> bool:
        new = [s for s in sorted(steps) if s not in self.committed]
        self.committed.extend(new)
        if at is not None:
            self.commits_at.extend((self.seconds(at), s) for s in new)
        return bool(new)

    def saw_progress(self, record: contract.ProgressRecord) -> None:
        """A sample when the trainer's record shows a new (run, step), at the record's own time (the step's,
        not the demo's poll's). A run is told by the process start, not the attempt alone: a restart in place
        keeps the attempt, and its restored step is below the killed run's last one."""
        run = TrainerRun(record.attempt, record.process_started_at)
        if not self.runs or self.runs[-1] != run:  # the attempt too: a record without a start time still splits
            self.runs.append(run)
        elif self.samples and self.samples[-1][1:] == (len(self.runs) - 1, record.step):
            return
        self.samples.append((self.seconds(record.updated), len(self.runs) - 1, record.step))

    def saw_run(self, record: contract.ProgressRecord) -> bool:
        """Follow the killed run and the restarted one by the trainer's start time, not by the attempt: a
        restart in place keeps the attempt. True when this record is the restarted run's first trained one."""
        started = contract.parse_time(record.process_started_at)
        if self.kill_time is None or started is None or started < self.kill_time:
            self.trainer_last_step_of_killed_run = record.step
            return False
        if self.resumed is None and record.first_step_at:
            self.resumed = record
            return True
        return False

    def seconds(self, at: datetime) -> float:
        if self.started_at is None:
            self.started_at = at
        return round((at - self.started_at).total_seconds(), 2)

    @property
    def advances(self) -> int:
        return max(0, len(self.committed) - 1)


def event_text(seen: Seen, status: dict[str, Any], kill_at_step: int) -> str:
    failure = status.get("lastFailure") or {}
    if seen.kill_time is None:
        latest = seen.committed[-1] if seen.committed else "none"
        return (
            f"waiting: {seen.advances}/{KILL_AFTER_ADVANCES} commit advances, "
            f"step {kill_at_step}+ (committed: {latest})"
        )
    if failure.get("recoverySeconds") is not None:
        return f"resumed from step {failure.get('resumeStep')}, recovered in {failure['recoverySeconds']} s"
    if failure:
        return f"{failure.get('kind')} on slice {failure.get('slice')} detected; restarting"
    return f"SIGKILLed {seen.killed_pod} at step {seen.trainer_step_before_kill}"


@dataclass(frozen=True)
class Snapshot:
    elapsed: float
    phase: str
    stage: str
    attempt: int
    step: int | None
    total_steps: int
    loss: float | None
    checkpoint: int | None
    restarts: int
    lost_steps: int
    goodput: float | None
    event: str


def snapshot(tj: dict[str, Any], seen: Seen, elapsed: float, total_steps: int, kill_at_step: int) -> Snapshot:
    status = tj.get("status") or {}
    loss = status.get("loss")
    return Snapshot(
        elapsed=elapsed,
        phase=str(status.get("phase") or "-"),
        stage=str(status.get("stage") or "-"),
        attempt=int(status.get("attempt") or 0),
        step=status.get("step"),
        total_steps=total_steps,
        loss=float(loss) if isinstance(loss, int | float) else None,
        checkpoint=(status.get("latestCheckpoint") or {}).get("step"),
        restarts=int(status.get("restarts") or 0),
        lost_steps=int(status.get("lostSteps") or 0),
        goodput=(status.get("goodput") or {}).get("ratio"),
        event=event_text(seen, status, kill_at_step),
    )


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def progress_line(s: Snapshot) -> str:
    """One plain line (under 80 columns) for a log or a pipe."""
    good = "-" if s.goodput is None else f"{s.goodput:.0%}"
    return (
        f"{s.elapsed:4.0f}s {s.phase:<10} {s.stage:<10} try {s.attempt} step {_opt(s.step):>3}/{s.total_steps}"
        f" ckpt {_opt(s.checkpoint):>3} lost {s.lost_steps} good {good}"
    )


def view_rows(s: Snapshot) -> list[tuple[str, str]]:
    """The live view's rows (key, value): a vertical table fits any terminal of 80 columns."""
    loss = "" if s.loss is None else f"   loss {s.loss:.3f}"
    good = "-" if s.goodput is None else f"{s.goodput:.1%}"
    return [
        ("phase", f"{s.phase} / {s.stage}"),
        ("attempt", f"{s.attempt}   restarts {s.restarts}"),
        ("step", f"{_opt(s.step)} / {s.total_steps}{loss}"),
        ("checkpoint", f"{_opt(s.checkpoint)} (latest committed)"),
        ("lost steps", str(s.lost_steps)),
        ("goodput", good),
        ("event", s.event),
    ]


@dataclass(frozen=True)
class Check:
    what: str
    ok: bool


def _restore_tier_check(
    restored_from: str | None, resume_step: int | None, step_at_kill: int | None, local_interval: int | None
) -> Check:
    """The local tier, unless GCS held a newer step than any local save could have been (continuous GCS
    saves may land between two local ones: the trainer then rightly restores the newer GCS step)."""
    local = restored_from == contract.RESTORED_FROM_LOCAL
    if not local and resume_step is not None and step_at_kill is not None and local_interval is not None:
        newest_local = local_interval * (step_at_kill // local_interval)
        return Check(
            f"restored from {restored_from} at {resume_step}, newer than any local step (at most {newest_local})",
            resume_step > newest_local,
        )
    return Check(f"restored from the local tier (restoredFrom {restored_from})", local)


def report_data(
    status: dict[str, Any], seen: Seen, name: str = "demo", local_interval: int | None = None
) -> dict[str, Any]:
    """Everything the report says, as plain data (also written as JSON next to the cluster state).
    `local_interval`: the job's spec.checkpoint.local.intervalSteps, None without a local tier."""
    failure = seen.failure or status.get("lastFailure") or {}
    timeline = failure.get("timeline") or {}
    step_at_kill = failure.get("step")
    resume_step = failure.get("resumeStep")
    lost = failure.get("lostSteps")
    p50 = p50_interval(seen.committed)
    restored = seen.resumed.restored_step if seen.resumed else None
    checks = [
        Check(
            f"lastFailure.step {step_at_kill} = trainer's last reported step {seen.trainer_last_step_of_killed_run}",
            step_at_kill is not None and step_at_kill == seen.trainer_last_step_of_killed_run,
        ),
        Check(
            f"resumeStep {resume_step} = step the restarted run restored {restored}",
            resume_step is not None and resume_step == restored,
        ),
        Check(
            f"resumeStep {resume_step} >= committed in the bucket at the kill {seen.committed_at_kill}",
            resume_step is not None and seen.committed_at_kill is not None and resume_step >= seen.committed_at_kill,
        ),
        # Never negative: a save after the trainer's last report (the local tier's) resumes past that step.
        Check(
            f"lostSteps {lost} = max(0, {step_at_kill} - {resume_step})",
            lost is not None
            and step_at_kill is not None
            and resume_step is not None
            and lost == max(0, step_at_kill - resume_step),
        ),
    ]
    rung = failure.get("rung")
    restored_from = seen.resumed.restored_from if seen.resumed else None
    if rung == IN_PLACE:
        checks += [
            Check(
                f"same {len(seen.pods_at_kill)} pods (names and uids) before and after the restart",
                bool(seen.pods_at_kill) and seen.pods_resumed == seen.pods_at_kill,
            ),
            _restore_tier_check(restored_from, resume_step, step_at_kill, local_interval),
        ]
    fixed = []
    if step_at_kill is not None:
        periods = [(MAXTEXT_CHECKPOINT_PERIOD, "MaxText's default")]
        if p50:
            periods.append((p50, "continuous's P50 here"))
        for period, why in periods:
            resumed, lost_fixed = fixed_interval_loss(step_at_kill, period)
            fixed.append(
                {
                    "period": period,
                    "why": why,
                    "resumes_from": resumed,
                    "steps_lost": lost_fixed,
                    "mean_steps_lost": mean_loss_over_kill_steps([period]),
                }
            )
    trainer_times = seen.resumed
    events: list[tuple[str, datetime | None]] = [
        ("SIGKILL sent by the demo", seen.kill_time),
        ("worker failed (pod finished)", contract.parse_time(timeline.get("failed"))),
        ("operator detected, decided", contract.parse_time(timeline.get("detected"))),
        ("replacement JobSet created", contract.parse_time(timeline.get("jobSetCreated"))),
        ("all pods scheduled", contract.parse_time(timeline.get("podsScheduled"))),
        ("trainer process started", contract.parse_time(trainer_times.process_started_at if trainer_times else None)),
        ("storage answered", contract.parse_time(trainer_times.storage_ready_at if trainer_times else None)),
        ("restore started", contract.parse_time(trainer_times.restore_started_at if trainer_times else None)),
        (
            "restore finished",
            contract.parse_time(trainer_times.restore_finished_at if trainer_times else None)
            or contract.parse_time(timeline.get("restored")),
        ),
        (
            "first new step (compiled)",
            contract.parse_time(trainer_times.first_step_at if trainer_times else None)
            or contract.parse_time(timeline.get("firstNewStep")),
        ),
    ]
    stages = stage_durations(events)
    ledger = ledger_of(status.get("goodput"))
    run = {
        "started_at": seen.started_at.isoformat() if seen.started_at else None,
        "kill_s": seen.seconds(seen.kill_time) if seen.kill_time and seen.started_at else None,
        "samples": [list(sample) for sample in seen.samples],  # [seconds, run, step]: run indexes runs
        "runs": [{"attempt": r.attempt, "process_started_at": r.process_started_at} for r in seen.runs],
        "commits": [list(commit) for commit in seen.commits_at],
    }
    return {
        "job": f"{NAMESPACE}/{name}",
        "phase": status.get("phase"),
        "final_step": status.get("step"),
        "restarts": status.get("restarts"),
        "last_failure_is_the_kill": failure == (status.get("lastFailure") or {}),
        "failure": {"kind": failure.get("kind"), "reason": failure.get("reason"), "slice": failure.get("slice")},
        "killed_pod": seen.killed_pod,
        "rung": rung,
        "restored_from": restored_from,
        "pods_at_kill": sorted(seen.pods_at_kill),
        "pods_resumed": sorted(seen.pods_resumed),
        "committed_steps_seen": list(seen.committed),
        "p50_interval_steps": p50,
        "mean_steps_lost_continuous": mean_loss_over_kill_steps(commit_intervals(seen.committed)),
        "step_at_kill": step_at_kill,
        "trainer_step_before_kill": seen.trainer_step_before_kill,
        "committed_at_kill": seen.committed_at_kill,
        "resume_step": resume_step,
        "steps_lost": lost,
        "checks": [{"what": c.what, "ok": c.ok} for c in checks],
        "fixed_interval": fixed,
        "recovery_seconds_operator": failure.get("recoverySeconds"),
        "timeline": [
            {"event": s.name, "at": s.at.isoformat(), "offset_s": s.offset_seconds, "stage_s": s.seconds}
            for s in stages
        ],
        "goodput": None
        if ledger is None
        else {
            "ratio": ledger.ratio,
            "wall_seconds": ledger.wall,
            "productive_seconds": ledger.productive,
            "badput_seconds": dict(ledger.badput),
            "parts_seconds": round(ledger.parts, 1),
            "adds_up": ledger.adds_up,
        },
        "run": run,  # the picture's data (picture.py): times in seconds since run.started_at
    }


def passed(data: dict[str, Any]) -> bool:
    goodput = data["goodput"]
    return (
        data["phase"] == "Succeeded"
        and data["last_failure_is_the_kill"]
        and data["restarts"] == 1
        and all(c["ok"] for c in data["checks"])
        and goodput is not None
        and goodput["adds_up"]
    )


def _pods_text(data: dict[str, Any]) -> str:
    before, after = data["pods_at_kill"], data["pods_resumed"]
    if before and before == after:
        return f"the same {len(before)} after the restart (same uids)"
    return f"{len(before)} at the kill, {len(after)} after, {len(set(before) & set(after))} of them the same"


def format_report(data: dict[str, Any]) -> str:
    """The report as text, no line over 80 columns."""
    lines = [
        f"TrainingJob {data['job']}: {data['phase']} at step {data['final_step']}, {data['restarts']} restart(s)",
        f"failure: {data['failure']['kind']}/{data['failure']['reason']} on slice {data['failure']['slice']}",
        f"killed:  {data['killed_pod']}",
        f"rung:    {_opt(data['rung'])}, restored from the {_opt(data['restored_from'])} tier",
        f"pods:    {_pods_text(data)}",
        *([] if data.get("last_failure_is_the_kill", True) else ["(a later failure happened too: see status)"]),
        "",
        "Steps lost",
        f"  trainer's report just before the SIGKILL          {_opt(data['trainer_step_before_kill']):>6}",
        f"  step reached (lastFailure.step: its last report)  {_opt(data['step_at_kill']):>6}",
        f"  committed in the bucket at the kill               {_opt(data['committed_at_kill']):>6}",
        f"  resumed from (the restarted run restored)         {_opt(data['resume_step']):>6}",
        f"  steps lost (status.lastFailure.lostSteps)         {_opt(data['steps_lost']):>6}",
    ]
    lines += [f"  [{'ok' if c['ok'] else 'MISMATCH'}] {c['what']}" for c in data["checks"]]
    seen = data["committed_steps_seen"]
    lines += [
        "",
        f"A fixed-interval policy at the same step ({_opt(data['step_at_kill'])})",
        "  Saving every N steps, the last multiple of N at or below the step reached",
        "  is what it would resume from: it loses step - N*floor(step/N) steps",
        "  (best case for it: that save is taken as committed by the kill).",
    ]
    lines.append(f"  {'policy':<38}{'resumes from':>13}{'lost':>6}{'mean*':>7}")
    for f in data["fixed_interval"]:
        policy = f"fixed, N = {f['period']} ({f['why']})"
        lines.append(f"  {policy:<38}{f['resumes_from']:>13}{f['steps_lost']:>6}{f['mean_steps_lost']:>7}")
    lines.append(
        f"  {'continuous (this run)':<38}{_opt(data['resume_step']):>13}{_opt(data['steps_lost']):>6}"
        f"{_opt(data['mean_steps_lost_continuous']):>7}"
    )
    lines.append(f"  ({len(seen)} commits seen, P50 interval {_opt(data['p50_interval_steps'])} steps)")
    lines.append("  * mean: steps lost by a kill at a random step, from the intervals")
    lines.append("    (N each for fixed; this run's commit deltas for continuous)")
    lines += ["", f"Recovery (operator's recoverySeconds: {_opt(data['recovery_seconds_operator'])} s)"]
    lines.append(f"  {'since kill':>10}  {'stage':>6}  event")
    for t in data["timeline"]:
        stage = "" if t["stage_s"] is None else f"{t['stage_s']:+.1f}s"
        lines.append(f"  {t['offset_s']:>9.1f}s  {stage:>6}  {t['event']}")
    lines.append("  (pod times from Kubernetes are whole seconds; the others are exact)")
    goodput = data["goodput"]
    lines += ["", "Goodput ledger"]
    if goodput is None:
        lines.append("  status.goodput is not set")
    else:
        ratio = "-" if goodput["ratio"] is None else f"{goodput['ratio']:.1%}"
        wall = goodput["wall_seconds"]
        lines.append(f"  goodput {ratio}: {goodput['productive_seconds']:.1f} s productive of {wall:.1f} s wall")
        for cause, seconds in goodput["badput_seconds"].items():
            share = f"{seconds / wall:6.1%}" if wall else ""
            lines.append(f"  badput {cause:<24} {seconds:7.1f} s  {share}")
        verdict = "adds up" if goodput["adds_up"] else "DOES NOT add up"
        lines.append(
            f"  productive + badput = {goodput['parts_seconds']:.1f} s vs wall {wall:.1f} s: {verdict}"
            f" (within {LEDGER_TOLERANCE:.0%})"
        )
    return "\n".join(lines)


# --- the run -------------------------------------------------------------------------------------------


def committed_steps(gcs: Any, run_dir: str, known: list[int]) -> list[int]:
    """Every committed step in the bucket now (Orbax keeps the latest few): new ones are checked for
    their commit marker, known ones are not asked again."""
    bucket_name, prefix = split_gs_path(run_dir)
    checkpoints = f"{prefix}/{contract.CHECKPOINTS_DIR}/"
    listing = gcs.list_blobs(bucket_name, prefix=checkpoints, delimiter="/")
    for _ in listing.pages:
        pass
    steps = [contract.step_of(p) for p in listing.prefixes]
    bucket = gcs.bucket(bucket_name)
    return [
        s
        for s in steps
        if s is not None and (s in known or bucket.blob(f"{checkpoints}{s}/{contract.COMMIT_MARKER}").exists())
    ]


def kill_one_slice_worker(core: client.CoreV1Api, state_dir: Path, js_name: str) -> str:
    """SIGKILL the trainer process of slice 1's first worker: a crash of the training process."""
    pods: list[Any] = core.list_namespaced_pod(
        NAMESPACE, label_selector=f"{contract.JOBSET_NAME_LABEL}={js_name},{contract.JOB_INDEX_ANNOTATION}=1"
    ).items
    running = [
        p.metadata.name for p in pods
        if p.status.phase == "Running" and p.metadata.annotations.get("batch.kubernetes.io/job-completion-index") == "0"
    ]  # fmt: skip
    if not running:
        raise RuntimeError(f"no worker of slice 1 of {js_name} is running")
    os.kill(trainer_pid(state_dir, NAMESPACE, running[0]), signal.SIGKILL)
    return str(running[0])


class LiveView:
    """rich's live table on a terminal; plain progress lines (on change, or every few seconds) otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._live: Any = None
        self._last_key: tuple[Any, ...] | None = None
        self._last_event = ""
        self._last_print = float("-inf")

    def __enter__(self) -> LiveView:
        if self.tty:
            from rich.live import Live

            self._live = Live(refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def say(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, flush=True)

    def update(self, s: Snapshot, name: str) -> None:
        if self._live is not None:
            from rich.table import Table

            table = Table(title=f"TrainingJob {NAMESPACE}/{name}  ({s.elapsed:.0f} s)", show_header=False)
            table.add_column(style="bold", no_wrap=True)
            table.add_column(overflow="fold")
            for key, value in view_rows(s):
                table.add_row(key, value)
            self._live.update(table)
            return
        state = (s.phase, s.stage, s.attempt, s.restarts, s.lost_steps)
        now = time.monotonic()
        if state != self._last_key or now - self._last_print >= PLAIN_LINE_EVERY_S:
            print(progress_line(s), flush=True)
            self._last_key, self._last_print = state, now
        if s.event != self._last_event:
            print(f"{s.elapsed:4.0f}s {s.event}", flush=True)
            self._last_event = s.event


def run_demo(state_dir: Path) -> int:
    started_here = read_state(state_dir) is None
    cluster = DevCluster(state_dir).start() if started_here else None
    kubeconfig = Path(read_state(state_dir)["kubeconfig"])  # type: ignore[index]
    try:
        print("devcluster up; installing the operator with Helm ...", flush=True)
        helm_install_operator(kubeconfig, "reconcile.progressCheckSeconds=5")  # status follows the short run closely
        api = config.new_client_from_config(str(kubeconfig))
        custom = client.CustomObjectsApi(api)
        core = client.CoreV1Api(api)
        manifest = yaml.safe_load(DEMO_MANIFEST.read_text())
        name = manifest["metadata"]["name"]
        args = manifest["spec"]["args"]
        total_steps = int(args[args.index("--steps") + 1])
        kill_at_step = int(total_steps * KILL_AFTER_FRACTION)
        env = manifest["spec"].setdefault("env", [])
        env.append({"name": contract.PROGRESS_INTERVAL_ENV, "value": PROGRESS_INTERVAL_SECONDS})
        os.environ.update(_gcs_env(state_dir))
        gcs = make_client()
        run_dir = f"gs://{BUCKET}/runs/{NAMESPACE}/{name}"
        _delete_previous(custom, gcs, name, run_dir)
        custom.create_namespaced_custom_object(*TRAININGJOBS, manifest)
        print(f"applied {DEMO_MANIFEST.name} ({total_steps} steps, 2 slices x 2 hosts)", flush=True)
        seen = Seen(started_at=datetime.now(UTC))
        start = time.monotonic()
        commit_times: list[float] = []
        kill_due: float | None = None
        tj: Any = {}
        with LiveView() as live:
            while time.monotonic() - start < DEMO_TIMEOUT_S:
                tj = custom.get_namespaced_custom_object(*TRAININGJOBS, name)
                status = tj.get("status") or {}
                if seen.saw_commits(committed_steps(gcs, run_dir, seen.committed), datetime.now(UTC)):
                    commit_times.append(time.monotonic())
                seen.saw_failure(status.get("lastFailure"))
                progress = read_progress(gcs, run_dir)  # the trainer's own record, not the status
                if progress is not None:
                    seen.saw_progress(progress)
                    if seen.saw_run(progress):
                        seen.pods_resumed = live_pod_uids(core, NAMESPACE, status["jobSetName"])
                live.update(snapshot(tj, seen, time.monotonic() - start, total_steps, kill_at_step), name)
                if status.get("phase") in ("Succeeded", "Failed"):
                    break
                if (
                    kill_due is None
                    and seen.kill_time is None
                    and seen.advances >= KILL_AFTER_ADVANCES
                    and seen.committed[-1] >= kill_at_step
                ):
                    # Half a (seconds) commit interval after a commit: the middle of an interval, not its start.
                    gaps = [b - a for a, b in itertools.pairwise(commit_times)]
                    kill_due = time.monotonic() + (statistics.median(gaps) / 2 if gaps else 0.0)
                due = kill_due is not None and seen.kill_time is None and time.monotonic() >= kill_due
                if due and status.get("phase") == "Running" and progress is not None and progress.attempt == 0:
                    seen.committed_at_kill = max(seen.committed)
                    seen.trainer_step_before_kill = progress.step
                    seen.pods_at_kill = live_pod_uids(core, NAMESPACE, status["jobSetName"])
                    seen.killed_pod = kill_one_slice_worker(core, state_dir, status["jobSetName"])
                    seen.kill_time = datetime.now(UTC)
                    live.say(f"SIGKILL {seen.killed_pod} (trainer at step {progress.step})")
                time.sleep(0.3)
        final = read_progress(gcs, run_dir)
        if final is not None:
            seen.saw_progress(final)
            if seen.resumed is not None and final.process_started_at == seen.resumed.process_started_at:
                seen.resumed = final  # the restarted run's start-up timestamps are kept in every record of it
        local = ((tj.get("spec") or {}).get("checkpoint") or {}).get("local")
        local_interval = local.get("intervalSteps", contract.DEFAULT_LOCAL_INTERVAL_STEPS) if local else None
        data = report_data(tj.get("status") or {}, seen, name, local_interval)
        (state_dir / "demo-report.json").write_text(json.dumps(data, indent=2))
        print("\n" + format_report(data))
        picture = _draw(data, state_dir / "demo-report.png")
        ok = passed(data)
        print(f"\ndemo {'passed' if ok else 'FAILED'} (JSON: {state_dir / 'demo-report.json'}{picture})")
        if not ok:
            print(f"pod logs (operator and workers): {state_dir / 'pods'}/<namespace>/<pod>/log")
        return 0 if ok else 1
    finally:
        if cluster is not None:
            cluster.stop()


def _draw(data: dict[str, Any], path: Path) -> str:
    """The picture, next to the JSON; it is no part of the verdict, so nothing it raises fails the demo."""
    try:
        from .picture import draw_report  # matplotlib is imported only here

        draw_report(data, path)
    except Exception as error:  # any: a picture that cannot be drawn is logged, the demo goes on
        print(f"the picture was not drawn: {error!r}", flush=True)
        return ""
    return f", picture: {path}"


def _delete_previous(custom: client.CustomObjectsApi, gcs: Any, name: str, run_dir: str) -> None:
    """A rerun starts from scratch: an earlier demo's job and its checkpoints are removed first."""
    try:
        custom.delete_namespaced_custom_object(*TRAININGJOBS, name)
        time.sleep(3)  # let the garbage collector take the old JobSet and the pod runner its processes
    except client.exceptions.ApiException as error:
        if error.status != 404:
            raise
    bucket_name, prefix = split_gs_path(run_dir)
    for blob in gcs.list_blobs(bucket_name, prefix=prefix + "/"):
        blob.delete()


def _gcs_env(state_dir: Path) -> dict[str, str]:
    endpoint = read_state(state_dir)["gcs"]  # type: ignore[index]
    return {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "tpujob-demo"}
