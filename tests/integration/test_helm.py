"""The Helm chart: lint, render, and install into the real control plane."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from tpujob_devcluster.controlplane import tools_dir

from .conftest import eventually

pytestmark = pytest.mark.integration
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


def test_cluster_role_is_least_privilege():
    [role] = [d for d in render() if d["kind"] == "ClusterRole"]
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "*" not in resources and "*" not in verbs
    assert "secrets" not in resources and "namespaces" not in resources
    assert resources == {
        "trainingjobs",
        "trainingjobs/status",
        "jobsets",
        "pods",
        "events",
        "customresourcedefinitions",
    }
    pod_rule = next(rule for rule in role["rules"] if rule["resources"] == ["pods"])
    assert pod_rule["verbs"] == ["list", "watch", "deletecollection"]
    # Watching a namespace list adds only read access to namespaces.
    [scoped] = [d for d in render("watchNamespaces={ml,research}") if d["kind"] == "ClusterRole"]
    assert {"list", "watch"} == {v for r in scoped["rules"] if "namespaces" in r["resources"] for v in r["verbs"]}


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


def test_leader_election_role_is_one_lease_in_the_release_namespace():
    docs = render()
    [role] = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "default"  # helm template's release namespace
    assert {(r["resources"][0], tuple(r.get("resourceNames", [])), v) for r in role["rules"] for v in r["verbs"]} == {
        ("leases", (), "create"),  # create cannot be limited to a name
        ("leases", ("tpujob-operator",), "get"),
        ("leases", ("tpujob-operator",), "update"),
    }
    assert all(r["apiGroups"] == ["coordination.k8s.io"] for r in role["rules"])
    [binding] = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # A shared Lease namespace lets releases in different namespaces elect one operator among them.
    [shared] = [d for d in render("leaderElection.namespace=ops") if d["kind"] == "Role"]
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
    deployment = client.AppsV1Api(kube).read_namespaced_deployment("tpujob", namespace)
    assert deployment.spec.template.spec.service_account_name == "tpujob"
    client.CoreV1Api(kube).read_namespaced_service_account("tpujob", namespace)
    role = client.RbacAuthorizationV1Api(kube).read_cluster_role("tpujob")
    assert any("jobsets" in (rule.resources or []) for rule in role.rules)
    binding = client.RbacAuthorizationV1Api(kube).read_cluster_role_binding("tpujob")
    assert binding.subjects[0].namespace == namespace
    lease_role = client.RbacAuthorizationV1Api(kube).read_namespaced_role("tpujob-leader-election", namespace)
    assert lease_role.rules[0].api_groups == ["coordination.k8s.io"]
    metrics_service = client.CoreV1Api(kube).read_namespaced_service("tpujob-metrics", namespace)
    assert [(p.name, p.port, p.target_port) for p in metrics_service.spec.ports] == [("metrics", 8081, "metrics")]
    # The Deployment controller (in kube-controller-manager) accepted it and made a ReplicaSet.
    eventually(lambda: client.AppsV1Api(kube).list_namespaced_replica_set(namespace).items, what="ReplicaSet")
    helm("uninstall", "tpujob", "--namespace", namespace, "--kubeconfig", str(control_plane.kubeconfig))


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
