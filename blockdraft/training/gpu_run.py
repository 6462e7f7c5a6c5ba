"""The one-call GPU recipe: target-generated data -> drafter training -> export -> acceptance.

Made for a lent accelerator that has torch + transformers but no network and no tokenizer files
worth parsing: everything text-related is done beforehand on the workstation (`prep`), so the GPU
side (`run`) needs only the target's GGUF, its config.json, the pre-tokenized prompts and our
package (plus the pure-Python `gguf` wheel).

    # workstation: tokenized training prompts (ShareGPT, eval-free) + eval prompts
    python -m blockdraft.training.gpu_run prep --target qwen2.5-coder-0.5b-instruct --out parts/qwen
    # GPU: answer, train, export, evaluate (time budgets in seconds)
    python -m blockdraft.training.gpu_run run --gguf Q.gguf --prep parts/qwen --work /tmp/w --drafters '[...]'

The training target is transformers' model on the weights our converter dequantizes (HF hidden
states for the features); the answers come from HF `generate` or, with --gen-engine, from our
engine (continuous batching; also the prompts the target writes itself, --synth-samples);
acceptance is measured offline (training/acceptance.py), which replays the engine's greedy walk
exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from blockdraft.model_loader import model_eos_ids
from blockdraft.training import answering
from blockdraft.training.answering import log as _log
from blockdraft.training.generate import sampling_plan
from blockdraft.training.pipeline import VAL_EVERY_LOGS  # --val-every's default: this many log lines' steps
from blockdraft.training.validation import check_val_settings

# ---------------------------------------------------------------- prep (workstation)


def _pack_lists(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.tensor([t for ids in lists for t in ids], dtype=torch.int32)
    offsets = torch.tensor([0] + list(_cumsum(len(x) for x in lists)), dtype=torch.int64)
    return flat, offsets


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _unpack_lists(flat: torch.Tensor, offsets: torch.Tensor) -> list[list[int]]:
    o = offsets.tolist()
    return [flat[o[i] : o[i + 1]].tolist() for i in range(len(o) - 1)]


def prep(target: str, out: Path, num_prompts: int, max_prompt_tokens: int, seed: int, cache_dir=None,
         later_turns: int = 0) -> dict:
    """Write `<out>/prompts.safetensors` (train/humaneval/mtbench token ids, chat template applied)
    and `<out>/config.json` (the target's HF config). Returns stats (also in the file metadata).

    later_turns: also up to this many multi-turn prompts (ShareGPT prefixes ending in a later user
    turn, prompts.select_later_turns), appended after the first-turn prompts, so the first-turn
    list (and the answers an earlier run gave to it) stays the same."""
    from blockdraft.training import corpora
    from blockdraft.training.generate import encode_prompts
    from blockdraft.training.prompts import assert_no_eval_overlap, select_prompts
    from blockdraft.weights.fetch import resolve_model_path
    from blockdraft.weights.loader import load_hf_config, load_tokenizer
    from blockdraft.weights.save import save_safetensors

    path = resolve_model_path(target, cache_dir=cache_dir)
    tok = load_tokenizer(path)
    eval_texts = corpora.all_eval_texts(cache_dir)
    texts, stats = select_prompts(corpora.sharegpt_first_turns(cache_dir), eval_texts, num_prompts, seed=seed)
    assert_no_eval_overlap(texts, eval_texts)
    train_ids, kept = encode_prompts(tok, texts, max_prompt_tokens)
    stats.update(encoded=len(train_ids), max_prompt_tokens=max_prompt_tokens)
    if later_turns:
        from blockdraft.training.prompts import select_later_turns

        convs, later_stats = select_later_turns(corpora.sharegpt_conversations(cache_dir), eval_texts, later_turns,
                                                seed=seed)
        assert_no_eval_overlap(convs, eval_texts)
        later_ids, _ = encode_prompts(tok, convs, max_prompt_tokens)
        train_ids += later_ids
        stats["later_turns"] = {**later_stats, "encoded": len(later_ids)}
    tensors = {}
    for name, lists in (("train", train_ids),
                        ("humaneval", encode_prompts(tok, corpora.eval_prompts("humaneval", cache_dir), 10**9)[0]),
                        ("mtbench", encode_prompts(tok, corpora.eval_prompts("mtbench", cache_dir), 10**9)[0])):
        tensors[f"{name}_ids"], tensors[f"{name}_offsets"] = _pack_lists(lists)
    out.mkdir(parents=True, exist_ok=True)
    info = {"target": target, "stats": stats, "eos_ids": _eos_ids(path, load_hf_config(path), tok),
            "pad_id": _pad_id(tok)}
    save_safetensors(tensors, str(out / "prompts.safetensors"), metadata={"info": json.dumps(info)})
    (out / "config.json").write_text(json.dumps(load_hf_config(path), indent=1))
    return info


def _eos_ids(path, cfg: dict, tok) -> list[int]:
    """The stop ids the engine decodes to (model_loader.model_eos_ids), so that answers made with
    transformers end where the engine's do."""
    eos = cfg.get("eos_token_id")
    return list(model_eos_ids(path, eos if isinstance(eos, list) else [eos] if eos is not None else [], tok))


def _pad_id(tok) -> int:
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


# ---------------------------------------------------------------- run (GPU)


def load_hf_target(gguf_path: Path, config_dir: Path, device: str):
    """transformers model (bf16 on CUDA, fp32 on CPU) on the weights our converter dequantizes
    from `gguf_path` (same tensors as the cached bf16 folder), config from `config_dir`."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    from blockdraft.weights.convert import gguf_architecture, read_gguf_tensors

    reader = gguf.GGUFReader(str(gguf_path))
    config = AutoConfig.from_pretrained(str(config_dir))
    state = read_gguf_tensors(reader, gguf_architecture(reader), config, gguf_path, dtype=torch.bfloat16, progress=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]:
        raise ValueError(f"GGUF tensors do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval().requires_grad_(False)


LOG_EVERY = 25  # steps per train_log.jsonl line

# Keys of a --drafters entry: the drafter's shape and start, and (OPTIM_KEYS) optimizer settings
# that may differ between drafters trained together: fit_together shares the batches, not the
# optimizer, so one run can compare learning rates or loss decays side by side.
SPEC_KEYS = ("name", "num_layers", "intermediate_size", "num_feature_layers", "int8", "norm_from_target", "init_from",
             "init_target_layer_ids")
OPTIM_KEYS = ("lr", "gamma", "warmup_frac", "min_lr_ratio", "weight_decay", "grad_clip")


def drafter_specs(text: str) -> list[dict]:
    """--drafters parsed and checked: a JSON list of objects, each with a unique "name" and
    "num_layers", and only SPEC_KEYS / OPTIM_KEYS (an OPTIM_KEYS value overrides --lr and the
    TrainConfig defaults for that drafter alone). "init_target_layer_ids" (the target layers the
    "init_from" weights' fc reads, in order; default: training.build.init_layer_ids) needs "init_from".

    Raises:
        ValueError: not such a list, a missing or repeated name, no num_layers, an unknown key
            (the message names it and the keys allowed), or init_target_layer_ids without init_from
            or not a non-empty list of distinct integers >= 0.
    """
    try:
        specs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--drafters is not JSON ({e}); expected a list of objects") from e
    if not isinstance(specs, list) or not specs or not all(isinstance(s, dict) for s in specs):
        raise ValueError(f"--drafters must be a non-empty JSON list of objects, got {text[:80]!r}")
    names = [s.get("name") for s in specs]
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"--drafters: every entry needs a unique non-empty \"name\", got {names}")
    for spec in specs:
        unknown = sorted(set(spec) - set(SPEC_KEYS) - set(OPTIM_KEYS))
        if unknown:
            raise ValueError(f"--drafters entry {spec['name']!r}: unknown keys {unknown}; allowed: "
                             f"{list(SPEC_KEYS)} and the optimizer settings {list(OPTIM_KEYS)}")
        if "num_layers" not in spec:
            raise ValueError(f"--drafters entry {spec['name']!r} has no \"num_layers\"")
        if "init_target_layer_ids" in spec:
            ids = spec["init_target_layer_ids"]
            if not spec.get("init_from"):
                raise ValueError(f"--drafters entry {spec['name']!r}: \"init_target_layer_ids\" names the layers the "
                                 f"\"init_from\" weights read: it needs \"init_from\"")
            if (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
                raise ValueError(f"--drafters entry {spec['name']!r}: \"init_target_layer_ids\" must be a non-empty "
                                 f"list of distinct target layer ids (integers >= 0), got {ids!r}")
    return specs


def check_inits(specs: list[dict], target_cfg) -> None:
    """Each "init_from" of `specs` (drafter_specs') is a file whose fc.weight fits the drafter the
    entry builds on `target_cfg` (a ModelConfig): the init's target layers ("init_target_layer_ids",
    else derived from its fc width: build.init_layer_ids) all among the drafter's, none dropped
    (build.feature_block_positions). Reads the safetensors header only: checked before the
    answering (minutes of GPU time), not only when the drafters are built after it.

    Raises:
        FileNotFoundError: an init_from that is not a file; ValueError: an fc that does not fit
            (naming the entry, the file and both id lists).
    """
    from safetensors import safe_open

    from blockdraft.training.build import default_layer_ids, feature_block_positions

    depth, h = target_cfg.num_hidden_layers, target_cfg.hidden_size
    for spec in specs:
        if not spec.get("init_from"):
            continue
        path, name = Path(spec["init_from"]), spec["name"]
        if not path.is_file():
            raise FileNotFoundError(f"--drafters entry {name!r}: init_from {str(path)!r} is not a file")
        with safe_open(str(path), framework="pt") as f:
            shape = list(f.get_slice("fc.weight").get_shape()) if "fc.weight" in f.keys() else None
        if shape is None:  # init_from copies what the file has
            continue
        if len(shape) != 2 or shape[0] != h or not shape[1] or shape[1] % h:
            raise ValueError(f"--drafters entry {name!r}: init_from {str(path)!r} has fc.weight of shape {shape}, "
                             f"not [{h}, n*{h}] for this target's hidden size {h}")
        ids = default_layer_ids(depth, spec["num_layers"], spec.get("num_feature_layers"))  # new_drafter's
        try:
            feature_block_positions(ids, shape[1] // h, depth, spec.get("init_target_layer_ids"))
        except ValueError as e:
            raise ValueError(f"--drafters entry {name!r} (init_from {str(path)!r}): {e}") from e


def run(args) -> dict:
    """Generate -> train (all drafters in lockstep) -> export -> offline acceptance; returns results."""
    from safetensors import safe_open

    from blockdraft.config import ModelConfig
    from blockdraft.training.dataset import TokenDataset

    t_start = time.time()
    specs = drafter_specs(args.drafters)  # a bad --drafters fails here, not after the answering
    prep_dir = Path(args.prep)
    target_cfg = ModelConfig.from_hf_dict(json.loads((prep_dir / "config.json").read_text()))
    check_inits(specs, target_cfg)  # so does an init_from whose feature layers the drafter cannot keep
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    with safe_open(str(prep_dir / "prompts.safetensors"), framework="pt") as f:
        info = json.loads(f.metadata()["info"])
        lists = {k: _unpack_lists(f.get_tensor(f"{k}_ids"), f.get_tensor(f"{k}_offsets")) for k in ("train", "humaneval", "mtbench")}
    eos, pad = tuple(info["eos_ids"]), info["pad_id"]
    hf = load_hf_target(Path(args.gguf), prep_dir, args.device)
    _log(f"target loaded ({time.time() - t_start:.0f} s)")

    data_dir = work / "data"
    prompts = lists["train"][: args.num_prompts]
    llm = answering.answer_engine(args, prompts) if args.gen_engine else None
    if (data_dir / "data-00000.safetensors").is_file():
        data = TokenDataset.load(data_dir)
    else:
        sampled = sampling_plan(len(prompts), args.sampled_fraction, args.seed)
        data = answering.answer(hf, llm, prompts, sampled, args, info, eos, pad, args.seed, args.gen_seconds)
        data.save(data_dir)
    if args.extend_seconds > 0:  # the next shard, also right after a fresh run's first one (one GPU call)
        more = answering.extend(hf, llm, data, prompts, args, info, eos, pad, data_dir)
        if more is not None:
            data = TokenDataset.concat([data, more])
    if llm is not None:  # give the engine's KV pool and graphs back before the features are cached
        del llm
        answering.release_gpu()
    _log(f"data: {json.dumps(data.info)}")
    results = {"data": data.info, "drafters": {}}
    inits = {}  # each drafter's starting weights, read before training can overwrite the file
    trainers = _train(args, hf, target_cfg, data, work, results, eos, pad, inits)
    results["eval"] = _evaluate(args, hf, target_cfg, lists, eos, pad, trainers, work, inits)
    results["wall_seconds"] = round(time.time() - t_start, 1)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    return results


def _train(args, hf, target_cfg, data, work: Path, results: dict, eos_ids: tuple[int, ...] = (),
           pad_id: int | None = None, inits: dict | None = None) -> dict:
    """Train every drafter of --drafters in lockstep; export each (z-lab files + a draft vocabulary
    ranked from `data`'s response tokens with `leading_ids(eos_ids, pad_id)` first) to
    `work/<name>/export`. `inits`, if given, receives the init_from weights of each drafter that has
    them (name -> state dict).

    --val-fraction F holds out that share of `data` first (dataset.split_validation, seeded by
    --seed, at most MAX_VAL_SEQUENCES): not trained on, not cached, not ranked into the draft
    vocabulary; every drafter is validated on it every --val-every steps (fit_together), its curve
    in results["drafters"][name]["val"] ([{step, loss, tau_proxy, acc_mean}]) and the split in
    results["val_split"]."""
    from blockdraft.spec.dflash.checkpoint import export_drafter
    from blockdraft.spec.draft_vocab import leading_ids, rank_dataset, write_dataset_draft_vocab
    from blockdraft.training.build import init_from, init_layer_ids, new_drafter, new_feature_layers, num_parameters
    from blockdraft.training.dataset import split_validation
    from blockdraft.training.features import FeatureCache
    from blockdraft.training.target import HFTarget
    from blockdraft.training.trainer import TrainConfig, Trainer, epoch_cap_steps, fit_together

    target = HFTarget(hf)
    fraction = getattr(args, "val_fraction", 0.0)
    # `data` is the training part from here on
    data, val_data = split_validation(data, fraction, args.seed, name="--val-fraction")
    val_every = (getattr(args, "val_every", None) or VAL_EVERY_LOGS * LOG_EVERY) if val_data is not None else 0
    results["val_split"] = {"fraction": fraction, "every": val_every,
                            "sequences": 0 if val_data is None else len(val_data), "train_sequences": len(data)}
    if val_data is not None:
        _log(f"validation: {len(val_data)} of {len(data) + len(val_data)} sequences held out (--val-fraction "
             f"{fraction:g}), validated every {val_every} steps")
    lead = leading_ids(eos_ids, pad_id)  # one lead for the trained slice and the exported file
    draft_vocab = None
    if args.train_vocab_size:  # the same ranking the export writes to draft_vocab.json
        draft_vocab = rank_dataset(data, target_cfg.vocab_size, lead, args.train_vocab_size)[0]
    features, train_data = None, data
    specs = drafter_specs(args.drafters)
    cfg = TrainConfig(steps=10**9, batch_size=args.batch_size, max_len=args.max_len, num_anchors=args.num_anchors,
                      lr=args.lr, warmup_frac=args.warmup_frac, seed=args.seed, log_every=LOG_EVERY,
                      ckpt_every=args.ckpt_every, greedy_labels=args.greedy_labels, val_every=val_every,
                      val_fraction=fraction)
    trainers = {}
    for spec in specs:
        d = new_drafter(target_cfg, spec["num_layers"], args.block_size, spec.get("intermediate_size"),
                        num_feature_layers=spec.get("num_feature_layers"), seed=args.seed, device=args.device)
        if spec.get("norm_from_target"):  # start in the LM head's input space: the target's final norm
            with torch.no_grad():
                d.norm.weight.copy_(hf.model.norm.weight.float())
        if spec.get("init_from"):  # continue from an earlier run's fp32 weights (z-lab names), maybe shallower
            from safetensors.torch import load_file

            state = load_file(spec["init_from"])
            given = spec.get("init_target_layer_ids")  # else derived from its fc width (build.init_layer_ids)
            grown = init_from(d, state, state_layer_ids=given)
            if inits is not None:
                inits[spec["name"]] = state
            if grown:
                _log(f"{spec['name']}: layers {grown} new (zero output projections) on {spec['init_from']}")
            added = new_feature_layers(d, state, given)
            if added:  # more target layers than the init reads: theirs start silent
                _log(f"{spec['name']}: target layers {added} new (zero fc columns) beside the init's "
                     f"{list(init_layer_ids(d, state, given))}: reading {list(d.config.target_layer_ids)} on "
                     f"{spec['init_from']}")
        if args.cache_features and features is None:  # one cache: drafters trained together share layer ids
            t0 = time.time()
            train_data, device_bytes = _cacheable(args, data, hf, d.config.target_layer_ids, cfg.max_len)
            features = FeatureCache.build(target, train_data, d.config.target_layer_ids, cfg.max_len, args.device,
                                          batch_size=args.batch_size, device_bytes=device_bytes,
                                          greedy=args.greedy_labels)
            host = 0 if features.host_feats is None else features.host_feats.shape[0]
            _log(f"target features cached: {tuple(features.feats.shape)} on the GPU, {host} tokens in host memory "
                 f"({time.time() - t0:.0f} s)")
        own = dataclasses.replace(cfg, **{k: spec[k] for k in OPTIM_KEYS if k in spec})  # this drafter's optimizer
        trainers[spec["name"]] = Trainer(d, target, train_data, own, work / spec["name"], features=features,
                                         draft_vocab=draft_vocab, val_data=val_data)
        results["drafters"][spec["name"]] = {"spec": spec, "params": num_parameters(d),
                                             "optim": {k: getattr(own, k) for k in OPTIM_KEYS}}
    steps = args.steps or _plan_steps(list(trainers.values()), args.train_seconds)
    cap = None if args.steps or not args.max_epochs else epoch_cap_steps(len(train_data), cfg.batch_size,
                                                                          args.max_epochs)
    if cap is not None and steps > cap:
        _log(f"{steps} steps would fit --train-seconds {args.train_seconds:g}, but --max-epochs {args.max_epochs:g} "
             f"over {len(train_data)} sequences allows {cap}: training {cap}")
        steps = cap
    results["epoch_cap_steps"] = cap
    for tr in trainers.values():
        tr.cfg = dataclasses.replace(tr.cfg, steps=steps)
    _log(f"training {list(trainers)} for {steps} steps")
    t0 = time.time()
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(torch.device(args.device))
    # without --steps the schedule is re-planned from the measured pace to end at --train-seconds
    last = fit_together(list(trainers.values()), progress=True, deadline=t0 + args.train_seconds * 1.1,
                        budget_seconds=None if args.steps else args.train_seconds, max_steps=cap)
    if torch.device(args.device).type == "cuda":  # what --cache-reserve-gib must leave for training
        peak = torch.cuda.max_memory_allocated(torch.device(args.device))
        cached = 0 if features is None else features.feats.numel() * features.feats.element_size()
        results["train_peak_gib"] = {"allocated": round(peak / 2**30, 2), "feature_cache": round(cached / 2**30, 2)}
        _log(f"training peak GPU memory {peak / 2**30:.1f} GiB, of which the feature cache {cached / 2**30:.1f} GiB")
    for (name, tr), summary in zip(trainers.items(), last):
        export_drafter(tr.drafter, work / name / "export")
        write_dataset_draft_vocab(work / name / "export", data, target_cfg.vocab_size, lead,
                                  f"gpu_run training data {work / 'data'} (response tokens)")
        results["drafters"][name].update(final=summary, steps=tr.step, planned_steps=steps,
                                         epochs=round(tr.step * cfg.batch_size / len(train_data), 2),
                                         schedule_steps=tr.cfg.steps,
                                         train_seconds=round(time.time() - t0, 1),
                                         val=[{k: v[k] for k in ("step", "loss", "tau_proxy", "acc_mean")}
                                              for v in tr.val_history])
        _log(f"{name}: {json.dumps(summary)}")
    return trainers


def _cacheable(args, data, hf, layer_ids: tuple[int, ...], max_len: int):
    """(`data` or the seeded random part of it whose feature cache fits, the cache's bytes on the
    GPU or None for all of it): the GPU memory left after --cache-reserve-gib for training, plus
    --cache-host-gib of pinned host memory (logged; the rest of the data is not trained on)."""
    from blockdraft.training.features import sequences_that_fit

    if torch.device(args.device).type != "cuda":
        return data, None
    free, _ = torch.cuda.mem_get_info(torch.device(args.device))
    on_gpu = max(int(free - args.cache_reserve_gib * 2**30), 0)
    budget = on_gpu + int(args.cache_host_gib * 2**30)
    per_token = len(layer_ids) * hf.config.hidden_size * torch.empty((), dtype=hf.dtype).element_size()
    device_bytes = on_gpu if args.cache_host_gib > 0 else None
    keep = sequences_that_fit(data, max_len, per_token, budget, args.seed)
    if keep is None:
        return data, device_bytes
    if not keep:
        raise ValueError(f"no training sequence fits the feature cache's {budget / 2**30:.2f} GiB (free "
                         f"{free / 2**30:.1f} GiB - --cache-reserve-gib {args.cache_reserve_gib:g} + --cache-host-gib "
                         f"{args.cache_host_gib:g}): lower the reserve, add host memory or train without "
                         f"--cache-features")
    _log(f"feature cache: {len(keep)} of {len(data)} sequences fit in {budget / 2**30:.1f} GiB "
         f"(free {free / 2**30:.1f} GiB - reserve {args.cache_reserve_gib} GiB + host {args.cache_host_gib} GiB); "
         f"training on those")
    return data.select(keep), device_bytes


def _plan_steps(trainers: list, seconds: float) -> int:
    """Steps that fit in `seconds`: time 6 forward/backward passes (after 2 warm-ups) without
    updating the weights, then scale (the cosine schedule needs the total up front)."""
    lead = trainers[0]
    times = []
    for i in range(8):
        if lead.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        prep = lead.prepare(10**6 + i)
        for tr in trainers:
            loss, _ = tr.loss_on(prep)
            loss.backward()
            tr.optimizer.zero_grad(set_to_none=True)
        if lead.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    # Fastest pass + 10% (optimizer, logging): early passes are inflated by the CUDA caching
    # allocator growing its pool (the median overestimated real steps 1.7-2x on the H200).
    per_step = min(times[2:]) * 1.1
    return max(10, int(seconds / per_step))


def _evaluate(args, hf, target_cfg, lists, eos, pad, trainers: dict, work: Path, inits: dict | None = None) -> dict:
    """Greedy (T=0) and sampled (T=1) target answers to the eval prompts, then offline acceptance of
    every exported drafter (and of its int8 round trip when the spec asks for it); for each drafter
    in `inits` (name -> init_from state) also of the weights it started from (variant "init": the
    trained drafter's shape holding the init's weights, what it grew silent), and, when they have the
    same shape (not grown deeper, wider or to more feature layers), of the 0.5 / 0.5 average of the
    trained and init weights ("avg")."""
    from blockdraft.drafters.average import weighted_mean
    from blockdraft.drafters.pack import pack, unpack
    from blockdraft.spec.dflash.checkpoint import load_drafter
    from blockdraft.training.acceptance import offline_acceptance
    from blockdraft.training.build import init_from
    from blockdraft.training.generate import generate_with_hf
    from blockdraft.training.target import HFTarget
    from blockdraft.weights.save import save_safetensors

    target = HFTarget(hf)
    seqs = {}
    if args.eval_sequences:  # reuse an earlier run's target answers (same prompts, same settings)
        from safetensors import safe_open

        with safe_open(args.eval_sequences, framework="pt") as f:
            for ds in ("humaneval", "mtbench"):
                prompts = lists[ds][: args.eval_prompts]
                for temp in (0.0, 1.0):
                    ss = [f.get_tensor(f"{ds}_T{int(temp)}_{i}").long() for i in range(len(prompts))]
                    seqs[(ds, temp)] = (ss, [len(p) for p in prompts])
    for ds in ("humaneval", "mtbench") if not seqs else ():
        prompts = lists[ds][: args.eval_prompts]
        for temp in (0.0, 1.0):
            resp = generate_with_hf(hf, prompts, args.eval_max_tokens, [temp > 0] * len(prompts), eos, pad,
                                    temperature=max(temp, 1e-5), seed=args.seed + 17, batch_size=256)
            seqs[(ds, temp)] = ([torch.tensor(p + r) for p, r in zip(prompts, resp)], [len(p) for p in prompts])
    save_safetensors({f"{ds}_T{int(t)}_{i}": s.to(torch.int32) for (ds, t), (ss, _) in seqs.items() for i, s in enumerate(ss)},
                     str(work / "eval_sequences.safetensors"))
    out = {}
    specs = {s["name"]: s for s in drafter_specs(args.drafters)}
    for name, tr in trainers.items():
        export = work / name / "export"
        variants = {"bf16": load_drafter(export, target_cfg, dtype=torch.bfloat16, device=args.device)}
        spec = specs[name]
        if inits and name in inits:  # the starting point on the same sequences: the gain side by side
            variants["init"] = load_drafter(export, target_cfg, dtype=torch.bfloat16, device=args.device)
            # grown layers, MLP units and feature layers add nothing: the init's drafts
            init_from(variants["init"], inits[name], state_layer_ids=spec.get("init_target_layer_ids"))
            trained = tr.drafter.state_dict()
            shapes = lambda state: {k: tuple(v.shape) for k, v in state.items()}  # noqa: E731
            if shapes(inits[name]) == shapes(trained):  # same depth and width: also their 0.5 / 0.5 average
                variants["avg"] = load_drafter(export, target_cfg, dtype=torch.bfloat16, device=args.device)
                variants["avg"].load_weights(weighted_mean([trained, inits[name]], [0.5, 0.5], ["trained", "init"]))
        if spec.get("int8"):
            q = variants["bf16"].state_dict()
            packed = pack(q)
            save_safetensors(packed, str(work / name / "model.int8"))
            d8 = load_drafter(export, target_cfg, dtype=torch.bfloat16, device=args.device)
            d8.load_weights(unpack(packed))
            variants["int8"] = d8
        heads = {"": None}
        if args.train_vocab_size:  # also as decoding with --draft-vocab-size N runs it
            from blockdraft.spec.draft_vocab import load_draft_vocab

            heads[f"-dv{args.train_vocab_size}"] = load_draft_vocab(export, args.train_vocab_size, target_cfg.vocab_size)
        for (vname, d), (suffix, dv) in ((v, h) for v in variants.items() for h in heads.items()):
            vname = vname + suffix
            for (ds, temp), (ss, starts) in seqs.items():
                r = offline_acceptance(d, target, ss, starts, eos, batch_size=8, draft_vocab=dv)
                out[f"{name}/{vname}/{ds}/T{int(temp)}"] = {k: v for k, v in r.items() if k != "per_sequence"}
                tau = "n/a" if r["acceptance_length"] is None else f"{r['acceptance_length']:.3f}"  # no step: None
                _log(f"{name}/{vname} {ds} T={temp}: acceptance length {tau}")
    return out


def main(argv=None) -> int:
    from blockdraft.training.trainer import DEFAULT_MAX_EPOCHS

    p = argparse.ArgumentParser(prog="python -m blockdraft.training.gpu_run", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prep", allow_abbrev=False)
    a.add_argument("--target", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--num-prompts", type=int, default=100000)
    a.add_argument("--max-prompt-tokens", type=int, default=512)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--later-turns", type=int, default=0,
                   help="also this many multi-turn prompts (ShareGPT prefixes ending in a later user turn)")
    r = sub.add_parser("run", allow_abbrev=False)
    r.add_argument("--gguf", required=True)
    r.add_argument("--prep", required=True, help="folder written by `prep`")
    r.add_argument("--work", required=True)
    r.add_argument("--drafters", required=True, help='JSON list of {"name", "num_layers", "intermediate_size", '
                   '"num_feature_layers", "int8" (also evaluate the 8-bit pack), "norm_from_target" (final norm '
                   'starts as the target\'s), "init_from" (fp32 drafter.safetensors to continue from, possibly '
                   'shallower, narrower or reading fewer target layers, whose ids must be among this drafter\'s: '
                   'new layers, units and fc columns start at zero), "init_target_layer_ids" (the target layers '
                   'init_from\'s fc reads, in order; default: the "num_feature_layers" rule for its fc width, as '
                   'new drafters pick them), and optimizer settings of that drafter alone: "lr", "gamma", '
                   '"warmup_frac", "min_lr_ratio", "weight_decay", "grad_clip"}; all train in lockstep on the same batches')
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--num-prompts", type=int, default=100000)
    r.add_argument("--sampled-fraction", type=float, default=0.25)
    r.add_argument("--max-new-tokens", type=int, default=384)
    r.add_argument("--gen-batch", type=int, default=512)
    r.add_argument("--gen-seconds", type=float, default=270)
    r.add_argument("--extend-seconds", type=float, default=0,
                   help="after the answers --work holds (kept from earlier runs, or this run's first --gen-seconds "
                        "of answers): answer prompts not in them yet and add them as the next shard, until this "
                        "many seconds after the extension began (--synth-seconds of request sampling count in "
                        "it: session 9 sampled 248 of 360 s, leaving 109 s to answer)")
    r.add_argument("--resample", action="store_true",
                   help="with --extend-seconds, after the prompts not answered yet (and the synthesized ones): answer "
                        "every prompt answered so far (synthesized ones included) again, all sampled at T = 0.7 with a "
                        "new seed, those with the fewest answers first (more data from the same prompts)")
    r.add_argument("--gen-engine", action="store_true",
                   help="answer with our engine (continuous batching, CUDA graphs) instead of transformers generate")
    r.add_argument("--gen-max-seqs", type=int, default=512, help="--gen-engine: requests answered at once")
    r.add_argument("--synth-samples", type=int, default=0,
                   help="with --extend-seconds and --gen-engine: sample this many user requests from the target's "
                        "pre-query template (Magpie; training/synth.py), filter them like ShareGPT prompts and "
                        "answer them after the prompts not answered yet")
    r.add_argument("--synth-openers", choices=("none", "general"), default="none",
                   help="--synth-samples: 'general' starts the requests with generic English openers in turn "
                        "('Write', 'Explain', 'Imagine you are', ...; training/synth.py GENERAL_OPENERS) to steer a "
                        "coder target towards other kinds of requests; 'none': the bare template (Magpie)")
    r.add_argument("--synth-seconds", type=float, default=60, help="time limit of the request sampling")
    r.add_argument("--synth-max-tokens", type=int, default=256, help="longest synthesized request (tokens)")
    r.add_argument("--max-prompt-tokens", type=int, default=512, help="synthesized requests longer than this "
                   "once chat-encoded are dropped (as prep drops long ShareGPT prompts)")
    r.add_argument("--train-seconds", type=float, default=420)
    r.add_argument("--steps", type=int, default=None, help="optimizer steps (default: as many as fit --train-seconds "
                   "and --max-epochs)")
    r.add_argument("--max-epochs", type=float, default=DEFAULT_MAX_EPOCHS,
                   help="without --steps: train at most this many passes over the training sequences, even when "
                        "--train-seconds would allow more (0: no cap; trainer.epoch_cap_steps says why: 11.4 passes "
                        "over too little data lost held-out acceptance in session 33)")
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--max-len", type=int, default=1024)
    r.add_argument("--num-anchors", type=int, default=64)
    r.add_argument("--lr", type=float, default=6e-4)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--eval-prompts", type=int, default=1000)
    r.add_argument("--eval-max-tokens", type=int, default=256)
    r.add_argument("--eval-sequences", default=None, help="reuse eval_sequences.safetensors of an earlier run")
    r.add_argument("--warmup-frac", type=float, default=0.04)
    r.add_argument("--cache-features", action="store_true", help="compute the target features once (FeatureCache)")
    r.add_argument("--ckpt-every", type=int, default=0,
                   help="steps between checkpoints (0: at the end only); a lent GPU can be taken back mid-run")
    r.add_argument("--cache-reserve-gib", type=float, default=64.0,
                   help="GPU memory (GiB) kept free for training beside the feature cache; data beyond what "
                        "fits is left out (a seeded random part is kept)")
    r.add_argument("--cache-host-gib", type=float, default=0.0,
                   help="with --cache-features: pinned host memory (GiB) for the part of the feature cache the GPU "
                        "cannot hold (copied to the GPU per batch); 0: the GPU's part only")
    r.add_argument("--greedy-labels", action="store_true",
                   help="label each draft slot with the target's greedy continuation from the block's start "
                        "(argmax next tokens, computed with the features) instead of the answer's tokens: the same "
                        "for greedy answers, what verification accepts for sampled ones (TrainConfig.greedy_labels)")
    r.add_argument("--train-vocab-size", type=int, default=0, help="loss over the N most frequent answer tokens (0: all)")
    r.add_argument("--val-fraction", type=float, default=0.0,
                   help="hold out this share of the answers (seeded by --seed; at least 1, at most 512 sequences), "
                        "not trained on, and validate every drafter on them during training: results' "
                        "drafters.NAME.val curve and train_log.jsonl lines with \"split\": \"val\" (0: off)")
    r.add_argument("--val-every", type=int, default=None,
                   help=f"with --val-fraction: steps between validations, also one before the first step and one "
                        f"after the last (default {VAL_EVERY_LOGS * LOG_EVERY}: every {VAL_EVERY_LOGS}th log line)")
    args = p.parse_args(argv)
    if args.cmd == "run" and not 0 <= args.cache_host_gib < float("inf"):
        p.error(f"--cache-host-gib must be a number >= 0 (GiB), got {args.cache_host_gib:g}")
    if args.cmd == "run" and args.cache_host_gib and not args.cache_features:
        p.error("--cache-host-gib holds part of the feature cache: it needs --cache-features")
    if args.cmd == "run" and not 0 <= args.max_epochs < float("inf"):
        p.error(f"--max-epochs must be a number >= 0 (passes over the data; 0: no cap), got {args.max_epochs:g}")
    if args.cmd == "run":
        try:
            check_val_settings(args.val_fraction, args.val_every)
        except ValueError as e:
            p.error(str(e))
    if args.cmd == "run" and args.synth_samples and not args.gen_engine:
        p.error("--synth-samples needs --gen-engine (the requests are sampled by our engine)")
    if args.cmd == "run" and args.synth_openers != "none" and not args.synth_samples:
        p.error(f"--synth-openers {args.synth_openers} steers synthesized requests: it needs --synth-samples N")
    if args.cmd == "prep":
        print(json.dumps(prep(args.target, Path(args.out), args.num_prompts, args.max_prompt_tokens, args.seed,
                              later_turns=args.later_turns)))
    else:
        print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
