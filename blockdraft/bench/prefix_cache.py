"""Prefix caching on a shared system prompt: time to first token and latency, cache off vs on.

Requests to a chat service often share a long system prompt. With `enable_prefix_caching` the
engine computes its KV pages (target and drafter) once and later requests start from them. One
process loads the target once; two engines share it (`LLM(target=...)`), prefix caching off and
on, each with its own KV pool. Each engine first answers a warm-up question (with caching on this
fills the cache), then every question is answered by both engines, one request at a time, the
engine going first alternating so machine drift lands on both. Each question is asked once per
engine: asked again, the caching engine would also reuse the question's own pages. Prints a
table (median time to first token and latency over the questions, cached tokens) and checks every
answer is the same token for token with and without the cache.

    python -m blockdraft.bench.prefix_cache --model qwen2.5-coder-0.5b-instruct --system-tokens 512 \\
        --max-tokens 16 --json prefix-cache.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

OFF, ON = "prefix caching off", "prefix caching on"
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
    """Run the comparison; exit status 1 if an answer differed with the cache on."""
    from blockdraft.drafters import resolve_draft
    from blockdraft.llm import LLM, load_target
    from blockdraft.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalog name or model folder")
    p.add_argument("--draft", default="auto",
                   help="drafter folder, 'shipped' or 'auto' (default: the shipped one, if any)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding")
    p.add_argument("--system-tokens", type=int, default=512,
                   help="length of the shared system prompt in tokens (default 512)")
    p.add_argument("--num-questions", type=int, default=len(QUESTIONS) - 1,
                   help=f"questions timed after the warm-up, 1..{len(QUESTIONS) - 1} (default all)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per answer (default 16)")
    p.add_argument("--dtype", default="auto", help="weights/KV dtype (default auto: the checkpoint's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    p.add_argument("--json", default=None, metavar="PATH", help="write the table and every request's times here")
    p.add_argument("--cache-dir", default=None,
                   help="model cache (default $BLOCKDRAFT_CACHE, else ~/.cache/blockdraft)")
    args = p.parse_args(argv)
    if not 1 <= args.num_questions <= len(QUESTIONS) - 1:
        p.error(f"--num-questions must be in [1, {len(QUESTIONS) - 1}], got {args.num_questions}")
    if args.system_tokens < 1 or args.max_tokens < 1:
        p.error(f"--system-tokens and --max-tokens must be >= 1, got {args.system_tokens} and {args.max_tokens}")

    draft = None if args.no_draft else resolve_draft(args.draft, args.model, cache_dir=args.cache_dir)
    target = load_target(args.model, args.dtype, device=args.device, cache_dir=args.cache_dir)
    system = system_prompt(target.tokenizer, args.system_tokens)
    pool = dict(num_kv_blocks=512, kv_block_size=16)  # 8192 tokens: the system prompt many times over
    engines = {name: LLM(target=target, draft=draft, enable_prefix_caching=(name == ON), **pool)
               for name in (OFF, ON)}
    params = SamplingParams(max_tokens=args.max_tokens)

    def chat(question: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    for llm in engines.values():
        llm.generate(chat(QUESTIONS[0]), params)
    outputs: dict[str, list] = {OFF: [], ON: []}
    for i, question in enumerate(QUESTIONS[1 : 1 + args.num_questions]):
        order = (OFF, ON) if i % 2 == 0 else (ON, OFF)
        for name in order:
            out = engines[name].generate(chat(question), params)[0]
            outputs[name].append(out)
            print(f"  question {i + 1}: {name}: ttft {out.ttft_s * 1e3:.0f} ms, latency {out.latency_s:.2f} s",
                  file=sys.stderr, flush=True)
    result = summarize(outputs)
    stats = engines[ON].engine.scheduler.kv.stats
    prompt_tokens = len(outputs[ON][0].prompt_token_ids)
    print(f"{args.model} ({target.dtype}), drafter {draft}, system prompt {args.system_tokens}+ tokens "
          f"(prompts ~{prompt_tokens} tokens), {args.num_questions} questions x {args.max_tokens} tokens, batch 1")
    print("| engine | median time to first token (ms) | median latency (s) |")
    print("|---|---|---|")
    for name, row in result["engines"].items():
        print(f"| {name} | {row['median_ttft_s'] * 1e3:.0f} | {row['median_latency_s']:.2f} |")
    print(f"cache on / off: time to first token {result['ttft_speedup']:.2f}x faster, latency "
          f"{result['latency_speedup']:.2f}x; prefix cache hits {stats.hits} of {stats.queries} prompt tokens "
          f"looked up; identical answers: {result['identical']}")
    if args.json:
        doc = {
            "measured": datetime.date.today().isoformat(),
            "command": "python -m blockdraft.bench.prefix_cache "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {__import__('torch').get_num_threads()} threads",
            "model": args.model, "draft": draft, "dtype": str(target.dtype).replace("torch.", ""),
            "prompt_tokens": prompt_tokens, "max_tokens": args.max_tokens,
            "prefix_cache_hits": stats.hits, "prefix_cache_queries": stats.queries, **result,
            "requests": {name: [{"ttft_s": o.ttft_s, "latency_s": o.latency_s} for o in outs]
                         for name, outs in outputs.items()},
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
