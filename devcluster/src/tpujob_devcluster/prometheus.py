"""A real Prometheus (devcluster/prometheus.sh) scraping the devcluster's operator as the chart's
ServiceMonitor describes it, and evaluating the chart's PrometheusRule.

There is no Prometheus Operator here, so `scrape_config` does its one job for a ServiceMonitor: find
the pods behind the Services it selects, on the port it names, with `job` set to the Service's name
(what the Prometheus Operator writes, so the chart's alerts select the same series here as on a
cluster). It discovers pods rather than EndpointSlices, a stand-in named as such: the devcluster's
pods have loopback addresses, which EndpointSlices refuse, so its endpoint controllers are off
(controlplane.py). A pod is kept when it is Running and matches the Service's selector, and its
container port is the Service port's targetPort; that is what the EndpointSlice would list.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from .controlplane import free_port, prometheus_dir

READY_TIMEOUT = 60.0


def _meta(name: str) -> str:
    """A Kubernetes label as a discovery meta label's suffix (Prometheus' label-name sanitizing)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _keep(source: str, value: str) -> dict[str, Any]:
    return {"action": "keep", "source_labels": [source], "regex": re.escape(value)}


def scrape_config(service_monitor: dict[str, Any], service: dict[str, Any], kubeconfig: Path) -> list[dict[str, Any]]:
    """One scrape config per endpoint of a monitoring.coreos.com/v1 ServiceMonitor, for the one
    Service it selects (`service`, checked against the monitor's selector)."""
    spec = service_monitor["spec"]
    namespaces = spec.get("namespaceSelector", {}).get("matchNames") or [service_monitor["metadata"]["namespace"]]
    selector = spec.get("selector", {}).get("matchLabels", {})
    labels = service["metadata"].get("labels") or {}
    if any(labels.get(key) != value for key, value in selector.items()):
        raise ValueError(f"the ServiceMonitor does not select Service {service['metadata']['name']}")
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    configs = []
    for index, endpoint in enumerate(spec["endpoints"]):
        target_port = ports[endpoint["port"]].get("targetPort", ports[endpoint["port"]]["port"])
        port_label = "name" if isinstance(target_port, str) else "number"
        configs.append(
            {
                "job_name": f"serviceMonitor/{service_monitor['metadata']['namespace']}/"
                f"{service_monitor['metadata']['name']}/{index}",
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "metrics_path": endpoint.get("path", "/metrics"),
                "scrape_interval": endpoint.get("interval", "30s"),
                **({"scrape_timeout": endpoint["scrapeTimeout"]} if endpoint.get("scrapeTimeout") else {}),
                "kubernetes_sd_configs": [
                    {"role": "pod", "kubeconfig_file": str(kubeconfig), "namespaces": {"names": namespaces}}
                ],
                "relabel_configs": [
                    *(
                        _keep(f"__meta_kubernetes_pod_label_{_meta(key)}", value)
                        for key, value in sorted(service["spec"]["selector"].items())
                    ),
                    _keep("__meta_kubernetes_pod_phase", "Running"),
                    _keep(f"__meta_kubernetes_pod_container_port_{port_label}", str(target_port)),
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"target_label": "service", "replacement": service["metadata"]["name"]},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"target_label": "job", "replacement": service["metadata"]["name"]},
                ],
            }
        )
    return configs


@dataclass
class Prometheus:
    """One Prometheus process on a free loopback port, its TSDB and log under `workdir`."""

    workdir: Path
    scrape_configs: list[dict[str, Any]]
    rule_groups: list[dict[str, Any]] = field(default_factory=list)
    evaluation_interval: str = "2s"
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        rules = self.workdir / "rules.yml"
        rules.write_text(yaml.safe_dump({"groups": self.rule_groups}))
        config = {
            "global": {"scrape_interval": "2s", "evaluation_interval": self.evaluation_interval},
            "rule_files": [str(rules)],
            "scrape_configs": self.scrape_configs,
        }
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self._log = (self.workdir / "prometheus.log").open("ab")
        self.process = subprocess.Popen(
            [
                str(prometheus_dir() / "prometheus"),
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1d",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.process.returncode}; see {self.workdir}/prometheus.log")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"prometheus not ready after {READY_TIMEOUT}s; see {self.workdir}/prometheus.log")

    def _get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": {labels}, "value": [time, "text"]}, ...]."""
        data = self._get("/api/v1/query", query=promql)
        result: list[dict[str, Any]] = data["result"]
        return result

    def value(self, promql: str) -> float | None:
        """The single value of an instant query, None when its vector is empty."""
        result = self.query(promql)
        if not result:
            return None
        if len(result) > 1:
            raise AssertionError(f"{promql}: {len(result)} series, expected one: {result}")
        return float(result[0]["value"][1])

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: [{"labels": ..., "state": "firing", "value": ...}, ...]."""
        alerts: list[dict[str, Any]] = self._get("/api/v1/alerts")["alerts"]
        return alerts

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self._get("/api/v1/targets")["activeTargets"]
        return active

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log is not None:
            self._log.close()
