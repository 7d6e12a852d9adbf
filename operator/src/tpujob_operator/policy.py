"""Pure multi-tenant policy: what a TrainingJob may ask the operator to do on its author's behalf.

The operator creates pods in the job's namespace with its own rights and reads the job's GCS
directory with its own identity, so a job may not:
- checkpoint outside the allowed locations (`gs://bucket` or `gs://bucket/prefix`; none listed:
  any) -- else the operator would read, and report into the author's status, any bucket it can;
- run its workers as a ServiceAccount of the operator's namespace (the operator's own among
  them), or set `spec.serviceAccountName` at all when the policy says so;
- read a Secret into the trainer's env (`env[].valueFrom.secretKeyRef`) unless allowed.

The chart installs the same rules as a ValidatingAdmissionPolicy (templates/admissionpolicy.yaml),
with the same messages; the operator checks them again before it creates or reads anything, for a
job that got past admission (the policy not installed, or tightened after the job was created).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .api import TrainingJob

REASON = "PolicyViolation"
GS = "gs://"

# The messages, with {placeholders}; the ValidatingAdmissionPolicy builds the same text in CEL.
OPERATOR_ACCOUNT_MESSAGE = "spec.serviceAccountName must not be the operator's own ServiceAccount ({namespace}/{name})"
OPERATOR_NAMESPACE_MESSAGE = "spec.serviceAccountName must not be set in the operator's namespace ({namespace})"
ACCOUNT_FORBIDDEN_MESSAGE = "spec.serviceAccountName must not be set (policy.allowServiceAccountName is false)"
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
    service_account_name_allowed: bool = True
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
    elif account and not policy.service_account_name_allowed:
        found.append(ACCOUNT_FORBIDDEN_MESSAGE)
    if not location_allowed(spec.checkpoint.directory, policy.checkpoint_locations):
        allowed = ", ".join(policy.checkpoint_locations)
        found.append(LOCATION_MESSAGE.format(directory=spec.checkpoint.directory, allowed=allowed))
    secret_refs = [e.name for e in spec.env or [] if e.value_from is not None and "secretKeyRef" in e.value_from]
    if secret_refs and not policy.secret_key_ref_allowed:
        found.append(SECRET_MESSAGE.format(names=", ".join(secret_refs)))
    return found


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
        "--allow-service-account-name",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="whether spec.serviceAccountName may be set (never in the operator's namespace)",
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
        service_account_name_allowed=args.allow_service_account_name,
        secret_key_ref_allowed=args.allow_secret_key_ref,
        operator_namespace=args.operator_namespace or environ.get("POD_NAMESPACE") or None,
        operator_service_account=args.operator_service_account or None,
    )
