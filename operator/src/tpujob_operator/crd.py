"""Generate the TrainingJob CRD from the pydantic models in api.py (`make crds`).

Pydantic emits JSON Schema with $ref/$defs, anyOf-null for optionals and titles; Kubernetes wants a
structural OpenAPI v3 schema with everything inlined. `to_structural` does that translation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from . import api

CRD_FILES = (Path("crds/trainingjob.yaml"), Path("charts/tpujob/crds/trainingjob.yaml"))
_DROPPED_KEYS = {"title"}
_CEL = "x-kubernetes-validations"


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _resolve(defs[node["$ref"].split("/")[-1]], defs)
        extra = _resolve({k: v for k, v in node.items() if k != "$ref"}, defs)
        # Rules on the field (e.g. immutability) add to the rules of the type, never replace them.
        rules = target.get(_CEL, []) + extra.get(_CEL, [])
        return {**target, **extra, **({_CEL: rules} if rules else {})}
    node = {k: _resolve(v, defs) for k, v in node.items() if k not in _DROPPED_KEYS and k != "$defs"}
    if "anyOf" in node:
        node = _collapse_any_of(node)
    if node.get("type") == "object" and node.get("additionalProperties") is True:
        node = {k: v for k, v in node.items() if k != "additionalProperties"}
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node[bound], bool):
            # JSON Schema 2020 (pydantic's gt/lt) gives the number; OpenAPI v3.0 a flag on minimum/maximum.
            node[limit], node[bound] = node[bound], True
    if node.get("default", 0) is None:
        del node["default"]
    return node


def _collapse_any_of(node: dict[str, Any]) -> dict[str, Any]:
    options = [o for o in node["anyOf"] if o.get("type") != "null"]
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    types = sorted(o.get("type", "") for o in options)
    if len(options) == 1:
        return {**options[0], **rest}
    if types == ["integer", "string"]:
        # The string side's maxLength bounds the CEL cost of rules on the value (e.g. isQuantity()).
        (string,) = [o for o in options if o.get("type") == "string"]
        bounds = {k: v for k, v in string.items() if k == "maxLength"}
        return {**rest, **bounds, "x-kubernetes-int-or-string": True}
    raise ValueError(f"cannot express anyOf {options} in a structural schema")


def to_structural(model: type[api.ApiModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="serialization")
    result: dict[str, Any] = _resolve(schema, schema.get("$defs", {}))
    return result


def build_crd() -> dict[str, Any]:
    spec_schema = to_structural(api.TrainingJobSpec)
    status_schema = to_structural(api.TrainingJobStatus)
    status_schema["properties"]["conditions"].update(
        {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )
    root = {
        "type": "object",
        "description": "A JAX training job on GKE TPU slices with continuous checkpointing and automatic restarts.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {**spec_schema, "description": "Desired state of the training job."},
            "status": {**status_schema, "description": "Observed state, written by the operator."},
        },
        "x-kubernetes-validations": api.NAME_RULES,
    }
    columns = [
        ("Phase", "string", ".status.phase", "Lifecycle phase"),
        ("Stage", "string", ".status.stage", "Which clock the job is on (Scheduling, StartingUp, Training, ...)"),
        ("Step", "integer", ".status.step", "Last step reported by the trainer"),
        ("Checkpoint", "integer", ".status.latestCheckpoint.step", "Latest committed checkpoint step"),
        ("Slices", "integer", ".status.slices", "Slices the current attempt runs on (fewer while elastic shrank it)"),
        ("Restarts", "integer", ".status.restarts", "Automatic restarts so far"),
        ("InPlace", "integer", ".status.inPlaceRestarts", "Of the restarts, those done in place (same pods)"),
        ("Goodput", "number", ".status.goodput.ratio", "Productive share of the job's wall time"),
        ("Age", "date", ".metadata.creationTimestamp", None),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.KIND.lower(),
                "shortNames": api.SHORT_NAMES,
                "categories": ["all"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": n, "type": t, "jsonPath": p, **({"description": d} if d else {})}
                        for n, t, p, d in columns
                    ],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated from operator/src/tpujob_operator/api.py by `make crds`. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root")
    parser.add_argument("--check", action="store_true", help="fail if a generated file differs")
    args = parser.parse_args(argv)
    text = render()
    stale = []
    for relative in CRD_FILES:
        path = args.root / relative
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(relative))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print(f"stale CRD files (run `make crds`): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
