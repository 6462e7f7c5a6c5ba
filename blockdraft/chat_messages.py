"""Chat messages: the one check and normalisation of roles, content and names, shared by the
Python API (`LLM.chat`, `LLM.generate` with conversations) and the server's request models
(blockdraft.server.protocol), so both give the chat template the same messages; and the one
rendering through the chat template with vLLM's template controls (render_chat).

Tool use (OpenAI's format): an assistant message may carry `tool_calls` (each {"id", "type":
"function", "function": {"name", "arguments": JSON text}}; its content may then be null), and a
"tool" message answers one of them by its `tool_call_id`. Templates get the arguments parsed into a
dict, as vLLM gives them (Qwen's and Hermes' templates write `arguments | tojson`)."""

from __future__ import annotations

import json

from blockdraft.errors import check_unicode_texts

# OpenAI's `developer` role is taken too, given to the chat template as `system` (template_message).
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
MAX_NAME_CHARS = 256  # longest `name` of a message (OpenAI's participant name)
# Keys an OpenAI client sends back in a conversation's earlier assistant messages (the SDK's
# message.model_dump()); null or [] they carry nothing and are dropped, with a value they are
# refused. `tool_calls` null or [] is dropped too (drop_echoed_empty_keys); with calls it is taken.
ECHOED_EMPTY_KEYS = ("refusal", "function_call", "audio", "annotations")
# What the OpenAI SDK adds to an assistant message it returns, derived from the message itself, so a
# client that appends that message to the conversation sends it: dropped whatever its value
# (`parsed`: .parse()'s object of the content; a tool call's stream `index`; `parsed_arguments`).
SDK_DERIVED_KEYS = ("parsed",)
SDK_DERIVED_CALL_KEYS = ("index",)
SDK_DERIVED_FUNCTION_KEYS = ("parsed_arguments",)
TOOL_CALL_KEYS = ("id", "type", "function")
_TOOL_CALL_SHAPE = '{"id": str, "type": "function", "function": {"name": str, "arguments": "<JSON object text>"}}'
_CONTENT_SHAPE = "content must be a string or a list of {'type': 'text', 'text': str} parts"
# apply_chat_template's own arguments: chat_template_kwargs may not set them, so each control is said once, by
# its own field (vLLM refuses chat_template and tokenize there and lets the others override their fields)
TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})


class ChatTemplateError(ValueError):
    """A conversation or template control the chat template cannot render. `param`: the request
    field at fault (messages, continue_final_message, chat_template_kwargs), for the server's 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_role(role, allowed: tuple[str, ...] = CHAT_ROLES) -> str:
    """Return `role` when it is one of `allowed` (default CHAT_ROLES).

    Raises:
        ValueError: any other value; names it (its first 32 characters: it may come from an HTTP
            body) and the allowed roles.
    """
    if not isinstance(role, str) or role not in allowed:
        shown = role[:32] if isinstance(role, str) else role
        raise ValueError(f"role {shown!r} is not supported; allowed roles: {', '.join(map(repr, allowed))}")
    return role


def check_content_parts(content) -> None:
    """Check the shape of a message's content: a string, or a list of {"type": "text", "text": str}
    parts (OpenAI's content parts; only text ones are supported).

    Raises:
        ValueError: another type, a part that is not a dict, a part of another type (names it) or
            with other keys, a part whose text is not a string.
    """
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{_CONTENT_SHAPE}, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{_CONTENT_SHAPE}; part {j} is a {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(f"content part {j} has type {str(part.get('type'))[:32]!r}, which is not supported; only "
                             f"'text' parts are")
        extra = sorted(map(str, set(part) - {"type", "text"}))
        if extra or not isinstance(part.get("text"), str):
            raise ValueError(f"content part {j} must be {{'type': 'text', 'text': str}}, got keys {sorted(map(str, part))}")


def content_text(content: str | list) -> str:
    """The text the chat template gets for a checked content: the string, or the parts' texts
    joined by newlines (as vLLM joins text parts). Parts may be dicts or objects with `.text`."""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] if isinstance(p, dict) else p.text for p in content)


def template_message(role: str, content: str | list | None, name: str | None = None,
                     tool_calls: list[dict] | None = None, tool_call_id: str | None = None) -> dict:
    """A checked message as the chat template gets it: {"role", "content"} plus "name",
    "tool_calls" (check_tool_calls' form: arguments parsed) and "tool_call_id" when given.

    OpenAI documents `developer` messages as taking the place of `system` messages (for newer
    models); chat templates know only `system`, so a developer message is given as a system one
    and renders exactly as it. Templates that do not use `name` ignore it (as with vLLM). A null
    content (an assistant message with tool_calls) is given as "", which templates can join.
    """
    out = {"role": "system" if role == "developer" else role, "content": "" if content is None else content_text(content)}
    if name is not None:
        out["name"] = name
    if tool_calls:
        out["tool_calls"] = tool_calls
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out


def drop_echoed_empty_keys(message: dict) -> dict:
    """`message` without its ECHOED_EMPTY_KEYS and `tool_calls` whose values are null or [], and
    without SDK_DERIVED_KEYS (the dict itself when it has none).

    Raises:
        ValueError: one of ECHOED_EMPTY_KEYS with another value, naming it (refusals, audio,
            annotations and the deprecated function_call are not supported).
    """
    if any(k in message for k in SDK_DERIVED_KEYS):
        message = {k: v for k, v in message.items() if k not in SDK_DERIVED_KEYS}
    present = [k for k in (*ECHOED_EMPTY_KEYS, "tool_calls") if k in message]
    for k in present:
        if k == "function_call" and message[k] not in (None, []):
            raise ValueError("function_call (OpenAI's deprecated form) is not supported; send tool_calls instead")
        if message[k] not in (None, []) and k != "tool_calls":
            raise ValueError(f"{k} is not supported in a message; send it as null or [], or leave it out")
    empty = [k for k in present if message[k] in (None, [])]
    return {k: v for k, v in message.items() if k not in empty} if empty else message


def check_tool_fields(role: str, content, tool_calls, tool_call_id) -> list[dict] | None:
    """Check a message's tool-use fields against its role; return its tool calls as the chat
    template gets them (check_tool_calls), or None.

    Rules (OpenAI's): tool_calls only in assistant messages, tool_call_id only in tool messages,
    which need one (a non-empty string: the id of the call they answer); content may be null (or
    left out) only in an assistant message with tool_calls.
    Raises:
        ValueError: naming the field and what is allowed.
    """
    if tool_calls and role != "assistant":
        raise ValueError(f"tool_calls is only allowed in assistant messages, not in a {role!r} message")
    if tool_call_id is not None and role != "tool":
        raise ValueError(f"tool_call_id is only allowed in tool messages, not in a {role!r} message")
    if role == "tool" and (not isinstance(tool_call_id, str) or not tool_call_id):
        raise ValueError(f"a tool message needs tool_call_id, the id of the assistant's tool call it answers (a "
                         f"non-empty string), got {tool_call_id!r:.60}")
    if content is None and not (role == "assistant" and tool_calls):
        raise ValueError("content is required: only an assistant message with tool_calls may have null content")
    return check_tool_calls(tool_calls) if tool_calls else None


def check_tool_calls(tool_calls) -> list[dict]:
    """An assistant message's `tool_calls` in OpenAI's format, checked, as the chat template gets
    them: [{"id", "type": "function", "function": {"name", "arguments": dict}}]. `arguments` is
    the JSON text of an object (or, as vLLM also takes it, that object); its parsed object is
    given, as vLLM gives it (an empty string or null: {}). `type` may be left out.

    Raises:
        ValueError: not a list of dicts, other keys, a missing or empty id or name, a type other
            than "function", arguments that are not a JSON object; names tool_calls[j] and the field.
    """
    if not isinstance(tool_calls, list):
        raise ValueError(f"tool_calls must be a list of {_TOOL_CALL_SHAPE}, got {type(tool_calls).__name__}")
    out = []
    for j, call in enumerate(tool_calls):
        where = f"tool_calls[{j}]"
        if not isinstance(call, dict) or sorted(set(call) - {*TOOL_CALL_KEYS, *SDK_DERIVED_CALL_KEYS}):
            raise ValueError(f"{where} must be {_TOOL_CALL_SHAPE}, got {json.dumps(call, default=str)[:100]}")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise ValueError(f"{where}.id must be a non-empty string (the id its tool message answers), got "
                             f"{call.get('id')!r:.60}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {call.get('type')!r:.40}")
        out.append({"id": call["id"], "type": "function", "function": _checked_function(call.get("function"), where)})
    return out


def _checked_function(function, where: str) -> dict:
    """A tool call's {"name", "arguments"} with arguments parsed (see check_tool_calls)."""
    if not isinstance(function, dict) or sorted(set(function) - {"name", "arguments", *SDK_DERIVED_FUNCTION_KEYS}):
        raise ValueError(f"{where}.function must be {{'name': str, 'arguments': '<JSON object text>'}}, got "
                         f"{json.dumps(function, default=str)[:100]}")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r:.60}")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ValueError(f"{where}.function.arguments is not valid JSON ({e}): {arguments[:80]!r}") from None
        except RecursionError:
            raise ValueError(f"{where}.function.arguments is nested too deeply") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be the JSON text of an object, got "
                         f"{json.dumps(arguments, default=str)[:80]}")
    return {"name": name, "arguments": arguments}


def template_messages(messages) -> list[dict]:
    """Check a conversation given to the Python API and return its messages as the chat template
    gets them (template_message), accepting what the server accepts: roles system / user /
    assistant / developer / tool, string or text-part content, an optional string `name` (<=
    MAX_NAME_CHARS characters), an assistant's `tool_calls` and a tool message's `tool_call_id`
    (check_tool_fields), and ECHOED_EMPTY_KEYS when null or [].

    Raises:
        ValueError: an empty conversation, or the first bad message, naming its index and value:
            not a dict, keys other than MESSAGE_KEYS, no "content" (only an assistant message with
            tool_calls may leave it out or null), bad content, an unsupported role, a bad name,
            bad tool fields.
    """
    if not messages:
        raise ValueError("chat conversation is empty: give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
        try:
            message = drop_echoed_empty_keys(message)
        except ValueError as e:
            raise ValueError(f"chat message {i}: {e}") from None
        extra = [k for k in message if k not in MESSAGE_KEYS]
        if extra:
            raise ValueError(f"chat message {i} has keys {extra!r:.80} that are not supported; a message's keys are "
                             f"{', '.join(map(repr, MESSAGE_KEYS))}")
        if "content" not in message and not (message.get("role") == "assistant" and message.get("tool_calls")):
            raise ValueError(f"chat message {i} has no 'content': {message!r:.80}; give "
                             f"{{'role': one of {list(CHAT_ROLES)}, 'content': str}}")
        content = message.get("content")
        try:
            if content is not None:
                check_content_parts(content)
            check_role(message.get("role"))
            _check_name(message.get("name"))
            calls = check_tool_fields(message["role"], content, message.get("tool_calls"), message.get("tool_call_id"))
        except ValueError as e:
            raise ValueError(f"chat message {i}: {e}") from None
        out.append(template_message(message["role"], content, message.get("name"), calls, message.get("tool_call_id")))
    return out


def _check_name(name) -> None:
    if name is None:
        return
    if not isinstance(name, str):
        raise ValueError(f"name must be a string, got {type(name).__name__} {name!r:.40}")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"name must be at most {MAX_NAME_CHARS} characters, got {len(name)}")


def _check_texts(value, what: str) -> None:
    """Every string in `value` (a message, the tools, template variables: nested dicts and lists) is
    valid Unicode (check_unicode_texts), else ChatTemplateError naming `what` ("message 2")."""
    try:
        check_unicode_texts(value, what)
    except ValueError as e:
        raise ChatTemplateError(str(e), "messages" if what.startswith("message") else what) from None


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` (as template_messages returns them) through the tokenizer's chat
    template, with vLLM's template controls: add_generation_prompt (end with the assistant cue),
    continue_final_message (leave the last, assistant, message open so the answer continues it;
    needs add_generation_prompt False), chat_template_kwargs (extra template variables, e.g.
    {"enable_thinking": False}; not apply_chat_template's own arguments, TEMPLATE_CALL_ARGS),
    tools (checked tool definitions, blockdraft.tools.check_tools: the template's `tools`; None or
    [] renders none). The one rendering of the Python API (LLM.chat) and the server (params.chat_prompt).

    Raises:
        ChatTemplateError (a ValueError; .param names the field): the tokenizer has no chat
            template; continue_final_message with add_generation_prompt, or without an assistant
            message last; chat_template_kwargs not a dict or with a reserved key; the template
            refused the conversation (e.g. roles that must alternate; its message, cut to 200
            characters).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; give LLM.generate a plain text prompt instead", "messages")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: set "
                                "add_generation_prompt to false to continue the last message", "continue_final_message")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ChatTemplateError(f"continue_final_message continues the last message, which must be an assistant "
                                f"message; it is a {messages[-1]['role']!r} one", "continue_final_message")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ChatTemplateError(f"chat_template_kwargs must be a dict of template variables, got "
                                f"{type(chat_template_kwargs).__name__} {chat_template_kwargs!r:.60}", "chat_template_kwargs")
    extra = dict(chat_template_kwargs or {})
    for what, value in [*((f"message {j}", m) for j, m in enumerate(messages)), ("tools", tools),
                        ("chat_template_kwargs", extra)]:
        _check_texts(value, what)
    reserved = sorted(set(extra) & TEMPLATE_CALL_ARGS)
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)} (arguments of the template "
                                "call, not template variables)", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, continue_final_message=continue_final_message, **extra)
    except Exception as e:  # jinja2 TemplateError, or raise_exception() inside the template
        # transformers refuses continue_final_message for a template that rewrites the final message
        param = "continue_final_message" if continue_final_message and "continue_final_message" in str(e) else "messages"
        raise ChatTemplateError(f"the chat template rejected these messages: {str(e)[:200]}", param) from None
    return tokenizer.encode(text, add_special_tokens=False)
