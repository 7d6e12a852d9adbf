"""The multi-tenant policy (pure): which TrainingJobs the operator refuses to act for, and why."""

from __future__ import annotations

import argparse

import pytest
from tpujob_operator import policy
from tpujob_operator.policy import Policy, violations

from .factories import training_job

OPERATOR = Policy(operator_namespace="tpujob-system", operator_service_account="tpujob")


def job_in(namespace: str, **spec):
    tj = training_job(**spec)
    tj.metadata["namespace"] = namespace
    return tj


def test_a_plain_job_breaks_nothing_under_the_defaults():
    assert violations(training_job(), Policy()) == []
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


def test_service_account_name_can_be_forbidden_everywhere():
    strict = Policy(service_account_name_allowed=False)
    assert violations(training_job(serviceAccountName="trainer"), strict) == [policy.ACCOUNT_FORBIDDEN_MESSAGE]
    assert violations(training_job(), strict) == []


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
            "--no-allow-service-account-name",
            "--allow-secret-key-ref",
            "--operator-namespace=tpujob-system",
            "--operator-service-account=tpujob",
        ),
        environ={"POD_NAMESPACE": "ignored"},
    )
    assert built == Policy(
        checkpoint_locations=("gs://a", "gs://b/runs"),
        service_account_name_allowed=False,
        secret_key_ref_allowed=True,
        operator_namespace="tpujob-system",
        operator_service_account="tpujob",
    )


@pytest.mark.parametrize("location", ["s3://a", "gs://", "a/b", "gs:///x"])
def test_a_malformed_location_is_refused(location):
    with pytest.raises(ValueError, match="gs://bucket"):
        policy.normalise_location(location)
