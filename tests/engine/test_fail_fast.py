"""Bad arguments fail before any weights load (blockdraft.preflight), naming the value.

Every weight loader is replaced by one that raises AssertionError, which the CLI does not catch:
a test passes only if the command refused its arguments (exit code 2, message on stderr) without
reaching a loader. The cases run on a tiny model folder and, when it is already in the cache, on
the real default catalog model (no download: the test is skipped otherwise).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from blockdraft.cli import main
from blockdraft.drafters import SHIPPED_DIR
from blockdraft.llm import LLM
from blockdraft.weights.catalog import DEFAULT_MODEL
from blockdraft.weights.fetch import cache_root, is_complete
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fail_fast")
    model = write_tiny_model(root / "model")
    drafter = write_tiny_drafter(root / "drafter", model)  # block_size 8, target layers (0, 2) of 4
    return model, drafter


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    """Any weight load fails the test (AssertionError passes through the CLI's error handler)."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the arguments were checked")

    for target in (
        "blockdraft.weights.loader.load_state_dict",
        "blockdraft.weights.loader.LazyStateDict",  # every target model (load_target)
        "blockdraft.spec.dflash.checkpoint._read_safetensors",  # every drafter (load_drafter)
        "blockdraft.drafters._expand",  # unpacking a shipped int8 drafter
        "blockdraft.bench.random_weights.random_target",  # bench --shape
        "transformers.AutoModelForCausalLM.from_pretrained",  # bench --model's HF twin
    ):
        monkeypatch.setattr(target, refuse)


def _drafter_variant(tmp_path: Path, drafter: Path, **changes) -> Path:
    folder = tmp_path / ("variant-" + "-".join(changes))
    shutil.copytree(drafter, folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key in cfg.get("dflash_config", {}):
            cfg["dflash_config"][key] = value
        cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _refused(capsys, argv: list[str], *expected: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, err
    return err


def test_generate_and_serve_refuse_a_bad_drafter_before_loading_the_target(tiny, tmp_path, capsys):
    model, drafter = tiny
    no_config = tmp_path / "empty"
    no_config.mkdir()
    wide = _drafter_variant(tmp_path, drafter, hidden_size=128)
    cases = [
        (["--draft", "/nonexistent/drafter"], ["'/nonexistent/drafter' does not exist", "draft (--draft) takes a DFlash checkpoint folder"]),
        (["--draft", str(no_config)], [f"no config.json in drafter folder '{no_config}'", "draft (--draft) takes"]),
        (["--draft", str(wide)], ["drafter hidden_size 128 != target hidden_size 64"]),
        (["--draft", str(drafter), "--num-speculative-tokens", "8"], ["block_size - 1 = 7", "got 8"]),
        (["--draft", str(drafter), "--num-speculative-tokens", "0"], ["integer >= 1, got 0"]),
    ]
    for command in (["generate", "w05x"], ["serve"]):
        for flags, expected in cases:
            _refused(capsys, [*command, "--model", str(model), *flags], *expected)
    deep = _drafter_variant(tmp_path, drafter, target_layer_ids=[0, 9], num_target_layers=None)
    _refused(capsys, ["generate", "w05x", "--model", str(model), "--draft", str(deep)],
             "target_layer_ids [0, 9] has ids [9] >= the target's num_hidden_layers (4)")


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--gpu-memory-utilization", "0"], "gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got 0.0"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got 1.5"),
        (["--top-p", "0"], "top_p (--top-p) must be in (0, 1], got 0.0"),
        (["--min-p", "1.5"], "min_p (--min-p) must be a number in [0, 1] (0 = off), got 1.5"),
        (["--min-p", "-0.2"], "min_p (--min-p) must be a number in [0, 1] (0 = off), got -0.2"),
        (["--temperature", "-1"], "temperature (--temperature) must be a finite number >= 0 and <= 3.40282e+38 (float32's largest), got -1.0"),
        (["--temperature", "inf"], "temperature (--temperature) must be a finite number >= 0 and <= 3.40282e+38 (float32's largest), got inf"),
        (["--max-tokens", "0"], "max_tokens (--max-tokens) must be an integer >= 1, got 0"),
        (["--presence-penalty", "3"], "presence_penalty (--presence-penalty) must be a number in [-2, 2] (0 = off), got 3.0"),
        (["--repetition-penalty", "0"],
         "repetition_penalty (--repetition-penalty) must be a number > 0 and <= 3.40282e+38 (float32's largest; 1 = off), got 0.0"),
        (["--enable-fp32-lm-head", "--device", "cpu"],
         "enable_fp32_lm_head (--enable-fp32-lm-head) runs on CUDA only, the device is 'cpu': leave it off there"),
        (["--batch-invariant", "--device", "cpu"], "batch_invariant (--batch-invariant) runs on CUDA only, the device is 'cpu'"),
        # constraints that do not parse: checked without the tokenizer (the engine checks again with it)
        (["--structured-outputs", '{"regex": "("}'], "error: structured_outputs.regex (--structured-outputs) is invalid: "),
        (["--structured-outputs", '{"json": {"type": "nope"}}'],
         "error: structured_outputs.json (--structured-outputs) is invalid: Invalid type: nope"),
        (["--structured-outputs", '{"grammar": "start: foo"}'],
         "error: structured_outputs.grammar (--structured-outputs) is invalid: "),
        (["--structured-outputs", '{"json_object": true, "whitespace_pattern": "["}'],
         "error: structured_outputs.whitespace_pattern (--structured-outputs) is invalid: "),
        (["--structured-outputs", '{"structural_tag": {"triggers": ["<f"], "structures": [{"begin": "<f>", '
                                  '"schema": {"type": "nope"}, "end": "</f>"}]}}'],
         "error: structured_outputs.structural_tag (--structured-outputs) (the schema of '<f>') is invalid"),
    ],
)
def test_generate_refuses_bad_values_before_loading(tiny, capsys, flags, expected):
    model, _ = tiny
    _refused(capsys, ["generate", "w05x", "--model", str(model), *flags], expected)


def test_serve_refuses_bad_pool_and_scheduler_sizes_before_loading(tiny, capsys):
    model, _ = tiny
    for flags, expected in [
        (["--kv-block-size", "0"], "kv_block_size (--kv-block-size) must be >= 1, got 0"),
        (["--num-kv-blocks", "0"], "num_kv_blocks (--num-kv-blocks) must be >= 1, got 0"),
        (["--max-num-seqs", "0"], "max_num_seqs (--max-num-seqs) must be >= 1, got 0"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens (--max-num-batched-tokens) must be >= 1, got 0"),
        (["--admission-batch-ratio", "1.5"],
         "admission_batch_ratio (--admission-batch-ratio) must be a number in [0, 1], got 1.5"),
        (["--admission-max-wait-steps", "-1"],
         "admission_max_wait_steps (--admission-max-wait-steps) must be an integer >= 0, got -1"),
    ]:
        _refused(capsys, ["serve", "--model", str(model), *flags], expected)


def test_the_step_budget_defaults_by_device(tiny):
    from blockdraft.config import default_max_num_batched_tokens
    from blockdraft.preflight import preflight

    model, _ = tiny
    assert preflight(str(model), device="cpu").scheduler.max_num_batched_tokens == 512
    assert preflight(str(model), device="cpu", max_num_batched_tokens=77).scheduler.max_num_batched_tokens == 77
    # CUDA: every running request's verify rows (64 x 16 at K = 15) and prefills of several prompts
    assert default_max_num_batched_tokens("cuda") == 8192
    with pytest.raises(ValueError, match=r"device 'mps'; known: \['cpu', 'cuda'\]"):
        default_max_num_batched_tokens("mps")


def test_python_api_checks_before_loading(tiny, tmp_path):
    model, drafter = tiny
    with pytest.raises(FileNotFoundError, match="'/nonexistent' does not exist"):
        LLM(model=str(model), draft="/nonexistent")
    with pytest.raises(ValueError, match=r"block_size - 1 = 7\] for this drafter, got 99"):
        LLM(model=str(model), draft=str(drafter), num_speculative_tokens=99)
    with pytest.raises(ValueError, match=r"^dtype must be one of"):
        LLM(model=str(model), dtype="int4")
    with pytest.raises(ValueError, match=r"^device must be one of"):
        LLM(model=str(model), device="tpu")
    with pytest.raises(ValueError, match="vocab_size 50 != target vocab_size 96"):
        LLM(model=str(model), draft=str(_drafter_variant(tmp_path, drafter, vocab_size=50, mask_token_id=40)))
    # A recorded K (speculative.json) out of range names the file.
    (Path(drafter) / "speculative.json").write_text('{"num_speculative_tokens": 9}')
    try:
        with pytest.raises(ValueError, match=r"speculative.json: num_speculative_tokens must be in \[1, block_size - 1 = 7\].*num_speculative_tokens overrides it"):
            LLM(model=str(model), draft=str(drafter))
    finally:
        (Path(drafter) / "speculative.json").unlink()


@pytest.mark.parametrize("kw, message", [
    (dict(kv_block_size=0), "kv_block_size must be >= 1, got 0"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1, got 0"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1, got 0"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (dict(num_speculative_tokens=0, draft="auto"), "num_speculative_tokens must be an integer >= 1, got 0"),
    (dict(draft_vocab_size=-1, draft="auto"), "draft_vocab_size must be an integer >= 0"),
    (dict(draft_vocab_size=8), "draft_vocab_size 8 needs a drafter; give draft"),
    (dict(dtype="int4"), "dtype must be one of"),
    (dict(admission_batch_ratio=-1.0), "admission_batch_ratio must be a number in [0, 1], got -1.0"),
    (dict(admission_max_wait_steps=2.5), "admission_max_wait_steps must be an integer >= 0, got 2.5"),
])
def test_python_api_errors_name_the_parameter_not_the_flag(tiny, tmp_path, kw, message):
    model, drafter = tiny
    kw = {**kw, "draft": str(drafter)} if kw.get("draft") == "auto" else kw  # the tiny model ships none
    with pytest.raises(ValueError) as info:
        LLM(model=str(model), **kw)
    assert str(info.value).startswith(message) and "--" not in str(info.value), str(info.value)


def test_model_of_the_wrong_type_is_a_type_message_not_an_unknown_name():
    with pytest.raises(ValueError, match=r"^model must be a catalog name or a path \(str\), got int 123$"):
        LLM(model=123)


def test_draft_of_the_wrong_type_or_empty_is_refused_before_loading(tiny, capsys):
    model, _ = tiny
    with pytest.raises(TypeError, match=r"draft must be a drafter folder, 'auto', 'shipped' or None, got 123"):
        LLM(model=str(model), draft=123)
    with pytest.raises(ValueError, match="draft is empty"):
        LLM(model=str(model), draft=" ")
    _refused(capsys, ["generate", "hi", "--model", str(model), "--draft", ""], "draft (--draft) is empty")


def test_flag_is_named_only_where_the_command_has_it():
    from blockdraft.errors import flag_message, param_error

    error = param_error("max_num_seqs", "max_num_seqs must be >= 1, got 0")
    assert flag_message(error, {"--max-num-seqs"}) == "max_num_seqs (--max-num-seqs) must be >= 1, got 0"
    assert flag_message(error, {"--max-tokens"}) == "max_num_seqs must be >= 1, got 0"  # not a flag of this command
    assert flag_message(ValueError("max_num_seqs must be >= 1"), {"--max-num-seqs"}) == "max_num_seqs must be >= 1"
    # the first whole-word mention only: not inside another name, not the hint after it
    error = param_error("seed", "seed_offset and seed must be >= 0; seed 0 is fine")
    assert flag_message(error, {"--seed"}) == "seed_offset and seed (--seed) must be >= 0; seed 0 is fine"
    # nor a path segment or a quoted value that happens to spell the parameter
    error = param_error("draft", "drafter folder '/tmp/draft' does not exist; draft takes a folder")
    assert flag_message(error, {"--draft"}) == "drafter folder '/tmp/draft' does not exist; draft (--draft) takes a folder"
    error = param_error("draft", "no config.json in /data/draft/x; draft takes a folder")
    assert flag_message(error, {"--draft"}) == "no config.json in /data/draft/x; draft (--draft) takes a folder"
    # None is Python wording: on the command line a flag left out is the None
    error = param_error("max_model_len", "max_model_len must be None or an integer >= 1 (tokens), got 0")
    assert flag_message(error, {"--max-model-len"}) == "max_model_len (--max-model-len) must be an integer >= 1 (tokens), got 0"
    assert flag_message(error, set()) == str(error)  # the Python API's message keeps it
    # a field inside a flag's JSON names the flag after it (the field's own param is not a flag)
    error = param_error("choice", "structured_outputs.choice must be a non-empty list, got []")
    flags = {"--structured-outputs"}
    assert flag_message(error, flags) == "structured_outputs.choice (--structured-outputs) must be a non-empty list, got []"
    assert flag_message(param_error("regex", "structured_outputs.regex is invalid: (a"), flags).startswith(
        "structured_outputs.regex (--structured-outputs) is invalid")
    # not for another parameter's message, nor a message without one (a file name such as model.gguf)
    assert flag_message(param_error("draft", "structured_outputs.json x"), flags) == "structured_outputs.json x"
    assert flag_message(ValueError("model.gguf is missing"), {"--model"}) == "model.gguf is missing"
    assert flag_message(error, {"--max-tokens"}) == str(error)


def test_other_commands_check_before_loading(tiny, tmp_path, capsys):
    model, drafter = tiny
    m = str(model)
    _refused(capsys, ["demo", "--model", m, "--draft", "/nonexistent"], "'/nonexistent' does not exist")
    _refused(capsys, ["demo", "--model", m, "--draft", str(drafter), "--num-speculative-tokens", "8"], "got 8")
    _refused(capsys, ["demo", "--model", m, "--draft", str(drafter), ""], "prompt is empty")
    _refused(capsys, ["eval-drafter", "--target", m, "--draft", "/nonexistent"], "'/nonexistent' does not exist")
    _refused(capsys, ["eval-drafter", "--target", m, "--draft", str(drafter), "--num-prompts", "0"],
             "--num-prompts) must be an integer >= 1, got 0")
    _refused(capsys, ["eval-drafter", "--target", m, "--draft", str(drafter), "--plot", "/nonexistent/p.png"],
             "--plot '/nonexistent/p.png': folder '/nonexistent' does not exist")
    _refused(capsys, ["eval-drafter", "--target", m, "--draft", str(drafter), "--plot", str(tmp_path / "p.txt")],
             "p.txt': the file name must end in an image format matplotlib writes")
    _refused(capsys, ["eval-drafter", "--target", m, "--draft", str(drafter), "--plot", str(tmp_path)],
             "is a folder: give a file path, e.g. ", "acceptance.png")
    for empty in ("", " "):  # was: no plot, unsaid
        _refused(capsys, ["eval-drafter", "--target", m, "--draft", str(drafter), "--plot", empty],
                 f"--plot {empty!r} is empty: give the PNG file to write, e.g. 'acceptance.png', or leave --plot out")
    if not torch.cuda.is_available():
        _refused(capsys, ["eval-drafter", "--target", m, "--draft", str(drafter), "--device", "cuda"],
                 "device (--device) 'cuda' asked for but torch sees no CUDA device (use 'cpu' or 'auto')")
    _refused(capsys, ["bench", "--model", m, "--draft", "/nonexistent", "--device", "cpu"],
             "'/nonexistent' does not exist")
    _refused(capsys, ["bench", "--model", m, "--draft", str(drafter), "--num-speculative-tokens", "8",
                      "--device", "cpu"], "got 8")
    _refused(capsys, ["bench", "--shape", "tiny", "--num-speculative-tokens", "16", "--device", "cpu"],
             "block_size - 1 = 15", "got 16")
    _refused(capsys, ["bench", "--shape", "tiny", "--block-size", "1", "--device", "cpu"], "--block-size must be >= 2")
    fp32_head = "enable_fp32_lm_head (--enable-fp32-lm-head) runs on CUDA only, the device is 'cpu'"
    _refused(capsys, ["bench", "--model", m, "--device", "cpu", "--enable-fp32-lm-head"], fp32_head)
    _refused(capsys, ["bench", "--shape", "tiny", "--device", "cpu", "--enable-fp32-lm-head"], fp32_head)
    _refused(capsys, ["bench", "--shape", "tiny", "--device", "cpu", "--batch-invariant"],
             "batch_invariant (--batch-invariant) runs on CUDA only, the device is 'cpu'")
    from blockdraft.bench.structured import main as structured_bench

    assert structured_bench(["--model", m, "--draft", str(drafter), "--device", "cpu", "--enable-fp32-lm-head"]) == 2
    assert fp32_head in capsys.readouterr().err
    _refused(capsys, ["generate", "hi", "--model", str(drafter)], "is a DFlash drafter",
             "give it as the draft, with the target it was trained for as the model")
    _refused(capsys, ["eval-drafter", "--target", "nope"], "unknown model 'nope'", f"catalog models: {DEFAULT_MODEL}")
    _refused(capsys, ["generate", "hi", "--model", "/some/missing/path.gguf"],
             "error: model file '/some/missing/path.gguf' does not exist")
    out = tmp_path / "train"
    for flags, expected in [
        (["--block-size", "1"], "--block-size must be an integer >= 2, got 1"),
        (["--mask-token-id", "96"], "--mask-token-id must be in [0, 96) (this target's vocabulary), got 96"),
        (["--num-feature-layers", "9"], "--num-feature-layers must be at most 3 (distinct layers below the last of "
                                        "this target's 4), got 9"),
        (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (["--sampled-fraction", "1.5"], "--sampled-fraction must be in [0, 1], got 1.5"),
    ]:
        _refused(capsys, ["train-drafter", "--tiny", "--target", m, "--out", str(out), *flags], expected)
    with pytest.raises(SystemExit) as exit_info:  # argparse's choices, as --device of the other commands
        main(["train-drafter", "--tiny", "--target", m, "--out", str(out), "--device", "tpu"])
    assert exit_info.value.code == 2 and "argument --device: invalid choice: 'tpu'" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


@pytest.mark.skipif(not is_complete(cache_root() / "models" / DEFAULT_MODEL),
                    reason=f"{DEFAULT_MODEL} is not in the cache (this test never downloads)")
def test_real_model_refuses_bad_drafter_flags_without_loading_weights(capsys):
    _refused(capsys, ["generate", "hi", "--draft", "/nonexistent"], "'/nonexistent' does not exist")
    _refused(capsys, ["generate", "hi", "--num-speculative-tokens", "99"], "block_size - 1 = 15", "got 99")
    _refused(capsys, ["serve", "--num-speculative-tokens", "99"], "got 99")
    small = str(SHIPPED_DIR / "qwen2.5-coder-0.5b-instruct")  # a drafter for another target
    _refused(capsys, ["generate", "hi", "--model", "smollm2-135m-instruct", "--draft", small],
             "draft (--draft) ", "does not fit this target model: drafter hidden_size 896 != target hidden_size 576",
             "only with the target it was trained for")


def test_draft_vocab_size_is_checked_before_loading(tiny, tmp_path, capsys):
    """--draft-vocab-size against the drafter folder's draft_vocab.json, in every command."""
    import torch

    from blockdraft.spec.draft_vocab import save_draft_vocab

    model, drafter = tiny
    m = str(model)
    ranked, foreign = shutil.copytree(drafter, tmp_path / "ranked"), shutil.copytree(drafter, tmp_path / "foreign")
    save_draft_vocab(ranked, torch.arange(10), torch.zeros(10, dtype=torch.long), {"source": "test"})
    # ranked for a larger vocabulary
    save_draft_vocab(foreign, torch.tensor([*range(7), 500]), torch.zeros(8, dtype=torch.long), {"source": "test"})
    cases = [
        (["--draft", str(drafter), "--draft-vocab-size", "5"], [
            f"draft_vocab_size (--draft-vocab-size) 5 needs the drafter's ranked vocabulary, but drafter folder "
            f"{drafter} has no draft_vocab", "`blockdraft train-drafter` writes it", "at least 6 and at most"]),
        (["--draft", str(ranked), "--draft-vocab-size", "11"], ["in [6, 10] for a target vocabulary of 96 ids", "got 11"]),
        (["--draft", str(ranked), "--draft-vocab-size", "-1"], ["integer >= 0 (0: full vocabulary), got -1"]),
        (["--draft", str(foreign), "--draft-vocab-size", "8"], ["holds token id 500", "vocabulary [0, 96)"]),
        # below 1/16 of the tiny vocabulary (256 ids for a real one): checked against the target's config
        (["--draft", str(ranked), "--draft-vocab-size", "5"], ["in [6, 10] for a target vocabulary of 96 ids",
                                                               "got 5"]),
    ]
    for command in (["generate", "w05x", "--model", m], ["serve", "--model", m], ["demo", "--model", m]):
        for flags, expected in cases:
            _refused(capsys, [*command, *flags], *expected)
    _refused(capsys, ["generate", "w05x", "--model", m, "--no-draft", "--draft-vocab-size", "4"], "needs a drafter")
    _refused(capsys, ["eval-drafter", "--target", m, "--draft", str(ranked), "--draft-vocab-size", "11"], "got 11")
    _refused(capsys, ["bench", "--model", m, "--draft", str(ranked), "--draft-vocab-size", "11", "--device", "cpu"],
             "got 11")
    _refused(capsys, ["bench", "--shape", "tiny", "--draft-vocab-size", "999999", "--device", "cpu"],
             "--draft-vocab-size with --shape must be in [0,", "got 999999")
    (ranked / "speculative.json").write_text('{"draft_vocab_size": 12}')
    with pytest.raises(ValueError, match=r"size 12 recorded in .*speculative.json cannot be used: draft_vocab_size must be 0 .*\[6, 10\] for a target vocabulary of 96 ids.*got 12"):
        LLM(model=m, draft=str(ranked))
