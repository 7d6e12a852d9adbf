"""The apiserver itself refuses invalid TrainingJobs (CRD schema + CEL), naming the field."""

from __future__ import annotations

import copy
import json
import subprocess
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tpujob_devcluster.controlplane import tools_dir
from tpujob_operator import api

from .conftest import training_job_manifest

pytestmark = pytest.mark.integration


def _set(manifest: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    result = copy.deepcopy(manifest)
    node = result
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return result


_DELETE = object()

INVALID = [
    ("unknown accelerator", "spec.tpu.accelerator", "tpu-v9-imaginary", "spec.tpu.accelerator"),
    ("topology not offered for v5p", "spec.tpu.topology", "4x4", "spec.tpu.topology"),
    ("3-D topology on v6e", "spec.tpu.accelerator", "tpu-v6e-slice", "spec.tpu.topology"),
    ("malformed topology", "spec.tpu.topology", "2by2", "spec.tpu.topology"),
    ("zero slices", "spec.tpu.slices", 0, "spec.tpu.slices"),
    ("negative slices", "spec.tpu.slices", -2, "spec.tpu.slices"),
    ("missing tpu", "spec.tpu", _DELETE, "spec.tpu"),
    ("negative min interval", "spec.checkpoint.minIntervalSeconds", -1, "spec.checkpoint.minIntervalSeconds"),
    ("zero interval steps", "spec.checkpoint.intervalSteps", 0, "spec.checkpoint.intervalSteps"),
    ("interval policy without intervalSteps", "spec.checkpoint.policy", "interval", "spec.checkpoint.intervalSteps"),
    ("unknown policy", "spec.checkpoint.policy", "sometimes", "spec.checkpoint.policy"),
    ("directory not gs://", "spec.checkpoint.directory", "s3://bucket/x", "spec.checkpoint.directory"),
    ("local directory", "spec.checkpoint.directory", "/tmp/ckpt", "spec.checkpoint.directory"),
    ("missing checkpoint directory", "spec.checkpoint.directory", _DELETE, "spec.checkpoint.directory"),
    ("keep latest zero", "spec.checkpoint.keep", {"latest": 0}, "spec.checkpoint.keep.latest"),
    ("negative max restarts", "spec.restart", {"maxRestarts": -1}, "spec.restart.maxRestarts"),
    ("negative hang timeout", "spec.restart", {"hangTimeoutSeconds": -5}, "spec.restart.hangTimeoutSeconds"),
    ("empty image", "spec.image", "", "spec.image"),
    ("args not a list", "spec.args", "--model tiny", "spec.args"),
    ("env without name", "spec.env", [{"value": "x"}], "spec.env[0].name"),
    ("name too long", "metadata.name", "n" * 41, "metadata.name"),
]


def _create(kube: client.ApiClient, namespace: str, manifest: dict[str, Any]) -> Any:
    return client.CustomObjectsApi(kube).create_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.PLURAL, manifest
    )


@pytest.mark.parametrize(("case", "path", "value", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_training_job_is_refused_naming_the_field(kube, namespace, case, path, value, field):
    manifest = _set(training_job_manifest("bad"), path, value)
    with pytest.raises(ApiException) as refused:
        _create(kube, namespace, manifest)
    assert refused.value.status == 422, refused.value.body
    message = json.loads(refused.value.body)["message"]
    assert field in message, message


def test_valid_job_is_accepted_with_defaults_filled_in(kube, namespace):
    created = _create(kube, namespace, training_job_manifest("good"))
    checkpoint = created["spec"]["checkpoint"]
    assert (checkpoint["policy"], checkpoint["async"], checkpoint["saveOnPreemption"]) == ("continuous", True, True)
    assert checkpoint["keep"] == {"latest": 3}
    assert created["spec"]["restart"]["maxRestarts"] == 3
    assert created["spec"]["tpu"]["slices"] == 2


def test_tpu_cannot_change_after_creation(kube, namespace):
    _create(kube, namespace, training_job_manifest("fixed"))
    custom = client.CustomObjectsApi(kube)
    with pytest.raises(ApiException) as refused:
        custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, "fixed", {"spec": {"tpu": {"slices": 4}}}
        )
    assert refused.value.status == 422
    assert "spec.tpu is immutable" in json.loads(refused.value.body)["message"]
    # Everything else stays mutable (e.g. the restart budget).
    custom.patch_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.PLURAL, "fixed", {"spec": {"restart": {"maxRestarts": 9}}}
    )


def test_printer_columns_come_back_from_the_apiserver(kube, control_plane, namespace):
    _create(kube, namespace, training_job_manifest("cols"))
    code, table = control_plane.request(
        "GET",
        f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}",
        accept="application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    assert code == 200, table
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Phase", "Step", "Checkpoint", "Restarts", "Age"]


def test_kubectl_explain_shows_field_descriptions(control_plane):
    result = subprocess.run(
        [
            str(tools_dir() / "kubectl"),
            "--kubeconfig",
            str(control_plane.kubeconfig),
            "explain",
            "trainingjob.spec.checkpoint",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "minIntervalSeconds" in result.stdout
    assert "start a new async save as soon as the previous one finished" in result.stdout
