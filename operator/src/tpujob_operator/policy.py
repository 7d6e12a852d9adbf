"""Pure multi-tenant policy: what a TrainingJob may ask the operator to do on its author's behalf.

The operator creates pods in the job's namespace with its own rights and reads the job's GCS
directory with its own identity, so a job may not:
- checkpoint outside the allowed locations (`gs://bucket` or `gs://bucket/prefix`; none listed:
  any) -- else the operator would read, and report into the author's status, any bucket it can;
- run its workers as a ServiceAccount the policy does not list (`spec.serviceAccountName`; none
  listed: only the namespace's `default`), never one of the operator's namespace (the operator's own
  among them) -- else anyone who may create a TrainingJob could act as any account of the namespace;
- give its workers a PriorityClass the policy does not list (`spec.priorityClassName`; none listed:
  none) -- else any tenant could preempt the others' pods;
- name a Kueue WorkloadPriorityClass the same list does not list (the `kueue.x-k8s.io/priority-class`
  label, which the operator copies to the JobSet and Kueue ranks the job's admission and preemption by,
  over the PriorityClass) -- else a label would do what the field may not. One list for both kinds: the
  admin names the priorities tenants may use once (the kinds are distinct objects; a name listed allows
  either);
- read a Secret into the trainer's env (`env[].valueFrom.secretKeyRef`) unless allowed.

The chart installs the same rules as a ValidatingAdmissionPolicy (templates/admissionpolicy.yaml),
with the same messages; the operator checks them again before it creates or reads anything, for a
job that got past admission (the policy not installed, or tightened after the job was created).

A policy tightened while a job runs (`helm upgrade`) never stops its workers: the attempt already
running (its JobSet exists and is not suspended) goes on, with a `PolicyViolation` condition and a
Warning Event, and the job ends Failed/PolicyViolation instead of starting another attempt outside the
policy. A job with no running attempt is refused at once (`running_attempt`, `while_running`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from tpujob_contract import PRIORITY_CLASS_LABEL

from .api import TrainingJob, TrainingJobStatus
from .facts import Actions, Event
from .jobset import incarnation_uid, workload_priority_class
from .status import set_condition

REASON = "PolicyViolation"
GS = "gs://"

# The messages, with {placeholders}; the ValidatingAdmissionPolicy builds the same text in CEL.
OPERATOR_ACCOUNT_MESSAGE = "spec.serviceAccountName must not be the operator's own ServiceAccount ({namespace}/{name})"
OPERATOR_NAMESPACE_MESSAGE = "spec.serviceAccountName must not be set in the operator's namespace ({namespace})"
ACCOUNT_FORBIDDEN_MESSAGE = (
    "spec.serviceAccountName {name} is not allowed (policy.allowedServiceAccounts: {allowed}); "
    "leave it unset to run as the namespace's default"
)
PRIORITY_FORBIDDEN_MESSAGE = "spec.priorityClassName {name} is not allowed (policy.allowedPriorityClasses: {allowed})"
WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE = (
    f"label {PRIORITY_CLASS_LABEL} {{name}} is not allowed (policy.allowedPriorityClasses: {{allowed}})"
)
RUNNING_MESSAGE = (
    "the policy changed while the job runs: its current attempt goes on, but the job ends Failed instead of "
    "restarting: {problems}"
)
ANY = "*"  # in an allow-list: any name
NONE_LISTED = "none"
DEFAULT_ACCOUNT = "default"
LOCATION_MESSAGE = (
    "spec.checkpoint.directory {directory} is outside the allowed checkpoint locations "
    "(policy.allowedCheckpointLocations): {allowed}"
)
SECRET_MESSAGE = "spec.env[].valueFrom.secretKeyRef is not allowed (policy.allowSecretKeyRef is false): {names}"


@dataclass(frozen=True)
class Policy:
    """The chart's `policy` values, as the operator receives them (flags, see `add_arguments`)."""

    # gs://bucket or gs://bucket/prefix, no trailing slash; empty: any location.
    checkpoint_locations: tuple[str, ...] = ()
    # ServiceAccount and PriorityClass names a job may set ("*": any); the defaults allow neither
    # (the namespace's default account, no PriorityClass). The priority names hold for the
    # kueue.x-k8s.io/priority-class label (a WorkloadPriorityClass) too.
    service_accounts: tuple[str, ...] = ()
    priority_classes: tuple[str, ...] = ()
    secret_key_ref_allowed: bool = False
    # Where the operator runs and as whom (unknown outside a pod: then no namespace rule applies).
    operator_namespace: str | None = None
    operator_service_account: str | None = None


def normalise_location(location: str) -> str:
    """gs://bucket[/prefix] without a trailing slash; anything else is refused."""
    stripped = location.strip().rstrip("/")
    bucket = stripped.removeprefix(GS).split("/", 1)[0]
    if not stripped.startswith(GS) or not bucket:
        raise ValueError(f"checkpoint location must be gs://bucket or gs://bucket/prefix, not {location!r}")
    return stripped


def location_allowed(directory: str, locations: tuple[str, ...]) -> bool:
    """The directory is a location or lies under one, on whole path segments (gs://b/p, not gs://b/pq)."""
    return not locations or any((directory + "/").startswith(loc + "/") for loc in locations)


def listed(name: str, allowed: tuple[str, ...]) -> bool:
    return ANY in allowed or name in allowed


def _names(allowed: tuple[str, ...]) -> str:
    return ", ".join(allowed) or NONE_LISTED


def violations(tj: TrainingJob, policy: Policy) -> list[str]:
    """Every rule the job breaks, each message naming the field and the rule (empty: allowed)."""
    found: list[str] = []
    spec = tj.spec
    account = spec.service_account_name
    in_operator_namespace = policy.operator_namespace is not None and tj.namespace == policy.operator_namespace
    if account and in_operator_namespace and account == policy.operator_service_account:
        found.append(OPERATOR_ACCOUNT_MESSAGE.format(namespace=policy.operator_namespace, name=account))
    elif account and in_operator_namespace:
        found.append(OPERATOR_NAMESPACE_MESSAGE.format(namespace=policy.operator_namespace))
    elif account and account != DEFAULT_ACCOUNT and not listed(account, policy.service_accounts):
        found.append(ACCOUNT_FORBIDDEN_MESSAGE.format(name=account, allowed=_names(policy.service_accounts)))
    priority = spec.priority_class_name
    if priority and not listed(priority, policy.priority_classes):
        found.append(PRIORITY_FORBIDDEN_MESSAGE.format(name=priority, allowed=_names(policy.priority_classes)))
    # Checked with or without a queue: kueue.defaultQueueName queues an unlabelled job too.
    if (label := _priority_label_problem(workload_priority_class(tj), policy)) is not None:
        found.append(label)
    if not location_allowed(spec.checkpoint.directory, policy.checkpoint_locations):
        allowed = ", ".join(policy.checkpoint_locations)
        found.append(LOCATION_MESSAGE.format(directory=spec.checkpoint.directory, allowed=allowed))
    secret_refs = [e.name for e in spec.env or [] if e.value_from is not None and "secretKeyRef" in e.value_from]
    if secret_refs and not policy.secret_key_ref_allowed:
        found.append(SECRET_MESSAGE.format(names=", ".join(secret_refs)))
    return found


def _priority_label_problem(name: str | None, policy: Policy) -> str | None:
    if not name or listed(name, policy.priority_classes):
        return None
    return WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE.format(name=name, allowed=_names(policy.priority_classes))


def unheeded_priority_label(labels: Mapping[str, str], conditions: Sequence[Mapping[str, Any]], policy: Policy) -> bool:
    """Whether the job's Kueue priority label is outside the policy while its status warns of no violation:
    a label change makes no new generation, so the watch asks for a reconcile on this instead."""
    warned = any(c.get("type") == REASON and c.get("status") == "True" for c in conditions)
    return not warned and _priority_label_problem(labels.get(PRIORITY_CLASS_LABEL), policy) is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-tenant policy (the chart's `policy` values)")
    group.add_argument(
        "--allowed-checkpoint-location",
        action="append",
        default=[],
        metavar="gs://BUCKET[/PREFIX]",
        help="a location TrainingJobs may checkpoint under (repeat; none: any)",
    )
    group.add_argument(
        "--allowed-service-account",
        action="append",
        default=[],
        metavar="NAME",
        help="a ServiceAccount spec.serviceAccountName may name (repeat; '*': any; none: only the namespace's "
        "default; never one in the operator's namespace)",
    )
    group.add_argument(
        "--allowed-priority-class",
        action="append",
        default=[],
        metavar="NAME",
        help="a PriorityClass spec.priorityClassName, or a Kueue WorkloadPriorityClass the "
        "kueue.x-k8s.io/priority-class label, may name (repeat; '*': any; none: none)",
    )
    group.add_argument(
        "--allow-secret-key-ref",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="whether spec.env[].valueFrom.secretKeyRef is allowed",
    )
    group.add_argument("--operator-namespace", help="the operator's namespace (default: POD_NAMESPACE)")
    group.add_argument("--operator-service-account", help="the operator's ServiceAccount name")


def from_arguments(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Policy:
    """The policy the flags describe; raises ValueError on a malformed location."""
    return Policy(
        checkpoint_locations=tuple(normalise_location(loc) for loc in args.allowed_checkpoint_location),
        service_accounts=tuple(args.allowed_service_account),
        priority_classes=tuple(args.allowed_priority_class),
        secret_key_ref_allowed=args.allow_secret_key_ref,
        operator_namespace=args.operator_namespace or environ.get("POD_NAMESPACE") or None,
        operator_service_account=args.operator_service_account or None,
    )


def running_attempt(tj: TrainingJob, jobsets: Sequence[dict[str, Any]]) -> str | None:
    """The JobSet of this job whose workers may be running (not suspended, not being deleted), if any:
    a policy tightened after it started lets it finish instead of stopping it unsaved."""
    uid = tj.metadata.get("uid")
    for js in jobsets:
        meta, spec = js["metadata"], js.get("spec") or {}
        if incarnation_uid(js) == uid and not meta.get("deletionTimestamp") and not spec.get("suspend"):
            return str(meta["name"])
    return None


def with_warning(status: TrainingJobStatus, problems: list[str], now: datetime) -> TrainingJobStatus:
    """The PolicyViolation condition of a running job that breaks the policy (True, the rules named);
    False again once nothing is broken (a condition that was never set stays absent)."""
    present = any(c.type == REASON for c in status.conditions)
    if not problems and not present:
        return status
    message = RUNNING_MESSAGE.format(problems="; ".join(problems)) if problems else "the job is within the policy"
    conditions = set_condition(list(status.conditions), REASON, bool(problems), REASON if problems else "Allowed",
                               message, now)  # fmt: skip
    return status.model_copy(update={"conditions": conditions})


def _warning(status: TrainingJobStatus) -> str | None:
    return next((c.message for c in status.conditions if c.type == REASON and c.status == "True"), None)


def while_running(
    tj: TrainingJob, status: TrainingJobStatus, actions: Actions, problems: list[str], now: datetime
) -> tuple[TrainingJobStatus, Actions] | None:
    """A reconcile's decision for a job whose attempt runs while it breaks the policy: the warning
    (condition, and an Event when it is new); None when the decision starts another attempt, which the
    policy refuses (the job ends Failed/PolicyViolation instead)."""
    if problems and actions.create_attempt is not None:
        return None
    warned = with_warning(status, problems, now)
    message = _warning(warned)
    if message is None or message == _warning(tj.status):
        return warned, actions
    return warned, replace(actions, events=[*actions.events, Event("Warning", REASON, message)])
