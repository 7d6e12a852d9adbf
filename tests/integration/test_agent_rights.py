"""Issue 30, defect 3: an InPlace job's pods get JobSet's in-place restart agent's rights (read their
JobSet, patch pods), and nothing more, for no longer than the job. On the real apiserver, with the chart
installed by Helm and the real operator: the operator binds the pods' ServiceAccount per job, the binding
owned by the TrainingJob; a token bound to pod A may annotate pod A and is refused by the chart's
admission policy on any other pod (a worker or not), on A's spec, and without a pod claim, while RBAC
alone would have allowed all of it; an account that is not bound keeps what its own role gives it; the
binding is deleted when the job ends and garbage-collected when it is deleted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tpujob_contract import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, LABEL_UID
from tpujob_operator import api
from tpujob_operator.jobset import IN_PLACE_RESTART_ATTEMPT_ANNOTATION
from tpujob_operator.runtime import RuntimeSettings

from .conftest import eventually, training_job_manifest
from .test_helm import helm
from .test_operator import Cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "tpujob"
IN_PLACE = {"strategy": "InPlace", "maxRestarts": 0, "backoffSeconds": 0}


@pytest.fixture
def team(kube: client.ApiClient, unique_name: str) -> Iterator[str]:
    """The tenant's namespace, where the jobs and their pods run (the release lives in `namespace`)."""
    name = f"{unique_name}-team"
    core = client.CoreV1Api(kube)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    eventually(lambda: core.read_namespaced_service_account("default", name), what="the default ServiceAccount")
    yield name
    core.delete_namespace(name)


@pytest.fixture
def release(control_plane: Any, namespace: str, team: str, unique_name: str) -> Iterator[str]:
    """The chart, watching the team's namespace; a release name of its own (its cluster-wide objects too)."""
    name = f"tpujob-{unique_name}"
    kubeconfig = ("--kubeconfig", str(control_plane.kubeconfig))
    helm("install", name, str(CHART), "--namespace", namespace, "--skip-crds", "--set", f"watchNamespaces={{{team}}}",
         *kubeconfig)  # fmt: skip
    yield name
    helm("uninstall", name, "--namespace", namespace, *kubeconfig)


def _bindings(kube: client.ApiClient, namespace: str, uid: str) -> list[Any]:
    found = client.RbacAuthorizationV1Api(kube).list_namespaced_role_binding(
        namespace, label_selector=f"{LABEL_UID}={uid}"
    )
    return list(found.items)


def _pod(kube: client.ApiClient, namespace: str, name: str, labels: dict[str, str]) -> str:
    """A pod running as the namespace's default account (no kubelet here: it stays Pending); its uid."""
    body: Any = {
        "metadata": {"name": name, "labels": labels},
        "spec": {"serviceAccountName": "default", "containers": [{"name": "c", "image": "trainer:1"}]},
    }
    created: Any = client.CoreV1Api(kube).create_namespaced_pod(namespace, body)
    return str(created.metadata.uid)


def _as(control_plane: Any, kube: client.ApiClient, namespace: str, account: str, pod: tuple[str, str] | None) -> Any:
    """A client with a real token of `account`: bound to `pod` (name, uid), as a pod's projected token is
    (its claims carry the pod's name), or bound to nothing (a plain TokenRequest)."""
    bound = client.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod[0], uid=pod[1]) if pod else None
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], bound_object_ref=bound, expiration_seconds=3600)
    )
    answer: Any = client.CoreV1Api(kube).create_namespaced_service_account_token(account, namespace, request)
    configuration = client.Configuration()
    configuration.host = control_plane.server
    configuration.ssl_ca_cert = str(control_plane.pki.ca_cert)
    configuration.api_key = {"authorization": f"Bearer {answer.status.token}"}
    return client.CoreV1Api(client.ApiClient(configuration))


def _annotate(core: Any, namespace: str, pod: str, round_: str) -> None:
    """What the agent does: server-side apply of its one annotation."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "annotations": {IN_PLACE_RESTART_ATTEMPT_ANNOTATION: round_}}}  # fmt: skip
    core.patch_namespaced_pod(
        pod, namespace, body, field_manager="in-place-restart-agent", _content_type="application/apply-patch+yaml"
    )


def _refusal(attempt: Any) -> str:
    """The apiserver's message refusing `attempt()` once the admission policy is in force (it syncs in the
    background: until then the patch goes through, and is tried again)."""

    def refused() -> list[ApiException]:
        try:
            attempt()
        except ApiException as error:
            return [error]
        return []

    [error] = eventually(refused, timeout=30, what="the admission policy to refuse")
    assert error.status == 403, error.body
    return str(json.loads(str(error.body))["message"])


def _allowed(kube: client.ApiClient, user: str, namespace: str, verb: str, group: str, resource: str) -> bool:
    """RBAC's answer (a SubjectAccessReview) for a ServiceAccount: what it may do before any admission policy."""
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}", "system:authenticated"]
    attributes = client.V1ResourceAttributes(namespace=namespace, verb=verb, group=group, resource=resource)
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(user=user, groups=groups, resource_attributes=attributes)
    )
    answer: Any = client.AuthorizationV1Api(kube).create_subject_access_review(review)
    return bool(answer.status.allowed)


def test_an_in_place_jobs_pods_may_annotate_only_their_own_pod_while_it_runs(
    control_plane, kube, start_operator, namespace, release, team, unique_name
):
    role = f"{release}-in-place-restart-agent"
    start_operator(RuntimeSettings(in_place_agent_role=role), namespaces=[team])
    cluster = Cluster(kube, team)
    job = cluster.apply(training_job_manifest(unique_name, restart=IN_PLACE))
    uid = job["metadata"]["uid"]
    attempt = eventually(lambda: cluster.jobset(f"{unique_name}-a0"), what="JobSet a0")
    # One binding, this job's: owned by it, its pods' account to the agent's role.
    [binding] = eventually(lambda: _bindings(kube, team, uid), what="the agent's RoleBinding")
    assert binding.metadata.name.startswith(f"tpujob-agent-{unique_name}-")
    assert [(o.kind, o.name, o.uid, o.controller) for o in binding.metadata.owner_references] == [
        (api.KIND, unique_name, uid, True)
    ]
    assert (binding.role_ref.kind, binding.role_ref.name) == ("ClusterRole", role)
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [("ServiceAccount", "default", team)]
    # RBAC alone lets the account patch every pod of the namespace: what follows is the policy's doing.
    account = f"system:serviceaccount:{team}:default"
    assert eventually(lambda: _allowed(kube, account, team, "patch", "", "pods"), what="RBAC to see the binding")
    # What the operator does here with the test's rights, the chart lets its ServiceAccount do in the team's
    # namespace: create the bindings, and delete them by label (their names are not remembered).
    operator = f"system:serviceaccount:{namespace}:{release}"
    for verb in ("create", "deletecollection"):
        assert _allowed(kube, operator, team, verb, "rbac.authorization.k8s.io", "rolebindings"), verb
    # It deletes a slice's Job whose pods all went with their nodes (JobSet recreates it), and never
    # makes or changes a Job itself.
    assert _allowed(kube, operator, team, "delete", "batch", "jobs")
    for verb in ("create", "update", "patch"):
        assert not _allowed(kube, operator, team, verb, "batch", "jobs"), verb

    worker_labels = attempt["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"]
    own, other = f"{unique_name}-worker-0", f"{unique_name}-worker-1"
    own_uid = _pod(kube, team, own, worker_labels)
    _pod(kube, team, other, worker_labels)
    _pod(kube, team, "notebook", {"app": "notebook"})  # not a worker: the agent's rights reached it too
    agent = _as(control_plane, kube, team, "default", (own, own_uid))

    _annotate(agent, team, own, "0")  # its own pod: allowed
    assert client.CoreV1Api(kube).read_namespaced_pod(own, team).metadata.annotations == {
        IN_PLACE_RESTART_ATTEMPT_ANNOTATION: "0"
    }
    # The notebook first: until the policy syncs its patch goes through, and a worker's would start a round.
    for target in ("notebook", other):
        message = _refusal(lambda target=target: _annotate(agent, team, target, "1"))
        assert f"ValidatingAdmissionPolicy '{release}-in-place-agent'" in message, message
        assert message.endswith(
            f"{account} may update only its own pod with the in-place restart agent's role ({role}): "
            f"its token is bound to pod {own}, not to pod {target}"
        ), message
    # Its own pod, but not its image (what would run as the pod's account): annotations only.
    swap = {"spec": {"containers": [{"name": "c", "image": "attacker:1"}]}}
    message = _refusal(lambda: agent.patch_namespaced_pod(own, team, swap))
    assert message.endswith(f"{account} may change only the annotations of its pod with the in-place restart "
                            f"agent's role ({role})"), message  # fmt: skip
    # A token of the account bound to no pod (a TokenRequest) updates no pod, not even a worker's.
    unbound = _as(control_plane, kube, team, "default", None)
    assert _refusal(lambda: _annotate(unbound, team, own, "1")).endswith(
        f"its token is bound to no pod, not to pod {own}"
    )
    # Reading its JobSet (the agent's other right) is untouched.
    agent_jobsets = client.CustomObjectsApi(agent.api_client)
    agent_jobsets.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, team, JOBSET_PLURAL, f"{unique_name}-a0")
    # An account not bound to the agent's role (another tenant's controller) keeps what its role gives it.
    rbac = client.RbacAuthorizationV1Api(kube)
    client.CoreV1Api(kube).create_namespaced_service_account(team, {"metadata": {"name": "controller"}})
    rbac.create_namespaced_role(
        team, {"metadata": {"name": "controller"}, "rules": [{"apiGroups": [""], "resources": ["pods"],
                                                             "verbs": ["patch"]}]}
    )  # fmt: skip
    rbac.create_namespaced_role_binding(team, {
        "metadata": {"name": "controller"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "controller"},
        "subjects": [{"kind": "ServiceAccount", "name": "controller", "namespace": team}],
    })  # fmt: skip
    controller = _as(control_plane, kube, team, "controller", None)
    eventually(lambda: _allowed(kube, f"system:serviceaccount:{team}:controller", team, "patch", "", "pods"),
               what="RBAC to see the controller's binding")  # fmt: skip
    _annotate(controller, team, "notebook", "7")  # not a worker's pod: a worker's would be a round

    # The job ends (its budget of 0 spent): the binding goes at once, and with it the rights.
    cluster.fail_slice(attempt, slice_index=0, exit_code=1)
    eventually(lambda: cluster.status(unique_name).get("phase") == "Failed", what="phase Failed")
    eventually(lambda: not _bindings(kube, team, uid), what="the agent's RoleBinding deleted at the end")
    eventually(lambda: not _allowed(kube, account, team, "patch", "", "pods"), what="RBAC to drop the rights")


def test_the_agents_binding_goes_with_the_deleted_job(kube, start_operator, release, team, unique_name):
    start_operator(RuntimeSettings(in_place_agent_role=f"{release}-in-place-restart-agent"), namespaces=[team])
    cluster = Cluster(kube, team)
    uid = cluster.apply(training_job_manifest(unique_name, restart=IN_PLACE))["metadata"]["uid"]
    eventually(lambda: _bindings(kube, team, uid), what="the agent's RoleBinding")
    cluster.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, team, api.PLURAL, unique_name)
    # The garbage collector (kube-controller-manager runs here) follows the owner reference.
    eventually(lambda: not _bindings(kube, team, uid), timeout=90, what="the RoleBinding garbage-collected")
