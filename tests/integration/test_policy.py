"""Multi-tenant policy on the real apiserver: the chart's ValidatingAdmissionPolicy refuses a
TrainingJob that breaks it, with the rule named, also for a person bound to the chart's user role;
without the admission policy the operator refuses it (Failed/PolicyViolation, an Event, no JobSet,
its checkpoint directory never read); a policy tightened while a job runs lets its attempt finish."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tpujob_contract import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, PRIORITY_CLASS_LABEL
from tpujob_devcluster.controlplane import tools_dir
from tpujob_operator import api, policy
from tpujob_operator.runtime import RuntimeSettings

from ..conftest import TEST_BUCKET
from .conftest import eventually, training_job_manifest
from .test_operator import Cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "tpujob"
ALLOWED = f"gs://{TEST_BUCKET}/runs"
_IN = {"directory": ALLOWED}
SECRET_ENV = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]


def _labelled(name: str, priority: str, **spec: Any) -> dict[str, Any]:
    """A job that names a Kueue WorkloadPriorityClass (the label the operator copies to its JobSets)."""
    manifest = training_job_manifest(name, checkpoint=_IN, **spec)
    manifest["metadata"]["labels"] = {PRIORITY_CLASS_LABEL: priority}
    return manifest


def helm(control_plane: Any, *args: str) -> None:
    result = subprocess.run(
        [str(tools_dir() / "helm"), *args, "--kubeconfig", str(control_plane.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


@pytest.fixture
def team(kube: client.ApiClient, unique_name: str) -> Iterator[str]:
    """A second namespace: a team's, watched by the same release."""
    name = f"{unique_name}-team"
    core = client.CoreV1Api(kube)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


@pytest.fixture
def release(control_plane, namespace: str, team: str) -> Iterator[str]:
    """The chart installed in `namespace` (the operator's), watching it and the team's, bucket allowlisted."""
    helm(
        control_plane, "install", "tpujob", str(CHART), "--namespace", namespace, "--skip-crds",
        "--set", f"watchNamespaces={{{namespace},{team}}}",
        "--set", f"policy.allowedCheckpointLocations={{{ALLOWED}}}",
        "--set", "policy.allowedServiceAccounts={trainer}", "--set", "policy.allowedPriorityClasses={batch-low}",
    )  # fmt: skip
    yield namespace
    helm(control_plane, "uninstall", "tpujob", "--namespace", namespace)


def _create(kube: client.ApiClient, namespace: str, manifest: dict[str, Any]) -> ApiException | None:
    try:
        client.CustomObjectsApi(kube).create_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, manifest
        )
    except ApiException as error:
        return error
    return None


def _refusal(kube: client.ApiClient, namespace: str, manifest: dict[str, Any]) -> str:
    """The apiserver's message refusing `manifest` (once the policy is in force: it syncs in the background)."""

    def refused() -> list[ApiException]:
        error = _create(kube, namespace, manifest)
        if error is None:  # not yet in force: remove what got through and try again
            client.CustomObjectsApi(kube).delete_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, manifest["metadata"]["name"]
            )
        return [error] if error else []  # (eventually() takes an exception for "not yet")

    [error] = eventually(refused, timeout=30, what="the admission policy to refuse")
    assert error.status == 403, error.body
    return str(json.loads(str(error.body))["message"])


def test_the_admission_policy_refuses_each_rule_with_its_message(kube, release, team, unique_name):
    operator_account = training_job_manifest(f"{unique_name}-a", serviceAccountName="tpujob")
    message = _refusal(kube, release, operator_account)
    assert "ValidatingAdmissionPolicy 'tpujob-policy'" in message
    assert message.endswith(policy.OPERATOR_ACCOUNT_MESSAGE.format(namespace=release, name="tpujob"))
    other_account = training_job_manifest(f"{unique_name}-b", serviceAccountName="default")
    assert _refusal(kube, release, other_account).endswith(policy.OPERATOR_NAMESPACE_MESSAGE.format(namespace=release))
    elsewhere = training_job_manifest(f"{unique_name}-c", checkpoint={"directory": "gs://someone-elses/runs"})
    assert _refusal(kube, team, elsewhere).endswith(
        policy.LOCATION_MESSAGE.format(directory="gs://someone-elses/runs", allowed=ALLOWED)
    )
    sibling = training_job_manifest(f"{unique_name}-d", checkpoint={"directory": f"{ALLOWED}2"})  # not a segment
    assert "outside the allowed checkpoint locations" in _refusal(kube, team, sibling)
    secret = training_job_manifest(f"{unique_name}-e", checkpoint={"directory": ALLOWED}, env=SECRET_ENV)
    assert _refusal(kube, team, secret).endswith(policy.SECRET_MESSAGE.format(names="HF_TOKEN"))
    # Issue 17 item 11: only the listed ServiceAccounts and PriorityClasses.
    unlisted = training_job_manifest(f"{unique_name}-f", serviceAccountName="ci-deployer", checkpoint=_IN)
    assert _refusal(kube, team, unlisted).endswith(
        policy.ACCOUNT_FORBIDDEN_MESSAGE.format(name="ci-deployer", allowed="trainer")
    )
    urgent = training_job_manifest(f"{unique_name}-g", priorityClassName="system-cluster-critical", checkpoint=_IN)
    assert _refusal(kube, team, urgent).endswith(
        policy.PRIORITY_FORBIDDEN_MESSAGE.format(name="system-cluster-critical", allowed="batch-low")
    )

    # What the policy allows goes through: the listed account and class, under the allowed prefix.
    allowed = training_job_manifest(
        f"{unique_name}-ok",
        serviceAccountName="trainer",
        priorityClassName="batch-low",
        checkpoint={"directory": f"{ALLOWED}/llama/"},
    )
    assert _create(kube, team, allowed) is None
    # ... and a spec change that breaks it is refused too; a label change is not (the spec is unchanged).
    custom = client.CustomObjectsApi(kube)
    with pytest.raises(ApiException) as patched:
        custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, team, api.PLURAL, f"{unique_name}-ok", {"spec": {"env": SECRET_ENV}}
        )
    assert policy.SECRET_MESSAGE.format(names="HF_TOKEN") in json.loads(patched.value.body)["message"]
    custom.patch_namespaced_custom_object(
        api.GROUP, api.VERSION, team, api.PLURAL, f"{unique_name}-ok", {"metadata": {"labels": {"a": "b"}}}
    )


def test_the_admission_policy_holds_the_kueue_priority_label_to_the_list_also_on_a_label_only_update(
    kube, release, team, unique_name
):
    """Issue 30 defect 4: the kueue.x-k8s.io/priority-class label (a WorkloadPriorityClass, which Kueue
    ranks preemption by) went unchecked, and a label-only update skipped the policy (it matched spec
    changes only): a tenant labelled its job `high` and preempted the others."""
    forbidden = policy.WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE.format(name="high", allowed="batch-low")
    assert _refusal(kube, team, _labelled(f"{unique_name}-high", "high")).endswith(forbidden)
    name = f"{unique_name}-low"
    assert _create(kube, team, _labelled(name, "batch-low")) is None
    custom = client.CustomObjectsApi(kube)

    def relabel(priority: str | None) -> Any:
        patch = {"metadata": {"labels": {PRIORITY_CLASS_LABEL: priority}}}
        return custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, team, api.PLURAL, name, patch)

    with pytest.raises(ApiException) as relabelled:
        relabel("high")
    assert relabelled.value.status == 403, relabelled.value.body
    assert json.loads(relabelled.value.body)["message"].endswith(forbidden)
    # Dropping the label, and labelling with a listed class, go through.
    assert PRIORITY_CLASS_LABEL not in relabel(None)["metadata"].get("labels", {})
    assert relabel("batch-low")["metadata"]["labels"][PRIORITY_CLASS_LABEL] == "batch-low"


def test_default_values_refuse_any_service_account_and_secret_refs_can_be_allowed(control_plane, kube, namespace, team):
    install = (
        "install", "tpujob", str(CHART), "--namespace", namespace, "--skip-crds",
        "--set", f"watchNamespaces={{{team}}}",
        "--set", "policy.allowSecretKeyRef=true",
    )  # fmt: skip
    helm(control_plane, *install)
    try:
        # The apiserver compiled every expression without a type-checking warning.
        adm = client.AdmissionregistrationV1Api(kube)
        checked = eventually(
            lambda: adm.read_validating_admission_policy("tpujob-policy").status.type_checking, what="type checking"
        )
        assert not checked.expression_warnings
        named = training_job_manifest("named", serviceAccountName="trainer")
        assert _refusal(kube, team, named).endswith(
            policy.ACCOUNT_FORBIDDEN_MESSAGE.format(name="trainer", allowed="none")
        )
        classed = training_job_manifest("classed", priorityClassName="batch-low")
        assert _refusal(kube, team, classed).endswith(
            policy.PRIORITY_FORBIDDEN_MESSAGE.format(name="batch-low", allowed="none")
        )
        # The namespace's default account is what an unset name means: allowed.
        assert _create(kube, team, training_job_manifest("plain", serviceAccountName="default")) is None
        # No location listed (the default): any bucket; secret refs allowed by these values.
        anywhere = training_job_manifest("secret", checkpoint={"directory": "gs://any-bucket/x"}, env=SECRET_ENV)
        assert _create(kube, team, anywhere) is None
        # The binding covers only the watched namespaces: the release's own is another policy's business.
        assert _create(kube, namespace, training_job_manifest("unwatched", serviceAccountName="x")) is None
        # Uninstalled and installed again (the case a params ConfigMap would break): still in force.
        helm(control_plane, "uninstall", "tpujob", "--namespace", namespace)
        helm(control_plane, *install)
        again = training_job_manifest("again", serviceAccountName="trainer")
        assert _refusal(kube, team, again).endswith(
            policy.ACCOUNT_FORBIDDEN_MESSAGE.format(name="trainer", allowed="none")
        )
    finally:
        helm(control_plane, "uninstall", "tpujob", "--namespace", namespace)


def test_without_the_admission_policy_the_operator_refuses_and_reads_nothing(kube, start_operator, namespace):
    custom = client.CustomObjectsApi(kube)
    refusing = policy.Policy(
        checkpoint_locations=(ALLOWED,), operator_namespace=namespace, operator_service_account="tpujob"
    )
    start_operator(RuntimeSettings(policy=refusing), namespaces=[namespace])
    jobs = {
        "own-account": (
            training_job_manifest("own-account", serviceAccountName="tpujob"),
            policy.OPERATOR_ACCOUNT_MESSAGE.format(namespace=namespace, name="tpujob"),
        ),
        # A bucket the emulator does not have: reading it would put a storage error into the status.
        "elsewhere": (
            training_job_manifest("elsewhere", checkpoint={"directory": "gs://no-such-bucket/runs"}),
            policy.LOCATION_MESSAGE.format(directory="gs://no-such-bucket/runs", allowed=ALLOWED),
        ),
        "secret": (
            training_job_manifest("secret", checkpoint={"directory": ALLOWED}, env=SECRET_ENV),
            policy.SECRET_MESSAGE.format(names="HF_TOKEN"),
        ),
        "priority": (
            training_job_manifest("priority", checkpoint=_IN, priorityClassName="system-cluster-critical"),
            policy.PRIORITY_FORBIDDEN_MESSAGE.format(name="system-cluster-critical", allowed="none"),
        ),
        # Issue 30 defect 4: a Kueue priority label that got past admission.
        "kueue-priority": (
            _labelled("kueue-priority", "high"),
            policy.WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE.format(name="high", allowed="none"),
        ),
    }
    for manifest, _ in jobs.values():
        custom.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, manifest)
    for name, (_, message) in jobs.items():

        def failed(name: str = name) -> dict[str, Any] | None:
            body: Any = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
            status: dict[str, Any] = body.get("status") or {}
            return status if status.get("phase") == "Failed" else None

        status = eventually(failed, what=f"{name} to fail")
        [condition] = [c for c in status["conditions"] if c["type"] == "Failed"]
        assert (condition["reason"], condition["message"]) == ("PolicyViolation", message)
        assert "checkpointStorageError" not in status and "latestCheckpoint" not in status
        assert not any(c["type"] == "CheckpointStorageReachable" for c in status["conditions"])

        def events(name: str = name) -> list[tuple[str, str]]:
            found = client.CoreV1Api(kube).list_namespaced_event(
                namespace, field_selector=f"involvedObject.name={name}"
            )
            return [(str(e.reason), str(e.message)) for e in found.items]

        assert eventually(events, what=f"{name}'s Event") == [("PolicyViolation", message)]
    jobsets: Any = custom.list_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL)
    assert jobsets["items"] == []


def test_a_person_bound_to_the_charts_role_gets_only_what_the_admin_allowed(
    control_plane, kube, release, team, unique_name
):
    """Issue 17 item 11, through the whole chain: RBAC lets a tenant create TrainingJobs (the chart's
    <release>-edit role, bound in the team's namespace), and the admission policy then refuses what
    the admin did not list, on the tenant's own request (impersonated)."""
    client.RbacAuthorizationV1Api(kube).create_namespaced_role_binding(
        team,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="alice"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="tpujob-edit"),
            subjects=[client.RbacV1Subject(kind="User", name="alice", api_group="rbac.authorization.k8s.io")],
        ),
    )
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user="alice",
            resource_attributes=client.V1ResourceAttributes(
                namespace=team, verb="create", group=api.GROUP, resource=api.PLURAL
            ),
        )
    )

    def rbac_allows() -> bool:
        answer: Any = client.AuthorizationV1Api(kube).create_subject_access_review(review)
        return bool(answer.status.allowed)

    # The apiserver's RBAC authorizer reads bindings from an informer: a new one is seen a moment later.
    # Any refusal below is then the policy's, not RBAC's.
    eventually(rbac_allows, what="RBAC to allow alice to create TrainingJobs")
    alice = config.new_client_from_config(str(control_plane.kubeconfig))
    alice.set_default_header("Impersonate-User", "alice")
    as_pods_account = training_job_manifest(f"{unique_name}-sa", serviceAccountName="ci-deployer", checkpoint=_IN)
    assert _refusal(alice, team, as_pods_account).endswith(
        policy.ACCOUNT_FORBIDDEN_MESSAGE.format(name="ci-deployer", allowed="trainer")
    )
    preempting = training_job_manifest(f"{unique_name}-pc", priorityClassName="system-node-critical", checkpoint=_IN)
    assert _refusal(alice, team, preempting).endswith(
        policy.PRIORITY_FORBIDDEN_MESSAGE.format(name="system-node-critical", allowed="batch-low")
    )
    allowed = training_job_manifest(
        f"{unique_name}-ok", serviceAccountName="trainer", priorityClassName="batch-low", checkpoint=_IN
    )
    assert _create(alice, team, allowed) is None
    # ... and alice cannot edit her way around it.
    with pytest.raises(ApiException) as patched:
        client.CustomObjectsApi(alice).patch_namespaced_custom_object(
            api.GROUP,
            api.VERSION,
            team,
            api.PLURAL,
            f"{unique_name}-ok",
            {"spec": {"serviceAccountName": "ci-deployer"}},
        )
    assert patched.value.status == 403, patched.value.body


def test_a_tightened_policy_lets_the_running_attempt_finish_and_never_restarts_it(kube, start_operator, namespace):
    """Issue 17 item 7: `helm upgrade` tightens the policy while a job trains (before: Failed at once,
    its JobSet deleted with 5 s of grace, nothing saved). The attempt goes on with a PolicyViolation
    condition and Event; when it ends, the job is Failed/PolicyViolation instead of restarted."""
    cluster = Cluster(kube, namespace)
    before = start_operator(RuntimeSettings(policy=policy.Policy(checkpoint_locations=(ALLOWED,))), [namespace])
    cluster.apply(training_job_manifest("late", checkpoint=_IN))
    first = eventually(lambda: cluster.jobset("late-a0"), what="the first JobSet")

    # `helm upgrade` with a stricter policy: a new operator process, with the new flags.
    before.stop()
    tightened = f"gs://{TEST_BUCKET}/other"
    start_operator(RuntimeSettings(policy=policy.Policy(checkpoint_locations=(tightened,))), [namespace])  # outside
    problem = policy.LOCATION_MESSAGE.format(directory=ALLOWED, allowed=tightened)

    def warned() -> dict[str, Any] | None:
        status: dict[str, Any] = cluster.status("late")
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        return status if conditions.get("PolicyViolation", {}).get("status") == "True" else None

    status = eventually(warned, timeout=30, what="the PolicyViolation condition (before: Failed, JobSet deleted)")
    [condition] = [c for c in status["conditions"] if c["type"] == "PolicyViolation"]
    assert problem in condition["message"] and "its current attempt goes on" in condition["message"]
    assert status["phase"] != "Failed"
    assert cluster.all_jobsets() == ["late-a0"] and cluster.jobset("late-a0") is not None  # not being deleted
    eventually(lambda: "PolicyViolation" in cluster.events("late"), what="the PolicyViolation Event")

    cluster.fail_slice(first, slice_index=0, exit_code=1)  # the attempt ends: no other one outside the policy

    def failed() -> dict[str, Any] | None:
        status: dict[str, Any] = cluster.status("late")
        return status if status.get("phase") == "Failed" else None

    status = eventually(failed, what="the job to fail")
    condition = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (condition["reason"], condition["message"]) == ("PolicyViolation", problem)
    eventually(lambda: cluster.all_jobsets() == [], what="the failed attempt's JobSet to go")
    assert status.get("attempt", 0) == 0


def test_a_kueue_priority_relabelled_while_the_job_runs_never_reaches_an_attempt(kube, start_operator, namespace):
    """Issue 30 defect 4, past admission (no policy installed): relabelling a running job `high` changes
    nothing of its JobSet (labelled at creation, never relabelled); the attempt goes on with a
    PolicyViolation condition, and the next one, which would carry the label, is refused instead. A label
    change makes no new generation: the operator's watch asks for a reconcile on a forbidden one."""
    cluster = Cluster(kube, namespace)
    start_operator(RuntimeSettings(policy=policy.Policy(priority_classes=("low",))), [namespace])
    cluster.apply(_labelled("relabelled", "low"))
    first = eventually(lambda: cluster.jobset("relabelled-a0"), what="the first JobSet")
    client.CustomObjectsApi(kube).patch_namespaced_custom_object(
        api.GROUP,
        api.VERSION,
        namespace,
        api.PLURAL,
        "relabelled",
        {"metadata": {"labels": {PRIORITY_CLASS_LABEL: "high"}}},
    )
    problem = policy.WORKLOAD_PRIORITY_FORBIDDEN_MESSAGE.format(name="high", allowed="low")

    def warned() -> dict[str, Any] | None:
        status: dict[str, Any] = cluster.status("relabelled")
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        return status if conditions.get("PolicyViolation", {}).get("status") == "True" else None

    status = eventually(warned, timeout=30, what="the PolicyViolation condition")
    [condition] = [c for c in status["conditions"] if c["type"] == "PolicyViolation"]
    assert problem in condition["message"] and status["phase"] != "Failed"
    assert cluster.jobset("relabelled-a0")["metadata"]["labels"] == first["metadata"]["labels"]

    cluster.fail_slice(first, slice_index=0, exit_code=1)  # the attempt ends: none other with the label

    def failed() -> dict[str, Any] | None:
        status: dict[str, Any] = cluster.status("relabelled")
        return status if status.get("phase") == "Failed" else None

    status = eventually(failed, what="the job to fail")
    condition = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (condition["reason"], condition["message"]) == (policy.REASON, problem)
    eventually(lambda: cluster.all_jobsets() == [], what="the failed attempt's JobSet to go")
    assert status.get("attempt", 0) == 0
