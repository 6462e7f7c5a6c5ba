"""Side-by-side offline acceptance of drafter folders on a run's eval sequences (no engine run).

`python -m blockdraft.training.gpu_run run` saves the target's answers to the eval prompts
(`<work>/eval_sequences.safetensors`: HumanEval and MT-bench first turns, T = 0 and T = 1) and
scores its own drafters on them. This command scores any drafter folders on the same answers in
one process, so drafters of different runs (or their weight average) are compared on identical
sequences, which a new run's own eval cannot do for drafters it did not train. The acceptance
length is the engine's greedy walk replayed over drafts made at every position
(`training.acceptance.offline_acceptance`, B = the drafter's block size, K = B - 1).

    python -m blockdraft.training.replay --gguf G --prep PREP --eval-sequences E \\
        --num-prompts 40 --temperature 0 --draft A --draft B --draft-vocab-size 32768 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _shared_features(target) -> None:
    """Compute the target's features once per batch for every drafter (same sequences, same
    layer ids); keyed by the batch's exact token ids."""
    compute, memo = target.features, {}

    def features(ids: torch.Tensor, lengths: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
        key = (ids.cpu().numpy().tobytes(), tuple(ids.shape), tuple(lengths.tolist()), tuple(layer_ids))
        if key not in memo:
            memo[key] = compute(ids, lengths, layer_ids)
        return memo[key]

    target.features = features


def replay(args: argparse.Namespace) -> dict:
    """{"<draft>/<dataset>": {"acceptance_length", "num_steps", ...}} for every --draft on the
    first --num-prompts sequences of each dataset at --temperature.

    Raises:
        FileNotFoundError: a missing --prep / --eval-sequences / --gguf / drafter file.
        KeyError: --eval-sequences lacks a sequence asked for (fewer prompts, other temperature).
    """
    from safetensors import safe_open

    from blockdraft.config import ModelConfig
    from blockdraft.spec.dflash.checkpoint import load_drafter
    from blockdraft.spec.draft_vocab import load_draft_vocab
    from blockdraft.training.acceptance import offline_acceptance
    from blockdraft.training.gpu_run import _unpack_lists, load_hf_target
    from blockdraft.training.target import HFTarget

    prep = Path(args.prep)
    with safe_open(str(prep / "prompts.safetensors"), framework="pt") as f:
        eos = tuple(json.loads(f.metadata()["info"])["eos_ids"])
        prompts = {ds: _unpack_lists(f.get_tensor(f"{ds}_ids"), f.get_tensor(f"{ds}_offsets")) for ds in args.datasets}
    cfg = ModelConfig.from_hf_dict(json.loads((prep / "config.json").read_text()))
    target = HFTarget(load_hf_target(Path(args.gguf), prep, args.device))
    _shared_features(target)
    dtype = getattr(torch, args.dtype)
    results = {}
    with safe_open(args.eval_sequences, framework="pt") as f:
        for ds in args.datasets:
            n = min(args.num_prompts, len(prompts[ds]))
            seqs = [f.get_tensor(f"{ds}_T{args.temperature}_{i}").long() for i in range(n)]
            starts = [len(p) for p in prompts[ds][:n]]
            for folder in args.draft:
                drafter = load_drafter(Path(folder), cfg, dtype=dtype, device=args.device)
                vocab = load_draft_vocab(folder, args.draft_vocab_size, cfg.vocab_size) if args.draft_vocab_size else None
                r = offline_acceptance(drafter, target, seqs, starts, eos, batch_size=args.batch_size, draft_vocab=vocab)
                results[f"{folder}/{ds}"] = {k: v for k, v in r.items() if k != "per_sequence"} | {"num_prompts": n}
                tau = "n/a" if r["acceptance_length"] is None else f"{r['acceptance_length']:.4f}"  # no step: None
                print(f"{folder} {ds} T={args.temperature} prompts={n}: acceptance length {tau}", file=sys.stderr,
                      flush=True)  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--gguf", required=True, help="the target's GGUF file (as for gpu_run run)")
    p.add_argument("--prep", required=True, help="the `gpu_run prep` folder (prompts.safetensors, config.json)")
    p.add_argument("--eval-sequences", required=True, help="a run's <work>/eval_sequences.safetensors")
    p.add_argument("--draft", action="append", required=True, help="drafter folder (repeat to compare several)")
    p.add_argument("--num-prompts", type=int, default=40, help="first N prompts of each dataset (default 40)")
    p.add_argument("--temperature", type=int, choices=[0, 1], default=0, help="which answers: T = 0 or T = 1")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"], choices=["humaneval", "mtbench"])
    p.add_argument("--draft-vocab-size", type=int, default=32768,
                   help="draft vocabulary as decoding uses it (the folder's draft_vocab.json); 0 = full")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="drafter dtype")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=4, help="sequences per dense forward")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.batch_size < 1:
        p.error(f"--num-prompts and --batch-size must be >= 1, got {args.num_prompts} and {args.batch_size}")
    if args.json:
        from blockdraft.errors import refuse_unwritable

        refuse_unwritable(p, "--json", args.json)
    results = replay(args)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
