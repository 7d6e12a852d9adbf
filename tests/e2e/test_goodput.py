"""The goodput ledger and /metrics on the devcluster: a job that is killed once and preempted once
accounts for its wall time, and the operator's metrics count both restarts under the right labels."""

from __future__ import annotations

import itertools
import signal
import urllib.request
from datetime import datetime, timedelta
from typing import Any

from kubernetes import client
from tpujob_devcluster.harness import OPERATOR_NAMESPACE

from .conftest import E2E, PACED

V5E: dict[str, Any] = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 1}


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _training(e2e: E2E, name: str, attempt: int, past_step: int) -> str:
    e2e.wait(
        name,
        lambda s: s.get("attempt") == attempt and s.get("phase") == "Running" and (s.get("step") or 0) > past_step,
        300,
        f"attempt {attempt} training past step {past_step}",
    )
    return e2e.running_pod(f"{name}-a{attempt}-slice-0-0")


def _metrics_text(e2e: E2E) -> str:
    """Scrape the leading operator replica's /metrics (the port the chart passed it)."""
    deployment: Any = client.AppsV1Api(e2e.api).read_namespaced_deployment("tpujob", OPERATOR_NAMESPACE)
    args = deployment.spec.template.spec.containers[0].args
    port = next(int(a.split("=", 1)[1]) for a in args if a.startswith("--metrics-port="))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _sample(text: str, metric: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(metric + "{"):
            continue
        found = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
        if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_killed_and_preempted_job_accounts_for_its_wall_time_and_is_scraped(e2e):
    name = "ledger"
    # Long enough to be hit twice while training: at least 30 s of steps; each hit comes as soon as it trains.
    e2e.apply(name, 600, restart={"maxRestarts": 2}, min_step_seconds=PACED, **V5E)
    e2e.signal_pod(_training(e2e, name, 0, 30), signal.SIGKILL)
    pod = _training(e2e, name, 1, 0)
    # The metrics of a live job, after its first restart: one counted ApplicationError.
    scraped = _metrics_text(e2e)
    labels = {"namespace": e2e.namespace, "name": name}
    assert _sample(scraped, "tpujob_restarts_total", kind="ApplicationError", counted="true", **labels) == 1
    ratio = _sample(scraped, "tpujob_goodput_ratio", **labels)
    assert ratio is not None and 0 <= ratio <= 1
    e2e.core.create_namespaced_pod_eviction(
        pod, e2e.namespace, client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=e2e.namespace))
    )
    _training(e2e, name, 2, 0)
    scraped = _metrics_text(e2e)
    assert _sample(scraped, "tpujob_restarts_total", kind="Preemption", counted="false", **labels) == 1
    status = e2e.wait(name, lambda s: s.get("phase") == "Succeeded", 400, "Succeeded")

    assert (status["restarts"], status["countedRestarts"]) == (2, 1)
    ledger = status["goodput"]
    badput = ledger["badput"]
    parts = ledger["productiveSeconds"] + sum(badput.values())
    created = _time(e2e.custom.get_namespaced_custom_object(
        "tpujob.dev", "v1alpha1", e2e.namespace, "trainingjobs", name)["metadata"]["creationTimestamp"])  # fmt: skip
    # The independent truth: the apiserver's creation time to the operator's completion time.
    wall = (_time(status["completionTime"]) - created).total_seconds()
    assert abs(parts - wall) <= 0.02 * wall + 2, (parts, wall, ledger)
    assert abs(ledger["wallSeconds"] - parts) < 0.01
    # Each cause that happened shows up: two recoveries (restore, rescheduling), saves, training.
    assert ledger["productiveSeconds"] > 0 and badput["infrastructureRecoverySeconds"] > 0
    assert badput["restoreSeconds"] > 0 and badput["startupSeconds"] > 0 and badput["checkpointSaveSeconds"] > 0
    assert ledger["ratio"] == round(ledger["productiveSeconds"] / ledger["wallSeconds"], 4)
    timeline = status["lastFailure"]["timeline"]
    stages = ["failed", "detected", "jobSetCreated", "podsScheduled", "restored", "firstNewStep"]
    times = [_time(timeline[s]) for s in stages]
    # In order, up to the whole-second resolution of the times Kubernetes records (pod conditions).
    assert all(b >= a - timedelta(seconds=1) for a, b in itertools.pairwise(times)), timeline
