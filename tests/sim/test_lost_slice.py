"""A lost slice's Job is recreated without its back-off, also by an operator that died in the middle.

The world of the simulation tier (tests/sim/world.py: the Job controller's back-off per Job uid, JobSet
recreating a deleted slice Job), the operator's real decisions, and one operator crash placed where it
hurts: right after the first API call of the decision that deletes the lost slice's Job."""

from __future__ import annotations

from typing import Any

import pytest
from tpujob_operator.facts import Actions

from .control import Operator
from .schedule import training_job
from .world import JOB_POD_FAILURE_BACKOFF_SECONDS, Config, World

SETTLE_SECONDS = 60  # the job trains well before this
WITHIN_SECONDS = 120  # the replacement exists well before this, back-off or not


class CrashingOperator(Operator):
    """Dies after `crash_after_calls` API calls (the status write is the first) of the first decision that
    deletes a lost slice's Job; the next decision is a restarted operator's."""

    crash_after_calls: int | None = None

    def _calls(self, tj: Any, status: Any, actions: Actions) -> list[Any]:
        if actions.recreate_lost_slices and self.crash_after_calls is not None:
            self.crash_after, self.crash_after_calls = self.crash_after_calls, None
        return super()._calls(tj, status, actions)


@pytest.mark.parametrize("crash_after_calls", [None, 2], ids=["no crash", "crash after its first action"])
def test_a_lost_slice_is_replaced_before_its_jobs_back_off_would_allow(crash_after_calls: int | None) -> None:
    config = Config(in_place=True, slices=2, spare_pools=1)
    world = World(config, training_job(config))
    operator = CrashingOperator(world)
    operator.crash_after_calls = crash_after_calls
    for _ in range(SETTLE_SECONDS):
        world.tick()
        operator.maybe_reconcile()
    [victim] = [p for p in world.live_pods() if p.slice == 1 and p.process_alive]
    world.node_lost(1)  # the running pods sorted by name: slice 1's is the second
    assert not victim.process_alive, "another node was lost"
    for _ in range(WITHIN_SECONDS):
        world.tick()
        operator.maybe_reconcile()
    assert victim.finished_at is not None, "the operator never marked the lost pod Failed"
    replacement = min(
        (p for p in world.pods.values() if p.slice == 1 and p.created > victim.created), key=lambda p: p.created
    )
    assert replacement.created - victim.finished_at < JOB_POD_FAILURE_BACKOFF_SECONDS, (replacement, victim)
    assert replacement.job_uid != victim.job_uid  # by the slice's Job recreated
    if crash_after_calls is not None:
        assert any(d.applied < d.calls and d.actions.recreate_lost_slices for d in operator.decisions)
