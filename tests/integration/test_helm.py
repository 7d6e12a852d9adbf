"""The Helm chart: lint, render, and install into the real control plane."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from tpujob_contract import ACCELERATOR_LABEL, TOPOLOGY_LABEL
from tpujob_devcluster.controlplane import tools_dir
from tpujob_operator.tpu import ACCELERATORS, slice_shape

from .conftest import eventually

CHART = Path(__file__).resolve().parents[2] / "charts" / "tpujob"


def helm(*args: str) -> str:
    result = subprocess.run([str(tools_dir() / "helm"), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(*overrides: str) -> list[dict[str, Any]]:
    args = [arg for override in overrides for arg in ("--set", override)]
    return [d for d in yaml.safe_load_all(helm("template", "tpujob", str(CHART), *args)) if d]


def refused_render(*overrides: str) -> str:
    """helm template with values the chart must refuse: its error text."""
    args = [arg for override in overrides for arg in ("--set", override)]
    result = subprocess.run(
        [str(tools_dir() / "helm"), "template", "tpujob", str(CHART), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0, result.stdout[:500]
    return result.stderr


def test_chart_lints_clean():
    assert "0 chart(s) failed" in helm("lint", "--strict", str(CHART))


def test_chart_crd_is_the_generated_one():
    generated = (CHART.parents[1] / "crds" / "trainingjob.yaml").read_text()
    assert (CHART / "crds" / "trainingjob.yaml").read_text() == generated


NAMESPACED_RESOURCES = {
    "trainingjobs",
    "trainingjobs/status",
    "jobsets",
    "pods",
    "pods/status",
    "jobs",
    "events",
    "rolebindings",
    "clusterroles",
}


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_cluster_role_is_least_privilege():
    role = _named(render(), "ClusterRole", "tpujob")
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in resources and "*" not in verbs
    assert "secrets" not in resources and "namespaces" not in resources
    assert resources == NAMESPACED_RESOURCES | {"customresourcedefinitions", "nodes"}
    pod_rule = next(rule for rule in role["rules"] if rule["resources"] == ["pods"])
    assert pod_rule["verbs"] == ["list", "watch", "delete", "deletecollection"]
    pod_status_rule = next(rule for rule in role["rules"] if rule["resources"] == ["pods/status"])
    assert pod_status_rule["verbs"] == ["patch"]  # a worker on a gone node marked Failed, nothing else
    job_rule = next(rule for rule in role["rules"] if rule["resources"] == ["jobs"])
    assert job_rule["verbs"] == ["delete"]  # a lost slice's Job, for JobSet to recreate; never created or read
    node_rule = next(rule for rule in role["rules"] if rule["resources"] == ["nodes"])
    assert node_rule["verbs"] == ["get", "list", "watch"]  # read only: whose failure it was
    # RoleBindings it creates, and only to the in-place restart agent's role: no other role can be granted.
    bind = next(rule for rule in role["rules"] if rule["resources"] == ["clusterroles"])
    assert (bind["verbs"], bind["resourceNames"]) == (["bind"], ["tpujob-in-place-restart-agent"])
    # Per job, deleted by label when it ends (their names are not remembered): create and deletecollection only.
    bindings = next(rule for rule in role["rules"] if rule["resources"] == ["rolebindings"])
    assert bindings["verbs"] == ["create", "deletecollection"]


def test_the_in_place_restart_agent_reads_jobsets_and_patches_pods_only():
    docs = render()
    agent = _named(docs, "ClusterRole", "tpujob-in-place-restart-agent")
    assert {(r, v) for rule in agent["rules"] for r in rule["resources"] for v in rule["verbs"]} == {
        ("jobsets", "get"),
        ("jobsets", "list"),
        ("jobsets", "watch"),
        ("pods", "patch"),
        ("inplacerestartagents", "own-pod-only"),  # the mark the admission policy knows its holders by
    }
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--in-place-agent-cluster-role=tpujob-in-place-restart-agent" in args
    assert "--in-place-restart-action=Restart" in args  # what a GKE 1.35 node does without alpha gates
    [alpha] = [d for d in render("inPlaceRestart.restartAction=RestartAllContainers") if d["kind"] == "Deployment"]
    assert (
        "--in-place-restart-action=RestartAllContainers" in alpha["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_node_leases_are_only_read_one_by_one():
    role = _named(render(), "Role", "tpujob-node-leases")
    assert role["metadata"]["namespace"] == "kube-node-lease"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get"]}]
    binding = _named(render(), "RoleBinding", "tpujob-node-leases")
    assert binding["roleRef"]["name"] == "tpujob-node-leases" and binding["subjects"][0]["name"] == "tpujob"


def test_watched_namespaces_get_roles_and_only_api_watching_stays_cluster_wide():
    docs = render("watchNamespaces={ml,research}")
    scoped = _named(docs, "ClusterRole", "tpujob")
    assert {(r, v) for rule in scoped["rules"] for r in rule["resources"] for v in rule["verbs"]} == {
        ("customresourcedefinitions", "list"),
        ("customresourcedefinitions", "watch"),
        ("namespaces", "list"),  # kopf resolves the watched namespaces
        ("namespaces", "watch"),
        ("nodes", "get"),  # cluster-scoped: whose failure a failed attempt was
        ("nodes", "list"),
        ("nodes", "watch"),
    }
    unscoped = _named(render(), "ClusterRole", "tpujob")
    for namespace in ("ml", "research"):
        [role] = [d for d in docs if d["kind"] == "Role" and d["metadata"].get("namespace") == namespace]
        assert {r for rule in role["rules"] for r in rule["resources"]} == NAMESPACED_RESOURCES
        assert [r for r in role["rules"]] == [r for r in unscoped["rules"] if r["resources"][0] in NAMESPACED_RESOURCES]
        [binding] = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"].get("namespace") == namespace]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tpujob"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tpujob", "namespace": "default"}]


def test_user_roles_aggregate_into_the_built_in_ones():
    docs = render()
    edit, view = _named(docs, "ClusterRole", "tpujob-edit"), _named(docs, "ClusterRole", "tpujob-view")
    assert (
        edit["metadata"]["labels"].items()
        >= {
            "rbac.authorization.k8s.io/aggregate-to-edit": "true",
            "rbac.authorization.k8s.io/aggregate-to-admin": "true",
        }.items()
    )
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {v for r in edit["rules"] if r["resources"] == ["trainingjobs"] for v in r["verbs"]} >= {"create", "delete"}
    # People never write status or JobSets: those are the operator's.
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in edit["rules"] if r["resources"] != ["trainingjobs"])
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in view["rules"])
    plain = _named(render("userRoles.aggregate=false"), "ClusterRole", "tpujob-edit")
    assert not any(k.startswith("rbac.authorization.k8s.io/aggregate") for k in plain["metadata"]["labels"])
    without = [d["metadata"]["name"] for d in render("userRoles.create=false") if d["kind"] == "ClusterRole"]
    assert without == ["tpujob", "tpujob-in-place-restart-agent"]


def test_policy_values_reach_the_operator_and_the_admission_policy_alike():
    docs = render(
        "policy.allowedCheckpointLocations={gs://team-a/,gs://shared/runs}",
        "policy.allowedServiceAccounts={trainer,reader}",
        "policy.allowedPriorityClasses={batch-low}",
        "policy.allowSecretKeyRef=true",
        "watchNamespaces={ml}",
    )
    args = _operator_container(docs)["args"]
    assert [a for a in args if a.startswith(("--allow", "--no-allow", "--operator-"))] == [
        "--allowed-checkpoint-location=gs://team-a",
        "--allowed-checkpoint-location=gs://shared/runs",
        "--allowed-service-account=trainer",
        "--allowed-service-account=reader",
        "--allowed-priority-class=batch-low",
        "--allow-secret-key-ref",
        "--operator-namespace=default",
        "--operator-service-account=tpujob",
    ]
    vap = _named(docs, "ValidatingAdmissionPolicy", "tpujob-policy")
    variables = {v["name"]: v["expression"] for v in vap["spec"]["variables"]}
    assert yaml.safe_load(variables["allowedLocations"]) == ["gs://team-a", "gs://shared/runs"]
    assert yaml.safe_load(variables["allowedServiceAccounts"]) == ["trainer", "reader"]
    assert yaml.safe_load(variables["allowedPriorityClasses"]) == ["batch-low"]
    assert variables["allowSecretKeyRef"] == "true"
    assert (variables["operatorNamespace"], variables["operatorServiceAccount"]) == ('"default"', '"tpujob"')
    binding = _named(docs, "ValidatingAdmissionPolicyBinding", "tpujob-policy")
    assert binding["spec"]["validationActions"] == ["Deny"] and "paramRef" not in binding["spec"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == ["ml"]
    # The defaults: any location, no serviceAccountName but the default, no PriorityClass, no secret refs.
    defaults = render()
    assert (
        yaml.safe_load(
            _named(defaults, "ValidatingAdmissionPolicy", "tpujob-policy")["spec"]["variables"][0]["expression"]
        )
        == []
    )
    default_args = _operator_container(defaults)["args"]
    assert "--no-allow-secret-key-ref" in default_args
    assert not [a for a in default_args if a.startswith(("--allowed-service-account", "--allowed-priority-class"))]
    default_variables = {
        v["name"]: v["expression"]
        for v in _named(defaults, "ValidatingAdmissionPolicy", "tpujob-policy")["spec"]["variables"]
    }
    assert (default_variables["allowedServiceAccounts"], default_variables["allowedPriorityClasses"]) == ("[]", "[]")
    assert "matchResources" not in _named(defaults, "ValidatingAdmissionPolicyBinding", "tpujob-policy")["spec"]
    # Not a TrainingJob policy: the in-place agent's limit stays.
    without = {
        d["metadata"]["name"] for d in render("policy.admissionPolicy.enabled=false") if "Admission" in d["kind"]
    }
    assert without == {"tpujob-in-place-agent"}
    assert "must be gs://bucket or gs://bucket/prefix" in refused_render("policy.allowedCheckpointLocations={s3://x}")


def test_the_in_place_agent_is_limited_to_its_own_pod_where_the_operator_binds_it():
    docs = render("watchNamespaces={ml}")
    policy = _named(docs, "ValidatingAdmissionPolicy", "tpujob-in-place-agent")
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}
    ]
    # Who is limited: the holders of the agent role's mark, by RBAC's own answer.
    assert "check('own-pod-only')" in policy["spec"]["matchConditions"][1]["expression"]
    binding = _named(docs, "ValidatingAdmissionPolicyBinding", "tpujob-in-place-agent")
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == ["ml"]
    assert "matchResources" not in _named(render(), "ValidatingAdmissionPolicyBinding", "tpujob-in-place-agent")["spec"]
    # Before Kubernetes 1.30 the v1 API does not exist: the chart is refused there (Chart.yaml kubeVersion).
    old = subprocess.run(
        [str(tools_dir() / "helm"), "template", "tpujob", str(CHART), "--kube-version", "1.29.3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert old.returncode != 0 and "kubeVersion" in old.stderr, old.stderr


def test_workload_identity_annotation_and_replicas_with_leader_election():
    docs = render("serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account=op@p.iam.gserviceaccount.com")
    [account] = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert account["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": "op@p.iam.gserviceaccount.com"}
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    # Two replicas: only the Lease holder reconciles, the other stands by.
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"--leader-elect", "--lease-duration=15", "--renew-deadline=10", "--retry-period=2"} <= set(
        container["args"]
    )
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert downward == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_IP": "status.podIP"}
    assert "--liveness=http://$(POD_IP):8080/healthz" in container["args"]


def test_image_is_pinned_by_digest_when_one_is_given_and_pods_report_readiness():
    container = _operator_container(render())
    assert container["image"].startswith("ghcr.io/tpujob/tpujob-operator:")  # the chart's appVersion
    # A standby answers /healthz too: a rolling update waits until the new pod runs.
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    digest = "sha256:" + "0" * 64
    pinned = _operator_container(render(f"image.digest={digest}", "image.tag=ignored"))
    assert pinned["image"] == f"ghcr.io/tpujob/tpujob-operator@{digest}"


def test_leader_election_role_is_one_lease_in_the_release_namespace():
    docs = render()
    role = _named(docs, "Role", "tpujob-leader-election")
    assert role["metadata"]["namespace"] == "default"  # helm template's release namespace
    assert {(r["resources"][0], tuple(r.get("resourceNames", [])), v) for r in role["rules"] for v in r["verbs"]} == {
        ("leases", (), "create"),  # create cannot be limited to a name
        ("leases", ("tpujob-operator",), "get"),
        ("leases", ("tpujob-operator",), "update"),
    }
    assert all(r["apiGroups"] == ["coordination.k8s.io"] for r in role["rules"])
    binding = _named(docs, "RoleBinding", "tpujob-leader-election")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # A shared Lease namespace lets releases in different namespaces elect one operator among them.
    shared = _named(render("leaderElection.namespace=ops"), "Role", "tpujob-leader-election")
    assert shared["metadata"]["namespace"] == "ops"


def test_without_leader_election_only_one_replica_renders():
    [deployment] = [d for d in render("leaderElection.enabled=false", "replicaCount=1") if d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert "--no-leader-elect" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "replicaCount > 1 needs leaderElection.enabled" in refused_render("leaderElection.enabled=false")


def test_helm_install_creates_accepted_objects(control_plane, kube, namespace):
    helm(
        "install",
        "tpujob",
        str(CHART),
        "--namespace",
        namespace,
        "--kubeconfig",
        str(control_plane.kubeconfig),
        "--set",
        "watchNamespaces={" + namespace + "}",
    )
    try:
        deployment = client.AppsV1Api(kube).read_namespaced_deployment("tpujob", namespace)
        assert deployment.spec.template.spec.service_account_name == "tpujob"
        client.CoreV1Api(kube).read_namespaced_service_account("tpujob", namespace)
        rbac = client.RbacAuthorizationV1Api(kube)
        # Watching one namespace: the JobSet rights are a Role there, not cluster-wide.
        assert any("jobsets" in (rule.resources or []) for rule in rbac.read_namespaced_role("tpujob", namespace).rules)
        assert not any("jobsets" in (rule.resources or []) for rule in rbac.read_cluster_role("tpujob").rules)
        binding = rbac.read_cluster_role_binding("tpujob")
        assert binding.subjects[0].namespace == namespace
        # The apiserver's authorizer agrees: the operator may create JobSets where it watches, nowhere else.
        operator = (
            f"system:serviceaccount:{namespace}:tpujob",
            ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
        )
        assert _allowed(kube, operator, namespace, "create", "jobset.x-k8s.io", "jobsets")
        assert not _allowed(kube, operator, "default", "create", "jobset.x-k8s.io", "jobsets")
        assert not _allowed(kube, operator, "default", "list", "", "pods")
        assert _allowed(kube, operator, None, "watch", "apiextensions.k8s.io", "customresourcedefinitions")
        assert _allowed(kube, operator, None, "watch", "", "nodes")
        assert not _allowed(kube, operator, None, "patch", "", "nodes")
        assert _allowed(kube, operator, "kube-node-lease", "get", "coordination.k8s.io", "leases")
        assert not _allowed(kube, operator, "kube-node-lease", "list", "coordination.k8s.io", "leases")
        # tpujob-edit/-view reach the built-in edit/view (kube-controller-manager aggregates them): a person
        # bound to `edit` in a namespace may run TrainingJobs there, one bound to `view` may only read them.
        for built_in in ("edit", "view", "admin"):
            eventually(
                lambda role=built_in: any(
                    "trainingjobs" in (r.resources or []) for r in rbac.read_cluster_role(role).rules
                ),
                what=f"TrainingJobs aggregated into {built_in}",
            )
        for person, role in (("alice", "edit"), ("bob", "view")):
            rbac.create_namespaced_role_binding(
                namespace,
                client.V1RoleBinding(
                    metadata=client.V1ObjectMeta(name=person),
                    role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=role),
                    subjects=[client.RbacV1Subject(kind="User", name=person, api_group="rbac.authorization.k8s.io")],
                ),
            )
        # The authorizer sees a new RoleBinding a moment after it is created.
        eventually(lambda: _allowed(kube, ("alice", []), namespace, "create", "tpujob.dev", "trainingjobs"),
                   what="RBAC to see alice's binding")  # fmt: skip
        assert not _allowed(kube, ("alice", []), namespace, "update", "tpujob.dev", "trainingjobs", "status")
        eventually(lambda: _allowed(kube, ("bob", []), namespace, "list", "tpujob.dev", "trainingjobs"),
                   what="RBAC to see bob's binding")  # fmt: skip
        assert not _allowed(kube, ("bob", []), namespace, "create", "tpujob.dev", "trainingjobs")
        lease_role = client.RbacAuthorizationV1Api(kube).read_namespaced_role("tpujob-leader-election", namespace)
        assert lease_role.rules[0].api_groups == ["coordination.k8s.io"]
        metrics_service = client.CoreV1Api(kube).read_namespaced_service("tpujob-metrics", namespace)
        assert [(p.name, p.port, p.target_port) for p in metrics_service.spec.ports] == [("metrics", 8081, "metrics")]
        # The Deployment controller (in kube-controller-manager) accepted it and made a ReplicaSet.
        eventually(lambda: client.AppsV1Api(kube).list_namespaced_replica_set(namespace).items, what="ReplicaSet")
    finally:  # a failure here must not leave the release's cluster-wide objects to the next test
        helm("uninstall", "tpujob", "--namespace", namespace, "--kubeconfig", str(control_plane.kubeconfig))


def _allowed(
    kube: client.ApiClient,
    who: tuple[str, list[str]],
    namespace: str | None,
    verb: str,
    group: str,
    resource: str,
    subresource: str | None = None,
) -> bool:
    """The apiserver's RBAC decision (a SubjectAccessReview) for one request."""
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=who[0],
            groups=who[1],
            resource_attributes=client.V1ResourceAttributes(
                namespace=namespace, verb=verb, group=group, resource=resource, subresource=subresource
            ),
        )
    )
    answer: Any = client.AuthorizationV1Api(kube).create_subject_access_review(review)
    return bool(answer.status.allowed)


def _operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_metrics_service_reaches_the_operator_metrics_port():
    docs = render()
    [service] = [d for d in docs if d["kind"] == "Service"]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    container = _operator_container(docs)
    assert service["metadata"]["name"] == "tpujob-metrics"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    assert "--metrics-port=8081" in container["args"]
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]  # off unless asked for
    # Another port goes everywhere at once; the liveness port cannot be shared.
    moved = render("metrics.port=9102")
    [moved_service] = [d for d in moved if d["kind"] == "Service"]
    assert moved_service["spec"]["ports"][0]["port"] == 9102
    assert "--metrics-port=9102" in _operator_container(moved)["args"]
    assert "metrics.port must differ from livenessPort" in refused_render("metrics.port=8080")


def test_service_monitor_is_rendered_only_when_enabled():
    docs = render("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=kube-prometheus-stack")
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    [service] = [d for d in docs if d["kind"] == "Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["default"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "30s")
    assert endpoint["honorLabels"] is True  # the series' namespace/name are the TrainingJob's
    assert "scrapeTimeout" not in endpoint


def test_metrics_disabled_renders_no_service_port_or_monitor():
    docs = render("metrics.enabled=false", "metrics.serviceMonitor.enabled=true")
    assert not [d for d in docs if d["kind"] in ("Service", "ServiceMonitor")]
    container = _operator_container(docs)
    assert "--metrics-port=0" in container["args"]
    assert [p["name"] for p in container["ports"]] == ["health"]


def _spare_pools(shapes: list[tuple[str, str]], hosts: int = 1) -> list[str]:
    return [
        f"spares.pools[{i}].{key}={value}"
        for i, (accelerator, topology) in enumerate(shapes)
        for key, value in (("name", f"p{i}"), ("accelerator", accelerator), ("topology", topology), ("hosts", hosts))
    ]


def test_spares_hold_one_host_each_of_every_shape_with_the_chips_a_worker_of_it_asks_for():
    """A spare asks for what a worker of its shape asks (tpu.py, the operator's one table): every chip of
    one host, so one spare per host and a replacement fits exactly where it was."""
    shapes = [(family.accelerator, topology) for family in ACCELERATORS.values() for topology in family.topologies]
    docs = render(*_spare_pools(shapes, hosts=2))
    spares = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("tpujob-spare-")]
    assert len(spares) == len(shapes)
    for (accelerator, topology), deployment in zip(shapes, spares, strict=True):
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        chips = slice_shape(accelerator, topology).chips_per_host
        assert container["resources"]["requests"]["google.com/tpu"] == str(chips), (accelerator, topology)
        assert container["resources"]["limits"]["google.com/tpu"] == str(chips)
        assert pod["nodeSelector"] == {ACCELERATOR_LABEL: accelerator, TOPOLOGY_LABEL: topology}
        assert deployment["spec"]["replicas"] == 2
        assert pod["priorityClassName"] == "tpujob-spare" and pod["terminationGracePeriodSeconds"] == 0
        assert pod["automountServiceAccountToken"] is False  # a placeholder never talks to the API
    [priority] = [d for d in docs if d["kind"] == "PriorityClass"]
    assert (priority["value"], priority["preemptionPolicy"]) == (-1000, "Never")
    # No pools: no placeholder, no PriorityClass.
    assert not [d for d in render() if d["kind"] == "PriorityClass" or "spare" in d["metadata"]["name"]]


def test_spares_refuse_what_could_not_be_a_spare():
    pool = _spare_pools([("tpu-v5-lite-podslice", "2x2")])
    assert "must be negative" in refused_render(*pool, "spares.priority=0")
    assert 'accelerator "tpu-v9" is not one of' in refused_render(*_spare_pools([("tpu-v9", "2x2")]))
    assert "is not a TPU topology" in refused_render(*_spare_pools([("tpu-v5-lite-podslice", "2by2")]))
    assert "must be a DNS label" in refused_render(*pool, "spares.pools[0].name=Not_A_Label")
