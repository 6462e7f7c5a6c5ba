"""Chat messages: the one check of roles and content, shared by the Python API (`LLM.chat`,
`LLM.generate` with conversations) and the server's request models (blockdraft.server.protocol)."""

from __future__ import annotations

CHAT_ROLES = ("system", "user", "assistant")
# The server also takes OpenAI's `developer` role, given to the chat template as `system`
# (blockdraft.server.protocol.ChatMessage.template_message).
SERVER_CHAT_ROLES = (*CHAT_ROLES, "developer")


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


def check_chat_messages(messages) -> None:
    """Check a conversation: a non-empty list of {"role": one of CHAT_ROLES, "content": str} dicts.

    Raises:
        ValueError: an empty conversation, or the first bad message, naming its index and value:
            not a dict, no "content" or content that is not a string, an unsupported role.
    """
    if not messages:
        raise ValueError("chat conversation is empty: give at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
        if "content" not in message:
            raise ValueError(f"chat message {i} has no 'content': {message!r:.80}; give "
                             f"{{'role': one of {list(CHAT_ROLES)}, 'content': str}}")
        if not isinstance(message["content"], str):
            raise ValueError(f"chat message {i}: content must be a string, got {type(message['content']).__name__}")
        try:
            check_role(message.get("role"))
        except ValueError as e:
            raise ValueError(f"chat message {i}: {e}") from None
