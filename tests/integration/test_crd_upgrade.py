"""How the TrainingJob CRD is upgraded (docs/troubleshooting.md, docs/compatibility.md): `helm upgrade`
leaves a chart's crds/ as the first install created them, and the documented command,
`kubectl apply --server-side --force-conflicts -f charts/tpujob/crds/`, brings the CRD to the chart's.
Shown on the real apiserver with the chart's own CRD under another API group (the session's TrainingJob
CRD and the other tests' jobs are left alone), in a chart that holds only that crds/ folder: Helm treats
crds/ the same in every chart.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from tpujob_devcluster.controlplane import tools_dir

from .conftest import eventually

CRD = Path(__file__).resolve().parents[2] / "charts" / "tpujob" / "crds" / "trainingjob.yaml"
GROUP = "crd-upgrade.tpujob.dev"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _crd(drop_status_field: str | None) -> dict[str, Any]:
    """The chart's CRD under GROUP; an older one lacks `drop_status_field` in its status schema."""
    crd: dict[str, Any] = yaml.safe_load(CRD.read_text().replace("tpujob.dev", GROUP))
    if drop_status_field:
        for version in crd["spec"]["versions"]:
            del version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][drop_status_field]
    return crd


def _status_fields(kube: client.ApiClient, name: str) -> set[str]:
    crd: Any = client.ApiextensionsV1Api(kube).read_custom_resource_definition(name)
    [version] = crd.spec.versions
    return set(version.schema.open_apiv3_schema.properties["status"].properties)


def test_helm_upgrade_leaves_the_crd_and_server_side_apply_upgrades_it(control_plane, kube, namespace, tmp_path):
    chart = tmp_path / "chart"
    (chart / "crds").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: crd-upgrade\nversion: 0.1.0\n")
    crds = chart / "crds" / "trainingjob.yaml"
    older = _crd(drop_status_field="resizes")
    name = older["metadata"]["name"]
    crds.write_text(yaml.safe_dump(older))
    helm = [str(tools_dir() / "helm"), "--kubeconfig", str(control_plane.kubeconfig), "--namespace", namespace]
    kubectl = [str(tools_dir() / "kubectl"), "--kubeconfig", str(control_plane.kubeconfig)]
    try:
        installed = _run(*helm, "install", "crd-upgrade", str(chart))
        assert installed.returncode == 0, installed.stderr
        eventually(lambda: "lastResize" in _status_fields(kube, name), what="the first install's CRD")
        assert "resizes" not in _status_fields(kube, name)
        # The chart's next version: helm upgrade does not touch the CRD.
        crds.write_text(yaml.safe_dump(_crd(drop_status_field=None)))
        upgraded = _run(*helm, "upgrade", "crd-upgrade", str(chart))
        assert upgraded.returncode == 0, upgraded.stderr
        assert "resizes" not in _status_fields(kube, name)
        # Server-side apply alone is refused: Helm manages the fields it created (.spec.versions).
        plain = _run(*kubectl, "apply", "--server-side", "-f", str(chart / "crds"))
        assert plain.returncode != 0 and 'conflict with "helm"' in plain.stderr, plain.stderr
        # The documented command takes them over.
        applied = _run(*kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(chart / "crds"))
        assert applied.returncode == 0, applied.stderr
        [version] = _crd(drop_status_field=None)["spec"]["versions"]
        assert _status_fields(kube, name) == set(
            version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        )
        # A later helm upgrade still leaves it as applied.
        upgraded = _run(*helm, "upgrade", "crd-upgrade", str(chart))
        assert upgraded.returncode == 0, upgraded.stderr
        assert "resizes" in _status_fields(kube, name)
    finally:
        _run(*helm, "uninstall", "crd-upgrade")
        # Not waited for: the CRD's finalizer removes its objects in the background (minutes on a loaded machine).
        _run(*kubectl, "delete", "crd", name, "--ignore-not-found", "--wait=false")
