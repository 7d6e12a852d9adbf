"""How many schedules the simulation needs to break each promise: `python -m tests.sim.hunt` prints, per
invariant, the number of schedules run before the first one that broke it and that schedule shrunk
(JSON). Run it with another tree's operator first on PYTHONPATH to show the tier finds its defects."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .schedule import Event, configs, run, schedules
from .world import Config


def hunt(invariant: str, limit: int, seed: int, worlds: st.SearchStrategy[Config] = configs) -> dict[str, object]:
    tried = {"schedules": 0, "first": None}
    found: dict[str, object] = {}

    @settings(max_examples=limit, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(config=worlds, schedule=schedules)
    def probe(config: Config, schedule: list[Event]) -> None:
        tried["schedules"] = int(tried["schedules"] or 0) + 1
        broken = [v for v in run(config, schedule) if v.startswith(f"{invariant}.")]
        if broken:
            if tried["first"] is None:
                tried["first"] = tried["schedules"]
            found.update(config=repr(config), schedule=repr(schedule), violation=broken[0])
            raise AssertionError(broken[0])

    probe._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]
    with contextlib.suppress(AssertionError):
        probe()
    return {"invariant": invariant, "schedules_to_find": tried["first"], "limit": limit, **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--invariants", default="1,2,3,4,6,7,8,9,10")
    parser.add_argument("--limit", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trainer-keeps-silent",
        action="store_true",
        help="the trainer before it gave up on storage lost while training (exit 3): it trains on, its record silent",
    )
    parser.add_argument(
        "--trainer-silent-in-saves",
        action="store_true",
        help="the trainer before it kept its record fresh while blocked in a save: a long final save is a hang",
    )
    args = parser.parse_args()
    worlds = configs
    if args.trainer_keeps_silent:
        worlds = worlds.map(lambda c: replace(c, trainer_gives_up_on_storage=False))
    if args.trainer_silent_in_saves:
        worlds = worlds.map(lambda c: replace(c, trainer_keeps_record_fresh_in_saves=False))
    for invariant in args.invariants.split(","):
        print(json.dumps(hunt(invariant, args.limit, args.seed, worlds)), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
