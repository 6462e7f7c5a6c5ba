"""Weight average of DFlash drafters of one shape ("model soup": Wortsman et al., 2022, "Model
soups: averaging weights of multiple fine-tuned models improves accuracy without increasing
inference time"). Session 13 shipped the 0.5 / 0.5 average of two Qwen drafters that started from
the same weights and were trained on different answers: +2.0 % / +1.5 % acceptance over either
(docs/benchmarks/drafter-qwen2.5-coder-0.5b.md "Session 13").

    python -m blockdraft.drafters.average --draft A --draft B [--weights 0.5,0.5] --out DIR [--pack]

Writes DIR/config.json (the first drafter's), DIR/model.safetensors (bf16, z-lab names) or, with
--pack, DIR/model.int8 (the 8-bit storage of the shipped drafters, drafters/pack.py), and copies
the first drafter's draft_vocab.json and speculative.json when it has them.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch

SIDECARS = ("draft_vocab.json", "speculative.json")


def average_drafters(folders: list[str | Path], weights: list[float]) -> tuple[dict, dict[str, torch.Tensor]]:
    """sum_i weights[i] * W_i for every tensor, in fp32.

    Args:
        folders: drafter folders (config.json + *.safetensors or model.int8), all of one shape.
        weights: one per folder, each > 0, summing to 1 (within 1e-6).
    Returns:
        (the first folder's config.json as a dict, name -> fp32 tensor of the average).
    Raises:
        ValueError: fewer than two folders, a weight count or value that does not fit, configs
            that differ (names the first differing key), or tensors missing or of another shape.
        FileNotFoundError: a folder without config.json or weights.
    """
    from blockdraft.spec.dflash.checkpoint import read_drafter_config, read_drafter_weights

    if len(folders) < 2:
        raise ValueError(f"averaging needs at least two drafters (--draft given {len(folders)} time(s))")
    if len(weights) != len(folders):
        raise ValueError(f"--weights has {len(weights)} value(s) for {len(folders)} drafters; give one per --draft")
    if any(not math.isfinite(w) or w <= 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"--weights must be positive and sum to 1, got {weights}")
    configs = [read_drafter_config(f).to_hf_dict() for f in folders]
    for f, cfg in zip(folders[1:], configs[1:]):
        keys = [*configs[0], *(k for k in cfg if k not in configs[0])]  # config.json's order: sizes first
        diff = next((k for k in keys if cfg.get(k) != configs[0].get(k)), None)
        if diff is not None:
            raise ValueError(f"drafters of different shapes cannot be averaged: {diff} is {configs[0].get(diff)!r} "
                             f"in {str(folders[0])!r} but {cfg.get(diff)!r} in {str(f)!r}")
    states = [read_drafter_weights(f) for f in folders]
    return configs[0], weighted_mean(states, weights, [str(f) for f in folders])


def weighted_mean(states: list[dict[str, torch.Tensor]], weights: list[float],
                  names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """sum_i weights[i] * states[i][k] for every tensor name k, accumulated in fp32 in list order
    (CPU; the weights are not checked here: average_drafters does).

    names: what to call each state in errors (default "state 0", "state 1", ...).
    Raises:
        ValueError: a tensor name in only some of the states, or one of another shape.
    """
    names = names or [f"state {i}" for i in range(len(states))]
    total: dict[str, torch.Tensor] = {}
    for i, (state, w) in enumerate(zip(states, weights)):
        if i and set(state) != set(total):
            odd = sorted(set(state) ^ set(total))[0]
            raise ValueError(f"tensor {odd!r} is in only one of {names[0]!r} and {names[i]!r}")
        for name, t in state.items():
            t = t.detach().float().cpu()
            if i and t.shape != total[name].shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)} in {names[i]!r}, "
                                 f"{tuple(total[name].shape)} in {names[0]!r}")
            total[name] = w * t if not i else total[name] + w * t
    return total


def write_average(out: str | Path, folders: list[str | Path], weights: list[float], packed: bool = False) -> Path:
    """Average `folders` (average_drafters) into the new folder `out`: bf16 weights, or their int8
    pack with packed=True; config.json and the first folder's sidecar files. Returns the weights file.

    Raises:
        ValueError: as average_drafters, or `out` exists and is not an empty folder.
    """
    from blockdraft.drafters.pack import PACK_FILE, pack
    from blockdraft.weights.save import save_safetensors

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists and is not an empty folder; give a new folder")
    config, state = average_drafters(folders, weights)
    bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in SIDECARS:
        if (Path(folders[0]) / name).is_file():
            shutil.copyfile(Path(folders[0]) / name, out / name)  # a new file's mode (umask), as the weights
    weights_file = out / (PACK_FILE if packed else "model.safetensors")
    save_safetensors(pack(bf16) if packed else bf16, str(weights_file), metadata={"format": "pt"})
    return weights_file


def main(argv: list[str] | None = None) -> int:
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph, unwrapped
    p = argparse.ArgumentParser(prog="python -m blockdraft.drafters.average", description=summary,
                                allow_abbrev=False)
    p.add_argument("--draft", action="append", required=True, metavar="FOLDER",
                   help="a drafter folder (config.json + *.safetensors or model.int8); give two or more")
    p.add_argument("--weights", default=None, help="comma-separated, one per --draft, summing to 1 (default: equal)")
    p.add_argument("--out", required=True, help="new folder for the averaged drafter")
    p.add_argument("--pack", action="store_true", help="store the weights as the int8 pack (model.int8) of the "
                                                       "shipped drafters instead of bf16 model.safetensors")
    args = p.parse_args(argv)
    try:
        weights = ([float(w) for w in args.weights.split(",")] if args.weights
                   else [1.0 / len(args.draft)] * len(args.draft))
    except ValueError:
        p.error(f"--weights must be comma-separated numbers, got {args.weights!r}")
    try:
        written = write_average(args.out, args.draft, weights, args.pack)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
