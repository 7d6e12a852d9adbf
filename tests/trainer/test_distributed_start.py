"""JAX's distributed start-up, as a replacement attempt meets it (issue 17, item 14): real trainer
processes, real JAX coordinators on loopback.

- Two coordinators on one address: gRPC listens with SO_REUSEPORT, so a second JAX service binds an
  address another job's coordinator serves without an error, and the kernel deals connections
  between the two; a registration that reaches the wrong one kills that job ("task 0 unexpectedly
  tried to connect with a different incarnation"). The devcluster gave two devclusters' pods the
  same addresses (fixed in the pod runner, tests/unit/test_pod_addresses.py); the trainer itself
  refuses to serve a coordinator address that another process serves: exit 6, never counted.
- A process waits for its peers in JAX's start-up as long as the operator's clocks allow
  (TPUJOB_DISTRIBUTED_INIT_TIMEOUT_SECONDS), not JAX's fixed 300 s.
"""

from __future__ import annotations

import time

import pytest
from tpujob.config import (
    DEFAULT_DISTRIBUTED_INIT_TIMEOUT_SECONDS,
    FOREVER_SECONDS,
    ConfigError,
    topology_from_env,
)
from tpujob_contract import Env, ExitCode

from tests.trainer.procs import Attempt, Job, free_port

SHAPE = ["--batch-size", "4", "--seq-len", "32"]


def _launch(job: Job, args: list[str], coordinator: str, indexes: list[int], **env: str) -> Attempt:
    """Processes `indexes` of a 2-process, 1-slice attempt of `job` whose coordinator is `coordinator`."""
    return job.start(args, env, processes=2, coordinator=coordinator, only=indexes)


@pytest.mark.timeout(420)
def test_a_coordinator_address_another_job_serves_is_refused_and_the_other_job_trains_on(job: Job) -> None:
    address = f"127.0.0.1:{free_port()}"
    running = _launch(job, ["--steps", "100000", *SHAPE, "--log-every", "1"], address, [0, 1])
    running.wait_until(lambda: "resume: " in running.output(0), quiet=180)  # past JAX's start-up
    # Another job's coordinator handed the same address (two devclusters' pods before the pod runner's
    # fix; a stale peer): its process 0 starts while the first job trains.
    (job.log_dir / "other").mkdir()
    other = Job(gcs=job.gcs, base_env=job.base_env, log_dir=job.log_dir / "other", name=f"{job.name}-other")
    try:
        intruder = _launch(other, ["--steps", "5", *SHAPE], address, [0])
        # Before: it bound the address too (SO_REUSEPORT) and either waited for its peer for 300 s or
        # registered at the first job's coordinator, which then aborted both of that job's processes.
        # (Its imports alone take a minute or more on 2 loaded cores, behind the other job's compiles.)
        assert intruder.wait(200) == [ExitCode.DISTRIBUTED_STARTUP], intruder.output()
        assert "is already served by another process" in intruder.output()
        step = running.last_step()
        running.wait_until(lambda: running.last_step() >= step + 2, quiet=180)  # still one job, training
        assert all(p.poll() is None for p in running.procs), running.output(1)
    finally:
        other.kill_all()


@pytest.mark.timeout(240)
def test_the_wait_for_peers_is_the_operators_not_jaxs_fixed_300s(job: Job) -> None:
    """Process 0 of a 2-process attempt whose peer never comes: JAX gives up when the operator's
    env says (here 3 s), where before it waited JAX's 300 s whatever the scheduling clock allowed."""
    alone = _launch(
        job, ["--steps", "5", *SHAPE], f"127.0.0.1:{free_port()}", [0], **{Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS: "3"}
    )
    started = time.monotonic()
    codes = alone.wait(80)
    # Against JAX's 300 s, not against the machine's speed: half of it is start-up's room on any day.
    assert codes != [0] and time.monotonic() - started < 150, alone.output()
    assert "DEADLINE_EXCEEDED" in alone.output(), alone.output()  # JAX's own end: its abort, exit 134


def test_the_jax_start_up_wait_comes_from_the_env() -> None:
    base = {Env.NUM_SLICES: "2", Env.HOSTS_PER_SLICE: "1", Env.COORDINATOR_ADDRESS: "c:8476"}
    assert topology_from_env(base).init_timeout_seconds == DEFAULT_DISTRIBUTED_INIT_TIMEOUT_SECONDS
    assert topology_from_env({**base, Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS: "5460"}).init_timeout_seconds == 5460
    assert (
        topology_from_env({**base, Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS: "0"}).init_timeout_seconds == FOREVER_SECONDS
    )
    huge = str(10 * FOREVER_SECONDS)
    assert (
        topology_from_env({**base, Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS: huge}).init_timeout_seconds == FOREVER_SECONDS
    )
    with pytest.raises(ConfigError, match=Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS):
        topology_from_env({**base, Env.DISTRIBUTED_INIT_TIMEOUT_SECONDS: "-1"})
