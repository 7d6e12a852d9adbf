"""Table tests of the JobSet builder against reviewed golden manifests (regenerate with
UPDATE_GOLDEN=1 and review the diff)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tpujob_contract as contract
import yaml
from pydantic import ValidationError
from tpujob_contract import ExitCode
from tpujob_operator import frameworks
from tpujob_operator.jobset import (
    IN_PLACE_AGENT,
    WORKER_INIT,
    build_jobset,
    coordinator_host,
    jobset_name,
    worker_command,
)
from tpujob_operator.tpu import slice_shape

from .factories import training_job

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "v5e-1-slice-2x2": dict(accelerator="tpu-v5-lite-podslice", topology="2x2", slices=1),
    "v5p-2-slices-2x2x2": dict(accelerator="tpu-v5p-slice", topology="2x2x2", slices=2),
    "v6e-4-slices-4x4": dict(
        accelerator="tpu-v6e-slice",
        topology="4x4",
        slices=4,
        checkpoint={
            "directory": "gs://acme-ckpt/runs",
            "policy": "interval",
            "intervalSteps": 100,
            "keep": {"latest": 2, "everySteps": 1000},
        },
        env=[{"name": "TPUJOB_MODEL", "value": "1b"}],
        resources={"requests": {"memory": "200Gi"}},
        serviceAccountName="trainer",
        automountServiceAccountToken=True,
    ),
    "v5p-2-slices-in-place": dict(
        accelerator="tpu-v5p-slice",
        topology="2x2x2",
        slices=2,
        restart={"strategy": "InPlace", "inPlace": {"maxRestarts": 5}},
        checkpoint={"directory": "gs://acme-ckpt/runs", "local": {"sizeLimit": "64Gi", "intervalSteps": 5}},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_builder_matches_golden_manifest(case):
    manifest = build_jobset(training_job(**CASES[case]), attempt=1, resume_step=400)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    assert manifest == yaml.safe_load(path.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_shape_and_placement_follow_the_tpu_table(case):
    tj = training_job(**CASES[case])
    shape = slice_shape(tj.spec.tpu.accelerator, tj.spec.tpu.topology)
    manifest = build_jobset(tj, attempt=0, resume_step=None)
    [rjob] = manifest["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    pod = job["template"]["spec"]
    assert rjob["replicas"] == tj.spec.tpu.slices
    assert job["parallelism"] == job["completions"] == shape.hosts
    in_place = tj.spec.restart.strategy == "InPlace"  # JobSet requires a failed pod never to fail its Job
    assert job["backoffLimit"] == (2**31 - 1 if in_place else 0) and job["completionMode"] == "Indexed"
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": tj.spec.tpu.accelerator,
        "cloud.google.com/gke-tpu-topology": tj.spec.tpu.topology,
    }
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == shape.chips_per_host
    assert (
        manifest["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"]
        == "cloud.google.com/gke-nodepool"
    )
    if not in_place:  # the in-place tests below check the other
        assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 0}
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == "0000-1111"


def _env(manifest):
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}


def test_env_carries_the_trainer_contract():
    tj = training_job(slices=2)
    env = _env(build_jobset(tj, attempt=3, resume_step=1200))
    name = jobset_name("llama", 3)
    assert env["TPUJOB_RESUME_STEP"] == "1200"
    assert env["TPUJOB_ATTEMPT"] == "3"
    assert env["TPUJOB_RUN_DIR"] == "gs://acme-ckpt/runs/ml/llama"
    assert env["TPUJOB_COORDINATOR_ADDRESS"] == f"{coordinator_host(name)}:8476"
    assert coordinator_host(name) == "llama-a3-slice-0-0.llama-a3"
    assert env["TPUJOB_NUM_SLICES"] == env["MEGASCALE_NUM_SLICES"] == "2"
    assert env["TPUJOB_HOSTS_PER_SLICE"] == "2"
    assert env["TPUJOB_SLICE_ID"] == {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    assert env["TPUJOB_CHECKPOINT_POLICY"] == "continuous"
    assert env["TPUJOB_CHECKPOINT_ASYNC"] == "true"


def test_no_resume_step_means_latest_committed():
    assert _env(build_jobset(training_job(), attempt=0, resume_step=None))["TPUJOB_RESUME_STEP"] == "latest"


def test_user_env_comes_before_the_contract_and_cannot_name_its_keys():
    with pytest.raises(ValidationError, match="TPUJOB_RESUME_STEP"):
        training_job(env=[{"name": "TPUJOB_RESUME_STEP", "value": "7"}])
    tj = training_job(env=[{"name": "EXTRA", "value": "1"}])
    pod = build_jobset(tj, attempt=0, resume_step=50)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]
    names = [e["name"] for e in pod["containers"][0]["env"]]
    last = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert names.index("EXTRA") < names.index("TPUJOB_NAME")
    assert (last["TPUJOB_RESUME_STEP"], last["TPUJOB_UID"]) == ("50", "0000-1111")


def test_longest_allowed_name_keeps_pod_hostnames_within_dns_label_limit():
    name = "n" * 40
    host = coordinator_host(jobset_name(name, 999)).split(".")[0].replace("-0-0", "-255-255")
    assert len(host) <= 63


ADAPTIVE_NAMES = (
    "TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT",
    "TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS",
    "TPUJOB_MTBF_SECONDS",
)


def test_adaptive_policy_carries_its_budget_bounds_and_the_failure_rate():
    checkpoint = {"directory": "gs://acme-ckpt/runs", "policy": "adaptive", "maxIntervalSeconds": 900}
    status = {"restarts": 3, "goodput": {"wallSeconds": 7200, "badput": {"schedulingSeconds": 600}}}
    env = _env(build_jobset(training_job(checkpoint=checkpoint, status=status), attempt=3, resume_step=None))
    assert env["TPUJOB_CHECKPOINT_POLICY"] == "adaptive"
    assert env["TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT"] == "5.0"  # the documented default
    assert env["TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS"] == "900.0"
    assert float(env["TPUJOB_MTBF_SECONDS"]) == round((7200 - 600 + 6 * 3600) / 4, 1)
    without_max = {"directory": "gs://acme-ckpt/runs", "policy": "adaptive", "overheadBudgetPercent": 10}
    env = _env(build_jobset(training_job(checkpoint=without_max), attempt=0, resume_step=None))
    assert env["TPUJOB_CHECKPOINT_OVERHEAD_BUDGET_PERCENT"] == "10.0"
    assert "TPUJOB_CHECKPOINT_MAX_INTERVAL_SECONDS" not in env


def test_other_policies_carry_no_adaptive_settings():
    env = _env(build_jobset(training_job(), attempt=0, resume_step=None))
    assert not set(ADAPTIVE_NAMES) & set(env)


def test_worker_pods_meet_the_restricted_pod_security_standard():
    pod = build_jobset(training_job(), attempt=0, resume_step=None)["spec"]["replicatedJobs"][0]["template"]["spec"]
    spec = pod["template"]["spec"]
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    for container in spec["containers"]:
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert "privileged" not in container and "hostPort" not in str(container["ports"])
    assert not any(key.startswith("host") for key in spec)  # hostNetwork/hostPID/hostIPC, hostPath volumes
    # No Kubernetes API token unless the spec asks for one.
    assert spec["automountServiceAccountToken"] is False
    asked = build_jobset(training_job(automountServiceAccountToken=True), attempt=0, resume_step=None)
    assert asked["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["automountServiceAccountToken"]


def _worker(manifest):
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("framework", ["tpujob", "maxtext"])
def test_in_place_wraps_the_images_entrypoint_in_jobsets_agent(framework):
    spec = {"framework": framework, "restart": {"strategy": "InPlace"}}
    if framework == "maxtext":
        spec.update(
            args=["model_name=default", "steps=10"],
            checkpoint={"directory": "gs://acme-ckpt/runs/", "policy": "interval", "intervalSteps": 5},
        )
    in_place = build_jobset(training_job(**spec), attempt=0, resume_step=None)
    recreate = build_jobset(training_job(**{**spec, "restart": {}}), attempt=0, resume_step=None)
    worker, plain = _worker(in_place), _worker(recreate)
    env = {e["name"]: e.get("value") for e in worker["env"]}
    entrypoint = {"tpujob": ["tpujob-train"], "maxtext": ["python3", "-m", "maxtext.trainers.pre_train.train"]}
    command = shlex.join([*entrypoint[framework], *plain.get("args", [])])
    assert env["WORKER_COMMAND"] == f"trap : TERM INT; {command}; exit $?"
    assert worker["command"] == ["tpujob-init", "in-place-restart-agent"] and "args" not in worker
    assert env["IN_PLACE_RESTART_EXIT_CODE"] == "86"
    assert env["SHELL"] == "/bin/sh"  # JobSet v0.12's agent runs $SHELL, else bash (none in some images)
    # What the agent's worker sees: the same env as a Recreate attempt's worker, nothing left out.
    assert [e for e in worker["env"] if e["name"] in {p["name"] for p in plain["env"]}] == plain["env"]
    assert in_place["spec"]["failurePolicy"] == {"restartStrategy": "InPlaceRestart", "maxRestarts": 3}
    assert recreate["spec"]["failurePolicy"] == {"maxRestarts": 0}


def test_in_place_restarts_every_exit_but_success_and_those_no_restart_can_fix():
    worker = _worker(build_jobset(training_job(restart={"strategy": "InPlace"}), attempt=0, resume_step=None))
    (rule,) = worker["restartPolicyRules"]
    assert rule["action"] == "Restart" and rule["exitCodes"]["operator"] == "NotIn"
    kept = (ExitCode.OK, ExitCode.CHECKPOINT_INCOMPATIBLE, ExitCode.STORAGE_PERMISSION_DENIED)
    assert sorted(rule["exitCodes"]["values"]) == sorted(int(c) for c in kept)


def test_the_tpujob_frameworks_entrypoint_is_the_trainer_images():
    dockerfile = (Path(__file__).parents[2] / "trainer_image" / "Dockerfile").read_text()
    (line,) = [line for line in dockerfile.splitlines() if line.startswith("ENTRYPOINT")]
    assert tuple(json.loads(line.removeprefix("ENTRYPOINT"))) == frameworks.adapter("tpujob").entrypoint


def test_the_local_tier_is_a_memory_backed_volume_the_trainer_is_pointed_at():
    checkpoint = {"directory": "gs://acme-ckpt/runs", "local": {"sizeLimit": "64Gi"}}
    manifest = build_jobset(training_job(checkpoint=checkpoint), attempt=0, resume_step=None)
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    [volume] = pod["volumes"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}  # lives as long as the pod
    [mount] = pod["containers"][0]["volumeMounts"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert mount["name"] == volume["name"]
    assert env["TPUJOB_LOCAL_CHECKPOINT_DIR"] == mount["mountPath"]
    assert env["TPUJOB_LOCAL_CHECKPOINT_INTERVAL_STEPS"] == str(contract.DEFAULT_LOCAL_INTERVAL_STEPS)
    budget = float(env[contract.Env.LOCAL_CHECKPOINT_OVERHEAD_BUDGET_PERCENT])
    assert budget == contract.DEFAULT_LOCAL_OVERHEAD_BUDGET_PERCENT
    assert env[contract.Env.LOCAL_CHECKPOINT_BUDDY_COPIES] == "true"
    off = {"directory": "gs://acme-ckpt/runs", "local": {"sizeLimit": "64Gi", "buddyCopies": False}}
    off_job = build_jobset(training_job(checkpoint=off), attempt=0, resume_step=None)["spec"]["replicatedJobs"][0]
    off_pod = off_job["template"]["spec"]["template"]["spec"]
    off_env = {e["name"]: e.get("value") for e in off_pod["containers"][0]["env"]}
    assert off_env[contract.Env.LOCAL_CHECKPOINT_BUDDY_COPIES] == "false"  # what the trainer's config reads
    plain = build_jobset(training_job(), attempt=0, resume_step=None)
    plain_pod = plain["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "volumes" not in plain_pod and "TPUJOB_LOCAL_CHECKPOINT_DIR" not in str(plain_pod)


@pytest.mark.parametrize("size", ["0", "-1Gi", "lots", ""])
def test_a_local_tier_needs_a_positive_size(size):
    with pytest.raises(ValidationError, match=r"spec\.checkpoint\.local\.sizeLimit"):
        training_job(checkpoint={"directory": "gs://acme-ckpt/runs", "local": {"sizeLimit": size}})


@pytest.mark.parametrize(("killed_by", "code"), [(None, 3), (signal.SIGKILL, 137), (signal.SIGTERM, 143)])
def test_the_worker_command_exits_as_a_runtime_reports_its_worker(tmp_path, killed_by, code):
    """What the agent runs, in a real shell: a signalled worker is 128+N (the agent says 255 otherwise)."""
    worker = ["sh", "-c", f"kill -{killed_by.name.removeprefix('SIG')} $$" if killed_by else "exit 3"]
    done = subprocess.run(["sh", "-c", worker_command(worker)], cwd=tmp_path, check=False)
    assert done.returncode == code


def test_the_worker_command_waits_for_its_workers_sigterm_save(tmp_path):
    """tpujob-init sends SIGTERM to every process but the agent: the shell among them outlives it, waits
    for the worker's save, and exits with the worker's code."""
    saver = "import signal,sys,time\ndef h(*_):\n time.sleep(0.5); open('saved','w'); sys.exit(143)\n"
    saver += "signal.signal(signal.SIGTERM, h); open('ready','w'); time.sleep(60)"
    shell = subprocess.Popen(["sh", "-c", worker_command([sys.executable, "-c", saver])], cwd=tmp_path)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and shell.poll() is None
        time.sleep(0.05)
    for pid in [shell.pid, *_children(shell.pid)]:
        os.kill(pid, signal.SIGTERM)
    assert shell.wait(30) == 143 and (tmp_path / "saved").exists()


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_the_trainer_image_holds_the_agent_of_the_jobset_the_devcluster_runs():
    root = Path(__file__).parents[2]
    dockerfile = (root / "trainer_image" / "Dockerfile").read_text()
    pinned = re.search(
        r'^JOBSET_VERSION="\$\{JOBSET_VERSION:-(v[0-9.]+)\}"', (root / "devcluster" / "build.sh").read_text(), re.M
    )
    assert pinned is not None and f"ARG JOBSET_VERSION={pinned.group(1)}\n" in dockerfile
    assert f"/usr/local/bin/{IN_PLACE_AGENT}\n" in dockerfile  # on the image's PATH, as the builder names it
    assert f"/usr/local/bin/{WORKER_INIT}\n" in dockerfile


def test_the_restart_action_is_what_the_nodes_can_do():
    tj = training_job(restart={"strategy": "InPlace"})
    beta = _worker(build_jobset(tj, attempt=0, resume_step=None))
    alpha = _worker(build_jobset(tj, attempt=0, resume_step=None, restart_action="RestartAllContainers"))
    assert [r["action"] for r in beta["restartPolicyRules"]] == ["Restart"]  # 1.35's beta, with back-off
    assert [r["action"] for r in alpha["restartPolicyRules"]] == ["RestartAllContainers"]
    assert alpha["restartPolicyRules"][0]["exitCodes"] == beta["restartPolicyRules"][0]["exitCodes"]
    recreate = _worker(build_jobset(training_job(), attempt=0, resume_step=None, restart_action="RestartAllContainers"))
    assert "restartPolicyRules" not in recreate  # only InPlace jobs restart containers


def test_the_operator_flag_reaches_the_builder():
    from tpujob_operator import __main__ as main

    default = main.runtime_settings(main.parse_args(["--no-leader-elect"]))
    chosen = main.runtime_settings(
        main.parse_args(["--no-leader-elect", "--in-place-restart-action", "RestartAllContainers"])
    )
    assert (default.in_place_restart_action, chosen.in_place_restart_action) == ("Restart", "RestartAllContainers")
    with pytest.raises(SystemExit):
        main.parse_args(["--no-leader-elect", "--in-place-restart-action", "Reboot"])
