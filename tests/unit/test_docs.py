"""The docs site says what the code does: every reason the operator writes is on the troubleshooting
page, every metric it exports is on the metrics page, and every field of the API is in the generated
reference. The reasons are read from the operator's source (its AST) and its own tables, not from a
list kept here, so a new reason without an entry fails this test.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from tpujob_operator import api, apidocs, metrics, nodes, reconcile, restarts
from tpujob_operator.crd import build_crd

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "src" / "tpujob_operator"
DOCS = ROOT / "docs"

# Calls that take a status or Event reason, and the position of the reason among their arguments.
_REASON_ARGS = {
    "Event": 1,  # facts.Event(type, reason, message)
    "with_phase": 2,  # status.with_phase(status, phase, reason, message, now)
    "_enter": 2,
    "set_condition": 3,  # status.set_condition(conditions, type, status, reason, message, now)
    "Failure": 1,  # restarts.Failure(kind, reason, message, ...)
    "Signal": 1,  # nodes.Signal(kind, reason, detail, since)
    "Evidence": 1,
}


def _strings(node: ast.expr, scope: ast.AST, constants: dict[str, str]) -> Iterator[str]:
    """The string values an argument can take: literals, either side of `or` / `if`, module constants,
    and what the enclosing function assigns to a local of that name. f-strings as their pattern
    (f"ExitCode{code}" -> "ExitCode<N>"); attributes (a pod's own reason, Kubernetes') are not ours."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr):
        fixed = "".join(str(v.value) if isinstance(v, ast.Constant) else "<N>" for v in node.values)
        if re.fullmatch(r"[A-Za-z]+<N>", fixed):
            yield fixed
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from _strings(value, scope, constants)
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body, scope, constants)
        yield from _strings(node.orelse, scope, constants)
    elif isinstance(node, ast.Name):
        if node.id in constants:
            yield constants[node.id]
        for assign in ast.walk(scope):
            if not isinstance(assign, ast.Assign):
                continue
            for target in assign.targets:
                if isinstance(target, ast.Name) and target.id == node.id:
                    yield from _strings(assign.value, scope, constants)
                elif isinstance(target, ast.Tuple) and isinstance(assign.value, ast.Tuple):
                    for t, v in zip(target.elts, assign.value.elts, strict=False):
                        if isinstance(t, ast.Name) and t.id == node.id:
                            yield from _strings(v, scope, constants)


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def module_constants(tree: ast.Module) -> dict[str, str]:
    """A module's string constants at its top level (NAME = "text"), by name."""
    return {
        t.id: a.value.value
        for a in tree.body
        if isinstance(a, ast.Assign) and isinstance(a.value, ast.Constant) and isinstance(a.value.value, str)
        for t in a.targets
        if isinstance(t, ast.Name)
    }


def reasons_in_source(source: str) -> set[str]:
    """Every reason a module's calls to the reason-taking functions can pass (see _REASON_ARGS)."""
    tree = ast.parse(source)
    constants = module_constants(tree)
    found: set[str] = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    # Each function is the scope its locals are looked up in (module-level code has no reasons).
    for scope in functions:
        for call in ast.walk(scope):
            if not isinstance(call, ast.Call) or _call_name(call) not in _REASON_ARGS:
                continue
            position = _REASON_ARGS[_call_name(call)]
            args = [*call.args[position : position + 1], *(k.value for k in call.keywords if k.arg == "reason")]
            for arg in args:
                found.update(_strings(arg, scope, constants))
    # A function that takes a `reason` and passes it on: what its callers give it.
    for function in functions:
        params = [a.arg for a in function.args.args]
        if "reason" not in params:
            continue
        position = params.index("reason") - (1 if params[0] in ("self", "cls") else 0)
        for scope in functions:
            for call in ast.walk(scope):
                if isinstance(call, ast.Call) and _call_name(call) == function.name:
                    named = [k.value for k in call.keywords if k.arg == "reason"]
                    for arg in [*call.args[position : position + 1], *named]:
                        found.update(_strings(arg, scope, constants))
    return found


def operator_reasons() -> set[str]:
    """Every status reason (the phase conditions' and the others') and Event reason the operator writes."""
    found: set[str] = set()
    for path in sorted(OPERATOR.rglob("*.py")):
        found |= reasons_in_source(path.read_text())
    # The tables the classification reads its reasons from.
    found |= {reason for _, reason, _ in restarts._NAMED_EXITS.values()}
    found |= set(restarts._INFRASTRUCTURE_DISRUPTIONS) | set(restarts._NODE_LOST_POD_REASONS)
    found |= set(reconcile._STUCK_WAITING_REASONS)
    found |= set(re.findall(r'"(Node[A-Z][A-Za-z]+)"', Path(nodes.__file__).read_text()))
    return found


def documented_reasons(page: str) -> set[str]:
    """The reasons the troubleshooting page has an entry for: `Reason` in its tables' first column."""
    rows = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `")]
    return {name for first in rows for name in re.findall(r"`([^`]+)`", first)}


def test_the_reason_finder_reads_literals_locals_constants_and_patterns() -> None:
    source = """
OUTAGE = "Outage"
def f(x):
    if x:
        reason, message = "Unschedulable", "m"
    else:
        reason = x.reason or "Starting"
    events.append(Event("Warning", OUTAGE, "m"))
    with_phase(s, "Pending", reason, message, now)
    return Failure("k", f"ExitCode{x}", "m", None, None), Failure("k", pod.reason, "m", None, None)
def _fail(self, job, reason, message):
    return Event("Warning", reason, message)
def g(self):
    self._fail(job, "InvalidSpec", "m")
"""
    assert reasons_in_source(source) == {"Outage", "Unschedulable", "Starting", "ExitCode<N>", "InvalidSpec"}


def test_every_reason_the_operator_writes_is_on_the_troubleshooting_page() -> None:
    reasons = operator_reasons()
    # The finder sees the reasons this page was first written from (a floor: it must not go blind).
    assert {"RestartBudgetExhausted", "FailureDetected", "PolicyViolation", "Unschedulable", "ExitCode<N>"} <= reasons
    missing = reasons - documented_reasons((DOCS / "troubleshooting.md").read_text())
    assert not missing, f"reasons without an entry in docs/troubleshooting.md: {sorted(missing)}"


def test_every_exported_metric_is_on_the_metrics_page() -> None:
    source = Path(metrics.__file__).read_text()
    names = set(re.findall(r'"(tpujob_[a-z_]+)"', source)) | {f"tpujob_{field}" for field in metrics.LIMIT_GAUGES}
    assert len(names) >= 14
    page = (DOCS / "operations" / "metrics.md").read_text()
    missing = {name for name in names if f"`{name}`" not in page}
    assert not missing, f"metrics missing from docs/operations/metrics.md: {sorted(missing)}"


def test_the_api_reference_is_generated_from_the_crd_and_names_every_field() -> None:
    committed = (ROOT / apidocs.REFERENCE).read_text()
    assert committed == apidocs.render(build_crd()), "stale docs/reference/trainingjob.md: run `make crds`"
    for model, prefix in ((api.TrainingJobSpec, "spec"), (api.TrainingJobStatus, "status")):
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in committed, f"{prefix}.{field.alias or name}"


def test_rules_that_differ_only_in_their_bound_read_as_one_with_the_range() -> None:
    rules = [{"rule": "x", "message": f"name must be at most {n} characters for this spec: why"} for n in (35, 36, 40)]
    rules.append({"rule": "y", "message": "another rule"})
    assert apidocs._rule_lines({"x-kubernetes-validations": rules}) == [
        "- name must be at most 35 to 40 characters for this spec: why",
        "- another rule",
    ]


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "devcluster" / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_links_to_repository_files_are_checked_against_the_tree_and_pointed_at_the_repository() -> None:
    hooks = _hooks()
    page = (
        "[values](../../charts/tpujob/values.yaml#L1) [gone](../../operator/gone.py) [page](../troubleshooting.md)\n"
        "`[not a link](../../nowhere.py)` [`examples`](../../examples) [web](https://example.com/x.py)\n"
        "```\n[in a block](../../nowhere.py)\n```\n"
    )
    text, missing = hooks.rewrite(page, "concepts/x.md", ROOT, "https://github.com/o/tpujob")
    assert missing == ["../../operator/gone.py"]
    assert "[values](https://github.com/o/tpujob/blob/main/charts/tpujob/values.yaml#L1)" in text
    assert "[`examples`](https://github.com/o/tpujob/tree/main/examples)" in text
    assert "[page](../troubleshooting.md)" in text and "[web](https://example.com/x.py)" in text
    assert "`[not a link](../../nowhere.py)`" in text and "[in a block](../../nowhere.py)" in text
    # Without a repository URL the link becomes its text: the site has nowhere to point it.
    assert hooks.rewrite("[v](../charts/tpujob/values.yaml)", "index.md", ROOT, "")[0] == "v"
