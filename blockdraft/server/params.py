"""Turn a validated request into engine inputs: prompt token ids and one SamplingParams per choice.

Every check that depends on the server's limits or on the model happens here, before anything
reaches the engine thread, so a bad request can never disturb requests already running.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from blockdraft.chat_messages import ChatTemplateError, render_chat
from blockdraft.engine.detokenizer import token_decoder
from blockdraft.prompt_truncation import truncate_prompt
from blockdraft.sampling_params import SamplingParams
from blockdraft.server.config import ModelInfo, ServerConfig
from blockdraft.server.errors import APIError
from blockdraft.server.protocol import ChatCompletionRequest, CompletionRequest
from blockdraft.server.tool_calls import ToolPlan
from blockdraft.structured.params import StructuredOutputsParams
from blockdraft.tools.definitions import required_calls_schema, tool_parameters

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions

# the `.param` values of StructuredOutputsParams' and the grammar compiler's ValueErrors: its fields,
# and "structured_outputs" for the whole (none or several constraints; a tokenizer it cannot use)
STRUCTURED_PARAMS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams)) | {"structured_outputs"}


@dataclass
class Plan:
    """What to run for one HTTP request.

    prompts[i] / params[i]: engine request of choice i (choice i = prompt i // n, sample i % n);
        a prompt cut by truncate_prompt_tokens is the truncated one (truncated_prompts).
    num_prompt_tokens: usage.prompt_tokens (each distinct prompt counted once, after truncation,
        as vLLM counts the prompt the engine ran).
    n: choices per prompt.
    echo: /v1/completions `echo: true`: each choice's text and logprobs begin with its prompt's
        (whose log-probabilities the engine computes: SamplingParams.prompt_logprobs = logprobs).
    prompt_only: `echo` with `max_tokens: 0`: the engine generates one token (as vLLM does), which
        the answer leaves out: only the prompt, finish_reason "length", 0 completion tokens.
    prompt_texts[i]: the text echoed for choice i (`echo_texts`; set by the caller), else None.
    prompt_logprobs: vLLM's `prompt_logprobs: N` (not with a stream): the N alternatives each
        choice's (completions) or the response's (chat) `prompt_logprobs` lists; else None.
    response_role: chat's message / delta role: "assistant", or with add_generation_prompt false
        the last message's role (vLLM's get_chat_request_role: the answer continues that turn).
    constraint_field: the request field whose output constraint every choice follows
        ("structured_outputs", "response_format", or for a tool_choice "tools[i].function.parameters"
        / "tools"; params[i].structured_outputs), else None: where engine_refusal points a
        constraint the engine cannot compile.
    tool_calls: chat's tool_choice plan (named, required or auto: each choice's text becomes
        tool calls, server.tool_calls), else None (plain text).
    """

    prompts: list[list[int]]
    params: list[SamplingParams]
    num_prompt_tokens: int
    echo: bool = False
    prompt_only: bool = False
    prompt_texts: list[str] | None = None
    prompt_logprobs: int | None = None
    response_role: str = "assistant"
    n: int = 1
    constraint_field: str | None = None
    tool_calls: ToolPlan | None = None


def completion_prompts(req: CompletionRequest, tokenizer, model: ModelInfo) -> list[list[int]]:
    """Token ids of each prompt of a /v1/completions request.

    Raises:
        APIError(400): an empty prompt, or a token id outside the vocabulary.
    """
    p = req.prompt
    if isinstance(p, str):
        texts_or_ids = [p]
    elif isinstance(p[0], int):
        texts_or_ids = [p]
    else:
        texts_or_ids = p
    out = []
    for i, item in enumerate(texts_or_ids):
        ids = _encode_text(tokenizer, item, req.add_special_tokens) if isinstance(item, str) else list(item)
        if not ids:
            raise APIError(400, f"prompt {i} is empty; give at least one token", param="prompt")
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt {i} has token id {bad}, outside the vocabulary [0, {model.vocab_size})", param="prompt")
        out.append(ids)
    return out


def echo_texts(req: CompletionRequest, prompts: list[list[int]], tokenizer,
               kept: list[list[int]] | None = None) -> list[str]:
    """The text `echo` returns for each prompt of a /v1/completions request: a text prompt as given,
    a token-id prompt decoded with its special tokens kept (as vLLM: tokenizer.decode's default),
    so that either way the echoed prompt holds their text and the prompt tokens' text_offset
    (responses.echo_logprobs) counts it. A prompt that truncate_prompt_tokens cut is echoed as the
    decoded tokens kept, text prompts too: the echoed tokens, their logprobs and text_offset then
    describe one text (vLLM echoes the whole text given, which its offsets do not index).

    Args:
        prompts: completion_prompts' token ids of `req`'s prompts (one list per prompt).
        kept: the token ids each prompt runs with (truncated_prompts); None: `prompts`.
    Raises: only the tokenizer's errors.
    """
    p = req.prompt
    texts = [p] if isinstance(p, str) or isinstance(p[0], int) else p
    kept = prompts if kept is None else kept
    decode = token_decoder(tokenizer, skip_special_tokens=False)
    return [t if isinstance(t, str) and len(k) == len(ids) else decode(k)
            for t, ids, k in zip(texts, prompts, kept, strict=True)]


def truncated_prompts(req, prompts: list[list[int]], model: ModelInfo) -> list[list[int]]:
    """Each prompt cut to its last `req.truncate_prompt_tokens` tokens (vLLM's field; -1: the last
    max_model_len; None: unchanged), before usage is counted and the context checked, so that an
    overlong prompt with truncation is answered (blockdraft.prompt_truncation).

    Raises:
        APIError(400, param "truncate_prompt_tokens"): 0, below -1 or above max_model_len (vLLM
            refuses a value above max_model_len too).
    """
    try:
        return [truncate_prompt(ids, req.truncate_prompt_tokens, model.max_model_len) for ids in prompts]
    except ValueError as e:
        message = str(e).replace("(the engine's max_model_len)", "(this model's max_model_len in /v1/models)")
        raise APIError(400, message, param="truncate_prompt_tokens") from None


def chat_prompt(req, tokenizer, add_generation_prompt: bool | None = None) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template
    (blockdraft.chat_messages.render_chat). `req`: anything with ChatMessage `messages`, and
    optionally ChatCompletionRequest's add_generation_prompt, continue_final_message,
    chat_template_kwargs (vLLM's) and reasoning_effort (the template variable `reasoning_effort`,
    unless chat_template_kwargs sets it); `add_generation_prompt` overrides the request's
    (default: end with the assistant cue).

    Messages reach the template as ChatMessage.template_message() gives them: developer as system,
    `name` passed on when given, tool calls with their arguments parsed. The request's `tools`
    reach the template too, whatever its tool_choice ("none" included, as vLLM by default).

    Raises:
        APIError(400): whatever render_chat refuses (no chat template; continue_final_message with
            add_generation_prompt, or without an assistant message last; a reserved
            chat_template_kwargs key; the template refused the conversation), its field as param.
    """
    if not getattr(tokenizer, "chat_template", None):  # said here: render_chat's words are for the Python API
        raise APIError(400, "this model has no chat template; use /v1/completions with a plain prompt", param="messages")
    if add_generation_prompt is None:
        add_generation_prompt = getattr(req, "add_generation_prompt", True)
    kwargs = getattr(req, "chat_template_kwargs", None)
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:  # a template variable, as vLLM gives it; chat_template_kwargs' own value wins
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    try:
        return render_chat(tokenizer, [m.template_message() for m in req.messages],
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=getattr(req, "continue_final_message", False),
                           chat_template_kwargs=kwargs, tools=getattr(req, "tools", None))
    except ChatTemplateError as e:
        raise APIError(400, str(e), param=e.param) from None


def build_plan(req, prompts: list[list[int]], config: ServerConfig, model: ModelInfo) -> Plan:
    """One SamplingParams per choice, with limits checked (`echo` for /v1/completions: see Plan).

    Args:
        req: a CompletionRequest or ChatCompletionRequest (pydantic-validated).
        prompts: the token ids of each prompt (completion_prompts / chat_prompt), non-empty;
            cut here when the request has truncate_prompt_tokens (truncated_prompts).
        config: the server's limits. model: the served model's vocab size, context and limits.
    Raises:
        APIError(400): a truncate_prompt_tokens truncated_prompts refuses; `stream_options`
            without `stream: true`; n / choices / max_tokens / stop / logprobs over the server limits; `prompt_logprobs` > 0 with `stream: true`, or over the
            logprobs limit; `min_tokens` > 0 with echo and `max_tokens: 0`; a prompt too long for
            the context or the KV pool; a constraint structured_outputs refuses; a tool_choice
            tool_plan refuses; or a value SamplingParams refuses.
    """
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    prompts = truncated_prompts(req, prompts, model)  # before usage and the context check (vLLM)
    n = req.n or 1
    if n > config.max_n:
        raise APIError(400, f"n must be <= {config.max_n} (the server's --max-n), got {n}", param="n")
    if len(prompts) * n > config.max_pending:  # never admitted: a 429 would send clients retrying in vain
        what = f"{len(prompts)} prompt{'s' if len(prompts) != 1 else ''} x n={n} = {len(prompts) * n} choices"
        raise APIError(400, f"{what}, more than the server's --max-pending {config.max_pending} engine requests in "
                            f"flight: send at most {config.max_pending} choices per request",
                       param="n" if n > 1 else "prompt")
    stop = _stop_strings(req.stop, config)
    logprobs = _logprobs(req, config, model)
    constraint, constraint_field = structured_outputs(req)
    tools = tool_plan(req, config, constraint_field) if isinstance(req, ChatCompletionRequest) else None
    if tools is not None and tools.constraint is not None:
        constraint, constraint_field = tools.constraint, tools.constraint_field
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    plan = Plan([], [], sum(len(p) for p in prompts), echo=echo, prompt_only=echo and req.max_tokens == 0,
                prompt_logprobs=_prompt_logprobs(req, config, model), n=n, constraint_field=constraint_field,
                tool_calls=tools)
    if isinstance(req, ChatCompletionRequest) and not req.add_generation_prompt:
        plan.response_role = req.messages[-1].role
    if plan.prompt_only and req.min_tokens:  # the engine runs max_tokens 1 here: check against what was sent
        raise APIError(400, f"min_tokens must be 0 with max_tokens 0 (echo: the prompt alone), got {req.min_tokens}",
                       param="min_tokens")
    for i, ids in enumerate(prompts):
        # echo with max_tokens 0: one token generated and left out, which the context must hold
        max_tokens = _max_tokens(req, len(ids), config, model, i, asked=1 if plan.prompt_only else None)
        # one engine request per choice: SamplingParams.completions (choice j of a seeded request: seed + j)
        choices = _sampling_params(req, max_tokens, stop, logprobs, n, model, echo, plan.prompt_logprobs,
                                   constraint, keep_special=tools is not None and tools.mode == "auto").completions()
        plan.prompts += [ids] * n
        plan.params += choices
    return plan


def _sampling_params(
    req, max_tokens: int, stop: list[str], logprobs: int | None, n: int, model: ModelInfo, echo: bool = False,
    prompt_logprobs: int | None = None, constraint: StructuredOutputsParams | None = None, keep_special: bool = False,
) -> SamplingParams:
    """The request's SamplingParams for one prompt, its `n` choices included (APIError(400) for a
    value it refuses). The prompt is scored for `echo` with logprobs (that many alternatives) and for
    `prompt_logprobs`, with the larger count (each answer slices its own). constraint: every
    choice's structured_outputs (`structured_outputs(req)` or the tool_choice's), or None.
    temperature, top_p, top_k, min_p and repetition_penalty left out or null take the model's
    defaults (model.default_sampling: its generation_config.json, as vLLM), else OpenAI's.
    keep_special: the text keeps special tokens (skip_special_tokens False) whatever the request
    says: tool_choice "auto", as vLLM's hermes parser asks (some models' <tool_call> is special)."""
    scored = [v for v in (logprobs if echo else None, prompt_logprobs) if v is not None]
    # a field left out or null: the model's default (generation_config.json), else OpenAI's / vLLM's
    default = model.default_sampling

    def pick(name: str, neutral: float | int):
        value = getattr(req, name)
        return default.get(name, neutral) if value is None else value

    for name in ("stop_token_ids", "allowed_token_ids"):
        for t in getattr(req, name) or []:
            if not 0 <= t < model.vocab_size:
                raise APIError(400, f"{name} has {t}, outside the vocabulary [0, {model.vocab_size})", param=name)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),  # OpenAI's default
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=req.seed,
            n=n,
            stop=stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False and not keep_special,  # null: the default, true
            spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=_logit_bias(req.logit_bias, model),
            min_tokens=req.min_tokens or 0,
            prompt_logprobs=max(scored) if scored else None,  # echo scores the prompt too (vLLM)
            structured_outputs=constraint,
            truncate_prompt_tokens=req.truncate_prompt_tokens,  # prompts are cut already: the engine keeps them
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
        )
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


def structured_outputs(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output constraint of a request and the field it came from, as vLLM reads them:
    `structured_outputs` (its fields, StructuredOutputsRequest.params) or `response_format`
    (json_object -> StructuredOutputsParams(json_object=True), json_schema -> json=its schema;
    text -> none). (None, None) without a constraint.

    Raises:
        APIError(400): both structured_outputs and a JSON response_format (says which to drop), or
            a constraint StructuredOutputsParams refuses (param: its field, as the request wrote
            it, constraint_error).
    """
    fmt = req.response_format
    json_format = fmt is not None and fmt.type != "text"
    if req.structured_outputs is not None and json_format:
        raise APIError(400, f'give structured_outputs or response_format {{"type": "{fmt.type}"}}, not both: '
                            f'drop response_format (structured_outputs.json takes a JSON Schema, '
                            f'structured_outputs.json_object true any JSON object), or drop structured_outputs',
                       param="structured_outputs")
    field = "structured_outputs" if req.structured_outputs is not None else "response_format"
    try:
        if req.structured_outputs is not None:
            return req.structured_outputs.params(), field
        if not json_format:
            return None, None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), field
        return StructuredOutputsParams(json=fmt.json_schema.json_schema), field
    except ValueError as e:
        raise constraint_error(e, field) from None


def tool_plan(req: ChatCompletionRequest, config: ServerConfig, constraint_field: str | None) -> ToolPlan | None:
    """What the request's tool_choice (ChatCompletionRequest.tool_choice_mode) asks, as vLLM:
    None for "none" or no tools (plain text); "auto": the server's --tool-call-parser finds the
    calls in free text; a named function: the answer constrained to its parameters schema;
    "required": to vLLM's array of calls (server.tool_calls).

    Args:
        constraint_field: the request's own constraint field (structured_outputs(req)), or None.
    Raises:
        APIError(400): "auto" on a server without --enable-auto-tool-choice and
            --tool-call-parser (as vLLM; says so, and what to send instead); a named or required
            tool_choice with structured_outputs or a JSON response_format (both constrain the
            answer); tools whose $defs clash (required).
    """
    (mode, name), tools = req.tool_choice_mode, req.tools or []
    parallel = req.parallel_tool_calls is not False
    if mode == "none" or not tools:
        return None
    if mode == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            given = "tool_choice \"auto\"" if req.tool_choice is not None else "tools without tool_choice (default \"auto\")"
            raise APIError(400, f'{given} needs the server started with --enable-auto-tool-choice and '
                                f'--tool-call-parser (as vLLM); send tool_choice "none", "required" or '
                                f'{{"type": "function", "function": {{"name": ...}}}} instead', param="tool_choice")
        return ToolPlan("auto", parallel=parallel)
    if constraint_field is not None:
        what = '"required"' if mode == "required" else f"naming the function {name!r}"
        raise APIError(400, f"tool_choice {what} constrains the answer to tool calls, so it cannot be combined with "
                            f"{constraint_field}: drop one of them", param="tool_choice")
    if mode == "required":
        try:
            schema = required_calls_schema(tools, parallel)
        except ValueError as e:
            raise APIError(400, str(e), param="tools") from None
        return ToolPlan("required", parallel=parallel, constraint=_tool_constraint(schema), constraint_field="tools")
    index = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
    return ToolPlan("named", name=name, parallel=parallel,
                    constraint=_tool_constraint(tool_parameters(tools, name)),
                    constraint_field=f"tools[{index}].function.parameters")


def _tool_constraint(schema: dict) -> StructuredOutputsParams:
    """The constraint of a tool_choice's JSON Schema: objects that list properties take no others
    unless the schema says so (disable_additional_properties), as vLLM's default backend (xgrammar,
    strict mode) generates them: a call's arguments are the function's declared parameters."""
    return StructuredOutputsParams(json=schema, disable_additional_properties=True)


def constraint_error(error: Exception, field: str) -> APIError:
    """The 400 for a constraint that StructuredOutputsParams or the engine's grammar compiler
    refused (`error`: their ValueError, whose `.param` is a StructuredOutputsParams field or
    "structured_outputs"; or the ImportError of a server without llguidance), named as the request
    wrote it: `field` "tools[i].function.parameters" or "tools" (a tool_choice's constraint): param
    `field`, and the message's structured_outputs[.json] reads `field`; `field` "structured_outputs": param "structured_outputs.<field>" (e.g.
    "structured_outputs.regex"), the message as it is; `field` "response_format": param
    "response_format", and the message's structured_outputs.json reads
    response_format.json_schema.schema (any other structured_outputs name: response_format)."""
    message, param = str(error), getattr(error, "param", None)
    if field.startswith("tools"):  # a tool_choice's schema: the tool's parameters ("tools": required's array)
        return APIError(400, re.sub(r"\bstructured_outputs(\.\w+)?", field, message), param=field)
    if field == "response_format":
        message = re.sub(r"\bstructured_outputs\.json\b", "response_format.json_schema.schema", message)
        return APIError(400, re.sub(r"\bstructured_outputs(\.\w+)?", "response_format", message), param=field)
    return APIError(400, message, param=field if param in (None, field) else f"{field}.{param}")


def engine_refusal(error: Exception, plan: Plan) -> APIError:
    """The 400 for a request the engine refused when it was submitted (LLMEngine.check_request's
    ValueError, with its `.param` when it has one; or an ImportError: structured outputs without
    llguidance on the server). An error about the output constraint (a regex, schema or grammar
    that does not compile, or a tokenizer the compiler cannot read) names the request's field
    (constraint_error with plan.constraint_field)."""
    param = getattr(error, "param", None)
    if plan.constraint_field is not None and (param in STRUCTURED_PARAMS or isinstance(error, ImportError)):
        return constraint_error(error, plan.constraint_field)
    return APIError(400, str(error), param=param)


def _logit_bias(bias: dict[str, float] | None, model: ModelInfo) -> dict[int, float] | None:
    """OpenAI's logit_bias (JSON keys are strings) -> {token id: bias}; ids and ranges checked."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < model.vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {model.vocab_size}) written as strings, "
                                f"got {key[:40]!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _max_tokens(req, prompt_len: int, config: ServerConfig, model: ModelInfo, index: int,
                asked: int | None = None) -> int:
    """The engine's max_tokens for prompt `index` (`asked`: this value instead of the request's),
    at most model.max_tokens_cap (vLLM: a --generation-config FOLDER's max_new_tokens).

    Raises:
        APIError(400): as _requested_max_tokens.
    """
    tokens = _requested_max_tokens(req, prompt_len, config, model, index, asked)
    return tokens if model.max_tokens_cap is None else min(tokens, model.max_tokens_cap)


def _requested_max_tokens(req, prompt_len: int, config: ServerConfig, model: ModelInfo, index: int,
                          asked: int | None = None) -> int:
    """The output tokens prompt `index` asks for (`asked`: this value instead of the request's); left
    out or null, the default: the model's max_tokens (its generation_config.json's max_new_tokens)
    or else the server's --max-tokens-limit, within the context left (completions left out: 16).

    Raises:
        APIError(400): below 1 (0 is allowed only with echo, and handled by build_plan), over the
            server's limit, or more than the context leaves after the prompt (or no room at all).
    """
    asked = req.max_tokens if asked is None else asked
    name = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        if asked is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        asked, name = req.max_completion_tokens, "max_completion_tokens"
    # Prompt + output must fit the context, which /v1/models reports as max_model_len (the engine
    # keeps it within the KV pool). Drafts take none of it: the engine drops those that would pass
    # the context's end, so a request may use all max_model_len tokens, as in vLLM.
    context = min(model.max_model_len, model.kv_capacity_tokens)
    room = context - prompt_len
    if room < 1:
        want = max(1, min(asked or 1, context - 1))  # output tokens the hint leaves room for
        cut = "" if req.truncate_prompt_tokens is None else (  # -1 keeps max_model_len tokens: no room
            f" (after truncate_prompt_tokens {req.truncate_prompt_tokens}; {context - want} leaves room for "
            f"{want} output token{'s' if want > 1 else ''})")
        raise APIError(
            400,
            f"{_prompt_size(req, index, prompt_len)}; this model's context is {context} tokens (max_model_len in "
            f"/v1/models), so at most {context - 1} prompt tokens leave room for one output token{cut}",
            param="prompt" if isinstance(req, CompletionRequest) else "messages",
        )
    if asked is None:
        # completions: 16 when left out (OpenAI's, vLLM's), the default below when sent as null (vLLM's);
        # the default: the model's max_new_tokens, else the server's limit, within the context left
        default = (COMPLETIONS_DEFAULT_MAX_TOKENS if isinstance(req, CompletionRequest)
                   and "max_tokens" not in req.model_fields_set
                   else min(model.default_sampling.get("max_tokens", config.max_tokens_limit), config.max_tokens_limit))
        return max(1, min(default, room))
    if asked < 1:
        hint = " (0 only with echo: true, which returns the prompt scored)" if isinstance(req, CompletionRequest) else ""
        raise APIError(400, f"{name} must be >= 1{hint}, got {asked}", param=name)
    if asked > config.max_tokens_limit:
        raise APIError(400, f"{name} must be <= {config.max_tokens_limit} (server limit), got {asked}", param=name)
    if asked > room:
        raise APIError(
            400,
            f"{_prompt_size(req, index, prompt_len)} and {name} is {asked}: {prompt_len + asked} tokens, more than "
            f"this model's context of {context} tokens (max_model_len in /v1/models); lower {name} to at most {room}",
            param=name,
        )
    return asked


def _prompt_size(req, index: int, prompt_len: int) -> str:
    """How a message names a prompt's size: "prompt 0 has N tokens" (completions); chat's one prompt
    is its messages rendered with the chat template."""
    tokens = f"{prompt_len} token{'s' if prompt_len != 1 else ''}"
    if isinstance(req, ChatCompletionRequest):
        return f"the messages rendered with the chat template are {tokens}"
    return f"prompt {index} has {tokens}"


def _stop_strings(stop, config: ServerConfig) -> list[str]:
    """The request's stop strings as a list (APIError(400) naming the first one over a limit)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > config.max_stop:
        raise APIError(400, f"stop has {len(stops)} strings; at most {config.max_stop} are allowed", param="stop")
    for i, s in enumerate(stops):
        name = "stop" if isinstance(stop, str) else f"stop[{i}]"  # as the request wrote it
        if not s:
            raise APIError(400, f"{name} is empty; stop strings must be non-empty", param="stop")
        if len(s) > config.max_stop_chars:
            raise APIError(400, f"{name} has {len(s)} characters; at most {config.max_stop_chars} are allowed",
                           param="stop")
    return stops


def _logprobs(req, config: ServerConfig, model: ModelInfo) -> int | None:
    """Top alternatives per token for the engine (None: no logprobs), at most the smaller of the
    server's and the engine's max_logprobs."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        value, name = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        value, name = req.logprobs, "logprobs"
    # the engine would refuse more than its own limit anyway: say so here, with the request's name
    limit = min(config.max_logprobs, model.max_logprobs)
    if value is not None and value > limit:
        raise APIError(400, f"{name} must be <= {limit} (the server's --max-logprobs), got {value}", param=name)
    return value


def _prompt_logprobs(req, config: ServerConfig, model: ModelInfo) -> int | None:
    """vLLM's `prompt_logprobs` (alternatives per prompt token, None: not asked), at most the
    logprobs limit; refused with a stream, as vLLM does (0 with a stream asks for nothing)."""
    value = req.prompt_logprobs
    if value is None:
        return None
    if req.stream:
        if value > 0:
            raise APIError(400, f"prompt_logprobs is not available with stream: true (got {value}); send the "
                                "request without stream", param="prompt_logprobs")
        return None
    limit = min(config.max_logprobs, model.max_logprobs)
    if value > limit:
        raise APIError(400, f"prompt_logprobs must be <= {limit} (the server's --max-logprobs), got {value}",
                       param="prompt_logprobs")
    return value


def _encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if not text:
        return []
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
