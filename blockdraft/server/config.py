"""Server settings (validated) and what the API layer needs to know about the model."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockdraft.errors import param_error
from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS
from blockdraft.server.tool_calls import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and what requests it accepts.

    host / port: bind address (127.0.0.1 by default: reachable from this machine only).
    api_key: when set, /v1/* needs `Authorization: Bearer <api_key>` (401 otherwise).
    served_model_name: the model id clients send and /v1/models lists; not empty or blank.
    max_body_bytes: request bodies above this are refused with 413.
    max_tokens_limit: largest `max_tokens` a request may ask for (400 above it).
    max_n: largest `n`; max_stop: stop strings per request;
    max_stop_chars: characters per stop string; max_logprobs: largest logprobs / top_logprobs (the
    server accepts at most the smaller of this and the engine's max_logprobs, ModelInfo).
    max_pending: engine requests (choices: prompts x n) admitted and unfinished; beyond it new
        requests get 429, and one request with more choices than this gets 400.
    log_requests: log one line per request (ids, token counts, timings; never prompt text).
    enable_prompt_tokens_details: `usage` carries `prompt_tokens_details: {"cached_tokens": N}`,
        the prompt tokens served from the prefix cache (vLLM's --enable-prompt-tokens-details;
        RequestOutput.num_cached_tokens); off by default, as in vLLM.
    enable_auto_tool_choice: requests may use tool_choice "auto" (the default with tools): the
        tool_call_parser finds the calls in the answer (vLLM's --enable-auto-tool-choice; needs
        tool_call_parser).
    tool_call_parser: the format of a model's tool calls in free text, one of TOOL_CALL_PARSERS
        ("hermes": <tool_call>{...}</tool_call>, Qwen2.5 / Hermes), or None.

    Raises:
        ValueError: a limit out of range, naming it; enable_auto_tool_choice without
            tool_call_parser; an unknown tool_call_parser.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "blockdraft"
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    max_n: int = 16
    max_stop: int = 4
    max_stop_chars: int = 256
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_pending: int = 1024
    log_requests: bool = True
    enable_prompt_tokens_details: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        # param_error: `blockdraft serve` then names the flag ("max_n (--max-n) must be >= 1, got 0")
        if not 0 <= self.port <= 65535:
            raise param_error("port", f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise param_error("api_key", "api_key must be a non-empty string (or unset)")
        if not self.served_model_name.strip():  # clients could never name it
            raise param_error("served_model_name", f"served_model_name must be a non-empty model id (the 'model' "
                              f"clients send), got {self.served_model_name!r}")
        for name in ("max_body_bytes", "max_tokens_limit", "max_n", "max_stop", "max_stop_chars", "max_pending"):
            if getattr(self, name) < 1:
                raise param_error(name, f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise param_error("max_logprobs", f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise param_error("tool_call_parser", f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                                                  f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise param_error("enable_auto_tool_choice", "enable_auto_tool_choice needs tool_call_parser (--tool-call-parser "
                                                         "hermes): the format in which the model writes its tool calls")


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model that requests are checked against.

    vocab_size: valid token ids are [0, vocab_size). max_model_len: prompt + output tokens at most,
    the engine's context (all of it usable: drafts that would pass its end are dropped).
    kv_capacity_tokens: tokens the whole KV pool holds (a request larger than that could never run;
    the engine's max_model_len is never more).
    num_speculative_tokens: drafts per step K (0 without a drafter).
    max_logprobs: the engine's largest logprobs (LLMEngine.max_logprobs).
    created: Unix time the server started (reported by /v1/models).
    default_sampling: the model's sampling defaults (LLM.default_sampling_params, from
        generation_config.json under --generation-config): SamplingParams fields that a request
        leaving them out (or sending null) gets instead of OpenAI's defaults; max_tokens among
        them is the default output length (tokens). Not shown in /v1/models (vLLM shows none).
    max_tokens_cap: output tokens at most for every request, asked or not (vLLM: max_new_tokens
        of a --generation-config FOLDER's file), or None.
    """

    name: str
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    num_speculative_tokens: int
    created: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    default_sampling: dict = field(default_factory=dict)
    max_tokens_cap: int | None = None
