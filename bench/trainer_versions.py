"""The built-in trainer's step time at two revisions, side by side in one run.

The trainer library (issue 31) moved the built-in trainer's protection code into `tpujob` (the
per-step hook, the save policy, the progress record). This measures what the move costs a step:
`python -m tpujob_trainer` from each revision's sources (PYTHONPATH puts its trainer_image/src,
library/src and contract/src first), one process on the CPU, continuous saves to a local
directory (no storage emulator: its noise stays out), no compilation cache. A run's figure is the
median steps/s of its progress lines (one per --log-every steps) after --warmup steps. Runs
alternate revisions, every other round in reverse order, so the machine's load drifts over both
alike. Prints one JSON object: per side the run medians and their median; the ratio after/before;
the noise, as each side's spread (max - min) / median over its runs.

    python bench/trainer_versions.py --before 07483e4^ [--after WORKTREE] [--rounds 3 --steps 1500]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpujob_devcluster.controlplane import REPO_ROOT
from tpujob_devcluster.harness import git, worktree

SOURCES = ("trainer_image/src", "library/src", "contract/src")  # what a revision's PYTHONPATH puts first
_PROGRESS = re.compile(r"^step (\d+)/\d+ loss [\d.]+ steps/s ([\d.]+)", re.MULTILINE)


@dataclass(frozen=True)
class Side:
    key: str  # "before" | "after"
    rev: str  # what the user named
    commit: str
    source: Path

    @property
    def pythonpath(self) -> str:
        return ":".join(str(self.source / d) for d in SOURCES if (self.source / d).is_dir())


def plan(sides: list[Side], rounds: int) -> list[tuple[int, Side]]:
    """Per round every side once, every other round in reverse order."""
    return [(r, side) for r in range(rounds) for side in (sides if r % 2 == 0 else sides[::-1])]


def run_rate(output: str, warmup: int) -> float:
    """The median steps/s of the progress lines past `warmup` steps (ValueError: none)."""
    rates = [float(rate) for step, rate in _PROGRESS.findall(output) if int(step) > warmup]
    if not rates:
        raise ValueError(f"no progress line past step {warmup} in the trainer's output")
    return statistics.median(rates)


def summary(rates: dict[str, list[float]]) -> dict[str, Any]:
    """Medians per side, after/before, and each side's spread over its runs (the noise)."""
    medians = {key: statistics.median(runs) for key, runs in rates.items()}
    spreads = {key: round((max(runs) - min(runs)) / medians[key], 3) for key, runs in rates.items()}
    sides = {
        key: {
            "runs_steps_per_s": [round(r, 2) for r in runs],
            "median_steps_per_s": round(medians[key], 2),
            "spread": spreads[key],
        }
        for key, runs in rates.items()
    }
    ratio = round(medians["after"], 2) / round(medians["before"], 2)
    noise = max(spreads.values())
    return {
        "sides": sides,
        "after_over_before": round(ratio, 3),
        "noise": noise,
        "within_noise": abs(ratio - 1) <= noise,
    }


def _run(side: Side, args: argparse.Namespace, work: Path, index: int) -> float:
    run_dir = work / f"{side.key}-{index}"
    env = {
        **os.environ,
        "PYTHONPATH": side.pythonpath,
        "TPUJOB_RUN_DIR": str(run_dir),
        "TPUJOB_CHECKPOINT_POLICY": "continuous",
        "TPUJOB_COMPILATION_CACHE_DIR": "off",
        "JAX_PLATFORMS": "cpu",
    }
    command = [sys.executable, "-m", "tpujob_trainer", "--model", args.model, "--steps", str(args.steps)]
    command += [
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--log-every",
        str(args.log_every),
    ]
    out = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{side.key} ({side.commit[:12]}) exited {out.returncode}: {out.stderr[-3000:]}")
    return run_rate(out.stdout, args.warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the baseline revision (e.g. 07483e4^, before the library)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=200, help="progress lines up to this step are not counted")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--timeout", type=float, default=1800.0, help="one run's limit (a stuck run, not a speed limit)")
    args = p.parse_args()
    head = git("rev-parse", "HEAD")
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="tpujob-trainer-versions-") as tmp,
        worktree(args.before, Path(tmp)) as (
            commit,
            path,
        ),
    ):
        sides = [Side("before", args.before, commit, path), Side("after", "working tree", head, REPO_ROOT)]
        rates: dict[str, list[float]] = {s.key: [] for s in sides}
        for index, (round_, side) in enumerate(plan(sides, args.rounds)):
            rate = _run(side, args, Path(tmp), index)
            rates[side.key].append(rate)
            print(f"round {round_} {side.key}: {rate:.2f} steps/s", file=sys.stderr, flush=True)
    result = {
        "bench": "trainer_versions",
        "before": {"rev": args.before, "commit": commit},
        "after": {"rev": "working tree", "commit": head},
        "workload": {k: getattr(args, k) for k in ("model", "steps", "warmup", "batch_size", "seq_len", "rounds")},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "seconds": round(time.monotonic() - started, 1),
        **summary(rates),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
