"""Frozen, validated configuration dataclasses. Errors name the knob and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass

from blockdraft.errors import param_error

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a target model, normalised from an HF `config.json`.

    `layer_types[i]` is "full_attention" or "sliding_attention"; sliding layers attend to the last
    `sliding_window` positions (incl. self). `attention_bias`: q/k/v projections carry a bias
    (Qwen2). `qk_norm`: per-head RMSNorm on q and k before RoPE (Qwen3).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS.values():
            raise ValueError(f"arch {self.arch!r} is not supported; supported: {sorted(set(SUPPORTED_ARCHS.values()))}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected {self.num_hidden_layers}")
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ValueError(f"layer_types contains {sorted(bad)}; allowed: full_attention, sliding_attention")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from an HF config dict (config.json).

        Raises:
            ValueError: unsupported `architectures` / `model_type`, naming it and the supported ones.
        """
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHS.values():
            raise ValueError(
                f"model architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHS)}"
            )
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        layer_types = tuple(cfg.get("layer_types") or ())
        window = cfg.get("sliding_window")
        if not layer_types and arch == "qwen2" and cfg.get("use_sliding_window") and window:
            lo = cfg.get("max_window_layers", cfg["num_hidden_layers"])
            layer_types = tuple(
                "sliding_attention" if i >= lo else "full_attention" for i in range(cfg["num_hidden_layers"])
            )
        if "sliding_attention" not in layer_types:
            window = None
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
            layer_types=layer_types,
            sliding_window=window,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_kv_blocks` pages of `kv_block_size` tokens each (all groups share page ids).

    num_kv_blocks None: size the pool from GPU memory, using at most `gpu_memory_utilization`
    (in (0, 1]) of the device (blockdraft.runner.kv_budget); CUDA only.
    enable_prefix_caching: reuse the KV pages of full pages of a cached prompt prefix
    (blockdraft.engine.kv_cache_manager). Off by default (vLLM turns it on by default); on the GPU
    (CUDA graphs, async scheduling) fp32 answers were identical, bf16 ones may flip at exact ties
    (docs/benchmarks/gpu.md "Session 9").
    """

    kv_block_size: int = 16
    num_kv_blocks: int | None = 1024
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.kv_block_size < 1:
            raise param_error("kv_block_size", f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise param_error("num_kv_blocks", f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise param_error("gpu_memory_utilization", f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise param_error(
                "enable_prefix_caching", f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )


# Tokens per engine step when not given, by device type: a few hundred rows already keep 2 CPU
# cores busy, while on the GPU a step must hold every running request's verify rows (64 x 16 at
# K = 15) and prefill steps of several prompts; 8192 is vLLM's server default on GPUs of >= 70 GiB
# (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 8192}


def default_max_num_batched_tokens(device: str) -> int:
    """The tokens-per-step budget used when none is given, for a resolved device type ("cpu" |
    "cuda"; DEFAULT_MAX_NUM_BATCHED_TOKENS). Raises ValueError for another device type."""
    if device not in DEFAULT_MAX_NUM_BATCHED_TOKENS:
        raise ValueError(f"no default max_num_batched_tokens for device {device!r}; "
                         f"known: {sorted(DEFAULT_MAX_NUM_BATCHED_TOKENS)}")
    return DEFAULT_MAX_NUM_BATCHED_TOKENS[device]


def resolve_max_model_len(requested: int | None, max_position_embeddings: int, num_kv_blocks: int | None,
                          kv_block_size: int, pool_from_memory: bool = False) -> int:
    """The context length in tokens (prompt + output of one request at most).

    requested: SchedulerConfig.max_model_len; None: the model's `max_position_embeddings` capped by
    the KV pool of `num_kv_blocks` pages of `kv_block_size` tokens (a request must fit the pool on
    its own, or preempting the others could never make room for it). num_kv_blocks None: the pool
    is not sized yet (from GPU memory, later): only the model's limit applies. pool_from_memory:
    the pool was sized from gpu_memory_utilization (the knob to name when it is too small).
    Raises:
        ValueError: `requested` above max_position_embeddings, or more tokens than the pool holds
            (naming the values, the limit and the knobs: num_kv_blocks / gpu_memory_utilization).
    """
    pool = None if num_kv_blocks is None else num_kv_blocks * kv_block_size
    if requested is None:
        return max_position_embeddings if pool is None else min(max_position_embeddings, pool)
    if requested > max_position_embeddings:
        raise param_error("max_model_len", f"max_model_len {requested} is above the model's context of "
                          f"{max_position_embeddings} tokens (max_position_embeddings in its config.json): give at "
                          f"most {max_position_embeddings}, or leave it out to use the model's")
    if pool is not None and requested > pool:
        need = -(-requested // kv_block_size)
        knob = ("raise gpu_memory_utilization (--gpu-memory-utilization), which sized it" if pool_from_memory
                else f"raise num_kv_blocks (--num-kv-blocks) to at least {need}")
        raise param_error("max_model_len", f"max_model_len {requested} does not fit the KV pool of {num_kv_blocks} "
                          f"pages x {kv_block_size} tokens = {pool} tokens, and one request must fit it: {knob}, "
                          f"or lower max_model_len")
    return requested


# Admission batching (SchedulerConfig): the engine's defaults when LLM(...) is given None. With a
# drafter, 0.25: on the H200 (Qwen2.5-Coder-0.5B, K = 5, 512 requests with 32 in flight) DFlash
# went 33,202 -> 37,270 tok/s (+12 %) while plain decoding, whose requests finish 3x less often
# per step, lost 9 % (24,807 -> 22,464), so plain decoding keeps 0 (docs/benchmarks/gpu.md
# "Session 27").
DEFAULT_ADMISSION_BATCH_RATIO_SPECULATIVE = 0.25
DEFAULT_ADMISSION_BATCH_RATIO_PLAIN = 0.0
DEFAULT_ADMISSION_MAX_WAIT_STEPS = 8


def default_admission_batch_ratio(speculative: bool) -> float:
    """SchedulerConfig.admission_batch_ratio when none is given: with a drafter or without."""
    return DEFAULT_ADMISSION_BATCH_RATIO_SPECULATIVE if speculative else DEFAULT_ADMISSION_BATCH_RATIO_PLAIN


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: tokens per step (prefill chunks + decode rows) and running requests.

    mixed_prefill: True = a step carries prompt chunks and running requests' decode / verify rows
    together (vLLM's chunked prefill); False = a step either prefills (admitted and partly
    computed prompts) or decodes, prefill first, as SGLang without --enable-mixed-chunk, so decode
    steps stay uniform and replay their CUDA graphs (a mixed step runs eagerly).
    max_prefill_tokens / max_prefill_seqs: without mixed prefill, a prefill step takes another
    waiting prompt only while its rows stay within max_prefill_tokens and its requests within
    max_prefill_seqs (SGLang's --max-prefill-tokens); the first prompt of a step is limited by
    max_num_batched_tokens alone (chunked as usual); running requests still prefilling count toward
    both. None: no limit beyond the budget. Without mixed prefill the engine sets them to the
    largest prefill graph bucket wherever it built prefill graphs (runner.prefill_graphs), so
    a burst of arrivals prefills in graphed steps instead of one eager step.
    num_speculative_tokens: K of the engine's speculator (0 without one; the engine sets it): the
    pages admissions leave free for the decoding requests count K drafts each, also for a request
    whose drafts a step trimmed to fit the token budget (its next step drafts K again).
    admission_batch_ratio / admission_max_wait_steps: without mixed prefill, while requests run,
    admit waiting ones only once at least max(1, ceil(ratio x running requests)) fit the free
    sequence slots, or after admission_max_wait_steps decode steps of waiting (blockdraft.engine.
    scheduler, "Admission batching"); ratio 0 admits as soon as a slot is free. Ignored with mixed
    prefill, where an admission costs no step of its own.
    max_model_len: the context length in tokens, prompt + output of one request at most (vLLM's
    max_model_len); None: the model's max_position_embeddings capped by the KV pool
    (resolve_max_model_len).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    mixed_prefill: bool = True
    max_prefill_tokens: int | None = None
    max_prefill_seqs: int | None = None
    num_speculative_tokens: int = 0
    admission_batch_ratio: float = 0.0
    admission_max_wait_steps: int = 8
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        n = self.max_model_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise param_error("max_model_len", f"max_model_len must be None or an integer >= 1 (tokens), got {n!r}")
        if self.max_num_batched_tokens < 1:
            raise param_error("max_num_batched_tokens", f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise param_error("max_num_seqs", f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not isinstance(self.mixed_prefill, bool):
            raise param_error("mixed_prefill", f"mixed_prefill must be True or False, got {self.mixed_prefill!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise param_error("num_speculative_tokens", f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        r = self.admission_batch_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise param_error("admission_batch_ratio", f"admission_batch_ratio must be a number in [0, 1], got {r!r}")
        w = self.admission_max_wait_steps
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise param_error("admission_max_wait_steps",
                              f"admission_max_wait_steps must be an integer >= 0, got {w!r}")
        for name in ("max_prefill_tokens", "max_prefill_seqs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise param_error(name, f"{name} must be None or an integer >= 1, got {value!r}")
