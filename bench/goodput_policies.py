"""Goodput under failures: fixed, continuous and adaptive checkpointing on the same job, killed by
the same seeded schedule.

For each policy: trainer processes (python -m tpujob_trainer, tiny model by default) train one job
into gs:// on fake-gcs-server; SIGKILLs land at Poisson times (mean --mtbf seconds apart, drawn
from --seed, counted from the job's start, identical for every policy); after each kill a new
attempt starts at once with resume=latest, until the job succeeds. Prints one JSON object.

Goodput, from the trainer's own progress records: productive step time (the job's steps x the
median step time of a run without checkpoints or failures, measured right before each seed's runs, from
its records' steps_per_second) / wall time (the first attempt's process_started_at -> the final
record's updated_at). The adaptive trainer is told the MTBF, as the operator tells it its estimate.

    python bench/goodput_policies.py [--steps 3000 --mtbf 30 --seeds 0 --fixed-interval 100 --budget 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tpujob_contract as contract
from tpujob_contract import Env
from tpujob_devcluster.fakegcs import FakeGcsServer, start_fake_gcs

BUCKET = "goodput"
RECORD_FIELDS = (
    "save_blocking_seconds", "checkpoint_interval_seconds", "checkpoint_interval_bound", "save_cost_seconds",
    "checkpoint_overhead_percent", "mtbf_seconds", "restored_step",
)  # fmt: skip


@dataclasses.dataclass
class Job:
    gcs: FakeGcsServer
    env: dict[str, str]
    name: str
    log_dir: Path

    def progress(self) -> dict[str, Any] | None:
        try:
            record: dict[str, Any] = json.loads(self.gcs.download(BUCKET, f"{self.name}/progress.json"))
        except Exception:  # not written yet, or mid-upload
            return None
        return record


def _kill_times(seed: int, mtbf: float, horizon: float) -> list[float]:
    """Poisson arrivals: exponential gaps with mean mtbf, up to horizon seconds."""
    rng, times, now = random.Random(seed), [], 0.0
    while now < horizon:
        now += rng.expovariate(1 / mtbf)
        times.append(now)
    return times


def _policy_env(args: argparse.Namespace, policy: str) -> dict[str, str]:
    if policy == "none":  # an interval longer than the job: only the final save
        return {Env.CHECKPOINT_POLICY: "interval", Env.CHECKPOINT_INTERVAL_STEPS: str(10**9)}
    if policy == "fixed":
        return {Env.CHECKPOINT_POLICY: "interval", Env.CHECKPOINT_INTERVAL_STEPS: str(args.fixed_interval)}
    if policy == "continuous":
        return {Env.CHECKPOINT_POLICY: "continuous"}
    if policy == "adaptive":
        return {
            Env.CHECKPOINT_POLICY: "adaptive",
            Env.CHECKPOINT_OVERHEAD_BUDGET_PERCENT: str(args.budget),
            Env.MTBF_SECONDS: str(args.mtbf),
        }
    raise SystemExit(f"unknown policy {policy!r}")


def _run_job(args: argparse.Namespace, job: Job, kills: list[float]) -> dict[str, Any]:
    """Attempts until the job succeeds, SIGKILLed at `kills` (seconds from the job's start)."""
    train_args = ["--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                  "--seq-len", str(args.seq_len), "--log-every", "1000"]  # fmt: skip
    start = time.monotonic()
    pending = list(kills)
    attempts: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    while True:
        attempt = len(attempts)
        log = (job.log_dir / f"{job.name}-attempt{attempt}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpujob_trainer", *train_args],
            env={**job.env, Env.ATTEMPT: str(attempt)}, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        killed_at, last = None, None
        while proc.poll() is None:
            if pending and time.monotonic() - start >= pending[0]:
                killed_at = pending.pop(0)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                break
            record = job.progress()
            if record and record.get("attempt") == attempt:
                last = record
                if not records or records[-1] != record:
                    records.append(record)
            if time.monotonic() - start > args.timeout:
                proc.kill()
                raise SystemExit(f"{job.name}: no success within {args.timeout}s")
            time.sleep(0.1)
        log.close()
        attempts.append({"killed_at_s": killed_at, "exit": proc.returncode, "last_record": last})
        if killed_at is None:
            if proc.returncode != 0:
                raise SystemExit(f"{job.name}: attempt {attempt} exited {proc.returncode}; see {log.name}")
            break
        pending = [t for t in pending if t > time.monotonic() - start]  # kills due while it started again
    final = job.progress()
    assert final is not None and final["state"] == "succeeded"
    return {"attempts": attempts, "records": records, "final": final, "bench_wall_s": time.monotonic() - start}


def _summarise(policy: str, run: dict[str, Any], median_step_s: float, steps: int) -> dict[str, Any]:
    attempts, final = run["attempts"], run["final"]
    first = next((a["last_record"] for a in attempts if a["last_record"]), final)
    started = contract.parse_time(first["process_started_at"])
    ended = contract.parse_time(final["updated_at"])
    assert started and ended
    wall = (ended - started).total_seconds()
    # Steps reached before each kill (its last record, up to 0.5 s old) minus the step the next
    # attempt that wrote a record restored (None: a fresh start, step 0).
    records = [a["last_record"] for a in attempts[:-1]] + [final]
    lost = []
    for i, attempt in enumerate(attempts[:-1]):
        after = next((r for r in records[i + 1 :] if r), None)
        if attempt["last_record"] and after:
            lost.append(attempt["last_record"]["step"] - (after.get("restored_step") or 0))
    return {
        "policy": policy,
        "goodput": steps * median_step_s / wall,
        "wall_s": wall,
        "bench_wall_s": run["bench_wall_s"],
        "productive_s": steps * median_step_s,
        "kills": sum(1 for a in attempts if a["killed_at_s"] is not None),
        "kill_times_s": [a["killed_at_s"] for a in attempts if a["killed_at_s"] is not None],
        "attempts": len(attempts),
        "steps_lost_per_kill": lost,
        "final_attempt_record": {k: final.get(k) for k in RECORD_FIELDS},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between SIGKILLs (Poisson)")
    p.add_argument("--seeds", default="0", help="one failure schedule per seed, the same for every policy")
    p.add_argument("--fixed-interval", type=int, default=100, help="policy fixed: save every N steps")
    p.add_argument("--budget", type=float, default=5.0, help="policy adaptive: overhead budget (percent)")
    p.add_argument("--policies", default="fixed,continuous,adaptive")
    p.add_argument("--timeout", type=float, default=900.0, help="per job (s)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="tpujob-goodput-") as tmp, start_fake_gcs(Path(tmp) / "gcs") as gcs:
        gcs.create_bucket(BUCKET)
        base_env = {
            **os.environ, **gcs.env(), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
            contract.PROGRESS_INTERVAL_ENV: "0.5", Env.CHECKPOINT_KEEP_LATEST: "3",
        }  # fmt: skip

        def job(name: str, policy: str) -> Job:
            env = {**base_env, **_policy_env(args, policy), Env.RUN_DIR: f"gs://{BUCKET}/{name}"}
            return Job(gcs, env, name, Path(tmp))

        runs, baselines = [], {}
        for seed in (int(s) for s in args.seeds.split(",")):
            kills = _kill_times(seed, args.mtbf, args.timeout)
            # A step is priced right before the seed's policies run, so that load drifting over
            # the bench moves the price and the runs it prices together.
            baseline = _run_job(args, job(f"baseline-seed{seed}", "none"), [])
            rates = [r["steps_per_second"] for r in baseline["records"] if r.get("steps_per_second") and r["step"] > 1]
            median_step_s = statistics.median(1 / r for r in rates)
            baselines[seed] = {"median_step_s": median_step_s, "wall_s": baseline["bench_wall_s"]}
            for policy in args.policies.split(","):
                run = _run_job(args, job(f"{policy}-seed{seed}", policy), kills)
                runs.append({"seed": seed, **_summarise(policy, run, median_step_s, args.steps)})
                print(f"{policy} seed {seed}: goodput {runs[-1]['goodput']:.3f}", file=sys.stderr, flush=True)
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        by_seed.setdefault(r["seed"], []).append(r)
    print(
        json.dumps(
            {
                "workload": {
                    **{k: v for k, v in vars(args).items() if k != "timeout"},
                    "keep_latest": 3,
                    "storage": "fake-gcs-server on 127.0.0.1 (gs://)",
                    "cpus": os.cpu_count(),
                    "load_average_1m": os.getloadavg()[0],
                },
                "no_checkpoint_baseline_per_seed": baselines,
                "runs": runs,
                "highest_goodput_per_seed": {
                    seed: max(rs, key=lambda r: r["goodput"])["policy"] for seed, rs in by_seed.items()
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
