"""The draft block at full width vs cut to K + 1 rows, side by side on the CPU (gpu.md "Session 23").

One process, one loaded target; three engines: plain decoding, DFlash drafting the drafter's whole
trained block (B rows, the default: on the CPU since session 23, on CUDA since 24) and DFlash drafting a block cut to K + 1
rows (what every engine drafted before); the three `blockdraft demo` prompts, interleaved
(blockdraft.side_by_side), medians over --repeats. Prints acceptance length, tok/s and the speedup
over plain for both widths, and writes them as JSON with --json.

    PYTHONPATH=. python scripts/compare_block_width.py --k 4 --max-tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import sys

from blockdraft.bench.spec_k import k_table
from blockdraft.demo import DEMO_PROMPTS
from blockdraft.drafters import SHIPPED, resolve_draft
from blockdraft.llm import LLM, load_target
from blockdraft.preflight import preflight
from blockdraft.sampling_params import SamplingParams
from blockdraft.side_by_side import compare_engines
from blockdraft.spec.dflash.speculator import DFlashSpeculator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--k", type=int, default=4, help="drafts per step K (default 4)")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default: the drafter's recorded one")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the table here")
    args = p.parse_args(argv)
    draft = resolve_draft(SHIPPED, args.model)
    pool = dict(num_kv_blocks=128, kv_block_size=16)
    pre = preflight(args.model, draft, args.k, "auto", draft_vocab_size=args.draft_vocab_size, **pool)
    target = load_target(args.model)
    engines = {"plain": LLM(target=target, **pool)}
    # the drafter and draft vocabulary LLM(draft=...) builds, loaded once; each engine its own width and KV
    built = LLM(target=target, draft=draft, num_speculative_tokens=args.k, draft_vocab_size=pre.draft_vocab_size,
                **pool).speculator
    for label, full in (("full", True), ("cut", False)):
        spec = DFlashSpeculator(built.drafter, target.model, args.k, pool["num_kv_blocks"], pool["kv_block_size"],
                                built.draft_head, full_block=full)
        engines[label] = LLM(target=target, speculator=spec, **pool)
    prompts = [[{"role": "user", "content": t}] for t in DEMO_PROMPTS]
    runs = compare_engines(engines, prompts, SamplingParams(max_tokens=args.max_tokens), args.repeats)
    rows = []
    for label in ("full", "cut"):
        row = k_table({"plain": runs["plain"], f"K={args.k}": runs[label]}, [args.k])[0]
        row["draft_vocab_size"] = pre.draft_vocab_size
        rows.append({"block": label, "block_rows": engines[label].speculator.num_block_tokens, **row})
    print(f"{args.model}, K = {args.k}, draft vocabulary {pre.draft_vocab_size or 'full'}, {len(prompts)} prompts x "
          f"{args.max_tokens} tokens, medians of {args.repeats}")
    print("| block | rows | acceptance length | tok/s | speedup vs plain (wall) | speedup (CPU time) | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['block']} | {r['block_rows']} | {r['acceptance_length']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['cpu_speedup']:.2f}x | {r['identical']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "k": args.k, "max_tokens": args.max_tokens, "repeats": args.repeats,
                       "rows": rows}, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
