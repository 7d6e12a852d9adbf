"""tpujob-init (trainer_image/init), the InPlace worker container's PID 1, as real processes.

STAND_IN_AGENT stands in for JobSet's in-place-restart agent (the real one needs an apiserver and its
JobSet: tests/e2e/test_in_place.py runs it). It does with signals what the agent does (v0.11 and v0.12,
whose SHELL the operator sets to /bin/sh): it runs WORKER_COMMAND with `sh -c`, exits with the worker's
code, and on SIGTERM or SIGINT kills its shell (exec.CommandContext's SIGKILL) and exits with 128+N at
once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from tpujob_devcluster.controlplane import IMAGE_BIN_DIR, build_binaries
from tpujob_operator.jobset import WORKER_INIT, worker_command

STAND_IN_AGENT = """
import os, signal, subprocess, sys, time
if os.environ.get("BARRIER_SECONDS"):
    signal.signal(signal.SIGTERM, lambda *_: (open("agent-signalled", "w"), sys.exit(143)))
    open("at-barrier", "w")
    time.sleep(float(os.environ["BARRIER_SECONDS"]))
shell = subprocess.Popen(["/bin/sh", "-c", os.environ["WORKER_COMMAND"]])
def stop(signum, _frame):
    open("agent-signalled", "w")
    shell.kill()
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
code = shell.wait()
sys.exit(code if code >= 0 else 255)
"""

# The trainer's part: on SIGTERM it takes a while to save, then exits 143 (the contract's "preempted").
SAVING_WORKER = """
import signal, sys, time
def save(*_):
    time.sleep(1.0)
    open("saved", "w")
    sys.exit(143)
signal.signal(signal.SIGTERM, save)
open("training", "w")
time.sleep(60)
"""


@pytest.fixture(scope="module")
def init() -> Path:
    build_binaries("init")
    return IMAGE_BIN_DIR / WORKER_INIT


def _start(init: Path, tmp_path: Path, worker: list[str], **env: str) -> subprocess.Popen[bytes]:
    agent = tmp_path / "agent.py"
    agent.write_text(STAND_IN_AGENT)
    return subprocess.Popen(
        [str(init), sys.executable, str(agent)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "WORKER_COMMAND": worker_command(worker), **env},
    )


def _wait_for(path: Path, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert process.poll() is None, f"exited {process.returncode} before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.05)


def test_sigterm_reaches_the_worker_not_the_agent_and_the_save_completes(init, tmp_path):
    process = _start(init, tmp_path, [sys.executable, "-c", SAVING_WORKER])
    _wait_for(tmp_path / "training", process)
    process.terminate()  # the runtime signals PID 1 only
    assert process.wait(30) == 143
    assert (tmp_path / "saved").exists()
    assert not (tmp_path / "agent-signalled").exists()


def test_sigterm_with_no_worker_running_stops_the_agent_at_once(init, tmp_path):
    """The agent waiting at JobSet's barrier: nothing to save, so the pod need not wait out its grace."""
    process = _start(init, tmp_path, ["true"], BARRIER_SECONDS="60")
    _wait_for(tmp_path / "at-barrier", process)
    started = time.monotonic()
    process.terminate()
    assert process.wait(30) == 143 and time.monotonic() - started < 10
    assert (tmp_path / "agent-signalled").exists()


@pytest.mark.parametrize(("worker", "code"), [(["sh", "-c", "exit 3"], 3), (["sh", "-c", "kill -KILL $$"], 137)])
def test_it_exits_with_the_agents_code(init, tmp_path, worker, code):
    assert _start(init, tmp_path, worker).wait(30) == code
