"""bench/operator_scale.py's pure parts: which watch events time a reaction, and the targets read
from each share of it."""

from typing import Any

from . import benches

scale = benches.load("operator_scale")


def _pod(phase: str | None) -> dict[str, Any]:
    return {"metadata": {"name": "job-7-w-0"}, "status": {"phase": phase} if phase else {}}


def test_a_pod_times_the_reaction_only_once_the_api_says_it_failed() -> None:
    assert [scale.failed_pod_key(_pod(p)) for p in (None, "Pending", "Running", "Succeeded")] == [None] * 4
    assert scale.failed_pod_key(_pod("Failed")) == "job-7-w-0"


def test_a_jobset_is_keyed_by_its_job_and_attempt() -> None:
    jobset = {"metadata": {"labels": {scale.LABEL_NAME: "job-7", scale.LABEL_ATTEMPT: "3"}}}
    assert scale.jobset_key(jobset) == ("job-7", 3)


def _reaction(whole: float, operator: float, timeouts: int = 0) -> dict[str, Any]:
    return {"p99": whole, "timeouts": timeouts, "node": {"p99": whole - operator}, "operator": {"p99": operator}}


def _size(reaction: dict[str, Any], blackholed: dict[str, Any] | None) -> dict[str, Any]:
    idle = {
        "operator": {"rss_mb_max": 150},
        "apiserver": {"periodic_list_calls": 0},
        "gcs": {"operations_per_job_hour": 50},
    }
    return {"idle": idle, "reaction": reaction, **({"reaction_gcs_blackholed": blackholed} if blackholed else {})}


def test_the_operator_share_is_judged_apart_from_the_whole_reaction() -> None:
    got = scale.targets(_size(_reaction(4.3, 0.4), _reaction(4.1, 0.6)))
    assert got["reaction_p99_s"] == {"target": 2.0, "got": 4.3, "met": False}
    assert got["reaction_operator_p99_s"] == {"target": 2.0, "got": 0.4, "met": True}
    assert got["reaction_gcs_blackholed_operator_p99_s"] == {"target": 2.0, "got": 0.6, "met": True}


def test_a_kill_never_reacted_to_fails_the_blackholed_targets_whatever_the_others() -> None:
    got = scale.targets(_size(_reaction(1.0, 0.4), _reaction(1.0, 0.4, timeouts=1)))
    assert not got["reaction_gcs_blackholed_p99_s"]["met"]
    assert not got["reaction_gcs_blackholed_operator_p99_s"]["met"]


def test_without_blackholed_kills_no_blackholed_target_is_claimed() -> None:
    assert not [key for key in scale.targets(_size(_reaction(1.0, 0.4), None)) if "blackholed" in key]
