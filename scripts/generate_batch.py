"""Greedy DFlash decoding of many HumanEval prompts through `LLM.generate` (at most
--max-num-seqs in flight), with the draft block's width and the CUDA-graph mode chosen: the
smallest program that runs the engine's padded graph buckets (buckets shrink as requests finish).

Session 24 used it on the H200 to find an illegal memory access with whole draft blocks: the
graph mode `eager` runs the graph code without capturing it, so CUDA_LAUNCH_BLOCKING=1 names the
failing kernel in a Python traceback (docs/benchmarks/gpu.md "Session 24"):

    CUDA_LAUNCH_BLOCKING=1 python scripts/generate_batch.py --k 7 --block whole --graph-mode eager

Prints the block width, the tokens generated, the accepted drafts and the wall time; exits 3 when
generation raises (the traceback is printed). The dtype is LLM's default (bf16 on CUDA).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, run the batch -> exit code (0 ok, 2 bad flags, 3 generation raised)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalog name with a shipped drafter "
                   "(default %(default)s)")
    p.add_argument("--k", type=int, default=7, help="drafts per step, K (default 7)")
    p.add_argument("--block", choices=["whole", "cut"], default="whole",
                   help="draft block of the drafter's trained width B (whole, the default) or of K + 1 rows (cut)")
    p.add_argument("--graph-mode", choices=["capture", "eager", "off"], default=None,
                   help="capture: CUDA graphs; eager: the same padded graph code run eagerly (Triton kernels); "
                        "both need CUDA. off: no graph code (enforce_eager). Default: capture on CUDA, off on the CPU")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto (default): cuda when torch sees a GPU")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft vocabulary size N (0: full); default: the size the drafter records")
    p.add_argument("--num-prompts", type=int, default=128,
                   help="HumanEval prompts, cycled past the dataset's 164 (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests in flight at most (default %(default)s)")
    args = p.parse_args(argv)

    import torch

    from blockdraft.llm import LLM
    from blockdraft.sampling_params import SamplingParams
    from blockdraft.spec.dflash import speculator as spec_module
    from blockdraft.training.corpora import eval_prompts

    init = spec_module.DFlashSpeculator.__init__

    def init_with_width(self, *a, **kw):  # LLM builds the speculator itself: set the block width there
        kw["full_block"] = args.block == "whole"
        init(self, *a, **kw)

    spec_module.DFlashSpeculator.__init__ = init_with_width
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    mode = args.graph_mode or ("capture" if device == "cuda" else "off")
    if mode != "off" and device != "cuda":
        p.error(f"--graph-mode {mode} needs CUDA (device {device}); use --graph-mode off")
    opts = {"capture": {}, "eager": {"graph_mode": "eager", "attention_backend": "triton"},
            "off": {"enforce_eager": True}}[mode]  # fmt: skip
    llm = LLM(model=args.model, draft="shipped", draft_vocab_size=args.draft_vocab_size, num_speculative_tokens=args.k,
              device=device, max_num_seqs=args.max_num_seqs, **opts)
    print("draft block rows", llm.engine.runner.speculator.num_block_tokens, "graph mode", mode, flush=True)
    texts = eval_prompts("humaneval", None)
    prompts = [llm.encode_chat([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(args.num_prompts)]
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:
        traceback.print_exc()
        return 3
    print("ok", sum(len(o.token_ids) for o in outs), "tokens,", llm.engine.stats.spec.num_accepted_tokens,
          "accepted drafts,", f"{time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
