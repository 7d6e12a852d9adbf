"""Claims the docs and the chart make about the code, checked against the code so they cannot drift:
the Kubernetes version the chart admits runs every API its default install uses; every badput cause
is in the goodput table; every `status.<field>` an alert or a page names exists in the CRD; every
model preset is in the trainer's README; every Event the operator posts is on the status page.
The truth is read from the code (the API models, the CRD, the chart as Helm renders it, the
operator's source), never from a list kept here, except where the truth lies outside the repository
(the Kubernetes release an API became GA in).
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import yaml
from tpujob_devcluster.controlplane import tools_dir
from tpujob_operator import api, restarts

from .test_docs import DOCS, OPERATOR, ROOT, _call_name, _strings, module_constants

CHART = ROOT / "charts" / "tpujob"

# The Kubernetes minor release in which each API the chart installs was served at the version the chart
# uses (GA for the v1 APIs). Kubernetes release notes; a kind not listed here fails the test until it is.
API_SINCE: dict[tuple[str, str], tuple[int, int]] = {
    ("v1", "ServiceAccount"): (1, 0),
    ("v1", "Service"): (1, 0),
    ("v1", "ConfigMap"): (1, 0),
    ("apps/v1", "Deployment"): (1, 9),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): (1, 8),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): (1, 8),
    ("rbac.authorization.k8s.io/v1", "Role"): (1, 8),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): (1, 8),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): (1, 16),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): (1, 30),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): (1, 30),
}
# CRD features the chart's CRD uses, by the key that marks them: CEL validation rules are GA in 1.29.
CRD_FEATURE_SINCE = {"x-kubernetes-validations": (1, 29)}


def chart_minimum_kube_version() -> tuple[int, int]:
    """The lower bound of Chart.yaml's kubeVersion (a single `>=X.Y.Z-0`: no upper bound, no ranges)."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)\.\d+(?:-0)?", constraint.strip())
    assert match, f"Chart.yaml kubeVersion {constraint!r}: expected one lower bound, >=X.Y.Z-0"
    return int(match[1]), int(match[2])


def helm_template(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tools_dir() / "helm"), "template", "tpujob", str(CHART), "-n", "tpujob-system", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_charts_minimum_kubernetes_serves_every_api_its_default_install_uses() -> None:
    major, minor = chart_minimum_kube_version()
    # Rendered as on a cluster of the minimum version: what a template gates on the version is as there.
    rendered = helm_template("--include-crds", "--kube-version", f"{major}.{minor}.0")
    assert rendered.returncode == 0, rendered.stderr
    documents = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    used = {(d["apiVersion"], d["kind"]) for d in documents}
    assert ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") in used  # on by default
    unknown = used - API_SINCE.keys()
    assert not unknown, f"add to API_SINCE the release that serves {sorted(unknown)}"
    too_new = {
        f"{v} {k} ({API_SINCE[(v, k)][0]}.{API_SINCE[(v, k)][1]})"
        for v, k in used
        if API_SINCE[(v, k)] > (major, minor)
    }
    assert not too_new, f"Chart.yaml admits Kubernetes {major}.{minor}, which does not serve {sorted(too_new)}"
    crd_text = (CHART / "crds" / "trainingjob.yaml").read_text()
    for feature, since in CRD_FEATURE_SINCE.items():
        assert feature not in crd_text or since <= (major, minor), f"the CRD's {feature} needs {since}"
    # And Helm refuses the release below it: the bound is the one enforced, not only the one documented.
    older = helm_template("--kube-version", f"{major}.{minor - 1}.0")
    assert older.returncode != 0 and "kubeVersion" in older.stderr, older.stderr


def test_every_badput_cause_is_in_the_goodput_table() -> None:
    page = (DOCS / "concepts" / "goodput.md").read_text()
    rows = {re.findall(r"`([^`]+)`", line.split("|")[1])[0] for line in page.splitlines() if line.startswith("| `")}
    fields = {field.alias or name for name, field in api.Badput.model_fields.items()}
    assert len(fields) >= 9
    assert not fields - rows, f"badput fields missing from docs/concepts/goodput.md: {sorted(fields - rows)}"
    assert not rows - fields - {"badput"}, f"goodput.md lists fields Badput lacks: {sorted(rows - fields)}"


# `status.<field>` the pages name that are another object's (not a TrainingJob's), and whose.
FOREIGN_STATUS = {
    "status.podIP": "the operator pod's own, through the downward API",
    "status.currentInPlaceRestartAttempt": "JobSet's count of in-place restart rounds",
}
STATUS_PATH = re.compile(r"(?<![\w./-])status((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
FILE_SUFFIXES = {"md", "py", "yaml", "json"}


def _schema_has(schema: dict[str, Any], path: list[str]) -> bool:
    for name in path:
        while schema.get("type") == "array":
            schema = schema["items"]
        properties = schema.get("properties", {})
        if name not in properties:
            return False
        schema = properties[name]
    return True


def named_status_paths(text: str) -> set[str]:
    """Every `status.a.b` the text names (file names such as status.md left out)."""
    found = {f"status{m[1]}" for m in STATUS_PATH.finditer(text)}
    return {p for p in found if p.rsplit(".", 1)[-1] not in FILE_SUFFIXES}


def test_every_status_field_an_alert_or_a_page_names_exists_in_the_crd() -> None:
    crd = yaml.safe_load((CHART / "crds" / "trainingjob.yaml").read_text())
    [version] = crd["spec"]["versions"]
    status_schema = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    sources = [
        *sorted(CHART.glob("templates/*.yaml")),  # the alerts' text among them (prometheusrule.yaml)
        CHART / "values.yaml",
        *sorted((ROOT / "tests" / "alerts").glob("*.yaml")),  # the alerts' text as promtool expects it
        *sorted(DOCS.rglob("*.md")),
        ROOT / "README.md",
    ]
    named = {(path, source.relative_to(ROOT)) for source in sources for path in named_status_paths(source.read_text())}
    assert ("status.lastFailure", Path("docs/operations/alerts.md")) in named  # the finder sees the alerts page
    assert any(str(where).endswith("prometheusrule.yaml") for _, where in named)  # and the alerts' text
    missing = sorted(
        f"{where}: {path}"
        for path, where in named
        if path not in FOREIGN_STATUS and not _schema_has(status_schema, path.split(".")[1:])
    )
    assert not missing, f"status fields the CRD does not have: {missing}"


def test_the_status_path_finder() -> None:
    text = "see status.lastFailure.timeline, `status.goodput`; [status.md](x) and .status.podIP and status.x_y"
    assert named_status_paths(text) == {"status.lastFailure.timeline", "status.goodput", "status.x_y"}
    schema = {"properties": {"conditions": {"type": "array", "items": {"properties": {"reason": {}}}}}}
    assert _schema_has(schema, ["conditions", "reason"]) and not _schema_has(schema, ["conditions", "nope"])


def model_presets() -> set[str]:
    """The names of the trainer's model presets: the ModelConfig("<name>", ...) of its MODELS table, read
    from the source (the trainer's packages need not be importable here)."""
    found: set[str] = set()
    for path in sorted((ROOT / "trainer_image" / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if not any(isinstance(t, ast.Name) and t.id == "MODELS" for t in targets):
                continue
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and _call_name(call) == "ModelConfig" and call.args:
                    first = call.args[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str):
                        found.add(first.value)
    return found


def test_every_model_preset_is_in_the_trainers_readme() -> None:
    presets = model_presets()
    assert {"tiny", "small", "1b"} <= presets  # a floor: the finder must not go blind
    readme = (ROOT / "trainer_image" / "README.md").read_text().splitlines()
    # Where the README lists the presets: the --model flag's row and config.py's row.
    rows = [line for line in readme if line.startswith(("| `--model`", "| `config.py`"))]
    assert any(row.startswith("| `--model`") for row in rows), "trainer_image/README.md: no --model row"
    for row in rows:
        missing = presets - set(re.findall(r"`([^`]+)`", row))
        assert not missing, f"presets {sorted(missing)} missing from trainer_image/README.md: {row}"


def event_reasons_in_source(source: str) -> set[str]:
    """The reasons a module's Events can carry: facts.Event(type, reason, message) with a literal, a
    module constant or a local, and through a function that posts an Event with its own `reason`
    parameter, what its callers pass (test_docs.reasons_in_source, narrowed to Events)."""
    tree = ast.parse(source)
    constants = module_constants(tree)
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    found: set[str] = set()
    forwarders: dict[str, int] = {}  # function name -> the position of the reason it posts, among its callers' args
    for scope in functions:
        params = [a.arg for a in scope.args.args]
        for call in ast.walk(scope):
            if not isinstance(call, ast.Call) or _call_name(call) != "Event":
                continue
            for arg in [*call.args[1:2], *(k.value for k in call.keywords if k.arg == "reason")]:
                found.update(_strings(arg, scope, constants))
                if isinstance(arg, ast.Name) and arg.id in params:
                    forwarders[scope.name] = params.index(arg.id) - (1 if params[0] in ("self", "cls") else 0)
    for scope in functions:
        for call in ast.walk(scope):
            if isinstance(call, ast.Call) and _call_name(call) in forwarders:
                position = forwarders[_call_name(call)]
                for arg in [
                    *call.args[position : position + 1],
                    *(k.value for k in call.keywords if k.arg == "reason"),
                ]:
                    found.update(_strings(arg, scope, constants))
    return found


def operator_event_reasons() -> set[str]:
    """Every reason of an Event the operator posts; a failure no restart can fix is posted under its own
    reason (reconcile: Event("Warning", failure.reason, ...) for restarts.TERMINAL_KINDS)."""
    found: set[str] = set()
    for path in sorted(OPERATOR.rglob("*.py")):
        found |= event_reasons_in_source(path.read_text())
    found |= {reason for kind, reason, _ in restarts._NAMED_EXITS.values() if kind in restarts.TERMINAL_KINDS}
    return found


def test_the_event_finder_reads_literals_constants_and_forwarded_reasons() -> None:
    source = """
OUTAGE = "Outage"
def f(x):
    events.append(Event("Warning", OUTAGE, "m"))
    events.append(Event("Normal", "Created", "m"))
    with_phase(s, "Pending", "NotAnEvent", "m", now)
def _fail(self, job, reason, message):
    return Event("Warning", reason, message)
def g(self):
    self._fail(job, "InvalidSpec", "m")
"""
    assert event_reasons_in_source(source) == {"Outage", "Created", "InvalidSpec"}


def test_every_event_the_operator_posts_is_on_the_status_page() -> None:
    events = operator_event_reasons()
    # A floor: the finder must not go blind.
    assert {"Created", "FailureDetected", "PolicyViolation", "InvalidSpec", "CheckpointIncompatible"} <= events
    page = (DOCS / "concepts" / "status.md").read_text()
    [paragraph] = [p for p in page.split("\n\n") if p.startswith("Events:")]
    listed = set(re.findall(r"`([A-Za-z]+)`", paragraph))
    assert not events - listed, f"Events missing from docs/concepts/status.md: {sorted(events - listed)}"
    assert not listed - events, (
        f"docs/concepts/status.md lists Events the operator never posts: {sorted(listed - events)}"
    )


def _shell_default(script: str, variable: str) -> str:
    """A script's pinned default: VAR="${VAR:-value}"."""
    match = re.search(rf'^{variable}="\$\{{{variable}:-([^}}]+)\}}"', (ROOT / script).read_text(), re.MULTILINE)
    assert match, f"{script}: {variable}"
    return match[1]


def _pin(pyproject: str, package: str) -> str:
    dependencies = tomllib.loads((ROOT / pyproject).read_text())["project"]["dependencies"]
    [version] = [d.split("==")[1] for d in dependencies if re.split(r"[=\[<>~ ]", d)[0] == package]
    return str(version)


def test_the_compatibility_page_names_the_versions_the_repository_pins() -> None:
    page = (DOCS / "compatibility.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| ")}
    major, minor = chart_minimum_kube_version()
    tools = re.search(r"helm v(\d+\.\d+)", (ROOT / "devcluster" / "tools.sh").read_text())
    assert tools
    expected = {
        "Kubernetes": [f"{major}.{minor} or later", f"`{_shell_default('devcluster/build.sh', 'K8S_VERSION')}`"],
        "JobSet": [f"`{_shell_default('devcluster/build.sh', 'JOBSET_VERSION')}`"],
        "Kueue": [f"`{_shell_default('devcluster/build.sh', 'KUEUE_VERSION')}`"],
        "Helm": [f"`v{tools[1]}`"],
        "JAX": [f"`{_pin('trainer_image/pyproject.toml', 'jax')}`"],
        "Orbax": [f"`{_pin('trainer_image/pyproject.toml', 'orbax-checkpoint')}`"],
        "MaxText": [f"`{_shell_default('devcluster/maxtext_venv.sh', 'MAXTEXT_VERSION')}`"],
    }
    for component, versions in expected.items():
        assert component in rows, f"docs/compatibility.md has no row for {component}"
        for version in versions:
            assert version in rows[component], f"docs/compatibility.md, {component}: expected {version}"
    # The README says which versions a GKE cluster needs: the ones the devcluster runs.
    readme = (ROOT / "README.md").read_text()
    for component in ("JobSet", "Kueue"):
        version = _shell_default("devcluster/build.sh", f"{component.upper()}_VERSION")
        assert f"{component} {version}" in readme, f"README.md: expected {component} {version}"
    # The trainer image installs the JAX it is tested with.
    assert (
        f'"jax[tpu]=={_pin("trainer_image/pyproject.toml", "jax")}"'
        in (ROOT / "trainer_image" / "Dockerfile").read_text()
    )
