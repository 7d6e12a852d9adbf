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
from tpujob_devcluster import demo, picture

from .factories import progress_record
from .test_demo_report import COMMITTED, GOODPUT, T0, _at, _seen, _status

KILL_S = 150.3  # the kill is at T0 + 0.3 (test_demo_report's _seen): the demo started 150 s before T0
STARTED = T0 - timedelta(seconds=150)


def _trained(seen: demo.Seen) -> None:
    """Feed seen as run_demo does: a progress record a second, commits 1 s after their step is reached."""
    reached: dict[int, float] = {}
    for i in range(131):  # attempt 0: step 0 at 20 s after the start, 229 at the kill's second (150 s)
        step = round(i * 229 / 130)
        seen.saw_progress(progress_record(step=step, attempt=0, updated_at=STARTED + timedelta(seconds=20 + i)))
        reached.setdefault(step, 20 + i)
    seen.saw_progress(progress_record(step=229, attempt=0, updated_at=_at(0.1)))  # the same step again: no sample
    seen.saw_progress(progress_record(step=221, attempt=1, updated_at=_at(11)))  # restored, not trained yet
    for i in range(200):  # attempt 1: its first new step at 30.75 s after the kill, then 1.4 steps/s to 500
        step = min(500, 222 + round(i * 1.4))
        seen.saw_progress(progress_record(step=step, attempt=1, updated_at=_at(30.75 + i)))
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
    attempts = {a for _, a, _ in run["samples"]}
    assert attempts == {0, 1}
    assert [s for _, a, s in run["samples"] if a == 0][-1] == 229  # the repeated record made no sample
    assert run["samples"][[a for _, a, _ in run["samples"]].index(1)] == [161.0, 1, 221]  # T0 + 11 s
    assert [s for _, s in run["commits"]] == data["committed_steps_seen"]
    assert all(t2 >= t1 for (t1, _), (t2, _) in itertools.pairwise(run["commits"]))
    assert demo.report_data({"phase": "Failed"}, demo.Seen())["run"] == {
        "started_at": None, "kill_s": None, "samples": [], "commits": [],
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
    lines = [ax for ax in got["steps"].lines if (ax.get_gid() or "").startswith("attempt-")]
    assert len(lines) == 2  # one line per attempt
    for attempt in (0, 1):
        x, y = got[f"attempt-{attempt}"].get_data()
        assert list(zip(x, y, strict=True)) == [(t, s) for t, a, s in samples if a == attempt]
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
    assert not [gid for gid in got if gid.startswith(("attempt-", "stage:", "ledger:"))]
    assert matplotlib.image.imread(tmp_path / "empty.png").shape[:2] == (picture.HEIGHT_PX, picture.WIDTH_PX)


def test_a_picture_that_cannot_be_drawn_does_not_fail_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert demo._draw(_report(), tmp_path / "demo-report.png") == f", picture: {tmp_path / 'demo-report.png'}"
    assert demo._draw({"goodput": {"wall_seconds": "x"}}, tmp_path / "bad.png") == ""  # raises inside: logged
    assert "the picture was not drawn: ValueError" in capsys.readouterr().out
    assert not (tmp_path / "bad.png").exists()
