import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from tpujob_operator.api import RestartSpec
from tpujob_operator.facts import JobSetFacts, PodFacts
from tpujob_operator.restarts import (
    FAILED_JOBSET_POD_WAIT_SECONDS,
    POD_NEWS_RECHECK_SECONDS,
    WORKER_POD_DELETED,
    backoff,
    classify_jobset_failure,
    classify_pod,
    counts_against_budget,
    pod_news_wait,
)

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("pod", "kind", "reason"),
    [
        (PodFacts("p", 0, "Failed", exit_code=1, reason="Error"), "ApplicationError", "ExitCode1"),
        (PodFacts("p", 0, "Failed", exit_code=137, reason="OOMKilled"), "ApplicationError", "OOMKilled"),
        (PodFacts("p", 1, "Failed", exit_code=143, reason="Error"), "Preemption", "Terminated"),
        (
            PodFacts("p", 1, "Failed", exit_code=137, disruption_reason="PreemptionByScheduler"),
            "Preemption",
            "PreemptionByScheduler",
        ),
        (PodFacts("p", 1, "Failed", disruption_reason="EvictionByEvictionAPI"), "Preemption", "EvictionByEvictionAPI"),
        (PodFacts("p", 0, "Failed", disruption_reason="DeletionByTaintManager"), "NodeLost", "DeletionByTaintManager"),
        (PodFacts("p", 0, "Failed", disruption_reason="DeletionByPodGC"), "NodeLost", "DeletionByPodGC"),
        (PodFacts("p", 0, "Failed", reason="NodeLost"), "NodeLost", "NodeLost"),
        (PodFacts("p", 0, "Failed"), "Unknown", "PodFailed"),
    ],
)
def test_pod_failures_are_classified(pod, kind, reason):
    failure = classify_pod(pod)
    assert failure is not None
    assert (failure.kind, failure.reason, failure.slice) == (kind, reason, pod.slice)


def test_running_and_succeeded_pods_are_not_failures():
    assert classify_pod(PodFacts("p", 0, "Running")) is None
    assert classify_pod(PodFacts("p", 0, "Succeeded", exit_code=0)) is None


def test_root_cause_is_the_earliest_failed_pod_not_its_collateral():
    collateral = PodFacts("a", 0, "Failed", exit_code=1, finished_at=T0 + timedelta(seconds=30))
    root = PodFacts("b", 1, "Failed", exit_code=143, finished_at=T0)
    jobset = JobSetFacts("js", 0, None, T0, "Failed", pods=(collateral, root, PodFacts("c", 1, "Running")))
    failure = classify_jobset_failure(jobset)
    assert (failure.kind, failure.slice) == ("Preemption", 1)


def test_a_failed_jobset_whose_pods_are_all_gone_is_a_deleted_pods_not_the_jobs():
    # An eviction or preemption deletes the pod and its DisruptionTarget with it; an operator that was
    # down meanwhile finds a failed JobSet and nothing else. A crash leaves its Failed pod behind.
    jobset = JobSetFacts(
        "js", 0, None, T0, "Failed", condition_reason="FailedJobs", condition_message="job js-slice-1 failed",
        ended_at=T0, pods=(PodFacts("c", 1, "Running", deleting=True),),
    )  # fmt: skip
    failure = classify_jobset_failure(jobset)
    assert (failure.kind, failure.reason, failure.time) == ("Preemption", WORKER_POD_DELETED, T0)
    assert not counts_against_budget(failure.kind, RestartSpec())
    # ... once the pod watch had its time to show a crashed pod (which stays in the API)
    assert pod_news_wait(jobset, failure, T0 + timedelta(seconds=1)) == POD_NEWS_RECHECK_SECONDS
    assert pod_news_wait(jobset, failure, T0 + timedelta(seconds=FAILED_JOBSET_POD_WAIT_SECONDS + 1)) is None


def test_a_failed_jobset_beside_a_running_pod_waits_a_bounded_while_for_the_pods_news():
    jobset = JobSetFacts(
        "js", 0, None, T0, "Failed", condition_reason="FailedJobs", condition_message="job js-slice-1 failed",
        ended_at=T0, pods=(PodFacts("c", 1, "Running"),),
    )  # fmt: skip
    failure = classify_jobset_failure(jobset)
    assert (failure.kind, failure.reason, failure.message) == ("Unknown", "FailedJobs", "job js-slice-1 failed")
    assert pod_news_wait(jobset, failure, T0 + timedelta(seconds=1)) == POD_NEWS_RECHECK_SECONDS
    past = T0 + timedelta(seconds=FAILED_JOBSET_POD_WAIT_SECONDS + 1)
    assert pod_news_wait(jobset, failure, past) is None  # then decided as the JobSet says: counted
    crashed = dataclasses.replace(jobset, pods=(PodFacts("a", 0, "Failed", exit_code=1, finished_at=T0), *jobset.pods))
    crash = classify_jobset_failure(crashed)
    assert crash.kind == "ApplicationError" and pod_news_wait(crashed, crash, T0) is None


def test_preemptions_count_only_when_asked():
    assert not counts_against_budget("Preemption", RestartSpec())
    assert not counts_against_budget("NodeLost", RestartSpec())
    assert counts_against_budget("Preemption", RestartSpec(count_preemptions=True))
    assert counts_against_budget("ApplicationError", RestartSpec())
    assert counts_against_budget("Hang", RestartSpec())


def test_backoff_doubles_for_counted_failures_and_is_capped():
    policy = RestartSpec(backoff_seconds=10, max_backoff_seconds=60)
    assert [backoff(policy, n, True).total_seconds() for n in (1, 2, 3, 4, 5)] == [10, 20, 40, 60, 60]
    assert backoff(policy, 4, False).total_seconds() == 10


def test_a_storage_refusal_is_terminal_and_never_counted():
    from tpujob_operator.restarts import TERMINAL_KINDS

    failure = classify_pod(PodFacts("p", 0, "Failed", exit_code=5))
    assert failure is not None and failure.kind == "StoragePermissionDenied"
    assert failure.kind in TERMINAL_KINDS and not counts_against_budget(
        failure.kind, RestartSpec(count_preemptions=True)
    )


def test_a_distributed_start_up_failure_is_restarted_quickly_and_never_counted():
    """Exit 6: process 0 found its JAX coordinator address served by another process (issue 17, item 14)."""
    from tpujob_operator.restarts import TERMINAL_KINDS

    policy = RestartSpec(backoff_seconds=10, max_backoff_seconds=600)
    failure = classify_pod(PodFacts("p", 0, "Failed", exit_code=6))
    assert failure is not None and (failure.kind, failure.reason) == ("StartupFailure", "DistributedStartupFailed")
    assert failure.kind not in TERMINAL_KINDS and not counts_against_budget(failure.kind, policy)
    assert backoff(policy, 5, counts_against_budget(failure.kind, policy)).total_seconds() == 10


def test_jax_waits_for_peers_as_long_as_the_scheduling_and_start_up_clocks_allow():
    from tpujob_operator.jobset import DISTRIBUTED_INIT_MARGIN_SECONDS, distributed_init_timeout

    bounded = RestartSpec(scheduling_timeout_seconds=1800, startup_timeout_seconds=3600)
    assert distributed_init_timeout(bounded) == 1800 + 3600 + DISTRIBUTED_INIT_MARGIN_SECONDS
    assert distributed_init_timeout(RestartSpec()) == 0  # schedulingTimeoutSeconds 0: capacity is waited for ever
    assert distributed_init_timeout(RestartSpec(scheduling_timeout_seconds=60, startup_timeout_seconds=0)) == 0
