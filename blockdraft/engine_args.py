"""Engine options on the command line (as vLLM's EngineArgs): the argparse flags that several
subcommands share (generate, serve, demo, bench, eval-drafter), and `llm_from_args`, which turns
generate's and serve's flags into an `LLM` (demo, bench and eval-drafter build theirs with their
own settings)."""

from __future__ import annotations

import argparse


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    """--draft / --no-draft / --num-speculative-tokens / --draft-vocab-size /
    --speculative-disable-by-batch-size, shared by generate and serve."""
    p.add_argument("--draft", default="auto",
                   help="DFlash drafter checkpoint folder; 'shipped' for the drafter shipped for --model; "
                   "'auto' (default): the shipped drafter if one exists for --model, else plain decoding (also "
                   "where its speculative.json says it measured slower than plain on this device type)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding (no speculation)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per step K (default: the K measured for the drafter on this device type, its "
                        "speculative.json, else block_size - 1)")
    add_draft_vocab_size_flag(p)
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                   help="decode without drafts in steps that run N or more requests (vLLM's disable_by_batch_size); "
                        "eager steps only (on CUDA with --enforce-eager); default: always speculate")


def add_draft_vocab_size_flag(parser, extra: str = "") -> None:
    """`--draft-vocab-size N` on an argparse parser (generate, serve, demo, eval-drafter, bench);
    `extra` is appended to the help text."""
    parser.add_argument(
        "--draft-vocab-size", type=int, default=None, metavar="N",
        help="score drafts over the drafter's N most frequent target tokens (its draft_vocab.json, "
        "FR-Spec): a cheaper draft LM head, output unchanged; 0 = the full vocabulary, else N >= 256 "
        "(1/16 of a vocabulary under 4096 ids) and at most the ids ranked in draft_vocab.json (default: the "
        "size recorded in the drafter's speculative.json, else 0)" + extra,
    )


def add_dtype_flag(p) -> None:
    """--dtype (LLM(dtype=...)): auto or one of DTYPE_CHOICES' names, for generate and serve."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/KV dtype (default auto: the checkpoint's, bf16 for catalog models; float32 on a CPU "
                        "without native bf16, e.g. AVX2 only)")


def add_device_flags(p) -> None:
    """--device / --gpu-memory-utilization / --enforce-eager (LLM(device=..., ...))."""
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run (default auto: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of GPU memory for weights, activations and the KV pool, in (0, 1] (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs: every step runs eagerly, so async scheduling is off and "
                        "prompts join decode steps (mixed prefill)")


def add_fp32_lm_head_flag(p) -> None:
    """--enable-fp32-lm-head (LLM(enable_fp32_lm_head=True)), for generate, serve and the benches."""
    p.add_argument("--enable-fp32-lm-head", action="store_true",
                   help="CUDA: float32 logits, the LM head's float32 accumulation of the bf16 weights instead of "
                        "logits rounded to bf16 (vLLM's / SGLang's flag; weights stay bf16): greedy choices no "
                        "longer hinge on bf16 ties, so plain and speculative decoding agree more often (default off; "
                        "refused on the CPU)")


def add_batch_invariant_flag(p) -> None:
    """--batch-invariant (LLM(batch_invariant=True)), for generate, serve and the benches."""
    p.add_argument("--batch-invariant", action="store_true",
                   help="CUDA: kernels whose result for a token does not depend on the batch around it (one "
                        "decode row, a verify block, other requests in flight), so greedy speculative decoding "
                        "equals plain decoding token for token and answers do not depend on the load (vLLM's "
                        "VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference). Slower; default off. "
                        "Refused on the CPU, whose prefill attention depends on how a prompt is chunked")


def add_prefix_caching_flag(p) -> None:
    """--enable-prefix-caching (LLM(enable_prefix_caching=True))."""
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV pages of prompt prefixes already computed (shared system prompts, "
                        "multi-turn chats); same output (default off: vLLM turns it on by default, here it is "
                        "opt-in; on the GPU fp32 answers are identical, bf16 ones may differ at exact ties)")


def add_async_scheduling_flag(p) -> None:
    """--async-scheduling / --no-async-scheduling (LLM(async_scheduling=...))."""
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next decode step before this one's tokens are read back: the GPU does not wait for "
                        "the host between steps, same output (default: on when CUDA graphs are captured; needs them)")


def add_admission_flags(p) -> None:
    """--admission-batch-ratio / --admission-max-wait-steps (LLM(admission_batch_ratio=...,
    admission_max_wait_steps=...)), for serve, bench and load_profile."""
    from blockdraft.config import (
        DEFAULT_ADMISSION_BATCH_RATIO_PLAIN,
        DEFAULT_ADMISSION_BATCH_RATIO_SPECULATIVE,
        DEFAULT_ADMISSION_MAX_WAIT_STEPS,
    )

    p.add_argument("--admission-batch-ratio", type=float, default=None, metavar="R",
                   help="without mixed prefill (CUDA graphs), while requests run, admit waiting requests only once "
                        "at least max(1, ceil(R x running)) fit the free --max-num-seqs slots (at most what one "
                        "prefill step takes, 8 with CUDA graphs): fewer prefill steps "
                        "pausing the running requests, for a few steps more time to first token (0 admits as soon "
                        f"as a slot frees; default {DEFAULT_ADMISSION_BATCH_RATIO_SPECULATIVE} with a drafter, "
                        f"{DEFAULT_ADMISSION_BATCH_RATIO_PLAIN} without)")
    p.add_argument("--admission-max-wait-steps", type=int, default=None, metavar="S",
                   help="admit anyway after S decode steps of waiting (default "
                        f"{DEFAULT_ADMISSION_MAX_WAIT_STEPS})")


def add_mixed_prefill_flag(p) -> None:
    """--mixed-prefill / --no-mixed-prefill (LLM(mixed_prefill=...)), for serve, bench and load_profile."""
    p.add_argument("--mixed-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="let a step carry new prompts' prefill chunks beside the running requests' decode rows, as "
                        "vLLM does (long prompts are chunked to the step's token budget either way). Default: on "
                        "where steps run eagerly (CPU, no CUDA graphs), off where decode steps replay CUDA graphs: "
                        "a step then prefills or decodes, new prompts first (as SGLang without "
                        "--enable-mixed-chunk), so the decode steps keep their graphs. Same tokens in fp32; in bf16 "
                        "a different batch can flip a near-tie")


# LLM keyword -> flag dest, for flags only some subcommands have (serve has them all)
_OPTIONAL = ("kv_block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "mixed_prefill",
             "admission_batch_ratio", "admission_max_wait_steps")


def resolve_draft_from_args(args):
    """`--draft` / `--no-draft` (add_draft_flags) resolved for `--model` on `--device`: a drafter
    folder, or None for plain decoding (blockdraft.drafters.resolve_draft). Where "auto" decodes
    plainly because the drafter measured slower here, "auto" itself: `LLM` resolves it again and
    logs why after checking the other flags, so that a bad flag's error is not preceded by it.

    Raises:
        ValueError / FileNotFoundError: as check_draft_flags and resolve_draft (a flag that needs a
            drafter without one, a missing folder, a shipped drafter that does not exist).
    """
    from blockdraft.drafters import AUTO, check_draft_flags, resolve_draft
    from blockdraft.preflight import resolve_device

    check_draft_flags(args.draft, args.no_draft, args.num_speculative_tokens, args.draft_vocab_size,
                      args.speculative_disable_by_batch_size)
    notes: list[str] = []
    draft = resolve_draft(args.draft, args.model, args.no_draft, args.cache_dir, args.num_speculative_tokens,
                          resolve_device(args.device), args.draft_vocab_size, notes=notes)
    return AUTO if notes else draft


def llm_from_args(args, draft, max_logprobs: int):
    """The LLM that a subcommand's flags describe: --model, the draft flags (with `draft` from
    resolve_draft_from_args), --dtype, --cache-dir, the device, async-scheduling, prefix-caching
    and --max-model-len flags, --generation-config and --seed where the subcommand has them (serve;
    else "vllm": no model sampling defaults, and no engine seed), and those of _OPTIONAL the subcommand has (else LLM's
    defaults).

    Raises:
        ValueError / FileNotFoundError: whatever LLM raises for the values (each names its flag).
    """
    from blockdraft.llm import LLM

    optional = {name: getattr(args, name) for name in _OPTIONAL if hasattr(args, name)}
    return LLM(
        model=args.model,
        draft=draft,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_vocab_size=args.draft_vocab_size,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_fp32_lm_head=args.enable_fp32_lm_head,
        batch_invariant=args.batch_invariant,
        max_model_len=args.max_model_len,
        max_logprobs=max_logprobs,
        # serve's --generation-config; generate's sampling flags all have defaults of their own, which
        # the model's would never replace: its file is not read there
        generation_config=getattr(args, "generation_config", "vllm"),
        # serve's --seed (vLLM's engine seed, default 0); generate's --seed seeds its one request, and
        # left out that request samples from fresh randomness, as its help says
        seed=getattr(args, "engine_seed", None),
        # nothing to disable when --draft auto decodes plainly
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size if draft is not None else None,
        **optional,
    )
