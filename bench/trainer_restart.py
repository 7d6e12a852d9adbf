"""A trainer process restart on one machine, stage by stage, with the process's own compilation cache on and off.

No Kubernetes: this is what an in-place restart leaves to the trainer (the restart ladder's `InPlace`
rung), on whatever accelerator the machine has (the device machine's TPU, or the CPU). Each run is
`python -m tpujob_trainer` with the environment the operator gives a worker (TPUJOB_RUN_DIR on a local
directory: no storage emulator, no socket, so it runs on the device machine too; interval saves every
--interval steps; the progress record every 0.5 s). A round, per side: a cold start (empty run
directory, empty caches), SIGKILLed once a checkpoint is committed; then --restarts restarts, each
SIGKILLed once it has trained and committed a step past its restore. Every restart is measured on the
clocks this machine shares (the bench's, and the trainer's own progress record, microseconds):
  spawn_to_process        the bench starts the process -> trainer main() entered (Python, the imports)
  process_to_storage      main() -> the storage probe passed (the accelerator opened, the cache installed)
  storage_to_restore      -> the restore starts (the model's mesh and abstract state)
  restore                 restore start -> restore finished (Orbax, from the local directory)
  restored_to_first_step  restore finished (a cold start: storage ready) -> first step done (tracing,
                          compiling or reading the cache, one step)
  total                   spawn -> first step done
The sides (`--sides`): `off` (TPUJOB_COMPILATION_CACHE_DIR=off: no persistent cache at all) and `on`
(TPUJOB_LOCAL_COMPILATION_CACHE_DIR, the process's own tier, which a restart in place keeps, kept from
the round's cold start on; the shared tier is the run directory's jax-cache, as an InPlace job has it),
and `replaced` (a lost node's replacement pod: its own tier new and empty at every restart, the shared
tier kept: what it reads comes from the run directory).
Sides alternate within a round, every other round in reverse order, so the machine's drift falls on
both. A process that exits before its first step (the TPU can refuse a program started just after
another was killed) is started again after 5 s, counted in `retries`; the stages are the successful one's.

Prints one JSON object: per side the medians of every stage over its restarts (and of its cold starts,
for reference), n, the cache's hits and misses (the trainer's log lines), the noise as the spread
(max - min) / median of the restarts' totals; and per stage the median on/off side by side.
`--deadline` (seconds) starts no new round past it: the rounds done are reported (`rounds_done`).

    python bench/trainer_restart.py [--model medium --rounds 3 --restarts 2 --sides off,on]

Measured on the device machine's TPU v5e (medium, 100m, 350m): docs/concepts/restart-ladder.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import tpujob_contract as contract

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("trainer_image/src", "library/src", "contract/src")
STAGES = (
    "spawn_to_process", "process_to_storage", "storage_to_restore", "restore", "restored_to_first_step", "total",
)  # fmt: skip
_DEVICES = re.compile(r"(\d+) devices \((\w+)\), model \S+ \(([\d.]+)M params\)")
_HIT = re.compile(r"compile cache: hit ")
_MISS = re.compile(r"compile cache: miss ")


def plan(sides: list[str], rounds: int) -> list[tuple[int, str]]:
    """Per round every side once, every other round in reverse order."""
    return [(r, side) for r in range(rounds) for side in (sides if r % 2 == 0 else sides[::-1])]


def _wall(moment: str | None) -> float | None:
    if not moment:
        return None
    return datetime.fromisoformat(moment.replace("Z", "+00:00")).timestamp()


def _span(start: float | None, end: float | None) -> float | None:
    return round(end - start, 3) if start is not None and end is not None else None


def stages(record: dict[str, Any], spawned: float) -> dict[str, float | None]:
    """A process's start split into STAGES, from its progress record and the bench's spawn time (Unix s)."""
    process, ready = _wall(record.get("process_started_at")), _wall(record.get("storage_ready_at"))
    begun, restored = _wall(record.get("restore_started_at")), _wall(record.get("restore_finished_at"))
    restored = restored or ready  # a cold start restores nothing: its first step counts from storage ready
    first = _wall(record.get("first_step_at"))
    return {
        "spawn_to_process": _span(spawned, process),
        "process_to_storage": _span(process, ready),
        "storage_to_restore": _span(ready, begun),
        "restore": _span(begun, restored),
        "restored_to_first_step": _span(restored, first),
        "total": _span(spawned, first),
    }


def cache_lookups(log: str) -> dict[str, int]:
    """The compilation cache's hits and misses in a trainer's log (both tiers; a miss in the own tier that
    the shared one answers counts once in each)."""
    return {"hits": len(_HIT.findall(log)), "misses": len(_MISS.findall(log))}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def side_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per stage over runs ({"stages": {...}, "cache": {...}}), n, and the totals' spread."""
    totals = [r["stages"]["total"] for r in runs if r["stages"]["total"] is not None]
    median_total = statistics.median(totals) if totals else None
    spread = round((max(totals) - min(totals)) / median_total, 3) if totals and median_total else None
    return {
        "n": len(runs),
        "median_s": {s: _median([r["stages"][s] for r in runs]) for s in STAGES},
        "totals_s": [round(t, 2) for t in totals],
        "spread": spread,
        "cache_hits": [r["cache"]["hits"] for r in runs],
        "cache_misses": [r["cache"]["misses"] for r in runs],
        "retries": sum(r["retries"] for r in runs),
    }


def side_by_side(sides: dict[str, dict[str, Any]], before: str = "off", after: str = "on") -> dict[str, Any]:
    """Per stage the two sides' medians and after - before; whether the totals differ past the noise."""
    if before not in sides or after not in sides:
        return {}
    b, a = sides[before]["median_s"], sides[after]["median_s"]
    rows = {s: {before: b[s], after: a[s], "delta": _span(b[s], a[s])} for s in STAGES}
    noise = max((sides[k]["spread"] or 0.0) for k in (before, after))
    ratio = round(a["total"] / b["total"], 3) if a["total"] and b["total"] else None
    return {
        "stages_s": rows,
        f"total_{after}_over_{before}": ratio,
        "noise": noise,
        "within_noise": ratio is not None and abs(ratio - 1) <= noise,
    }


@dataclass
class Trainer:
    """One `python -m tpujob_trainer` process of a round, its log in a file."""

    args: argparse.Namespace
    side: str
    round_dir: Path
    attempt: int
    spawned: float = 0.0
    retries: int = 0
    log_offset: int = 0  # where the current try's lines begin in the log (a retry appends)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.round_dir / f"attempt-{self.attempt}.log"

    def env(self) -> dict[str, str]:
        run_dir = self.round_dir / "run"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [*(str(REPO / d) for d in SOURCES), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "PYTHONUNBUFFERED": "1",
            contract.Env.NAME: "restart-bench",
            contract.Env.NAMESPACE: "bench",
            contract.Env.UID: f"uid-{self.round_dir.name}",
            contract.Env.ATTEMPT: str(self.attempt),
            contract.Env.RUN_DIR: str(run_dir),
            contract.Env.NUM_SLICES: "1",
            contract.Env.HOSTS_PER_SLICE: "1",
            contract.Env.CHECKPOINT_POLICY: "interval",
            contract.Env.CHECKPOINT_INTERVAL_STEPS: str(self.args.interval),
            contract.PROGRESS_INTERVAL_ENV: "0.5",
            "TPUJOB_STORAGE_WAIT_SECONDS": "30",
        }
        env.pop(contract.Env.LOCAL_COMPILATION_CACHE_DIR, None)
        if self.side == "off":
            env[contract.COMPILATION_CACHE_ENV] = "off"
        else:
            env.pop(contract.COMPILATION_CACHE_ENV, None)
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            # `replaced`: a new pod (a lost node's replacement) brings a new, empty own tier every time
            own = "own-compile-cache" + (f"-{self.attempt}" if self.side == "replaced" else "")
            env[contract.Env.LOCAL_COMPILATION_CACHE_DIR] = str(self.round_dir / own)
        if self.args.platforms:
            env["JAX_PLATFORMS"] = self.args.platforms
        return env

    def command(self) -> list[str]:
        a = self.args
        return [
            sys.executable, "-m", "tpujob_trainer", "--model", a.model, "--steps", str(a.steps),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--log-every", str(a.interval),
        ]  # fmt: skip

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.log_offset = log.tell()
            self.spawned = time.time()
            self.proc = subprocess.Popen(self.command(), env=self.env(), cwd=self.round_dir, stdout=log, stderr=log)

    def record(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads((self.round_dir / "run" / contract.PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            return None
        return data if int(data.get("attempt", -1)) == self.attempt else None

    def newest_committed(self) -> int:
        """The newest committed step in the run directory (on a filesystem: a step's directory, renamed
        from Orbax's temporary one when committed), read from storage: the record's last_committed_step
        lags while saves run back to back. -1: none."""
        try:
            entries = os.listdir(contract.checkpoints_dir(str(self.round_dir / "run")))
        except OSError:
            return -1
        return max((step for e in entries if (step := contract.step_of(e)) is not None), default=-1)

    def run_until_committed(self) -> dict[str, Any]:
        """Start, wait for the first step and then a commit past the step restored; SIGKILL; the record."""
        while True:
            self.start()
            assert self.proc is not None
            deadline = time.monotonic() + self.args.timeout
            while time.monotonic() < deadline:
                rec = self.record()
                if rec and rec.get("first_step_at") and self.newest_committed() > (rec.get("restored_step") or 0):
                    self.proc.send_signal(signal.SIGKILL)
                    self.proc.wait()
                    return rec
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
            else:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"{self.side} attempt {self.attempt}: no commit within {self.args.timeout:g}s")
            rec = self.record()
            if self.retries >= 2 or (rec and rec.get("first_step_at")):
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.side} attempt {self.attempt} exited {self.proc.returncode}: {tail}")
            self.retries += 1
            print(f"  {self.side} attempt {self.attempt} exited {self.proc.returncode} early; again in 5 s",
                  file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(5)

    def result(self, rec: dict[str, Any]) -> dict[str, Any]:
        with self.log_path.open("rb") as f:
            f.seek(self.log_offset)
            log = f.read().decode(errors="replace")
        return {
            "attempt": self.attempt,
            "restored_step": rec.get("restored_step"),
            "stages": stages(rec, self.spawned),
            "cache": cache_lookups(log),
            "retries": self.retries,
        }


def run_round(args: argparse.Namespace, side: str, round_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One cold start and args.restarts restarts of one side: (the cold start's result, the restarts')."""
    round_dir.mkdir(parents=True)
    runs = []
    for attempt in range(args.restarts + 1):
        trainer = Trainer(args, side, round_dir, attempt)
        rec = trainer.run_until_committed()
        runs.append(trainer.result(rec))
        s = runs[-1]["stages"]
        print(f"  {side} attempt {attempt}: total {s['total']}s, restored->first step {s['restored_to_first_step']}s, "
              f"cache {runs[-1]['cache']}", file=sys.stderr, flush=True)  # fmt: skip
    return runs[0], runs[1:]


def _machine(round_dirs: list[Path]) -> dict[str, Any]:
    found = None
    for d in round_dirs:
        log = (d / "attempt-0.log").read_text(errors="replace") if (d / "attempt-0.log").exists() else ""
        if m := _DEVICES.search(log):
            found = m
            break
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "devices": int(found.group(1)) if found else None,
        "platform": found.group(2) if found else None,
        "model_params_m": float(found.group(3)) if found else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="medium")
    p.add_argument(
        "--sides",
        default="off,on",
        help="of off (no compilation cache), on (the process's own tier), replaced (a new own tier each restart)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--restarts", type=int, default=2, help="restarts per round after its cold start")
    p.add_argument("--steps", type=int, default=1_000_000, help="the trainer's --steps (it is killed long before)")
    p.add_argument("--interval", type=int, default=20, help="steps between checkpoint saves")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--platforms", default="", help="JAX_PLATFORMS for the trainer (default: this environment's)")
    p.add_argument("--timeout", type=float, default=300.0, help="one process's limit to its commit (a stuck run)")
    p.add_argument("--deadline", type=float, default=0.0, help="start no round after this many seconds (0: none)")
    p.add_argument("--keep", default="", help="keep the work directory here (default: a temporary one, removed)")
    args = p.parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in ("off", "on", "replaced") for s in sides):
        raise SystemExit(f"--sides: of off, on and replaced, got {args.sides!r}")
    started = time.monotonic()
    cold: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    restarts: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    round_dirs: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="tpujob-trainer-restart-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        for index, (round_, side) in enumerate(plan(sides, args.rounds)):
            if index % len(sides) == 0 and args.deadline and time.monotonic() - started > args.deadline:
                print(f"deadline: {round_} rounds done", file=sys.stderr, flush=True)
                break
            print(f"round {round_} {side}", file=sys.stderr, flush=True)
            round_dirs.append(work / f"r{round_}-{side}")
            first, rest = run_round(args, side, round_dirs[-1])
            cold[side].append(first)
            restarts[side].extend(rest)
        machine = _machine(round_dirs)
    per_side = {s: {"restart": side_summary(restarts[s]), "cold_start": side_summary(cold[s])} for s in sides}
    result = {
        "bench": "trainer_restart",
        "workload": {k: getattr(args, k) for k in ("model", "batch_size", "seq_len", "interval", "rounds", "restarts")},
        "rounds_done": min(len(runs) for runs in cold.values()),
        "machine": machine,
        "seconds": round(time.monotonic() - started, 1),
        "sides": per_side,
        "restart_on_vs_off": side_by_side({s: v["restart"] for s, v in per_side.items()}),
        "restart_replaced_vs_off": side_by_side({s: v["restart"] for s, v in per_side.items()}, after="replaced"),
        "runs": {s: {"cold_start": cold[s], "restarts": restarts[s]} for s in sides},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
