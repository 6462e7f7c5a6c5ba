"""The tool-call parsers on strings: whole answers, and the same answers streamed in pieces split at
every position (one and two cuts), whose deltas must add up to the whole answer."""

from __future__ import annotations

import json

import pytest

from blockdraft.tools.parsers import (
    HermesParser,
    NamedCallParser,
    RequiredCallsParser,
    accumulate,
    parse_whole,
)

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC <b>"}}</tool_call>'


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    (CALL_A, "", [("get_weather", {"city": "Oslo", "days": 2})]),
    (f"{CALL_A}\n{CALL_B}\n", "", [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC <b>"})]),
    (f"Let me check.\n{CALL_A} Done.", "Let me check. Done.", [("get_weather", {"city": "Oslo", "days": 2})]),
    ('<tool_call>{"name": "ping"}</tool_call>', "", [("ping", {})]),  # arguments left out: {}
    ("no calls, a < b and <tool_ here  ", "no calls, a < b and <tool_ here  ", []),  # no calls: the text as it is
    ("   ", "   ", []),
    ('x <tool_call>{"name": "f", "arguments": {"a": 1}}', "x", [("f", {"a": 1})]),  # unclosed last block (vLLM)
])
def test_hermes_whole_answers(text, content, calls):
    got_content, got_calls = parse_whole(HermesParser(), text)
    assert got_content == content and _calls(got_calls) == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("block", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',  # arguments not an object
    '<tool_call>["f"]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # unclosed, incomplete JSON
])
def test_hermes_malformed_blocks_stay_content_and_do_not_hide_good_calls(block):
    content, calls = parse_whole(HermesParser(), f"Hi {CALL_B} and {block}")
    assert content == f"Hi and {block}" and _calls(calls) == [("get_time", {"zone": "UTC <b>"})]


def test_hermes_parallel_false_keeps_the_first_call():
    content, calls = parse_whole(HermesParser(parallel=False), f"{CALL_A}{CALL_B}")
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Oslo", "days": 2})]


def _streamed(parser_factory, text: str, cuts: tuple[int, ...]):
    parser = parser_factory()
    bounds = [0, *cuts, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    return deltas


STREAM_CASES = [
    (HermesParser, f"Let me check.\n{CALL_A}\n{CALL_B} ok <tool_call>{{bad}}</tool_call> <tool"),
    (HermesParser, f"  {CALL_A}  "),
    (HermesParser, 'a <tool_call>{"name": "f", "arguments": {}}'),
    (lambda: NamedCallParser("get_weather"), '{"city": "Oslo", "days": 2}'),
    (RequiredCallsParser, '[{"name": "f", "parameters": {"s": "}]{\\"["}}, {"name": "g", "parameters": {}}]'),
    (RequiredCallsParser, '[{"name": "f", "parameters": {}}, {"name": "g", "param'),  # cut: the complete call
]


@pytest.mark.parametrize("factory, text", STREAM_CASES, ids=["hermes", "hermes-space", "hermes-open", "named", "required",
                                                             "required-cut"])
def test_streamed_pieces_add_up_to_the_whole_answer_at_every_split(factory, text):
    whole_content, whole_calls = parse_whole(factory(), text)
    want = (whole_content, [c["function"] for c in whole_calls])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            deltas = _streamed(factory, text, (i, j))
            content, calls = accumulate(deltas)
            assert (content, [c["function"] for c in calls]) == want, (i, j)
            assert "<tool_call" not in "".join(d.content for d in deltas) or "{bad}" in text
            # each call's first item carries its id, type and name; later items only arguments
            seen = set()
            for d in deltas:
                for item in d.tool_calls:
                    assert ("id" in item) == (item["index"] not in seen)
                    seen.add(item["index"])


def test_hermes_holds_back_a_possible_tag_start_and_whitespace():
    p = HermesParser()
    assert p.feed("Hi <tool").content == "Hi"  # " <tool" may start a block
    assert p.feed("box> ").content == " <toolbox>"
    assert p.feed("<tool_call>").content == ""
    d = p.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert d.content == "" and [c["function"]["name"] for c in d.tool_calls] == ["f"]
    assert p.finish().content == ""


def test_named_parser_streams_arguments_and_an_empty_answer_is_still_a_call():
    p = NamedCallParser("f")
    first, second = p.feed('{"a"'), p.feed(": 1}")
    assert first.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a"'} and "id" in first.tool_calls[0]
    assert second.tool_calls == [{"index": 0, "function": {"arguments": ": 1}"}}]
    content, calls = parse_whole(NamedCallParser("f"), "")
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": ""}


def test_required_parser_gives_parameters_as_json_text():
    content, calls = parse_whole(RequiredCallsParser(), '[ {"name": "f", "parameters": {"city": "Zürich"}} ]')
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": '{"city": "Zürich"}'}


def test_answers_nested_past_pythons_recursion_limit_are_not_calls():
    from blockdraft.tools.parsers import HermesParser, RequiredCallsParser, parse_whole

    deep = "[" * 50_000
    assert parse_whole(HermesParser(), f"<tool_call>{deep}</tool_call>")[1] == []
    balanced = deep + "]" * 50_000
    assert parse_whole(HermesParser(), f"<tool_call>{balanced}</tool_call>")[1] == []
    assert parse_whole(RequiredCallsParser(), '[{"name": "f", "parameters": ' + balanced + "}]")[1] == []


def test_a_hermes_block_with_other_keys_stays_content():
    """A model writing "parameters" instead of "arguments": content, not a call with lost arguments."""
    from blockdraft.tools.parsers import HermesParser, parse_whole

    text = '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Rome"}}\n</tool_call>'
    content, calls = parse_whole(HermesParser(), text)
    assert calls == [] and '"parameters"' in content
    content, calls = parse_whole(HermesParser(), '<tool_call>{"name": "ping"}</tool_call>')
    assert [c["function"] for c in calls] == [{"name": "ping", "arguments": "{}"}] and not content
