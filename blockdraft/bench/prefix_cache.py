"""Prefix caching on a shared system prompt: time to first token and latency, cache off vs on.

Requests to a chat service often share a long system prompt. With `enable_prefix_caching` the
engine computes its KV pages (target and drafter) once and later requests start from them. One
process loads the target once; two engines share it (`LLM(target=...)`), prefix caching off and
on, each with its own KV pool. Warm-up rounds (`--warmup-rounds`) first run the timed round's
requests untimed, then the cache is emptied (`LLM.reset_prefix_cache`): every shape has run once,
so JIT compiles (Triton on the GPU: ~0.9 s for a first cache-hit prefill shape) stay out of the
timings. In the timed round each engine first answers a warm-up question (with caching on this
fills the cache), then every question is answered by both engines, one request at a time, the
engine going first alternating so machine drift lands on both. Each question is asked once per
engine: asked again, the caching engine would also reuse the question's own pages. Prints a
table (median time to first token and latency over the questions, cached tokens) and checks every
answer is the same token for token with and without the cache; where one differs, it reports the
top-2 logit gap at the first differing token (bf16 may flip near-ties).

    python -m blockdraft.bench.prefix_cache --model qwen2.5-coder-0.5b-instruct --system-tokens 512 \\
        --max-tokens 16 --json prefix-cache.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path

OFF, ON = "prefix caching off", "prefix caching on"
# bf16 answers may differ at a near-tie (issue 5's rule: top-2 logit gap below this at the first
# divergent token); a larger gap is an error.
NEAR_TIE = 1e-2
# Filler for the system prompt: generic assistant guidelines, repeated to --system-tokens.
GUIDELINES = (
    "You are a careful programming assistant. Answer with correct, idiomatic code and a short "
    "explanation. Prefer the standard library, name things clearly, handle edge cases, and say "
    "when a question is ambiguous instead of guessing. "
)
QUESTIONS = [
    "Write a Python function that reverses a string.",  # the warm-up
    "Write a Python function that checks whether a number is prime.",
    "How do I read a CSV file with the csv module?",
    "Write a function that returns the n-th Fibonacci number.",
    "What is the difference between a list and a tuple?",
    "Write a function that merges two sorted lists.",
    "How do I count word frequencies in a text?",
]


def system_prompt(tokenizer, num_tokens: int) -> str:
    """GUIDELINES repeated until the text is at least `num_tokens` tokens long (>= 1)."""
    text = GUIDELINES
    while len(tokenizer.encode(text)) < num_tokens:
        text += GUIDELINES
    return text


def summarize(outputs: dict[str, list]) -> dict:
    """Medians over the questions (seconds) per engine, the cache's saving as ratios, and whether
    every answer matched. `outputs[engine]` is a list of RequestOutput, one per question."""
    rows = {}
    for name, outs in outputs.items():
        rows[name] = {
            "median_ttft_s": statistics.median(o.ttft_s for o in outs),
            "median_latency_s": statistics.median(o.latency_s for o in outs),
        }
    return {
        "engines": rows,
        "ttft_speedup": rows[OFF]["median_ttft_s"] / rows[ON]["median_ttft_s"],
        "latency_speedup": rows[OFF]["median_latency_s"] / rows[ON]["median_latency_s"],
        "identical": all(a.token_ids == b.token_ids for a, b in zip(outputs[OFF], outputs[ON])),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; exit status 1 if an answer differed with the cache on at a token that
    was not a near-tie (bf16 may flip those, see `divergences`). Bad flags, and a --json path that
    cannot be written, are usage errors (exit 2) before any model loads; a bad model or drafter
    (the library's ValueError / FileNotFoundError) is one `error:` line on stderr, exit 2."""
    from blockdraft.cpu_threads import add_threads_flag, apply_threads_flag
    from blockdraft.errors import flag_message, refuse_unwritable
    from blockdraft.preflight import DTYPE_CHOICES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalog name or model folder (default %(default)s)")
    p.add_argument("--draft", default="auto",
                   help="drafter folder, 'shipped' or 'auto' (default: the shipped one, if any)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding")
    p.add_argument("--system-tokens", type=int, default=512,
                   help="length of the shared system prompt in tokens (default 512)")
    p.add_argument("--num-questions", type=int, default=len(QUESTIONS) - 1,
                   help=f"questions timed after the warm-up, 1..{len(QUESTIONS) - 1} (default all)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per answer (default 16)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights/KV dtype (default auto: the checkpoint's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="untimed rounds of the same requests first (the cache emptied after them), so that "
                        "JIT compiles of each shape stay out of the timings (0..8, default %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the table and every request's times here")
    p.add_argument("--cache-dir", default=None,
                   help="model cache (default $BLOCKDRAFT_CACHE, else ~/.cache/blockdraft)")
    add_threads_flag(p)
    args = p.parse_args(argv)
    if not 1 <= args.num_questions <= len(QUESTIONS) - 1:
        p.error(f"--num-questions must be in [1, {len(QUESTIONS) - 1}], got {args.num_questions}")
    if not 0 <= args.warmup_rounds <= 8:
        p.error(f"--warmup-rounds must be in [0, 8], got {args.warmup_rounds}")
    if args.system_tokens < 1 or args.max_tokens < 1:
        p.error(f"--system-tokens and --max-tokens must be >= 1, got {args.system_tokens} and {args.max_tokens}")
    refuse_unwritable(p, "--json", args.json)  # now, not after the whole measurement
    apply_threads_flag(p, args.threads)  # before the target loads, after the flag errors (no notice before them)
    try:
        return _measure(args, argv)
    except (ValueError, FileNotFoundError) as e:  # a bad --model / --draft: one line, no traceback
        print(f"error: {flag_message(e, p._option_string_actions)}", file=sys.stderr)
        return 2


def _measure(args, argv: list[str] | None) -> int:
    """main's body after the flags are checked: load, run the rounds, print, write --json."""
    from blockdraft.drafters import resolve_draft
    from blockdraft.llm import LLM
    from blockdraft.model_loader import load_target
    from blockdraft.sampling_params import SamplingParams

    draft = None if args.no_draft else resolve_draft(args.draft, args.model, cache_dir=args.cache_dir,
                                                               device_type=args.device)
    target = load_target(args.model, args.dtype, device=args.device, cache_dir=args.cache_dir)
    pool = dict(num_kv_blocks=512, kv_block_size=16)  # 8192 tokens: the system prompt many times over
    engines = {name: LLM(target=target, draft=draft, device=args.device, enable_prefix_caching=(name == ON), **pool)
               for name in (OFF, ON)}
    params = SamplingParams(max_tokens=args.max_tokens)

    system = system_prompt(target.tokenizer, args.system_tokens)
    stats = engines[ON].engine.scheduler.kv.stats
    for _ in range(args.warmup_rounds):
        _round(engines, system, args.num_questions, params, timed=False)
        if not engines[ON].reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: a request still holds pages")
    hits0, queries0 = stats.hits, stats.queries  # the table counts the timed round's lookups only
    outputs = _round(engines, system, args.num_questions, params, timed=True)
    hits, queries = stats.hits - hits0, stats.queries - queries0
    result = summarize(outputs)
    result["divergences"] = divergences(engines[OFF], system, outputs, params)
    prompt_tokens = len(outputs[ON][0].prompt_token_ids)
    print(f"{args.model} ({target.dtype}), drafter {draft}, system prompt {args.system_tokens}+ tokens "
          f"(prompts ~{prompt_tokens} tokens), {args.num_questions} questions x {args.max_tokens} tokens, batch 1")
    print("| engine | median time to first token (ms) | median latency (s) |")
    print("|---|---|---|")
    for name, row in result["engines"].items():
        print(f"| {name} | {row['median_ttft_s'] * 1e3:.0f} | {row['median_latency_s']:.2f} |")
    print(f"cache on / off: time to first token {result['ttft_speedup']:.2f}x faster, latency "
          f"{result['latency_speedup']:.2f}x; prefix cache hits {hits} of {queries} prompt tokens "
          f"looked up; identical answers: {result['identical']}")
    for d in result["divergences"]:
        print(f"  question {d['question']}: first differs at output token {d['index']} ({d['off_token']} -> "
              f"{d['on_token']}), top-2 logit gap there {d['top2_gap']:.4f}: "
              f"{'a near-tie' if d['near_tie'] else 'NOT a near-tie'} (< {NEAR_TIE})")
    if args.json:
        doc = {
            "measured": datetime.date.today().isoformat(),
            "command": "python -m blockdraft.bench.prefix_cache "
            + shlex.join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {__import__('torch').get_num_threads()} threads",
            "model": args.model, "draft": draft, "dtype": str(target.dtype).replace("torch.", ""),
            "prompt_tokens": prompt_tokens, "max_tokens": args.max_tokens,
            "prefix_cache_hits": hits, "prefix_cache_queries": queries, "warmup_rounds": args.warmup_rounds, **result,
            "requests": {name: [{"ttft_s": o.ttft_s, "latency_s": o.latency_s} for o in outs]
                         for name, outs in outputs.items()},
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if all(d["near_tie"] for d in result["divergences"]) else 1


def divergences(reference, system: str, outputs: dict[str, list], params) -> list[dict]:
    """Where each cache-on answer first differs from the cache-off one, and whether that token was
    a near-tie: the question is asked the cache-off engine (`reference`) again with logprobs, whose
    top-2 gap (logprob difference = logit difference) at that position is reported. Asking for
    logprobs turns async scheduling off, not the math: the tokens must come out the same, else
    the gap is not comparable (ValueError)."""
    found = []
    for i, (off, on) in enumerate(zip(outputs[OFF], outputs[ON])):
        if off.token_ids == on.token_ids:
            continue
        k = next((j for j, (a, b) in enumerate(zip(off.token_ids, on.token_ids)) if a != b),
                 min(len(off.token_ids), len(on.token_ids)))
        again = reference.generate(_chat(system, QUESTIONS[1 + i]), replace(params, logprobs=2))[0]
        if again.token_ids != off.token_ids:
            raise ValueError(f"question {i + 1}: the cache-off answer changed when asked with logprobs")
        top = again.logprobs[k]["top"] if k < len(again.logprobs) else []
        gap = top[0][1] - top[1][1] if len(top) >= 2 else float("inf")
        found.append({"question": i + 1, "index": k, "off_token": _at(off.token_ids, k),
                      "on_token": _at(on.token_ids, k), "top2_gap": gap, "near_tie": gap < NEAR_TIE})
    return found


def _at(ids: list[int], k: int):
    return ids[k] if k < len(ids) else None  # None: that answer ended here


def _chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _round(engines: dict, system: str, num_questions: int, params, timed: bool) -> dict[str, list]:
    """Warm-up question, then questions 1..num_questions on both engines under `system`; returns
    each engine's RequestOutputs of the questions (their times are printed when `timed`)."""
    for llm in engines.values():
        llm.generate(_chat(system, QUESTIONS[0]), params)
    outputs: dict[str, list] = {OFF: [], ON: []}
    for i, question in enumerate(QUESTIONS[1 : 1 + num_questions]):
        order = (OFF, ON) if i % 2 == 0 else (ON, OFF)
        for name in order:
            out = engines[name].generate(_chat(system, question), params)[0]
            outputs[name].append(out)
            if timed:
                print(f"  question {i + 1}: {name}: ttft {out.ttft_s * 1e3:.0f} ms, latency {out.latency_s:.2f} s",
                      file=sys.stderr, flush=True)
    return outputs


if __name__ == "__main__":
    sys.exit(main())
