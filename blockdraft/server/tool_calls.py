"""Tool calls in /v1/chat/completions answers, as vLLM gives them: what a request's tool_choice
asks of the engine (a constraint) and how each choice's text becomes `message.tool_calls` or
stream deltas.

- named function: the answer is constrained to the function's parameters schema and is that
  call's arguments; content "" (vLLM), finish_reason the engine's ("stop": OpenAI's for a named
  call).
- "required": the answer is constrained to vLLM's JSON array of {"name", "parameters"} calls;
  content "", finish_reason "tool_calls" when it ended with "stop".
- "auto" (`--enable-auto-tool-choice --tool-call-parser hermes`): the hermes parser finds the
  `<tool_call>` blocks; content the text outside them (null when empty, or only whitespace beside
  calls), finish_reason "tool_calls" when it found calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockdraft.structured.params import StructuredOutputsParams
from blockdraft.tools.parsers import CallsDelta, HermesParser, NamedCallParser, RequiredCallsParser, parse_whole

TOOL_CALL_PARSERS = ("hermes",)  # --tool-call-parser values


@dataclass
class ToolPlan:
    """How one request's choices become tool calls.

    mode: "named", "required" or "auto". name: the function of a named tool_choice.
    parallel: parallel_tool_calls (False: at most one call per choice).
    constraint: the engine's output constraint (named / required), else None; constraint_field:
        the request field a constraint the engine refuses is reported under.
    """

    mode: str
    name: str | None = None
    parallel: bool = True
    constraint: StructuredOutputsParams | None = None
    constraint_field: str | None = None

    def parser(self):
        """A fresh parser for one choice (blockdraft.tools.parsers)."""
        if self.mode == "named":
            return NamedCallParser(self.name)
        if self.mode == "required":
            return RequiredCallsParser()
        return HermesParser(self.parallel)

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """The choice's finish_reason (vLLM's): "tool_calls" for auto with calls found and for
        required ending with "stop"; else the engine's (None while it runs)."""
        if engine_reason is None:
            return None
        if num_calls and (self.mode == "auto" or (self.mode == "required" and engine_reason == "stop")):
            return "tool_calls"
        return engine_reason

    def message(self, role: str, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
        """(the choice's message, its finish_reason) for a whole answer `text`: {"role",
        "content", "tool_calls"}; content "" for named / required (vLLM), the text outside the
        calls or null for auto."""
        parser = self.parser()
        content, calls = parse_whole(parser, text)
        if self.mode != "auto":
            content = ""
        message = {"role": role, "content": content or ("" if self.mode != "auto" else None), "tool_calls": calls}
        return message, self.finish_reason(engine_reason, parser.num_calls)


class ToolStream:
    """One streamed choice's tool-call parsing: its parser and the plan's finish_reason rule."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.parser()

    def delta(self, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
        """(the chunk's `delta` object, its finish_reason) for the choice's new text; with
        `engine_reason` (the last chunk) the parser is finished and what it held is sent."""
        d: CallsDelta = self.parser.feed(text)
        if engine_reason is not None:
            d.extend(self.parser.finish())
        return d.message(), self.plan.finish_reason(engine_reason, self.parser.num_calls)
