"""`blockdraft train-drafter`: prompts -> target answers (our engine) -> training -> z-lab export.

Layout of `--out`:
    data/          the token dataset (see training/dataset.py), reused when present if it was made
                   for the same target, target dtype, data settings and --seed (`reuse_dataset`),
                   with --no-resume too (it starts the training over, not the answers)
    data/partial/  while answering: the answers saved so far, wave by wave (training/answer_journal.py),
                   which the same command continues after an interrupt; removed once data/ is saved
    checkpoint/    resumable trainer state (training/trainer.py)
    train_log.jsonl one line per --log-every steps; with --val-fraction also validation lines
                   ("split": "val": loss and per-slot accuracy on the held-out answers)
    drafter/       the exported z-lab DFlash checkpoint (config.json + model.safetensors) and its
                   draft vocabulary (draft_vocab.json: the training answers' tokens ranked
                   by frequency, the target's EOS ids and pad id first; see blockdraft.spec.draft_vocab)
    summary.json   device, settings, data counts, final loss / per-slot accuracy, the last
                   validation ("val", null without --val-fraction)
--out is a new or empty folder or one holding a run (resumed, its data/ reused): anything else is
refused before anything loads (run_folder.check_out_folder). A rerun for another --target is refused naming
both targets (check_resume_target), and --no-resume says which checkpoint it discards.

This is the engine path (CPU or GPU, any catalog target). The GPU runs behind the shipped drafters
use training/gpu_run.py (made for a lent accelerator: pre-tokenized prompts, time budgets, data
kept across runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from blockdraft.training.run_folder import (check_data_folder, check_out_folder, check_resume_dtype,
                                             check_resume_settings, check_resume_target, dtype_flag, finished_run,
                                             say_discarded_checkpoint)

# `--tiny`: a smoke run in seconds on the CPU (CI); any option given explicitly still wins.
TINY = dict(num_prompts=8, max_prompt_tokens=128, max_new_tokens=16, synth_prompts=0, synth_openers="general",
            sampled_fraction=0.25, steps=4, batch_size=4, num_anchors=4, num_layers=1, intermediate_size=256,
            num_feature_layers=2, log_every=1)
DEFAULTS = dict(num_prompts=2000, max_prompt_tokens=512, max_new_tokens=256, synth_prompts=0, synth_openers="general",
                sampled_fraction=0.25, steps=2000, batch_size=8, num_anchors=64, num_layers=2, intermediate_size=None,
                num_feature_layers=3, log_every=10)


# The settings that shape the dataset (recorded in its info["settings"]); the training ones may change on reuse.
DATA_SETTINGS = ("num_prompts", "max_prompt_tokens", "max_new_tokens", "synth_prompts", "synth_openers",
                 "sampled_fraction")

# --synth-openers: what the --synth-prompts requests start with, in turn (synth.py; "" = bare Magpie).
# "general" is the default: the first H200 run on data whose self-written requests used them (session
# 32) raised the Qwen drafter's MT-bench acceptance 2.558 -> 2.693 (HumanEval 3.111 -> 3.203), where
# the two runs before, on bare ones, moved it -0.4 % and 0 %; and the ASCII filter dropped 1,118 of
# 32,514 requests instead of about a quarter (the bare ones are mostly coding, some not English).
SYNTH_OPENERS = ("none", "general")

# Requests the target answers at once while making the data (--max-num-seqs): 512 at once answered
# at 47.8K tokens/s on the H200 in bf16 (gpu_run, docs/benchmarks/gpu.md "Session 21"); the CPU
# gains nothing from more than a few dozen.
ANSWER_MAX_NUM_SEQS = {"cpu": 32, "cuda": 512}

# --dtype auto: bf16 on the GPU (the recipe behind the shipped drafters answers and trains in bf16),
# fp32 on the CPU, where bf16 matmuls are slower and another batch changes fp32 logits only in their
# last bits (up to 1.2e-5 in log-probabilities measured: answer_journal.py), flipping only near-ties.
TARGET_DTYPE_AUTO = {"cpu": "float32", "cuda": "bfloat16"}
TARGET_DTYPES = ("auto", "float32", "bfloat16")

# What the training bar's postfix shows (fit_together's _postfix): said once on stderr before the first
# step ("the bar shows " + it) and in train-drafter --help. The loss is not capped by ln(V), a uniform
# guess's: 84.9 at step 1 of `train-drafter --target smollm2-135m-instruct --tiny` on the CPU, ln V 10.8.
BAR_LEGEND = ("loss: the decay-weighted mean cross-entropy (nats) over the draft slots 1..B-1 (slot k weighted "
              "exp(-(k-1)/gamma), gamma 7 for a block of 16); a new (untrained) drafter's starts well above "
              "ln(vocabulary size), a uniform guess's, as its logits through the target's LM head are large and "
              "wrong (e.g. 84.9 at step 1 of SmolLM2's --tiny run, ln V 10.8); tau: 1 + a1 + a1*a2 + ..., a rough "
              "acceptance-length proxy; aK: top-1 accuracy of draft slot K, n/a when no training block had a label "
              "at slot K (each sampled anchor had fewer than K answer tokens after it); each over the steps since "
              "the last log line")

MAX_BLOCK_SIZE = 64  # released DFlash drafters use 8-16; a block costs B query tokens per anchor
MAX_SYNTH_PROMPTS = 1_000_000  # far above any useful run; beyond it the request list alone exhausts memory


def _device_kind(device: str) -> str:
    """"cpu" | "cuda" | "cuda:N" -> "cpu" or "cuda", the key of the per-device defaults above."""
    return "cuda" if device.startswith("cuda") else "cpu"


def resolve_target_dtype(dtype: str, device: str) -> str:
    """train-drafter's --dtype on `device` ("cpu", "cuda" or "cuda:N") -> "float32" | "bfloat16"
    ("auto": see TARGET_DTYPE_AUTO).

    Raises:
        ValueError: `dtype` is not one of TARGET_DTYPES (named with the allowed values).
    """
    if dtype not in TARGET_DTYPES:
        raise ValueError(f"--dtype must be one of {list(TARGET_DTYPES)}, got {dtype!r}")
    return TARGET_DTYPE_AUTO[_device_kind(device)] if dtype == "auto" else dtype


def resolve_settings(args) -> dict:
    """Merge preset (TINY or DEFAULTS) with the options the user gave (None = not given)."""
    preset = TINY if args.tiny else DEFAULTS
    return {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in preset.items()}


def check_settings(settings: dict, args) -> None:
    """The values that need no target config (the flags as the user spells them).

    Raises:
        ValueError: naming the flag, the value and what is allowed.
    """
    for name in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "num_layers", "num_feature_layers", "steps",
                 "batch_size", "num_anchors", "log_every"):
        _check_int(f"--{name.replace('_', '-')}", settings[name], 1)
    for flag, value, low in (("--block-size", args.block_size, 2), ("--max-len", args.max_len, 2),
                             ("--ckpt-every", args.ckpt_every, 0), ("--seed", args.seed, 0)):
        _check_int(flag, value, low)
    if args.block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"--block-size must be <= {MAX_BLOCK_SIZE} (released DFlash drafters use 8-16; each "
                         f"block costs B query tokens per anchor), got {args.block_size}")
    if isinstance(args.lr, bool) or not isinstance(args.lr, (int, float)) or not 0 < args.lr < math.inf:
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr!r}")
    width = settings["intermediate_size"]
    if width is not None and width < 1:
        raise ValueError(f"--intermediate-size must be >= 1 (or left out: the target's), got {width}")
    synth = settings["synth_prompts"]
    if isinstance(synth, bool) or not isinstance(synth, int) or not 0 <= synth <= MAX_SYNTH_PROMPTS:
        raise ValueError(f"--synth-prompts must be an integer in [0, {MAX_SYNTH_PROMPTS}], got {synth!r}")
    if settings["synth_openers"] not in SYNTH_OPENERS:
        raise ValueError(f"--synth-openers must be one of {list(SYNTH_OPENERS)}, got {settings['synth_openers']!r}")
    # As gpu_run's --synth-openers: asking for openers explicitly with nothing to synthesize is a
    # forgotten --synth-prompts (the preset's "general" is not asked for; "none" steers nothing).
    if getattr(args, "synth_openers", None) == "general" and not synth:
        raise ValueError("--synth-openers general steers the requests --synth-prompts N has the target write: it "
                         "needs --synth-prompts N > 0 (got 0; leave --synth-openers out to synthesize none)")
    if not 0.0 <= settings["sampled_fraction"] <= 1.0:
        raise ValueError(f"--sampled-fraction must be in [0, 1], got {settings['sampled_fraction']}")
    if getattr(args, "max_num_seqs", None) is not None:
        _check_int("--max-num-seqs", args.max_num_seqs, 1)
    from blockdraft.training.validation import check_val_settings

    check_val_settings(getattr(args, "val_fraction", 0.0), getattr(args, "val_every", None))
    if isinstance(args.train_vocab_size, bool) or not isinstance(args.train_vocab_size, int) or args.train_vocab_size < 0:
        raise ValueError(f"--train-vocab-size must be an integer >= 0 (0: full vocabulary), got {args.train_vocab_size!r}")
    if args.data and Path(args.data).is_file():
        raise ValueError(f"--data {args.data!r} is a file; expected a dataset folder (data-*.safetensors)")
    check_out_folder(args.out, args.data)
    if args.data:
        check_data_folder(args.data, args.out)


def check_mask_token(mask_token_id: int, tokenizer, target, flag: str = "--mask-token-id") -> None:
    """The mask token must be an id the training data never holds: it fills the draft slots, so a
    chat marker or end-of-sequence id there would make a drafted slot and a real token alike.

    Args:
        tokenizer: the target's (transformers); target: its ModelConfig; flag: where the id came
            from, for the message (the --init-from drafter's config when the user gave none).
    Raises:
        ValueError: the id is one of the tokenizer's named special tokens (BOS / EOS / PAD ...), a
            special token its chat template writes (chat markers) or one of the config's EOS ids;
            names the token and this target's default.
    """
    from blockdraft.training.build import default_mask_token_id

    taken = set(tokenizer.all_special_ids) | set(target.eos_token_ids) | _chat_marker_ids(tokenizer)
    if mask_token_id in taken:
        name = tokenizer.convert_ids_to_tokens(mask_token_id)
        fix = "leave the flag out" if flag == "--mask-token-id" else "start from another drafter"
        raise ValueError(f"{flag} {mask_token_id} is {name!r}, a special token the training data holds "
                         f"(chat markers, end of sequence); pick an id that never occurs in the data, or {fix} "
                         f"(this target's default: {default_mask_token_id(target)})")


def _chat_marker_ids(tokenizer) -> set[int]:
    """Special (added) tokens the chat template writes around a short conversation: markers such as
    Qwen's <|im_start|>, which transformers may leave out of all_special_ids. Empty without a
    template or when the template refuses the probe conversation."""
    from jinja2 import TemplateError

    special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    if not special or not getattr(tokenizer, "chat_template", None):
        return set()
    chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]  # roles every template takes
    try:
        ids = tokenizer.apply_chat_template(chat, tokenize=True)
    except TemplateError:  # a template that refuses this conversation: the named specials still apply
        return set()
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    return special & set(ids)


def check_against_target(settings: dict, args, target) -> None:
    """The values whose range depends on the target's config (a ModelConfig).

    Raises:
        ValueError: naming the flag, the value and the range this target allows.
    """
    from blockdraft.spec.draft_vocab import min_draft_vocab_size

    low, high = min_draft_vocab_size(target.vocab_size), target.vocab_size
    if args.train_vocab_size and not low <= args.train_vocab_size <= high:
        raise ValueError(f"--train-vocab-size must be 0 (full vocabulary) or in [{low}, {high}] for this target's "
                         f"{high}-id vocabulary (the range --draft-vocab-size allows), got {args.train_vocab_size}")
    if args.mask_token_id is not None and not 0 <= args.mask_token_id < high:
        raise ValueError(f"--mask-token-id must be in [0, {high}) (this target's vocabulary), got {args.mask_token_id}")
    most = max(1, target.num_hidden_layers - 1)
    if settings["num_feature_layers"] > most:
        raise ValueError(f"--num-feature-layers must be at most {most} (distinct layers below the last of this "
                         f"target's {target.num_hidden_layers}), got {settings['num_feature_layers']}")


def apply_init_shape(args, settings: dict):
    """--init-from: the drafter to start from, as (folder, DFlashConfig), or None without it.

    Its shape fills the shape flags left out (`settings` num_layers / intermediate_size /
    num_feature_layers, `args.block_size` / `args.mask_token_id`, both updated in place); a deeper
    --num-layers, a wider --intermediate-size or a larger --num-feature-layers grows it
    (training.build.init_from; which feature layers a larger count reads, and whether they hold the
    init's, is settled against the target's depth by grown_feature_layer_ids). Reads its
    config.json only, no weights.
    Raises:
        ValueError: --block-size / --mask-token-id given with another value than the drafter's, or
            --num-layers / --intermediate-size / --num-feature-layers below its own (names the flag,
            both values and the folder); 'shipped' for a target with none; FileNotFoundError: no
            drafter folder there (the message lists what --init-from takes: a folder or 'shipped';
            'auto' is not one).
    """
    if not getattr(args, "init_from", None):
        return None
    for flag, value in (("--num-layers", getattr(args, "num_layers", None)),
                        ("--num-feature-layers", getattr(args, "num_feature_layers", None))):
        if value is not None:  # 0 or -1 is no count at all, not "fewer than the init's"
            _check_int(flag, value, 1)
    from blockdraft.drafters import SHIPPED, resolve_draft
    from blockdraft.spec.dflash.checkpoint import read_drafter_config

    folder = Path(resolve_draft(SHIPPED, args.target, cache_dir=args.cache_dir) if args.init_from == SHIPPED
                  else args.init_from)
    if not folder.is_dir():  # read_drafter_config's message is --draft's, which also takes 'auto'
        raise FileNotFoundError(_init_from_not_a_folder(folder))
    if not (folder / "config.json").is_file():  # the same: say it for --init-from
        nested = folder / "drafter"  # a train-drafter --out holds data/, checkpoint/, drafter/
        hint = f" (did you mean {nested}?)" if (nested / "config.json").is_file() else ""
        raise FileNotFoundError(f"no config.json in drafter folder {str(folder)!r}{hint}; --init-from takes a DFlash "
                                f"checkpoint folder (config.json + *.safetensors or model.int8) or 'shipped' (the "
                                f"drafter shipped for --target)")
    config = read_drafter_config(folder)
    if args.intermediate_size is not None and args.intermediate_size < config.intermediate_size:
        raise ValueError(f"--intermediate-size {args.intermediate_size} is below the --init-from drafter's "
                         f"{config.intermediate_size} ({folder}): an MLP can be widened, not cut")
    features = len(config.target_layer_ids)
    if args.num_feature_layers is not None and args.num_feature_layers < features:
        raise ValueError(f"--num-feature-layers {args.num_feature_layers} is below the --init-from drafter's "
                         f"{features} (target_layer_ids {list(config.target_layer_ids)}; {folder}): feature layers "
                         f"can be added, not removed")
    kept = {"--block-size": (args.block_size, config.block_size),
            "--mask-token-id": (args.mask_token_id, config.mask_token_id)}
    for flag, (given, own) in kept.items():
        if given is not None and given != own:
            raise ValueError(f"{flag} {given} differs from the --init-from drafter's {own} ({folder}): "
                             f"leave {flag} out (its value is kept) or start from random weights")
    if args.num_layers is not None and args.num_layers < config.num_hidden_layers:
        raise ValueError(f"--num-layers {args.num_layers} is below the --init-from drafter's {config.num_hidden_layers} "
                         f"layers ({folder}): a drafter can be grown, not cut")
    settings.update(num_layers=args.num_layers or config.num_hidden_layers,
                    intermediate_size=args.intermediate_size or config.intermediate_size,
                    num_feature_layers=args.num_feature_layers or features)
    args.block_size, args.mask_token_id = config.block_size, config.mask_token_id
    return folder, config


def grown_feature_layer_ids(init, count: int, depth: int) -> tuple[int, ...]:
    """The target layer ids a drafter grown from `init` ((folder, DFlashConfig), apply_init_shape's)
    reads with --num-feature-layers `count` on a target of `depth` layers: the init's own for its
    count, else feature_layer_ids(depth, count), which must hold every id of the init's (its fc
    blocks move to their ids' positions, the new ids' columns start at zero: training.build.init_from).

    Raises:
        ValueError: the init's ids are not all among those of `count` (names both lists, the
            folder and the counts whose ids would hold them).
    """
    from blockdraft.training.build import feature_layer_ids

    folder, config = init
    own = tuple(config.target_layer_ids)
    if count == len(own):
        return own
    ids = feature_layer_ids(depth, count)
    missing = [i for i in own if i not in ids]
    if missing:
        fits = [n for n in range(len(own) + 1, depth) if set(own) <= set(feature_layer_ids(depth, n))]
        listed = ", ".join(map(str, fits[:4])) + (", ..." if len(fits) > 4 else "")
        hint = (f"; counts whose ids hold them on this {depth}-layer target: [{listed}]" if fits
                else f"; no larger count's ids hold them on this {depth}-layer target")
        raise ValueError(f"--num-feature-layers {count} reads target layers {list(ids)}, which lack {missing} of the "
                         f"--init-from drafter's target_layer_ids {list(own)} ({folder}): feature layers can be added, "
                         f"not moved{hint}")
    return ids


def _init_from_not_a_folder(folder: Path) -> str:
    """Why --init-from `folder` cannot be used, and the values --init-from takes (no 'auto')."""
    what = "is a file, not a folder" if folder.exists() else "does not exist"
    hint = (" (--init-from has no 'auto': leave the flag out to start from random weights)"
            if str(folder) == "auto" else "")
    return (f"drafter folder {str(folder)!r} {what}; --init-from takes a DFlash checkpoint folder (config.json + "
            f"*.safetensors or model.int8) or 'shipped' (the drafter shipped for --target){hint}")


def _check_int(flag: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")


def reuse_dataset(folder: Path, settings: dict, args, target_path: str, vocab_size: int,
                  asked_dtype: str | None = None, device: str = "cpu"):
    """The dataset already in `folder` (a TokenDataset), or None when it holds none.

    It is reused only when made for this target (its recorded name or folder), with token ids
    inside the target's vocabulary, and with the data settings asked for: all of DATA_SETTINGS
    for the run's own OUT/data, those given explicitly for a --data folder (whose recorded ones
    otherwise stand), as dataset.data_settings_differences compares them (a dataset that records no
    synth_openers counts as made with "none"; the openers are not compared when neither it nor the
    run synthesizes requests). Likewise the target dtype its answers were made in (info["dtype"]; greedy
    answers differ at near-ties between float32 and bfloat16): it must be `args.dtype` (the
    resolved --dtype) for the run's own OUT/data, whether or not the run resumes; for a --data
    folder only when --dtype was given explicitly (`asked_dtype` not "auto"), an auto that
    resolves to another dtype being said on stderr. A dataset that records no dtype (made before
    train-drafter recorded it, or by training/gpu_run.py) is reused with a warning on stderr
    naming the folder. The seed it was made with (info["seed"]: it chose the prompts and seeded
    the sampled answers) must be args.seed for the run's own OUT/data; a --data folder is reused
    with another, said on stderr (--seed then seeds the training only). The device it was
    answered on is not compared: it acts through the dtype (--dtype auto resolves per device),
    and kernels of one dtype on another device differ only at rare near-ties, as another
    --max-num-seqs batch does in bfloat16. Reuse is reported on stderr with the recorded settings.

    Args:
        args: the run's arguments, args.dtype already resolved (resolve_target_dtype).
        asked_dtype: --dtype as the user gave it ("auto" | "float32" | "bfloat16"; None: args.dtype),
            and `device` the resolved device ("cpu" | "cuda[:N]"): both only for the messages and
            the --data rule above.
    Raises:
        ValueError: naming the folder, each recorded value against the requested one, and what to do
            (a new --out, removing the folder, or the --dtype / --seed it was made with when only that
            differs).
    """
    from blockdraft.training.dataset import SHARD_PATTERN, TokenDataset, data_settings_differences
    from blockdraft.weights.fetch import same_target

    if not any(folder.glob(SHARD_PATTERN)):
        return None
    data = TokenDataset.load(folder)
    info, made = data.info, data.info.get("settings", {})
    differ = []  # (what, recorded, requested)
    if "target" in info and not same_target(info["target"], info.get("target_path"), args.target, target_path):
        differ.append(("target", repr(info["target"]), repr(args.target)))
    if info.get("vocab_size", vocab_size) != vocab_size:
        differ.append(("vocab size", info["vocab_size"], vocab_size))
    ids = data.token_id_range()
    if ids is not None and not (0 <= ids[0] and ids[1] < vocab_size):
        differ.append(("token ids", f"{ids[0]}..{ids[1]}", f"in [0, {vocab_size})"))
    asked = {name: settings[name] for name in DATA_SETTINGS
             if args.data is None or getattr(args, name, None) is not None}
    differ += [(f"--{name.replace('_', '-')}", was, now) for name, was, now in data_settings_differences(made, asked)]
    made_seed = info.get("seed")  # None: not recorded; it chose the prompts and seeded the sampled answers
    if made_seed is not None and made_seed != args.seed and args.data is None:
        differ.append(("--seed", made_seed, args.seed))
    dtype, asked_dtype = args.dtype, asked_dtype or args.dtype
    answered_in = info.get("dtype")  # None: not recorded (an older dataset, or gpu_run's)
    dtype_differs = answered_in is not None and answered_in != dtype
    if dtype_differs and (args.data is None or asked_dtype != "auto"):
        differ.append(("--dtype", answered_in, dtype_flag(asked_dtype, dtype, device).removeprefix("--dtype ")))
    if differ:
        other = " (or another --data folder)" if args.data else ""
        only = [w for w, _, _ in differ]
        matching = (f", or pass --dtype {answered_in} to train on its answers" if only == ["--dtype"] else
                    # --seed also seeds the training: --data keeps the answers and trains with the new seed
                    f", or pass --seed {made_seed} to train on its answers (or --data {folder} to train on them with "
                    f"--seed {args.seed})" if only == ["--seed"] else "")
        # the seed is compared for OUT/data only (a --data folder keeps its answers): named when it is the cause
        rule = "target, --dtype, data settings and --seed" if "--seed" in only else "target, --dtype and data settings"
        raise ValueError(
            f"the dataset in {folder} was made with {', '.join(f'{w} {r}' for w, r, _ in differ)}; this run asks for "
            f"{', '.join(f'{w} {a}' for w, _, a in differ)}. A dataset is reused only for the same {rule}: use a new "
            f"--out{other}, or remove {folder} to generate it again{matching}")
    shown = ", ".join(f"{k}={v}" for k, v in {**made, **({"seed": made_seed} if made_seed is not None else {})}.items()) \
        or "settings not recorded"
    print(f"train-drafter: reusing the {len(data)} sequences in {folder} (target {info.get('target', 'not recorded')!r}, "
          f"dtype {answered_in or 'not recorded'}, {shown}), made with this run's data flags (other values are "
          f"refused here: a new --out or --data folder answers anew)", file=sys.stderr)
    if made_seed is not None and made_seed != args.seed:  # a --data folder (OUT/data was refused above)
        print(f"train-drafter: the prompts and sampled answers in {folder} were made with --seed {made_seed}; "
              f"--seed {args.seed} seeds this run's training only", file=sys.stderr)
    if answered_in is None:
        made_by = f" (generator: {info['generator']!r})" if "generator" in info else ""
        print(f"train-drafter: warning: {folder} does not record the dtype its answers were made in{made_by}; "
              f"this run trains with the target in {dtype}: if it answered in another, those answers are used as "
              f"they are (remove {folder} or use a new --out to answer again in {dtype})", file=sys.stderr)
    elif dtype_differs:  # a --data folder with --dtype auto
        print(f"train-drafter: warning: the answers in {folder} were made with the target in {answered_in}; this "
              f"run trains it in {dtype} (--dtype {asked_dtype} on {device}): pass --dtype {answered_in} to "
              f"train in the dtype that answered", file=sys.stderr)
    return data


def select_training_prompts(tokenizer, settings: dict, args) -> tuple[list[list[int]], dict, list[str]]:
    """(chat-encoded ShareGPT prompts, their filter stats, the evaluation texts kept out of them).

    Twice --num-prompts ShareGPT prompts are read as candidates, so that those longer than
    --max-prompt-tokens can be dropped and --num-prompts still kept. The stats count the prompts
    dropped as longer (`over_max_prompt_tokens`) among those read until --num-prompts were kept,
    and the prompts `used`; fewer than --num-prompts kept is said on stderr.
    Raises:
        ValueError: --max-prompt-tokens keeps none of them (names its value, the candidates read and
            why there are that many, and the shortest one's length).
    """
    from blockdraft.training import corpora
    from blockdraft.training.generate import encode_prompts
    from blockdraft.training.prompts import assert_no_eval_overlap, select_prompts

    eval_texts = corpora.all_eval_texts(args.cache_dir)
    texts, stats = select_prompts(corpora.sharegpt_first_turns(args.cache_dir), eval_texts,
                                  settings["num_prompts"] * 2, seed=args.seed)
    assert_no_eval_overlap(texts, eval_texts)
    limit, wanted = settings["max_prompt_tokens"], settings["num_prompts"]
    prompts, kept = encode_prompts(tokenizer, texts, limit)
    # The counts name the candidates read (2 x --num-prompts), not only --num-prompts: "drops all 16"
    # for --num-prompts 8 read as a miscount.
    read_as = (f"the {len(texts)} ShareGPT prompts read as candidates for --num-prompts {wanted} (up to twice as "
               f"many, to allow for drops)")
    if texts and not prompts:
        shortest = min(len(ids) for ids in encode_prompts(tokenizer, texts, 10**9)[0])
        raise ValueError(f"--max-prompt-tokens {limit} keeps none of {read_as}: each is longer once chat-encoded "
                         f"(the shortest has {shortest} tokens); raise --max-prompt-tokens to at least {shortest}")
    if len(prompts) < wanted:
        print(f"train-drafter: --max-prompt-tokens {limit} keeps {len(prompts)} of {read_as}: the data comes from "
              f"{len(prompts)} prompts, not {wanted}; raise --max-prompt-tokens for more", file=sys.stderr)
    read = kept[wanted - 1] + 1 if len(kept) >= wanted else len(texts)
    prompts = prompts[:wanted]
    stats.update(over_max_prompt_tokens=read - len(prompts), used=len(prompts))
    return prompts, stats, eval_texts


def answering_engine_kwargs(device: str, max_num_seqs: int | None, num_requests: int, max_prompt_tokens: int,
                            max_new_tokens: int, kv_block_size: int = 16) -> dict:
    """The LLM keyword arguments of the engine that answers the training prompts.

    Args:
        device: the resolved device, "cpu" or "cuda[:N]".
        max_num_seqs: --max-num-seqs, requests answered at once (None: ANSWER_MAX_NUM_SEQS of the
            device, at most `num_requests`).
        num_requests: requests to answer (ShareGPT prompts + --synth-prompts).
        max_prompt_tokens / max_new_tokens: the longest prompt and answer, tokens.
    Returns {"max_num_seqs", "kv_block_size", "num_kv_blocks"}: a pool of the pages that many
    requests of the longest prompt and answer need (at least 1,024), as the GPU recipe
    (training/answering.answer_engine) sizes it, so it does not grow with the prompt count nor take
    the whole GPU (the trainer needs the memory next).
    """
    if max_num_seqs is None:
        max_num_seqs = max(1, min(ANSWER_MAX_NUM_SEQS[_device_kind(device)], num_requests))
    per_request = math.ceil((max_prompt_tokens + max_new_tokens + 1) / kv_block_size)
    return {"max_num_seqs": max_num_seqs, "kv_block_size": kv_block_size,
            "num_kv_blocks": max(1024, max_num_seqs * per_request)}


def answering_setup(settings: dict, args, target_path: str, vocab_size: int, num_prompts: int,
                    device: str) -> tuple[dict, dict]:
    """(engine keyword arguments, journal header) of the answering of `num_prompts` chosen prompts
    (plus --synth-prompts): answering_engine_kwargs and answer_journal.answering_header."""
    from blockdraft.training.answer_journal import answering_header

    engine = answering_engine_kwargs(device, getattr(args, "max_num_seqs", None), num_prompts + settings["synth_prompts"],
                                     settings["max_prompt_tokens"], settings["max_new_tokens"])
    header = answering_header(args.target, target_path, vocab_size, {k: settings[k] for k in DATA_SETTINGS}, args.seed,
                              args.dtype, engine["max_num_seqs"])
    return engine, header


def _other_data(args) -> str:
    """What a message adds to "use a new --out" when the data folder is a --data one."""
    return " (or another --data folder)" if getattr(args, "data", None) else ""


def build_dataset(target, settings: dict, args, folder: Path, target_path: str,
                  chosen: tuple[list[list[int]], dict, list[str]], device: str = "cpu",
                  should_stop=None):
    """Generate the dataset into `folder` with our engine on `device`: the target answers the `chosen`
    prompts (select_training_prompts) and, with --synth-prompts, requests it writes itself (starting
    with GENERAL_OPENERS in turn for --synth-openers general, bare for none); at most
    --max-num-seqs at once (answering_engine_kwargs). The engine (its KV pool, its CUDA graphs) is
    freed before returning, so training gets the memory.

    Both are answered in waves saved as they complete to `folder`/partial (training/answer_journal.py),
    which a later call with the same settings continues (the requests and waves saved are read back,
    said on stderr; --synth-prompts are not written again): the dataset comes out the same as an
    uninterrupted call's. `should_stop` (a callable, checked between engine steps): once it returns
    True the wave in progress is dropped, one line on stderr says how many of how many requests are
    saved, how many finished answers of the dropped wave are not kept (answering_stopped_message)
    and that the same command resumes, and KeyboardInterrupt is raised.

    Returns the TokenDataset (also saved to `folder`, then the journal removed; its info records
    device, dtype, max_num_seqs, wave_size; gen_seconds sums the waves of every run that made them).
    Raises:
        ValueError: the answering engine's KV pool does not fit the GPU (names --max-num-seqs); a
            journal in `folder` made with other settings (answer_journal.check_journal).
        KeyboardInterrupt: stopped by `should_stop` (above).
    """
    import gc

    import torch

    from blockdraft.llm import LLM
    from blockdraft.training.answer_journal import AnswerJournal, AnsweringStopped, answer_in_waves, check_journal
    from blockdraft.training.generate import encode_prompts, sampling_plan, to_dataset

    prompts, stats, eval_texts = chosen
    engine = answering_engine_kwargs(device, getattr(args, "max_num_seqs", None), len(prompts) + settings["synth_prompts"],
                                     settings["max_prompt_tokens"], settings["max_new_tokens"])
    try:
        llm = LLM(target=target, dtype=args.dtype, device=device, **engine)
    except torch.OutOfMemoryError as e:
        raise ValueError(f"--max-num-seqs {engine['max_num_seqs']}: the answering engine's KV pool of "
                         f"{engine['num_kv_blocks']} pages (that many prompts of --max-prompt-tokens + "
                         f"--max-new-tokens) does not fit in the GPU's memory; lower --max-num-seqs") from e
    journal = AnswerJournal(folder)
    try:
        _, header = answering_setup(settings, args, target_path, target.config.vocab_size, len(prompts), device)
        check_journal(journal, header, _other_data(args))  # train_drafter checked it before loading; other callers
        journal.start(header)
        wave = header["wave_size"]
        saved = journal.requests()
        if saved is not None:  # chosen and synthesized by the run that was interrupted
            prompts, sampled, stats = saved
        else:
            prompts, stats = list(prompts), dict(stats)
            if settings["synth_prompts"]:  # requests the target writes itself, after the ShareGPT ones (training/synth.py)
                from blockdraft.training.synth import GENERAL_OPENERS, synthesize_prompts

                def journaled(prompt_ids, max_tokens, sampled, temperature, seed):
                    return answer_in_waves(journal, "synth", llm, prompt_ids, sampled, max_tokens, temperature, seed,
                                           wave, should_stop, progress=True)

                openers = GENERAL_OPENERS if settings["synth_openers"] == "general" else ("",)  # --synth-openers
                synth, stats["synthesized"] = synthesize_prompts(llm, settings["synth_prompts"], eval_texts,
                                                                 seed=args.seed, max_tokens=settings["max_prompt_tokens"],
                                                                 progress=True, openers=openers, generate=journaled)
                stats["synthesized"]["openers"] = len(openers)  # as gpu_run records them (training/answering.py)
                synth_ids, _ = encode_prompts(target.tokenizer, synth, settings["max_prompt_tokens"])
                stats["synthesized"].update(encoded=len(synth_ids), over_max_prompt_tokens=len(synth) - len(synth_ids))
                prompts += synth_ids
            sampled = sampling_plan(len(prompts), settings["sampled_fraction"], args.seed)
            journal.save_requests(prompts, sampled, stats)
        responses = answer_in_waves(journal, "answers", llm, prompts, sampled, settings["max_new_tokens"], 0.7,
                                    args.seed, wave, should_stop, progress=True)
    except AnsweringStopped as e:
        print(f"train-drafter: {answering_stopped_message(e, journal.folder, wave)}", file=sys.stderr, flush=True)
        raise KeyboardInterrupt from None
    finally:
        del llm
        gc.collect()  # CUDA graphs keep closures over their owners (cycles); collect them so empty_cache frees the pool
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    info = {"target": args.target, "target_path": target_path, "vocab_size": target.config.vocab_size,
            "settings": {k: settings[k] for k in DATA_SETTINGS}, "generator": "blockdraft engine",
            "device": device, "dtype": args.dtype, "max_num_seqs": engine["max_num_seqs"], "wave_size": wave,
            "sampled_temperature": 0.7, "seed": args.seed, "prompt_stats": stats,
            "gen_seconds": round(journal.seconds(), 1)}
    data = to_dataset(prompts, responses, sampled, info)
    data.save(folder)
    journal.remove()  # after the dataset is whole on disk: a kill in between keeps both, and the dataset is reused
    return data


def answering_stopped_message(e, folder: Path, wave_size: int) -> str:
    """build_dataset's line for an answering stopped by should_stop (`e`: an AnsweringStopped):
    how many requests are saved in the journal `folder` and, stopped within a wave, how many
    finished answers of that wave are not kept and why (a wave of WAVE_BATCHES x --max-num-seqs =
    `wave_size` requests is saved whole, so the count on the progress bar before the stop can
    exceed what is saved)."""
    from blockdraft.training.answer_journal import WAVE_BATCHES

    what = ("prompts answered" if e.stage == "answers" else
            "--synth-prompts requests written (the prompts are answered after them)")
    lost = ""
    if e.dropped:
        noun = "answer" if e.stage == "answers" else "request"
        lost = (f" ({e.dropped} {noun}{'s' if e.dropped != 1 else ''} of the unfinished wave of {e.wave} "
                f"{'are' if e.dropped != 1 else 'is'} not kept: {noun}s are saved a wave of {WAVE_BATCHES} x "
                f"--max-num-seqs = {wave_size} at a time)")
    return (f"stopped answering: {e.done} of {e.total} {what} and saved in {folder}{lost}; the same command resumes "
            f"from there")


VAL_EVERY_LOGS = 10  # --val-every's default (train-drafter and gpu_run): this many --log-every intervals


def resolve_val_every(args, settings: dict) -> int:
    """Steps between validations: --val-every, else VAL_EVERY_LOGS x --log-every; 0 without
    --val-fraction (nothing held out)."""
    if not getattr(args, "val_fraction", 0.0):
        return 0
    given = getattr(args, "val_every", None)
    return given if given is not None else VAL_EVERY_LOGS * settings["log_every"]


def split_answers(data, args):
    """(training part, validation part or None) of the answers: dataset.split_validation with
    --val-fraction and --seed (the same split whenever the same data is reused or resumed).

    Raises:
        ValueError: the fraction leaves no answer to train on (named as --val-fraction).
    """
    from blockdraft.training.dataset import split_validation

    return split_validation(data, getattr(args, "val_fraction", 0.0), args.seed, name="--val-fraction")


def train_drafter(args) -> dict:
    """The whole command; returns the summary (also written to `out/summary.json`), or the recorded
    one of a run already finished in `out` (finished_run: said on stderr, nothing trained).

    With --val-fraction F, split_answers holds out that share of the answers (seeded by --seed; at most
    dataset.MAX_VAL_SEQUENCES): the rest is trained on (and ranked into the draft vocabulary), the
    held-out part validated every --val-every steps (train_log.jsonl lines with "split": "val";
    summary["val"]: the last).

    Raises:
        ValueError: a flag's value (check_settings, check_against_target, ...), an --out that is empty,
            holds paths of the run's of the wrong kind or is a non-empty folder holding no run
            (check_out_folder), a --val-fraction that leaves no answer to train on, a dataset made with
            other settings or --seed or answered in another target dtype (reuse_dataset; before any weights
            load, --no-resume or not), or a checkpoint in `out` made for another target
            (check_resume_target), of another target dtype
            (check_resume_dtype) or of other training settings (Trainer.load_checkpoint), or an
            interrupted answering saved in the data folder with other settings
            (answer_journal.check_journal; before any weights load).
        StopRequested (a KeyboardInterrupt; exit_code 130 for Ctrl-C, 143 for SIGTERM): after a first
            Ctrl-C / SIGTERM, once what was done is saved (the answers so far, build_dataset; or a
            checkpoint and the drafter so far), or at once on a second.
    """
    plan = _plan_run(args)
    if isinstance(plan, dict):  # the run in --out is finished: its recorded summary, nothing loads
        return plan
    if plan.device == "cpu" and not plan.args.tiny:  # a bare `train-drafter` is a real run: say its size first
        print(cpu_run_note(plan.settings, plan.data is not None), file=sys.stderr, flush=True)
    from blockdraft.model_loader import load_target

    plan.out.mkdir(parents=True, exist_ok=True)
    # Unpacked: the loss back-propagates through the frozen LM head into the drafter (packed CPU
    # weights are inference-only; an untied LM head, as Qwen's, is one).
    target = load_target(str(plan.path), plan.args.dtype, plan.device, plan.args.cache_dir, pack_weights=False)
    data = plan.data if plan.data is not None else _answer(plan, target)
    return _train_and_export(plan, target, data)


def cpu_run_note(settings: dict, data_reused: bool) -> str:
    """What a full-size run (not --tiny) on the CPU is in for, said before the target loads: the
    answers to make (unless a dataset is reused) and the training steps, and the flags for a smoke
    run or the GPU (a trial left a bare `train-drafter` at "answer 0%" with no hint of its size)."""
    work = f"{settings['steps']} training steps of {settings['batch_size']} sequences"
    if not data_reused:
        work = (f"the target answers {settings['num_prompts']} prompts (up to {settings['max_new_tokens']} tokens "
                f"each), then {work}")
    return (f"train-drafter: a full run on the CPU: {work}; that can take hours on a CPU (the shipped drafters "
            f"trained on a GPU: --device cuda). --tiny is a smoke run of seconds; Ctrl-C stops with what is saved.")


@dataclass
class _RunPlan:
    """What train_drafter settles before any weights load, every check passed (_plan_run).

    args: the caller's flags, copied, with --init-from's shape and the resolved dtype and block size
    filled in. init: (--init-from folder, its DFlash config) or None. cfg: the TrainConfig.
    path / target_config: the target's folder and config. drafter: the new drafter on `device`
    (grown from --init-from's weights: `grown`, init_from's report, else None; `added_feature_layers`:
    the target layer ids it reads beyond the init's, whose fc columns start at zero, else None). out / folder: the
    run's and the dataset's folders. data: a reused dataset, else None and `chosen` holds the prompts
    to answer (select_training_prompts).
    """

    args: argparse.Namespace
    settings: dict
    init: tuple | None
    cfg: object
    device: str
    path: Path
    target_config: object
    drafter: object
    grown: object
    added_feature_layers: list[int] | None
    out: Path
    folder: Path
    data: object | None
    chosen: tuple | None


def _plan_run(args) -> _RunPlan | dict:
    """train_drafter's settings, each checked before the target's weights load and the dataset is
    made (minutes to hours), or the recorded summary of a run already finished in --out (finished_run).

    Raises:
        ValueError: as train_drafter's (every check but the trainer's own).
    """
    import torch

    from blockdraft.preflight import read_target_config, resolve_device
    from blockdraft.spec.dflash.checkpoint import load_drafter
    from blockdraft.spec.dflash.config import DEFAULT_BLOCK_SIZE
    from blockdraft.training.answer_journal import AnswerJournal, check_journal
    from blockdraft.training.build import init_from, new_drafter, new_feature_layers
    from blockdraft.training.trainer import TrainConfig
    from blockdraft.weights.fetch import model_folder
    from blockdraft.weights.loader import load_tokenizer

    settings = resolve_settings(args)
    user_mask_token_id = args.mask_token_id  # None: --init-from's (or the default) is used
    args = argparse.Namespace(**vars(args))  # the shape flags --init-from fills in stay the caller's
    init = apply_init_shape(args, settings)
    if args.block_size is None:
        args.block_size = DEFAULT_BLOCK_SIZE
    # Every setting is checked before the target's weights load and the dataset is generated
    # (minutes to hours): the values, then the drafter's shape against the target's config.json.
    check_settings(settings, args)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    asked_dtype, args.dtype = args.dtype, resolve_target_dtype(args.dtype, device)
    out = Path(args.out)
    folder = Path(args.data) if args.data else out / "data"
    # The target's folder as far as it is known without downloading a catalog model (GBs) or
    # converting a .gguf: the resume checks that need no target config come before that.
    where = model_folder(args.target, args.cache_dir)
    if not args.no_resume:  # a finished run's rerun does not ignore --dtype either
        # another target first and alone: the shape flags that differ with it were never given
        check_resume_target(out, folder, args.target, None if where is None else str(where), own_data=not args.data)
        check_resume_dtype(out, args.dtype, asked_dtype, device)
    path, _, target_config = read_target_config(args.target, args.cache_dir)
    if not args.no_resume and where is None:  # a .gguf target: its folder is known now
        check_resume_target(out, folder, args.target, str(path), own_data=not args.data)
    cfg = TrainConfig(steps=settings["steps"], batch_size=settings["batch_size"], max_len=args.max_len,
                      num_anchors=settings["num_anchors"], lr=args.lr, seed=args.seed,
                      ckpt_every=args.ckpt_every, log_every=settings["log_every"], greedy_labels=args.greedy_labels,
                      val_every=resolve_val_every(args, settings), val_fraction=getattr(args, "val_fraction", 0.0))
    if init:  # before building on its target_layer_ids: a drafter of another target is named as such
        from blockdraft.spec.dflash.checkpoint import check_drafter_fits

        try:
            check_drafter_fits(init[1], init[0], target_config)
        except ValueError as e:
            raise ValueError(f"--init-from {str(init[0])!r}: {e}") from e
    check_against_target(settings, args, target_config)
    layer_ids = None  # a new drafter's: feature_layer_ids of --num-feature-layers
    if init:  # the init's, or more that hold them (checked before any weights load)
        layer_ids = grown_feature_layer_ids(init, settings["num_feature_layers"], target_config.num_hidden_layers)
    if args.mask_token_id is not None:
        flag = "--mask-token-id" if user_mask_token_id is not None else "the --init-from drafter's mask_token_id"
        check_mask_token(args.mask_token_id, load_tokenizer(path), target_config, flag)
    drafter = new_drafter(target_config, settings["num_layers"], args.block_size, settings["intermediate_size"],
                          num_feature_layers=settings["num_feature_layers"], mask_token_id=args.mask_token_id,
                          target_layer_ids=layer_ids, seed=args.seed, device=device)
    asked = {name: settings[name] for name in DATA_SETTINGS if args.data is None or getattr(args, name, None) is not None}
    finished = None if args.no_resume else finished_run(out, folder, cfg, drafter.config, args.train_vocab_size, asked)
    if finished is not None:
        return finished
    if not args.no_resume:  # before the answers and features are made, not after
        check_resume_settings(out, cfg, args.train_vocab_size, drafter.config)
    # The dataset is checked (its target, dtype and data settings) before any weights load.
    data = reuse_dataset(folder, settings, args, str(path), target_config.vocab_size, asked_dtype, device)
    if data is not None:  # a reused dataset too small for --val-fraction is refused before any weights load
        split_answers(data, args)
    grown = added = None
    if init:  # weights after every check: the init drafter must fit this target too
        state = {k: v.float() for k, v in load_drafter(init[0], target_config, torch.float32).state_dict().items()}
        grown = init_from(drafter, state, state_layer_ids=init[1].target_layer_ids)
        added = new_feature_layers(drafter, state, init[1].target_layer_ids)  # gpu_run reports them the same way
        if added:
            print(f"train-drafter: reading target layers {list(layer_ids)}: {added} added to the --init-from drafter's "
                  f"{list(init[1].target_layer_ids)} (their fc columns start at zero: the drafter starts as the init)",
                  file=sys.stderr, flush=True)
    chosen = None if data is not None else select_training_prompts(load_tokenizer(path), settings, args)
    if chosen is not None:  # an interrupted answering's journal (answer_journal.py) is checked before loading too
        check_journal(AnswerJournal(folder), answering_setup(settings, args, str(path), target_config.vocab_size,
                                                             len(chosen[0]), device)[1], _other_data(args))
    if args.no_resume:  # every check passed: the run goes ahead and starts its training over
        say_discarded_checkpoint(out)
    return _RunPlan(args, settings, init, cfg, device, path, target_config, drafter, grown, added, out, folder, data,
                    chosen)


def _answer(plan: _RunPlan, target):
    """The target answers plan.chosen into plan.folder (build_dataset), saving as it goes.

    Raises:
        StopRequested (a KeyboardInterrupt naming the signal): after a first Ctrl-C / SIGTERM once
            the answers so far are saved (the same command resumes the answering), or at once on a
            second.
    """
    with deferred_interrupt(ANSWERING_STOP, ANSWERING_STOP_NOW) as stop:
        try:
            data = build_dataset(target, plan.settings, plan.args, plan.folder, str(plan.path), plan.chosen,
                                 plan.device, should_stop=lambda: stop.hit)
        except KeyboardInterrupt as e:  # build_dataset stopped (should_stop): exit by the signal that asked
            if isinstance(e, StopRequested) or not stop.hit:
                raise
            raise stop.interrupt() from None
    if stop.hit:  # the signal came as the last wave finished: the answers are all saved, nothing trained yet
        print(f"train-drafter: stopped after answering: the dataset is saved in {plan.folder}; the same command "
              f"trains on it", file=sys.stderr, flush=True)
        raise stop.interrupt()
    return data


def _train_and_export(plan: _RunPlan, target, data) -> dict:
    """Train the planned drafter on `data` (its held-out share validated), export it to out/drafter
    with its draft vocabulary, write out/summary.json and return the summary.

    Raises:
        ValueError: a checkpoint in out of other training settings (Trainer.load_checkpoint).
        StopRequested (a KeyboardInterrupt naming the signal): after a first Ctrl-C / SIGTERM, once
            a checkpoint and the drafter so far are saved, or at once on a second.
    """
    from blockdraft.model_loader import eos_token_ids
    from blockdraft.spec.dflash.checkpoint import SPECULATIVE_FILE, export_drafter
    from blockdraft.spec.draft_vocab import leading_ids, rank_dataset, write_dataset_draft_vocab
    from blockdraft.training.build import num_parameters
    from blockdraft.training.features import FeatureCache
    from blockdraft.training.target import EngineTarget
    from blockdraft.training.trainer import DEFAULT_MAX_EPOCHS, Trainer

    args, settings, init, cfg, out = plan.args, plan.settings, plan.init, plan.cfg, plan.out
    drafter, target_config, device, grown = plan.drafter, plan.target_config, plan.device, plan.grown
    # The held-out answers (--val-fraction) are neither trained on nor ranked into the draft vocabulary.
    train_data, val_data = split_answers(data, args)
    if val_data is not None:
        print(f"train-drafter: {len(val_data)} of the {len(data)} answers held out for validation every "
              f"{cfg.val_every} steps (--val-fraction {args.val_fraction:g}); training on {len(train_data)}",
              file=sys.stderr, flush=True)
    if cfg.batch_size > len(train_data):  # not an error (each step takes all of them), but not what was asked
        print(f"train-drafter: --batch-size {cfg.batch_size} is more than the {len(train_data)} training sequences; "
              f"each step uses all {len(train_data)}", file=sys.stderr, flush=True)
    epochs = cfg.steps * min(cfg.batch_size, len(train_data)) / len(train_data)  # passes over the training sequences
    if init and epochs > DEFAULT_MAX_EPOCHS:
        print(f"train-drafter: --steps {cfg.steps} x --batch-size {cfg.batch_size} is {epochs:.1f} passes over the "
              f"{len(train_data)} training sequences; continuing a trained drafter for 11.4 passes lost held-out "
              f"acceptance on an H200: more prompts (--num-prompts, --synth-prompts) or fewer --steps, and "
              f"--val-fraction to watch held-out accuracy", file=sys.stderr, flush=True)
    train_target = EngineTarget(target.model)
    features = None
    if args.cache_features:
        features = FeatureCache.build(train_target, train_data, drafter.config.target_layer_ids, cfg.max_len, device,
                                      progress=True, greedy=args.greedy_labels)
    # one lead (EOS ids, then the pad id) for the trained slice and the exported draft_vocab.json
    lead = leading_ids(eos_token_ids(target), getattr(target.tokenizer, "pad_token_id", None))
    draft_vocab = None
    if args.train_vocab_size:
        draft_vocab = rank_dataset(train_data, target_config.vocab_size, lead, args.train_vocab_size)[0]
    trainer = Trainer(drafter, train_target, train_data, cfg, out, features=features, draft_vocab=draft_vocab,
                      target_dtype=args.dtype, val_data=val_data, target_name=args.target, target_path=str(plan.path))
    resumed = trainer.load_checkpoint() if not args.no_resume else False
    if resumed:
        print(f"train-drafter: resuming the run in {out} at step {trainer.step} of {cfg.steps} (its checkpoint; "
              f"--no-resume starts over)", file=sys.stderr, flush=True)
    else:  # a run from step 0 (--no-resume, or no checkpoint: one interrupted before its first) logs anew
        (out / "train_log.jsonl").unlink(missing_ok=True)
    if trainer.step < cfg.steps:
        print(f"train-drafter: the bar shows {BAR_LEGEND}", file=sys.stderr, flush=True)
    with deferred_interrupt() as stop:
        final = trainer.fit(progress=True, should_stop=lambda: stop.hit)
    if not final and trainer.history:  # nothing left to train (a finished run re-exported): its last log
        final = trainer.history[-1]
    export_drafter(drafter, out / "drafter")  # also when stopped early: the drafter as trained so far
    write_dataset_draft_vocab(out / "drafter", train_data, target_config.vocab_size, lead,
                              f"train-drafter data {args.data or out / 'data'} (response tokens"
                              + (")" if val_data is None else f"; the {len(val_data)} held out for validation left out)"))
    if args.train_vocab_size:  # decode over the vocabulary it was trained on unless told otherwise
        (out / "drafter" / SPECULATIVE_FILE).write_text(json.dumps(
            {"draft_vocab_size": args.train_vocab_size, "source": "train-drafter --train-vocab-size"}, indent=1))
    if stop.hit and trainer.step < trainer.cfg.steps:
        print(f"train-drafter: stopped at step {trainer.step} of {trainer.cfg.steps}; checkpoint saved in "
              f"{out / 'checkpoint'} (the same command resumes it) and the drafter as trained so far exported to "
              f"{out / 'drafter'} (--draft takes it)", file=sys.stderr, flush=True)
        raise stop.interrupt()
    run = {**settings, "block_size": args.block_size, "max_len": args.max_len, "lr": args.lr, "seed": args.seed,
           "val_fraction": cfg.val_fraction, "val_every": cfg.val_every}
    summary = {"target": args.target, "settings": run, "drafter": str(out / "drafter"), "device": device,
               "dtype": args.dtype, "resumed": resumed, "epochs": round(epochs, 2),
               "params": num_parameters(drafter), "train_vocab_size": args.train_vocab_size,
               "cache_features": args.cache_features, "greedy_labels": args.greedy_labels, "data": data.info, "final": final,
               # the last validation (Trainer.validate: held-out loss, per-slot accuracy, tau proxy), None without
               "val": trainer.val_history[-1] if trainer.val_history else None,
               "init_from": str(init[0]) if init else None, "new_layers": grown,
               # target layer ids read beyond the init's (their fc columns started at zero), None without an init
               "new_feature_layers": plan.added_feature_layers,
               # the init's own depth and MLP width: settings hold the (possibly grown) ones trained
               "init_shape": {"num_layers": init[1].num_hidden_layers, "intermediate_size": init[1].intermediate_size}
               if init else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


class _Flag:
    hit = False
    signum = signal.SIGINT  # the first stop signal's, once hit

    def interrupt(self) -> "StopRequested":
        """The KeyboardInterrupt to raise once what was done is saved: exits 128 + this signal."""
        return StopRequested(self.signum)


class StopRequested(KeyboardInterrupt):
    """train-drafter stopped by a signal (deferred_interrupt). `exit_code` is 128 + its number, the
    status a shell reports for a process that signal ends: 130 for Ctrl-C (SIGINT), 143 for
    SIGTERM (cli.main returns it; a plain KeyboardInterrupt exits 130)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and what kill / timeout / job schedulers send


TRAINING_STOP = "stopping after this step and saving a checkpoint (again: stop now, unsaved)"
TRAINING_STOP_NOW = ("stopping now: the steps since the last checkpoint are not saved; a checkpoint already in "
                     "--out stays (rerun the command to resume from it)")
ANSWERING_STOP = ("stopping the answering now, keeping the answers saved so far (again: stop at once; what is saved "
                  "stays)")
ANSWERING_STOP_NOW = "stopping now: the answers saved so far stay (rerun the command to resume from them)"


@contextlib.contextmanager
def deferred_interrupt(note: str = TRAINING_STOP, again_note: str = TRAINING_STOP_NOW):
    """While the block runs, the first Ctrl-C (SIGINT) or SIGTERM sets the yielded flag's `hit`
    instead of ending the process, so that training stops at the end of its step, checkpoints and
    exports (an interrupt inside an optimizer step would leave half-updated weights), or the
    answering stops between engine steps keeping its saved waves; `note` says which on stderr
    after the signal's name, and the flag's `signum` records it (`flag.interrupt()`: the
    StopRequested to raise once saved). A second one says `again_note` (what stays saved) and
    raises StopRequested at once. Off the main thread (where signal handlers cannot be set) the
    flag just stays False."""
    flag = _Flag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def on_signal(signum, frame):
        if flag.hit:
            print(f"\ntrain-drafter: {signal.Signals(signum).name} again: {again_note}", file=sys.stderr, flush=True)
            raise StopRequested(signum)
        flag.hit, flag.signum = True, signum
        print(f"\ntrain-drafter: {signal.Signals(signum).name}: {note}", file=sys.stderr, flush=True)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(args) -> int:
    """CLI body of `blockdraft train-drafter` (arguments from cli.py)."""
    summary = train_drafter(args)
    print(json.dumps(summary, indent=1))
    print(closing_message(summary, args.target, getattr(args, "train_vocab_size", 0)), file=sys.stderr)
    return 0


def closing_message(summary: dict, target: str, train_vocab_size: int = 0) -> str:
    """train-drafter's last stderr line: where the drafter is and the commands that use it (generate),
    make generate decode at its fastest K (spec_k --write-default: speculative.json in the drafter
    folder; without it the whole block, K = block size - 1, the slowest on a CPU) and measure its
    acceptance (eval-drafter). With --train-vocab-size N, spec_k also times that draft vocabulary
    (its --write-default would otherwise record the full one)."""
    drafter = summary["drafter"]
    vocab = f" --draft-vocab-sizes {train_vocab_size}" if train_vocab_size else ""
    written = Path(drafter) / "speculative.json"
    return (f"train-drafter: the drafter is {drafter}; decode with it: blockdraft generate --model {target} --draft "
            f"{drafter} PROMPT (it drafts the whole block, K = block size - 1, unless --num-speculative-tokens K: "
            f"slow on a CPU; `python -m blockdraft.bench.spec_k --model {target} --draft {drafter}{vocab} "
            f"--write-default` times K = 1, 2, 3, 4, 7, 15 and writes the fastest to {written}, which generate then "
            f"uses), and measure its acceptance: blockdraft eval-drafter --model {target} --draft {drafter}")
