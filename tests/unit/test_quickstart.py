"""The GKE quickstart (docs/quickstart.md) is checked, not run (CI has no Google Cloud): its Helm
values render with the chart, its TrainingJob passes the API and the policy those values give the
operator, and the names it uses (the chart's ServiceAccount and Deployment, the workers' label and
container, the run directory, the printer columns) are the code's."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import yaml
from tpujob_contract import LABEL_NAME, checkpoints_dir, run_dir
from tpujob_operator import api, policy
from tpujob_operator.jobset import CONTAINER

from .test_docs import DOCS, ROOT
from .test_docs_drift import helm_template

QUICKSTART = DOCS / "quickstart.md"
# What step 1 sets, as a user might.
VARIABLES = {
    "PROJECT_ID": "acme-ml",
    "ZONE": "us-west4-a",
    "REGION": "us-west4",
    "BUCKET": "acme-ml-tpujob",
    "REGISTRY": "us-west4-docker.pkg.dev/acme-ml/tpujob",
    "TAG": "0.1.0",
}


def _text() -> str:
    return QUICKSTART.read_text()


def _expand(text: str) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: VARIABLES[m.group(1) or m.group(2)], text)


def _shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", _text(), re.S)


def _command(first_words: str) -> list[str]:
    """The first command starting with `first_words`, its continuation lines joined, expanded, split."""
    for block in _shell_blocks():
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if line.strip().startswith(first_words):
                return shlex.split(_expand(line.split("#")[0] if " # " in line else line))
    raise AssertionError(f"no `{first_words}` command in {QUICKSTART.name}")


def _helm_sets() -> list[str]:
    words = _command("helm install")
    return [words[i + 1] for i, word in enumerate(words) if word == "--set"]


def _rendered() -> list[dict[str, Any]]:
    sets = [arg for value in _helm_sets() for arg in ("--set", value)]
    result = helm_template(*sets)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _training_job() -> api.TrainingJob:
    [manifest] = re.findall(r"kubectl apply -n ml -f - <<EOF\n(.*?)\nEOF", _text(), re.S)
    body = yaml.safe_load(_expand(manifest))
    body["metadata"] |= {"namespace": "ml", "uid": "u1", "generation": 1}
    return api.TrainingJob.model_validate(body)


def test_every_variable_the_page_uses_is_set_in_its_first_block() -> None:
    first = _shell_blocks()[0]
    exported = set(re.findall(r"^export (\w+)=", first, re.M))
    later = _shell_blocks()[1:]
    used = {a or b for block in later for a, b in re.findall(r"\$\{(\w+)\}|\$(\w+)", block)}
    local = {name for block in later for name in re.findall(r"^(?:for )?(\w+)(?:=| in )", block, re.M)}
    assert used - local <= exported, used - local - exported
    assert set(VARIABLES) <= exported


def test_the_helm_values_render_and_give_the_operator_a_policy_the_first_job_passes() -> None:
    objects = _rendered()
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    [account] = [o for o in objects if o["kind"] == "ServiceAccount"]
    # Step 3's table binds these names; step 5 waits on the Deployment by name.
    assert account["metadata"]["name"] == "tpujob" and "sa/tpujob" in _text()
    assert deployment["metadata"]["name"] == "tpujob" and "deployment/tpujob" in _text()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{VARIABLES['REGISTRY']}/tpujob-operator:{VARIABLES['TAG']}"

    parser = argparse.ArgumentParser()
    policy.add_arguments(parser)
    known, _ = parser.parse_known_args(container.get("args", []))
    rules = policy.from_arguments(known, environ={"POD_NAMESPACE": "tpujob-system"})
    assert rules.checkpoint_locations == (f"gs://{VARIABLES['BUCKET']}",)
    assert rules.service_accounts == ("trainer",)
    tj = _training_job()
    assert policy.violations(tj, rules) == []
    # The same job elsewhere is refused: the policy the page installs is not "anything goes".
    elsewhere = tj.model_copy(deep=True)
    elsewhere.spec.checkpoint.directory = "gs://someone-else/runs"
    assert policy.violations(elsewhere, rules)


def test_the_names_the_page_reads_are_the_codes() -> None:
    tj = _training_job()
    assert tj.spec.service_account_name == "trainer" and "sa/trainer" in _text()
    logs = _command("kubectl logs")
    assert f"{LABEL_NAME}={tj.name}" in logs and logs[logs.index("-c") + 1] == CONTAINER
    listed = _command("gcloud storage ls")[-1]
    assert listed.rstrip("/") == checkpoints_dir(run_dir(tj.spec.checkpoint.directory, "ml", tj.name))
    crd = yaml.safe_load((ROOT / "crds" / "trainingjob.yaml").read_text())
    columns = {c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    named = set(re.findall(r"`(\w+)`", _text().split("## 7. Watch it")[1].split("## 9.")[0]))
    assert {"Phase", "Step", "Checkpoint", "Goodput", "Restarts"} <= named & columns


def test_the_cloud_build_config_builds_the_two_images_the_page_installs() -> None:
    config = yaml.safe_load((ROOT / "cloudbuild.yaml").read_text())
    built = {tuple(step["args"][step["args"].index("-f") + 1 :][:1]): step["args"] for step in config["steps"]}
    assert set(built) == {("Dockerfile",), ("trainer_image/Dockerfile",)}
    for dockerfile in built:
        assert (ROOT / dockerfile[0]).is_file()
    assert sorted(config["images"]) == [
        "${_REGISTRY}/tpujob-operator:${_TAG}",
        "${_REGISTRY}/tpujob-trainer:${_TAG}",
    ]
    assert "tpujob-trainer:${TAG}" in _text() and Path(ROOT / "cloudbuild.yaml").name in _text()
