"""The operator's metrics and the chart's alerts through a real Prometheus on the devcluster.

Prometheus (built from its Go module, devcluster/prometheus.sh) discovers the operator through the
Kubernetes API exactly as the chart's ServiceMonitor selects it, and evaluates the chart's
PrometheusRule as rendered. A worker is killed: PromQL must show the restart with its kind and rung,
the recovery time that status.lastFailure reports, and the restart-budget alert firing for this job.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from tpujob_devcluster.cluster import DevCluster
from tpujob_devcluster.harness import OPERATOR_RELEASE, render_template
from tpujob_devcluster.prometheus import Prometheus, scrape_config

from .conftest import E2E, PACED

V5E: dict[str, Any] = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 1}
T = TypeVar("T")


@pytest.fixture
def prometheus(devcluster: DevCluster) -> Iterator[Prometheus]:
    monitor = render_template(
        "servicemonitor.yaml", "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.interval=2s"
    )
    rule = render_template("prometheusrule.yaml", "metrics.prometheusRule.enabled=true")
    service = render_template("service.yaml")
    server = Prometheus(
        devcluster.state_dir / "prometheus",
        scrape_config(monitor, service, devcluster.kubeconfig),
        rule_groups=rule["spec"]["groups"],
    ).start()
    try:
        yield server
    finally:
        server.stop()


def eventually(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(1)


def test_a_killed_worker_shows_in_promql_and_fires_the_budget_alert(e2e: E2E, prometheus: Prometheus) -> None:
    # The operator's target, found through the EndpointSlice of the chart's metrics Service.
    # Only the leader serves /metrics, but every pod here shares the host's network: the standby's
    # address reaches the leader's socket too, so both targets are up with the same series. The
    # queries take one per series (max without the target's labels), as a dashboard would.
    targets = eventually(lambda: [t for t in prometheus.targets() if t["health"] == "up"], 60, "the operator scraped")
    assert {t["labels"]["job"] for t in targets} == {f"{OPERATOR_RELEASE}-metrics"}, targets
    recovery = 'max without (instance, pod) (tpujob_recovery_seconds_{0}{{kind="ApplicationError",rung="Recreate"}})'
    before = {part: prometheus.value(recovery.format(part)) or 0.0 for part in ("sum", "count")}

    name = "scraped"
    e2e.apply(name, 600, restart={"maxRestarts": 2}, min_step_seconds=PACED, **V5E)
    e2e.wait(name, lambda s: s.get("phase") == "Running" and (s.get("step") or 0) > 20, 300, "training")
    e2e.signal_pod(e2e.running_pod(f"{name}-a0-slice-0-0"), signal.SIGKILL)
    status = e2e.wait(name, lambda s: (s.get("lastFailure") or {}).get("recoverySeconds") is not None, 300, "recovered")
    job = f'namespace="{e2e.namespace}",name="{name}"'

    labels = f'{job},kind="ApplicationError",counted="true",rung="Recreate"'
    restarts = f"max without (instance, pod) (tpujob_restarts_total{{{labels}}})"
    assert eventually(lambda: prometheus.value(restarts), 30, "the restart in PromQL") == 1
    seen = status["lastFailure"]["recoverySeconds"]

    # The histogram has no job labels: the recovery this test caused is what was added since it began.
    def added_since_start() -> dict[str, float] | None:
        now = {part: prometheus.value(recovery.format(part)) or 0.0 for part in ("sum", "count")}
        return {part: now[part] - before[part] for part in now} if now["count"] > before["count"] else None

    added = eventually(added_since_start, 30, "the recovery in PromQL")
    assert added["count"] == 1 and added["sum"] == pytest.approx(seen, abs=1e-3), (added, seen)
    # Every stage of a Recreate recovery is observed (a stage may take 0 s: the stamps are whole seconds).
    stages = prometheus.query('max by (stage) (tpujob_recovery_stage_seconds_count{rung="Recreate"})')
    assert {s["metric"]["stage"] for s in stages} == {"detect", "replace", "schedule", "restore", "first_step"}

    # maxRestarts 2, one counted: one left, the chart's TPUJobRestartBudgetLow fires (it has no `for`).
    def firing() -> list[dict[str, Any]]:
        return [
            a for a in prometheus.alerts()
            if a["labels"]["alertname"] == "TPUJobRestartBudgetLow" and a["state"] == "firing"
            and a["labels"].get("name") == name and a["labels"].get("namespace") == e2e.namespace
        ]  # fmt: skip

    alerts = eventually(firing, 30, "TPUJobRestartBudgetLow firing")  # once per target (see above)
    for alert in alerts:
        assert alert["annotations"]["summary"] == f"TrainingJob {e2e.namespace}/{name} has 1 counted restart(s) left"
    assert not [a for a in prometheus.alerts() if a["labels"]["alertname"] == "TPUJobOperatorNoLeader"]
