from pathlib import Path

from tpujob_operator import crd

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_files_match_a_fresh_generation():
    fresh = crd.render()
    for relative in crd.CRD_FILES:
        assert (ROOT / relative).read_text() == fresh, f"{relative} is stale: run `make crds`"


def _walk(node, path="$"):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}[{index}]")


def test_schema_is_structural_without_refs_or_untyped_nodes():
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if "properties" in node:
            assert node.get("type") == "object", f"{path} has properties but type {node.get('type')}"


def test_every_spec_field_has_a_description_for_kubectl_explain():
    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    missing = [
        path
        for path, node in _walk(spec)
        if "type" in node
        and ".items" not in path
        and not path.endswith(("additionalProperties",))
        and "description" not in node
        and path != "$"
    ]
    assert missing == []


def test_printer_columns():
    columns = crd.build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == ["Phase", "Step", "Checkpoint", "Restarts", "Age"]
