"""Chat messages: the one check and normalisation of roles, content and names, shared by the
Python API (`LLM.chat`, `LLM.generate` with conversations) and the server's request models
(blockdraft.server.protocol), so both give the chat template the same messages; and the one
rendering through the chat template with vLLM's template controls (render_chat)."""

from __future__ import annotations

# OpenAI's `developer` role is taken too, given to the chat template as `system` (template_message).
CHAT_ROLES = ("system", "user", "assistant", "developer")
MESSAGE_KEYS = ("role", "content", "name")
MAX_NAME_CHARS = 256  # longest `name` of a message (OpenAI's participant name)
# Keys an OpenAI client sends back in a conversation's earlier assistant messages (the SDK's
# message.model_dump()); null or [] they carry nothing and are dropped, with a value they are refused
# (no tools here).
ECHOED_EMPTY_KEYS = ("tool_calls", "refusal", "function_call", "audio", "annotations")
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


def template_message(role: str, content: str | list, name: str | None = None) -> dict:
    """A checked message as the chat template gets it: {"role", "content"} plus "name" when given.

    OpenAI documents `developer` messages as taking the place of `system` messages (for newer
    models); chat templates know only `system`, so a developer message is given as a system one
    and renders exactly as it. Templates that do not use `name` ignore it (as with vLLM).
    """
    out = {"role": "system" if role == "developer" else role, "content": content_text(content)}
    if name is not None:
        out["name"] = name
    return out


def drop_echoed_empty_keys(message: dict) -> dict:
    """`message` without its ECHOED_EMPTY_KEYS whose values are null or [] (the dict itself when it
    has none).

    Raises:
        ValueError: one of those keys with another value, naming it (tool calls, refusals and
            audio are not supported).
    """
    present = [k for k in ECHOED_EMPTY_KEYS if k in message]
    if not present:
        return message
    for k in present:
        if message[k] not in (None, []):
            raise ValueError(f"{k} is not supported (this server has no tools or audio); send it as null or [], or "
                             f"leave it out")
    return {k: v for k, v in message.items() if k not in present}


def template_messages(messages) -> list[dict]:
    """Check a conversation given to the Python API and return its messages as the chat template
    gets them (template_message), accepting what the server accepts: roles system / user /
    assistant / developer, string or text-part content, an optional string `name` (<=
    MAX_NAME_CHARS characters), and ECHOED_EMPTY_KEYS when null or [].

    Raises:
        ValueError: an empty conversation, or the first bad message, naming its index and value:
            not a dict, keys other than role / content / name, no "content", bad content, an
            unsupported role, a bad name.
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
        if "content" not in message:
            raise ValueError(f"chat message {i} has no 'content': {message!r:.80}; give "
                             f"{{'role': one of {list(CHAT_ROLES)}, 'content': str}}")
        try:
            check_content_parts(message["content"])
            check_role(message.get("role"))
            _check_name(message.get("name"))
        except ValueError as e:
            raise ValueError(f"chat message {i}: {e}") from None
        out.append(template_message(message["role"], message["content"], message.get("name")))
    return out


def _check_name(name) -> None:
    if name is None:
        return
    if not isinstance(name, str):
        raise ValueError(f"name must be a string, got {type(name).__name__} {name!r:.40}")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"name must be at most {MAX_NAME_CHARS} characters, got {len(name)}")


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` (as template_messages returns them) through the tokenizer's chat
    template, with vLLM's template controls: add_generation_prompt (end with the assistant cue),
    continue_final_message (leave the last, assistant, message open so the answer continues it;
    needs add_generation_prompt False), chat_template_kwargs (extra template variables, e.g.
    {"enable_thinking": False}; not apply_chat_template's own arguments, TEMPLATE_CALL_ARGS).
    The one rendering of the Python API (LLM.chat) and the server (params.chat_prompt).

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
    reserved = sorted(set(extra) & TEMPLATE_CALL_ARGS)
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)} (arguments of the template "
                                "call, not template variables)", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message, **extra)
    except Exception as e:  # jinja2 TemplateError, or raise_exception() inside the template
        # transformers refuses continue_final_message for a template that rewrites the final message
        param = "continue_final_message" if continue_final_message and "continue_final_message" in str(e) else "messages"
        raise ChatTemplateError(f"the chat template rejected these messages: {str(e)[:200]}", param) from None
    return tokenizer.encode(text, add_special_tokens=False)
