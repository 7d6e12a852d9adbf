"""Checkpoint policies on one workload: none, fixed interval, continuous (with/without minimum interval).

Runs the trainer's own model, optimizer, data and Orbax manager (tpujob_trainer) in one process
against fake-gcs-server on loopback, and prints one JSON object. Per policy: median and mean step
time, overhead vs no checkpointing, number of saves, checkpoint interval P50/P90 in steps and in
seconds, median save duration (save() called -> commit_success.txt written, from Orbax's own
commit timestamp), bytes per checkpoint, and the physical floor of the interval (save duration /
step time of the no-checkpoint run).

    python bench/checkpoint_policies.py [--model small --steps 500 --interval 100 ...]

Every step is waited for (loss fetched) so step times are real; the overlap of an async save with
the following steps is exactly what the numbers show.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tpujob_contract import LATEST
from tpujob_devcluster.fakegcs import start_fake_gcs

BUCKET = "bench"


@dataclasses.dataclass
class Saves:
    starts: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> wall time of save()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _run_policy(args: argparse.Namespace, name: str, root: Path) -> dict[str, Any]:
    # Imported here: the emulator's environment must be in place before fsspec/gcsfs load.
    import orbax.checkpoint as ocp
    from tpujob_trainer.checkpointing import CheckpointManager, PreemptionNotice, manager_options
    from tpujob_trainer.config import CheckpointConfig, parse_config
    from tpujob_trainer.data import batch_for_step
    from tpujob_trainer.train import Trainer, make_mesh

    cfg = parse_config(
        ["--model", args.model, "--steps", str(args.steps + args.warmup), "--batch-size", str(args.batch_size),
         "--seq-len", str(args.seq_len)], {},
    ).train  # fmt: skip
    trainer = Trainer(cfg, make_mesh(1))
    mngr = None
    if name != "none":
        ckpt = CheckpointConfig(
            policy="interval" if name == "fixed_interval" else "continuous",
            min_interval_seconds=args.min_interval if name == "continuous_min_interval" else 0.0,
            interval_steps=args.interval, async_save=True, keep_latest=100_000, keep_every_steps=0,
            save_on_preemption=False, resume=LATEST,
        )  # fmt: skip
        mngr = CheckpointManager(f"gs://{BUCKET}/{name}/checkpoints", manager_options(ckpt), PreemptionNotice(False))
    state = trainer.init()
    step_times: list[float] = []
    saves = Saves()
    for step in range(1, cfg.steps + 1):
        tokens = trainer.device_batch(
            batch_for_step(cfg.seed, step - 1, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size)
        )
        start = time.perf_counter()
        state, loss = trainer.step(state, tokens)
        measured = step > args.warmup  # the first steps compile
        if mngr and measured:
            called = time.time()
            if mngr.save(step, args=ocp.args.StandardSave(state)):
                saves.starts[step] = called
        float(loss.addressable_data(0))
        if measured:
            step_times.append(time.perf_counter() - start)
    if mngr:
        mngr.wait_until_finished()
        mngr.close()
    return _summarise(name, step_times, saves, root / BUCKET / name / "checkpoints")


def _summarise(name: str, step_times: list[float], saves: Saves, directory: Path) -> dict[str, Any]:
    steps = sorted(saves.starts)
    durations, sizes = [], []
    for step in steps:
        meta = json.loads((directory / str(step) / "_CHECKPOINT_METADATA").read_text())
        durations.append(meta["commit_timestamp_nsecs"] / 1e9 - saves.starts[step])
        sizes.append(sum(f.stat().st_size for f in (directory / str(step)).rglob("*") if f.is_file()))
    gaps_steps = [float(b - a) for a, b in itertools.pairwise(steps)]
    gaps_secs = [saves.starts[b] - saves.starts[a] for a, b in itertools.pairwise(steps)]
    return {
        "policy": name,
        "steps_measured": len(step_times),
        "median_step_s": statistics.median(step_times),
        "mean_step_s": statistics.fmean(step_times),
        "saves": len(steps),
        "interval_steps_p50": _percentile(gaps_steps, 50),
        "interval_steps_p90": _percentile(gaps_steps, 90),
        "interval_s_p50": _percentile(gaps_secs, 50),
        "interval_s_p90": _percentile(gaps_secs, 90),
        "median_save_s": statistics.median(durations) if durations else None,
        "bytes_per_checkpoint": int(statistics.median(sizes)) if sizes else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=500, help="measured steps per policy")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured first steps (compilation)")
    p.add_argument("--interval", type=int, default=100, help="fixed-interval policy: save every N steps")
    p.add_argument("--min-interval", type=float, default=3.0, help="continuous_min_interval: seconds")
    p.add_argument("--policies", default="none,fixed_interval,continuous,continuous_min_interval")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="tpujob-bench-") as tmp, start_fake_gcs(Path(tmp) / "gcs") as gcs:
        os.environ.update(gcs.env())
        gcs.create_bucket(BUCKET)
        import jax

        results = [_run_policy(args, name, gcs.root_dir) for name in args.policies.split(",")]
        device = jax.devices()[0]
    base = next((r for r in results if r["policy"] == "none"), None)
    for r in results:
        if base:
            r["step_overhead_vs_none"] = r["median_step_s"] / base["median_step_s"] - 1
            r["mean_step_overhead_vs_none"] = r["mean_step_s"] / base["mean_step_s"] - 1
            if r["median_save_s"] is not None:
                r["floor_interval_steps"] = r["median_save_s"] / base["median_step_s"]
    print(
        json.dumps(
            {
                "workload": {
                    "model": args.model,
                    "batch_size": args.batch_size,
                    "seq_len": args.seq_len,
                    "measured_steps": args.steps,
                    "fixed_interval": args.interval,
                    "min_interval_s": args.min_interval,
                    "storage": "fake-gcs-server on 127.0.0.1 (gs://)",
                },
                "host": {
                    "platform": device.platform,
                    "device": device.device_kind,
                    "devices": jax.device_count(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "jax": jax.__version__,
                },
                "policies": results,
            },
            indent=2,
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
