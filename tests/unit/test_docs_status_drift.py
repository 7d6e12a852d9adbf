"""The status page (docs/concepts/status.md) and the troubleshooting page's Events table say what the
operator writes, checked against the code so they cannot drift: every status field of the CRD has a
row, and every row is a field; every condition type the operator sets, every phase and stage, every
printer column is listed; every Event the operator posts has a row in troubleshooting's Events table,
and nothing that is not an Event has one. The truth is read from the code (the CRD, the API's literals,
the operator's source), never from a list kept here.
"""

from __future__ import annotations

import ast
import re
import typing
from typing import Any

import yaml
from tpujob_operator import api, status

from .test_docs import DOCS, OPERATOR, _call_name, _strings, module_constants
from .test_docs_drift import CHART, _schema_has, operator_event_reasons

STATUS_PAGE = DOCS / "concepts" / "status.md"
TROUBLESHOOTING = DOCS / "troubleshooting.md"


def _crd_version() -> dict[str, Any]:
    crd = yaml.safe_load((CHART / "crds" / "trainingjob.yaml").read_text())
    [version] = crd["spec"]["versions"]
    return dict(version)


def _status_schema() -> dict[str, Any]:
    return dict(_crd_version()["schema"]["openAPIV3Schema"]["properties"]["status"])


def section(page: str, heading: str) -> str:
    """The text under `heading` (a line `## heading`), up to the next heading of the same level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = page.splitlines()
    start = lines.index(heading)
    end = next(
        (i for i in range(start + 1, len(lines)) if (m := re.match(r"^(#+) ", lines[i])) and len(m[1]) <= level),
        len(lines),
    )
    return "\n".join(lines[start + 1 : end])


def first_column_names(text: str) -> set[str]:
    """The `names` in the first column of the text's table rows (header and separator rows left out)."""
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return {name for first in rows for name in re.findall(r"`([^`]+)`", first)}


def documented_status_fields(page: str) -> set[str]:
    return first_column_names(section(page, "## Status fields"))


def test_the_section_and_column_readers() -> None:
    page = "# T\n## A\n| field | x |\n| --- | --- |\n| `a`, `b.c` | `not` |\n### Sub\n| `d` | y |\n## B\n| `e` | z |\n"
    assert first_column_names(section(page, "## A")) == {"a", "b.c", "d"}
    assert first_column_names(section(page, "### Sub")) == {"d"}
    assert first_column_names(section(page, "## B")) == {"e"}


def test_every_status_field_of_the_crd_has_a_row_on_the_status_page_and_every_row_is_one() -> None:
    schema = _status_schema()
    fields = set(schema["properties"])
    assert {"phase", "lastFailure", "goodput", "slices", "lastResize"} <= fields  # a floor: the reader sees the CRD
    documented = documented_status_fields(STATUS_PAGE.read_text())
    top_level = {name.split(".")[0] for name in documented}
    missing = sorted(fields - top_level)
    assert not missing, f"status fields without a row in docs/concepts/status.md: {missing}"
    stale = sorted(name for name in documented if not _schema_has(schema, name.split(".")))
    assert not stale, f"docs/concepts/status.md has rows for fields the CRD does not have: {stale}"
    # The failure record, field by field: the page's lastFailure table.
    failure_fields = {f"lastFailure.{name}" for name in schema["properties"]["lastFailure"]["properties"]}
    undocumented = sorted(failure_fields - documented)
    assert not undocumented, f"lastFailure fields without a row in docs/concepts/status.md: {undocumented}"


def condition_types_in_source(source: str) -> set[str]:
    """The condition types a module's set_condition(conditions, type, ...) calls can set: literals,
    module constants, locals (a type taken from a loop is not seen: the phases are added by the caller)."""
    tree = ast.parse(source)
    constants = module_constants(tree)
    found: set[str] = set()
    for scope in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        for call in ast.walk(scope):
            if isinstance(call, ast.Call) and _call_name(call) == "set_condition" and len(call.args) > 1:
                found.update(_strings(call.args[1], scope, constants))
    return found


def operator_condition_types() -> set[str]:
    found: set[str] = set(status.CONDITION_TYPES)  # one per phase (status.with_phase)
    for path in sorted(OPERATOR.rglob("*.py")):
        found |= condition_types_in_source(path.read_text())
    return found


def test_the_condition_finder_reads_literals_and_constants() -> None:
    source = """
KIND = "Kind"
def f(c):
    set_condition(c, KIND, True, "R", "m", now)
    set_condition(c, "Other", 1, "R", "m", n)
"""
    assert condition_types_in_source(source) == {"Kind", "Other"}


def test_every_condition_type_the_operator_sets_is_on_the_status_page() -> None:
    types = operator_condition_types()
    assert {"Succeeded", "CheckpointStorageReachable", "LocalCheckpointTierSaving", "PolicyViolation"} <= types
    listed = first_column_names(section(STATUS_PAGE.read_text(), "## Conditions"))
    assert not types - listed, f"conditions missing from docs/concepts/status.md: {sorted(types - listed)}"
    stale = sorted(listed - types)
    assert not stale, f"docs/concepts/status.md lists conditions the operator never sets: {stale}"


def test_every_phase_stage_and_column_is_on_the_status_page() -> None:
    page = STATUS_PAGE.read_text()
    phases = set(typing.get_args(api.Phase))
    stages = set(typing.get_args(api.Stage))
    rows = {line.split("|")[1].strip() for line in section(page, "## Phase").splitlines() if line.startswith("| ")}
    assert not phases - rows, f"phases missing from docs/concepts/status.md: {sorted(phases - rows)}"
    listed = first_column_names(section(page, "## Stage"))
    assert listed == stages, f"docs/concepts/status.md stages {sorted(listed)} != the API's {sorted(stages)}"
    columns = {c["name"] for c in _crd_version()["additionalPrinterColumns"]}
    shown = {line.split("|")[1].strip() for line in page.split("## Phase")[0].splitlines() if line.startswith("| ")}
    assert not columns - shown, f"printer columns missing from docs/concepts/status.md: {sorted(columns - shown)}"


def test_every_event_the_operator_posts_has_a_row_in_troubleshootings_events_table_and_only_those() -> None:
    events = operator_event_reasons()
    assert {"Created", "FailureDetected", "Resized", "CheckpointIncompatible"} <= events  # a floor
    listed = first_column_names(section(TROUBLESHOOTING.read_text(), "## Events"))
    assert not events - listed, f"Events without a row in docs/troubleshooting.md: {sorted(events - listed)}"
    stale = sorted(listed - events)
    assert not stale, f"docs/troubleshooting.md's Events table lists what the operator never posts as an Event: {stale}"
