"""`make demo`'s pure parts: the fixed-interval counterfactual, the commit interval, the recovery
stages, the ledger check, the live view's lines and the final report (80 columns, exact text)."""

import dataclasses
import io
from datetime import UTC, datetime, timedelta

import pytest
import tpujob_contract as contract
from rich.console import Console
from rich.table import Table
from tpujob_devcluster import demo

from .factories import progress_record

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _z(seconds: float) -> str:
    return _at(seconds).strftime("%Y-%m-%dT%H:%M:%SZ")  # the operator's whole-second times


# Deltas 20 19 22 18 21 19 21 19 22 21 18 19: twelve of them, the lower middle one is 19.
COMMITTED = [1, 21, 40, 62, 80, 101, 120, 141, 160, 182, 203, 221, 240]


def test_fixed_interval_loss_is_the_step_past_the_last_multiple():
    assert demo.fixed_interval_loss(229, 100) == (200, 29)
    assert demo.fixed_interval_loss(229, 19) == (228, 1)
    assert demo.fixed_interval_loss(200, 100) == (200, 0)
    assert demo.fixed_interval_loss(87, 100) == (0, 87)  # before the first save: everything is lost
    assert demo.fixed_interval_loss(0, 100) == (0, 0)
    with pytest.raises(ValueError):
        demo.fixed_interval_loss(229, 0)


def test_p50_interval_is_the_lower_median_of_distinct_committed_steps():
    assert demo.commit_intervals(COMMITTED) == [20, 19, 22, 18, 21, 19, 21, 19, 22, 21, 18, 19]
    assert demo.p50_interval(COMMITTED) == 19
    assert demo.p50_interval([40, 1, 21, 21]) == 19  # sorted and deduplicated: deltas 20, 19
    assert demo.p50_interval([5]) is None
    assert demo.p50_interval([]) is None


def test_mean_loss_over_a_random_kill_step():
    assert demo.mean_loss_over_kill_steps([100]) == 49.5  # (N - 1) / 2 for a fixed interval
    assert demo.mean_loss_over_kill_steps([1, 1, 1]) == 0.0  # a commit every step loses nothing
    # 10 steps in an interval of 10 lose 0..9 (45), 30 in one of 30 lose 0..29 (435): 480 / 40.
    assert demo.mean_loss_over_kill_steps([10, 30]) == 12.0
    assert demo.mean_loss_over_kill_steps(demo.commit_intervals(COMMITTED)) == 9.5  # 2272 / 239
    assert demo.mean_loss_over_kill_steps([]) is None


def test_stage_durations_skip_undated_events_and_keep_the_given_order():
    stages = demo.stage_durations([("a", _at(0.3)), ("b", _at(0)), ("c", None), ("d", _at(4.25)), ("e", _at(10))])
    assert [(s.name, s.offset_seconds, s.seconds) for s in stages] == [
        ("a", 0.0, None),
        ("b", -0.3, -0.3),
        ("d", 4.0, 4.2),
        ("e", 9.7, 5.8),
    ]
    assert demo.stage_durations([("a", None)]) == []


GOODPUT = {
    "ratio": 0.6,
    "wallSeconds": 200.0,
    "productiveSeconds": 120.0,
    "badput": {
        "schedulingSeconds": 10.0,
        "startupSeconds": 40.0,
        "restoreSeconds": 3.0,
        "checkpointSaveSeconds": 5.0,
        "wastedProgressSeconds": 2.0,
        "infrastructureRecoverySeconds": 20.0,
    },
}


def test_ledger_parts_and_tolerance():
    ledger = demo.ledger_of(GOODPUT)
    assert ledger is not None
    assert ledger.badput[-1] == ("suspended", 0.0)  # absent causes are zero
    assert ledger.parts == 200.0 and ledger.adds_up
    off_by_3_percent = {**GOODPUT, "productiveSeconds": 126.0}
    assert not demo.ledger_of(off_by_3_percent).adds_up  # type: ignore[union-attr]
    assert demo.ledger_of({**GOODPUT, "productiveSeconds": 123.9}).adds_up  # type: ignore[union-attr]
    assert demo.ledger_of(None) is None
    assert not demo.ledger_of({"wallSeconds": 0}).adds_up  # type: ignore[union-attr]


def _status(**failure_changes):
    failure = {
        "kind": "ApplicationError",
        "reason": "ExitCode137",
        "slice": 1,
        "step": 229,
        "resumeStep": 221,
        "lostSteps": 8,
        "rung": "Recreate",
        "recoverySeconds": 31.2,
        "timeline": {
            "failed": _z(0),
            "detected": _z(1),
            "jobSetCreated": _z(4),
            "podsScheduled": _z(6),
            "restored": _z(11),
            "firstNewStep": _z(30),
        },
    }
    failure.update(failure_changes)
    return {"phase": "Succeeded", "step": 500, "restarts": 1, "lastFailure": failure, "goodput": GOODPUT}


def _seen():
    resumed = progress_record(
        step=240, attempt=1, updated_at=_at(40), restored_step=221, restored_from="gcs",
        process_started_at=_at(7.25), storage_ready_at=_at(9), restore_started_at=_at(9.5),
        restore_finished_at=_at(11), first_step_at=_at(30.75),
    )  # fmt: skip
    return demo.Seen(
        committed=list(COMMITTED),
        kill_time=_at(0.3),
        killed_pod="demo-0-slice-1-0-x7k2p",
        committed_at_kill=221,
        trainer_step_before_kill=228,
        trainer_last_step_of_killed_run=229,
        resumed=resumed,
        pods_at_kill={"demo-a0-slice-0-0-ab": "u1", "demo-a0-slice-1-0-x7k2p": "u2"},
        pods_resumed={"demo-a1-slice-0-0-cd": "u3", "demo-a1-slice-1-0-ef": "u4"},
    )


EXPECTED_REPORT = """\
TrainingJob default/demo: Succeeded at step 500, 1 restart(s)
failure: ApplicationError/ExitCode137 on slice 1
killed:  demo-0-slice-1-0-x7k2p
rung:    Recreate, restored from the gcs tier
pods:    2 at the kill, 2 after, 0 of them the same

Steps lost
  trainer's report just before the SIGKILL             228
  step reached (lastFailure.step: its last report)     229
  committed in the bucket at the kill                  221
  resumed from (the restarted run restored)            221
  steps lost (status.lastFailure.lostSteps)              8
  [ok] lastFailure.step 229 = trainer's last reported step 229
  [ok] resumeStep 221 = step the restarted run restored 221
  [ok] resumeStep 221 >= committed in the bucket at the kill 221
  [ok] lostSteps 8 = max(0, 229 - 221)

A fixed-interval policy at the same step (229)
  Saving every N steps, the last multiple of N at or below the step reached
  is what it would resume from: it loses step - N*floor(step/N) steps
  (best case for it: that save is taken as committed by the kill).
  policy                                 resumes from  lost  mean*
  fixed, N = 100 (MaxText's default)              200    29   49.5
  fixed, N = 19 (continuous's P50 here)           228     1    9.0
  continuous (this run)                           221     8    9.5
  (13 commits seen, P50 interval 19 steps)
  * mean: steps lost by a kill at a random step, from the intervals
    (N each for fixed; this run's commit deltas for continuous)

Recovery (operator's recoverySeconds: 31.2 s)
  since kill   stage  event
        0.0s          SIGKILL sent by the demo
       -0.3s   -0.3s  worker failed (pod finished)
        0.7s   +1.0s  operator detected, decided
        3.7s   +3.0s  replacement JobSet created
        5.7s   +2.0s  all pods scheduled
        7.0s   +1.2s  trainer process started
        8.7s   +1.8s  storage answered
        9.2s   +0.5s  restore started
       10.7s   +1.5s  restore finished
       30.4s  +19.8s  first new step (compiled)
  (pod times from Kubernetes are whole seconds; the others are exact)

Goodput ledger
  goodput 60.0%: 120.0 s productive of 200.0 s wall
  badput scheduling                  10.0 s    5.0%
  badput start-up                    40.0 s   20.0%
  badput restore                      3.0 s    1.5%
  badput checkpoint save              5.0 s    2.5%
  badput wasted progress              2.0 s    1.0%
  badput infrastructure recovery     20.0 s   10.0%
  badput suspended                    0.0 s    0.0%
  productive + badput = 200.0 s vs wall 200.0 s: adds up (within 2%)"""


def test_report_checks_the_loss_against_the_trainer_and_the_bucket():
    data = demo.report_data(_status(), _seen())
    assert all(c["ok"] for c in data["checks"])
    assert data["fixed_interval"] == [
        {"period": 100, "why": "MaxText's default", "resumes_from": 200, "steps_lost": 29, "mean_steps_lost": 49.5},
        {"period": 19, "why": "continuous's P50 here", "resumes_from": 228, "steps_lost": 1, "mean_steps_lost": 9.0},
    ]
    assert demo.passed(data)
    wrong = demo.report_data(_status(lostSteps=3, resumeStep=224), _seen())
    assert [c["ok"] for c in wrong["checks"]] == [True, False, True, False]
    assert not demo.passed(wrong)
    assert not demo.passed({**data, "restarts": 2})
    assert not demo.passed({**data, "goodput": None})


def test_a_restore_past_the_last_report_lost_no_steps():
    """The local tier saved step 233 after the trainer last reported 229: the operator's lostSteps is 0,
    never 229 - 233."""
    seen = _seen()
    seen.resumed = dataclasses.replace(seen.resumed, restored_step=233)
    data = demo.report_data(_status(lostSteps=0, resumeStep=233), seen)
    assert demo.passed(data), data["checks"]
    assert {"what": "lostSteps 0 = max(0, 229 - 233)", "ok": True} in data["checks"]
    assert not demo.passed(demo.report_data(_status(lostSteps=4, resumeStep=233), seen))


def test_report_text_is_exact_and_fits_80_columns():
    text = demo.format_report(demo.report_data(_status(), _seen()))
    assert text == EXPECTED_REPORT
    assert max(len(line) for line in text.splitlines()) <= 80


def test_report_without_a_failure_or_a_ledger_still_prints():
    data = demo.report_data({"phase": "Failed", "restarts": 0}, demo.Seen())
    text = demo.format_report(data)
    assert "status.goodput is not set" in text
    assert data["fixed_interval"] == [] and data["timeline"] == []
    assert not demo.passed(data)


def _snapshot(**changes):
    fields = dict(
        elapsed=142.4, phase="Restarting", stage="StartingUp", attempt=1, step=229, total_steps=500,
        loss=3.14159, checkpoint=221, restarts=1, lost_steps=8, goodput=0.612,
        event="ApplicationError on slice 1 detected; restarting",
    )  # fmt: skip
    fields.update(changes)
    return demo.Snapshot(**fields)


def test_plain_progress_line_fits_80_columns():
    line = demo.progress_line(_snapshot())
    assert line == " 142s Restarting StartingUp try 1 step 229/500 ckpt 221 lost 8 good 61%"
    assert len(line) <= 80
    empty = demo.progress_line(_snapshot(step=None, checkpoint=None, goodput=None, phase="-", stage="-"))
    assert empty == " 142s -          -          try 1 step   -/500 ckpt   - lost 8 good -"


def test_live_table_is_not_truncated_at_80_columns():
    rows = demo.view_rows(_snapshot(event="SIGKILLed demo-0-slice-1-0-x7k2p at step 228 " * 3))
    assert rows[:6] == [
        ("phase", "Restarting / StartingUp"),
        ("attempt", "1   restarts 1"),
        ("step", "229 / 500   loss 3.142"),
        ("checkpoint", "221 (latest committed)"),
        ("lost steps", "8"),
        ("goodput", "61.2%"),
    ]
    table = Table(show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(table)
    rendered = out.getvalue()
    assert "…" not in rendered
    assert max(len(line) for line in rendered.splitlines()) <= 80
    assert "".join(rendered.split()).count("x7k2p") == 3  # the long event wraps, nothing is cut


def test_event_text_follows_the_demo():
    seen = demo.Seen(committed=[1, 21])
    assert demo.event_text(seen, {}, 200) == "waiting: 1/3 commit advances, step 200+ (committed: 21)"
    seen = _seen()
    assert demo.event_text(seen, {}, 200) == "SIGKILLed demo-0-slice-1-0-x7k2p at step 228"
    failure = {"kind": "ApplicationError", "slice": 1, "resumeStep": 221}
    assert demo.event_text(seen, {"lastFailure": failure}, 200) == "ApplicationError on slice 1 detected; restarting"
    failure["recoverySeconds"] = 31.2
    assert demo.event_text(seen, {"lastFailure": failure}, 200) == "resumed from step 221, recovered in 31.2 s"


def test_the_report_is_about_the_kill_even_after_a_later_failure():
    seen = _seen()
    first = _status()["lastFailure"] | {"time": _z(0)}
    seen.saw_failure(first)
    seen.saw_failure(first | {"recoverySeconds": 31.2})  # the same failure, completed
    later = {"time": _z(300), "kind": "ApplicationError", "slice": 0, "step": 242, "resumeStep": 241, "lostSteps": 1}
    seen.saw_failure(later)
    assert seen.failure == first | {"recoverySeconds": 31.2}
    data = demo.report_data({**_status(), "lastFailure": later, "restarts": 2}, seen)
    assert data["step_at_kill"] == 229 and not data["last_failure_is_the_kill"]
    assert "(a later failure happened too: see status)" in demo.format_report(data)
    assert not demo.passed(data)
    unkilled = demo.Seen()
    unkilled.saw_failure(first)  # a failure before any kill is not the demo's
    assert unkilled.failure is None


def test_an_in_place_restart_is_checked_for_the_same_pods_and_the_local_tier():
    seen = _seen()
    seen.pods_resumed = dict(seen.pods_at_kill)
    seen.resumed = dataclasses.replace(seen.resumed, attempt=0, restored_from="local")
    status = _status(rung="InPlace")
    data = demo.report_data(status, seen)
    assert demo.passed(data), data["checks"]
    assert data["checks"][-2:] == [
        {"what": "same 2 pods (names and uids) before and after the restart", "ok": True},
        {"what": "restored from the local tier (restoredFrom local)", "ok": True},
    ]
    assert "pods:    the same 2 after the restart (same uids)" in demo.format_report(data)
    recreated_pod = dict(seen.pods_at_kill, **{"demo-a0-slice-1-0-x7k2p": "new-uid"})
    for changed in (
        dataclasses.replace(seen, pods_resumed=recreated_pod),
        dataclasses.replace(seen, resumed=dataclasses.replace(seen.resumed, restored_from="gcs")),
        dataclasses.replace(seen, pods_at_kill={}, pods_resumed={}),
    ):
        assert not demo.passed(demo.report_data(status, changed))


def test_an_in_place_restore_from_gcs_passes_only_when_gcs_was_newer_than_any_local_step():
    """Local saves every 5 steps, the trainer last at 206: GCS's 206 is newer than the local tier's 205 at
    most, so restoring it is right; GCS's 205 could have come from the local tier and did not."""
    seen = _seen()
    seen.pods_resumed = dict(seen.pods_at_kill)
    seen.trainer_last_step_of_killed_run, seen.committed_at_kill = 206, 201
    for resume, ok in ((206, True), (205, False)):
        seen.resumed = dataclasses.replace(seen.resumed, attempt=0, restored_from="gcs", restored_step=resume)
        status = _status(rung="InPlace", step=206, resumeStep=resume, lostSteps=206 - resume)
        seen.failure = status["lastFailure"]
        data = demo.report_data(status, seen, local_interval=5)
        assert data["checks"][-1] == {
            "what": f"restored from gcs at {resume}, newer than any local step (at most 205)",
            "ok": ok,
        }
        assert demo.passed(data) is ok, data["checks"]


def test_the_runs_are_told_apart_by_the_trainers_start_not_the_attempt():
    seen = demo.Seen()
    before = progress_record(step=100, attempt=0, updated_at=_at(-1), process_started_at=_at(-60))
    assert not seen.saw_run(before) and seen.trainer_last_step_of_killed_run == 100
    seen.kill_time = _at(0)
    late = progress_record(step=103, attempt=0, updated_at=_at(1), process_started_at=_at(-60))
    assert not seen.saw_run(late) and seen.trainer_last_step_of_killed_run == 103  # process 0 ran on a moment
    starting = progress_record(step=96, attempt=0, updated_at=_at(5), process_started_at=_at(3))
    assert not seen.saw_run(starting) and seen.resumed is None  # restarted in place, no step trained yet
    trained = dataclasses.replace(starting, step=97, first_step_at=_at(8))
    assert seen.saw_run(trained) and seen.resumed == trained
    assert not seen.saw_run(dataclasses.replace(trained, step=98))  # the first trained record only
    assert seen.trainer_last_step_of_killed_run == 103


def test_samples_follow_the_trainers_runs_not_its_attempts():
    seen = demo.Seen(started_at=_at(0))
    first = progress_record(step=228, attempt=0, updated_at=_at(1), process_started_at=_at(-60))
    seen.saw_progress(first)
    seen.saw_progress(dataclasses.replace(first, step=229, updated_at=contract.format_time(_at(2))))
    seen.saw_progress(dataclasses.replace(first, step=229, updated_at=contract.format_time(_at(3))))  # repeated
    in_place = progress_record(step=221, attempt=0, updated_at=_at(9), process_started_at=_at(5))
    seen.saw_progress(in_place)  # the same attempt, a new process: a new run, from the restored step
    seen.saw_progress(in_place)
    recreated = progress_record(step=221, attempt=1, updated_at=_at(40))  # no start time: the attempt splits it
    seen.saw_progress(recreated)
    assert seen.samples == [(1.0, 0, 228), (2.0, 0, 229), (9.0, 1, 221), (40.0, 2, 221)]
    assert seen.runs == [
        demo.TrainerRun(0, contract.format_time(_at(-60))),
        demo.TrainerRun(0, contract.format_time(_at(5))),
        demo.TrainerRun(1, None),
    ]
    assert demo.report_data({}, seen)["run"]["runs"][1] == {
        "attempt": 0, "process_started_at": contract.format_time(_at(5)),
    }  # fmt: skip
