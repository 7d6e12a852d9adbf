"""The Framework protocol (frameworks/): each adapter's container is the one the JobSet carries, its
admission rules are the CRD's, lookup knows exactly the frameworks the API admits, and the package
imports without a circle whichever module is imported first."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from tpujob_operator import api, frameworks
from tpujob_operator.frameworks import admission
from tpujob_operator.jobset import build_jobset, coordinator_host, jobset_name, trainer_env
from tpujob_operator.tpu import slice_shape

from .factories import training_job

ROOT = Path(__file__).parents[2]
JOBS = {
    "tpujob": lambda: training_job(args=["--model", "tiny", "--steps=50"]),
    "maxtext": lambda: training_job(framework="maxtext", image="maxtext:0.2.5", args=["steps=50"]),
}


def _container(manifest: dict[str, Any]) -> dict[str, Any]:
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return pod["containers"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(JOBS))
def test_each_adapters_args_and_env_are_the_containers(name):
    tj = JOBS[name]()
    framework = frameworks.for_job(tj)
    assert framework is frameworks.adapter(name) and framework.name == name
    js_name, hosts = jobset_name(tj.name, 3), slice_shape(tj.spec.tpu.accelerator, tj.spec.tpu.topology).hosts
    container = _container(build_jobset(tj, attempt=3, resume_step=7))
    assert container.get("args", []) == framework.args(tj)
    contract_env = trainer_env(tj, 3, 7, js_name)
    assert container["env"][: len(contract_env)] == contract_env  # the contract's, whatever the framework
    added = container["env"][len(contract_env) :]
    literal = framework.env(tj, coordinator_host(js_name), hosts)
    assert added[: len(literal)] == literal
    slice_index = {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    assert added[len(literal) :] == [{"name": n, "valueFrom": slice_index} for n in framework.slice_index_env]


def test_only_maxtext_adds_to_the_container_and_reads_progress_from_the_listing():
    tpujob, maxtext = frameworks.adapter("tpujob"), frameworks.adapter("maxtext")
    tj = JOBS["tpujob"]()
    assert tpujob.args(tj) == ["--model", "tiny", "--steps=50"] and tpujob.env(tj, "c", 2) == []
    assert not tpujob.progress_from_listing and tpujob.read_progress(None, tj, 10, []) is None  # type: ignore[arg-type]
    assert maxtext.progress_from_listing and maxtext.slice_index_env == ("JOB_INDEX",)


def test_final_step_is_the_frameworks():
    assert frameworks.for_job(JOBS["tpujob"]()).final_step(JOBS["tpujob"]()) == 50  # --steps=50
    assert frameworks.for_job(JOBS["maxtext"]()).final_step(JOBS["maxtext"]()) == 49  # loop steps 0..49


def test_lookup_knows_exactly_the_frameworks_the_api_admits():
    admitted = typing.get_args(api.TrainingJobSpec.model_fields["framework"].annotation)
    assert set(admitted) == set(frameworks.ADAPTERS)
    with pytest.raises(ValueError, match=r"unknown framework 'pytorch' \(known: tpujob, maxtext\)"):
        frameworks.adapter("pytorch")


def test_the_crd_carries_every_adapters_admission_rules():
    """The generated CRD the apiserver is given (crds/trainingjob.yaml), not the models' schema."""
    crd = yaml.safe_load((ROOT / "crds" / "trainingjob.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [r for a in frameworks.ADAPTERS.values() for r in a.cel_rules]
    assert rules and [r for r in spec["x-kubernetes-validations"] if r in rules] == rules
    assert rules == admission.CEL_RULES  # what api.py puts in the schema: each adapter's, nothing else


@pytest.mark.parametrize(
    "change",
    [
        {"checkpoint": {"directory": "gs://b-1/x", "policy": "adaptive"}},
        {"args": ["run_name=x"]},
        {"env": [{"name": "JAX_PROCESS_COUNT", "value": "9"}]},
    ],
)
def test_refusals_are_the_adapters(change):
    spec = training_job(**change).spec  # admitted for the project's trainer
    as_maxtext = spec.model_copy(update={"framework": "maxtext"})
    assert frameworks.adapter("tpujob").refusals(spec) == admission.refusals(spec) == []
    assert frameworks.adapter("maxtext").refusals(as_maxtext) == admission.refusals(as_maxtext) != []


@pytest.mark.parametrize("first", ["tpujob_operator.api", "tpujob_operator.frameworks.maxtext"])
def test_imports_without_a_circle_whichever_module_comes_first(first):
    """api.py imports frameworks/admission.py (running frameworks/__init__.py and the adapters): an
    adapter that imported api.py at run time would find it half built."""
    code = f"import {first}; from tpujob_operator import api, frameworks; frameworks.for_job"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_no_branch_on_the_framework_outside_the_adapters():
    """What differs between frameworks is asked of the adapter (frameworks/), never tested elsewhere."""
    package = ROOT / "operator" / "src" / "tpujob_operator"
    branch = re.compile(r"\bframework\s*(==|!=|\bin\b)|\bFRAMEWORK\b")
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if "frameworks" not in path.relative_to(package).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert found == []
