"""GrammarCompiler / RequestGrammar over the tiny ASCII tokenizer (token i is chr(31 + i), 0 is
EOS): the masks of a verify step's rows follow the drafts, the state is left where it was,
advancing stops at the token that completes the grammar, errors name the field."""

import pytest
import torch

from blockdraft import StructuredOutputsParams as SO
from blockdraft.sample.bitmask import bitmask_words
from blockdraft.structured import grammar as grammar_mod
from blockdraft.structured.grammar import GrammarCompiler, _close_objects, fill_bitmasks
from tests.conftest import EOS_ID, VOCAB, make_ascii_tokenizer, make_tokenizer


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(make_ascii_tokenizer(), VOCAB, (EOS_ID,))


def _allowed(out):
    return [set(((row[:, None] >> torch.arange(32)) & 1).flatten()[:VOCAB].nonzero().flatten().tolist()) for row in out]


def _rows(grammar, drafts):
    """The masks of one request's rows, computed one by one (RequestGrammar.fill_bitmask) and, for
    a request without blocked EOS, by the parallel executor as a step computes them (beside
    another request's rows): both must agree, and leave the grammar where it was."""
    out = torch.zeros(len(drafts) + 1, bitmask_words(VOCAB), dtype=torch.int32)
    grammar.fill_bitmask(out, drafts)
    if not grammar.blocked_eos:
        other = grammar.__class__(grammar.matcher.deep_copy(), VOCAB, (), grammar.executor)
        batch = torch.full((2 * (len(drafts) + 1), bitmask_words(VOCAB)), -1, dtype=torch.int32)
        fill_bitmasks([(other, 0, list(drafts)), (grammar, len(drafts) + 1, list(drafts))], batch)
        assert torch.equal(batch[len(drafts) + 1:], out) and torch.equal(batch[:len(drafts) + 1], out)
    return _allowed(out)


ALL = set(range(VOCAB))


def T(text: str) -> list[int]:
    """The token ids of `text`."""
    return [ord(c) - 31 for c in text]


def test_each_verify_row_is_masked_with_the_state_after_the_drafts_before_it(compiler):
    g = compiler.matcher(SO(regex="[a-e]+"))
    letters = set(T("abcde"))
    # "c" fits, "z" does not: rows after the refused draft are never emitted and allow everything
    assert _rows(g, T("czb")) == [letters, letters | {EOS_ID}, ALL, ALL]
    assert _rows(g, []) == [letters]  # the drafts were rolled back
    assert g.advance(T("c")) == (1, False)
    assert _rows(g, T("de")) == [letters | {EOS_ID}] * 3


def test_rows_after_a_draft_that_completes_the_grammar_allow_only_eos(compiler):
    g = compiler.matcher(SO(regex="(ok|no)!"))
    ok, no = T("ok!"), T("no!")
    # the request ends at "!": rows after the one it completes are never emitted, so left free
    assert _rows(g, ok + [EOS_ID, EOS_ID]) == [{ok[0], no[0]}, {ok[1]}, {ok[2]}, {EOS_ID}, ALL, ALL]
    assert _rows(g, ok[:1]) == [{ok[0], no[0]}, {ok[1]}]  # rolled back to the start
    assert g.advance(ok + [EOS_ID]) == (3, True)  # ends at the completing token, before EOS


def test_a_refused_token_stops_the_advance_and_names_the_error(compiler):
    g = compiler.matcher(SO(regex="(ok|no)!"))
    assert g.advance(T("oh")) == (1, False)
    assert g.error


@pytest.mark.parametrize("so, first", [
    (SO(choice=["yes", "no", "never"]), set(T("yn"))),
    (SO(grammar='root ::= "a" | "b" root'), set(T("ab"))),  # GBNF, as vLLM's examples write it
    (SO(grammar='start: "c"+'), set(T("c"))),  # Lark
    (SO(json={"type": "object"}), set(T("{"))),
    (SO(json_object=True), set(T("{"))),
    (SO(json={"type": "array"}), set(T("["))),
])
def test_choices_grammars_and_schemas(compiler, so, first):
    assert _rows(compiler.matcher(so), []) == [first]


def test_json_options(compiler):
    tight = compiler.matcher(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                disable_any_whitespace=True))
    assert tight.advance(T('{"a"')) == (4, False)
    assert _rows(tight, []) == [set(T(":"))]  # no space before the colon
    closed = compiler.matcher(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                 disable_additional_properties=True, disable_any_whitespace=True))
    assert _rows(closed, T('{"')) [2] == set(T("a"))  # no other property name may start


def test_constraints_compile_once(compiler, monkeypatch):
    calls = []
    source = grammar_mod.grammar_source
    monkeypatch.setattr(grammar_mod, "grammar_source", lambda p: calls.append(p) or source(p))
    for _ in range(3):
        compiler.check(SO(regex="[0-9]+"))
        compiler.matcher(SO(regex="[0-9]+"))
    assert len(calls) == 1


@pytest.mark.parametrize("so, words", [
    (SO(regex="(ab"), ["structured_outputs.regex is invalid"]),
    (SO(grammar="start: undefined_rule"), ["structured_outputs.grammar", "undefined_rule"]),
    (SO(grammar="root ::= ("), ["structured_outputs.grammar"]),
    (SO(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), ["structured_outputs.json is invalid"]),
    (SO(structural_tag={"triggers": ["<f"]}), ["structural_tag", "structures"]),
    (SO(structural_tag={"triggers": ["<a"], "structures": [{"begin": 1, "schema": {}, "end": "x"}]}),
     ["needs begin and end (non-empty strings) and schema (an object)"]),
    (SO(structural_tag={"triggers": [""], "structures": [{"begin": "", "schema": {}, "end": "x"}]}),
     ["triggers must be non-empty strings"]),
    (SO(structural_tag={"triggers": ["<a"], "structures": [{"begin": "<a>", "schema": {}, "end": None}]}),
     ["needs begin and end"]),
    (SO(structural_tag={"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {"type": "foo"}, "end": "</f>"}]}),
     ["structured_outputs.structural_tag (the schema of '<f>') is invalid", "foo"]),
    (SO(structural_tag={"triggers": ["<g"], "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}),
     ["no trigger starts", "<f>"]),
])
def test_bad_constraints_raise_naming_the_field(compiler, so, words):
    with pytest.raises(ValueError) as e:
        compiler.check(so)
    for w in words:
        assert w in str(e.value)
    assert e.value.param == so.kind


def test_a_choice_of_thousands_and_of_regex_characters(compiler):
    """Choices compile as one regex (a Lark rule of 2,000 alternatives stopped working), each
    string literal, regex characters included."""
    many = compiler.matcher(SO(choice=[f"option {i}" for i in range(3000)]))
    assert many.advance(T("option 2999")) == (11, True)
    odd = ["a.b|c (d)", "x\\y", "a-b~c#d&e$", "[^]*"]
    for text in odd:
        assert compiler.matcher(SO(choice=odd)).advance(T(text)) == (len(text), True), text
    assert compiler.matcher(SO(choice=odd)).advance(T("abb")) == (1, False)  # "a.b" is no wildcard


def test_ignore_eos_masks_eos_until_the_grammar_is_complete(compiler):
    plain, blocked = (compiler.matcher(SO(regex="[0-9]{1,3}"), block_eos=b) for b in (False, True))
    digits = set(T("0123456789"))
    assert _rows(plain, T("12")) == [digits, digits | {EOS_ID}, digits | {EOS_ID}]
    assert _rows(blocked, T("12")) == [digits, digits, digits]
    assert blocked.advance(T("123")) == (3, True)
    assert _rows(blocked, []) == [{EOS_ID}]  # complete: EOS is all that is left


def test_blocking_an_id_in_a_words_top_bit():
    """Token ids 31 mod 32 sit in an int32 word's sign bit."""
    g = GrammarCompiler(make_ascii_tokenizer(), VOCAB, (T(">")[0], EOS_ID)).matcher(SO(regex="a>?"), block_eos=True)
    assert T(">")[0] % 32 == 31
    assert g.advance(T("a")) == (1, False)
    assert _rows(g, []) == [set()]  # ">" and EOS were the only ways on


@pytest.mark.parametrize("so, message", [
    (SO(regex="[a-"), 'structured_outputs.regex is invalid: invalid regex "[a-": unclosed character class'),
    (SO(json_object=True, whitespace_pattern="(("), 'structured_outputs.whitespace_pattern is invalid: invalid regex '
                                                    '"((": unclosed group'),
    (SO(json={"type": "string", "pattern": "[x"}), 'structured_outputs.json is invalid: invalid regex "[x": unclosed '
                                                   'character class'),
])
def test_a_regex_that_does_not_parse_is_one_line_about_the_users_regex(compiler, so, message):
    """llguidance reports a regex over several lines, with the Lark source it wraps the regex in
    (`start: /[a-/`): the error keeps the regex and the reason, on one line."""
    with pytest.raises(ValueError) as e:
        compiler.check(so)
    assert str(e.value) == message


def test_a_bad_whitespace_pattern_is_named_as_such(compiler):
    with pytest.raises(ValueError, match="structured_outputs.whitespace_pattern is invalid") as e:
        compiler.check(SO(json_object=True, whitespace_pattern="(a"))
    assert e.value.param == "whitespace_pattern"


def test_a_tokenizer_llguidance_cannot_read_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="structured_outputs cannot use this tokenizer.*decoder"):
        GrammarCompiler(make_tokenizer(), VOCAB, (EOS_ID,))  # word-level, no decoder


def test_disable_additional_properties_closes_every_object_that_lists_properties():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}}},
              "$defs": {"e": {"properties": {}, "additionalProperties": True}}}
    _close_objects(schema)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["a"]["additionalProperties"] is False
    assert schema["properties"]["c"]["items"]["additionalProperties"] is False
    assert schema["$defs"]["e"]["additionalProperties"] is True  # said explicitly: kept
    assert "additionalProperties" not in schema["properties"]["c"]  # an array


@pytest.mark.parametrize("setting, closed", [(None, True), (True, True), (False, False)])
def test_objects_that_list_properties_are_closed_by_default_as_vllms_xgrammar(compiler, setting, closed):
    """After a complete property, an open object may take another (","), a closed one only ends
    ("}"): closed unless disable_additional_properties=False (a trial's small model, given an open
    schema, added keys until max_tokens)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = compiler.matcher(SO(json=schema, disable_additional_properties=setting, disable_any_whitespace=True))
    assert SO(json=schema, disable_additional_properties=setting).closes_objects is closed
    assert g.advance(T('{"a":1')) == (6, False)
    after = _rows(g, [])[0]
    assert set(T("}")) <= after and (set(T(",")) <= after) is not closed


def test_forced_tokens_replace_the_drafts_up_to_the_first_refused_one(compiler):
    g = compiler.matcher(SO(regex="abc(d|e)+!"))
    assert g.steer_drafts(T("zzzd")) == T("abcd")  # forced a, b, c; d is the drafter's, and allowed
    assert g.steer_drafts(T("zzzqx")) == T("abcqx")  # q refused: the rest is left as drafted
    assert g.steer_drafts(T("abc")) == T("abc")
    assert _rows(g, []) == [set(T("a"))]  # the matcher is where it was
    assert g.advance(T("abcde!")) == (6, True)
    assert g.steer_drafts(T("xy")) == T("xy")  # after the end: nothing to steer


def test_schemas_nested_past_pythons_recursion_limit_are_value_errors(compiler):
    schema = node = {"type": "object"}
    for _ in range(1200):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply") as e:
        compiler.check(SO(json=schema, disable_additional_properties=True))  # deepcopy + closing recurse
    assert e.value.param == "json"
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
        SO(json="[" * 50_000)  # as JSON text: json.loads recurses


def test_the_servers_fields_keep_the_closed_default_and_an_explicit_false():
    """response_format json_schema and structured_outputs without the option close objects (as
    vLLM's default backend); structured_outputs.disable_additional_properties false opens them."""
    from blockdraft.server.protocol import StructuredOutputsRequest

    schema = {"type": "object", "properties": {"a": {}}}
    assert StructuredOutputsRequest.model_validate({"json": schema}).params().closes_objects
    assert not StructuredOutputsRequest.model_validate({"json": schema, "disable_additional_properties": False}
                                                       ).params().closes_objects
    assert StructuredOutputsRequest.model_validate({"json": schema, "disable_additional_properties": None}
                                                   ).params().closes_objects


def test_closing_leaves_data_keywords_and_property_names_alone():
    """const / enum values are data, and a property named "properties" is a property (a trial saw
    `const: {"properties": ...}` closed into an unmatchable value)."""
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "c": {"const": {"properties": {"x": 1}}},
                                               "e": {"enum": [{"properties": {}}]}},
              "default": {"properties": {}}}
    _close_objects(schema)
    assert schema["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]  # the name map is not a schema
    assert schema["properties"]["properties"]["additionalProperties"] is False  # the property's schema is
    assert schema["properties"]["c"]["const"] == {"properties": {"x": 1}}
    assert schema["properties"]["e"]["enum"] == [{"properties": {}}]
    assert schema["default"] == {"properties": {}}


def test_closing_keeps_allof_satisfiable():
    """Properties split across allOf branches (and a $defs a branch refers to) stay open, else the
    branches refuse each other's properties; objects nested inside them are still closed."""
    schema = {"allOf": [{"$ref": "#/$defs/base"},
                        {"type": "object", "properties": {"b": {"type": "object", "properties": {"z": {}}}},
                         "required": ["b"]}],
              "$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        "other": {"type": "object", "properties": {"q": {}}}}}
    _close_objects(schema)
    assert "additionalProperties" not in schema["allOf"][1] and "additionalProperties" not in schema["$defs"]["base"]
    assert schema["allOf"][1]["properties"]["b"]["additionalProperties"] is False
    assert schema["$defs"]["other"]["additionalProperties"] is False


@pytest.mark.parametrize("schema, text", [
    ({"const": {"properties": {"x": 1}}}, '{"properties":{"x":1}}'),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, '{"a":1,"b":2}'),
])
def test_schemas_the_closing_once_broke_compile_and_accept_their_json(compiler, schema, text):
    g = compiler.matcher(SO(json=schema, disable_any_whitespace=True))
    assert g.advance(T(text)) == (len(text), True)
