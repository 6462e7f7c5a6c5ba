"""Answers -> OpenAI tool calls, incrementally: each parser takes the answer's text piece by piece
(`feed`, then `finish` once it is complete) and gives what a stream sends for it: content text and
tool-call delta items ({"index", "id", "type", "function": {"name", "arguments"}}, the later items
of a call only {"index", "function": {"arguments"}}). A whole answer is the same parser fed once
(`parse_whole`), accumulated as the OpenAI client accumulates a stream (`accumulate`), so a stream
always adds up to the non-streamed answer.

- NamedCallParser: a named tool_choice: the whole answer is the arguments (JSON text) of one call,
  streamed as it comes (as vLLM).
- RequiredCallsParser: tool_choice "required": the answer is vLLM's JSON array of
  {"name", "parameters"}; each call is sent whole once its array element is complete.
- HermesParser: tool_choice "auto" with `--tool-call-parser hermes`: `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks in free text; each call is sent whole once its block is
  closed (vLLM streams the arguments as they come), the text outside the blocks is content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def new_call_id() -> str:
    """A tool call id, vLLM's form: "chatcmpl-tool-" and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallsDelta:
    """What one piece of an answer adds: content text and tool-call delta items (OpenAI's
    delta.tool_calls entries, `index` counting the choice's calls from 0)."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def extend(self, other: "CallsDelta") -> "CallsDelta":
        """Append `other` to this delta (in place); returns self."""
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self

    def message(self) -> dict:
        """The stream's `delta` object: "content" and "tool_calls" when not empty ({} for none)."""
        out: dict = {}
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def whole_call(index: int, name: str, arguments: str) -> dict:
    """The delta item of a call sent whole: a fresh id, its name and all its arguments (JSON text)."""
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def arguments_text(arguments: dict) -> str:
    """A call's parsed arguments as the JSON text answers give (vLLM's json.dumps, non-ASCII kept)."""
    return json.dumps(arguments, ensure_ascii=False)


class NamedCallParser:
    """A named tool_choice: the answer (constrained to the function's parameters schema) is the
    arguments of one call of `name`. The first non-empty piece sends the call's id, type, name and
    the text so far; later pieces only more arguments text. An empty answer still gives the call
    (with arguments "")."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> CallsDelta:
        """The delta of the next piece of the answer (nothing for an empty piece)."""
        if not text:
            return CallsDelta()
        if self.num_calls:
            return CallsDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}])
        self.num_calls = 1
        return CallsDelta(tool_calls=[whole_call(0, self.name, text)])

    def finish(self) -> CallsDelta:
        """The end of the answer: the call itself if no text came."""
        if self.num_calls:
            return CallsDelta()
        self.num_calls = 1
        return CallsDelta(tool_calls=[whole_call(0, self.name, "")])


class RequiredCallsParser:
    """tool_choice "required": the answer is a JSON array of {"name", "parameters"} objects
    (definitions.required_calls_schema). Each element is sent as a whole call once it is complete
    (its closing brace at depth 1), its parameters as JSON text; an element that does not parse as
    such an object (the grammar allows none) is skipped. No content."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._text = ""
        self._pos = 0  # scanned up to here
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._start = -1  # where the element being read began

    def feed(self, text: str) -> CallsDelta:
        """The calls whose array elements this piece completes."""
        self._text += text
        out = CallsDelta()
        for i in range(self._pos, len(self._text)):
            end = self._scan(self._text[i], i)
            if end:
                out.extend(self._call(self._text[self._start:i + 1]))
        self._pos = len(self._text)
        return out

    def finish(self) -> CallsDelta:
        """Nothing more: an element left open (the answer was cut) gives no call."""
        return CallsDelta()

    def _scan(self, c: str, i: int) -> bool:
        """Advance the JSON scanner over character `c` at `i`; True when it closes an element."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
            return False
        if c == '"':
            self._in_string = True
        elif c in "[{":
            if self._depth == 1 and c == "{":
                self._start = i
            self._depth += 1
        elif c in "]}":
            self._depth -= 1
            return self._depth == 1 and c == "}"
        return False

    def _call(self, element: str) -> CallsDelta:
        try:
            value = json.loads(element)
        except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
            return CallsDelta()
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "parameters" not in value:
            return CallsDelta()
        self.num_calls += 1
        return CallsDelta(tool_calls=[whole_call(self.num_calls - 1, value["name"], arguments_text(value["parameters"]))])


class HermesParser:
    """vLLM's `hermes` tool-call format (Qwen2.5, Hermes 2/3): calls are
    `<tool_call>{"name": str, "arguments": {...}}</tool_call>` blocks in the answer.

    A block whose JSON is an object with a string "name" and an object "arguments" (left out: {})
    is a call, sent whole once its closing tag arrives; a block that is not stays in the content,
    tags included. A block still open at the end is a call if its text parses (as vLLM's parser
    takes an unclosed last block), else content. The text outside the blocks is content, less
    the whitespace right before a call and, in an answer with calls, at its end (the newlines
    around blocks); so whitespace is held until text follows, and text that may be the start of a
    `<tool_call>` tag until it is known not to be. parallel False (parallel_tool_calls: false):
    calls after the first are dropped, as vLLM does.
    """

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.num_calls = 0
        self._buffer = ""
        self._inside = False  # in a block (its start tag consumed)
        self._space = ""  # trailing whitespace of the content, not sent yet
        self._space_before_block = ""  # the whitespace before the open block (content if it is not a call)

    def feed(self, text: str) -> CallsDelta:
        """What this piece completes: content outside blocks (less held whitespace or a possible
        tag start) and the calls of the blocks it closes."""
        self._buffer += text
        out = CallsDelta()
        while True:
            if self._inside:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    return out
                out.extend(self._block(self._buffer[:end], closed=True))
                self._buffer, self._inside = self._buffer[end + len(TOOL_CALL_END):], False
                continue
            start = self._buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = _tag_prefix_len(self._buffer, TOOL_CALL_START)
                out.content += self._content(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            out.content += self._content(self._buffer[:start])
            self._space_before_block, self._space = self._space, ""
            self._buffer, self._inside = self._buffer[start + len(TOOL_CALL_START):], True

    def finish(self) -> CallsDelta:
        """The end of the answer: text held back is content; an open block is a call or content;
        trailing whitespace is content only in an answer without calls."""
        out = CallsDelta()
        if self._inside:
            out.extend(self._block(self._buffer, closed=False))
        else:
            out.content += self._content(self._buffer)
        if not self.num_calls:
            out.content += self._space
        self._buffer, self._inside, self._space = "", False, ""
        return out

    def _content(self, text: str) -> str:
        """The content to send for outside `text`: held whitespace and `text`, less their trailing
        whitespace, which is held."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        return body

    def _block(self, body: str, closed: bool) -> CallsDelta:
        """The delta of one block's `body` (between the tags): a call, nothing (a call past the
        first with parallel False), or the block, with the whitespace before it, as content when
        it is not a call."""
        call = parse_hermes_call(body)
        space, self._space_before_block = self._space_before_block, ""
        if call is None:
            self._space = space
            return CallsDelta(content=self._content(TOOL_CALL_START + body + (TOOL_CALL_END if closed else "")))
        if self.num_calls and not self.parallel:
            return CallsDelta()
        self.num_calls += 1
        return CallsDelta(tool_calls=[whole_call(self.num_calls - 1, *call)])


def parse_hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a hermes block's body, or None when it is not
    {"name": non-empty str, "arguments": object (optional)} JSON: a block with other keys (e.g. a
    model writing "parameters") stays content rather than becoming a call whose arguments are lost
    (vLLM's parser fails on it and gives the whole answer as content)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if set(value) - {"name", "arguments"}:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments_text(arguments)


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def accumulate(deltas: list[CallsDelta]) -> tuple[str, list[dict]]:
    """(content, tool calls) that a stream of these deltas adds up to, as the OpenAI client
    accumulates delta.tool_calls: by index, id / type / name from the first item that has them,
    arguments concatenated. Calls: [{"id", "type", "function": {"name", "arguments"}}] in index
    order."""
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for item in d.tool_calls:
            call = calls.setdefault(item["index"], {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            call["id"] = item.get("id") or call["id"]
            call["type"] = item.get("type") or call["type"]
            function = item.get("function", {})
            call["function"]["name"] = function.get("name") or call["function"]["name"]
            call["function"]["arguments"] += function.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def parse_whole(parser, text: str) -> tuple[str, list[dict]]:
    """(content, tool calls) of a whole answer: `parser` (a fresh one) fed `text` once, then
    finished (accumulate)."""
    return accumulate([parser.feed(text), parser.finish()])
