from pathlib import Path

from tpujob_operator import api, crd

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
    assert [c["name"] for c in columns] == [
        "Phase",
        "Stage",
        "Step",
        "Checkpoint",
        "Slices",
        "Restarts",
        "InPlace",
        "Goodput",
        "Age",
    ]


def _spec_schema():
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_every_number_in_the_spec_has_a_maximum():
    """Nothing a user writes can overflow a computation (restart.backoffSeconds: 1e12 once did)."""
    unbounded = [
        path
        for path, node in _walk(_spec_schema())
        if node.get("type") in ("integer", "number") and "maximum" not in node
    ]
    assert unbounded == []


def test_every_list_and_map_in_the_spec_has_a_size_limit():
    """The apiserver refuses CEL rules whose estimated cost is unbounded."""
    unbounded = [
        path
        for path, node in _walk(_spec_schema())
        if (node.get("type") == "array" and "maxItems" not in node)
        or ("additionalProperties" in node and "maxProperties" not in node)
    ]
    assert unbounded == []


def test_strings_that_cel_inspects_have_a_max_length():
    spec = _spec_schema()
    for path, node in _walk(spec):
        if node.get("type") == "string" and "x-kubernetes-validations" in node:
            assert "maxLength" in node or "enum" in node, path  # an enum's values bound it
    assert "maxLength" in spec["properties"]["env"]["items"]["properties"]["name"]
    assert "maxLength" in spec["properties"]["tpu"]["properties"]["topology"]


def test_every_spec_rule_message_names_a_field():
    messages = [
        rule["message"] for _, node in _walk(_spec_schema()) for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(messages) >= 12
    assert [m for m in messages if not m.startswith("spec.")] == []


def test_reserved_env_rule_is_generated_from_the_constant():
    env = _spec_schema()["properties"]["env"]["items"]
    [name_rule] = env["properties"]["name"]["x-kubernetes-validations"]
    assert name_rule == {"rule": "self.matches('^[-._a-zA-Z][-._a-zA-Z0-9]*$')", "message": api.ENV_NAME_MESSAGE}
    (reserved,) = [r for r in env["x-kubernetes-validations"] if r.get("fieldPath") == ".name"]
    for name in api.OPERATOR_ENV_NAMES:
        assert f"'{name}'" in reserved["rule"]
    for prefix in api.OPERATOR_ENV_PREFIXES:
        assert f"!self.name.startsWith('{prefix}')" in reserved["rule"]
    assert "self.name" in reserved["messageExpression"]


def test_new_spec_rules_are_in_the_schema():
    spec = _spec_schema()["properties"]
    restart = [r["rule"] for r in spec["restart"]["x-kubernetes-validations"]]
    assert restart == [
        "!has(self.maxBackoffSeconds) || !has(self.backoffSeconds) || self.maxBackoffSeconds >= self.backoffSeconds"
    ]
    for field in ("requests", "limits"):
        node = spec["resources"]["properties"][field]
        rules = " ".join(r["rule"] for r in node["x-kubernetes-validations"])
        value_rules = " ".join(r["rule"] for r in node["additionalProperties"]["x-kubernetes-validations"])
        assert "'google.com/tpu' in self" in rules and "isQuantity(" in value_rules, field
        assert node["maxProperties"] == api.MAX_RESOURCES
    directory = spec["checkpoint"]["properties"]["directory"]
    assert len(directory["x-kubernetes-validations"]) == 4
    assert spec["restart"]["properties"]["backoffSeconds"]["maximum"] == 604_800
    assert spec["env"]["maxItems"] == 256 and spec["args"]["maxItems"] == 1024


def test_no_refusal_prints_a_raw_regular_expression():
    """Issue 17 item 12: a pattern's refusal is the regex itself; every pattern is a CEL rule with words."""
    assert [path for path, node in _walk(crd.build_crd()) if "pattern" in node] == []


def test_what_would_orphan_the_run_is_immutable():
    """Issue 17 item 7: the checkpoint directory and the framework (the run's layout) and the TPU shape."""
    spec = _spec_schema()["properties"]
    transition = {
        path: rule["message"]
        for path, node in _walk(spec)
        for rule in node.get("x-kubernetes-validations", [])
        if "oldSelf" in rule["rule"]
    }
    assert transition == {
        "$.framework": api.FRAMEWORK_IMMUTABLE_MESSAGE,
        "$.tpu": "spec.tpu is immutable",
        "$.checkpoint.properties.directory": api.DIRECTORY_IMMUTABLE_MESSAGE,
    }
