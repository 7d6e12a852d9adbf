"""The demo's picture: demo-report.png next to demo-report.json, drawn from the report's data alone (so a
kept JSON can be drawn again): the trainer's step over wall time, one line per trainer run (a process
start: run.samples are [seconds, run, step], run.runs[run] its attempt and start, so an in-place restart,
which keeps the attempt, is a line of its own), the commits found in the bucket, the SIGKILL and the
recovery; the recovery stage by stage; the goodput ledger.

matplotlib's Agg canvas is used directly (no pyplot, no display, no global backend). Every artist a
test looks for carries a gid ("run-0", "commits", "kill", "recovery", "stage:<event>",
"ledger:<part>"), and so does each axes ("steps", "zoom", "stages", "ledger").
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

WIDTH_PX, HEIGHT_PX, DPI = 1600, 1000, 100
RUN_COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
KILL_COLOR = "tab:red"
# The ledger's parts, in the report's order: productive first, then the badput causes.
LEDGER_COLORS = {
    "productive": "tab:green",
    "scheduling": "tab:gray",
    "start-up": "tab:orange",
    "restore": "tab:purple",
    "checkpoint save": "tab:blue",
    "wasted progress": "tab:red",
    "infrastructure recovery": "tab:brown",
    "suspended": "tab:olive",
}
LABEL_MIN_SHARE = 0.08  # a ledger part narrower than this share of the bar is named in the legend only
LABEL_ONE_LINE_SHARE = 0.15  # narrower than this: its name is written one word a line


def draw_report(data: dict[str, Any], path: Path) -> None:
    """Write the picture of one demo run (report_data's dict, or the JSON read back) as a PNG."""
    figure_of(data).savefig(path, dpi=DPI)


def figure_of(data: dict[str, Any]) -> Figure:
    figure = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplot_mosaic(
        [["steps", "zoom"], ["stages", "stages"], ["ledger", "ledger"]],
        width_ratios=[2.3, 1.0],
        height_ratios=[3.0, 1.9, 1.0],
    )
    steps, zoom, stages, ledger = (axes[name] for name in ("steps", "zoom", "stages", "ledger"))
    figure.suptitle(title_of(data), fontsize=14)
    _steps(steps, zoom, data)
    _stages(stages, data)
    _ledger(ledger, data)
    return figure


def _opt(value: object, unit: str = "") -> str:
    return "-" if value is None else f"{value}{unit}"


def title_of(data: dict[str, Any]) -> str:
    goodput = data.get("goodput") or {}
    ratio = goodput.get("ratio")
    return (
        f"TrainingJob {data.get('job')}: {data.get('phase')} at step {_opt(data.get('final_step'))}, "
        f"{_opt(data.get('restarts'))} restart(s)\n"
        f"SIGKILL at step {_opt(data.get('step_at_kill'))}, resumed from {_opt(data.get('resume_step'))}: "
        f"{_opt(data.get('steps_lost'))} step(s) lost;  recovery {_opt(data.get('recovery_seconds_operator'), ' s')};  "
        f"goodput {'-' if ratio is None else f'{ratio:.1%}'}"
    )


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=12, color="gray")


def _recovery_seconds(data: dict[str, Any]) -> float | None:
    """Kill to the last stage of the timeline (the first new step), from the report's offsets."""
    offsets = [t["offset_s"] for t in data.get("timeline") or []]
    return max(offsets) if offsets else None


def _run_name(runs: list[dict[str, Any]], index: int) -> str:
    """The run, its attempt, and whether its restart kept the attempt: "run 1 (attempt 0, restarted in place)"."""
    if index >= len(runs):
        return f"run {index}"  # a report without the runs (an older one): their attempts are unknown
    attempt = runs[index].get("attempt")
    kept = index > 0 and runs[index - 1].get("attempt") == attempt
    return f"run {index} (attempt {attempt}{', restarted in place' if kept else ''})"


def _color(run: int) -> str:
    return RUN_COLORS[run % len(RUN_COLORS)]


def _steps(ax: Axes, zoom: Axes, data: dict[str, Any]) -> None:
    ax.set_gid("steps")
    zoom.set_gid("zoom")
    run = data.get("run") or {}
    by_run: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for seconds, index, step in run.get("samples") or []:
        by_run[index].append((seconds, step))
    runs = run.get("runs") or []
    for index, points in sorted(by_run.items()):
        times, steps = zip(*points, strict=True)
        ax.plot(
            times, steps, color=_color(index), linewidth=2.2,
            label=f"{_run_name(runs, index)}: steps {steps[0]}–{steps[-1]}", gid=f"run-{index}",
        )  # fmt: skip
    commits = run.get("commits") or []
    if commits:
        times, steps = zip(*commits, strict=True)
        ax.plot(
            times, steps, linestyle="none", marker="o", markersize=5, markerfacecolor="white",
            markeredgecolor="black", zorder=3, label=f"commit found in the bucket ({len(commits)})", gid="commits",
        )  # fmt: skip
    kill = run.get("kill_s")
    zoomed = False
    if kill is not None:
        ax.axvline(
            kill, color=KILL_COLOR, linestyle="--", linewidth=2, label=f"SIGKILL {data.get('killed_pod')}", gid="kill"
        )
        recovery = _recovery_seconds(data)
        if recovery:
            ax.axvspan(
                kill, kill + recovery, color=KILL_COLOR, alpha=0.10, gid="recovery",
                label=f"recovery: SIGKILL → first new step, {recovery:.1f} s",
            )  # fmt: skip
        if data.get("step_at_kill") is not None:
            ax.annotate(
                f"step {data['step_at_kill']} at the kill\nresumed from {_opt(data.get('resume_step'))}",
                xy=(kill, data["step_at_kill"]), xytext=(-12, 12), textcoords="offset points", ha="right",
                fontsize=11, color=KILL_COLOR,
            )  # fmt: skip
        if by_run and data.get("step_at_kill") is not None and data.get("resume_step") is not None:
            _zoom(zoom, data, by_run, commits, kill, recovery or 0.0)
            zoomed = True
    if not zoomed:
        zoom.set_title("Around the kill")
        _empty(zoom, "no kill with a resume step")
    if not by_run and not commits:
        _empty(ax, "no step samples in the report")
    else:
        ax.legend(loc="lower right", fontsize=11)  # a rising line leaves that corner empty
    ax.set_title("Training step over wall time (the trainer's progress.json; commits as the demo found them)")
    ax.set_xlabel("seconds since the demo applied the job")
    ax.set_ylabel("step")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _zoom(
    zoom: Axes,
    data: dict[str, Any],
    by_run: dict[int, list[tuple[float, int]]],
    commits: list[list[float]],
    kill: float,
    recovery: float,
) -> None:
    """The steps around the kill, where the steps lost (a few of hundreds) can be seen."""
    at_kill, resumed = int(data["step_at_kill"]), int(data["resume_step"])
    for index, points in sorted(by_run.items()):  # the killed run and the restarted one: a line each
        times, steps = zip(*points, strict=True)
        zoom.plot(times, steps, color=_color(index), linewidth=2, marker=".")
    if commits:
        times, steps = zip(*commits, strict=True)
        zoom.plot(times, steps, linestyle="none", marker="o", markersize=6, markerfacecolor="white",
                  markeredgecolor="black", zorder=3)  # fmt: skip
    zoom.axvline(kill, color=KILL_COLOR, linestyle="--", linewidth=1.5)
    zoom.axvspan(kill, kill + recovery, color=KILL_COLOR, alpha=0.10)
    zoom.axhline(at_kill, color=KILL_COLOR, linestyle=":", linewidth=1.5, label=f"step reached {at_kill}")
    zoom.axhline(resumed, color="tab:green", linestyle=":", linewidth=1.5, label=f"resumed from {resumed}")
    pad = max(8.0, recovery / 2)
    left, right = kill - pad, kill + recovery + pad
    shown = [step for points in by_run.values() for t, step in points if left <= t <= right]
    low, high = min([*shown, resumed, at_kill]), max([*shown, resumed, at_kill])
    margin = max(2.0, (high - low) * 0.06)
    zoom.set_xlim(left, right)
    zoom.set_ylim(low - margin, high + margin)
    zoom.set_title(f"Around the kill: {_opt(data.get('steps_lost'))} step(s) lost")
    zoom.set_xlabel("seconds since the demo applied the job")
    zoom.legend(loc="lower right", fontsize=10)
    zoom.grid(alpha=0.3)


def _stages(ax: Axes, data: dict[str, Any]) -> None:
    """The recovery stage by stage, since the SIGKILL: each event's row has a bar from the event before it."""
    ax.set_gid("stages")
    timeline = data.get("timeline") or []
    ax.set_title("Recovery, stage by stage (lastFailure.timeline and the restarted run's start-up record)")
    if len(timeline) < 2:
        _empty(ax, "no recovery timeline in the report")
        return
    first = timeline[0]  # the SIGKILL, at 0 (the offsets are since the first event)
    ax.axvline(first["offset_s"], color=KILL_COLOR, linestyle="--", linewidth=1.5)
    rows = timeline[1:]
    for row, (previous, event) in enumerate(itertools.pairwise(timeline)):
        start, end = previous["offset_s"], event["offset_s"]
        bars = ax.barh(row, end - start, left=start, height=0.6, color=f"C{row % 10}", alpha=0.85)
        bars[0].set_gid(f"stage:{event['event']}")
        ax.text(max(start, end), row, f"  {end - start:+.1f} s  (at {end:.1f} s)", va="center", fontsize=10)
    ax.set_yticks(range(len(rows)), [r["event"] for r in rows], fontsize=10)
    ax.invert_yaxis()  # in the order they happen, top to bottom
    right = max(t["offset_s"] for t in timeline)
    left = min(0.0, *(t["offset_s"] for t in timeline))
    ax.set_xlim(left - 0.5, right * 1.18 + 1)  # room for the last bar's text
    ax.set_xlabel(f"seconds since {first['event']}")
    ax.grid(axis="x", alpha=0.3)


def _ledger(ax: Axes, data: dict[str, Any]) -> None:
    """status.goodput as one stacked bar: productive, then each badput cause that took any time."""
    ax.set_gid("ledger")
    goodput = data.get("goodput")
    if not goodput:
        ax.set_title("Goodput ledger")
        _empty(ax, "status.goodput is not set")
        ax.set_yticks([])
        return
    wall = float(goodput["wall_seconds"])
    parts = [("productive", float(goodput["productive_seconds"]))]
    parts += [(cause, float(s)) for cause, s in (goodput.get("badput_seconds") or {}).items() if s > 0]
    total = sum(seconds for _, seconds in parts)
    left = 0.0
    for name, seconds in parts:
        share = f" ({seconds / wall:.1%})" if wall else ""
        bars = ax.barh(
            0, seconds, left=left, height=0.7, color=LEDGER_COLORS.get(name, "tab:cyan"), edgecolor="white",
            label=f"{name} {seconds:.1f} s{share}",
        )  # fmt: skip
        bars[0].set_gid(f"ledger:{name}")
        if total and seconds / total >= LABEL_MIN_SHARE:
            words = name if seconds / total >= LABEL_ONE_LINE_SHARE else name.replace(" ", "\n")
            ax.text(left + seconds / 2, 0, f"{words}\n{seconds:.0f} s", ha="center", va="center", fontsize=10)
        left += seconds
    if wall:
        ax.axvline(wall, color="black", linewidth=1.5, gid="ledger:wall")
    ratio = goodput.get("ratio")
    verdict = "adds up" if goodput.get("adds_up") else "DOES NOT add up"
    ax.set_title(
        f"Goodput ledger (status.goodput): {'-' if ratio is None else f'{ratio:.1%}'} productive of {wall:.1f} s"
        f" wall (black line); productive + badput = {total:.1f} s, {verdict}"
    )
    ax.set_xlim(0, max(wall, total) * 1.01 or 1)
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.set_xlabel("seconds")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=min(len(parts), 4), fontsize=10, frameon=False)
