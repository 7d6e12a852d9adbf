"""What a platform team plugs in: the chart's alert rules and dashboard, checked with the real promtool
against the metrics the operator really exports.

- The PrometheusRule the chart renders passes `promtool check rules`, and `promtool test rules` runs
  tests/alerts/tpujob_test.yaml on it: every alert fires in one case and stays silent in another.
- Every query of the dashboard parses (promtool, as a recording rule) and names only metrics the
  operator exports; so does every alert expression. The truth for "exports" is a registry of a real
  OperatorMetrics that has seen a job through a restart and a recovery.
- The operator's exposition passes `promtool check metrics` (Prometheus' naming and help lint).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from tpujob_devcluster.controlplane import prometheus_dir
from tpujob_devcluster.harness import render_template
from tpujob_operator import api
from tpujob_operator.metrics import OperatorMetrics
from tpujob_operator.status import rfc3339

from .factories import training_job

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tpujob"
ALERT_TESTS = REPO / "tests" / "alerts" / "tpujob_test.yaml"
DASHBOARD = CHART / "files" / "dashboard.json"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
# Grafana's variables, as a query would see them once Grafana substituted them.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "6h", "$namespace": ".*", "$job": ".*", "$rung": ".*"}
METRIC_NAME = re.compile(r"\btpujob_[a-z0-9_]+\b")


def run(*argv: str, cwd: Path | None = None) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert result.returncode == 0, f"{' '.join(argv)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def promtool() -> str:
    return str(prometheus_dir() / "promtool")


@pytest.fixture(scope="module")
def rules() -> dict[str, Any]:
    """The chart's alert rules as a user of its defaults gets them (the PrometheusRule's spec)."""
    spec: dict[str, Any] = render_template("prometheusrule.yaml", "metrics.prometheusRule.enabled=true")["spec"]
    return spec


@pytest.fixture
def rules_dir(rules: dict[str, Any], tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    yield tmp_path


def exported_names() -> set[str]:
    """Every sample name the operator's registry holds once it saw a job train, fail, restart in place
    and recover, with its cadence and limits reported (histograms as _bucket/_sum/_count)."""
    metrics = OperatorMetrics(CollectorRegistry(), clock=lambda: T0.timestamp())
    metrics.mark_leading()
    at = [rfc3339(T0 + timedelta(seconds=s)) for s in (0, 2, 5, 9, 20, 42)]
    timeline = api.FailureTimeline(failed=at[0], detected=at[1], job_set_created=at[2], pods_scheduled=at[3],
                                   restored=at[4], first_new_step=at[5])  # fmt: skip
    failure = api.FailureRecord(time=at[0], kind="ApplicationError", reason="ExitCode1", timeline=timeline)
    tj = training_job(status={"phase": "Running", "step": 100})
    cadence = api.CheckpointCadence(interval_seconds=30, save_cost_seconds=1, overhead_percent=2)
    goodput = api.Goodput(ratio=0.5, wall_seconds=100, productive_seconds=50)
    update = {
        "restarts": 1, "counted_restarts": 1, "lost_steps": 3, "last_progress_time": at[5],
        "checkpoint_cadence": cadence, "goodput": goodput, "latest_checkpoint": api.CheckpointRef(step=90, time=at[4]),
        "last_failure": failure.model_copy(update={"recovery_seconds": 42.0}),
    }  # fmt: skip
    after = tj.status.model_copy(update=update)
    metrics.observe_reconcile("ml", "llama", tj.status, after, T0, tj.spec)
    with pytest.raises(RuntimeError), metrics.reconciling():
        raise RuntimeError("a reconcile that fails")
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    queries = [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", [])]
    queries += [(f"variable {v['name']}", v["definition"]) for v in board["templating"]["list"] if v["type"] == "query"]
    return queries


def substituted(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    return query


def test_the_alert_rules_pass_promtool_check_and_their_unit_tests(promtool: str, rules_dir: Path) -> None:
    assert "SUCCESS" in run(promtool, "check", "rules", "rules.yaml", cwd=rules_dir)
    out = run(promtool, "test", "rules", ALERT_TESTS.name, cwd=rules_dir)
    assert "SUCCESS" in out, out


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_stays_silent(rules: dict[str, Any]) -> None:
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    assert len(alerts) == 7, alerts
    cases = [case for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    fires = {case["alertname"] for case in cases if case["exp_alerts"]}
    silent = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert fires == alerts and silent == alerts, (alerts - fires, alerts - silent)


def test_a_broken_alert_test_fails_promtool(promtool: str, rules_dir: Path) -> None:
    """The harness can fail: the same tests against rules whose threshold moved by one step."""
    broken = (rules_dir / "rules.yaml").read_text().replace("> 0.05", "> 0.5")
    (rules_dir / "rules.yaml").write_text(broken)
    argv = [promtool, "test", "rules", ALERT_TESTS.name]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=rules_dir)
    assert result.returncode != 0 and "TPUJobReconcileErrors" in result.stdout + result.stderr


def test_every_dashboard_and_alert_query_parses_and_names_only_exported_metrics(
    promtool: str, rules: dict[str, Any], tmp_path: Path
) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 15
    # label_values(...) is Grafana's, not PromQL: its metric selector is what Prometheus answers.
    promql = [(title, re.sub(r"^label_values\((.*), \w+\)$", r"\1", substituted(q))) for title, q in queries]
    records = [{"record": f"dashboard:query_{i}", "expr": q} for i, (_, q) in enumerate(promql)]
    (tmp_path / "dashboard-rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": records}]}))
    assert "SUCCESS" in run(promtool, "check", "rules", "dashboard-rules.yaml", cwd=tmp_path)

    exported = exported_names()
    alert_exprs = [(rule["alert"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]
    unknown = {
        (title, name) for title, query in promql + alert_exprs for name in METRIC_NAME.findall(query)
        if name not in exported
    }  # fmt: skip
    assert not unknown, unknown
    # And the dashboard shows what the issue asks of it: per job and namespace, every family.
    shown = {name for _, q in promql for name in METRIC_NAME.findall(q)}
    for family in ("tpujob_badput_seconds", "tpujob_restarts_total", "tpujob_recovery_stage_seconds_sum",
                   "tpujob_seconds_since_committed_checkpoint", "tpujob_checkpoint_interval_seconds"):  # fmt: skip
        assert family in shown, family


def test_the_operator_exposition_passes_promtool_check_metrics(promtool: str) -> None:
    metrics = OperatorMetrics(CollectorRegistry(), clock=lambda: T0.timestamp())
    tj = training_job(status={"phase": "Running"})
    metrics.observe_reconcile("ml", "llama", tj.status, tj.status, T0, tj.spec)
    exposition = generate_latest(metrics.registry).decode()
    result = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_configmap_carries_the_dashboard_with_the_sidecar_label() -> None:
    configmap = render_template("dashboard.yaml", "metrics.dashboard.enabled=true")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["tpujob.json"]) == json.loads(DASHBOARD.read_text())
