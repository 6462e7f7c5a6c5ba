"""`blockdraft train-drafter` refuses bad flags, mismatched data and too-short prompt limits with
messages that name the flag (as the user spells it), the value and what to do."""

from pathlib import Path

import pytest

import blockdraft.llm
import blockdraft.model_loader
from blockdraft.cli import main
from blockdraft.drafters import SHIPPED_DIR
from tests.training.test_train_drafter_e2e import NAME, _cached

pytestmark = [] if _cached() else [pytest.mark.slow]


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if the target's weights load (every check here comes before them)."""
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))


def _error(capsys, *flags) -> str:
    assert main(["train-drafter", "--target", NAME, "--tiny", *flags]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--num-anchors", "0"], "--num-anchors must be an integer >= 1, got 0"),
    (["--log-every", "0"], "--log-every must be an integer >= 1, got 0"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--block-size", "1"], "--block-size must be an integer >= 2, got 1"),
    (["--block-size", "100000"], "--block-size must be <= 64 (released DFlash drafters use 8-16"),
    (["--max-len", "1"], "--max-len must be an integer >= 2, got 1"),
    (["--ckpt-every", "-1"], "--ckpt-every must be an integer >= 0, got -1"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
    (["--mask-token-id", "49152"], "--mask-token-id must be in [0, 49152) (this target's vocabulary), got 49152"),
    (["--mask-token-id", "2"], ("--mask-token-id 2 is '<|im_end|>', a special token the training data holds "
                                "(chat markers, end of sequence); pick an id that never occurs in the data, or "
                                "leave the flag out (this target's default: 16)")),
    (["--init-from", "shipped", "--intermediate-size", "256"],
     "--intermediate-size 256 is below the --init-from drafter's 1536"),
    (["--init-from", "shipped", "--block-size", "8"], "--block-size 8 differs from the --init-from drafter's 16"),
    (["--init-from", "shipped", "--num-layers", "2"], "--num-layers 2 is below the --init-from drafter's 3 layers"),
    (["--init-from", "shipped", "--num-feature-layers", "2"],  # the shipped SmolLM2 drafter reads [1, 14, 27]
     "--num-feature-layers 2 is below the --init-from drafter's 3 (target_layer_ids [1, 14, 27]; "),
    (["--init-from", "shipped", "--num-feature-layers", "2"], "): feature layers can be added, not removed"),
    (["--init-from", "shipped", "--num-feature-layers", "4"],  # more, but without layer 14
     "--num-feature-layers 4 reads target layers [1, 10, 18, 27], which lack [14] of the --init-from drafter's "
     "target_layer_ids [1, 14, 27]"),
    (["--init-from", "shipped", "--num-feature-layers", "4"],
     "feature layers can be added, not moved; counts whose ids hold them on this 30-layer target: [5, 7, 9"),
    (["--init-from", "shipped", "--num-feature-layers", "0"], "--num-feature-layers must be an integer >= 1, got 0"),
    (["--init-from", "shipped", "--num-layers", "-1"], "--num-layers must be an integer >= 1, got -1"),
    (["--init-from", "/nonexistent/drafter"], "drafter folder '/nonexistent/drafter' does not exist"),
    (["--init-from", str(SHIPPED_DIR / "qwen2.5-coder-0.5b-instruct")],  # another target's drafter
     "drafter hidden_size 896 != target hidden_size 576; a DFlash drafter works only with the target"),
    (["--num-feature-layers", "30"], "--num-feature-layers must be at most 29 (distinct layers below the last of "
                                     "this target's 30), got 30"),
    (["--synth-openers", "general"], "--synth-openers general steers the requests --synth-prompts N has the target "
                                     "write: it needs --synth-prompts N > 0 (got 0; leave --synth-openers out"),
    (["--val-fraction", "-0.1"], "--val-fraction must be a number in [0, 1) (the share of the answers held out for "
                                 "validation; 0: none), got -0.1"),
    (["--val-fraction", "1"], "--val-fraction must be a number in [0, 1) (the share of the answers held out for "
                              "validation; 0: none), got 1.0"),
    (["--val-fraction", "0.2", "--val-every", "0"], "--val-every must be an integer >= 1 (steps between validations), "
                                                    "got 0"),
    (["--val-every", "5"], "--val-every 5 validates on the answers --val-fraction F holds out: it needs "
                           "--val-fraction F > 0 (got 0.0)"),
])
def test_bad_values_name_the_flag(flags, message, tmp_path, capsys, no_weights):
    err = _error(capsys, "--out", str(tmp_path), *flags)
    assert message in err
    assert "dflash_config" not in err and "batch_size" not in err


def test_an_init_drafter_whose_mask_is_a_chat_marker_is_named(tmp_path, capsys, no_weights):
    import json
    import shutil

    init = tmp_path / "init"
    shutil.copytree(SHIPPED_DIR / NAME, init)
    cfg = json.loads((init / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = 1
    (init / "config.json").write_text(json.dumps(cfg))
    err = _error(capsys, "--out", str(tmp_path / "out"), "--init-from", str(init))
    assert "the --init-from drafter's mask_token_id 1 is '<|im_start|>', a special token" in err
    assert "or start from another drafter (this target's default: 16)" in err


def test_chat_markers_are_refused_even_where_transformers_does_not_name_them_special():
    """Qwen2.5's tokenizer leaves <|im_start|> out of all_special_ids; the chat template writes it."""
    from blockdraft.preflight import read_target_config
    from blockdraft.training.pipeline import check_mask_token
    from blockdraft.weights.loader import load_tokenizer

    path, _, config = read_target_config(NAME, None)
    tok = load_tokenizer(path)

    class Unnamed:  # the same tokenizer, with no named special tokens
        all_special_ids: list = []

        def __getattr__(self, name):
            return getattr(tok, name)

    for marker in (1, 2):  # <|im_start|>, <|im_end|>
        with pytest.raises(ValueError, match=f"--mask-token-id {marker} is "):
            check_mask_token(marker, Unnamed(), config)
    check_mask_token(16, Unnamed(), config)  # the default (<empty_output>) never occurs in the data

    class Refusing(Unnamed):  # a template that raises on the probe conversation: no markers found
        def apply_chat_template(self, *a, **k):
            from jinja2 import TemplateError

            raise TemplateError("no assistant turns here")

    check_mask_token(1, Refusing(), config)  # nothing to go on but the named specials (none here)


@pytest.mark.parametrize("below", ["", "sub"])
def test_out_that_is_or_sits_under_a_file_is_refused(below, tmp_path, capsys, no_weights):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    out = file / below if below else file
    err = _error(capsys, "--out", str(out))
    assert f"--out {str(out)!r}: {str(file)!r} is a file" in err


class _Loading(Exception):
    """Raised where the target's weights would load: every check before it passed."""


def _dataset(folder, info, ids=(1, 2, 3, 4, 5)):
    from blockdraft.training.dataset import TokenDataset

    TokenDataset.from_pairs([(list(ids[:2]), list(ids[2:]))] * 2, [False, True], info).save(folder)


def _settings(**changes):
    from blockdraft.training.pipeline import DATA_SETTINGS, TINY

    return {**{k: TINY[k] for k in DATA_SETTINGS}, **changes}


def _made_here(folder, dtype="float32", seed=None, **changes):
    """A dataset as `train-drafter --tiny` with `changes` records it for SmolLM2, answered in `dtype`
    with `seed` (None: not recorded, as in data made before it was)."""
    _dataset(folder, {"target": NAME, "vocab_size": 49152, "settings": _settings(**changes),
                      **({"dtype": dtype} if dtype else {}), **({"seed": seed} if seed is not None else {})})


def test_data_made_for_another_target_is_refused_before_an_index_error(tmp_path, capsys, no_weights):
    data = tmp_path / "qwen-data"
    _dataset(data, {"target": "qwen2.5-coder-0.5b-instruct", "vocab_size": 151936}, ids=(151644, 872, 151643, 9, 151645))
    err = _error(capsys, "--out", str(tmp_path / "run"), "--data", str(data))
    assert (f"the dataset in {data} was made with target 'qwen2.5-coder-0.5b-instruct', vocab size 151936, token ids "
            f"9..151645; this run asks for target '{NAME}', vocab size 49152, token ids in [0, 49152)") in err
    assert f"use a new --out (or another --data folder), or remove {data} to generate it again" in err
    assert not (tmp_path / "run").exists()
    _dataset(tmp_path / "bare", {}, ids=(1, 2, 60000, 3, 4))  # nothing recorded: the ids alone are checked
    assert "was made with token ids 1..60000; this run asks for token ids in [0, 49152)" in _error(
        capsys, "--out", str(tmp_path / "run"), "--data", str(tmp_path / "bare"))


def test_data_settings_that_differ_from_the_runs_own_data_are_refused(tmp_path, capsys, no_weights):
    _made_here(tmp_path / "data")
    err = _error(capsys, "--out", str(tmp_path), "--synth-prompts", "8")  # was silently ignored
    assert (f"the dataset in {tmp_path / 'data'} was made with --synth-prompts 0; this run asks for --synth-prompts 8. "
            f"A dataset is reused only for the same target, --dtype and data settings: use a new --out, or remove "
            f"{tmp_path / 'data'} to generate it again") in err
    assert main(["train-drafter", "--target", NAME, "--out", str(tmp_path)]) == 2  # the defaults, not --tiny's
    assert "--num-prompts 8, --max-prompt-tokens 128, --max-new-tokens 16; this run asks for --num-prompts 2000, " \
           "--max-prompt-tokens 512, --max-new-tokens 256" in capsys.readouterr().err


def test_the_same_runs_data_is_reused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    _made_here(tmp_path / "data", num_prompts=4)
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--num-prompts", "4",
              "--steps", "9", "--lr", "1e-3"])  # training settings may change
    assert (f"train-drafter: reusing the 2 sequences in {tmp_path / 'data'} (target '{NAME}', dtype float32, "
            f"num_prompts=4, max_prompt_tokens=128, max_new_tokens=16, synth_prompts=0, synth_openers=general, "
            f"sampled_fraction=0.25)") in \
        capsys.readouterr().err


def test_a_full_size_cpu_run_says_its_size_before_the_target_loads(tmp_path, capsys, monkeypatch):
    """A bare train-drafter on the CPU is a real run: it says what it will do and how to make a
    smoke run, before loading; --tiny says nothing of it."""
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--out", str(tmp_path / "full"), "--device", "cpu"])
    assert ("train-drafter: a full run on the CPU: the target answers 2000 prompts (up to 256 tokens each), then "
            "2000 training steps of 8 sequences; that can take hours on a CPU (the shipped drafters trained on a "
            "GPU: --device cuda). --tiny is a smoke run of seconds") in capsys.readouterr().err
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path / "tiny"), "--device", "cpu"])
    assert "a full run on the CPU" not in capsys.readouterr().err
    _made_here(tmp_path / "reuse" / "data", num_prompts=4)  # a dataset to reuse: only the training is left
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--out", str(tmp_path / "reuse"), "--device", "cpu",
              "--num-prompts", "4", "--max-prompt-tokens", "128", "--max-new-tokens", "16"])
    assert "a full run on the CPU: 2000 training steps of 8 sequences; that can take hours" in capsys.readouterr().err


def test_the_runs_data_answered_in_another_dtype_is_refused_with_no_resume_too(tmp_path, capsys, no_weights,
                                                                               monkeypatch):
    """--no-resume starts the training over but reuses OUT/data: answers made in float32 are not
    silently trained on in bfloat16 (greedy answers differ at near-ties); refused naming both,
    before any weights load (an --init-from drafter's neither)."""
    import blockdraft.spec.dflash.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "load_drafter", lambda *a, **k: pytest.fail("drafter weights loaded before the check"))
    data = tmp_path / "data"
    _made_here(data)  # answered in float32, as --tiny on the CPU with --dtype auto
    before = _files(tmp_path)
    fix = (f"A dataset is reused only for the same target, --dtype and data settings: use a new --out, or remove {data} to "
           f"generate it again, or pass --dtype float32 to train on its answers")
    # a run that resumes but holds no checkpoint yet gets the same check
    for flags in (["--no-resume"], [], ["--no-resume", "--init-from", "shipped"]):
        err = _error(capsys, "--out", str(tmp_path), "--device", "cpu", "--dtype", "bfloat16", *flags)
        assert f"the dataset in {data} was made with --dtype float32; this run asks for --dtype bfloat16. {fix}" in err
    _made_here(data, dtype="bfloat16")  # --dtype auto is named with what it resolved to
    err = _error(capsys, "--out", str(tmp_path), "--device", "cpu", "--no-resume")
    assert (f"was made with --dtype bfloat16; this run asks for --dtype auto (float32 on cpu). A dataset is reused "
            f"only for the same target, --dtype and data settings: use a new --out, or remove {data} to generate it again, "
            f"or pass --dtype bfloat16 to train on its answers") in err
    # another difference too: --dtype alone would not do, so it is not offered
    err = _error(capsys, "--out", str(tmp_path), "--device", "cpu", "--no-resume", "--synth-prompts", "8")
    assert (f"was made with --synth-prompts 0, --dtype bfloat16; this run asks for --synth-prompts 8, --dtype auto "
            f"(float32 on cpu). A dataset is reused only for the same target, --dtype and data settings: use a new --out, or "
            f"remove {data} to generate it again") in err and "or pass --dtype" not in err
    _made_here(data)
    assert _files(tmp_path) == before  # nothing written


def test_the_runs_data_made_with_another_seed_is_refused(tmp_path, capsys, monkeypatch):
    """--seed chose the prompts and seeded the sampled answers of OUT/data: a rerun with another
    --seed (--no-resume or not) was silently trained on the old seed's data; now refused naming
    both seeds and the ways on, before any weights load. The same seed reuses it."""
    data = tmp_path / "data"
    _made_here(data, seed=0)
    before = _files(tmp_path)
    with monkeypatch.context() as mp:
        mp.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
        for flags in ([], ["--no-resume"]):
            err = _error(capsys, "--out", str(tmp_path), "--device", "cpu", "--seed", "5", *flags)
            assert (f"the dataset in {data} was made with --seed 0; this run asks for --seed 5. A dataset is reused "
                    f"only for the same target, --dtype, data settings and --seed: use a new --out, or remove {data} to "
                    f"generate it again, or pass --seed 0 to train on its answers (or --data {data} to train on them "
                    f"with --seed 5)") in err
        # another difference too: --seed alone would not do, so it is not offered
        err = _error(capsys, "--out", str(tmp_path), "--device", "cpu", "--seed", "5", "--synth-prompts", "8")
        assert "was made with --synth-prompts 0, --seed 0; this run asks for --synth-prompts 8, --seed 5." in err
        assert "or pass --seed" not in err
    assert _files(tmp_path) == before  # nothing written
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    with pytest.raises(_Loading):  # --seed 0 is the default
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert f"reusing the 2 sequences in {data} (target '{NAME}', dtype float32, " in err and "seed=0)" in err
    assert "seeds this run's training only" not in err


def test_a_data_folder_made_with_another_seed_is_reused_and_said(tmp_path, capsys, monkeypatch):
    """A --data folder keeps its answers (sharing them across runs is what it is for): another
    --seed then seeds only the training, said on stderr."""
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    data = tmp_path / "shared"
    _made_here(data, seed=0)
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path / "run"), "--data", str(data),
              "--device", "cpu", "--seed", "5"])
    err = capsys.readouterr().err
    assert f"reusing the 2 sequences in {data}" in err
    assert (f"train-drafter: the prompts and sampled answers in {data} were made with --seed 0; --seed 5 seeds this "
            f"run's training only") in err


@pytest.mark.parametrize("flags", [["--dtype", "float32"], []])  # auto resolves to float32 on the CPU
def test_the_runs_data_is_reused_with_no_resume_in_its_dtype(flags, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    _made_here(tmp_path / "data")
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu", "--no-resume",
              *flags])
    err = capsys.readouterr().err
    assert f"train-drafter: reusing the 2 sequences in {tmp_path / 'data'} (target '{NAME}', dtype float32, " in err
    assert "warning" not in err


def test_data_that_records_no_dtype_is_reused_with_a_warning(tmp_path, capsys, monkeypatch):
    """Made before the dtype was recorded: it may have been either, so it is reused as before, said
    on stderr with the folder and how to answer again."""
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    data = tmp_path / "data"
    _made_here(data, dtype=None)
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu", "--no-resume",
              "--dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert f"reusing the 2 sequences in {data} (target '{NAME}', dtype not recorded, " in err
    assert (f"train-drafter: warning: {data} does not record the dtype its answers were made in; this run trains with "
            f"the target in bfloat16: if it answered in another, those answers are used as they are (remove {data} "
            f"or use a new --out to answer again in bfloat16)") in err


def test_a_data_folder_is_held_to_an_explicit_dtype_only(tmp_path, capsys, monkeypatch):
    """A --data folder keeps what it was made with unless a flag asks otherwise (as its data flags):
    an explicit --dtype must match; --dtype auto resolving to another dtype is said on stderr."""
    data = tmp_path / "shared"
    _made_here(data, dtype="bfloat16")
    with monkeypatch.context() as mp:
        mp.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
        err = _error(capsys, "--out", str(tmp_path / "run"), "--data", str(data), "--device", "cpu", "--dtype", "float32")
    assert (f"the dataset in {data} was made with --dtype bfloat16; this run asks for --dtype float32. A dataset is "
            f"reused only for the same target, --dtype and data settings: use a new --out (or another --data folder), or "
            f"remove {data} to generate it again, or pass --dtype bfloat16 to train on its answers") in err
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path / "run"), "--data", str(data),
              "--device", "cpu"])
    assert (f"train-drafter: warning: the answers in {data} were made with the target in bfloat16; this run trains "
            f"it in float32 (--dtype auto on cpu): pass --dtype bfloat16 to train in the dtype that answered") in \
        capsys.readouterr().err


def test_a_data_folder_keeps_its_settings_unless_a_flag_asks_for_others(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    data = tmp_path / "shared"
    _made_here(data, num_prompts=4, max_new_tokens=8)
    with pytest.raises(_Loading):  # --tiny's presets (8 prompts, 16 new tokens) are not asked for explicitly
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path / "run"), "--data", str(data)])
    assert f"reusing the 2 sequences in {data}" in capsys.readouterr().err
    assert (f"was made with --max-new-tokens 8; this run asks for --max-new-tokens 32. A dataset is reused only for "
            f"the same target, --dtype and data settings: use a new --out (or another --data folder), or remove {data}") in \
        _error(capsys, "--out", str(tmp_path / "run"), "--data", str(data), "--max-new-tokens", "32")


def test_a_bad_synth_openers_gets_argparses_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train-drafter", "--target", NAME, "--tiny", "--synth-openers", "chat"])
    assert exited.value.code == 2
    assert "argument --synth-openers: invalid choice: 'chat' (choose from 'none', 'general')" in capsys.readouterr().err


@pytest.mark.parametrize("asked, openers", [([], "general"), (["--synth-openers", "none"], "none")])
def test_synth_openers_reach_the_synthesis_and_the_dataset_records_them(asked, openers, tmp_path, monkeypatch):
    """The requests --synth-prompts samples start with GENERAL_OPENERS by default, bare with none;
    the value is a data setting of the dataset (no model: the engine and the sampling are faked)."""
    from argparse import Namespace
    from types import SimpleNamespace

    from blockdraft.cli import _parser
    from blockdraft.training import generate, synth
    from blockdraft.training.dataset import TokenDataset
    from blockdraft.training.pipeline import build_dataset, resolve_settings

    args = _parser().parse_args(["train-drafter", "--tiny", "--out", str(tmp_path), "--synth-prompts", "2", *asked])
    settings = resolve_settings(args)
    seen = {}

    def fake_synthesize(llm, num_samples, eval_texts, **kw):
        seen.update(num_samples=num_samples, openers=kw.get("openers", ("",)))
        return [], {"sampled": num_samples}

    monkeypatch.setattr(blockdraft.llm, "LLM", lambda **kw: object())
    monkeypatch.setattr(synth, "synthesize_prompts", fake_synthesize)
    monkeypatch.setattr(generate, "generate_with_engine", lambda llm, prompts, *a, **kw: [[3, 4]] * len(prompts))
    target = SimpleNamespace(tokenizer=None, config=SimpleNamespace(vocab_size=49152))
    build_dataset(target, settings, Namespace(target=NAME, dtype="float32", seed=0, max_num_seqs=None),
                  tmp_path / "data", "path", ([[1, 2]], {}, []))
    assert seen == {"num_samples": 2, "openers": synth.GENERAL_OPENERS if openers == "general" else ("",)}
    info = TokenDataset.load(tmp_path / "data").info
    assert info["settings"]["synth_openers"] == openers
    assert info["prompt_stats"]["synthesized"]["openers"] == len(seen["openers"])


@pytest.mark.parametrize("recorded", ["none", None])  # None: made before --synth-openers (its requests were bare)
def test_data_synthesized_with_other_openers_is_refused_by_name(recorded, tmp_path, capsys, monkeypatch):
    made = _settings(synth_prompts=8, synth_openers=recorded)
    if recorded is None:
        del made["synth_openers"]
    _dataset(tmp_path / "data", {"target": NAME, "vocab_size": 49152, "settings": made, "dtype": "float32"})
    with monkeypatch.context() as mp:
        mp.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
        err = _error(capsys, "--out", str(tmp_path), "--device", "cpu", "--synth-prompts", "8")
    assert (f"the dataset in {tmp_path / 'data'} was made with --synth-openers none; this run asks for --synth-openers "
            f"general. A dataset is reused only for the same target, --dtype and data settings") in err
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    with pytest.raises(_Loading):  # the openers it was made with
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu",
              "--synth-prompts", "8", "--synth-openers", "none"])
    assert f"reusing the 2 sequences in {tmp_path / 'data'}" in capsys.readouterr().err


@pytest.mark.parametrize("recorded", ["none", None])
def test_data_without_synthesized_requests_is_reused_whatever_the_openers(recorded, tmp_path, capsys, monkeypatch):
    """synth_prompts 0 in the dataset and in the run: the openers steered nothing, so the default
    (general) reuses a dataset made with none, or made before the flag (no synth_openers recorded)."""
    made = _settings(synth_openers=recorded)
    if recorded is None:
        del made["synth_openers"]
    _dataset(tmp_path / "data", {"target": NAME, "vocab_size": 49152, "settings": made, "dtype": "float32"})
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu"])
    assert f"reusing the 2 sequences in {tmp_path / 'data'}" in capsys.readouterr().err


def test_data_settings_differences_reads_old_datasets_as_bare_openers():
    from blockdraft.training.dataset import data_settings_differences as differences

    old = {"synth_prompts": 8, "num_prompts": 4}  # made before --synth-openers
    assert differences(old, {"synth_prompts": 8, "synth_openers": "general"}) == [("synth_openers", "none", "general")]
    assert differences(old, {"synth_prompts": 8, "synth_openers": "none"}) == []
    assert differences({"synth_prompts": 0}, {"synth_prompts": 0, "synth_openers": "general"}) == []
    assert differences({"synth_prompts": 0}, {"synth_openers": "general"}) == []  # --data: its 0 stands
    made = {"synth_prompts": 0, "synth_openers": "none"}
    assert differences(made, {"synth_prompts": 4, "synth_openers": "general"}) == [
        ("synth_prompts", 0, 4), ("synth_openers", "none", "general")]
    assert differences({}, {"synth_openers": "general"}) == []  # nothing recorded: nothing compared


def test_a_max_prompt_tokens_that_keeps_no_prompt_is_named(tmp_path, capsys, no_weights):
    import re

    err = _error(capsys, "--out", str(tmp_path), "--max-prompt-tokens", "8")  # was "no prompts given"
    # --tiny's 8 prompts, read as 16 candidates: the message says which count is which
    assert re.search(r"--max-prompt-tokens 8 keeps none of the 16 ShareGPT prompts read as candidates for "
                     r"--num-prompts 8 \(up to twice as many, to allow for drops\): each is longer once chat-encoded "
                     r"\(the shortest has (\d\d+) tokens\); raise --max-prompt-tokens to at least \1", err), err
    assert "drops all 16 prompts" not in err


def test_fewer_prompts_than_asked_for_are_said(capsys):
    from argparse import Namespace

    from blockdraft.preflight import read_target_config
    from blockdraft.training import corpora
    from blockdraft.training.generate import encode_prompts
    from blockdraft.training.pipeline import select_training_prompts
    from blockdraft.training.prompts import select_prompts
    from blockdraft.weights.loader import load_tokenizer

    tokenizer = load_tokenizer(read_target_config(NAME, None)[0])
    texts = select_prompts(corpora.sharegpt_first_turns(None), corpora.all_eval_texts(None), 16, seed=0)[0]
    limit = min(len(ids) for ids in encode_prompts(tokenizer, texts, 10**9)[0])  # keeps the shortest only (or ties)
    settings = {"num_prompts": 8, "max_prompt_tokens": limit}
    prompts, stats, _ = select_training_prompts(tokenizer, settings, Namespace(cache_dir=None, seed=0))
    assert 1 <= len(prompts) < 8 and stats["used"] == len(prompts)
    assert (f"train-drafter: --max-prompt-tokens {limit} keeps {len(prompts)} of the 16 ShareGPT prompts read as "
            f"candidates for --num-prompts 8 (up to twice as many, to allow for drops): the data comes from "
            f"{len(prompts)} prompts, not 8; raise --max-prompt-tokens for more") in capsys.readouterr().err


def test_prompts_dropped_for_length_are_counted():
    from argparse import Namespace

    from blockdraft.preflight import read_target_config
    from blockdraft.training import corpora
    from blockdraft.training.generate import encode_prompts
    from blockdraft.training.pipeline import select_training_prompts
    from blockdraft.training.prompts import select_prompts
    from blockdraft.weights.loader import load_tokenizer

    tokenizer = load_tokenizer(read_target_config(NAME, None)[0])
    n, limit = 8, 128
    args, settings = Namespace(cache_dir=None, seed=0), {"num_prompts": n, "max_prompt_tokens": limit}
    prompts, stats, _ = select_training_prompts(tokenizer, settings, args)
    texts = select_prompts(corpora.sharegpt_first_turns(None), corpora.all_eval_texts(None), 2 * n, seed=0)[0]
    lengths = [len(ids) for ids in encode_prompts(tokenizer, texts, 10**9)[0]]
    short = [i for i, length in enumerate(lengths) if length <= limit]
    read = short[n - 1] + 1  # texts read until n were kept
    assert read > n  # some of them are too long
    assert stats["over_max_prompt_tokens"] == read - n and stats["used"] == len(prompts) == n
    assert prompts == [encode_prompts(tokenizer, [texts[i]], limit)[0][0] for i in short[:n]]


def _files(folder) -> dict:
    """Every file under `folder` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resume_in_another_target_dtype_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """A float32 run resumed in bfloat16 (e.g. moved to a GPU with --dtype auto) would mix features of both
    precisions: refused naming both, the folder untouched; an auto that resolves to float32 resumes."""
    import json
    import shutil

    from blockdraft.training.trainer import Trainer

    out = tmp_path / "run"

    def run(*flags, folder=out):
        return main(["train-drafter", "--target", NAME, "--tiny", "--out", str(folder), "--num-prompts", "4",
                     "--max-new-tokens", "8", "--steps", "2", "--ckpt-every", "1", *flags])

    class Interrupted(Exception):
        pass

    def save_then_stop(self):  # the run stops right after its step-1 checkpoint
        save(self)
        raise Interrupted

    save = Trainer.save_checkpoint
    with monkeypatch.context() as mp:
        mp.setattr(Trainer, "save_checkpoint", save_then_stop)
        with pytest.raises(Interrupted):
            run("--device", "cpu", "--dtype", "float32")
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 1 and state["target_dtype"] == "float32"
    capsys.readouterr()

    before = _files(out)
    assert "checkpoint/drafter.safetensors" in before
    with monkeypatch.context() as mp:
        mp.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
        assert run("--device", "cpu", "--dtype", "bfloat16") == 2
        assert (f"the run in {out} was trained with the target in float32 (its checkpoint); this run asks for "
                f"--dtype bfloat16: continue it (or rerun it if finished) with --dtype float32, or use a new --out to train in bfloat16") in \
            capsys.readouterr().err
        # --no-resume starts the training over, not the answers: its data/ records float32 (build_dataset)
        assert run("--device", "cpu", "--dtype", "bfloat16", "--no-resume") == 2
        assert (f"the dataset in {out / 'data'} was made with --dtype float32; this run asks for --dtype bfloat16. "
                f"A dataset is reused only for the same target, --dtype and data settings: use a new --out, or remove "
                f"{out / 'data'} to generate it again, or pass --dtype float32 to train on its answers") in \
            capsys.readouterr().err
        mp.setattr("torch.cuda.is_available", lambda: True)  # the run moved to a GPU, --dtype auto
        assert run() == 2
        assert "this run asks for --dtype auto (bfloat16 on cuda): continue it (or rerun it if finished) with --dtype float32" in \
            capsys.readouterr().err
    assert _files(out) == before  # nothing written, renamed or removed

    # a checkpoint written before the dtype was recorded is not checked, but its data/ still is
    old = tmp_path / "old"
    shutil.copytree(out, old)
    del state["target_dtype"]
    (old / "checkpoint" / "state.json").write_text(json.dumps(state))
    with monkeypatch.context() as mp:
        mp.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
        assert run("--device", "cpu", "--dtype", "bfloat16", folder=old) == 2
        assert f"the dataset in {old / 'data'} was made with --dtype float32" in capsys.readouterr().err
    # ... and where the data records none either (both made before), the run resumes as before, warned
    from blockdraft.training.dataset import TokenDataset

    data = TokenDataset.load(old / "data")
    del data.info["dtype"]
    data.save(old / "data")
    with monkeypatch.context() as mp:
        mp.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
        with pytest.raises(_Loading):
            run("--device", "cpu", "--dtype", "bfloat16", folder=old)
    assert f"train-drafter: warning: {old / 'data'} does not record the dtype its answers were made in (generator: " \
           f"'blockdraft engine')" in capsys.readouterr().err

    # --dtype auto on the CPU resolves to the recorded float32: the run resumes and finishes
    assert run("--device", "cpu") == 0
    captured = capsys.readouterr()
    assert f"train-drafter: resuming the run in {out} at step 1 of 2" in captured.err
    summary = json.loads(captured.out)
    assert summary["resumed"] and summary["dtype"] == "float32" and summary["final"]["step"] == 2


@pytest.mark.parametrize("out", ["", "   "])
def test_an_empty_out_is_refused_by_name(out, tmp_path, capsys, monkeypatch, no_weights):
    """`--out ""` read as the current folder: the run was written there (exit 0); refused as
    `--out afile.txt` is, nothing written."""
    monkeypatch.chdir(tmp_path)
    err = _error(capsys, "--out", out)
    assert (f"--out {out!r} is empty (it would write the run into the current folder): give the run's output "
            f"folder, a new or empty one, e.g. --out runs/mine") in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, kind", [("drafter", "file"), ("checkpoint", "file"), ("data", "file"),
                                        ("train_log.jsonl", "folder"), ("summary.json", "folder")])
def test_a_run_path_of_the_wrong_kind_in_out_is_refused_before_anything_loads(name, kind, tmp_path, capsys,
                                                                              no_weights):
    """OUT/drafter as a file was only met at the very end of the run ("File exists", after the
    answering and the training); now named at the start."""
    path = tmp_path / name
    if kind == "file":
        path.write_text("mine")
    else:
        path.mkdir()
    err = _error(capsys, "--out", str(tmp_path))
    what = {"drafter": "exported drafter folder", "checkpoint": "checkpoint folder", "data": "dataset folder",
            "train_log.jsonl": "training log file", "summary.json": "summary file"}[name]
    assert (f"--out {str(tmp_path)!r}: {str(path)!r} is a {kind}, where the run writes its {what}; move it away or "
            f"use another --out") in err
    assert path.exists() and [p.name for p in tmp_path.iterdir()] == [name]  # untouched


def test_a_data_file_in_out_is_no_matter_with_another_data_folder(tmp_path, capsys, monkeypatch):
    """With --data, OUT/data is not written: a file of that name stays the user's."""
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "data").write_text("mine")
    (tmp_path / "run" / "train_log.jsonl").write_text("")
    _made_here(tmp_path / "shared")
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path / "run"), "--data",
              str(tmp_path / "shared"), "--device", "cpu"])


@pytest.mark.parametrize("files", [["summary.json"], ["notes.txt", "summary.json"], ["a", "b", "c", "d"]])
def test_a_folder_of_other_files_is_refused_as_out(files, tmp_path, capsys, no_weights):
    """A user's own summary.json in --out was overwritten silently: a non-empty folder holding no
    run is refused, naming it, before anything loads."""
    for name in files:
        (tmp_path / name).write_text("mine")
    err = _error(capsys, "--out", str(tmp_path))
    shown = ", ".join(files[:3]) + (" and 1 more" if len(files) > 3 else "")
    assert (f"--out {str(tmp_path)!r} is a folder that holds no train-drafter run ({shown}; a run has "
            f"checkpoint/, train_log.jsonl, a data/ of answers or an exported drafter/), and the run would write "
            f"train_log.jsonl, summary.json and its folders over it: pick a new or empty folder for --out") in err
    assert all((tmp_path / name).read_text() == "mine" for name in files)


def test_a_run_folder_with_other_files_resumes_and_reuses_its_data(tmp_path, capsys, monkeypatch):
    """A run's folder (its data/ here; a checkpoint or train_log.jsonl alike) with files of the
    user's beside it is still its run: its data reused, a --data folder inside --out too."""
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    _made_here(tmp_path / "data")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu"])
    assert f"train-drafter: reusing the 2 sequences in {tmp_path / 'data'}" in capsys.readouterr().err
    inside = tmp_path / "inside"
    _made_here(inside / "answers")  # --data OUT/answers: the run's own, not a foreign file
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(inside), "--data", str(inside / "answers"),
              "--device", "cpu"])
    assert f"train-drafter: reusing the 2 sequences in {inside / 'answers'}" in capsys.readouterr().err


@pytest.mark.parametrize("inside", [[], ["corpus.csv"], ["partial/answers-00000.safetensors"]])
def test_a_project_folder_with_a_data_folder_of_its_own_is_refused_as_out(inside, tmp_path, capsys, no_weights):
    """Any data/ marked a run: `--out .` in a project with a data/ folder wrote the run into it and
    beside its files. A data/ counts only with a dataset's shards or an answering journal in it."""
    (tmp_path / "README.md").write_text("mine")
    (tmp_path / "data").mkdir()
    for name in inside:
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_text("mine")
    before = _files(tmp_path)
    err = _error(capsys, "--out", str(tmp_path))
    shown = "README.md, data" if inside else "README.md"  # an empty data/ holds nothing to overwrite
    assert f"--out {str(tmp_path)!r} is a folder that holds no train-drafter run ({shown}; a run has " in err
    assert _files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "data"]


def test_only_what_a_run_writes_marks_data_and_drafter_folders(tmp_path):
    import json

    from blockdraft.training.answer_journal import JOURNAL_DIR, JOURNAL_FILE
    from blockdraft.training.run_folder import check_out_folder, run_markers

    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data" / JOURNAL_DIR).mkdir(parents=True)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert run_markers(tmp_path) == []  # a journal folder without its journal.json; a target model's config
    with pytest.raises(ValueError, match="holds no train-drafter run"):
        check_out_folder(str(tmp_path))
    (tmp_path / "drafter" / "config.json").write_text("{")  # not JSON: no drafter either
    assert run_markers(tmp_path) == []
    (tmp_path / "data" / JOURNAL_DIR / JOURNAL_FILE).write_text("{}")  # an interrupted answering
    assert run_markers(tmp_path) == ["data"]
    check_out_folder(str(tmp_path))
    (tmp_path / "drafter" / "config.json").write_text((SHIPPED_DIR / NAME / "config.json").read_text())
    assert run_markers(tmp_path) == ["data", "drafter"]
    (tmp_path / "data" / JOURNAL_DIR / JOURNAL_FILE).unlink()
    assert run_markers(tmp_path) == ["drafter"]  # an exported DFlash drafter (dflash_config)
    check_out_folder(str(tmp_path))
    shards = tmp_path / "shards"
    _made_here(shards / "data")
    assert run_markers(shards) == ["data"]  # a finished answering: its dataset shards
    (shards / "train_log.jsonl").write_text("")
    (shards / "checkpoint.new").mkdir()
    assert run_markers(shards) == ["checkpoint.new", "train_log.jsonl", "data"]


def test_an_out_that_is_a_link_to_nothing_is_refused_by_name(tmp_path, capsys, no_weights):
    """It counted as a new folder: the run loaded the target, then failed making it."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    for out in (str(link), f"{link}/", str(link / "run")):
        err = _error(capsys, "--out", out)
        assert (f"--out {out!r}: {str(link)!r} is a symbolic link to {str(tmp_path / 'gone')!r}, which does not "
                f"exist: create that folder, or use another --out") in err
    assert link.is_symlink() and not (tmp_path / "gone").exists()


def test_hidden_files_and_the_spelling_of_out_are_no_matter(tmp_path, capsys, monkeypatch):
    """A folder holding only .DS_Store / .gitkeep was refused as holding no run; --out runs/x/ and
    a relative --out are the plain path."""
    from blockdraft.training.run_folder import check_out_folder

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    for name in (".DS_Store", ".gitkeep"):
        (tmp_path / "runs" / "x" / name).write_text("")
    for out in ("runs/x", "runs/x/", str(tmp_path / "runs" / "x") + "/", "./runs/x"):
        check_out_folder(out)
    (tmp_path / "runs" / "x" / "summary.json").write_text("mine")  # a user's file beside them: refused as before
    for out in ("runs/x", "runs/x/"):
        with pytest.raises(ValueError, match=f"--out {out!r} is a folder that holds no train-drafter run "
                                             r"\(summary.json; a run has"):
            check_out_folder(out)
    (tmp_path / "runs" / "x" / "summary.json").unlink()
    # a run's folder given relative and with a trailing slash: its data reused as with the plain path
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    _made_here(tmp_path / "runs" / "x" / "data")
    for out in ("runs/x/", "runs/x"):
        with pytest.raises(_Loading):
            main(["train-drafter", "--target", NAME, "--tiny", "--out", out, "--device", "cpu"])
        assert "train-drafter: reusing the 2 sequences in runs/x/data" in capsys.readouterr().err


QWEN = "qwen2.5-coder-0.5b-instruct"


def _checkpoint_of(out, target=QWEN, step=1, steps=4):
    """A checkpoint's state.json in `out` as a run for `target` writes it (the shipped drafter's
    config for its shape; None: a state written before the target was recorded)."""
    import json

    drafter = json.loads((SHIPPED_DIR / (target or QWEN) / "config.json").read_text())
    state = {"step": step, "drafter_config": drafter, "train_config": {"steps": steps}, "target_dtype": "float32",
             **({"target": target, "target_path": f"/cache/models/{target}"} if target else {})}
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text(json.dumps(state))


def test_a_rerun_for_another_target_says_that_first_and_only(tmp_path, capsys, no_weights):
    """A run made for Qwen rerun with SmolLM2 named the mask token and feature layers that differ
    with the target ("rerun with those"), flags never given; now the targets alone."""
    out = tmp_path / "run"
    _checkpoint_of(out)
    err = _error(capsys, "--out", str(out), "--device", "cpu")
    assert (f"this run (--out {out}) was made for target '{QWEN}', not '{NAME}': use another --out, or --no-resume "
            f"to start it over for '{NAME}'") in err
    assert "--mask-token-id" not in err and "rerun with those" not in err
    # its answers in OUT/data are Qwen's too: --no-resume alone would meet the dataset's refusal, so it is said
    _dataset(out / "data", {"target": QWEN, "vocab_size": 151936}, ids=(151644, 872, 151643, 9, 151645))
    err = _error(capsys, "--out", str(out), "--device", "cpu")
    assert (f"this run (--out {out}) was made for target '{QWEN}', not '{NAME}': use another --out, or remove "
            f"{out / 'data'} (the answers of '{QWEN}') and pass --no-resume to start it over for '{NAME}'") in err
    # ... which is what --no-resume meets: the dataset check names the target
    err = _error(capsys, "--out", str(out), "--device", "cpu", "--no-resume")
    assert f"the dataset in {out / 'data'} was made with target '{QWEN}'" in err and "discarding" not in err


def test_a_checkpoint_that_records_no_target_is_held_to_its_datasets(tmp_path, capsys, no_weights):
    out = tmp_path / "run"
    _checkpoint_of(out, target=None)
    _dataset(out / "data", {"target": QWEN, "vocab_size": 151936}, ids=(151644, 872, 151643, 9, 151645))
    err = _error(capsys, "--out", str(out), "--device", "cpu")
    assert f"this run (--out {out}) was made for target '{QWEN}', not '{NAME}'" in err and "--mask-token-id" not in err


@pytest.fixture
def no_fetch(monkeypatch, no_weights):
    """Fails the test if the target is resolved (a catalog model not in the cache is downloaded
    there, GBs; a .gguf converted): the checks here come before it."""
    import blockdraft.weights.fetch

    def fail(*a, **k):
        pytest.fail("the target was resolved (downloaded or converted) before the check")

    for name in ("resolve_model_path", "fetch_model", "convert_gguf"):
        monkeypatch.setattr(blockdraft.weights.fetch, name, fail)


def test_the_resume_refusals_come_before_the_target_is_fetched(tmp_path, capsys, no_fetch):
    """read_target_config (which downloads a catalog target not yet cached) ran before the resume
    checks: the target and dtype refusals now come first, the target's folder taken as known."""
    import json

    from blockdraft.weights.fetch import cache_root

    out = tmp_path / "run"
    _checkpoint_of(out)  # made for Qwen: another catalog name decides it
    err = _error(capsys, "--out", str(out), "--device", "cpu")
    assert f"this run (--out {out}) was made for target '{QWEN}', not '{NAME}'" in err
    err = _error(capsys, "--out", str(out), "--device", "cpu", "--target", str(cache_root() / "models" / NAME))
    assert f"was made for target '{QWEN}', not '{cache_root() / 'models' / NAME}'" in err  # a local folder too
    mine = tmp_path / "mine"
    _checkpoint_of(mine, target=NAME)  # made for this target in float32
    err = _error(capsys, "--out", str(mine), "--device", "cpu", "--dtype", "bfloat16")
    assert f"the run in {mine} was trained with the target in float32 (its checkpoint)" in err
    # the recorded target in its cache folder, asked for by name (or the other way round): the same target
    state = json.loads((mine / "checkpoint" / "state.json").read_text())
    state.update(target=str(cache_root() / "models" / NAME), target_path=str(cache_root() / "models" / NAME))
    (mine / "checkpoint" / "state.json").write_text(json.dumps(state))
    err = _error(capsys, "--out", str(mine), "--device", "cpu", "--dtype", "bfloat16")
    assert "was made for target" not in err and "was trained with the target in float32" in err


def test_a_gguf_target_is_held_to_the_recorded_one_once_resolved(tmp_path, capsys, monkeypatch, no_weights):
    """A .gguf's folder is named by its hash: known only once converted, when a run recorded for
    another target is refused; before it nothing is decided by the other name."""
    import blockdraft.weights.fetch
    from blockdraft.training.run_folder import check_resume_target
    from blockdraft.weights.fetch import cache_root

    out = tmp_path / "run"
    _checkpoint_of(out)
    check_resume_target(out, out / "data", str(tmp_path / "model.gguf"), None, own_data=True)  # undecided: passes
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(blockdraft.weights.fetch, "convert_gguf", lambda *a, **k: cache_root() / "models" / NAME)
    err = _error(capsys, "--out", str(out), "--device", "cpu", "--target", str(tmp_path / "model.gguf"))
    assert f"this run (--out {out}) was made for target '{QWEN}', not '{tmp_path / 'model.gguf'}'" in err


def _model_folder(folder):
    """A local model folder as resolve_model_path takes it (its config.json; nothing else read here)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_a_local_target_folder_is_the_same_however_its_path_is_spelled(tmp_path, monkeypatch):
    """A run recorded for models/m and resumed as /abs/models/m (or through a link) was refused as made
    for another target: paths are compared resolved; another folder is still refused."""
    import json
    from argparse import Namespace

    from blockdraft.training.pipeline import reuse_dataset
    from blockdraft.training.run_folder import check_resume_target

    monkeypatch.chdir(tmp_path)
    model, other = _model_folder(tmp_path / "models" / "m"), _model_folder(tmp_path / "models" / "n")
    (tmp_path / "link").symlink_to(model)
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text(json.dumps(
        {"step": 1, "drafter_config": {}, "target": "models/m", "target_path": "models/m"}))
    _dataset(out / "data", {"target": "models/m", "target_path": "models/m", "vocab_size": 49152,
                            "settings": _settings(), "dtype": "float32", "seed": 0})
    args = Namespace(target=None, data=None, seed=0, dtype="float32")
    for spelled in (str(model), "./models/m/", str(tmp_path / "link"), "models/../models/m"):
        check_resume_target(out, out / "data", spelled, spelled, own_data=True)
        args.target = spelled
        assert reuse_dataset(out / "data", _settings(), args, spelled, 49152) is not None
    from blockdraft.weights.fetch import same_target  # both compare with it, as the answering journal does

    assert same_target("models/m", "models/m", str(tmp_path / "link")) and not same_target("models/m", None, str(other))
    with pytest.raises(ValueError, match=f"this run \\(--out {out}\\) was made for target 'models/m', not '{other}'"):
        check_resume_target(out, out / "data", str(other), str(other), own_data=True)
    args.target = str(other)
    with pytest.raises(ValueError, match=f"the dataset in {out / 'data'} was made with target 'models/m'"):
        reuse_dataset(out / "data", _settings(), args, str(other), 49152)
    assert same_target(QWEN, None, QWEN) and not same_target(QWEN, None, NAME)  # catalog names as names


def test_no_resume_says_which_checkpoint_it_discards(tmp_path, capsys, monkeypatch):
    """--no-resume over an unfinished checkpoint threw its steps away unsaid."""
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    _made_here(tmp_path / "data")
    _checkpoint_of(tmp_path, target=NAME, step=3, steps=2000)
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu", "--no-resume"])
    assert (f"train-drafter: --no-resume: discarding the checkpoint at step 3 of 2000 in {tmp_path / 'checkpoint'}; "
            f"the training starts over from step 0") in capsys.readouterr().err
    (tmp_path / "checkpoint" / "state.json").write_text("{")  # damaged: what --no-resume is for
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path), "--device", "cpu", "--no-resume"])
    assert f"--no-resume: the damaged checkpoint in {tmp_path / 'checkpoint'} is discarded" in capsys.readouterr().err


def test_the_closing_line_gives_the_command_that_sets_the_fastest_k():
    from blockdraft.training.pipeline import closing_message

    line = closing_message({"drafter": "/runs/a/drafter"}, NAME)
    assert (f"`python -m blockdraft.bench.spec_k --model {NAME} --draft /runs/a/drafter --write-default` times K = "
            f"1, 2, 3, 4, 7, 15 and writes the fastest to /runs/a/drafter/speculative.json, which generate then uses"
            ) in line
    assert "--draft /runs/a/drafter --draft-vocab-sizes 256 --write-default" in closing_message(
        {"drafter": "/runs/a/drafter"}, NAME, 256)


def test_a_sigterm_stop_exits_143_and_ctrl_c_130(monkeypatch, capsys):
    """128 + the signal, as a shell reports it (SIGTERM exited 130, Ctrl-C's status)."""
    import signal

    from blockdraft.training import pipeline

    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        def stopped(args, sig=sig):
            with pipeline.deferred_interrupt() as stop:
                signal.raise_signal(sig)
            assert stop.hit
            raise stop.interrupt()

        monkeypatch.setattr(pipeline, "train_drafter", stopped)
        assert main(["train-drafter", "--target", NAME, "--tiny"]) == code
        assert "blockdraft train-drafter: interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["training", "answering"])
def test_a_second_signal_says_what_stays_saved(monkeypatch, capsys, stage):
    """The second Ctrl-C stops at once; it says what it leaves (a trial saw only "interrupted")."""
    import signal

    from blockdraft.training import pipeline

    notes = ((pipeline.TRAINING_STOP, pipeline.TRAINING_STOP_NOW) if stage == "training" else
             (pipeline.ANSWERING_STOP, pipeline.ANSWERING_STOP_NOW))

    def stopped(args):
        with pipeline.deferred_interrupt(*notes):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        pytest.fail("the second signal did not stop at once")

    monkeypatch.setattr(pipeline, "train_drafter", stopped)
    assert main(["train-drafter", "--target", NAME, "--tiny"]) == 130
    err = capsys.readouterr().err
    assert f"train-drafter: SIGINT: {notes[0]}" in err
    want = ("a checkpoint already in --out stays (rerun the command to resume from it)" if stage == "training" else
            "the answers saved so far stay (rerun the command to resume from them)")
    assert f"train-drafter: SIGINT again: stopping now: " in err and want in err, err
    assert "blockdraft train-drafter: interrupted" in err


def test_help_says_what_the_bar_shows_and_the_exit_statuses():
    import argparse

    from blockdraft.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["train-drafter"].format_help().split())
    assert "exports OUT/drafter as trained so far (exit 130; 143 for SIGTERM)" in text
    assert ("The progress bar shows loss: the decay-weighted mean cross-entropy (nats) over the draft slots 1..B-1 "
            "(slot k weighted exp(-(k-1)/gamma), gamma 7 for a block of 16); a new (untrained) drafter's starts well "
            "above ln(vocabulary size), a uniform guess's") in text
    assert ("aK: top-1 accuracy of draft slot K, n/a when no training block had a label at slot K (each sampled anchor "
            "had fewer than K answer tokens after it); each over the steps since the last log line. --tiny") in text
    assert "--tiny only proves the pipeline" in text
    from blockdraft.training.pipeline import BAR_LEGEND

    assert f"The progress bar shows {BAR_LEGEND}." in text  # word for word the legend on stderr (e2e test)


@pytest.mark.parametrize("files", [["config.json", "model.safetensors"], ["notes.txt", "main.py"]])
def test_a_data_folder_of_other_files_is_refused_before_anything_loads(files, tmp_path, capsys, no_weights):
    """--data wrote its shards into any folder: into a drafter folder, whose loader then read them
    as weights (a trial). A folder holding anything but a dataset's shards is refused, untouched."""
    data = tmp_path / "folder"
    data.mkdir()
    for name in files:
        (data / name).write_text("mine")
    before = _files(data)
    err = _error(capsys, "--out", str(tmp_path / "run"), "--data", str(data))
    assert f"--data {str(data)!r} holds files that are not a train-drafter dataset ({', '.join(sorted(files))};" in err
    assert _files(data) == before and not (tmp_path / "run").exists()


def test_data_that_is_out_itself_is_refused(tmp_path, capsys, no_weights):
    err = _error(capsys, "--out", str(tmp_path / "run"), "--data", str(tmp_path / "run"))
    assert f"--data {str(tmp_path / 'run')!r} is --out itself; give the dataset its own folder" in err


def test_a_dataset_folder_with_hidden_files_or_a_journal_is_accepted_as_data(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: (_ for _ in ()).throw(_Loading()))
    _made_here(tmp_path / "shared")
    (tmp_path / "shared" / ".DS_Store").write_text("")
    (tmp_path / "shared" / "partial").mkdir()
    with pytest.raises(_Loading):
        main(["train-drafter", "--target", NAME, "--tiny", "--out", str(tmp_path / "run"), "--data",
              str(tmp_path / "shared"), "--device", "cpu"])


def test_init_from_a_run_folder_names_its_drafter_and_the_flag(tmp_path, capsys, no_weights):
    """--init-from OUT (a run folder) said "draft takes ... or 'auto'", which --init-from refuses."""
    (tmp_path / "old" / "drafter").mkdir(parents=True)
    (tmp_path / "old" / "drafter" / "config.json").write_text("{}")
    err = _error(capsys, "--out", str(tmp_path / "run"), "--init-from", str(tmp_path / "old"))
    assert (f"no config.json in drafter folder {str(tmp_path / 'old')!r} (did you mean {tmp_path / 'old' / 'drafter'}?);"
            f" --init-from takes a DFlash checkpoint folder") in err and "'auto'" not in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (a folder no file can be made in)")
def test_an_out_no_file_can_be_written_in_is_refused_before_anything_loads(capsys, no_weights):
    """A trial: --out under a folder that takes no file failed only once the run wrote, after the
    target loaded (a read-only run folder: after the first training step)."""
    err = _error(capsys, "--out", "/proc/blockdraft-no-such/run")
    assert "--out '/proc/blockdraft-no-such/run': cannot write in '/proc' (" in err
