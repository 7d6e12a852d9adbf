"""The simulation tier: thousands of random fault schedules through the operator's real decision code,
each checked after every simulated second against the promises in docs/concepts/invariants.md.

SIM_SCHEDULES sets how many schedules (`make sim SCHEDULES=...`); SIM_SEED a seed (unset: derandomized,
the same schedules every run)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, seed, settings

from .schedule import Event, configs, run, schedules
from .world import Config

SCHEDULES = int(os.environ.get("SIM_SCHEDULES") or 2000)
SEED = os.environ.get("SIM_SEED") or None


@settings(
    max_examples=SCHEDULES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=configs, schedule=schedules)
def check_every_promise(config: Config, schedule: list[Event]) -> None:
    assert run(config, schedule) == []


test_no_schedule_breaks_a_promise = seed(int(SEED))(check_every_promise) if SEED else check_every_promise
