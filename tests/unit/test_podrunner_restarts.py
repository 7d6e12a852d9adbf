"""The pod runner's restart decisions, as the Kubernetes 1.35 kubelet makes them with
ContainerRestartRules and RestartAllContainersOnContainerExits on (pkg/api/v1/pod/util.go
ContainerShouldRestart, pkg/kubelet/kuberuntime doBackOff, client-go flowcontrol.Backoff), and
the status it reports; the in-place path through the real agent is tests/integration/test_in_place_engine.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tpujob_devcluster.podrunner import (
    BACKOFF_INITIAL_S,
    BACKOFF_MAX_S,
    REPO_ROOT,
    RESTART,
    RESTART_ALL,
    VolumeMount,
    could_restart_all,
    empty_dir_mounts,
    exit_action,
    image_path,
    image_workdir,
    load_image_paths,
    load_image_workdirs,
    matching_restart_rule,
    mount_commands,
    pod_status,
    quantity_bytes,
    restart_backoff,
    restarts_in_place,
    terminal_phase,
)

RULES = [
    {"action": RESTART_ALL, "exitCodes": {"operator": "In", "values": [42]}},
    {"action": RESTART, "exitCodes": {"operator": "NotIn", "values": [0, 42, 7]}},
]


@pytest.mark.parametrize(
    ("pod_policy", "exit_code", "expected"),
    [
        ("Never", 0, None),
        ("Never", 1, None),
        ("OnFailure", 0, None),
        ("OnFailure", 1, RESTART),
        ("OnFailure", 137, RESTART),
        ("Always", 0, RESTART),
        (None, 0, RESTART),  # the API's default is Always
    ],
)
def test_the_pods_restart_policy_decides_without_a_container_policy(pod_policy, exit_code, expected):
    spec = {"restartPolicy": pod_policy} if pod_policy else {}
    assert exit_action(spec, {"name": "c"}, exit_code) == expected


@pytest.mark.parametrize(
    ("exit_code", "expected"),
    [(42, RESTART_ALL), (1, RESTART), (0, None), (7, None)],  # 7: no rule matches, restartPolicy Never holds
)
def test_a_containers_rules_win_over_the_pods_policy(exit_code, expected):
    container = {"name": "c", "restartPolicy": "Never", "restartPolicyRules": RULES}
    assert exit_action({"restartPolicy": "OnFailure"}, container, exit_code) == expected


def test_a_containers_own_policy_applies_when_no_rule_matches():
    on_failure = {"name": "c", "restartPolicy": "OnFailure", "restartPolicyRules": RULES[:1]}
    assert exit_action({"restartPolicy": "Never"}, on_failure, 3) == RESTART
    assert exit_action({"restartPolicy": "Always"}, on_failure, 0) is None
    always = {"name": "c", "restartPolicy": "Always"}
    assert exit_action({"restartPolicy": "Never"}, always, 0) == RESTART


def test_the_first_matching_rule_wins_and_a_rule_needs_exit_codes():
    container = {"restartPolicy": "Never", "restartPolicyRules": [{"action": RESTART}, *RULES]}
    assert matching_restart_rule(container, 42) == RULES[0]
    assert matching_restart_rule(container, 5) == RULES[1]
    assert matching_restart_rule(container, 0) is None


def test_the_runner_restarts_on_failure_pods_and_containers_with_a_policy_not_deployments():
    assert restarts_in_place({"restartPolicy": "OnFailure"}, {"name": "c"})
    assert restarts_in_place({"restartPolicy": "Never"}, {"name": "c", "restartPolicy": "Never"})
    assert not restarts_in_place({"restartPolicy": "Never"}, {"name": "c"})  # every TrainingJob pod today
    assert not restarts_in_place({"restartPolicy": "Always"}, {"name": "c"})  # the operator's Deployment


def test_only_pods_with_a_restart_all_rule_carry_the_condition():
    assert could_restart_all({"containers": [{"restartPolicy": "Never", "restartPolicyRules": RULES}]})
    assert could_restart_all({"initContainers": [{"restartPolicyRules": RULES[:1]}], "containers": [{}]})
    assert not could_restart_all({"containers": [{"restartPolicy": "Never", "restartPolicyRules": RULES[1:]}]})
    assert not could_restart_all({"containers": [{"name": "c"}]})


@pytest.mark.parametrize(("exit_code", "phase"), [(0, "Succeeded"), (1, "Failed"), (143, "Failed"), (137, "Failed")])
def test_a_pod_being_deleted_ends_succeeded_when_its_container_exited_0(exit_code, phase):
    """kubelet_pods.go getPhase for a terminal pod: a worker that finished its last step while it was
    being evicted is Succeeded (its Job completes), not Failed (JobSet would restart every worker)."""
    assert terminal_phase(exit_code) == phase


def test_crash_loop_backoff_is_immediate_then_10s_doubling_to_5_minutes():
    """A container that exits right after each start: restart 1 at once, then 10, 20, 40 ... 300 s."""
    entry, clock, delays = None, 1000.0, []
    for _ in range(8):
        finished = clock  # exits as soon as it started
        delay, entry = restart_backoff(entry, finished, clock)
        delays.append(delay)
        clock += delay
    assert delays == [0.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]
    assert (BACKOFF_INITIAL_S, BACKOFF_MAX_S) == (10.0, 300.0)


def test_the_backoff_counts_from_the_exit_and_is_forgotten_after_twice_the_maximum():
    _, entry = restart_backoff(None, 0.0, 0.0)
    # It exited at 4 s and is looked at 3 s later: 7 s of the armed 10 s are left (counted from the exit).
    delay, entry = restart_backoff(entry, 4.0, 7.0)
    assert delay == 7.0 and entry.period == 20.0
    # Exited at 35 s and is looked at 25 s later: the armed 20 s are over, the period still doubles.
    delay, entry = restart_backoff(entry, 35.0, 60.0)
    assert delay == 0.0 and entry.period == 40.0
    # Stable for more than 2 x 300 s since the last restart: back to an immediate restart and 10 s.
    delay, entry = restart_backoff(entry, 60.0 + 601.0, 60.0 + 601.0)
    assert delay == 0.0 and entry.period == BACKOFF_INITIAL_S


def test_status_after_a_restart_names_the_last_termination_and_clears_the_old_state():
    container = {"name": "worker", "image": "tpujob-trainer:dev"}
    last = {"exitCode": 1, "reason": "Error"}
    waiting = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}
    status = pod_status("Running", container, waiting, "t", ip="127.2.0.1", restart_count=2, last_terminated=last)
    (entry,) = status["containerStatuses"]
    assert entry["restartCount"] == 2 and entry["lastState"] == {"terminated": last}
    # null deletes the earlier `running` in the apiserver's strategic merge
    assert entry["state"] == {"running": None, "waiting": waiting["waiting"], "terminated": None}
    assert not entry["ready"] and status["podIP"] == "127.2.0.1"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Ready"] == "False" and "AllContainersRestarting" not in conditions
    restarting = pod_status("Running", container, {"terminated": last}, "t", restart_count=1, restarting_all=True)
    condition = next(c for c in restarting["conditions"] if c["type"] == "AllContainersRestarting")
    assert condition["status"] == "True" and condition["reason"] == "RestartAllContainersStarted"


def test_status_of_a_pod_that_never_restarted_is_as_before():
    container = {"name": "trainer", "image": "tpujob-trainer:dev"}
    status = pod_status("Running", container, {"running": {"startedAt": "s"}}, "t", ip="127.2.0.1", start_time="s")
    assert status["containerStatuses"] == [
        {
            "name": "trainer",
            "ready": True,
            "restartCount": 0,
            "image": "tpujob-trainer:dev",
            "imageID": "",
            "started": True,
            "state": {"running": {"startedAt": "s"}},
        }
    ]
    assert status["startTime"] == "s" and [c["type"] for c in status["conditions"]] == [
        "PodScheduled",
        "Initialized",
        "ContainersReady",
        "Ready",
    ]


def test_empty_dir_mounts_of_the_container(tmp_path: Path):
    spec = {
        "volumes": [
            {"name": "local", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "config", "configMap": {"name": "x"}},
        ]
    }
    container = {
        "volumeMounts": [
            {"name": "local", "mountPath": "/local"},
            {"name": "scratch", "mountPath": "/scratch", "readOnly": True},
            {"name": "config", "mountPath": "/config"},
        ]
    }
    local, scratch = empty_dir_mounts(spec, container, tmp_path)
    assert (local.source, local.mount_path, local.memory, local.size_bytes) == (
        tmp_path / "local",
        "/local",
        True,
        2 << 30,
    )
    assert (scratch.memory, scratch.size_bytes, scratch.read_only) == (False, None, True)
    assert [quantity_bytes(q) for q in ("16Mi", "1G", "512", "1.5Ki")] == [16 << 20, 10**9, 512, 1536]
    with pytest.raises(ValueError):
        quantity_bytes("lots")


def test_a_shell_in_the_trainer_image_finds_the_projects_python(tmp_path: Path):
    """`python -m tpujob_trainer` as the agent's WORKER_COMMAND: a real `sh -c` on the image's PATH."""
    entries = image_path(
        "gcr.io/x/tpujob-trainer:dev", load_image_paths(REPO_ROOT / "devcluster" / "images.yaml"), sys.executable
    )
    assert entries == [str(Path(sys.executable).parent)]
    found = subprocess.run(
        ["sh", "-c", "python -c 'import sys; print(sys.prefix)'"],
        env={"PATH": ":".join([*entries, "/usr/bin:/bin"])},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert os.path.samefile(found, sys.prefix)
    assert image_path("busybox", load_image_paths(REPO_ROOT / "devcluster" / "images.yaml"), sys.executable) == []


def test_each_image_finds_the_entrypoint_its_framework_declares(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The agent runs a framework's entrypoint (frameworks/) by name: the image's PATH must hold it."""
    from tpujob_operator import frameworks

    monkeypatch.setenv("TPUJOB_CACHE", str(tmp_path))
    paths = load_image_paths(REPO_ROOT / "devcluster" / "images.yaml")
    maxtext = image_path("tpujob-maxtext:dev", paths, sys.executable)
    assert maxtext == [str(tmp_path / "maxtext" / "0.2.5" / "bin")]
    assert frameworks.adapter("maxtext").entrypoint[0] == "python3"  # what MaxText's venv has in bin/
    trainer = image_path("tpujob-trainer:dev", paths, sys.executable)
    assert (Path(trainer[0]) / frameworks.adapter("tpujob").entrypoint[0]).exists()  # the console script


def test_the_own_loop_images_command_runs_the_example_from_its_workdir():
    """`command: ["python", "train.py"]` (examples/own-loop/trainingjob.yaml) in the image's WORKDIR, as the
    pod runner starts it: the example file, found by that shell on the image's PATH."""
    table = REPO_ROOT / "devcluster" / "images.yaml"
    workdir = image_workdir("tpujob-own-loop:dev", load_image_workdirs(table), sys.executable)
    assert workdir == str(REPO_ROOT / "examples" / "own-loop")
    entries = image_path("tpujob-own-loop:dev", load_image_paths(table), sys.executable)
    found = subprocess.run(
        [
            "sh",
            "-c",
            f'cd {workdir} && exec "$@"',
            "pod",
            "python",
            "-c",
            "import os; print(os.path.abspath('train.py'))",
        ],
        env={"PATH": ":".join([*entries, "/usr/bin:/bin"])},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert Path(found) == REPO_ROOT / "examples" / "own-loop" / "train.py" and Path(found).is_file()
    assert image_workdir("tpujob-trainer:dev", load_image_workdirs(table), sys.executable) is None


def test_a_volume_never_hides_the_hosts_files_the_container_runs_from(tmp_path: Path):
    """The chart's operator mounts an emptyDir at /tmp; a checkout (and its venv) under /tmp must stay visible."""
    (tmp_path / "venv").mkdir()
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    mounts = [
        VolumeMount(
            name=n, source=tmp_path / "src" / n, mount_path=str(p), memory=False, size_bytes=None, read_only=False
        )
        for n, p in (("tmp", tmp_path), ("empty", empty), ("local", missing))
    ]
    commands = " ".join(mount_commands(mounts))
    assert str(empty) in commands and str(missing) in commands  # nothing of the host's there
    assert f"mount --bind {tmp_path / 'src' / 'tmp'} " not in commands  # it would hide tmp_path/venv
