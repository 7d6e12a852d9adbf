"""The apiserver itself refuses invalid TrainingJobs (CRD schema + CEL), naming the field."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tpujob_devcluster.controlplane import tools_dir
from tpujob_operator import api, crd

from .conftest import eventually, training_job_manifest

CHART = Path(__file__).resolve().parents[2] / "charts" / "tpujob"


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


_BKT = {"directory": "gs://bkt/a"}
TPU = {"accelerator": "tpu-v5p-slice", "topology": "2x2x2"}


def _maxtext_spec(change: dict[str, Any]) -> dict[str, Any]:
    spec = {"framework": "maxtext", "image": "tpujob-maxtext:dev", "args": ["steps=5"], **change}
    return dict(training_job_manifest("maxtext", **spec)["spec"])


# (case, spec change, field the refusal names)
_MAXTEXT_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("min interval", {"checkpoint": {**_BKT, "minIntervalSeconds": 5}}, "spec.checkpoint.minIntervalSeconds"),
    ("every steps", {"checkpoint": {**_BKT, "keep": {"everySteps": 100}}}, "spec.checkpoint.keep.everySteps"),
    ("adaptive", {"checkpoint": {**_BKT, "policy": "adaptive"}}, "spec.checkpoint.policy"),
    ("checkpoint_period in args", {"args": ["steps=5", "checkpoint_period=10"]}, "spec.args"),
    ("base_output_directory in args", {"args": ["base_output_directory=gs://x/y"]}, "spec.args"),
    ("env override of a flag", {"env": [{"name": "M_RUN_NAME", "value": "x"}]}, "spec.env"),
    ("XPK variable in env", {"env": [{"name": "JAX_COORDINATOR_ADDRESS", "value": "x"}]}, "spec.env"),
    ("local tier", {"checkpoint": {**_BKT, "local": {"sizeLimit": "1Gi"}}}, "spec.checkpoint.local"),
    ("elastic", {"elastic": {"minSlices": 1}}, "spec.elastic"),
]


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
    # Issue 21: elastic slices.
    ("elastic at the full size", "spec.elastic", {"minSlices": 2}, "spec.elastic.minSlices"),
    ("elastic of no slices", "spec.elastic", {"minSlices": 0}, "spec.elastic.minSlices"),
    ("negative shrink wait", "spec.elastic", {"minSlices": 1, "shrinkAfterSeconds": -1}, "spec.elastic.shrinkAfter"),
    (
        "elastic without a divisor",
        "spec",
        training_job_manifest("bad", tpu={**TPU, "slices": 3}, elastic={"minSlices": 2})["spec"],
        "spec.elastic.minSlices: no slice count from minSlices up to below spec.tpu.slices divides",
    ),
    # Issue 19: the restart ladder and the local tier.
    ("unknown restart strategy", "spec.restart.strategy", "Reboot", "spec.restart.strategy"),
    ("negative in-place restarts", "spec.restart.inPlace.maxRestarts", -1, "spec.restart.inPlace.maxRestarts"),
    ("local tier without a size", "spec.checkpoint.local", {"intervalSteps": 5}, "spec.checkpoint.local.sizeLimit"),
    ("local tier of no size", "spec.checkpoint.local", {"sizeLimit": "0"}, "spec.checkpoint.local.sizeLimit"),
    ("local tier sized in words", "spec.checkpoint.local", {"sizeLimit": "lots"}, "spec.checkpoint.local.sizeLimit"),
    (
        "zero local interval",
        "spec.checkpoint.local",
        {"sizeLimit": "1Gi", "intervalSteps": 0},
        "spec.checkpoint.local.intervalSteps",
    ),
    (
        "local budget over 100%",
        "spec.checkpoint.local",
        {"sizeLimit": "1Gi", "overheadBudgetPercent": 101},
        "spec.checkpoint.local.overheadBudgetPercent",
    ),
    # Issue 13: the adaptive policy's settings, only with that policy, within bounds.
    ("budget with continuous", "spec.checkpoint.overheadBudgetPercent", 5, "spec.checkpoint.overheadBudgetPercent"),
    ("max interval with continuous", "spec.checkpoint.maxIntervalSeconds", 60, "spec.checkpoint.maxIntervalSeconds"),
    (
        "zero budget",
        "spec.checkpoint",
        {"directory": "gs://bkt/a", "policy": "adaptive", "overheadBudgetPercent": 0},
        "spec.checkpoint.overheadBudgetPercent",
    ),
    (
        "max interval below min interval",
        "spec.checkpoint",
        {"directory": "gs://bkt/a", "policy": "adaptive", "minIntervalSeconds": 30, "maxIntervalSeconds": 10},
        "spec.checkpoint.maxIntervalSeconds",
    ),
    ("directory not gs://", "spec.checkpoint.directory", "s3://bucket/x", "spec.checkpoint.directory"),
    ("local directory", "spec.checkpoint.directory", "/tmp/ckpt", "spec.checkpoint.directory"),
    ("missing checkpoint directory", "spec.checkpoint.directory", _DELETE, "spec.checkpoint.directory"),
    ("keep latest zero", "spec.checkpoint.keep", {"latest": 0}, "spec.checkpoint.keep.latest"),
    ("negative max restarts", "spec.restart", {"maxRestarts": -1}, "spec.restart.maxRestarts"),
    ("negative hang timeout", "spec.restart", {"hangTimeoutSeconds": -5}, "spec.restart.hangTimeoutSeconds"),
    ("empty image", "spec.image", "", "spec.image"),
    ("args not a list", "spec.args", "--model tiny", "spec.args"),
    ("env without name", "spec.env", [{"value": "x"}], "spec.env[0].name"),
    # Issue 17 item 12: names JobSet's webhook would refuse after admission (retried forever).
    ("name too long for its pods", "metadata.name", "n" * 43, "metadata.name must be at most 42 characters"),
    ("name with a leading digit", "metadata.name", "7b-llama", "metadata.name 7b-llama is not valid"),
    ("name with a dot", "metadata.name", "llama.v2", "metadata.name llama.v2 is not valid"),
    ("image with a trailing space", "spec.image", "tpujob-trainer:dev ", "spec.image"),
    ("image with a leading newline", "spec.image", "\ntpujob-trainer:dev", "spec.image"),
    ("env valueFrom without a source", "spec.env", [{"name": "X", "valueFrom": {}}], "spec.env[0].valueFrom"),
    (
        "env valueFrom with two sources",
        "spec.env",
        [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "a"}, "secretKeyRef": {"name": "s", "key": "k"}}}],
        "spec.env[0].valueFrom",
    ),
    (
        "request above its limit",
        "spec.resources",
        {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"cpu": "1500m"}},
        "spec.resources.requests.cpu must not exceed spec.resources.limits.cpu",
    ),
    (
        "cpu request named in the refusal",
        "spec.resources",
        {"requests": {"cpu": "1", "example.com/gpu": "lots"}},
        "spec.resources.requests[example.com/gpu]",
    ),
    *[
        # Issue 7 item 8: numbers that would overflow the operator's computations.
        (
            "backoff that overflowed the operator",
            "spec.restart",
            {"backoffSeconds": 10**12},
            "spec.restart.backoffSeconds",
        ),
        ("max backoff over a week", "spec.restart", {"maxBackoffSeconds": 604_801}, "spec.restart.maxBackoffSeconds"),
        (
            "max backoff below backoff",
            "spec.restart",
            {"backoffSeconds": 60, "maxBackoffSeconds": 30},
            "spec.restart.maxBackoffSeconds",
        ),
        ("too many restarts", "spec.restart", {"maxRestarts": 10_001}, "spec.restart.maxRestarts"),
        (
            "hang timeout over a week",
            "spec.restart",
            {"hangTimeoutSeconds": 604_801},
            "spec.restart.hangTimeoutSeconds",
        ),
        (
            "startup timeout over a week",
            "spec.restart",
            {"startupTimeoutSeconds": 604_801},
            "spec.restart.startupTimeoutSeconds",
        ),
        (
            "scheduling timeout over a week",
            "spec.restart",
            {"schedulingTimeoutSeconds": 604_801},
            "spec.restart.schedulingTimeoutSeconds",
        ),
        (
            "min interval over a day",
            "spec.checkpoint.minIntervalSeconds",
            86_400.5,
            "spec.checkpoint.minIntervalSeconds",
        ),
        ("interval steps over 1e9", "spec.checkpoint.intervalSteps", 10**9 + 1, "spec.checkpoint.intervalSteps"),
        ("keep latest over 1000", "spec.checkpoint.keep", {"latest": 1001}, "spec.checkpoint.keep.latest"),
        (
            "keep every steps over 1e9",
            "spec.checkpoint.keep",
            {"everySteps": 10**9 + 1},
            "spec.checkpoint.keep.everySteps",
        ),
        # Resource values are quantities; the TPU chips are the operator's.
        ("cpu request not a quantity", "spec.resources", {"requests": {"cpu": "lots"}}, "spec.resources.requests"),
        ("memory limit not a quantity", "spec.resources", {"limits": {"memory": "16GB"}}, "spec.resources.limits"),
        ("negative quantity", "spec.resources", {"requests": {"cpu": "-500m"}}, "spec.resources.requests"),
        ("negative integer quantity", "spec.resources", {"limits": {"cpu": -1}}, "spec.resources.limits"),
        ("tpu requested by hand", "spec.resources", {"requests": {"google.com/tpu": 4}}, "spec.resources.requests"),
        ("tpu limited by hand", "spec.resources", {"limits": {"google.com/tpu": "4"}}, "spec.resources.limits"),
        (
            "too many resources",
            "spec.resources",
            {"requests": {f"example.com/r{i}": 1 for i in range(33)}},
            "spec.resources.requests",
        ),
        # Checkpoint paths without empty, . or .. segments.
        ("empty directory segment", "spec.checkpoint.directory", "gs://bkt/a//b", "spec.checkpoint.directory"),
        ("empty segment after bucket", "spec.checkpoint.directory", "gs://bkt//a", "spec.checkpoint.directory"),
        ("double trailing slash", "spec.checkpoint.directory", "gs://bkt/a//", "spec.checkpoint.directory"),
        ("dot directory segment", "spec.checkpoint.directory", "gs://bkt/./a", "spec.checkpoint.directory"),
        ("dot-dot directory segment", "spec.checkpoint.directory", "gs://bkt/a/..", "spec.checkpoint.directory"),
        ("dot-dot inner segment", "spec.checkpoint.directory", "gs://bkt/a/../b", "spec.checkpoint.directory"),
        # The operator's own env is refused, not silently overridden.
        ("env sets TPUJOB_RUN_DIR", "spec.env", [{"name": "TPUJOB_RUN_DIR", "value": "x"}], "spec.env[0].name"),
        ("env sets TPUJOB_UID", "spec.env", [{"name": "X", "value": "1"}, {"name": "TPUJOB_UID"}], "spec.env[1].name"),
        ("env sets a checkpoint knob", "spec.env", [{"name": "TPUJOB_CHECKPOINT_POLICY"}], "spec.env[0].name"),
        ("env sets a megascale var", "spec.env", [{"name": "MEGASCALE_NUM_SLICES", "value": "9"}], "spec.env[0].name"),
        ("env name not an identifier", "spec.env", [{"name": "1 BAD=x", "value": "1"}], "spec.env[0].name"),
        (
            "env value and valueFrom",
            "spec.env",
            [{"name": "TOKEN", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            "spec.env[0].valueFrom",
        ),
        ("too many env entries", "spec.env", [{"name": f"V{i}"} for i in range(257)], "spec.env"),
        ("too many args", "spec.args", ["x"] * 1025, "spec.args"),
        ("too many command items", "spec.command", ["x"] * 257, "spec.command"),
    ],
    # Issue 12: what MaxText cannot honour, with spec.framework maxtext (the whole spec is replaced).
    *[(f"maxtext: {case}", "spec", _maxtext_spec(change), field) for case, change, field in _MAXTEXT_REFUSED],
]

# Edge cases that stay accepted, each next to its nearest refused neighbour: the bounds themselves,
# every quantity form, clean paths, trainer knobs. (case, path, accepted value, refused neighbour)
VALID = [
    (
        "every restart number at its bound",
        "spec.restart",
        {
            "maxRestarts": 10_000,
            "backoffSeconds": 604_800,
            "maxBackoffSeconds": 604_800,
            "hangTimeoutSeconds": 604_800,
            "startupTimeoutSeconds": 604_800,
            "schedulingTimeoutSeconds": 604_800,
        },
        {"maxRestarts": 10_000, "backoffSeconds": 604_800, "maxBackoffSeconds": 604_801},
    ),
    (
        "every checkpoint number at its bound",
        "spec.checkpoint",
        {
            "directory": "gs://bkt/a",
            "minIntervalSeconds": 86_400,
            "intervalSteps": 10**9,
            "keep": {"latest": 1000, "everySteps": 10**9},
        },
        {"directory": "gs://bkt/a", "minIntervalSeconds": 86_400, "keep": {"latest": 1001}},
    ),
    (
        "max backoff equal to backoff",
        "spec.restart",
        {"backoffSeconds": 30, "maxBackoffSeconds": 30},
        {"backoffSeconds": 30, "maxBackoffSeconds": 29},
    ),
    (
        "quantities of every form",
        "spec.resources",
        {
            "requests": {
                "cpu": "500m",
                "memory": "16Gi",
                "ephemeral-storage": "1e3",
                "example.com/a": 2,
                "example.com/b": "0",
            },
            "limits": {
                "cpu": 4,
                "memory": "17.5G",  # at least the request's 16Gi
                "example.com/c": ".5",
                "example.com/d": "+1",
                "example.com/e": "100n",
            },
        },
        {"requests": {"cpu": "500m", "memory": "16 Gi"}},
    ),
    (
        "32 resources",
        "spec.resources",
        {"limits": {f"example.com/r{i}": 1 for i in range(32)}},
        {"limits": {f"example.com/r{i}": 1 for i in range(33)}},
    ),
    (
        "adaptive budget at its bound, max interval equal to min",
        "spec.checkpoint",
        {
            "directory": "gs://bkt/a",
            "policy": "adaptive",
            "overheadBudgetPercent": 50,
            "minIntervalSeconds": 10,
            "maxIntervalSeconds": 10,
        },
        {"directory": "gs://bkt/a", "policy": "adaptive", "overheadBudgetPercent": 50.5},
    ),
    (
        "maxtext with what MaxText honours; a minimum interval is not",
        "spec",
        _maxtext_spec(
            {
                "args": ["steps=5", "log_period=1", "my_checkpoint_period=3"],
                "env": [{"name": "M_STEPS", "value": "5"}],
                "checkpoint": {**_BKT, "policy": "interval", "intervalSteps": 5, "async": False, "keep": {"latest": 9}},
            }
        ),
        _maxtext_spec({"checkpoint": {**_BKT, "minIntervalSeconds": 0.5}}),
    ),
    (
        "elastic down to one slice, shrinking at once",
        "spec.elastic",
        {"minSlices": 1, "shrinkAfterSeconds": 0},
        {"minSlices": 2},
    ),
    ("single trailing slash", "spec.checkpoint.directory", "gs://bkt/a/", "gs://bkt/a//"),
    ("bucket only", "spec.checkpoint.directory", "gs://bkt", "gs://bkt/."),
    (
        "dotted names that are not . or ..",
        "spec.checkpoint.directory",
        "gs://b-1.x/a.b/...x/.hidden/..y/z..",
        "gs://b-1.x/a.b/../.hidden",
    ),
    (
        "trainer knobs and valueFrom",
        "spec.env",
        [
            {"name": "TPUJOB_MODEL", "value": "1b"},
            {"name": "TPUJOB_STEPS", "value": "100"},
            {"name": "TPUJOB_LOG_LEVEL", "value": "debug"},
            {"name": "my.var-1", "value": ""},
            {"name": "TOKEN", "value": "", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
        [{"name": "TPUJOB_MODEL", "value": "1b"}, {"name": "TPUJOB_NUM_SLICES", "value": "9"}],
    ),
    (
        "256 env entries",
        "spec.env",
        [{"name": f"V{i}", "value": "1"} for i in range(256)],
        [{"name": f"V{i}", "value": "1"} for i in range(257)],
    ),
    ("1024 args", "spec.args", ["x"] * 1024, ["x"] * 1025),
    ("the longest name for its pods", "metadata.name", "n" * 42, "n" * 43),
    (
        "request equal to its limit",
        "spec.resources",
        {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1000m", "memory": "1Gi"}},
        {"requests": {"cpu": "1001m"}, "limits": {"cpu": "1"}},
    ),
]

# Issue 17 item 12: a refusal says what is wrong in words, never a raw regular expression.
IN_WORDS = [
    ("spec.checkpoint.directory", "gs://BUCKET/runs", "the bucket name is 3-222 lowercase letters"),
    ("spec.tpu.topology", "2by2", "two or three numbers joined by x"),
    ("spec.env", [{"name": "1X", "value": "1"}], "must not start with a digit"),
    ("spec.priorityClassName", "High", "lowercase letters, digits, '-' and '.'"),
    ("spec.serviceAccountName", "my_sa", "lowercase letters, digits, '-' and '.'"),
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


@pytest.mark.parametrize(("case", "path", "value", "neighbour"), VALID, ids=[c[0] for c in VALID])
def test_edge_case_is_accepted_and_its_neighbour_refused(kube, namespace, case, path, value, neighbour):
    created = _create(kube, namespace, _set(training_job_manifest("edge"), path, value))
    # The operator's model agrees with the apiserver (else it would report Failed/InvalidSpec).
    api.TrainingJob.model_validate(created)
    with pytest.raises(ApiException) as refused:
        _create(kube, namespace, _set(training_job_manifest("over"), path, neighbour))
    assert refused.value.status == 422, refused.value.body
    assert path in json.loads(refused.value.body)["message"]


@pytest.mark.parametrize(("path", "value", "words"), IN_WORDS, ids=[c[0] for c in IN_WORDS])
def test_a_malformed_value_is_refused_in_words(kube, namespace, path, value, words):
    with pytest.raises(ApiException) as refused:
        _create(kube, namespace, _set(training_job_manifest("words"), path, value))
    message = json.loads(refused.value.body)["message"]
    assert words in message and "should match" not in message, message


def test_the_longest_name_depends_on_the_spec(kube, namespace):
    """256 slices of 1536 hosts each: 37 characters at most (the message says so), where 2 slices allow 42."""
    big = {"tpu": {"accelerator": "tpu-v5p-slice", "topology": "16x16x24", "slices": 256}}
    with pytest.raises(ApiException) as refused:
        _create(kube, namespace, training_job_manifest("n" * 38, **big))
    assert "metadata.name must be at most 37 characters for this spec" in json.loads(refused.value.body)["message"]
    _create(kube, namespace, training_job_manifest("n" * 37, **big))
    more_restarts = {"restart": {"backoffSeconds": 0, "maxRestarts": 10_000}}
    with pytest.raises(ApiException) as refused:
        _create(kube, namespace, training_job_manifest("m" * 41, **more_restarts))
    assert "metadata.name must be at most 40 characters" in json.loads(refused.value.body)["message"]


def test_reserved_env_message_names_the_variable(kube, namespace):
    manifest = _set(training_job_manifest("env"), "spec.env", [{"name": "TPUJOB_RESUME_STEP", "value": "7"}])
    with pytest.raises(ApiException) as refused:
        _create(kube, namespace, manifest)
    message = json.loads(refused.value.body)["message"]
    assert "spec.env[0].name" in message and "TPUJOB_RESUME_STEP is set by the operator" in message, message


QUANTITIES = ["4", "1e-3", "500m", "16Gi", "1.5", "1e3", "2E", ".5", "1.", "+1", "100n", "10u", "0", "-0", "1Ki"]
QUANTITIES += ["1e+3", "1.e3", "00", "9" * 60, "1e400", "Gi", "m", ".", "+", ".e3"]  # Kubernetes: no digits is 0
NOT_QUANTITIES = ["lots", "", " 1", "1 ", "16GB", "1.2.3", "1e", "-1", "-500m", "-.5", "1ki", "1Mi2", "1.."]
NOT_QUANTITIES += ["\uff11", "0x10", "1_000", "1E3Ki", "1ee3", "1e3.5", "1.5m3", "1" * 65]


def test_operator_and_apiserver_agree_on_quantities(kube, namespace):
    """The pydantic check (a regex) and the apiserver's isQuantity() accept exactly the same strings."""
    disagreements = []
    for index, value in enumerate(QUANTITIES + NOT_QUANTITIES):
        manifest = _set(training_job_manifest(f"q{index}"), "spec.resources", {"requests": {"cpu": value}})
        try:
            _create(kube, namespace, manifest)
            apiserver = True
        except ApiException as error:
            assert error.status == 422, error.body
            assert "spec.resources.requests" in json.loads(error.body)["message"]
            apiserver = False
        operator = api.is_quantity(value)
        if (apiserver, operator) != (value in QUANTITIES, value in QUANTITIES):
            disagreements.append((value, apiserver, operator))
    assert disagreements == []


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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"checkpoint": {"directory": "gs://tpujob-tests/elsewhere"}}, api.DIRECTORY_IMMUTABLE_MESSAGE),
        ({"framework": "maxtext", "args": ["steps=5"]}, api.FRAMEWORK_IMMUTABLE_MESSAGE),
    ],
    ids=["checkpoint directory", "framework"],
)
def test_what_would_orphan_the_run_cannot_change(kube, namespace, change, message):
    """Issue 17 item 7: a new directory (or checkpoint layout) would restart the run from step 0 elsewhere."""
    _create(kube, namespace, training_job_manifest("run"))
    custom = client.CustomObjectsApi(kube)
    with pytest.raises(ApiException) as refused:
        custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, "run", {"spec": change})
    assert refused.value.status == 422
    assert message in json.loads(refused.value.body)["message"]
    # The checkpoint policy around the directory stays editable.
    custom.patch_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.PLURAL, "run", {"spec": {"checkpoint": {"keep": {"latest": 5}}}}
    )


def test_printer_columns_come_back_from_the_apiserver(kube, control_plane, namespace):
    _create(kube, namespace, training_job_manifest("cols"))
    code, table = control_plane.request(
        "GET",
        f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}",
        accept="application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    assert code == 200, table
    names = [c["name"] for c in table["columnDefinitions"]]
    columns = crd.build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert names == ["Name", *(c["name"] for c in columns)] and "Slices" in names


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


_EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLES = sorted([*_EXAMPLES_DIR.glob("*.yaml"), *_EXAMPLES_DIR.glob("own-loop/*.yaml")])


def test_every_example_applies_as_shipped(control_plane, kube, namespace):
    """Issue 17 item 12: `kubectl apply -f examples/<file>.yaml` works as is, with the chart's default
    policy in force (as on the devcluster): server-side dry run, so admission runs but nothing is kept."""
    assert {p.relative_to(_EXAMPLES_DIR).as_posix() for p in EXAMPLES} >= {
        "trainingjob.yaml",
        "demo.yaml",
        "maxtext.yaml",
        "own-loop/trainingjob.yaml",
    }
    helm = [str(tools_dir() / "helm"), "--kubeconfig", str(control_plane.kubeconfig), "--namespace", namespace]
    install = [*helm, "install", "tpujob", str(CHART), "--skip-crds", "--set", f"watchNamespaces={{{namespace}}}"]
    subprocess.run(install, check=True, capture_output=True, timeout=120)
    try:
        # The admission policy is in force (it syncs in the background): an unlisted account is refused.
        probe = training_job_manifest("probe", serviceAccountName="not-listed")

        def in_force() -> bool:
            try:
                client.CustomObjectsApi(kube).create_namespaced_custom_object(
                    api.GROUP, api.VERSION, namespace, api.PLURAL, probe, dry_run="All"
                )
            except ApiException as error:
                return error.status == 403
            return False

        eventually(in_force, timeout=30, what="the admission policy")
        kubectl = [str(tools_dir() / "kubectl"), "--kubeconfig", str(control_plane.kubeconfig), "-n", namespace]
        for example in EXAMPLES:
            result = subprocess.run(
                [*kubectl, "apply", "--dry-run=server", "-f", str(example)], capture_output=True, text=True, timeout=60
            )
            assert result.returncode == 0, f"{example.name}: {result.stderr}"
            assert "created (server dry run)" in result.stdout, result.stdout
    finally:
        subprocess.run([*helm, "uninstall", "tpujob"], check=True, capture_output=True, timeout=120)
