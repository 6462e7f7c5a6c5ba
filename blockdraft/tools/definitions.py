"""Tool definitions (OpenAI's `tools`) and `tool_choice`, checked, and the JSON Schemas that
constrain an answer to tool calls, as vLLM builds them.

A tool is {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}};
`parameters` is a JSON Schema of an object (left out: no parameters). tool_choice is "none",
"auto", "required" or {"type": "function", "function": {"name": ...}} (a named function).
"""

from __future__ import annotations

import copy
import json
import re

TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without parameters: {}
TOOL_SHAPE = '{"type": "function", "function": {"name": str, "description": str, "parameters": {JSON Schema}}}'
NAMED_CHOICE_SHAPE = '{"type": "function", "function": {"name": "<one of the tools>"}}'


def check_tools(tools) -> list[dict]:
    """Check OpenAI tool definitions and return them as the chat template gets them: each
    {"type": "function", "function": {...}} with only the keys given (None-valued ones dropped).

    Raises:
        ValueError: not a list; an item that is not {"type": "function", "function": {...}}; other
            keys; a name that is not 1-64 letters, digits, "_" or "-" (OpenAI's rule); two tools of
            one name; a description that is not a string; parameters that are not a JSON Schema
            object (a dict whose "type", if given, is "object"); strict not a boolean. The message
            names the item (tools[i]...) and what is allowed.
    """
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of {TOOL_SHAPE}, got {type(tools).__name__}")
    out, seen = [], {}
    for i, tool in enumerate(tools):
        function = _checked_tool(tool, f"tools[{i}]")
        if function["name"] in seen:
            raise ValueError(f"tools[{i}].function.name {function['name']!r} is also the name of tools[{seen[function['name']]}]; "
                             f"tool names must be unique")
        seen[function["name"]] = i
        out.append({"type": "function", "function": function})
    return out


def _checked_tool(tool, where: str) -> dict:
    """One tool's `function` object, checked (see check_tools), None-valued keys dropped."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or sorted(set(tool) - {"type", "function"}):
        raise ValueError(f"{where} must be {TOOL_SHAPE} (type 'function' only), got {json.dumps(tool, default=str)[:100]}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object with a name, got {json.dumps(function, default=str)[:80]}")
    extra = sorted(map(str, set(function) - set(FUNCTION_KEYS)))
    if extra:
        raise ValueError(f"{where}.function has unknown keys {extra}; allowed: {', '.join(FUNCTION_KEYS)}")
    function = {k: v for k, v in function.items() if v is not None}
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}")
    if not isinstance(function.get("description", ""), str):
        raise ValueError(f"{where}.function.description must be a string, got {function['description']!r:.60}")
    if not isinstance(function.get("strict", False), bool):
        raise ValueError(f"{where}.function.strict must be true or false, got {function['strict']!r:.20}")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise ValueError(f"{where}.function.parameters must be a JSON Schema of an object, such as "
                         f'{{"type": "object", "properties": {{...}}}}, got {json.dumps(parameters, default=str)[:80]}')
    return function


def check_tool_choice(tool_choice) -> str | dict:
    """`tool_choice` checked for its shape: one of TOOL_CHOICES, or a named function
    {"type": "function", "function": {"name": str}} (returned as given).

    Raises:
        ValueError: another string or shape, naming the value and the allowed forms.
    """
    if isinstance(tool_choice, str):
        if tool_choice in TOOL_CHOICES:
            return tool_choice
        raise ValueError(f"tool_choice must be one of {', '.join(map(repr, TOOL_CHOICES))} or {NAMED_CHOICE_SHAPE}, "
                         f"got {tool_choice[:40]!r}")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or set(tool_choice) != {"type", "function"}
            or not isinstance(function, dict) or set(function) != {"name"} or not isinstance(function["name"], str)):
        raise ValueError(f"tool_choice must be one of {', '.join(map(repr, TOOL_CHOICES))} or {NAMED_CHOICE_SHAPE}, "
                         f"got {json.dumps(tool_choice, default=str)[:100]}")
    return tool_choice


def resolve_tool_choice(tools: list[dict] | None, tool_choice: str | dict | None) -> tuple[str, str | None]:
    """The tool choice in effect, as vLLM resolves it: (mode, function name), mode "none",
    "auto", "required" or "named" (then the name of the function to call, else None). Not given: "auto" with tools (non-empty), else "none"; "required" with
    an empty tools list is "none" (OpenAI's behaviour, as vLLM).

    Args:
        tools: check_tools' list, or None when the request has no `tools`.
        tool_choice: check_tool_choice's value, or None when not given.
    Raises:
        ValueError: a tool_choice other than "none" without tools (null), or a named function that
            is not one of the tools (names it and the tools' names).
    """
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice == "none":
        return "none", None
    if tools is None:
        shown = tool_choice if isinstance(tool_choice, str) else "a named function"
        raise ValueError(f"tool_choice {shown!r} needs tools: give the functions in `tools`, or leave tool_choice out")
    if isinstance(tool_choice, str):
        return ("none" if not tools and tool_choice == "required" else tool_choice), None
    name = tool_choice["function"]["name"]
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise ValueError(f"tool_choice names the function {name[:64]!r}, which is not one of the tools "
                         f"({', '.join(names) or 'none given'})")
    return "named", name


def tool_parameters(tools: list[dict], name: str) -> dict:
    """The JSON Schema of the arguments of tool `name` (NO_PARAMETERS for a tool without
    parameters): the constraint of a named tool_choice. KeyError for an unknown name."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"].get("parameters") or copy.deepcopy(NO_PARAMETERS)
    raise KeyError(name)


def required_calls_schema(tools: list[dict], parallel: bool = True) -> dict:
    """vLLM's JSON Schema of tool_choice "required": a JSON array of at least one call
    {"name": <a tool's name>, "parameters": <its arguments>} (anyOf over the tools; a tool without
    parameters takes {}); at most one call with parallel False (parallel_tool_calls: false).
    The tools' `$defs` are lifted to the top (their `$ref`s point at the document root).

    Raises:
        ValueError: two tools whose $defs give one name different schemas (names it), or $defs
            that is not an object.
    """
    options, defs = [], {}
    for tool in tools:
        parameters = copy.deepcopy(tool["function"].get("parameters") or NO_PARAMETERS)
        tool_defs = parameters.pop("$defs", None) or {}
        if not isinstance(tool_defs, dict):
            raise ValueError(f"tool {tool['function']['name']!r}: parameters.$defs must be an object (name -> "
                             f"schema), got {tool_defs!r:.60}")
        for key, schema in tool_defs.items():
            if key in defs and defs[key] != schema:
                raise ValueError(f"tools define $defs {key!r} with different schemas; tool_choice 'required' needs "
                                 f"one schema per $defs name")
            defs[key] = schema
        options.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                       "parameters": parameters},
                        "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
