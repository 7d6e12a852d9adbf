"""Checkpoint policies on one workload: none, fixed intervals (a sweep), continuous, adaptive.

Runs the trainer's own model, optimizer, data, Orbax manager and adaptive cadence (tpujob_trainer)
in one process against fake-gcs-server on loopback (or, with --storage disk, a local directory: a
machine that may open no socket, such as the device machine), one policy after the other, and prints one
JSON object. Every step is waited for (loss fetched) so step times are real; the overlap of an
async save with the following steps is exactly what the numbers show.

Per policy (the first --quiet measured steps save nothing, so that every policy's meter starts
from the same baseline of steps with no save in flight; saves then begin):
- overhead: the trainer's own meter (tpujob.cadence.SaveCostMeter), the same for every
  policy: (time blocked in save() + slowdown of the steps beside a background save, against the
  median of this run's steps with no save in flight) / productive step time. It compares each run
  with itself, so load from other work on the machine cancels out; `overhead_vs_none` (mean time
  per step against the `none` run) is printed too and moves with that load.
- interval P50/P90 between save starts, in steps and in seconds; median save duration (save() ->
  Orbax's commit timestamp); bytes per checkpoint.
- expected waste for a failure every --mtbf seconds: waste fraction = overhead + (expected work
  lost + restart cost) / MTBF, where the work lost by a failure at a random moment is
  sum(d^2) / (2 sum(d)) over the intervals d (half an interval when they are equal); per hour.

Policies: none, none_async (no per-step wait: what timing every step costs), continuous,
continuous_min:<s>, fixed:<steps>, adaptive:<budget %> (budget bound alone) and
adaptive_mtbf:<budget %> (also told --mtbf, as the operator does: Young/Daly can bind).
Any policy plus `+local:<steps>[@<budget %>]` also saves to the local tier (tpujob.local_tier,
on a tmpfs-like local directory) every <steps> steps at most, as the trainer does, within the overhead
budget (default: spec.checkpoint.local.overheadBudgetPercent's; @0: every <steps> steps): compare
`local_overhead_points` (seconds per step against the same policy without it, in points of the
`none` run's step time) side by side, e.g. --policies none,continuous,continuous+local:10, and
`local_blocked_points` (the loop's time blocked in local saves, in the same points: what a host whose
cores are not all busy training pays; on 2 shared CPU cores the background write also slows the steps).
`--rounds N` repeats the policies, every other round in reverse order, and pairs each run with the
`none` and GCS-alone runs of its own round; `local_tier` has the medians over the rounds.
A `+local:` policy plus `+buddy` also sends each committed local step to a buddy and keeps a ward's,
as every host of a one-slice job of several hosts does (tpujob.buddy): both ends run here over
loopback TCP, so this host pays for sending its copy and for receiving its ward's. Its
`buddy_overhead_points` compare it with the same `+local:` policy without buddy copies.

    python bench/checkpoint_policies.py [--model tiny --steps 3000 --sweep 10,20,50,100,200,500,1000 --mtbf 120]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tpujob_contract as contract
from tpujob_contract import LATEST

BUCKET = "bench"
DEFAULT_POLICIES = "none,none_async,continuous,adaptive:5,adaptive:10,adaptive_mtbf:5"


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _checkpoint_config(spec: str, mtbf: float) -> Any:
    """The trainer's CheckpointConfig for a policy spec (None for none / none_async)."""
    from tpujob.config import CheckpointConfig

    kind, _, arg = spec.partition(":")
    if kind in ("none", "none_async"):
        return None
    common: dict[str, Any] = dict(
        min_interval_seconds=0.0, interval_steps=100, async_save=True, keep_latest=100_000, keep_every_steps=0,
        save_on_preemption=False, resume=LATEST,
    )  # fmt: skip
    if kind == "continuous":
        return CheckpointConfig(policy="continuous", **common)
    if kind == "continuous_min":
        return CheckpointConfig(policy="continuous", **(common | {"min_interval_seconds": float(arg)}))
    if kind == "fixed":
        return CheckpointConfig(policy="interval", **(common | {"interval_steps": int(arg)}))
    if kind in ("adaptive", "adaptive_mtbf"):
        told = mtbf if kind == "adaptive_mtbf" else None
        return CheckpointConfig(policy="adaptive", overhead_budget_percent=float(arg), mtbf_seconds=told, **common)
    raise SystemExit(f"unknown policy {spec!r}")


@contextlib.contextmanager
def _storage(kind: str, tmp: Path) -> Iterator[tuple[Path, str, str]]:
    """The persistent tier: (the folder its bucket's objects land in, the bucket's URL, its description)."""
    if kind == "disk":
        root = tmp / "disk"
        (root / BUCKET).mkdir(parents=True)
        yield root, str(root / BUCKET), f"a local directory ({root}), no emulator"
        return
    from tpujob_devcluster.fakegcs import start_fake_gcs

    with start_fake_gcs(tmp / "gcs") as gcs:
        os.environ.update(gcs.env())
        gcs.create_bucket(BUCKET)
        yield gcs.root_dir, f"gs://{BUCKET}", "fake-gcs-server on 127.0.0.1 (gs://)"


def _run_policy(args: argparse.Namespace, spec: str, root: Path, bucket: str, round_: int = 0) -> dict[str, Any]:
    # Imported here: the emulator's environment must be in place before fsspec/gcsfs load.
    import orbax.checkpoint as ocp
    from tpujob import checkpointing
    from tpujob.cadence import SaveCostMeter
    from tpujob_trainer.config import parse_config
    from tpujob_trainer.data import batch_for_step
    from tpujob_trainer.train import Trainer, make_mesh

    cfg = parse_config(
        ["--model", args.model, "--steps", str(args.steps + args.warmup), "--batch-size", str(args.batch_size),
         "--seq-len", str(args.seq_len)], {},
    ).train  # fmt: skip
    trainer = Trainer(cfg, make_mesh(1))
    spec, _, local_every = spec.partition("+local:")
    local_every, with_buddy, _ = local_every.partition("+buddy")
    ckpt = _checkpoint_config(spec, args.mtbf)
    # A directory per round: a manager does not save a step at or below one its directory holds.
    local_name = f"-local{local_every.replace('@', '-b')}{'-buddy' if with_buddy else ''}" if local_every else ""
    name = spec.replace(":", "-").replace(".", "_") + local_name + f"-r{round_}"
    local, stand_in, buddy_copies = None, None, None
    if local_every:
        from tpujob.config import LocalTierConfig
        from tpujob.local_tier import LocalTier

        local_dir = Path(os.environ.get("TPUJOB_BENCH_LOCAL_DIR") or root.parent / "local") / name
        every, _, budget = local_every.partition("@")
        budget_percent = float(budget) if budget else contract.DEFAULT_LOCAL_OVERHEAD_BUDGET_PERCENT
        local = LocalTier(LocalTierConfig(str(local_dir), int(every), budget_percent), f"{bucket}/{name}", "bench", 1)
        if with_buddy:
            stand_in = _start_buddy_pair(local, local_dir)
    local_blocked_s, local_saves = 0.0, 0
    mngr, cadence = None, None
    meter = SaveCostMeter()
    if ckpt is not None:
        options = checkpointing.manager_options(ckpt)
        if policy := checkpointing.adaptive_policy(options):
            cadence = checkpointing.AdaptiveCadence(ckpt, policy, announce=False)
            meter = cadence.cadence.meter
        directory = contract.checkpoints_dir(f"{bucket}/{name}")
        mngr = checkpointing.CheckpointManager(directory, options, checkpointing.PreemptionNotice(False))
    wait_each_step = spec != "none_async"
    state = trainer.init()
    starts: dict[int, float] = {}  # step -> wall time of the save() that started it
    step_times: list[float] = []
    measured_from = 0.0
    for step in range(1, cfg.steps + 1):
        if step == args.warmup + 1:  # the first steps compile
            measured_from = time.perf_counter()
        started = time.perf_counter()
        tokens = trainer.device_batch(
            batch_for_step(cfg.seed, step - 1, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size)
        )
        state, loss = trainer.step(state, tokens)
        if wait_each_step:
            float(loss.addressable_data(0))
        if step <= args.warmup:
            continue
        step_s = time.perf_counter() - started
        step_times.append(step_s)
        if local and local.measuring:  # as the trainer's loop feeds it (the quiet steps are its idle ones)
            local.step(step_s)
        if mngr is None:
            continue
        saving = mngr.is_saving_in_progress()
        if cadence:
            cadence.step(step_s, saving)
        else:
            meter.step(step_s, saving)
        if step <= args.warmup + args.quiet:  # every policy's meter starts from the same idle baseline
            continue
        called, blocked_from = time.time(), time.perf_counter()
        if mngr.save(step, args=ocp.args.StandardSave(state)):
            starts[step] = called
            blocked_s = time.perf_counter() - blocked_from
            (cadence or meter).saved(blocked_s)
        if local:
            blocked_from = time.perf_counter()
            if local.save(step, state):
                local_saves += 1
                local_blocked_s += time.perf_counter() - blocked_from
    float(loss.addressable_data(0))
    loop_s = time.perf_counter() - measured_from
    if mngr:
        mngr.wait_until_finished()
        mngr.close()
    if local:
        buddy_copies = local.buddies.sender.copies_sent if local.buddies else None
        local.close()
    if stand_in:
        stand_in.close()
    result = _summarise(spec, step_times, loop_s, starts, root / BUCKET / name / contract.CHECKPOINTS_DIR)
    if local:
        result |= {"policy": f"{spec}+local:{local_every}{with_buddy}", "local_saves": local_saves,
                   "local_blocked_s": local_blocked_s, "local_interval_steps": local.interval_steps}  # fmt: skip
        if buddy_copies is not None:
            result["buddy_copies_sent"] = buddy_copies
    if mngr:
        result |= {"overhead": meter.overhead, "save_cost_s": meter.cost_s, "extra_s": meter.extra_s}
    if cadence:
        in_force = cadence.in_force
        result |= {
            "budget_percent": ckpt.overhead_budget_percent,
            "mtbf_told_s": ckpt.mtbf_seconds,
            "interval_in_force_s": None if in_force is None else in_force.seconds,
            "bound": None if in_force is None else in_force.bound,
        }
    return result


def _summarise(
    spec: str, step_times: list[float], loop_s: float, starts: dict[int, float], directory: Path
) -> dict[str, Any]:
    steps = sorted(starts)
    durations, sizes = [], []
    for step in steps:
        meta = json.loads((directory / str(step) / "_CHECKPOINT_METADATA").read_text())
        durations.append(meta["commit_timestamp_nsecs"] / 1e9 - starts[step])
        sizes.append(sum(f.stat().st_size for f in (directory / str(step)).rglob("*") if f.is_file()))
    gaps_steps = [float(b - a) for a, b in itertools.pairwise(steps)]
    gaps_s = [starts[b] - starts[a] for a, b in itertools.pairwise(steps)]
    return {
        "policy": spec,
        "steps_measured": len(step_times),
        "loop_s": loop_s,
        "seconds_per_step": loop_s / len(step_times),
        "median_step_s": statistics.median(step_times),
        "saves": len(steps),
        "interval_steps_p50": _percentile(gaps_steps, 50),
        "interval_steps_p90": _percentile(gaps_steps, 90),
        "interval_s_p50": _percentile(gaps_s, 50),
        "interval_s_p90": _percentile(gaps_s, 90),
        # a failure at a uniformly random moment lands in an interval d with probability d / sum(d)
        "expected_lost_s": sum(d * d for d in gaps_s) / (2 * sum(gaps_s)) if gaps_s else None,
        "median_save_s": statistics.median(durations) if durations else None,
        "bytes_per_checkpoint": int(statistics.median(sizes)) if sizes else None,
    }


def _waste(result: dict[str, Any], mtbf: float, restart: float) -> None:
    if result.get("overhead") is None or result["expected_lost_s"] is None:
        return
    fraction = result["overhead"] + (result["expected_lost_s"] + restart) / mtbf
    result["waste_fraction"] = fraction
    result["waste_s_per_hour"] = 3600 * fraction


def _targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, as measured here (reported, never asserted)."""
    fixed = [r for r in results if r["policy"].startswith("fixed:") and "waste_fraction" in r]
    best = min(fixed, key=lambda r: r["waste_fraction"]) if fixed else None
    fixed_100 = next((r for r in results if r["policy"] == "fixed:100"), None)
    out: dict[str, Any] = {"best_fixed": best["policy"] if best else None}
    for r in results:
        if not r["policy"].startswith("adaptive"):
            continue
        target: dict[str, Any] = {}
        if r.get("overhead") is not None:
            target["overhead_within_budget_plus_1_point"] = 100 * r["overhead"] <= r["budget_percent"] + 1
        if best and "waste_fraction" in r:
            target["waste_vs_best_fixed"] = r["waste_fraction"] / best["waste_fraction"]
            target["waste_within_10_percent_of_best_fixed"] = r["waste_fraction"] <= 1.1 * best["waste_fraction"]
        if fixed_100 and r["interval_steps_p50"] and fixed_100["interval_steps_p50"]:
            target["p50_interval_steps_vs_fixed_100"] = r["interval_steps_p50"] / fixed_100["interval_steps_p50"]
            target["p50_interval_s_vs_fixed_100"] = r["interval_s_p50"] / fixed_100["interval_s_p50"]
        out[r["policy"]] = target
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3000, help="measured steps per policy")
    p.add_argument("--warmup", type=int, default=50, help="unmeasured first steps (compilation, first-run effects)")
    p.add_argument("--quiet", type=int, default=100, help="first measured steps without saves (the meter's baseline)")
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--rounds", type=int, default=1, help="run the policies this many times, every other round reversed")
    p.add_argument("--sweep", default="10,20,50,100,200,500,1000", help="fixed intervals (steps) added to --policies")
    p.add_argument("--mtbf", type=float, default=120.0, help="mean time between failures for the waste (s)")
    p.add_argument("--restart-cost", type=float, default=6.0, help="seconds from a failure to training again")
    p.add_argument("--storage", choices=("gcs", "disk"), default="gcs", help="the persistent tier's storage")
    args = p.parse_args()
    specs = args.policies.split(",") + [f"fixed:{n}" for n in args.sweep.split(",") if n]

    with tempfile.TemporaryDirectory(prefix="tpujob-bench-") as tmp, _storage(args.storage, Path(tmp)) as storage:
        root, bucket, described = storage
        import jax

        results = []
        for round_ in range(args.rounds):
            for spec in specs if round_ % 2 == 0 else specs[::-1]:  # the machine's drift falls on both orders
                results.append({**_run_policy(args, spec, root, bucket, round_), "round": round_})
                print(f"round {round_} {spec}: done", file=sys.stderr, flush=True)
        device = jax.devices()[0]
    for r in results:
        same_round = [g for g in results if g["round"] == r["round"]]
        base = next((g for g in same_round if g["policy"] == "none"), None)
        if base:
            r["overhead_vs_none"] = r["seconds_per_step"] / base["seconds_per_step"] - 1
        _waste(r, args.mtbf, args.restart_cost)
        gcs_alone = next((g for g in same_round if g["policy"] == r["policy"].partition("+local:")[0]), None)
        if base and "+local:" in r["policy"]:
            r["local_blocked_points"] = 100 * r["local_blocked_s"] / (r["steps_measured"] * base["seconds_per_step"])
            if gcs_alone:
                extra = r["seconds_per_step"] - gcs_alone["seconds_per_step"]
                r["local_overhead_points"] = 100 * extra / base["seconds_per_step"]
        local_alone = next((g for g in same_round if g["policy"] == r["policy"].removesuffix("+buddy")), None)
        if base and r["policy"].endswith("+buddy") and local_alone:
            extra = r["seconds_per_step"] - local_alone["seconds_per_step"]
            r["buddy_overhead_points"] = 100 * extra / base["seconds_per_step"]
    print(
        json.dumps(
            {
                "workload": {
                    "model": args.model,
                    "batch_size": args.batch_size,
                    "seq_len": args.seq_len,
                    "measured_steps": args.steps,
                    "mtbf_s": args.mtbf,
                    "restart_cost_s": args.restart_cost,
                    "young_daly_s_at_median_cost": _young_daly(results, args.mtbf),
                    "storage": described,
                },
                "host": {
                    "platform": device.platform,
                    "device": device.device_kind,
                    "devices": jax.device_count(),
                    "cpus": os.cpu_count(),
                    "load_average_1m": os.getloadavg()[0],
                    "python": platform.python_version(),
                    "jax": jax.__version__,
                },
                "policies": results,
                "local_tier": _local_tier(results),
                "targets": _targets([r for r in results if r["round"] == 0]),
            },
            indent=2,
        )
    )
    sys.stdout.flush()


def _local_tier(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per `+local:` policy, over the rounds: the points it adds to its GCS policy's step time, and the
    points of it the loop spent blocked in local saves (the part a host with idle cores still pays)."""
    out: dict[str, Any] = {}
    for policy in dict.fromkeys(r["policy"] for r in results if "+local:" in r["policy"]):
        runs = [r for r in results if r["policy"] == policy]
        overhead = [r["local_overhead_points"] for r in runs if "local_overhead_points" in r]
        blocked = [r["local_blocked_points"] for r in runs if "local_blocked_points" in r]
        buddies = [r["buddy_overhead_points"] for r in runs if "buddy_overhead_points" in r]
        out[policy] = {
            "overhead_points": overhead,
            "overhead_points_median": statistics.median(overhead) if overhead else None,
            "blocked_points": blocked,
            "blocked_points_median": statistics.median(blocked) if blocked else None,
            "blocked_ms_per_save": [1000 * r["local_blocked_s"] / r["local_saves"] for r in runs if r["local_saves"]],
            "interval_steps": [r["local_interval_steps"] for r in runs],
        }
        if buddies:
            out[policy] |= {
                "buddy_overhead_points": buddies,
                "buddy_overhead_points_median": statistics.median(buddies),
                "buddy_copies_sent": [r.get("buddy_copies_sent") for r in runs],
            }
    return out


class _Store:
    """The distributed runtime's key-value store, for one process playing both ends."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> str:
        return self.values[key]


def _start_buddy_pair(local: Any, local_dir: Path) -> Any:
    """This process as process 0 of a one-slice job of two hosts (it keeps process 1's steps, as a
    real host does, and sends its own), and a keeper standing in for process 1, in this process too:
    the copy it sends is the one it receives, so the host's load is both ends of one copy."""
    from tpujob import buddy, local_tier

    store = _Store()
    kept = local_tier.prepare(str(local_dir / buddy.KEPT_DIR), local._identity(1))
    local.buddies = buddy.Buddies(
        kept, Path(local.manager.directory), store, 0, (2, 1), local._identity, local_tier.KEEP
    )
    stand_in = buddy.Keeper(local_dir / "stand-in", store.get(buddy.TOKEN_KEY), 0, local._identity(0),
                            local_tier.KEEP, "127.0.0.1")  # fmt: skip
    store.set(buddy.ADDRESS_KEY.format(1), stand_in.address)
    return stand_in


def _young_daly(results: list[dict[str, Any]], mtbf: float) -> float | None:
    costs = [r["save_cost_s"] for r in results if r.get("save_cost_s")]
    return math.sqrt(2 * statistics.median(costs) * mtbf) if costs else None


if __name__ == "__main__":
    main()
