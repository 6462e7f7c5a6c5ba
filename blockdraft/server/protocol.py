"""Request bodies of /v1/completions and /v1/chat/completions as strict pydantic models.

Strict: no type coercion ("5" is not an int, true is not a number). A top-level field the
request class does not have is dropped when its value is null (null changes nothing, whatever the
name, as vLLM ignores unknown fields) and refused otherwise, so a typo is not silently ignored.
OpenAI's and vLLM's fields this server does not implement (UNSUPPORTED_FIELDS) are refused with a
message naming the field unless they carry their neutral value (e.g. `best_of: 1`, `tools: []`,
or null), which changes nothing; a request class that defines one of them
(CompletionRequest.echo; chat's tools, tool_choice, parallel_tool_calls and reasoning_effort)
takes it as its own field instead. Fields that never change the output (prompt_cache_key,
safety_identifier, user, store, metadata) are type-checked and unused; request_id (or the
X-Request-Id header: base_request_id) names the response. vLLM's `guided_*` fields, removed in its v0.12, are refused with the name of their
replacement (REMOVED_GUIDED_FIELDS). Range checks that depend on the server's limits or the model
live in params.py, which also turns `response_format` / `structured_outputs` into the engine's
StructuredOutputsParams.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from blockdraft.chat_messages import (  # noqa: F401  (MAX_NAME_CHARS: re-exported)
    CHAT_ROLES,
    MAX_NAME_CHARS,
    check_content_parts,
    check_role,
    check_tool_fields,
    content_text,
    drop_echoed_empty_keys,
    template_message,
)
from blockdraft.prompt_truncation import ALLOWED as TRUNCATION_VALUES
from blockdraft.server.errors import APIError
from blockdraft.structured.params import StructuredOutputsParams
from blockdraft.tools.definitions import check_tool_choice, check_tools, resolve_tool_choice

# field -> its neutral values (accepted because they change nothing; null is always neutral),
# unless the request class has the field (`echo` is a field of CompletionRequest, not of chat).
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),  # a chat template variable (as vLLM): a field of chat and /tokenize
    "web_search_options": (),
    "verbosity": ("medium",),
    # vLLM's extra fields that clients send with their defaults: those values are this server's behaviour
    "include_stop_str_in_output": (False,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template_kwargs": ({},),
    "return_tokens_as_token_ids": (False,),
    "priority": (0,),
    "add_special_tokens": (False,),  # chat's default (the template writes the special tokens); a field of completions
    "include_reasoning": (True,),  # no reasoning parser: the whole answer is content, as vLLM's without one
    "return_token_ids": (False,),
    "logits_processors": ([],),
    "vllm_xargs": ({},),
    "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},),
    "documents": ([],),
    "kv_transfer_params": ({},),
    "chat_template": (),  # the model's template only
    "cache_salt": (),  # refused, not ignored: the client asked to keep its prefix cache apart
    "prompt_embeds": (),
    "repetition_detection": (),
}

# what follows "'<field>' is not supported" where " by this server" alone would not say why
UNSUPPORTED_REASONS: dict[str, str] = {
    "priority": ": priority scheduling is not supported by this server",
    "reasoning_effort": " here: it is a chat template variable (chat completions, /tokenize with messages)",
}

# vLLM's structured-output request fields before v0.12 -> the field that replaced each (None: none,
# drop it). Refused with that hint when not null: vLLM >= 0.12 ignores them, and the output would
# silently be unconstrained.
REMOVED_GUIDED_FIELDS: dict[str, str | None] = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": None,
}

MAX_SEED = 2**63 - 1
MAX_REQUEST_ID_CHARS = 256
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # the OpenAI SDK's values


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """`stream_options`: include_usage adds a last chunk with `usage` (and empty `choices`).
    continuous_usage_stats (vLLM's): with include_usage, every chunk that carries a choice also
    carries that choice's `usage` so far (its prompt's tokens, its completion tokens); an omitted
    (null) include_usage then counts as true, as vLLM's default true does, and false turns both off.
    include_obfuscation (OpenAI's: random padding in stream events against length side channels,
    which current SDKs send): accepted and unused, as by vLLM; no padding is added."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None


RESPONSE_FORMATS = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                    '{"name": ..., "schema": {...}}}')


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema` (OpenAI's): the output is one JSON value valid under `schema`.

    name: required, as by OpenAI; unused (as in vLLM). schema: the JSON Schema, a JSON object
    (required here: OpenAI's optional schema has no meaning without one). strict, description:
    accepted and unused: the schema is always enforced, as in vLLM; objects that list properties
    take no others unless the schema says so, as vLLM's default backend (xgrammar) generates them.
    """

    name: str
    json_schema: dict[str, Any] = Field(alias="schema")  # `schema` would shadow BaseModel.schema
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, data: Any) -> Any:
        return _json_object(data, '{"name": ..., "schema": {...}, "strict": true}')

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_object(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            raise ValueError(f"must be a JSON Schema: a JSON object such as {{\"type\": \"object\", \"properties\": "
                             f"{{...}}}}, got {_json_type(v)} {json.dumps(v)[:80]}")
        return v


class ResponseFormat(_Strict):
    """OpenAI's `response_format` (both endpoints, as vLLM): {"type": "text"} (no constraint),
    {"type": "json_object"} (any JSON object) or {"type": "json_schema", "json_schema":
    JsonSchemaFormat}; json_schema is required with that type and refused with the others.
    params.structured_outputs turns it into StructuredOutputsParams."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, data: Any) -> Any:
        return _json_object(data, RESPONSE_FORMATS)

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a "json_schema" object: {"name": ..., "schema": {...}, '
                             '"strict": true}')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'"json_schema" goes only with type "json_schema", got type "{self.type}"')
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` request field (both endpoints): the fields of
    blockdraft.StructuredOutputsParams, which `params()` builds: exactly one of json (a JSON
    Schema object or its JSON text), regex, choice (strings), grammar (Lark or GBNF), json_object
    (true), structural_tag (object or JSON text); options disable_any_whitespace,
    disable_additional_properties, whitespace_pattern, disable_fallback (vLLM's; no effect: one
    backend) (null = default). Types are checked here,
    the rest by StructuredOutputsParams (params.structured_outputs) and the engine's compiler."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")  # `json` shadows BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, data: Any) -> Any:
        return _json_object(data, 'an object with one of json, regex, choice, grammar, json_object, structural_tag, '
                                  'e.g. {"regex": "[0-9]+"}')

    @field_validator("json_schema", "structural_tag", mode="before")
    @classmethod
    def _object_or_text(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (dict, str)):
            raise ValueError(f"must be a JSON object or its JSON text, got {_json_type(v)} {json.dumps(v)[:80]}")
        return v

    def params(self) -> StructuredOutputsParams:
        """The StructuredOutputsParams of these fields.

        Raises:
            ValueError: as StructuredOutputsParams (none or several constraints, an empty regex,
                choice or grammar, JSON text that is not a JSON object); `.param` names its field.
        """
        return StructuredOutputsParams(
            json=self.json_schema, regex=self.regex, choice=self.choice, grammar=self.grammar,
            json_object=self.json_object, structural_tag=self.structural_tag,
            disable_any_whitespace=bool(self.disable_any_whitespace),
            disable_additional_properties=self.disable_additional_properties,  # None: closed, as vLLM's xgrammar
            whitespace_pattern=self.whitespace_pattern, disable_fallback=bool(self.disable_fallback),
        )


class _SamplingRequest(_Strict):
    """Fields shared by both endpoints. None means "the default" (see params.py)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0)  # no upper bound, as vLLM (OpenAI caps it at 2)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension (vLLM): 0 or -1 disables
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension (vLLM): 0 disables
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # extension (vLLM): 1 disables
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key string) -> bias in [-100, 100]
    min_tokens: int | None = Field(default=None, ge=0)  # extension (vLLM): no stop before this many tokens
    prompt_logprobs: int | None = Field(default=None, ge=0)  # extension (vLLM): score the prompt's tokens
    # extension (vLLM): keep the prompt's last k tokens (-1: max_model_len); the values are checked
    # by blockdraft.prompt_truncation (params.truncated_prompts), one message for the API and the server
    truncate_prompt_tokens: int | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    allowed_token_ids: list[int] | None = None  # extension (vLLM): only these ids may be sampled
    bad_words: list[str] | None = None  # extension (vLLM): words whose tokens the output never spells
    ignore_eos: bool | None = None  # extension (vLLM)
    include_stop_str_in_output: bool | None = None  # extension (vLLM): the text keeps the stop string found
    skip_special_tokens: bool | None = None  # extension (vLLM): false keeps special tokens in the text
    spaces_between_special_tokens: bool | None = None  # extension (vLLM): false joins consecutive added tokens
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # fields that never change the output: type-checked, then unused (store: nothing is stored, as in vLLM)
    user: str | None = None  # OpenAI's end-user id
    prompt_cache_key: str | None = None  # OpenAI's
    safety_identifier: str | None = None  # OpenAI's
    store: bool | None = None  # OpenAI's
    metadata: dict[str, str] | None = None  # OpenAI's
    # vLLM's: the response id is chatcmpl-<request_id> / cmpl-<request_id> (default: a random hex uuid)
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    response_format: ResponseFormat | None = None  # OpenAI's; vLLM takes it on completions too
    structured_outputs: StructuredOutputsRequest | None = None  # extension (vLLM); not with a JSON response_format

    @field_validator("truncate_prompt_tokens", mode="before")
    @classmethod
    def _truncation_form(cls, v: Any) -> Any:
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            return v  # the range: params.truncated_prompts, one message with the Python API's
        raise ValueError(f"truncate_prompt_tokens must be {TRUNCATION_VALUES}, got {json.dumps(v)}")

    @field_validator("request_id")
    @classmethod
    def _printable_id(cls, v: str | None) -> str | None:
        # it goes into the response id and the request log line: no line breaks or control characters
        if v is not None and not v.isprintable():
            raise ValueError(f"request_id must be printable characters (no control characters), got "
                             f"{json.dumps(v)[:80]}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError(f"stop must be a string or a list of strings, got {json.dumps(v)[:80]}")

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage; see StreamOptions)."""
        so = self.stream_options
        return so is not None and bool(so.include_usage or (so.include_usage is None and so.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk with a choice carries that choice's usage so far (vLLM's
        stream_options.continuous_usage_stats, only with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    """/v1/completions. prompt: a string, a list of strings, a list of token ids, or a list of those.

    logprobs: number of top alternatives per token (0: only the chosen token's log-probability).
    echo: return the prompt before the completion (text, and with `logprobs` the prompt tokens'
        log-probabilities first, the first token's null), as vLLM; with echo, max_tokens may be 0
        (only the prompt, scored: lm-evaluation-harness's loglikelihood requests).
    """

    prompt: Any
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = None
    add_special_tokens: bool = True  # extension (vLLM): text prompts tokenized with the tokenizer's special tokens (e.g. a BOS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(x, str) for x in v):
                return v
            if all(_is_int(x) for x in v):
                return v
            if all(isinstance(x, list) and all(_is_int(t) for t in x) for x in v):
                return v
        if isinstance(v, list) and not v:
            raise ValueError("prompt is an empty list; give a string or a non-empty list")
        raise ValueError("prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists")


class TextPart(_Strict):
    """A content part; only text parts are supported."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message. Roles: system, developer (rendered as system), user, assistant, tool.
    Content: a string or text parts; null (or left out) only in an assistant message with
    tool_calls. name: OpenAI's optional participant name, passed on to the chat template.
    tool_calls (assistant): OpenAI's [{"id", "type": "function", "function": {"name", "arguments":
    JSON text}}], given to the template with the arguments parsed; tool_call_id (tool, required
    there): the call a tool result answers. refusal, function_call, audio, annotations: only null
    or [] (clients echo an earlier assistant message whole; chat_messages.ECHOED_EMPTY_KEYS),
    dropped. Checked and rendered by blockdraft.chat_messages, as the Python API's messages are."""

    role: str
    content: str | list[TextPart] | None
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    _template_calls: list[dict] | None = None  # tool_calls as the template gets them (_tool_fields)

    @model_validator(mode="before")
    @classmethod
    def _echoed_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = drop_echoed_empty_keys(data)
        if "content" not in data and data.get("role") == "assistant" and data.get("tool_calls"):
            data = {**data, "content": None}  # OpenAI lets a tool-calling assistant message leave it out
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        if v is not None:
            check_content_parts(v)
        return v

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        return check_role(v, CHAT_ROLES)

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        self._template_calls = check_tool_fields(self.role, self.content, self.tool_calls, self.tool_call_id)
        return self

    @property
    def text(self) -> str:
        return "" if self.content is None else content_text(self.content)

    def template_message(self) -> dict:
        """The message as the chat template gets it (blockdraft.chat_messages.template_message):
        {"role", "content"} plus "name", "tool_calls" (arguments parsed) and "tool_call_id" when
        given; developer given as system."""
        return template_message(self.role, self.content, self.name, self._template_calls, self.tool_call_id)


class _TemplateRequest(_Strict):
    """What the chat template renders the messages with, shared by chat completions and /tokenize
    (params.chat_prompt): `tools` (OpenAI's function definitions, checked by
    blockdraft.tools.check_tools: unique names, parameters a JSON Schema object) and vLLM's template
    controls: add_generation_prompt (default true: end with the assistant cue),
    continue_final_message (render the last, assistant, message open so the answer continues it;
    needs add_generation_prompt false), chat_template_kwargs (extra variables for the chat
    template, e.g. {"enable_thinking": false}; not apply_chat_template's own arguments), and
    OpenAI's reasoning_effort (REASONING_EFFORTS): given to the template as the variable
    `reasoning_effort`, as vLLM does (a template without it ignores it); chat_template_kwargs' own
    reasoning_effort wins."""

    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _checked_tools(cls, v: Any) -> Any:
        return None if v is None else check_tools(v)

    @field_validator("reasoning_effort", mode="before")
    @classmethod
    def _known_effort(cls, v: Any) -> Any:
        if v is None or v in REASONING_EFFORTS:
            return v
        raise ValueError(f"reasoning_effort must be one of {', '.join(map(json.dumps, REASONING_EFFORTS))} or null, "
                         f"got {json.dumps(v)[:80]}")


class ChatCompletionRequest(_SamplingRequest, _TemplateRequest):
    """/v1/chat/completions. logprobs: return per-token log-probabilities; top_logprobs: how many
    alternatives per token (needs logprobs: true). max_completion_tokens: newer name of max_tokens.
    The template controls and `tools`: _TemplateRequest.

    Tool calling (OpenAI's, as vLLM): `tools`, `tool_choice` ("none", "auto",
    "required" or {"type": "function", "function": {"name": ...}}; default "auto" with tools, else
    "none"; anything but "none" needs `tools`, a named function one of them), parallel_tool_calls
    (false: at most one call). `tool_choice_mode` is the choice in effect (resolve_tool_choice):
    ("none" | "auto" | "required" | "named", the named function or None); params.tool_plan acts
    on it."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    _tool_choice_mode: tuple[str, str | None] = ("none", None)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, v: Any) -> Any:
        return None if v is None else check_tool_choice(v)

    @model_validator(mode="after")
    def _tool_choice_needs_its_tool(self) -> "ChatCompletionRequest":
        try:
            self._tool_choice_mode = resolve_tool_choice(self.tools, self.tool_choice)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        return self

    @property
    def tool_choice_mode(self) -> tuple[str, str | None]:
        return self._tool_choice_mode


class TokenizeRequest(_TemplateRequest):
    """POST /tokenize (vLLM's): exactly one of `prompt` (text, as /v1/completions encodes it;
    add_special_tokens default true) and `messages` (a conversation through the chat template, as
    /v1/chat/completions renders it, with the same template controls and `tools`:
    _TemplateRequest). return_token_strs: also each token's string (the tokenizer's
    convert_ids_to_tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


def base_request_id(header: str | None, field: str | None) -> str:
    """The id a response is named by (`chatcmpl-<id>` / `cmpl-<id>`), as vLLM's _base_request_id:
    the X-Request-Id header's value, else the body's request_id, else a random hex uuid. An empty
    header counts as none.

    Raises:
        APIError(400): a header of more than MAX_REQUEST_ID_CHARS characters or with control
            characters (it goes into the response id and the request log line).
    """
    if header:
        if len(header) > MAX_REQUEST_ID_CHARS or not header.isprintable():
            raise APIError(400, f"the X-Request-Id header must be 1-{MAX_REQUEST_ID_CHARS} printable characters, got "
                                f"{json.dumps(header)[:80]} ({len(header)} characters)", param="X-Request-Id")
        return header
    return field or uuid.uuid4().hex


def parse_request(cls: type[BaseModel], body: dict) -> BaseModel:
    """Validate a decoded JSON body into `cls`.

    Unknown top-level fields whose value is null are dropped (see the module docstring).

    Raises:
        APIError(400): an unsupported field with a non-neutral value, one of vLLM's removed
            guided_* fields (not null; names its replacement), an unknown field that is not null,
            a wrong type or an out-of-range value; the message names the field (first problem only).
    """
    _refuse_removed_guided_fields(body)
    body = _drop_neutral_unsupported(body, cls)
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise _first_error(e) from None


def _refuse_removed_guided_fields(body: dict) -> None:
    """APIError(400) for the first of vLLM's removed guided_* fields (REMOVED_GUIDED_FIELDS) that
    `body` gives a non-null value, naming the field that replaced it; null ones are left to
    `_drop_neutral_unsupported`'s rule (null is neutral) and dropped there."""
    for name, replacement in REMOVED_GUIDED_FIELDS.items():
        if body.get(name) is None:
            continue
        if replacement is None:
            hint = "this server has one structured-output backend (llguidance): drop the field"
        else:
            key = replacement.split(".")[1]
            hint = f'send {replacement} instead: {{"structured_outputs": {{"{key}": ...}}}}'
        raise APIError(400, f"'{name}' was removed in vLLM 0.12 and is not supported; {hint}", param=name)


def _drop_neutral_unsupported(body: dict, cls: type[BaseModel]) -> dict:
    """`body` without the fields `cls` does not have whose value is null (any name: null changes
    nothing) or neutral (UNSUPPORTED_FIELDS); APIError(400) for such a field with another value
    (UNSUPPORTED_REASONS says why, where it has a reason)."""
    own = {f.alias or name for name, f in cls.model_fields.items()}
    out = {k: v for k, v in body.items() if v is not None or k in own}
    for name, neutral in UNSUPPORTED_FIELDS.items():
        if name not in out or name in own:
            continue
        value = out.pop(name)
        if not any(_same(value, n) for n in neutral):
            allowed = " or ".join(json.dumps(n) for n in (*neutral, None))
            why = UNSUPPORTED_REASONS.get(name, " by this server")
            raise APIError(400, f"'{name}' is not supported{why} (only {allowed} is accepted), got "
                                f"{json.dumps(value)[:80]}", param=name)
    return out


def _first_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    loc = _loc(err["loc"])
    if err["type"] == "extra_forbidden":
        # top level: null would have been dropped; refused rather than ignored so a typo shows
        nested = "." in loc or "[" in loc
        hint = "" if nested else " (a non-null field this server does not know is refused; null is ignored)"
        return APIError(400, f"unknown or unsupported field '{loc}'{hint}", param=loc)
    if err["type"] == "missing":
        return APIError(400, f"'{loc}' is required", param=loc)
    if err["type"] == "value_error":  # our validators' own messages, each worded to stand alone
        return APIError(400, f"invalid '{loc}': {err['msg'].removeprefix('Value error, ')}", param=loc)
    return APIError(400, f"invalid '{loc}': {err['msg']}{_got(err.get('input'))}", param=loc)


def _got(value) -> str:
    """", got <value as JSON>" for a scalar the request sent (cut to 80 characters), else "" (an
    object or array may be large, and its field is already named)."""
    if value is not None and not isinstance(value, (str, int, float, bool)):
        return ""
    shown = json.dumps(value, ensure_ascii=False)
    return f", got {shown if len(shown) <= 80 else shown[:77] + '...'}"


def _loc(parts: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; drops pydantic's union-member tags ('str', 'list[...]')."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p not in _UNION_TAGS and "[" not in p:
            out += f".{p}" if out else p
    return out


_UNION_TAGS = {"str", "int", "float", "bool"}


def _same(value, neutral) -> bool:
    # bool is an int in Python: `false` must not pass as the neutral 0 (or `0` as false).
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    return value == neutral


def _json_object(data: Any, allowed: str) -> Any:
    """`data` when it is a JSON object (a dict); else ValueError("must be {allowed}, got ...")."""
    if not isinstance(data, dict):
        raise ValueError(f"must be {allowed}, got {_json_type(data)} {json.dumps(data)[:80]}")
    return data


def _json_type(v: Any) -> str:
    """The JSON type name of a decoded JSON value (for messages): "a string", "an array", ..."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
