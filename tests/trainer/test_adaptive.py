"""Policy "adaptive" in real trainer processes against fake-gcs-server.

What the cadence decides from its own meter (the save cost it measured, the bound that won, an
interval the budget allows): here. How much the saves cost against the budget is a speed, measured by
bench/checkpoint_policies.py (`overhead_within_budget_plus_1_point`), never asserted by a test.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from tpujob.cadence import budget_interval
from tpujob_devcluster.fakegcs import FakeGcsServer

from tests.trainer.procs import Job

# tiny model, ~12 ms steps on 2 cores: a save (~0.1-0.2 s of cost) is large against a step.
STEPS = 1200


def _workload(steps: int) -> list[str]:
    return ["--model", "tiny", "--steps", str(steps), "--batch-size", "8", "--seq-len", "64", "--log-every", "200"]


BUDGET_PERCENT = 10.0


def _env(env: dict[str, str]) -> dict[str, str]:
    # XLA's optimised steps: these runs are long in steps, not in compiles (tests/conftest.py TEST_JAX_ENV).
    return {
        "TPUJOB_CHECKPOINT_POLICY": "adaptive",
        "TPUJOB_CHECKPOINT_KEEP_LATEST": "100000",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "0",
        **env,
    }


def _adaptive(job: Job, env: dict[str, str]) -> dict[str, object]:
    attempt = job.start(_workload(STEPS), _env(env))
    assert attempt.wait(240) == [0], attempt.output()
    record = job.progress()
    assert record["state"] == "succeeded" and record["step"] == STEPS
    return record


def _adaptive_until_saved(job: Job, env: dict[str, str], commits: int) -> dict[str, object]:
    """An adaptive run with no end of its own, stopped by SIGTERM once `commits` steps are committed:
    how many saves fit in a fixed number of steps is the machine's speed, not the policy's."""
    attempt = job.start(_workload(100_000_000), _env(env))
    attempt.wait_until(lambda: len(job.committed_steps()) >= commits, quiet=120, poll=0.5)
    attempt.signal(signal.SIGTERM)
    assert attempt.wait(quiet=120) == [143], attempt.output()[-4000:]
    record = job.progress()
    assert record["state"] == "preempted", record
    return record


@pytest.mark.timeout(600)
def test_adaptive_saves_at_the_interval_its_budget_allows_unless_the_users_bound_is_tighter(
    job: Job, gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path, run_name: str
) -> None:
    # Back to back: an upper bound below any save's duration makes every save start as soon as
    # the previous one finished (what policy "continuous" does), priced by the same meter.
    back_to_back = Job(gcs=gcs, base_env=trainer_env, log_dir=tmp_path / "b2b", name=f"{run_name}-b2b")
    back_to_back.log_dir.mkdir()
    try:
        pinned = _adaptive(
            back_to_back, {"TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS": "0.001", "TPUJOB_MTBF_SECONDS": "1000000"}
        )
    finally:
        back_to_back.kill_all()
    assert pinned["checkpoint_interval_bound"] == "max"  # the user's bound wins over Young/Daly's
    assert pinned["mtbf_seconds"] == 1_000_000
    assert isinstance(pinned["checkpoint_overhead_percent"], float)

    adaptive = _adaptive_until_saved(job, {"TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT": str(BUDGET_PERCENT)}, 3)
    assert adaptive["mtbf_seconds"] is None and adaptive["checkpoint_interval_bound"] == "budget"
    cost, interval = adaptive["save_cost_seconds"], adaptive["checkpoint_interval_seconds"]
    assert isinstance(cost, float) and isinstance(interval, float) and cost > 0
    assert interval >= budget_interval(cost, BUDGET_PERCENT / 100) - 1e-3  # plus any overhead still owed
    assert isinstance(adaptive["checkpoint_overhead_percent"], float)
    # It checkpointed as it went, at a cadence it announced, and the SIGTERM's save is the last.
    assert len(job.committed_steps()) >= 3 and job.committed_steps()[-1] == adaptive["step"]
    assert "checkpoint cadence: every" in job.attempts[0].output()
