"""The pydantic models refuse what the CRD refuses, so a spec that slipped past an older CRD still
fails as InvalidSpec instead of breaking a computation or a JobSet (issue 7, item 8)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from tpujob_operator import api
from tpujob_operator.jobset import build_jobset

from .factories import training_job

# (what, spec field to set, too-large value, at-the-bound value, name the error must carry)
BOUNDS = [
    (
        "maxRestarts",
        {"restart": {"maxRestarts": 10_001}},
        {"restart": {"maxRestarts": 10_000}},
        "spec.restart.maxRestarts",
    ),
    (
        "backoffSeconds",
        {"restart": {"backoffSeconds": 10**12, "maxBackoffSeconds": 10**12}},
        {"restart": {"backoffSeconds": 604_800, "maxBackoffSeconds": 604_800}},
        "spec.restart.backoffSeconds",
    ),
    (
        "maxBackoffSeconds",
        {"restart": {"maxBackoffSeconds": 604_801}},
        {"restart": {"maxBackoffSeconds": 604_800}},
        "spec.restart.maxBackoffSeconds",
    ),
    (
        "hangTimeoutSeconds",
        {"restart": {"hangTimeoutSeconds": 604_801}},
        {"restart": {"hangTimeoutSeconds": 604_800}},
        "spec.restart.hangTimeoutSeconds",
    ),
    (
        "startupTimeoutSeconds",
        {"restart": {"startupTimeoutSeconds": 604_801}},
        {"restart": {"startupTimeoutSeconds": 604_800}},
        "spec.restart.startupTimeoutSeconds",
    ),
    (
        "schedulingTimeoutSeconds",
        {"restart": {"schedulingTimeoutSeconds": 604_801}},
        {"restart": {"schedulingTimeoutSeconds": 604_800}},
        "spec.restart.schedulingTimeoutSeconds",
    ),
    (
        "minIntervalSeconds",
        {"checkpoint": {"directory": "gs://b-1/x", "minIntervalSeconds": 86_400.5}},
        {"checkpoint": {"directory": "gs://b-1/x", "minIntervalSeconds": 86_400}},
        "spec.checkpoint.minIntervalSeconds",
    ),
    (
        "intervalSteps",
        {"checkpoint": {"directory": "gs://b-1/x", "intervalSteps": 10**9 + 1}},
        {"checkpoint": {"directory": "gs://b-1/x", "intervalSteps": 10**9}},
        "spec.checkpoint.intervalSteps",
    ),
    (
        "keep.latest",
        {"checkpoint": {"directory": "gs://b-1/x", "keep": {"latest": 1001}}},
        {"checkpoint": {"directory": "gs://b-1/x", "keep": {"latest": 1000}}},
        "spec.checkpoint.keep.latest",
    ),
    (
        "keep.everySteps",
        {"checkpoint": {"directory": "gs://b-1/x", "keep": {"everySteps": 10**9 + 1}}},
        {"checkpoint": {"directory": "gs://b-1/x", "keep": {"everySteps": 10**9}}},
        "spec.checkpoint.keep.everySteps",
    ),
    (
        "env entries",
        {"env": [{"name": f"V{i}"} for i in range(257)]},
        {"env": [{"name": f"V{i}"} for i in range(256)]},
        "spec.env",
    ),
    ("args items", {"args": ["x"] * 1025}, {"args": ["x"] * 1024}, "spec.args"),
    ("command items", {"command": ["x"] * 257}, {"command": ["x"] * 256}, "spec.command"),
    (
        "resource entries",
        {"resources": {"requests": {f"example.com/r{i}": 1 for i in range(33)}}},
        {"resources": {"requests": {f"example.com/r{i}": 1 for i in range(32)}}},
        "spec.resources.requests",
    ),
]


@pytest.mark.parametrize(("what", "too_large", "at_bound", "field"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_every_number_and_list_is_bounded(what: str, too_large: dict[str, Any], at_bound: dict[str, Any], field: str):
    with pytest.raises(ValidationError) as refused:
        training_job(**too_large)
    assert field in str(refused.value)
    training_job(**at_bound)


def test_backoff_that_overflowed_the_operator_is_refused():
    with pytest.raises(ValidationError, match=r"spec\.restart\.backoffSeconds"):
        training_job(restart={"backoffSeconds": 10**12})


def test_max_backoff_below_backoff_is_refused():
    with pytest.raises(ValidationError, match=re.escape(api.BACKOFF_MESSAGE)):
        training_job(restart={"backoffSeconds": 60, "maxBackoffSeconds": 30})
    with pytest.raises(ValidationError, match=re.escape(api.BACKOFF_MESSAGE)):
        training_job(restart={"maxBackoffSeconds": 5})  # below the default backoffSeconds (10)
    assert training_job(restart={"backoffSeconds": 30, "maxBackoffSeconds": 30}).spec.restart.max_backoff_seconds == 30


VALID_QUANTITIES: list[int | str] = [
    4,
    0,
    "4",
    "500m",
    "16Gi",
    "1.5",
    "1e3",
    "2E",
    ".5",
    "1.",
    "+1",
    "100n",
    "10u",
    "0",
    "1e-3",
    "1e+3",
    "1.e3",
    "00",
    "-0",
    # Kubernetes parses a missing number as zero.
    "Gi",
    "m",
    ".",
]
INVALID_QUANTITIES: list[int | str] = [
    "lots",
    "",
    " 1",
    "1 ",
    "1\n",
    "16GB",
    "1.2.3",
    "1e",
    "1..",
    "-1",
    "-500m",
    "-.5",
    -1,
    "1ki",
    "\uff11",  # a fullwidth digit
    "0x10",
    "1_000",
    "1E3Ki",
]


@pytest.mark.parametrize("value", INVALID_QUANTITIES, ids=repr)
@pytest.mark.parametrize("field", ["requests", "limits"])
def test_resource_values_that_are_not_quantities_are_refused(field: str, value: int | str):
    # Issue 17 item 12: the message names the key, not only the map.
    with pytest.raises(
        ValidationError, match=re.escape(api.QUANTITY_KEY_MESSAGE.format(field=field, key="example.com/b"))
    ):
        training_job(resources={field: {"cpu": "1", "example.com/b": value}})
    # ... while every form of a quantity Kubernetes accepts still is.
    valid = {f"example.com/r{i}": v for i, v in enumerate(VALID_QUANTITIES)}
    assert getattr(training_job(resources={field: valid}).spec.resources, field) == valid


@pytest.mark.parametrize("field", ["requests", "limits"])
def test_tpu_chips_cannot_be_requested_by_hand(field: str):
    with pytest.raises(ValidationError, match=f"spec.resources.{field} must not set google.com/tpu"):
        training_job(resources={field: {"google.com/tpu": 4}})


def test_the_refused_resource_is_the_one_the_operator_sets():
    pod = build_jobset(training_job(), attempt=0, resume_step=None)["spec"]["replicatedJobs"][0]["template"]["spec"]
    set_by_operator = pod["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert set_by_operator  # the slice's chips, which a user's limits may not name
    for name in set_by_operator:
        with pytest.raises(ValidationError, match=f"spec.resources.limits must not set {re.escape(name)}"):
            training_job(resources={"limits": {name: 4}})


VALID_DIRECTORIES = ["gs://bkt", "gs://bkt/", "gs://bkt/a", "gs://bkt/a/", "gs://b-1.x/a.b/...x/.hidden/..y/z.."]
EMPTY_SEGMENT = ["gs://bkt//", "gs://bkt//a", "gs://bkt/a//b", "gs://bkt/a//"]
DOT_SEGMENT = ["gs://bkt/.", "gs://bkt/./a", "gs://bkt/a/..", "gs://bkt/a/../b", "gs://bkt/a/./", "gs://bkt/../a"]


def _clean_directories_are_accepted() -> None:
    for directory in VALID_DIRECTORIES:
        assert training_job(checkpoint={"directory": directory}).spec.checkpoint.directory == directory
    # A single trailing slash is allowed and ignored.
    assert training_job(checkpoint={"directory": "gs://bkt/a/"}).run_dir == "gs://bkt/a/ml/llama"


@pytest.mark.parametrize("directory", EMPTY_SEGMENT)
def test_checkpoint_directory_with_an_empty_segment_is_refused(directory: str):
    with pytest.raises(ValidationError, match=re.escape(api.DIRECTORY_EMPTY_SEGMENT_MESSAGE)):
        training_job(checkpoint={"directory": directory})
    _clean_directories_are_accepted()


@pytest.mark.parametrize("directory", DOT_SEGMENT)
def test_checkpoint_directory_with_a_dot_segment_is_refused(directory: str):
    with pytest.raises(ValidationError, match=re.escape(api.DIRECTORY_DOT_SEGMENT_MESSAGE)):
        training_job(checkpoint={"directory": directory})
    _clean_directories_are_accepted()


# Every variable jobset.trainer_env sets.
OPERATOR_SET = [
    "TPUJOB_NAME",
    "TPUJOB_NAMESPACE",
    "TPUJOB_UID",
    "TPUJOB_ATTEMPT",
    "TPUJOB_RESUME_STEP",
    "TPUJOB_RUN_DIR",
    "TPUJOB_NUM_SLICES",
    "TPUJOB_HOSTS_PER_SLICE",
    "TPUJOB_SLICE_ID",
    "TPUJOB_COORDINATOR_ADDRESS",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "TPUJOB_CHECKPOINT_POLICY",
    "TPUJOB_CHECKPOINT_KEEP_LATEST",
]
TRAINER_KNOBS = [
    "TPUJOB_MODEL",
    "TPUJOB_STEPS",
    "TPUJOB_LOG_LEVEL",
    "TPUJOB_STORAGE_WAIT_SECONDS",  # how long a worker waits out unreachable storage: the user's to tune
    "TPUJOB_BATCH_SIZE",
    "TPUJOB_SEED",
    "EXTRA",
    "a.b-c_d",
]


@pytest.mark.parametrize("name", OPERATOR_SET)
def test_env_the_operator_sets_is_refused_not_overridden(name: str):
    with pytest.raises(ValidationError, match=r"spec.env\[\].name must not name a variable the operator sets"):
        training_job(env=[{"name": name, "value": "1"}])
    # Trainer knobs (TPUJOB_MODEL, ...) stay settable.
    assert training_job(env=[{"name": n, "value": "1"} for n in TRAINER_KNOBS]).spec.env is not None


@pytest.mark.parametrize("name", ["1ABC", "A B", "A=B", "Ä", "A/B", "x" * 257])
def test_env_names_must_be_valid(name: str):
    with pytest.raises(ValidationError, match=r"spec\.env\.0\.name"):
        training_job(env=[{"name": name, "value": "1"}])


def test_env_value_and_value_from_are_exclusive():
    source = {"secretKeyRef": {"name": "s", "key": "k"}}
    with pytest.raises(ValidationError, match=re.escape(api.ENV_VALUE_AND_VALUE_FROM_MESSAGE)):
        training_job(env=[{"name": "TOKEN", "value": "x", "valueFrom": source}])
    training_job(env=[{"name": "TOKEN", "valueFrom": source}, {"name": "EMPTY", "value": "", "valueFrom": source}])


def test_every_env_name_the_operator_adds_is_reserved():
    """Builds a JobSet and checks its env against the reserved set, so the two cannot drift."""
    user = [{"name": name, "value": "1"} for name in TRAINER_KNOBS]
    tj = training_job(
        env=user,
        checkpoint={
            "directory": "gs://acme-ckpt/runs",
            "policy": "interval",
            "intervalSteps": 5,
            "keep": {"everySteps": 100},
        },
    )
    pod = build_jobset(tj, attempt=3, resume_step=40)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]
    names = [e["name"] for e in pod["containers"][0]["env"]]
    added = set(names) - set(TRAINER_KNOBS)
    assert added, names
    assert sorted(n for n in added if not api.is_operator_env(n)) == []
    # ... and the reserved set holds no trainer knob.
    assert [n for n in TRAINER_KNOBS if api.is_operator_env(n)] == []


def test_reserved_names_are_well_formed():
    assert len(set(api.OPERATOR_ENV_NAMES)) == len(api.OPERATOR_ENV_NAMES)
    for name in api.OPERATOR_ENV_NAMES:
        assert not name.startswith(api.OPERATOR_ENV_PREFIXES), f"{name} is already covered by a prefix"


@pytest.mark.parametrize("field", ["overheadBudgetPercent", "maxIntervalSeconds"])
@pytest.mark.parametrize("policy", ["continuous", "interval"])
def test_adaptive_settings_are_refused_for_other_policies(field: str, policy: str):
    checkpoint = {"directory": "gs://bkt", "policy": policy, "intervalSteps": 10, field: 5}
    with pytest.raises(ValidationError, match=re.escape(api.ADAPTIVE_ONLY_MESSAGE.format(field=field))):
        training_job(checkpoint=checkpoint)


def test_adaptive_max_interval_below_min_interval_is_refused():
    checkpoint = {"directory": "gs://bkt", "policy": "adaptive", "minIntervalSeconds": 30, "maxIntervalSeconds": 10}
    with pytest.raises(ValidationError, match=re.escape(api.MAX_INTERVAL_MESSAGE)):
        training_job(checkpoint=checkpoint)
    checkpoint["maxIntervalSeconds"] = 30
    assert training_job(checkpoint=checkpoint).spec.checkpoint.max_interval_seconds == 30


@pytest.mark.parametrize("budget", [0, -1, 50.5])
def test_adaptive_budget_out_of_range_is_refused(budget: float):
    with pytest.raises(ValidationError, match=r"spec\.checkpoint\.overheadBudgetPercent"):
        training_job(checkpoint={"directory": "gs://bkt", "policy": "adaptive", "overheadBudgetPercent": budget})


# Issue 17 item 12: what JobSet's webhook (or the Job controller) would refuse after admission, refused
# by the model too, in words.


def _longest_pod_name(tj: api.TrainingJob, attempt: int) -> str:
    """JobSet's webhook check (placement.GenPodName + the Job controller's 5-character suffix), from the manifest."""
    manifest = build_jobset(tj, attempt=attempt, resume_step=None)
    [rjob] = manifest["spec"]["replicatedJobs"]
    last_pod = rjob["template"]["spec"]["completions"] - 1
    return f"{manifest['metadata']['name']}-{rjob['name']}-{rjob['replicas'] - 1}-{last_pod}-abcde"


@pytest.mark.parametrize(
    ("shape", "max_restarts"),
    [
        (("tpu-v5p-slice", "2x2x2", 1), 3),
        (("tpu-v5p-slice", "2x2x2", 2), 3),
        (("tpu-v5p-slice", "16x16x24", 256), 3),  # 1536 hosts per slice
        (("tpu-v6e-slice", "2x2", 12), 10_000),
        (("tpu-v5-lite-podslice", "1x1", 1), 1000),
    ],
)
def test_the_longest_name_allowed_is_the_longest_jobset_accepts(shape: tuple[str, str, int], max_restarts: int):
    accelerator, topology, slices = shape
    spec: dict[str, Any] = {
        "accelerator": accelerator,
        "topology": topology,
        "slices": slices,
        "restart": {"maxRestarts": max_restarts},
    }
    limit = api.max_name_length(training_job(**spec).spec)
    last_attempt = max(api.MIN_RESERVED_ATTEMPTS, max_restarts)
    at_limit = training_job(name="n" * limit, **spec)
    assert len(_longest_pod_name(at_limit, last_attempt)) == api.DNS_LABEL_LENGTH
    with pytest.raises(ValidationError, match=re.escape(api.NAME_LENGTH_MESSAGE.format(limit=limit))):
        training_job(name="n" * (limit + 1), **spec)


@pytest.mark.parametrize("name", ["7b-llama", "llama.v2", "Llama", "llama-", "-llama", "llama_2"])
def test_a_name_that_is_not_a_dns_1035_label_is_refused(name: str):
    with pytest.raises(ValidationError, match=re.escape(api.NAME_DNS_MESSAGE)):
        training_job(name=name)
    assert training_job(name="llama-7b-v2").name == "llama-7b-v2"


@pytest.mark.parametrize("image", [" tpujob:1", "tpujob:1 ", "tpujob:1\n", "\ttpujob:1"])
def test_an_image_with_surrounding_whitespace_is_refused(image: str):
    with pytest.raises(ValidationError, match=re.escape(api.IMAGE_MESSAGE)):
        training_job(image=image)


@pytest.mark.parametrize(
    "value_from",
    [{}, {"secretKeyRef": {"name": "s", "key": "k"}, "configMapKeyRef": {"name": "c", "key": "k"}}],
    ids=["no source", "two sources"],
)
def test_env_value_from_needs_exactly_one_source(value_from: dict[str, Any]):
    with pytest.raises(ValidationError, match=re.escape(api.VALUE_FROM_MESSAGE)):
        training_job(env=[{"name": "X", "valueFrom": value_from}])
    one = {"fieldRef": {"fieldPath": "metadata.name"}}
    assert training_job(env=[{"name": "X", "valueFrom": one}]).spec.env[0].value_from == one  # type: ignore[index]


@pytest.mark.parametrize(
    ("request_", "limit", "refused"),
    [("2", "1", True), ("1500m", "1", True), ("1Gi", "1G", True), (2, "1", True), ("1", "1000m", False),
     ("1G", "1Gi", False), ("1e3", "1k", False), (1, 2, False)],
)  # fmt: skip
def test_a_request_above_its_limit_is_refused_naming_the_key(request_: int | str, limit: int | str, refused: bool):
    resources = {"requests": {"cpu": request_, "memory": "1Gi"}, "limits": {"cpu": limit}}
    if refused:
        with pytest.raises(ValidationError, match=re.escape(api.REQUEST_ABOVE_LIMIT_MESSAGE.format(key="cpu"))):
            training_job(resources=resources)
    else:
        assert training_job(resources=resources).spec.resources is not None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"checkpoint": {"directory": "gs://BUCKET/runs"}}, api.DIRECTORY_MESSAGE),
        ({"checkpoint": {"directory": "gs://b/with space"}}, api.DIRECTORY_MESSAGE),
        ({"checkpoint": {"directory": "s3://bucket"}}, api.DIRECTORY_MESSAGE),
        ({"topology": "2by2"}, api.TOPOLOGY_MESSAGE),
        ({"env": [{"name": "1X", "value": "1"}]}, api.ENV_NAME_MESSAGE),
        ({"priorityClassName": "High"}, api.DNS_SUBDOMAIN_MESSAGE.format(field="priorityClassName")),
        ({"serviceAccountName": "my_sa"}, api.DNS_SUBDOMAIN_MESSAGE.format(field="serviceAccountName")),
    ],
)
def test_a_malformed_value_is_refused_in_words(spec: dict[str, Any], message: str):
    with pytest.raises(ValidationError, match=re.escape(message)) as refused:
        training_job(**spec)
    assert "should match" not in str(refused.value)


def test_every_example_is_a_valid_training_job():
    """Issue 17 item 12: the examples hold no placeholder the CRD refuses (gs://BUCKET did)."""
    folder = Path(__file__).resolve().parents[2] / "examples"
    examples = sorted([*folder.glob("*.yaml"), *folder.glob("own-loop/*.yaml")])
    docs = [d for path in examples for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == api.KIND]
    assert len(docs) >= 3
    for doc in docs:
        api.TrainingJob.model_validate(doc)
