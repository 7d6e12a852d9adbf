"""The multi-tenant policy (pure): which TrainingJobs the operator refuses to act for, and why."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

import pytest
from tpujob_contract import LABEL_UID
from tpujob_operator import policy
from tpujob_operator.facts import Actions
from tpujob_operator.jobset import build_jobset, workload_priority_class
from tpujob_operator.policy import Policy, violations

from .factories import training_job

OPERATOR = Policy(
    operator_namespace="tpujob-system", operator_service_account="tpujob", service_accounts=("trainer", "tpujob")
)


def job_in(namespace: str, **spec):
    tj = training_job(**spec)
    tj.metadata["namespace"] = namespace
    return tj


def test_a_plain_job_breaks_nothing_under_the_defaults():
    assert violations(training_job(), Policy()) == []
    assert violations(training_job(serviceAccountName="default"), Policy()) == []  # the same as unset
    assert violations(training_job(serviceAccountName="trainer"), OPERATOR) == []


def test_the_operators_own_service_account_is_refused_by_name():
    tj = job_in("tpujob-system", serviceAccountName="tpujob")
    assert violations(tj, OPERATOR) == [
        "spec.serviceAccountName must not be the operator's own ServiceAccount (tpujob-system/tpujob)"
    ]


def test_no_service_account_of_the_operators_namespace_may_be_named():
    tj = job_in("tpujob-system", serviceAccountName="default")
    assert violations(tj, OPERATOR) == [
        "spec.serviceAccountName must not be set in the operator's namespace (tpujob-system)"
    ]
    # The same name elsewhere is another namespace's account: allowed.
    assert violations(job_in("ml", serviceAccountName="tpujob"), OPERATOR) == []
    # Without a serviceAccountName a job in the operator's namespace runs as that namespace's default, tokenless.
    assert violations(job_in("tpujob-system"), OPERATOR) == []


def test_only_listed_service_accounts_are_allowed_and_none_by_default():
    """Issue 17 item 11: a tenant cannot run its workers as any account of the namespace."""
    assert violations(training_job(serviceAccountName="trainer"), Policy()) == [
        "spec.serviceAccountName trainer is not allowed (policy.allowedServiceAccounts: none); "
        "leave it unset to run as the namespace's default"
    ]
    listed = Policy(service_accounts=("trainer", "reader"))
    assert violations(training_job(serviceAccountName="trainer"), listed) == []
    assert violations(training_job(serviceAccountName="ci-deployer"), listed) == [
        policy.ACCOUNT_FORBIDDEN_MESSAGE.format(name="ci-deployer", allowed="trainer, reader")
    ]
    assert violations(training_job(serviceAccountName="ci-deployer"), Policy(service_accounts=("*",))) == []
    # "*" never opens the operator's namespace.
    anything = Policy(service_accounts=("*",), operator_namespace="tpujob-system")
    assert violations(job_in("tpujob-system", serviceAccountName="x"), anything) == [
        policy.OPERATOR_NAMESPACE_MESSAGE.format(namespace="tpujob-system")
    ]


def test_only_listed_priority_classes_are_allowed_and_none_by_default():
    """Issue 17 item 11: a tenant cannot preempt the others with a PriorityClass of its choosing."""
    assert violations(training_job(priorityClassName="system-cluster-critical"), Policy()) == [
        "spec.priorityClassName system-cluster-critical is not allowed (policy.allowedPriorityClasses: none)"
    ]
    listed = Policy(priority_classes=("batch-low", "batch-high"))
    assert violations(training_job(priorityClassName="batch-low"), listed) == []
    assert violations(training_job(priorityClassName="batch-urgent"), listed) == [
        policy.PRIORITY_FORBIDDEN_MESSAGE.format(name="batch-urgent", allowed="batch-low, batch-high")
    ]
    assert violations(training_job(priorityClassName="anything"), Policy(priority_classes=("*",))) == []
    assert violations(training_job(), Policy()) == []


def _labelled(priority: str, **spec: Any):
    tj = training_job(**spec)
    tj.metadata["labels"] = {"kueue.x-k8s.io/queue-name": "tpu", "kueue.x-k8s.io/priority-class": priority}
    return tj


def test_the_kueue_priority_label_is_held_to_the_same_list_and_named():
    """Issue 30 defect 4: the WorkloadPriorityClass label, which Kueue ranks preemption by, was copied to
    the JobSet unchecked: a tenant labelled its job `high` and preempted the others."""
    assert violations(_labelled("high"), Policy()) == [
        "label kueue.x-k8s.io/priority-class high is not allowed (policy.allowedPriorityClasses: none)"
    ]
    listed = Policy(priority_classes=("low", "batch-low"))
    assert violations(_labelled("low"), listed) == []
    assert violations(_labelled("high"), listed) == [
        policy.WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE.format(name="high", allowed="low, batch-low")
    ]
    assert violations(_labelled("high"), Policy(priority_classes=("*",))) == []
    # The field and the label are checked each on its own: an allowed field does not carry the label.
    assert violations(_labelled("high", priorityClassName="batch-low"), listed) == [
        policy.WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE.format(name="high", allowed="low, batch-low")
    ]
    # Without a queue label too: kueue.defaultQueueName queues an unlabelled job.
    unqueued = training_job()
    unqueued.metadata["labels"] = {"kueue.x-k8s.io/priority-class": "high"}
    assert violations(unqueued, Policy()) == [
        policy.WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE.format(name="high", allowed="none")
    ]
    # Other labels are none of the policy's business.
    other = training_job()
    other.metadata["labels"] = {"team": "high"}
    assert violations(other, Policy()) == []


def test_the_label_the_policy_checks_is_the_one_the_jobset_carries():
    tj = _labelled("low")
    built = build_jobset(tj, 0, None, "tpu")
    assert built["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == workload_priority_class(tj) == "low"


def test_a_running_job_relabelled_outside_the_policy_is_warned_and_never_restarted_with_it():
    """A label changed while an attempt runs cannot reach its JobSet (set at creation, never relabelled);
    the next attempt, which would carry it, is refused instead of created."""
    tj = _labelled("high", status={"phase": "Running", "attempt": 0})
    problems = violations(tj, Policy(priority_classes=("low",)))
    assert problems == [policy.WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE.format(name="high", allowed="low")]
    decided = policy.while_running(tj, tj.status, Actions(), problems, NOW)
    assert decided is not None
    [condition] = [c for c in decided[0].conditions if c.type == "PolicyViolation"]
    assert condition.status == "True" and "label kueue.x-k8s.io/priority-class high" in condition.message
    assert policy.while_running(tj, tj.status, Actions(create_attempt=1), problems, NOW) is None


def test_the_watch_reconciles_a_forbidden_priority_label_until_the_status_warns_of_it():
    """A label change makes no new generation, which alone triggered a reconcile: a job relabelled `high`
    waited for its next check (for a Pending job, none) before the policy applied."""
    label = {"kueue.x-k8s.io/priority-class": "high"}
    warning = [{"type": "PolicyViolation", "status": "True"}]
    assert policy.unheeded_priority_label(label, [], Policy())
    assert not policy.unheeded_priority_label(label, warning, Policy())  # decided on already: no loop
    assert not policy.unheeded_priority_label(label, [], Policy(priority_classes=("high",)))
    assert not policy.unheeded_priority_label({"team": "high"}, [], Policy())


@pytest.mark.parametrize(
    ("directory", "allowed"),
    [
        ("gs://acme-ckpt", True),
        ("gs://acme-ckpt/", True),
        ("gs://acme-ckpt/anything/below", True),
        ("gs://team-a/runs", True),
        ("gs://team-a/runs/", True),
        ("gs://team-a/runs/llama", True),
        ("gs://team-a/runs2", False),  # a prefix matches whole path segments only
        ("gs://team-a", False),
        ("gs://team-a/other", False),
        ("gs://acme-ckpt-2/runs", False),  # nor is a bucket a prefix of another bucket
        ("gs://elsewhere/runs", False),
    ],
)
def test_checkpoint_directory_must_lie_in_an_allowed_location(directory, allowed):
    rules = Policy(checkpoint_locations=("gs://acme-ckpt", "gs://team-a/runs"))
    found = violations(training_job(checkpoint={"directory": directory}), rules)
    if allowed:
        assert found == []
    else:
        assert found == [
            f"spec.checkpoint.directory {directory} is outside the allowed checkpoint locations "
            "(policy.allowedCheckpointLocations): gs://acme-ckpt, gs://team-a/runs"
        ]


def test_no_location_listed_allows_any():
    assert violations(training_job(checkpoint={"directory": "gs://whatever/x"}), Policy()) == []


def test_secret_key_refs_are_refused_unless_allowed_and_named():
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        {"name": "PLAIN", "value": "1"},
    ]
    tj = training_job(env=env)
    assert violations(tj, Policy()) == [
        "spec.env[].valueFrom.secretKeyRef is not allowed (policy.allowSecretKeyRef is false): TOKEN, KEY"
    ]
    assert violations(tj, Policy(secret_key_ref_allowed=True)) == []
    assert violations(training_job(env=env[1:3] + env[4:]), Policy()) == []


def test_every_broken_rule_is_reported():
    tj = job_in(
        "tpujob-system",
        serviceAccountName="tpujob",
        checkpoint={"directory": "gs://elsewhere/x"},
        env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    )
    rules = Policy(
        checkpoint_locations=("gs://acme-ckpt",), operator_namespace="tpujob-system", operator_service_account="tpujob"
    )
    assert [m.split(" ")[0] for m in violations(tj, rules)] == [
        "spec.serviceAccountName",
        "spec.checkpoint.directory",
        "spec.env[].valueFrom.secretKeyRef",
    ]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    policy.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_build_the_policy_and_default_to_the_charts_defaults():
    assert policy.from_arguments(_parse(), environ={}) == Policy()
    assert policy.from_arguments(_parse(), environ={"POD_NAMESPACE": "ops"}).operator_namespace == "ops"
    built = policy.from_arguments(
        _parse(
            "--allowed-checkpoint-location=gs://a/",
            "--allowed-checkpoint-location=gs://b/runs",
            "--allowed-service-account=trainer",
            "--allowed-service-account=reader",
            "--allowed-priority-class=batch-low",
            "--allow-secret-key-ref",
            "--operator-namespace=tpujob-system",
            "--operator-service-account=tpujob",
        ),
        environ={"POD_NAMESPACE": "ignored"},
    )
    assert built == Policy(
        checkpoint_locations=("gs://a", "gs://b/runs"),
        service_accounts=("trainer", "reader"),
        priority_classes=("batch-low",),
        secret_key_ref_allowed=True,
        operator_namespace="tpujob-system",
        operator_service_account="tpujob",
    )


@pytest.mark.parametrize("location", ["s3://a", "gs://", "a/b", "gs:///x"])
def test_a_malformed_location_is_refused(location):
    with pytest.raises(ValueError, match="gs://bucket"):
        policy.normalise_location(location)


# Issue 17 item 7: a policy tightened while a job runs never stops it unsaved.


def _jobset(name: str, uid: str = "0000-1111", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {LABEL_UID: uid}}, "spec": spec}


def test_a_running_attempt_is_the_live_unsuspended_jobset_of_this_job():
    tj = training_job()
    assert policy.running_attempt(tj, [_jobset("llama-a0")]) == "llama-a0"
    assert policy.running_attempt(tj, []) is None
    assert policy.running_attempt(tj, [_jobset("llama-a0", suspend=True)]) is None  # queued or suspended
    assert policy.running_attempt(tj, [_jobset("llama-a0", uid="another-incarnation")]) is None
    deleting = _jobset("llama-a0")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert policy.running_attempt(tj, [deleting]) is None


NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_running_job_outside_the_policy_goes_on_with_a_warning_once():
    tj = training_job(status={"phase": "Running", "attempt": 0})
    problems = ["spec.priorityClassName x is not allowed (policy.allowedPriorityClasses: none)"]
    decided = policy.while_running(tj, tj.status, Actions(), problems, NOW)
    assert decided is not None
    status, actions = decided
    [condition] = [c for c in status.conditions if c.type == "PolicyViolation"]
    assert (condition.status, condition.reason) == ("True", "PolicyViolation")
    assert condition.message == policy.RUNNING_MESSAGE.format(problems=problems[0])
    assert [(e.type, e.reason, e.message) for e in actions.events] == [
        ("Warning", "PolicyViolation", condition.message)
    ]
    # The next reconcile keeps the condition and posts no second Event.
    again = training_job(status=status.model_dump(by_alias=True, exclude_none=True, mode="json"))
    decided = policy.while_running(again, again.status, Actions(), problems, NOW)
    assert decided is not None and decided[1].events == []
    # Back within the policy (loosened, or the spec fixed): the condition turns False.
    decided = policy.while_running(again, again.status, Actions(), [], NOW)
    assert decided is not None
    [condition] = [c for c in decided[0].conditions if c.type == "PolicyViolation"]
    assert condition.status == "False" and decided[1].events == []


def test_a_job_outside_the_policy_is_never_restarted():
    tj = training_job(status={"phase": "Running", "attempt": 0})
    assert policy.while_running(tj, tj.status, Actions(create_attempt=1), ["x"], NOW) is None
    # Within the policy nothing changes: the decision stands as it is.
    decided = policy.while_running(tj, tj.status, Actions(create_attempt=1), [], NOW)
    assert decided is not None and decided[1].create_attempt == 1 and decided[0] == tj.status
