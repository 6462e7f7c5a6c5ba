"""StructuredOutputsParams: exactly one constraint, typed fields, errors that name the field; and
SamplingParams takes it (vLLM's names and import paths)."""

import pytest

from blockdraft import SamplingParams, StructuredOutputsParams
from blockdraft.sampling_params import StructuredOutputsParams as FromSamplingParams


@pytest.mark.parametrize("kw, kind", [
    (dict(json={"type": "object"}), "json"),
    (dict(json='{"type": "integer"}'), "json"),
    (dict(regex="[a-z]+"), "regex"),
    (dict(choice=["yes", "no"]), "choice"),
    (dict(grammar='root ::= "a" | "b"'), "grammar"),
    (dict(json_object=True), "json_object"),
    (dict(structural_tag={"triggers": ["<f"], "structures": []}), "structural_tag"),
    (dict(choice=("a",), json_object=False), "choice"),  # a tuple is taken; json_object False is no constraint
])
def test_one_constraint_names_its_kind(kw, kind):
    assert StructuredOutputsParams(**kw).kind == kind


@pytest.mark.parametrize("kw, words", [
    (dict(), ["exactly one of", "none"]),
    (dict(regex="a", choice=["b"]), ["exactly one of", "'regex', 'choice'"]),
    (dict(json_object=False), ["exactly one of", "none"]),
    (dict(choice=[]), ["choice", "non-empty list"]),
    (dict(choice=["a", ""]), ["choice", "non-empty list"]),
    (dict(choice="yes"), ["choice", "non-empty list"]),
    (dict(regex=""), ["regex", "non-empty string"]),
    (dict(grammar=5), ["grammar", "non-empty string"]),
    (dict(json="{not json"), ["json", "not valid JSON"]),
    (dict(json="[1, 2]"), ["json", "JSON object"]),
    (dict(json="true"), ["json", "JSON object"]),  # a boolean schema: llguidance takes objects only
    (dict(json=[{"type": "object"}]), ["json", "dict or its JSON text", "list"]),
    (dict(json_object="yes"), ["json_object", "must be a boolean (true or false)"]),
    (dict(regex="a", disable_any_whitespace=1), ["disable_any_whitespace", "must be a boolean (true or false)"]),
    (dict(json_object=True, whitespace_pattern=""), ["whitespace_pattern", "non-empty string"]),
])
def test_bad_constraints_are_refused_naming_the_field(kw, words):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kw)
    for w in words:
        assert w in str(e.value)


def test_sampling_params_take_it_and_check_it_again():
    so = StructuredOutputsParams(choice=["a", "b"])
    params = SamplingParams(structured_outputs=so)
    assert params.structured_outputs is so and FromSamplingParams is StructuredOutputsParams
    so.choice = []  # changed after construction: the engine's verify() sees it
    with pytest.raises(ValueError, match="choice"):
        params.verify()
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams.*dict"):
        SamplingParams(structured_outputs={"choice": ["a"]})


def test_a_schema_nested_too_deeply_is_a_value_error():
    schema = node = {}
    for _ in range(3000):
        node["properties"] = {"a": {}}
        node = node["properties"]["a"]
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
        StructuredOutputsParams(json=schema).key()


def test_disable_fallback_is_taken_as_vllm_takes_it():
    assert StructuredOutputsParams(regex="a", disable_fallback=True).disable_fallback
    with pytest.raises(ValueError, match=r"disable_fallback must be a boolean \(true or false\)"):
        StructuredOutputsParams(regex="a", disable_fallback="yes")


def test_equal_constraints_share_a_key():
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.key() == StructuredOutputsParams(json={"a": 2, "b": 1}).key()
    assert a.key() != StructuredOutputsParams(json={"a": 2, "b": 1}, disable_any_whitespace=True).key()


def test_generate_cli_structured_outputs_with_and_without_the_drafter(tmp_path, capsys):
    """`blockdraft generate --structured-outputs`: the answer follows the regex and ends with it, the
    drafter's answer is plain decoding's; a misspelt field is refused before anything loads."""
    import json
    import re

    from blockdraft.cli import main
    from tests.conftest import make_ascii_tokenizer
    from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    make_ascii_tokenizer().save_pretrained(str(model))
    drafter = write_tiny_drafter(tmp_path / "drafter", model)
    regex = "(ab|cd)+!"
    outs = {}
    for name, flags in {"plain": ["--no-draft"], "draft": ["--draft", str(drafter)]}.items():
        code = main(["generate", "xyz", "--raw", "--model", str(model), "--max-tokens", "40", "--json",
                     "--structured-outputs", json.dumps({"regex": regex}), *flags])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs[name] = json.loads(out)
    assert outs["draft"]["token_ids"] == outs["plain"]["token_ids"]
    assert re.fullmatch(regex, outs["plain"]["text"]) and outs["plain"]["finish_reason"] == "stop"
    assert main(["generate", "xyz", "--model", str(model), "--structured-outputs", '{"chioce": ["a"]}']) == 2
    assert "unknown field(s) ['chioce']" in capsys.readouterr().err
