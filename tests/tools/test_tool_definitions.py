"""Tool definitions, tool_choice and the JSON Schemas of named and required tool choices."""

from __future__ import annotations

import json

import pytest

from blockdraft.tools.definitions import (
    NO_PARAMETERS,
    check_tool_choice,
    check_tools,
    required_calls_schema,
    resolve_tool_choice,
    tool_parameters,
)

WEATHER = {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "$defs": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "description": None, "strict": True}}]


def test_check_tools_keeps_what_was_given_and_drops_nulls():
    tools = check_tools(TOOLS)
    assert tools[0] == TOOLS[0] and tools[1] == {"type": "function", "function": {"name": "ping", "strict": True}}
    assert check_tools([]) == []


@pytest.mark.parametrize("tools, match", [
    ({"type": "function"}, "tools must be a list"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], r"tools\[0\] must be"),
    ([{"type": "code_interpreter"}], r"tools\[0\] must be .* \(type 'function' only\)"),
    ([{"type": "function", "function": "f"}], r"tools\[0\]\.function must be an object"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     r"tools\[1\]\.function\.name 'f' is also the name of tools\[0\]; tool names must be unique"),
    ([{"type": "function", "function": {"name": "x" * 65}}], r"tools\[0\]\.function\.name must be 1 to 64"),
    ([{"type": "function", "function": {"name": "a.b"}}], r"tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], r"description must be a string"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], r"strict must be true or false"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], r"parameters must be a JSON Schema of an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], r"parameters must be a JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "args": {}}}], r"unknown keys \['args'\]"),
])
def test_bad_tools_are_refused_naming_the_item(tools, match):
    with pytest.raises(ValueError, match=match):
        check_tools(tools)


def test_tool_choice_shapes_and_resolution():
    named = {"type": "function", "function": {"name": "ping"}}
    for choice in ("none", "auto", "required", named):
        assert check_tool_choice(choice) == choice
    for bad in ("any", {"type": "function", "name": "ping"}, {"type": "function", "function": {"name": 3}}, 5,
                {"type": "function", "function": {"name": "ping", "x": 1}}):
        with pytest.raises(ValueError, match="tool_choice must be one of 'none', 'auto', 'required' or"):
            check_tool_choice(bad)
    tools = check_tools(TOOLS)
    assert resolve_tool_choice(tools, None) == ("auto", None)  # vLLM's default with tools
    assert resolve_tool_choice(None, None) == ("none", None) == resolve_tool_choice([], None)
    assert resolve_tool_choice(tools, named) == ("named", "ping")
    assert resolve_tool_choice([], "required") == ("none", None)  # OpenAI's (and vLLM's) behaviour
    assert resolve_tool_choice(None, "none") == ("none", None)
    with pytest.raises(ValueError, match="tool_choice 'auto' needs tools"):
        resolve_tool_choice(None, "auto")
    with pytest.raises(ValueError, match=r"names the function 'nope', which is not one of the tools \(get_weather, ping\)"):
        resolve_tool_choice(tools, {"type": "function", "function": {"name": "nope"}})


def test_named_schema_is_the_tools_parameters_and_required_is_an_array_of_calls():
    tools = check_tools(TOOLS)
    assert tool_parameters(tools, "get_weather") == WEATHER and tool_parameters(tools, "ping") == NO_PARAMETERS
    schema = required_calls_schema(tools)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["ping"]] and schema["$defs"] == WEATHER["$defs"]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"] and "$defs" in WEATHER  # copied
    assert required_calls_schema(tools, parallel=False)["maxItems"] == 1
    clash = check_tools([TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "$defs": {"city": {"type": "integer"}}}}}])
    with pytest.raises(ValueError, match="tools define \\$defs 'city' with different schemas"):
        required_calls_schema(clash)


def test_the_schemas_compile_and_constrain(tmp_path):
    """The required schema compiles with llguidance over a byte-level tokenizer and accepts vLLM's
    call array form (a check of the schema, not of generation)."""
    from blockdraft.structured.grammar import GrammarCompiler
    from blockdraft.structured.params import StructuredOutputsParams
    from tests.conftest import EOS_ID, VOCAB, make_ascii_tokenizer

    tok = make_ascii_tokenizer()
    compiler = GrammarCompiler(tok, VOCAB, (EOS_ID,))
    grammar = compiler.matcher(StructuredOutputsParams(json=required_calls_schema(check_tools(TOOLS)),
                                                       disable_additional_properties=True))
    text = json.dumps([{"name": "ping", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}])
    ids = tok.encode(text, add_special_tokens=False)
    assert grammar.advance(ids) == (len(ids), True)
    bad = compiler.matcher(StructuredOutputsParams(json=required_calls_schema(check_tools(TOOLS)),
                                                   disable_additional_properties=True))
    ids = tok.encode('[{"name": "nope"', add_special_tokens=False)
    assert bad.advance(ids)[0] < len(ids)


@pytest.mark.parametrize("defs", [None, [1], "x"])
def test_required_calls_take_defs_only_as_an_object(defs):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": defs}}}
    if defs is None:  # null: no $defs
        assert required_calls_schema([tool])["type"] == "array"
        return
    with pytest.raises(ValueError, match=r"tool 'f': parameters.\$defs must be an object"):
        required_calls_schema([tool])
