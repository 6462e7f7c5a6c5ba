"""Per-step host cost of vLLM's allowed_token_ids / bad_words masks: RequestTokenMask.fill.

The engine builds a request's masks on the host every step (runner.input_batch._sampling_mask):
its 1 + K logits rows, row i banning what the bad words ban after the output and drafts[:i]. This
times that call alone, on the CPU, for one request, in microseconds per request-step (the mean
over `--steps` consecutive steps, the median of `--repeats` such runs):

  K: drafts per step (0: plain decoding, one row).
  words: multi-token bad words (2-4 random token ids each; one-token words cost nothing per step).
  allowed: allowed_token_ids (a random subset of that many ids), or none.
  bans/row: the tokens a row's bad words ban, on average (bits cleared beyond the static row),
      so the table shows the workload bans something: the output and drafts are random tokens
      with a random word's prefix spliced in 20% of the time.

It is a benchmark, not a test:

    python -m blockdraft.bench.token_mask [--out token_mask.json] [--repeats 7] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from blockdraft.errors import refuse_unwritable
from blockdraft.sample.bitmask import bitmask_words
from blockdraft.sample.token_mask import RequestTokenMask

VOCAB = 151936  # Qwen2.5 / Qwen3 logits width
OUTPUT_LEN = 64  # output tokens a step passes (fill reads only the last few)


def make_case(rng: random.Random, vocab: int, words: int, allowed: int | None, k: int,
              steps: int) -> tuple[RequestTokenMask, list[tuple[list[int], list[int]]]]:
    """A request's mask and `steps` consecutive steps' (output tokens, K drafts) for it."""
    bad = [[rng.randrange(vocab) for _ in range(rng.randint(2, 4))] for _ in range(words)]
    mask = RequestTokenMask(vocab, rng.sample(range(vocab), allowed) if allowed else None, bad)
    stream: list[int] = []
    while len(stream) < OUTPUT_LEN + steps + k:
        if bad and rng.random() < 0.2:
            stream += rng.choice(bad)[:-1]  # a word's prefix: the next row bans its last token
        else:
            stream.append(rng.randrange(vocab))
    return mask, [(stream[s:s + OUTPUT_LEN], stream[s + OUTPUT_LEN:s + OUTPUT_LEN + k]) for s in range(steps)]


def _popcount(x: torch.Tensor) -> int:
    """Set bits in an int32 tensor."""
    return int(((x.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).sum())


def measure(vocab: int, words: int, allowed: int | None, k: int, steps: int, repeats: int, seed: int = 0) -> dict:
    """One case: fill's microseconds per request-step (median of `repeats`) and its bans per row."""
    mask, inputs = make_case(random.Random(seed), vocab, words, allowed, k, steps)
    out = torch.empty((k + 1, bitmask_words(vocab)), dtype=torch.int32)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for output, drafts in inputs:
            mask.fill(out, output, drafts)
        runs.append((time.perf_counter_ns() - t0) / 1e3 / steps)
    static = _popcount(mask.static_row)
    banned = 0
    for output, drafts in inputs:
        mask.fill(out, output, drafts)
        banned += static * (k + 1) - _popcount(out)
    return {"k": k, "words": words, "allowed": allowed, "vocab": vocab, "steps": steps, "repeats": repeats,
            "fill_us": statistics.median(runs), "fill_us_runs": runs, "bans_per_row": banned / (steps * (k + 1))}


def run(ks: list[int], words: list[int], allowed: list[int | None], vocab: int, steps: int, repeats: int) -> list[dict]:
    """Every case, K outermost."""
    return [measure(vocab, w, a, k, steps, repeats) for k in ks for a in allowed for w in words]


def format_table(rows: list[dict]) -> str:
    """K, words, allowed ids, fill us per request-step, bans per row."""
    lines = [f"{'K':>3}{'words':>7}{'allowed':>9}{'fill us':>10}{'bans/row':>10}"]
    for r in rows:
        lines.append(f"{r['k']:>3}{r['words']:>7}{r['allowed'] or '-':>9}{r['fill_us']:>10.1f}{r['bans_per_row']:>10.2f}")
    return "\n".join(lines)


def _allowed_arg(s: str) -> int | None:
    return None if s.lower() == "none" else int(s)


def main(argv: list[str] | None = None) -> int:
    """`python -m blockdraft.bench.token_mask`: print the table, write JSON with --out; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m blockdraft.bench.token_mask", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("-k", "--num-speculative-tokens", type=int, nargs="+", default=[0, 5, 15])
    p.add_argument("--words", type=int, nargs="+", default=[0, 20, 200, 2000], help="multi-token bad words")
    p.add_argument("--allowed", type=_allowed_arg, nargs="+", default=[None, 49152],
                   help="allowed_token_ids sizes ('none': no allowed_token_ids)")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps op overhead steady)")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    for flag, values in (("-k", args.num_speculative_tokens), ("--words", args.words)):
        bad = [v for v in values if v < 0]
        if bad:
            p.error(f"{flag} values must be >= 0, got {bad[0]}")
    if args.vocab < 1:
        p.error(f"--vocab must be >= 1, got {args.vocab}")
    bad = [a for a in args.allowed if a is not None and not 0 < a <= args.vocab]
    if bad:
        p.error(f"--allowed sizes must lie in [1, --vocab {args.vocab}] (or 'none'), got {bad[0]}")
    for flag, value in (("--steps", args.steps), ("--repeats", args.repeats), ("--threads", args.threads)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    refuse_unwritable(p, "--out", args.out)  # before the run, not when writing its result
    torch.set_num_threads(args.threads)
    rows = run(args.num_speculative_tokens, args.words, args.allowed, args.vocab, args.steps, args.repeats)
    print(format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
