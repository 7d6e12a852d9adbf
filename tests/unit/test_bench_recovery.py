"""bench/recovery.py's pure parts: the job order (sides alternate), the sides compared, the
quantiles and the before/after comparison."""

import random
import subprocess
from pathlib import Path
from typing import Any, cast

import numpy
import pytest
from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_devcluster.harness import quantiles
from tpujob_devcluster.podrunner import container_env
from tpujob_devcluster.throttle import ThrottledProxy
from tpujob_operator.api import TrainingJob
from tpujob_operator.jobset import CONTAINER, build_jobset

from . import benches

recovery = benches.load("recovery")


def _sides() -> list[Any]:
    return list(recovery.sides_for(["on"], ("a740187", "a" * 40, Path("/tmp/old")), None))


def test_with_a_baseline_it_comes_first_in_its_own_namespace_with_its_sources_first() -> None:
    baseline, current = _sides()
    assert (baseline.key, current.key) == ("baseline", "current")
    assert baseline.namespace == recovery.BASELINE_NAMESPACE != current.namespace == recovery.NAMESPACE
    assert current.pythonpath is None  # the working tree: the venv's editable installs
    assert (baseline.rev, baseline.commit) == ("a740187", "a" * 40)


def test_a_revision_puts_the_sources_it_has_on_pythonpath(tmp_path: Path) -> None:
    (tmp_path / "operator" / "src").mkdir(parents=True)
    (tmp_path / "trainer_image" / "src").mkdir(parents=True)  # no contract/ before issue 8
    side = recovery.Side("baseline", "ns", "on", "old", "c" * 40, tmp_path)
    assert side.pythonpath == f"{tmp_path}/operator/src:{tmp_path}/trainer_image/src"


def test_without_a_baseline_the_sides_are_the_cache_settings_as_before() -> None:
    sides = recovery.sides_for(["off", "on"], None, None)
    assert [(s.key, s.namespace, s.compile_cache) for s in sides] == [
        ("off", "default", "off"),
        ("on", "default", "on"),
    ]


def test_sides_alternate_within_a_policy_and_turn_each_round() -> None:
    baseline, current = _sides()
    order = [(r, policy, side.key) for r, policy, side in recovery.plan([baseline, current], 2)]
    assert order == [
        (0, "continuous", "baseline"), (0, "continuous", "current"),
        (0, "interval", "baseline"), (0, "interval", "current"),
        (1, "continuous", "current"), (1, "continuous", "baseline"),
        (1, "interval", "current"), (1, "interval", "baseline"),
    ]  # fmt: skip


def test_quantiles_skip_unknown_values_and_say_n() -> None:
    q = recovery.quantiles([None, *[float(v) for v in range(1, 31)]])
    assert q["n"] == 30 and q["p50"] == 15.5 and q["max"] == 30.0
    assert 29.0 < q["p99"] < 30.0  # with n = 30 the p99 lies between the two largest
    assert recovery.quantiles([None]) == {"p50": None, "p90": None, "p99": None, "max": None, "n": 0}


@pytest.mark.parametrize("n", [1, 2, 3, 10, 99, 1000])
def test_quantiles_are_numpys_linear_percentiles(n: int) -> None:
    """harness.quantiles (both fleet benches') computes what numpy.percentile does, without numpy."""
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    q = quantiles(values, points=(50, 90, 99))
    expected = numpy.percentile(values, [50, 90, 99])
    assert [q["p50"], q["p90"], q["p99"]] == pytest.approx([float(v) for v in expected], abs=0.001)  # it rounds
    assert (q["max"], q["n"]) == (round(max(values), 3), n)


def _failure(recovery_s: float, share: float | None) -> dict[str, Any]:
    stages = dict.fromkeys(recovery.STAGES)
    stages["operator_share"] = share
    return {"recovery_s": recovery_s, "reaction_s": 0.3, "stages": stages}


def test_comparison_pools_every_policy_and_round_per_side_and_divides_by_the_first_side() -> None:
    runs = {
        "baseline": {
            "continuous": [{"failures": [_failure(10.0, 0.5), _failure(12.0, 0.7)]}],
            "interval": [{"failures": [_failure(8.0, 0.6)]}, {"failures": [_failure(9.0, None)]}],
        },
        "current": {
            "continuous": [{"failures": [_failure(4.0, 0.2), _failure(5.0, 0.1)]}],
            "interval": [{"failures": [_failure(6.0, 0.3)]}, {"failures": [_failure(3.0, 0.2)]}],
        },
    }
    result = recovery.comparison(runs)
    assert result["failures"] == {"baseline": 4, "current": 4}
    assert result["median"]["baseline"]["recovery_s"] == 9.5
    assert result["median"]["current"]["recovery_s"] == 4.5
    assert result["ratio_over_baseline"]["current"]["recovery_s"] == pytest.approx(4.5 / 9.5, abs=1e-3)
    share = result["stages"]["baseline"]["operator_share"]
    assert (share["n"], share["p50"], share["max"]) == (3, 0.6, 0.7)
    assert result["median"]["current"]["total_s"] is None  # no trainer timeline in these records


def test_paired_ratios_divide_each_job_by_the_first_sides_job_of_the_same_round_and_policy() -> None:
    def job(r: int, policy: str, side: str, median: float) -> dict[str, Any]:
        return {"round": r, "policy": policy, "side": side, "median_recovery_s": median}

    runs = [
        job(0, "continuous", "baseline", 10.0), job(0, "continuous", "current", 4.0),
        job(0, "interval", "baseline", 8.0), job(0, "interval", "current", 4.0),
        job(1, "continuous", "current", 3.0), job(1, "continuous", "baseline", 20.0),
    ]  # fmt: skip
    result = recovery.paired_ratios(runs, "baseline")
    assert result == {
        "current": {"pairs": {"r0-continuous": 0.4, "r0-interval": 0.5, "r1-continuous": 0.15}, "median": 0.4}
    }


def test_a_throttled_rung_points_the_trainers_gcs_clients_at_the_proxy_over_the_runners_emulator(
    tmp_path: Path,
) -> None:
    """The rung's manifest, built into its JobSet by the operator and its env resolved as the pod runner
    does (spec env over the runner's emulator env): no GCS client of the trainer reaches the emulator."""
    emulator = FakeGcsServer(cast(subprocess.Popen[bytes], None), 4443, tmp_path, tmp_path / "log")
    with ThrottledProxy(emulator, 1e6) as proxy:
        manifest = recovery._rung_manifest("bench-recreate-r0", recovery.RUNGS["recreate"], "medium", 3, proxy.env())
    manifest["metadata"]["uid"] = "uid-1"  # the apiserver's
    jobset = build_jobset(TrainingJob.model_validate(manifest), attempt=0, resume_step=None)
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    [trainer] = [c for c in pod["spec"]["containers"] if c["name"] == CONTAINER]
    env = container_env(pod, trainer, emulator.env())
    pointed = {k for k, v in env.items() if proxy.endpoint in v}
    assert pointed >= {"STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"}
    assert not [k for k, v in env.items() if emulator.endpoint in v]
