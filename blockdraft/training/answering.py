"""The target's answers for a GPU run (training/gpu_run.py): which prompts, in which order, from
which generator, within a time budget.

- `answer`: answers to a list of prompts from transformers `generate` or our engine (`--gen-engine`).
- `extend`: the next data shard: prompts not answered yet, then (--synth-samples) prompts the target
  writes itself (synth.py), then (--resample) sampled re-answers of earlier prompts.
- `answer_engine` / `release_gpu`: the engine for answering, sized so the GPU stays free for the
  feature cache and training that follow, and giving its memory back.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

import torch

from blockdraft.training.generate import sampling_plan


def log(msg: str) -> None:
    """One time-stamped progress line on stderr (the GPU run's log)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def extend(hf, llm, data, prompts: list[list[int]], args, info: dict, eos, pad, data_dir: Path):
    """Answer, for at most --extend-seconds, in this order: the prompts `data` holds no answer to
    yet; with --synth-samples, prompts the target writes itself (synth.py); with --resample, every
    prompt answered so far again, sampled, those with the fewest answers first (resample_queue).
    Saves the answers as the next shard of `data_dir` and returns them (None when there was
    nothing to answer).

    hf: the transformers target (answers when `llm` is None); llm: our engine (`answer_engine`) or
    None; data: the TokenDataset so far; prompts: the prep's training prompts (token ids); args:
    gpu_run's `run` arguments; info / eos / pad: the prep's metadata, EOS ids and pad id."""
    shard = len(list(data_dir.glob("data-*.safetensors")))
    seed = args.seed + 1000 * shard
    deadline = time.time() + args.extend_seconds
    answers = collections.Counter(answered_prompts(data))
    fresh = [p for p in prompts if tuple(p) not in answers]
    synth, synth_stats = [], None
    if args.synth_samples:
        synth, synth_stats = synthesize(llm, args, seed, min(deadline, time.time() + args.synth_seconds))
    again = resample_queue(answers) if args.resample else []
    queue = fresh + synth + again
    if not queue:
        return None
    sampled = sampling_plan(len(fresh) + len(synth), args.sampled_fraction, seed) + [True] * len(again)
    log(f"extending the data -> shard {shard}: {len(fresh)} prompts not answered yet, {len(synth)} synthesized, "
         f"{len(again)} answered again (sampled), until {args.extend_seconds:.0f} s have passed")
    more = answer(hf, llm, queue, sampled, args, info, eos, pad, seed, deadline - time.time())
    more.info.update(queued={"fresh": len(fresh), "synthesized": len(synth), "resampled": len(again)})
    if synth_stats is not None:
        more.info["synthesized_prompts"] = synth_stats
    more.save(data_dir, shard=shard)
    return more


def synthesize(llm, args, seed: int, deadline: float) -> tuple[list[list[int]], dict]:
    """--synth-samples user requests written by the target (synth.py), chat-encoded; and their stats."""
    from blockdraft.training import corpora
    from blockdraft.training.generate import encode_prompts
    from blockdraft.training.synth import GENERAL_OPENERS, synthesize_prompts

    t0 = time.time()
    openers = GENERAL_OPENERS if args.synth_openers == "general" else ("",)
    texts, stats = synthesize_prompts(llm, args.synth_samples, corpora.all_eval_texts(), seed=seed,
                                      max_tokens=args.synth_max_tokens, deadline=deadline, progress=True,
                                      openers=openers)
    stats["openers"] = len(openers)
    ids, _ = encode_prompts(llm.tokenizer, texts, args.max_prompt_tokens)
    stats.update(encoded=len(ids), seconds=round(time.time() - t0, 1))
    log(f"synthesized prompts: {json.dumps(stats)}")
    return ids, stats


def answer_engine(args, prompts: list[list[int]]):
    """Our engine on the target (--gguf) for answering: --gen-max-seqs requests at once, a KV pool
    sized for that many of the longest prompt + --max-new-tokens (a fixed size, so the GPU's
    memory stays free for the rest of the run)."""
    import math

    from blockdraft.llm import LLM

    page = 16
    longest = max([len(p) for p in prompts] + [args.max_prompt_tokens])
    pages = args.gen_max_seqs * math.ceil((longest + args.max_new_tokens + 1) / page)
    t0 = time.time()
    llm = LLM(args.gguf, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
              kv_block_size=page, num_kv_blocks=pages, max_num_seqs=args.gen_max_seqs,
              max_num_batched_tokens=max(4096, longest + 1))
    log(f"engine for answering: {args.gen_max_seqs} requests at once, {pages} KV pages ({time.time() - t0:.0f} s)")
    return llm


def release_gpu() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        log(f"engine released: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")


def answer(hf, llm, prompts: list[list[int]], sampled: list[bool], args, info: dict, eos, pad, seed: int,
            seconds: float):
    """The target's answers to `prompts` (those flagged in `sampled` at T = 0.7) as a TokenDataset,
    from our engine (`llm`, when --gen-engine) or transformers `generate`, for at most `seconds`
    (prompts left unanswered are dropped)."""
    from blockdraft.training.generate import generate_with_engine, generate_with_hf, to_dataset

    t0 = time.time()
    if llm is not None:
        responses = generate_with_engine(llm, prompts, args.max_new_tokens, sampled, temperature=0.7, seed=seed,
                                         progress=True, deadline=t0 + seconds)
        generator = "blockdraft engine " + ("bf16" if args.device == "cuda" else "fp32")
    else:
        responses = generate_with_hf(hf, prompts, args.max_new_tokens, sampled, eos, pad, temperature=0.7, seed=seed,
                                     batch_size=args.gen_batch, progress=True, deadline=t0 + seconds)
        generator = "transformers.generate bf16"
    seconds_used = time.time() - t0
    gen_info = {"target": info["target"], "generator": generator, "max_new_tokens": args.max_new_tokens,
                "sampled_temperature": 0.7, "sampled_fraction": round(sum(sampled) / max(1, len(sampled)), 4),
                "seed": seed, "prompt_stats": info["stats"], "gen_seconds": round(seconds_used, 1)}
    data = to_dataset(prompts, responses, sampled, gen_info)
    log(f"answered {len(data)} of {len(prompts)} prompts, {data.info['num_response_tokens']} response tokens "
         f"in {seconds_used:.0f} s ({data.info['num_response_tokens'] / max(seconds_used, 1e-9):.0f} tokens/s)")
    return data


def resample_queue(answers: collections.Counter) -> list[list[int]]:
    """Every prompt answered so far (prep, later-turn and synthesized alike) for --resample: fewest
    answers first, ties in the order first answered (Counter keeps insertion order; sorted is stable).

    Session 8 found new in-domain prompts (synthesized) worth more than more steps, so their
    sampled re-answers are queued too, not only the prep's prompts'."""
    return [list(p) for p in sorted(answers, key=answers.__getitem__)]


def answered_prompts(data) -> list[tuple[int, ...]]:
    """The prompt token ids of each sequence of a TokenDataset, in order (one per answer)."""
    return [tuple(data.sequence(i)[0][: _prompt_len(data, i)].tolist()) for i in range(len(data))]


def _prompt_len(data, i: int) -> int:
    """Tokens before sequence i's first response token (its prompt)."""
    mask = data.sequence(i)[1]
    return int(mask.int().argmax()) if bool(mask.any()) else mask.numel()
