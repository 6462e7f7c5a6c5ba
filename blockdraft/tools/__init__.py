"""Tool calling: tool definitions and tool_choice (definitions), and the parsers that turn an
answer into OpenAI tool calls, whole or as stream deltas (parsers)."""

from blockdraft.tools.definitions import check_tool_choice, check_tools, resolve_tool_choice  # noqa: F401
