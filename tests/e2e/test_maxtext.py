"""Real MaxText (PyPI maxtext 0.2.5, unchanged) as a TrainingJob with spec.framework maxtext: a
multi-host job (1 slice x 2 hosts, two JAX processes) is SIGKILLed after several continuous saves;
the operator restarts it, MaxText resumes from the latest committed step (its own log says so), and
the job succeeds with the lost steps in status matching MaxText's log.

The truths are MaxText's log ("completed step: k", "restoring from this run's directory step k") and
the bucket (commit markers); the operator knows neither: it reads the commit metadata and the
gcs_metrics files (frameworks/maxtext.py). The venv comes from devcluster/maxtext_venv.sh (cached).
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from typing import Any

import pytest
from tpujob_devcluster.cluster import BUCKET
from tpujob_devcluster.controlplane import REPO_ROOT
from tpujob_operator import api

from .conftest import E2E

pytestmark = pytest.mark.slow

STEPS = 300
# A tiny MaxText model on CPU (examples/maxtext.yaml's, with a metrics file per step).
ARGS = [
    "model_name=default",
    "override_model_config=true",
    "base_num_decoder_layers=1",
    "base_emb_dim=32",
    "base_mlp_dim=64",
    "base_num_query_heads=2",
    "base_num_kv_heads=2",
    "head_dim=16",
    "vocab_size=256",
    "max_target_length=32",
    "per_device_batch_size=1",
    "attention=dot_product",
    "dataset_type=synthetic",
    "hardware=cpu",
    "gcs_metrics=true",
    "log_period=1",
    f"steps={STEPS}",
]
COMPLETED = re.compile(r"completed step: (\d+)")
RESTORED = re.compile(r"restoring from this run's directory step (\d+)")


@pytest.fixture(scope="module", autouse=True)
def maxtext_venv() -> None:
    """The devcluster's MaxText image (devcluster/images.yaml): built once, then cached."""
    subprocess.run([str(REPO_ROOT / "devcluster" / "maxtext_venv.sh")], check=True, stdout=subprocess.DEVNULL)


def _log(e2e: E2E, pod_prefix: str) -> str:
    [directory] = [d for d in e2e.pod_dirs(pod_prefix.rsplit("-a", 1)[0]) if d.name.startswith(pod_prefix)]
    return (directory / "log").read_text(errors="replace")


def _metrics_steps(e2e: E2E, name: str) -> list[int]:
    prefix = f"e2e/{e2e.namespace}/{name}/metrics/metrics_step_"
    return sorted(int(b.name.rsplit("_", 1)[1].split(".")[0]) for b in e2e.gcs.list_blobs(BUCKET, prefix=prefix))


def _stop_consistent(e2e: E2E, name: str, pod: str) -> tuple[int, int]:
    """SIGSTOP MaxText's process 0 where its log and its metrics files agree on the last step (the
    log line comes just before the upload), and return (that step, latest committed step)."""
    for _ in range(50):
        e2e.signal_pod(pod, signal.SIGSTOP)
        time.sleep(0.3)  # a request in flight lands
        logged = [int(s) for s in COMPLETED.findall(_log(e2e, pod))]
        uploaded = _metrics_steps(e2e, name)
        if logged and uploaded and logged[-1] == uploaded[-1]:
            return logged[-1], e2e.committed_steps(name)[-1]
        e2e.signal_pod(pod, signal.SIGCONT)
        time.sleep(0.2)
    raise AssertionError("MaxText's log and metrics files never agreed")


@pytest.mark.timeout(1200)  # a backstop: the waits fail on a stall, not on a slow machine
def test_maxtext_resumes_from_the_latest_committed_step_after_sigkill(e2e: E2E) -> None:
    name = "maxtext"
    manifest: dict[str, Any] = {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "metadata": {"name": name},
        "spec": {
            "framework": "maxtext",
            "image": "tpujob-maxtext:dev",
            "args": ARGS,
            "tpu": {"accelerator": "tpu-v5p-slice", "topology": "2x2x2", "slices": 1},  # 2 hosts
            "checkpoint": {"directory": f"gs://{BUCKET}/e2e", "policy": "continuous", "keep": {"latest": 3}},
            "restart": {"backoffSeconds": 1, "maxRestarts": 1},
        },
    }
    e2e.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, e2e.namespace, api.PLURAL, manifest)

    # Several continuous saves first (the bucket's commit markers), while MaxText trains.
    seen: set[int] = set()

    def saved_several() -> bool:
        seen.update(e2e.committed_steps(name))
        return len(seen) >= 4

    e2e.until(saved_several, 240, f"4 committed MaxText steps\n{e2e.logs_tail(name)}")
    status = e2e.wait(name, lambda s: s.get("phase") == "Running", 60, "Running")
    coordinator = e2e.running_pod(f"{name}-a0-slice-0-0")
    assert "Jax distributed system initialized on CPUs!" in _log(e2e, coordinator)  # two JAX processes

    # SIGKILL process 0 (the JAX coordinator) at a step its log and its metrics files agree on.
    logged, committed = _stop_consistent(e2e, name, coordinator)
    assert committed in seen or committed > max(seen)
    e2e.signal_pod(coordinator, signal.SIGKILL)
    killed_at = time.monotonic()

    status = e2e.wait_working(name, lambda s: s.get("phase") == "Succeeded", "Succeeded after the restart")
    failure = status["lastFailure"]
    assert (status["restarts"], failure["kind"], failure["reason"]) == (1, "ApplicationError", "ExitCode137")

    # MaxText's own word on the resume: the latest committed step at the kill, then the next step.
    resumed = _log(e2e, f"{name}-a1-slice-0-0")
    [restored] = [int(s) for s in RESTORED.findall(resumed)]
    assert restored == committed == failure["resumeStep"] == status["resumedFromStep"]
    assert int(COMPLETED.findall(resumed)[0]) == restored + 1
    # Lost: what the log shows trained past the commit it resumed from.
    assert failure["step"] == max(logged, committed)
    assert failure["lostSteps"] == status["lostSteps"] == max(0, logged - restored)
    assert status["step"] == STEPS - 1 and status["latestCheckpoint"]["step"] == STEPS - 1
    print(f"killed at step {logged} (committed {committed}); succeeded {time.monotonic() - killed_at:.0f}s later")
