"""Generate the TrainingJob API reference (docs/reference/trainingjob.md) from the CRD that crd.py builds.

`python -m tpujob_operator.apidocs` writes it (`make crds` runs both); `--check` fails when the committed
page differs from what the CRD says, so `make lint` catches a reference left behind by a change to api.py.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .crd import build_crd

REFERENCE = Path("docs/reference/trainingjob.md")
_CEL = "x-kubernetes-validations"


def _cell(text: str) -> str:
    """Plain text as Markdown that stays in one table cell: <name> is text, not an HTML tag."""
    text = " ".join(text.split())
    for char, escaped in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("*", "\\*"), ("`", "'")):
        text = text.replace(char, escaped)
    return text


def _rule_lines(node: dict[str, Any]) -> list[str]:
    """The CEL rules' messages as list items; rules that differ only in one number (one per bound the
    spec may imply) read as one, with the range."""
    lines: list[str] = []
    groups: list[tuple[str, list[int]]] = []
    for message in (r["message"] for r in node.get(_CEL, []) if "message" in r):
        number = re.search(r"\d+", message)
        template = message if number is None else message[: number.start()] + "{}" + message[number.end() :]
        if number is not None and groups and groups[-1][0] == template:
            groups[-1][1].append(int(number.group()))
        else:
            groups.append((template, [int(number.group())] if number else []))
    for template, numbers in groups:
        shown = f"{min(numbers)} to {max(numbers)}" if len(numbers) > 1 else (str(numbers[0]) if numbers else "")
        lines.append(f"- {_cell(template.replace('{}', shown, 1) if numbers else template)}")
    return lines


def _code(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return "`" + text.replace("`", "'") + "`" if text else '`""`'


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string (quantity)"
    kind = node.get("type", "")
    if kind == "array":
        return f"array of {_type(node.get('items', {}))}"
    if kind == "object" and "additionalProperties" in node:
        return f"map of {_type(node['additionalProperties'])}"
    if kind == "object" and node.get("x-kubernetes-preserve-unknown-fields"):
        return "object (any fields)"
    return kind or "any"


def _constraints(node: dict[str, Any]) -> list[str]:
    """The schema's bounds in one line, then each CEL rule's message on its own."""
    out: list[str] = []
    if "enum" in node:
        out.append("one of " + ", ".join(_code(v) for v in node["enum"]))
    for key, word in (("minimum", "≥"), ("maximum", "≤")):
        if key in node:
            strict = node.get(f"exclusive{key.capitalize()}") is True
            out.append(f"{'>' if strict and key == 'minimum' else '<' if strict else word} {node[key]}")
    for key, word in (
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
        ("minProperties", "entries ≥"),
        ("maxProperties", "entries ≤"),
    ):
        if key in node:
            out.append(f"{word} {node[key]}")
    if "pattern" in node:
        out.append(f"pattern {_code(node['pattern'])}")
    bounds = [", ".join(out)] if out else []
    return bounds + [_cell(rule["message"]) for rule in node.get(_CEL, []) if "message" in rule]


def _children(node: dict[str, Any]) -> dict[str, Any]:
    """The object whose fields a node's fields are: itself, its array's items, or its map's values."""
    for inner in (node, node.get("items", {}), node.get("additionalProperties", {})):
        if isinstance(inner, dict) and inner.get("properties"):
            return inner
    return {}


def _sections(path: str, node: dict[str, Any], out: list[str]) -> None:
    fields = _children(node)
    if not fields:
        return
    required = set(fields.get("required", []))
    out += [f"### `{path}`", ""]
    if fields.get("description") and fields is not node:
        out += [_cell(fields["description"]), ""]
    if rules := _rule_lines(fields):
        out += ["Rules on the whole object:", "", *rules, ""]
    out += ["| field | type | default | description and rules |", "| --- | --- | --- | --- |"]
    nested: list[tuple[str, dict[str, Any]]] = []
    for name, child in fields["properties"].items():
        child_path = f"{path}.{name}"
        anchor = _children(child)
        typ = _type(child)
        if anchor:
            typ = f"[{typ}](#{_anchor(child_path)})"
            nested.append((child_path, child))
        description = ("**Required.** " if name in required else "") + _cell(child.get("description", ""))
        what = [w for w in (description, *_constraints(child)) if w]
        default = _code(child["default"]) if "default" in child else ""
        out.append(f"| `{name}` | {typ} | {default} | {'<br>'.join(what)} |")
    out.append("")
    for child_path, child in nested:
        _sections(child_path, child, out)


def _anchor(path: str) -> str:
    """The id mkdocs' toc gives the heading "`path`" (its slugify: lowercase, dots dropped)."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_")


def render(crd: dict[str, Any]) -> str:
    """The reference page for a CRD as crd.build_crd() gives it."""
    version = crd["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    names = crd["spec"]["names"]
    out = [
        "<!-- Generated from the CRD (operator/src/tpujob_operator/api.py) by `make crds`. Do not edit. -->",
        "",
        f"# {names['kind']} API reference",
        "",
        f"`apiVersion: {crd['spec']['group']}/{version['name']}`, `kind: {names['kind']}` "
        f"(plural `{names['plural']}`, short names {', '.join(f'`{s}`' for s in names.get('shortNames', []))}; "
        f"{crd['spec']['scope']}). {_cell(root.get('description', ''))}",
        "",
        "The same text is what `kubectl explain trainingjob.spec` prints. Every rule below is enforced by the "
        "apiserver at admission (schema and CEL), and again by the operator for a spec that got past an older CRD.",
        "",
        "## Columns of `kubectl get trainingjobs`",
        "",
        "| column | type | from | description |",
        "| --- | --- | --- | --- |",
        *(
            f"| {c['name']} | {c['type']} | `{c['jsonPath']}` | {_cell(c.get('description', ''))} |"
            for c in version.get("additionalPrinterColumns", [])
        ),
        "",
    ]
    if rules := _rule_lines(root):
        out += ["## Rules on the object", "", *rules, ""]
    for part in ("spec", "status"):
        out += [f"## {part}", "", _cell(root["properties"][part].get("description", "")), ""]
        _sections(part, root["properties"][part], out)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root")
    parser.add_argument("--check", action="store_true", help="fail if the committed reference differs")
    args = parser.parse_args(argv)
    text = render(build_crd())
    path = args.root / REFERENCE
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"stale API reference {REFERENCE} (run `make crds`)", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
