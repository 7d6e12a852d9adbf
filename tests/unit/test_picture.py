"""The demo's picture (picture.py), drawn from a synthetic report made by demo.report_data from a Seen
as the demo fills it: 2 attempts, a kill, commits, the recovery timeline and the ledger. The figure's
artists are checked against that data, and the PNG is decoded."""

import itertools
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
import tpujob_contract as contract
from tpujob_devcluster import demo, picture

from .factories import progress_record
from .test_demo_report import COMMITTED, GOODPUT, T0, _at, _seen, _status

KILL_S = 150.3  # the kill is at T0 + 0.3 (test_demo_report's _seen): the demo started 150 s before T0
STARTED = T0 - timedelta(seconds=150)
KILLED_RUN_STARTED, RESTARTED = STARTED + timedelta(seconds=5), _at(7.25)  # _seen's resumed record's start


def _trained(seen: demo.Seen) -> None:
    """Feed seen as run_demo does: a progress record a second, commits 1 s after their step is reached. A
    Recreate restart: the restarted run is attempt 1."""
    reached: dict[int, float] = {}
    killed = {"attempt": 0, "process_started_at": KILLED_RUN_STARTED}
    for i in range(131):  # run 0: step 0 at 20 s after the start, 229 at the kill's second (150 s)
        step = round(i * 229 / 130)
        seen.saw_progress(progress_record(step=step, updated_at=STARTED + timedelta(seconds=20 + i), **killed))
        reached.setdefault(step, 20 + i)
    seen.saw_progress(progress_record(step=229, updated_at=_at(0.1), **killed))  # the same step again: no sample
    restarted = {"attempt": 1, "process_started_at": RESTARTED}
    seen.saw_progress(progress_record(step=221, updated_at=_at(11), **restarted))  # restored, not trained yet
    for i in range(200):  # run 1: its first new step at 30.75 s after the kill, then 1.4 steps/s to 500
        step = min(500, 222 + round(i * 1.4))
        seen.saw_progress(progress_record(step=step, updated_at=_at(30.75 + i), **restarted))
        reached.setdefault(step, 150 + 30.75 + i)
    for step in [*COMMITTED, *range(260, 501, 20)]:
        when = min(t for s, t in reached.items() if s >= step) + 1.0
        seen.saw_commits([step], STARTED + timedelta(seconds=when))


def _report() -> dict[str, Any]:
    seen = _seen()
    seen.committed = []
    seen.started_at = STARTED
    _trained(seen)
    return demo.report_data(_status(), seen)


def test_the_report_carries_the_run_as_plain_data():
    data = _report()
    run = json.loads(json.dumps(data))["run"]  # what the JSON keeps is enough to draw it again
    assert run["started_at"] == STARTED.isoformat() and run["kill_s"] == KILL_S
    assert run["runs"] == [
        {"attempt": 0, "process_started_at": contract.format_time(KILLED_RUN_STARTED)},
        {"attempt": 1, "process_started_at": contract.format_time(RESTARTED)},
    ]
    runs = [r for _, r, _ in run["samples"]]
    assert runs == sorted(runs) and set(runs) == {0, 1}  # a run's samples, then the next run's
    killed = [s for _, r, s in run["samples"] if r == 0]
    assert killed[-1] == 229 and len(killed) == 131  # 131 steps, 132 records: the repeated one made no sample
    assert run["samples"][runs.index(1)] == [161.0, 1, 221]  # T0 + 11 s
    assert [s for _, s in run["commits"]] == data["committed_steps_seen"]
    assert all(t2 >= t1 for (t1, _), (t2, _) in itertools.pairwise(run["commits"]))
    assert demo.report_data({"phase": "Failed"}, demo.Seen())["run"] == {
        "started_at": None, "kill_s": None, "samples": [], "runs": [], "commits": [],
    }  # fmt: skip


def _by_gid(figure: Any) -> dict[str, Any]:
    artists: dict[str, Any] = {}
    for ax in figure.axes:
        artists[ax.get_gid()] = ax
        for artist in [*ax.lines, *ax.patches]:
            if artist.get_gid():
                artists[artist.get_gid()] = artist
    return artists


def test_the_figure_draws_what_the_report_says():
    data = _report()
    got = _by_gid(picture.figure_of(data))
    samples = data["run"]["samples"]
    lines = [line for line in got["steps"].lines if (line.get_gid() or "").startswith("run-")]
    assert len(lines) == 2  # one line per trainer run
    for run in (0, 1):
        x, y = got[f"run-{run}"].get_data()
        assert list(zip(x, y, strict=True)) == [(t, s) for t, r, s in samples if r == run]
    assert got["run-0"].get_label() == "run 0 (attempt 0): steps 0–229"
    assert got["run-1"].get_label() == "run 1 (attempt 1): steps 221–500"  # a Recreate restart: a new attempt
    x, y = got["commits"].get_data()
    assert list(zip(x, y, strict=True)) == [tuple(c) for c in data["run"]["commits"]]
    assert list(got["kill"].get_xdata()) == [KILL_S, KILL_S]
    recovery = got["recovery"].get_bbox()  # SIGKILL -> first new step (the timeline's last offset, 30.4 s)
    assert (recovery.x0, recovery.x1) == pytest.approx((KILL_S, KILL_S + 30.4))
    # The stages: one bar per event after the SIGKILL, from the event before it to it.
    timeline = data["timeline"]
    assert len(timeline) == 10
    for previous, event in itertools.pairwise(timeline):
        bar = got[f"stage:{event['event']}"]
        assert (bar.get_x(), bar.get_x() + bar.get_width()) == pytest.approx((previous["offset_s"], event["offset_s"]))
    # The ledger: productive, then each badput cause that took any time, side by side, as wide as its seconds.
    ledger = [p for p in got["ledger"].patches if (p.get_gid() or "").startswith("ledger:")]
    assert [p.get_gid() for p in ledger] == [
        "ledger:productive", "ledger:scheduling", "ledger:start-up", "ledger:restore",
        "ledger:checkpoint save", "ledger:wasted progress", "ledger:infrastructure recovery",
    ]  # fmt: skip
    badput = data["goodput"]["badput_seconds"]
    assert [p.get_width() for p in ledger] == [GOODPUT["productiveSeconds"], *(s for s in badput.values() if s)]
    assert [p.get_x() for p in ledger] == [0.0, 120.0, 130.0, 170.0, 173.0, 178.0, 180.0]
    assert list(got["ledger:wall"].get_xdata()) == [GOODPUT["wallSeconds"]] * 2
    title = picture.figure_of(data).get_suptitle()
    assert "SIGKILL at step 229, resumed from 221: 8 step(s) lost" in title and "goodput 60.0%" in title


def test_the_png_decodes_at_the_size_drawn(tmp_path: Path):
    path = tmp_path / "demo-report.png"
    picture.draw_report(json.loads(json.dumps(_report())), path)
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (picture.HEIGHT_PX, picture.WIDTH_PX)
    assert pixels.std() > 0.05  # not a blank canvas


def test_a_report_without_a_run_a_timeline_or_a_ledger_still_draws(tmp_path: Path):
    data = demo.report_data({"phase": "Failed", "restarts": 0}, demo.Seen())
    del data["run"]  # an older report's JSON
    picture.draw_report(data, tmp_path / "empty.png")
    got = _by_gid(picture.figure_of(data))
    assert not [gid for gid in got if gid.startswith(("run-", "stage:", "ledger:"))]
    assert matplotlib.image.imread(tmp_path / "empty.png").shape[:2] == (picture.HEIGHT_PX, picture.WIDTH_PX)


def test_a_picture_that_cannot_be_drawn_does_not_fail_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert demo._draw(_report(), tmp_path / "demo-report.png") == f", picture: {tmp_path / 'demo-report.png'}"
    assert demo._draw({"goodput": {"wall_seconds": "x"}}, tmp_path / "bad.png") == ""  # raises inside: logged
    assert "the picture was not drawn: ValueError" in capsys.readouterr().out
    assert not (tmp_path / "bad.png").exists()


def test_an_in_place_restart_draws_two_runs_of_the_same_attempt() -> None:
    """The restarted trainer keeps attempt 0 and starts from a lower (restored) step: its own line, so no
    line goes back in step at the restart."""
    seen = demo.Seen(started_at=STARTED, kill_time=_at(0.3))
    killed, restarted = STARTED + timedelta(seconds=5), _at(3)
    fed: dict[int, list[tuple[float, int]]] = {0: [], 1: []}
    for run, started, steps, first in ((0, killed, range(200, 230), 120.0), (1, restarted, range(221, 241), 160.0)):
        for i, step in enumerate(steps):
            at = STARTED + timedelta(seconds=first + i)
            seen.saw_progress(progress_record(step=step, attempt=0, updated_at=at, process_started_at=started))
            fed[run].append((first + i, step))
        seen.saw_progress(progress_record(step=step, attempt=0, updated_at=at, process_started_at=started))  # again
    data = json.loads(json.dumps(demo.report_data(_status(rung="InPlace"), seen)))
    got = _by_gid(picture.figure_of(data))
    lines = [line for line in got["steps"].lines if line.get_gid() not in ("commits", "kill")]
    assert [line.get_gid() for line in lines] == ["run-0", "run-1"]  # not one line for attempt 0
    for run, line in enumerate(lines):
        x, y = line.get_data()
        assert list(zip(x, y, strict=True)) == fed[run]
        assert all(b >= a for a, b in itertools.pairwise(y))  # neither goes down in step
    assert lines[0].get_label() == "run 0 (attempt 0): steps 200–229"
    assert lines[1].get_label() == "run 1 (attempt 0, restarted in place): steps 221–240"
    assert data["run"]["runs"] == [
        {"attempt": 0, "process_started_at": contract.format_time(killed)},
        {"attempt": 0, "process_started_at": contract.format_time(restarted)},
    ]
