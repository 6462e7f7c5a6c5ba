"""Drafter training throughput: optimizer steps per second of `Trainer` on a random target of a
real shape, per batch size and feature source, so that a GPU run's settings can be chosen by
measurement (no weights or data to ship: random token sequences of the lengths the real data has).

    python -m blockdraft.bench.train_throughput --shape qwen2.5-0.5b --device cuda --batch-sizes 16,64
    python -m blockdraft.bench.train_throughput --shape tiny --device cpu --steps 2 --warmup 1   # smoke

Each cell: `--warmup` steps, then `--steps` timed optimizer steps (device-synchronised clock
around each step, median). Features: "cached" (training/features.py, computed once) or "target"
(the target runs every step). Prints a table; `--out PATH` writes JSON. The CUDA allocator's
settings (PYTORCH_CUDA_ALLOC_CONF) are printed: they can only be set before the process starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from blockdraft.errors import refuse_unwritable


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers >= 1, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    value = _positive_ints(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"must be one integer >= 1, got {text!r}")
    return value[0]


def random_dataset(num_sequences: int, vocab_size: int, prompt_len: tuple[int, int], response_len: tuple[int, int],
                   seed: int):
    """A TokenDataset of random ids: prompt and response lengths uniform in the given [lo, hi] ranges."""
    from blockdraft.training.dataset import TokenDataset

    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(num_sequences):
        n_p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        n_r = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g))
        ids = torch.randint(0, vocab_size, (n_p + n_r,), generator=g).tolist()
        pairs.append((ids[:n_p], ids[n_p:]))
    return TokenDataset.from_pairs(pairs, [False] * num_sequences, {"random": True})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args) -> dict:
    """Build the random target and data once, then time every (batch size, feature source) cell."""
    from blockdraft.bench.random_weights import random_hf_model
    from blockdraft.bench.shapes import get_shape, model_config
    from blockdraft.training.build import new_drafter
    from blockdraft.training.features import FeatureCache
    from blockdraft.training.target import HFTarget
    from blockdraft.training.trainer import TrainConfig, Trainer

    device = torch.device(args.device)
    shape = get_shape(args.shape)
    config = model_config(shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = HFTarget(random_hf_model(shape, dtype, device, seed=0))
    data = random_dataset(args.num_sequences, config.vocab_size, (args.prompt_len_min, args.prompt_len_max),
                          (args.response_len_min, args.response_len_max), seed=0)
    vocab = None
    if args.train_vocab_size:
        if args.train_vocab_size > config.vocab_size:
            raise ValueError(f"--train-vocab-size {args.train_vocab_size} exceeds the {shape.name} vocabulary "
                             f"({config.vocab_size})")
        vocab = torch.arange(args.train_vocab_size)
    rows, cache = [], None
    for source in args.features.split(","):
        for batch_size in args.batch_sizes:
            drafter = new_drafter(config, args.draft_layers, 16, args.intermediate_size, num_feature_layers=3,
                                  mask_token_id=config.vocab_size - 1, seed=0, device=device)
            cfg = TrainConfig(steps=10**6, batch_size=batch_size, num_anchors=args.num_anchors, max_len=1024, lr=1e-4)
            if source == "cached" and cache is None:
                t0 = time.perf_counter()
                cache = FeatureCache.build(target, data, drafter.config.target_layer_ids, cfg.max_len, device)
                _sync(device)
                print(f"features cached: {tuple(cache.feats.shape)} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            trainer = Trainer(drafter, target, data, cfg, Path(args.work), features=cache if source == "cached" else None,
                              draft_vocab=vocab)
            times = []
            for i in range(args.warmup + args.steps):
                _sync(device)
                t0 = time.perf_counter()
                trainer.train_step()
                _sync(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            rows.append({"features": source, "batch_size": batch_size, "num_anchors": args.num_anchors,
                         "ms_per_step": ms, "steps_per_s": 1e3 / ms,
                         "blocks_per_s": 1e3 / ms * batch_size * args.num_anchors})
            print(f"{source} b={batch_size}: {ms:.1f} ms/step", file=sys.stderr)
            del trainer, drafter
    return {"shape": shape.name, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"), "train_vocab_size": args.train_vocab_size,
            "draft_layers": args.draft_layers, "num_sequences": args.num_sequences, "rows": rows}


def table(result: dict) -> str:
    """The result as a Markdown table (one row per cell)."""
    head = (f"{result['shape']} on {result['device']} ({result['dtype']}), allocator {result['allocator']}, "
            f"train vocab {result['train_vocab_size'] or 'full'}, {result['draft_layers']} draft layers\n"
            "| features | batch | anchors | ms/step | steps/s | blocks/s |\n|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['features']} | {r['batch_size']} | {r['num_anchors']} | {r['ms_per_step']:.1f} | {r['steps_per_s']:.2f} "
        f"| {r['blocks_per_s']:.0f} |" for r in result["rows"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockdraft.bench.train_throughput", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__, allow_abbrev=False)
    p.add_argument("--shape", default="qwen2.5-0.5b", help="target shape (blockdraft.bench.shapes)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-sizes", type=_positive_ints, default=[16, 64], help="sequences per step, e.g. 16,64")
    p.add_argument("--features", default="cached,target", help="comma list of cached | target")
    p.add_argument("--num-anchors", type=_positive_int, default=64)
    p.add_argument("--steps", type=_positive_int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--train-vocab-size", type=int, default=32768, help="0: full vocabulary")
    p.add_argument("--draft-layers", type=_positive_int, default=2)
    p.add_argument("--intermediate-size", type=_positive_int, default=1024)
    p.add_argument("--num-sequences", type=_positive_int, default=512)
    p.add_argument("--prompt-len-min", type=_positive_int, default=20)
    p.add_argument("--prompt-len-max", type=_positive_int, default=512)
    p.add_argument("--response-len-min", type=_positive_int, default=50)
    p.add_argument("--response-len-max", type=_positive_int, default=384)
    p.add_argument("--work", default="/tmp/train-throughput", help="scratch folder (the trainer's out_dir)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    bad = [s for s in args.features.split(",") if s not in ("cached", "target")]
    if bad:
        p.error(f"--features: {bad[0]!r} is not one of cached, target")
    if args.warmup < 0 or args.train_vocab_size < 0:
        p.error(f"--warmup and --train-vocab-size must be >= 0, got {args.warmup}, {args.train_vocab_size}")
    for part in ("prompt", "response"):
        lo, hi = getattr(args, f"{part}_len_min"), getattr(args, f"{part}_len_max")
        if lo > hi:
            p.error(f"--{part}-len-min {lo} is larger than --{part}-len-max {hi}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here; use --device cpu")
    refuse_unwritable(p, "--out", args.out)  # before the run, not when writing its result
    try:
        result = measure(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
