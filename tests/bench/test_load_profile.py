"""bench.load_profile sorts the engine steps of a closed or windowed run by what they launched
(the padded graph code runs eagerly on CPU with graph_mode="eager")."""

import pytest

from blockdraft.bench.load_profile import format_table, profile_load
from blockdraft.runner.model_runner import ModelRunner
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import make_llm, random_prompts, tiny_target
from tests.engine.test_async_scheduling import _oracle_speculator


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=5, logit_scale=8.0)


def _dflash_llm(target, **kw):
    drafter = random_drafter(target.config, num_layers=1, block_size=4, target_layer_ids=(0, 2), seed=1)
    spec = DFlashSpeculator(drafter, target.model, 3, None, 4)
    return make_llm(target, speculator=spec, attention_backend="dense", graph_mode="eager", **kw)


def test_closed_batches_sort_into_eager_prefill_graph_and_uniform_steps(target):
    launch = ModelRunner.launch
    engine = _dflash_llm(target, max_num_seqs=5, max_num_batched_tokens=64, mixed_prefill=False).engine
    # prompts of 19, 19, 6, 7, 7 tokens, then 8 and 80 (longer than the 64-token budget)
    prompts = random_prompts(6, seed=3) + random_prompts(1, seed=9, low=80, high=81)
    out = profile_load(engine, prompts, max_tokens=6, batch_size=5, how="closed")
    kinds = out["by_kind"]
    assert out["tokens"] == 7 * 6 and out["steps"] == sum(k["steps"] for k in kinds.values())
    # batch 1: one prefill-graph step of 5 prompts (58 rows); batch 2: the 8-token prompt alone (the
    # 80-token one does not join as a chunk), the long prompt's first chunk (eager), a decode step
    # (its turn after a non-final chunk), the last chunk of 16 rows (prefill graph)
    assert kinds["eager"]["steps"] == 1 and kinds["prefill-graph"]["steps"] == 3
    assert kinds["uniform"]["steps"] == out["steps"] - 4
    assert out["launch_shapes"] == {"eager": [[1, 64]], "prefill-graph": [[5, 58], [1, 8], [1, 16]]}
    assert out["wall_s"] >= sum(k["seconds"] for k in kinds.values()) > 0
    assert "step" not in vars(engine) and ModelRunner.launch is launch  # instrumentation removed
    table = format_table({"dflash/closed": out})
    assert "prefill-graph" in table and "uniform" in table
    assert "eager launches, requests x rows: 1x64" in table


def test_windowed_run_counts_every_token_and_bad_arguments_are_refused(target):
    engine = _dflash_llm(target, max_num_seqs=3).engine
    prompts = random_prompts(6, seed=4)
    out = profile_load(engine, prompts, max_tokens=5, batch_size=3, how="windowed")
    assert out["tokens"] == 6 * 5 and out["steps"] == sum(k["steps"] for k in out["by_kind"].values())
    with pytest.raises(ValueError, match="how must be one of"):
        profile_load(engine, prompts, 5, 3, "open")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        profile_load(engine, prompts, 5, 0, "closed")


def test_windowed_async_run_shows_the_join_steps(target):
    """Async scheduling without mixed prefill: a newcomer's prefill, then the step it joins,
    launched before the prefill is read back ("join", alone or after the prefill's launch)."""
    launch_join = ModelRunner.launch_join
    engine = _dflash_llm(target, max_num_seqs=3, mixed_prefill=False, async_scheduling=True).engine
    out = profile_load(engine, random_prompts(8, seed=4), max_tokens=6, batch_size=3, how="windowed")
    kinds = out["by_kind"]
    assert out["tokens"] == 8 * 6 and sum(v["steps"] for k, v in kinds.items() if "join" in k.split("+")) >= 3

    # an oracle drafter accepts more for some requests: they stop at different steps and leave the chain
    prompts = random_prompts(3, seed=5)
    plain = make_llm(target).generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    spec = _oracle_speculator(target, 3, [p + o.token_ids for p, o in zip(prompts, plain)])
    engine = make_llm(target, speculator=spec, attention_backend="dense", graph_mode="eager", max_num_seqs=3,
                      mixed_prefill=False, async_scheduling=True).engine
    closed = profile_load(engine, prompts, max_tokens=24, batch_size=3, how="closed")["by_kind"]
    assert closed["continuation-past-stops"]["steps"] >= 1
    assert ModelRunner.launch_join is launch_join  # instrumentation removed


@pytest.mark.parametrize("argv, words", [
    (["--num-prompts", "1", "--batch-size", "2"], "--num-prompts (1) must be >= --batch-size (2)"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--draft", "/nonexistent-drafter"], "drafter folder '/nonexistent-drafter' does not exist; draft (--draft)"),
    (["--out", "/nonexistent-folder/x.json"], "folder '/nonexistent-folder' does not exist"),
    (["--num-speculative-tokens", "16"], "(--num-speculative-tokens) must be in [1, block_size - 1 = 15] for this "
                                         "drafter, got 16"),
])
def test_bad_flags_exit_2_naming_the_flag_before_any_weights_load(argv, words, capsys):
    from blockdraft.bench.load_profile import main

    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_default_k_is_the_drafters_recorded_k_on_this_device_and_the_flag_wins(tmp_path, monkeypatch):
    """Without --num-speculative-tokens the profile runs (and records) the K `generate` uses on this
    device type: the speculative.json `per_device.cpu` entry (3) over its top level (2); B - 1 = 7
    where the folder records none; the flag always wins."""
    import json

    from blockdraft.bench.load_profile import main
    from blockdraft.spec.dflash.checkpoint import SPECULATIVE_FILE
    from blockdraft.training import corpora
    from tests.bench.test_bench_cli import recorded_ks
    from tests.server.tiny_model import word, write_tiny_drafter, write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    draft = write_tiny_drafter(tmp_path / "drafter", model)
    monkeypatch.setattr(corpora, "eval_prompts", lambda dataset, cache_dir=None: [f"{word(5)} {word(7)}"])
    ks, out = recorded_ks(monkeypatch), tmp_path / "load.json"

    def run(*flags) -> int:
        assert main(["--model", str(model), "--draft", str(draft), "--device", "cpu", "--batch-size", "1",
                     "--num-prompts", "1", "--max-tokens", "3", "--repeats", "1", "--out", str(out), *flags]) == 0
        settings = json.loads(out.read_text())["settings"]
        # the admission flag as given (None: per-engine default) beside what each engine ran with
        given = float(flags[flags.index("--admission-batch-ratio") + 1]) if "--admission-batch-ratio" in flags else None
        assert settings["admission_batch_ratio_flag"] == given
        assert settings["admission_batch_ratio"] == ({"plain": 0.0, "dflash": 0.25} if given is None
                                                     else {"plain": given, "dflash": given})
        return settings["num_speculative_tokens"]

    (draft / SPECULATIVE_FILE).write_text(json.dumps({"num_speculative_tokens": 2, "per_device": {
        "cpu": {"num_speculative_tokens": 3}, "cuda": {"num_speculative_tokens": 5}}}))
    assert run() == 3 and ks == [3]
    assert run("--num-speculative-tokens", "1", "--admission-batch-ratio", "0.5") == 1 and ks == [3, 1]
    (draft / SPECULATIVE_FILE).unlink()
    assert run() == 7 and ks == [3, 1, 7]
