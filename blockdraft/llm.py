"""Offline Python API: `LLM(model=..., draft=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import logging
import operator
import random
from collections.abc import Iterator

from blockdraft.chat_messages import MESSAGE_KEYS, render_chat, template_messages
from blockdraft.tools.definitions import check_tools
from blockdraft import cpu_threads
from blockdraft.config import (
    DEFAULT_ADMISSION_MAX_WAIT_STEPS,
    default_admission_batch_ratio,
)
from blockdraft.drafters import check_disable_by_batch_size
from blockdraft.drafters import logger as drafters_logger
from blockdraft.engine.gc_heap import frozen_gc_heap
from blockdraft.engine.outputs import CompletionOutput, RequestOutput
from blockdraft.engine_setup import (  # noqa: F401  (resolve_*: re-exported, they used to live here)
    build_engine,
    build_speculator,
    check_bool_options,
    resolve_async_scheduling,
    resolve_disable_by_batch_size,
    resolve_mixed_prefill,
)
from blockdraft.errors import check_unicode_text, param_error
from blockdraft import generation_config as gen_config
from blockdraft import model_loader
from blockdraft.model_loader import LoadedTarget, catalog_name, eos_token_ids, load_target  # noqa: F401  (re-exported)
from blockdraft.preflight import (  # noqa: F401  (re-exported: the public names used to live here)
    CPU_NUM_KV_BLOCKS,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    Preflight,
    check_dtype,
    dtype_name,
    preflight,
    read_target_config,
    resolve_device,
)
from blockdraft.runner.setup import check_batch_invariant, check_fp32_lm_head
from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams, check_max_logprobs
from blockdraft.vllm_only_args import check_vllm_only

logger = logging.getLogger(__name__)

# torch's own thread count, taken before any engine: LLM(threads=None) keeps one the user sets later
cpu_threads.remember_torch_default()


class LLM:
    """A target model, optionally with a DFlash drafter, behind a continuous-batching engine.

    Args:
        model: catalog name (see `blockdraft fetch --list`), HF-format folder, or .gguf file.
        draft: DFlash drafter checkpoint folder, "shipped" (the drafter shipped for `model`),
            "auto" (shipped if one exists and its speculative.json does not record it slower than
            plain on this device type, else plain), or None for plain decoding (the default
            here, as in vLLM's LLM; the CLI's `generate` defaults to "auto").
        num_speculative_tokens: drafts per step K (default: the K recorded in the drafter folder's
            speculative.json, else the drafter's block_size - 1).
        draft_vocab_size: score drafts over the drafter folder's N most frequent target tokens
            (its draft_vocab.json; FR-Spec, see blockdraft.spec.draft_vocab) instead of the
            whole vocabulary: a cheaper draft LM head, output unchanged (lossless). 0 = the full
            vocabulary; None = the size recorded in the folder's speculative.json, else 0.
        dtype: "auto" (the checkpoint's dtype, bf16 for catalog models; float32 on a CPU without
            native bf16, e.g. AVX2-only) | "float32" | "bfloat16" | "float16", the torch.dtype of
            one of these, or vLLM's "half" / "float" (as vLLM takes them).
        device: "cpu" | "cuda" | "auto" (CUDA when available). CUDA runs the Triton attention
            kernels, a sync-free step and CUDA graphs for uniform decode / verify steps.
        kv_block_size / num_kv_blocks: KV page size (tokens) and pool size (pages). num_kv_blocks
            None: 1024 on CPU (or as many as max_model_len needs); on CUDA sized from
            `gpu_memory_utilization` after a profile step, to hold one request of max_model_len
            (else of the model's max_position_embeddings).
        seed: makes unseeded requests reproducible from run to run (vLLM's LLM(seed=...)): each
            draws its seed from a stream started at `seed`, in the order requests are queued.
            Default 0, as vLLM V1's: a script's sampling repeats from run to run; None: from the
            operating system's randomness. Seeded SamplingParams keep theirs.
        max_model_len: the context length in tokens, prompt + output of one request at most
            (vLLM's max_model_len); `engine.max_model_len` holds the value in effect. None: the
            model's max_position_embeddings, capped by the KV pool (e.g. Qwen2.5's 32768 on the
            CPU's default pool of 1024 x 16 = 16384 tokens). A value above max_position_embeddings
            or above what the pool holds raises ValueError naming num_kv_blocks /
            gpu_memory_utilization.
        gpu_memory_utilization: fraction of the GPU the engine may use, in (0, 1] (CUDA, when
            num_kv_blocks is None).
        enforce_eager: CUDA: never capture CUDA graphs.
        max_num_batched_tokens / max_num_seqs: scheduler limits per step (tokens: prefill chunks +
            decode / verify rows; running requests). max_num_batched_tokens None: 512 on CPU, 8192
            on CUDA (blockdraft.config.DEFAULT_MAX_NUM_BATCHED_TOKENS).
        cache_dir: the cache root for catalog models (downloaded and converted once), converted
            .gguf files and expanded shipped drafters; None: $BLOCKDRAFT_CACHE, else
            ~/.cache/blockdraft (blockdraft.weights.fetch.cache_root).
        target: an already loaded target (shares weights between engines; tests, benchmarks).
        speculator: an already built speculator (e.g. a DFlashSpeculator over `target`'s model;
            tests, benchmarks) used instead of loading one: `draft`, `num_speculative_tokens` and
            `draft_vocab_size` are then ignored. Its draft KV caches are reallocated to the pool's
            page count when they differ. None: built from `draft`.
        attention_backend: "torch" | "dense" | "triton" | None (the device's default; tests).
        graph_mode: None (CUDA graphs on CUDA unless enforce_eager) | "off" | "eager" (the
            padded CUDA-graph code run without capture; tests and debugging) | "capture".
        async_scheduling: launch the next decode step before this one's tokens are read back
            (blockdraft.engine.llm_engine.LLMEngine; vLLM's --async-scheduling): same output, the
            GPU no longer waits for the host between steps. None = on when CUDA graphs are
            captured; True needs the uniform-step graphs (graph mode "capture" or "eager").
        enable_prefix_caching: reuse the KV pages (target and drafter) of full pages of prompt
            prefixes already computed (blockdraft.engine.kv_cache_manager; vLLM's
            enable_prefix_caching). Same output; hits are counted in tokens in
            `engine.scheduler.kv.stats`. Off by default (vLLM defaults it on): on the GPU, fp32
            answers were identical, bf16 ones may flip at exact ties.
        enable_fp32_lm_head: CUDA: the LM head returns its float32 accumulation of the bf16 / fp16
            operands instead of rounding the logits to the model dtype (vLLM's and SGLang's
            --enable-fp32-lm-head, here without upcasting the weights: same operand traffic).
            Rounded bf16 logits tie wherever two tokens' logits are within one bf16 step (0.125
            at |logit| in [16, 32)), and which one wins then depends on the batch shape: with
            this on, plain and speculative decoding agree more often (README, "GPU path").
            Off by default, as in vLLM.
        batch_invariant: CUDA: every matmul, the LM head and attention give a token's row the
            same bits whatever else shares its step (a one-row decode, a K + 1-row verify block,
            other requests in flight): greedy speculative decoding then equals plain decoding
            token for token, and a request's answer does not depend on the batch it ran in
            (vLLM's VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference). Slower
            (fixed-tile kernels; README "GPU path"); off by default. CUDA only, with the 'triton'
            attention backend: on the CPU, decode and verify rows are row-invariant as they are,
            but a prompt's prefill attention depends on its chunking, which this mode does not
            change (refused there; runner.setup.check_batch_invariant).
        max_logprobs: the largest `SamplingParams.logprobs` / `prompt_logprobs` a request may ask for
            (default 20, as vLLM's max_logprobs); `generate` refuses more with a ValueError naming
            the field.
        mixed_prefill: a step may carry new prompts' prefill chunks beside running requests'
            decode / verify rows (blockdraft.engine.scheduler; long prompts are chunked either
            way). None = on unless the decode steps replay captured CUDA graphs: a mixed step
            cannot, so there a step prefills or decodes (as SGLang without --enable-mixed-chunk).
            The same tokens in fp32; in bf16 another batch make-up can flip a near-tie.
        speculative_disable_by_batch_size: N (requests): a step that runs N or more requests
            decodes without drafts (vLLM's disable_by_batch_size; the drafter still reads the
            step's context, so drafting resumes below N); same output. On the CPU DFlash measured
            1.53x / 1.32x / 1.06x / 0.80x plain decoding at 1 / 2 / 4 / 8 requests
            (docs/benchmarks/cpu.md). Eager steps only: needs graph mode "off" (on CUDA
            enforce_eager=True) and a drafter; ignored when draft="auto" decodes plainly. None
            (default): always speculate.
        admission_batch_ratio / admission_max_wait_steps: without mixed prefill, while requests
            run, admit waiting ones only once at least max(1, ceil(ratio x running)) fit the free
            sequence slots, or after that many decode steps of waiting (fewer prefill steps pausing
            the decoding requests, for a few steps more time to first token; blockdraft.engine.
            scheduler "Admission batching"). None: ratio 0.25 with a drafter (DFlash +12 % under a
            steady load of 32 on the H200), 0 without (plain decoding lost 9 % with it), and 8
            steps (blockdraft.config); ratio 0 admits as soon as a slot frees.
        threads: torch's CPU threads for the model's math (torch.set_num_threads; the CLI's
            --threads), an integer >= 1, applied before the weights load on any device. None
            (default): $BLOCKDRAFT_THREADS, else on the CPU one per free core (one per core,
            less the cores other processes keep busy, sampled for 0.1 s; a line on stderr says
            so when that is fewer than torch's default: oversubscribed cores stall torch), and on
            a GPU torch's default. It is chosen once per process (torch has one setting): None
            keeps a count set earlier, by a previous engine, a `blockdraft` command or you
            (torch.set_num_threads after `from blockdraft import LLM`; set before it, the count
            is taken for torch's default, which the automatic choice may only lower). See
            blockdraft.cpu_threads.engine_threads. A threads that is not None or an integer >= 1
            raises ValueError naming the value (before anything loads).
        generation_config: where the sampling defaults of `generate` / `chat` / `generate_stream`
            without SamplingParams come from (vLLM's generation_config): "auto" (default) the
            model folder's generation_config.json (its temperature, top_p, top_k, min_p,
            repetition_penalty, and max_new_tokens as max_tokens; e.g. Qwen2.5-Instruct's
            temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05), "vllm" none, or a
            folder whose generation_config.json to read instead. Fields the file does not set keep
            SamplingParams' defaults (greedy, 256 tokens); SamplingParams you pass are used as they
            are. Catalog models (converted from GGUF) have no such file. Read and checked before
            the weights load (blockdraft.generation_config.default_sampling_params); a warning
            line gives the values the first time they are used.
        vllm_args: vLLM's LLM arguments that have no meaning here (blockdraft.vllm_only_args:
            tensor_parallel_size=1, trust_remote_code=False, ...), accepted at the values that
            change nothing.
    Raises:
        TypeError: an unknown keyword argument (the nearest known ones named), or one of vLLM's
            at a value that would change something (what to do instead: e.g. speculative_config
            -> draft= and num_speculative_tokens=).
        ValueError / FileNotFoundError: a bad setting (names it), including a GPU pool too small
            for one request. Everything that needs no weights (see blockdraft.preflight: device,
            dtype, pool and scheduler sizes, the drafter folder and config, K, the drafter against
            the target's config) is checked before any weights load.
    """

    def __init__(
        self,
        model: str | None = None,
        draft: str | None = None,
        num_speculative_tokens: int | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        kv_block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 64,
        cache_dir: str | None = None,
        target: LoadedTarget | None = None,
        speculator=None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        attention_backend: str | None = None,
        graph_mode: str | None = None,
        draft_vocab_size: int | None = None,
        async_scheduling: bool | None = None,
        enable_prefix_caching: bool = False,
        enable_fp32_lm_head: bool = False,
        batch_invariant: bool = False,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        mixed_prefill: bool | None = None,
        speculative_disable_by_batch_size: int | None = None,
        admission_batch_ratio: float | None = None,
        admission_max_wait_steps: int | None = None,
        max_model_len: int | None = None,
        seed: int | None = 0,
        threads: int | None = None,
        generation_config: str = "auto",
        **vllm_args,
    ) -> None:
        own = [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "vllm_args")]
        check_vllm_only(vllm_args, own)  # first: a vLLM script's argument is said before anything else
        dtype = dtype_name(dtype)
        check_max_logprobs(max_logprobs)
        gen_config.check_generation_config(generation_config)
        cpu_threads.check_threads(threads)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise param_error("seed", f"seed must be None or an integer >= 0, got {seed!r}")  # before any weights load, as preflight's checks
        disable_by_batch_size = check_disable_by_batch_size(speculative_disable_by_batch_size)
        check_bool_options(enforce_eager=enforce_eager, enable_fp32_lm_head=enable_fp32_lm_head,
                           batch_invariant=batch_invariant)  # fmt: skip
        check_fp32_lm_head(enable_fp32_lm_head, resolve_device(device))  # before any drafter or weights
        check_batch_invariant(batch_invariant, resolve_device(device), attention_backend)
        if model is None and target is not None:  # "auto" / "shipped" pick the loaded target's drafter
            model = catalog_name(target.path)
        notes: list[str] = []  # why draft="auto" decodes plainly: said once every setting is checked
        pre = preflight(
            model, draft if speculator is None else None, num_speculative_tokens if speculator is None else None,
            dtype, device, kv_block_size,
            num_kv_blocks, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, cache_dir,
            target_config=target.config if target is not None else None,
            draft_vocab_size=draft_vocab_size if speculator is None else None,
            enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len, notes=notes,
        )
        device, cache = pre.device, pre.cache
        sched = dataclasses.replace(  # checks the values before any weights load
            pre.scheduler,
            admission_batch_ratio=(default_admission_batch_ratio(speculator is not None or pre.draft is not None)
                                   if admission_batch_ratio is None else admission_batch_ratio),
            admission_max_wait_steps=(DEFAULT_ADMISSION_MAX_WAIT_STEPS if admission_max_wait_steps is None
                                      else admission_max_wait_steps),
        )  # fmt: skip
        async_scheduling = resolve_async_scheduling(async_scheduling, device, enforce_eager, attention_backend, graph_mode)
        resolve_mixed_prefill(mixed_prefill, graphs_captured=False)  # checked before the weights load
        disable_by_batch_size = resolve_disable_by_batch_size(
            disable_by_batch_size, speculator is not None or draft is not None, speculator is None and pre.draft is None,
            device, enforce_eager, attention_backend, graph_mode,
        )  # fmt: skip
        for note in notes:
            drafters_logger.warning("%s", note)
        # the model's sampling defaults, read and checked before minutes of weight loading
        model_path = target.path if target is not None else pre.target_path
        self.generation_config = generation_config
        self.default_sampling_params: dict = gen_config.default_sampling_params(model_path, generation_config)
        self.generation_config_file = gen_config.source_file(model_path, generation_config)  # or None
        self._defaults_said = False
        cpu_threads.engine_threads(threads, device)  # the settings are checked; before any model work
        self.target = target or model_loader.load_target(str(pre.target_path), dtype, device, cache_dir)
        self.tokenizer = self.target.tokenizer
        if speculator is None and pre.draft is not None:
            speculator = build_speculator(pre, self.target)
        self.speculator = speculator
        options = dict(enforce_eager=enforce_eager, attention_backend=attention_backend, graph_mode=graph_mode,
                       disable_by_batch_size=disable_by_batch_size, fp32_lm_head=enable_fp32_lm_head,
                       batch_invariant=batch_invariant)  # fmt: skip
        self.engine = build_engine(self.target, cache, sched, speculator, device, async_scheduling,
                                    max_logprobs, mixed_prefill, **options)
        self.engine.seed_rng = None if seed is None else random.Random(seed)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams that `generate`, `chat` and `generate_stream` use when given none, as
        vLLM's `LLM.get_default_sampling_params`: SamplingParams() with the model's
        generation_config.json defaults (`default_sampling_params`, a dict of its fields; see the
        `generation_config` argument) set. A new object on each call (its own random seed); the
        first call that applies model defaults logs them in one warning line, as vLLM.
        """
        if self.default_sampling_params and not self._defaults_said:
            self._defaults_said = True
            logger.warning("%s", gen_config.overridden_message(
                self.default_sampling_params, self.generation_config_file,
                "build the LLM with generation_config=\"vllm\" or pass SamplingParams"))
        return SamplingParams(**self.default_sampling_params)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for a batch, continuously batched; outputs come back in input order.

        prompts: a str, a list of token ids, vLLM's prompt dicts {"prompt": str} (TextPrompt)
            and {"prompt_token_ids": [ids]} (TokensPrompt), a chat conversation (list of
            {"role", "content"[, "name"]} dicts; chat template applied; see `chat`) or a list of
            any of these, mixed (str: raw text). A dict is read by its keys: "role" makes it a
            chat message, "prompt" / "prompt_token_ids" a prompt. An empty list (or tuple)
            returns [] without stepping the engine, as vLLM.
        sampling_params: one SamplingParams for every prompt or a list of them (one per prompt), as
            vLLM; None: `get_default_sampling_params()` (SamplingParams() with the model's
            generation_config.json defaults, if any).
        Returns:
            one finished RequestOutput per prompt, in input order; with SamplingParams(n=N) its
            `outputs` holds the N completions (vLLM's `o.outputs[j].text`), run as N requests.
            With truncate_prompt_tokens, its prompt_token_ids (and prompt_logprobs) are those of
            the truncated prompt and its `prompt` the text given, as vLLM's.
        Raises:
            TypeError: sampling_params of another type (e.g. a dict: build SamplingParams(**d)).
            ValueError: prompts of another type (e.g. None), an empty prompt, a prompt of another
                type or a token id that is not an integer (naming the prompt's index and the
                value), a dict whose keys are neither a prompt's nor a chat message's, both, or
                include others (e.g. "multi_modal_data"; names the keys found and the allowed
                ones), a bad chat message (its index, value and the allowed roles), a token id
                outside the vocabulary or a prompt longer than the context, both checked after
                SamplingParams.truncate_prompt_tokens cut the prompt (naming the prompt's index
                when there are several), truncate_prompt_tokens above max_model_len, mismatched params list, a
                SamplingParams field out of range (also one set after construction), `logprobs`
                or `prompt_logprobs` above `max_logprobs`; nothing of the batch is queued then.
        """
        items = self._prompt_list(prompts)
        token_lists = [self._tokenize_one(i, p) for i, p in enumerate(items)]
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        one_for_all = not isinstance(params, (list, tuple))
        # checked before repeating it per prompt: a bad one is refused also for an empty batch
        params = [params] if one_for_all else list(params)
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                where = f" (item {i} of the list)" if isinstance(sampling_params, (list, tuple)) else ""
                hint = ": build one with SamplingParams(**params)" if isinstance(p, dict) else ""
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                                f"{_shown(p)}{where}{hint}")
        if one_for_all:
            params = params * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"got {len(params)} SamplingParams for {len(token_lists)} prompts")
        # one engine request per completion (SamplingParams.n), grouped back per prompt at the end
        runs = [(i, toks, q) for i, (toks, p) in enumerate(zip(token_lists, params)) for q in p.completions()]
        for i, toks, q in runs:  # the whole batch first: a bad prompt queues nothing
            try:
                self.engine.check_request(toks, q)
            except ValueError as e:
                # a field's error (param_error) names the field and value; a token id outside the
                # vocabulary (the prompt's or a field's) and a prompt too long also need the
                # prompt's index in a batch (a field's keeps its .param)
                message = str(e)
                vocabulary = "outside the vocabulary" in message
                if len(token_lists) == 1 or (hasattr(e, "param") and not vocabulary) or (
                        not hasattr(e, "param") and type(e) is not ValueError):
                    raise
                if hasattr(e, "param"):
                    raise param_error(e.param, f"prompt {i}: {message}") from None
                raise ValueError(f"prompt {i} {message[len('prompt '):]}" if message.startswith("prompt ")
                                 else f"prompt {i}: {message}") from None
        if not token_lists:  # vLLM returns [] too; stepping would only advance others' requests
            return []
        ids = [f"req-{next(self._ids)}" for _ in runs]
        for rid, (_, toks, q) in zip(ids, runs):
            self.engine.add_request(rid, toks, q)
        outs = _per_prompt(self._run(ids, use_tqdm), [i for i, _, _ in runs])
        for out, text in zip(outs, self._prompt_texts(items, token_lists)):
            out.prompt = text
        return outs

    def generate_stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """One prompt, its output as it grows: a RequestOutput after every engine step that gave the
        request tokens (cumulative `text` / `token_ids`; the last one `finished`). The same tokens
        as `generate` (tested). The prompt is checked before this returns and queued at the first
        `next()` (a stream never iterated leaves nothing in the engine); closing the iterator early
        (break, an exception in the loop) aborts the request and frees its pages. One stream at a
        time: the engine steps every queued request, and outputs of other requests are dropped.
        With `stop` strings, a step's text may end in the start of a stop string that a later step
        cuts away: hold back the last (longest stop string - 1) characters, as the server's stream
        does (server/serving.py).

        prompt: a str (raw text), a list of token ids, a prompt dict ({"prompt": str} or
            {"prompt_token_ids": [ids]}) or a chat conversation, as one `generate` prompt.
        sampling_params: None: `get_default_sampling_params()`, as `generate`.
        Raises:
            TypeError: sampling_params that is not a SamplingParams.
            ValueError: as `generate`, and a batch of prompts (streaming takes one).
        """
        token_lists = self._tokenize_all(prompt)
        if len(token_lists) != 1:
            raise ValueError(f"generate_stream takes one prompt (a str, a list of token ids or a conversation), got "
                             f"{len(token_lists)}; use generate for a batch")
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {_shown(params)}")
        if params.n != 1:
            raise param_error("n", f"generate_stream streams one completion: n must be 1, got {params.n} (use "
                                   f"generate for n > 1)")
        self.engine.check_request(token_lists[0], params)
        return self._stream(f"req-{next(self._ids)}", token_lists[0], params)

    def _stream(self, rid: str, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        self.engine.add_request(rid, prompt_token_ids, params)  # in the generator: queued at the first next()
        finished = False
        try:
            with frozen_gc_heap():  # as _run: no full collection over the model's heap mid-run
                while not finished and self.engine.has_unfinished_requests():
                    for out in self.engine.step(stream=True):
                        if out.request_id == rid:
                            finished = out.finished
                            yield out
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's `LLM.reset_prefix_cache` (e.g. to time a cold
        cache). Returns True when the cache is empty afterwards (also without prefix caching), False
        (nothing changed) while requests are unfinished. The hit counters keep counting."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        """The target's tokenizer (a Hugging Face tokenizer), as vLLM's `LLM.get_tokenizer()`."""
        return self.tokenizer

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """`generate` for one conversation or a list of conversations (chat template applied), as
        vLLM's `LLM.chat`. An empty list is no conversations and gives [] (as vLLM's LLM.chat);
        [[]] is one empty conversation and is refused.

        messages: a conversation (a list of {"role", "content"} dicts; roles system / user /
            assistant / developer / tool, developer rendered as system; content a str or a list of
            {"type": "text", "text": str} parts; an optional str "name"; an assistant message's
            OpenAI `tool_calls`, whose JSON arguments the template gets parsed, and a tool
            message's `tool_call_id`), as the server takes them, or a list of conversations.
        add_generation_prompt: end the prompt with the template's assistant cue (vLLM's keyword,
            passed on to the chat template); False renders the conversation alone.
        continue_final_message: leave the last message (an assistant one) open, so the answer
            continues it (vLLM's keyword; needs add_generation_prompt=False).
        chat_template_kwargs: extra variables for the chat template (vLLM's keyword), not
            apply_chat_template's own arguments.
        tools: OpenAI tool definitions ({"type": "function", "function": {"name", "description",
            "parameters"}}) for the chat template (vLLM's keyword; Qwen2.5's template then asks
            for <tool_call> blocks). The answer is text: constrain it with
            SamplingParams(structured_outputs=...) or parse it (blockdraft.tools.parsers).
        Raises:
            ValueError: as `generate`; a message whose role is not one of the allowed ones, with
                other keys, or without string / text-part content names the message's index and
                value; bad tool fields of a message or bad tools (blockdraft.tools.check_tools:
                names tools[i] and the field); a template control the template cannot honour
                (blockdraft.chat_messages.ChatTemplateError: render_chat).
        """
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"LLM.chat takes a conversation (a list of {{'role', 'content'}} dicts) or a list of "
                             f"conversations, got {_shown(messages)}; raw text goes to LLM.generate")
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {_shown(flag)}")
        # a list whose first item is a list: several conversations; else one (its messages are checked)
        convs = list(messages) if not messages or isinstance(messages[0], list) else [messages]
        prompts = [self.encode_chat(c, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs, tools=tools) for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out, ids in zip(outs, prompts):  # vLLM's output.prompt: the template's text
            out.prompt = self.tokenizer.decode(ids)
        return outs

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation through the model's chat template, with the assistant cue
        unless add_generation_prompt is False (the template controls: LLM.chat). Messages are
        checked and given to the template as the server gives them
        (blockdraft.chat_messages.template_messages: developer as system, text parts joined, `name`
        passed on, tool calls' arguments parsed), and rendered by the server's function
        (render_chat), so both give the same ids. tools: OpenAI tool definitions for the template
        (checked as the server checks them: blockdraft.tools.check_tools), or None.

        Raises:
            ValueError: an empty conversation or a bad message (blockdraft.chat_messages: the
                message index, the value, the allowed roles / keys); bad tools (names tools[i]);
                ChatTemplateError (a ValueError) for what render_chat refuses.
        """
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"a chat conversation must be a list of {{'role', 'content'}} dicts, got {_shown(messages)}")
        return render_chat(self.tokenizer, template_messages(messages), add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                           tools=None if tools is None else check_tools(tools))

    def _tokenize_all(self, prompts) -> list[list[int]]:
        """Token ids of each prompt (see `generate`; `_prompt_list` and the errors)."""
        return [self._tokenize_one(i, p) for i, p in enumerate(self._prompt_list(prompts))]

    def _prompt_list(self, prompts) -> list:
        """`generate`'s prompts as a list of single prompts (one str, token-id list, conversation
        or prompt dict is a batch of one). An empty list or tuple gives [] (`generate` returns []).

        Raises:
            ValueError: prompts that are neither a str, a prompt dict nor a list / tuple (None
                included: names the type and value), a dict of unknown keys (names them and the
                allowed ones); each prompt is checked by `_tokenize_one`.
        """
        if isinstance(prompts, dict) and _dict_kind(prompts, "prompts") == "message":
            raise ValueError(f"prompts is a single chat message {prompts!r:.80}: a conversation is a list of "
                             f"messages, so give [message, ...] (or use LLM.chat)")
        if isinstance(prompts, dict):
            prompts = [prompts]  # one TextPrompt / TokensPrompt, as vLLM takes it
        elif isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and len(prompts) > 0 and (
                _is_token_id(prompts[0])
                or (isinstance(prompts[0], dict) and _dict_kind(prompts[0], "prompt 0") == "message"))):
            prompts = [prompts]  # one raw text, one conversation or one list of token ids
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a str, a list of token ids, a prompt dict ({{'prompt': str}} or "
                             f"{{'prompt_token_ids': [ids]}}), a conversation (a list of {{'role', 'content'}} "
                             f"dicts) or a list of these, got {_shown(prompts)}")
        return list(prompts)

    def _prompt_texts(self, items: list, token_lists: list[list[int]]) -> list[str | None]:
        """RequestOutput.prompt of each prompt (`_prompt_list`'s items; vLLM's): the text given (a
        str or {"prompt": str}), a conversation's rendered chat-template text, None for token ids."""
        texts = []
        for p, ids in zip(items, token_lists):
            if isinstance(p, dict):
                p = p.get("prompt")
            if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
                p = self.tokenizer.decode(ids)  # the template's text (special tokens kept)
            texts.append(p if isinstance(p, str) else None)
        return texts

    def _tokenize_one(self, i: int, p) -> list[int]:
        """Token ids of prompt `i` of a batch.

        Raises:
            ValueError: a prompt of another type (names its index and type), a dict of unknown keys,
                a token id that is not an integer (names the prompt, the position and the value),
                an empty string or list of token ids (names its index) or a bad conversation.
        """
        if isinstance(p, dict):
            if _dict_kind(p, f"prompt {i}") == "message":
                raise ValueError(f"prompt {i} is a single chat message {p!r:.80}: a conversation is a list of "
                                 f"messages, so give [[message, ...], ...] (or use LLM.chat)")
            if "prompt" in p:
                if not isinstance(p["prompt"], str):
                    raise ValueError(f"prompt {i}: 'prompt' must be a str, got {_shown(p['prompt'])}; token ids go "
                                     f"in 'prompt_token_ids'")
                return self._tokenize_one(i, p["prompt"])
            if not isinstance(p["prompt_token_ids"], (list, tuple)):
                raise ValueError(f"prompt {i}: 'prompt_token_ids' must be a list of token ids, got "
                                 f"{_shown(p['prompt_token_ids'])}")
            return self._token_ids(i, p["prompt_token_ids"])
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is empty: give a non-empty string")
            check_unicode_text(p, f"prompt {i}")
            return self.tokenizer.encode(p)
        if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
            return self.encode_chat(p)
        if isinstance(p, (list, tuple)):
            return self._token_ids(i, p)
        raise ValueError(f"prompt {i} must be a str, a list of token ids, a prompt dict or a conversation (a list "
                         f"of {{'role', 'content'}} dicts), got {_shown(p)}")

    @staticmethod
    def _token_ids(i: int, p) -> list[int]:
        if not p:
            raise ValueError(f"prompt {i} is empty: give at least one token id")
        for j, t in enumerate(p):
            if not _is_token_id(t):
                raise ValueError(f"prompt {i}: token {j} must be an integer token id, got {_shown(t)}")
        return [operator.index(t) for t in p]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until the requests `ids` finish -> their outputs in order. An exception on the way
        (Ctrl-C in a notebook, an engine error) aborts the ones not finished and frees their pages,
        so the next call does not first decode what this one abandoned."""
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = _progress(len(ids), use_tqdm)
        try:
            with frozen_gc_heap():  # no full collection over the model's heap mid-run (engine/gc_heap.py)
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step(stream=False):
                        if out.finished and out.request_id in wanted:
                            done[out.request_id] = out
                            bar.update(1) if bar else None
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [done[i] for i in ids]


def _per_prompt(outs: list[RequestOutput], prompt_index: list[int]) -> list[RequestOutput]:
    """Outputs of the engine requests (in order; prompt_index[r]: the prompt of request r) -> one
    RequestOutput per prompt: its only completion, or for n > 1 the first one with `choices` set
    to all of them (CompletionOutput j = completion j) and `spec` counting them all (its other
    fields, num_cached_tokens among them, are the first one's)."""
    grouped: dict[int, list[RequestOutput]] = {}
    for out, i in zip(outs, prompt_index):
        grouped.setdefault(i, []).append(out)
    result = []
    for i in sorted(grouped):
        group = grouped[i]
        if len(group) == 1:
            result.append(group[0])
            continue
        spec = copy.deepcopy(group[0].spec)
        for o in group[1:]:
            spec.merge(o.spec)
        choices = [CompletionOutput(j, o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs)
                   for j, o in enumerate(group)]  # fmt: skip
        result.append(dataclasses.replace(group[0], spec=spec, choices=choices))
    return result


def _is_token_id(value) -> bool:
    """An integer (Python, numpy or a 0-d integer tensor), not a bool: floats are never rounded."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt (text-only fields)


def _dict_kind(d: dict, where: str) -> str:
    """"message" for a chat message ({"role", "content", ...}: a key of MESSAGE_KEYS, none of
    PROMPT_KEYS), "prompt" for a prompt dict (exactly one of PROMPT_KEYS, nothing else).

    where: how the error names the dict ("prompt 3", "prompts").
    Raises:
        ValueError: keys of both kinds, of neither, both prompt keys, or other keys beside a prompt
            key (e.g. vLLM's "multi_modal_data"); names the keys found and the allowed ones.
    """
    keys = list(d)
    found = f"{where} is a dict with keys {[str(k)[:40] for k in keys][:8]}"
    allowed = (f"a prompt dict has exactly one of {list(PROMPT_KEYS)}; a chat message has {list(MESSAGE_KEYS)} "
               f"(in a list: a conversation)")
    prompt_keys = [k for k in keys if k in PROMPT_KEYS]
    if not prompt_keys:
        if any(k in MESSAGE_KEYS for k in keys):
            return "message"  # other keys are named by the message check
        raise ValueError(f"{found}, neither a prompt nor a chat message: {allowed}")
    if any(k in MESSAGE_KEYS for k in keys):
        raise ValueError(f"{found}, both prompt and chat-message keys: {allowed}")
    if len(prompt_keys) > 1:
        raise ValueError(f"{found}: give 'prompt' (text) or 'prompt_token_ids', not both")
    extra = [str(k)[:40] for k in keys if k not in PROMPT_KEYS]
    if extra:
        raise ValueError(f"{found}: {extra} not supported (text-only prompts); {allowed}")
    return "prompt"


def _shown(value) -> str:
    """A value's type and its first 80 characters, for error messages."""
    return f"{type(value).__name__} {value!r:.80}"


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
