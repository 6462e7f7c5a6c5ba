"""Which drafter `generate` / `serve` use by default (`--draft auto`), and the recorded default K."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from blockdraft.cli import main
from blockdraft.drafters import SHIPPED_DIR, check_draft_flags, resolve_draft, shipped_drafter
from blockdraft.llm import LLM
from blockdraft.spec.dflash.checkpoint import (
    SPECULATIVE_FILE,
    draft_auto_off_reason,
    read_drafter_config,
    recommended_draft_vocab_size,
    recommended_num_speculative_tokens,
    resolve_num_speculative_tokens,
    write_recommended_num_speculative_tokens,
)
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

QWEN, SMOL = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = write_tiny_model(root / "model")
    return model, write_tiny_drafter(root / "drafter", model)


def test_auto_picks_the_shipped_drafter_for_catalog_models_and_nothing_otherwise(tmp_path):
    qwen = str(shipped_drafter(QWEN, cache_dir=tmp_path))
    assert resolve_draft(None, QWEN, cache_dir=tmp_path) == resolve_draft("auto", QWEN, cache_dir=tmp_path) == qwen
    for name in (QWEN, SMOL):  # both ship as int8 packs, expanded into the cache on first use
        path = resolve_draft("auto", name, cache_dir=tmp_path, device_type="cuda")
        assert path is not None and (tmp_path / "drafters") in Path(path).parents
    assert resolve_draft("auto", "qwen2.5-coder-1.5b-instruct") is None  # catalog model, no drafter
    assert resolve_draft("auto", str(tmp_path)) is None  # a model folder
    # A path is never taken for a catalog name, not even the shipped folder's own path.
    assert shipped_drafter(str(SHIPPED_DIR / QWEN)) is None
    assert resolve_draft("auto", QWEN, no_draft=True) is None
    assert resolve_draft("shipped", QWEN, cache_dir=tmp_path) == qwen
    assert resolve_draft("/some/drafter", QWEN) == "/some/drafter"


def test_auto_decodes_plainly_where_the_shipped_drafter_measured_slower(tmp_path, caplog, monkeypatch):
    """A shipped drafter whose speculative.json says draft_auto: false at the top level (it
    measured slower than plain decoding on a CPU; SmolLM2's did until session 44, 0.97x): auto
    skips it there, with a warning naming the file and how to speculate anyway; shipped, K or a
    draft vocabulary still take it."""
    import blockdraft.drafters as drafters

    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR / SMOL, shipped / SMOL)
    spec = json.loads((shipped / SMOL / "speculative.json").read_text())
    spec.update(draft_auto=False, table=[{"k": 3, "speedup": 0.97}])
    (shipped / SMOL / "speculative.json").write_text(json.dumps(spec))
    monkeypatch.setattr(drafters, "SHIPPED_DIR", shipped)
    cache = tmp_path / "cache"
    assert resolve_draft("auto", SMOL, cache_dir=cache, device_type="cpu") is None
    assert re.search(r"slower than plain decoding on cpu \(fastest: K = 3 at 0\.97x\)", caplog.text)
    assert "--draft shipped" in caplog.text and not (cache / "drafters").exists()  # nothing expanded
    smol = str(shipped_drafter(SMOL, cache_dir=cache))
    assert resolve_draft("auto", SMOL, cache_dir=cache, device_type="cuda") == smol
    assert resolve_draft("shipped", SMOL, cache_dir=cache, device_type="cpu") == smol
    assert resolve_draft("auto", SMOL, cache_dir=cache, num_speculative_tokens=1) == smol
    assert resolve_draft("auto", SMOL, cache_dir=cache, draft_vocab_size=0) == smol  # 0 = full vocabulary


def test_cli_auto_says_it_decodes_plainly_only_once_the_flags_are_checked(tiny, tmp_path, caplog, monkeypatch, capsys):
    """generate / serve --draft auto where the shipped drafter measured slower: a bad flag's error
    comes alone, not after the warning (the engine says it once its checks pass); good flags get
    the warning and plain decoding."""
    import blockdraft.drafters as drafters
    import blockdraft.weights.fetch as fetch

    model, _ = tiny
    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR / SMOL, shipped / SMOL)
    spec = json.loads((shipped / SMOL / "speculative.json").read_text())
    (shipped / SMOL / "speculative.json").write_text(json.dumps(spec | {"draft_auto": False}))
    monkeypatch.setattr(drafters, "SHIPPED_DIR", shipped)
    real = fetch.resolve_model_path  # SMOL's name, the tiny model's files: no download
    monkeypatch.setattr(fetch, "resolve_model_path", lambda m, cache_dir=None: model if m == SMOL else real(m, cache_dir))
    base = ["--model", SMOL, "--device", "cpu"]
    for command in (["generate", "w05x"], ["serve", "--port", "0"]):
        for flags in (["--max-model-len", "0"], ["--gpu-memory-utilization", "0"]):
            caplog.clear()
            assert main([*command, *base, *flags]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: ") and "(--" in err and "slower than plain" not in caplog.text + err, err
    assert main(["generate", "w05x", *base, "--max-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_speculative_tokens"] is None
    assert "slower than plain decoding on cpu" in caplog.text


def test_both_shipped_drafters_measured_faster_than_plain_on_a_cpu(tmp_path):
    """The shipped speculative.json files: Qwen's drafter 1.31x (session 22), SmolLM2's 1.16x at
    K = 3 (session 44's drafter; 0.97x before): auto takes both on the CPU."""
    for name in (QWEN, SMOL):
        assert resolve_draft("auto", name, cache_dir=tmp_path, device_type="cpu") is not None, name


def test_draft_auto_flag_per_device_type(tmp_path):
    write = lambda d: (tmp_path / SPECULATIVE_FILE).write_text(json.dumps(d))  # noqa: E731
    write({"num_speculative_tokens": 2, "draft_auto": False, "table": [{"k": 1, "speedup": 0.7}, {"k": 2, "speedup": 0.8}]})
    assert "(fastest: K = 2 at 0.80x)" in draft_auto_off_reason(tmp_path, "cpu")
    assert draft_auto_off_reason(tmp_path, "cuda") is None  # the top level is a CPU measurement
    # a per_device.cpu entry without its own flag (e.g. only a K) leaves the top level's in force
    write({"draft_auto": False, "per_device": {"cpu": {"num_speculative_tokens": 3}}})
    assert draft_auto_off_reason(tmp_path, "cpu") is not None
    write({"draft_auto": False, "per_device": {"cpu": {"draft_auto": True}}})
    assert draft_auto_off_reason(tmp_path, "cpu") is None
    write({"draft_auto": True, "per_device": {"cuda": {"draft_auto": False}}})
    assert draft_auto_off_reason(tmp_path, "cpu") is None
    assert "slower than plain decoding on cuda, so" in draft_auto_off_reason(tmp_path, "cuda")
    write({"num_speculative_tokens": 2})
    assert draft_auto_off_reason(tmp_path, "cpu") is None
    write({"draft_auto": "no"})
    for device in ("cpu", "cuda"):  # a bad value is refused whichever device reads it
        with pytest.raises(ValueError, match="draft_auto must be true or false, got 'no'"):
            draft_auto_off_reason(tmp_path, device)
    write({"per_device": {"cuda": {"draft_auto": 0}}})
    with pytest.raises(ValueError, match="per_device.cuda.draft_auto must be true or false, got 0"):
        draft_auto_off_reason(tmp_path, "cpu")


def test_resolution_errors_name_the_problem():
    with pytest.raises(ValueError, match="no drafter ships for model 'qwen2.5-coder-1.5b-instruct'"):
        resolve_draft("shipped", "qwen2.5-coder-1.5b-instruct")
    with pytest.raises(ValueError, match="--num-speculative-tokens needs a drafter, and none ships"):
        resolve_draft("auto", "qwen2.5-coder-1.5b-instruct", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="contradict"):
        check_draft_flags("/some/drafter", True, None)
    with pytest.raises(ValueError, match="drop --no-draft"):
        check_draft_flags("auto", True, 3)
    with pytest.raises(ValueError, match="--draft-vocab-size 100 needs a drafter; drop --no-draft"):
        check_draft_flags(None, True, None, 100)
    check_draft_flags("auto", True, None, 0)  # 0 = full vocabulary: nothing to contradict
    check_draft_flags("auto", True, None)  # the default --draft with --no-draft: plain decoding
    check_draft_flags(None, False, 3)


def test_cli_generate_defaults(tiny, tmp_path, capsys):
    model, drafter = tiny
    assert main(["generate", "w05x w06x", "--model", str(model), "--max-tokens", "6", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)  # a folder model has no shipped drafter: plain decoding
    assert plain["num_speculative_tokens"] is None and plain["acceptance_length"] is None
    assert main(["generate", "w05x w06x", "--model", str(model), "--max-tokens", "6", "--json",
                 "--draft", str(drafter)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["num_speculative_tokens"] == 7 and spec["token_ids"] == plain["token_ids"]
    drafted, rates = spec["drafted_per_position"], spec["acceptance_per_position"]  # 6 tokens: blocks cut short
    assert len(drafted) == len(rates) > 0 and drafted == sorted(drafted, reverse=True) and drafted[0] > 0
    assert all(r is None if d == 0 else 0 <= r <= 1 for r, d in zip(rates, drafted))
    assert main(["generate", "w05x", "--model", str(model), "--num-speculative-tokens", "3"]) == 2
    assert "none ships for model" in capsys.readouterr().err


def test_cli_generate_truncate_prompt_tokens(tiny, capsys):
    """--truncate-prompt-tokens N, vLLM's field as a flag (the too-long-prompt error names it):
    only the last N prompt tokens run, with a drafter too (the same answer)."""
    model, drafter = tiny
    base = ["generate", "w05x w06x w07x w08x w09x", "--model", str(model), "--raw", "--max-tokens", "4", "--json",
            "--truncate-prompt-tokens", "2"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", "w08x w09x", "--model", str(model), "--raw", "--max-tokens", "4", "--json"]) == 0
    assert plain["num_prompt_tokens"] == 2 and plain["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*base, "--draft", str(drafter)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]


def test_cli_generate_summary_line(tiny, capsys):
    """Singular for one token; with a drafter but no verify step (one token: prefill only), acceptance n/a."""
    model, drafter = tiny
    assert main(["generate", "w05x w06x", "--model", str(model), "--max-tokens", "1", "--draft", str(drafter)]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[1 token in ") and "DFlash K=7" in line and "acceptance length n/a" in line
    assert main(["generate", "w05x w06x", "--model", str(model), "--max-tokens", "6", "--draft", str(drafter)]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[6 tokens in ") and "acceptance length n/a" not in line
    assert "acceptance length 1." in line  # a verify step ran: a number >= 1
    assert main(["generate", "w05x w06x", "--model", str(model), "--max-tokens", "1", "--no-draft"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[1 token in ") and "acceptance" not in line
    assert main(["generate", "w05x", "--no-draft", "--num-speculative-tokens", "3"]) == 2
    assert "drop --no-draft" in capsys.readouterr().err


def test_recorded_k_is_the_default_and_an_explicit_k_wins(tiny, tmp_path):
    model, drafter = tiny
    folder = tmp_path / "drafter"
    shutil.copytree(drafter, folder)
    assert recommended_num_speculative_tokens(folder) is None
    write_recommended_num_speculative_tokens(folder, 3, {"note": "test"})
    assert recommended_num_speculative_tokens(folder) == 3
    assert json.loads((folder / SPECULATIVE_FILE).read_text()) == {"num_speculative_tokens": 3, "note": "test"}
    assert LLM(model=str(model), draft=str(folder)).speculator.num_speculative_tokens == 3
    assert LLM(model=str(model), draft=str(folder), num_speculative_tokens=5).speculator.num_speculative_tokens == 5
    write_recommended_num_speculative_tokens(folder, 9)  # more than block_size - 1 = 7
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, block_size - 1 = 7\]"):
        LLM(model=str(model), draft=str(folder))
    (folder / SPECULATIVE_FILE).write_text('{"num_speculative_tokens": 0}')
    with pytest.raises(ValueError, match="speculative.json: num_speculative_tokens must be an integer >= 1, got 0"):
        recommended_num_speculative_tokens(folder)
    (folder / SPECULATIVE_FILE).write_text("[3]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        recommended_num_speculative_tokens(folder)


def test_a_k_recorded_per_device_type_wins_on_that_device_and_survives_a_rewrite(tiny, tmp_path):
    """speculative.json's `per_device` entry (e.g. K measured on a GPU) applies on that device
    type; the top-level K (measured on a CPU) everywhere else; rewriting the CPU K keeps it."""
    _, drafter = tiny
    folder = tmp_path / "drafter"
    shutil.copytree(drafter, folder)
    config = read_drafter_config(folder)
    (folder / SPECULATIVE_FILE).write_text(json.dumps(
        {"num_speculative_tokens": 2, "draft_vocab_size": 0, "per_device": {"cuda": {"num_speculative_tokens": 7}}}))
    assert recommended_num_speculative_tokens(folder) == 2 == recommended_num_speculative_tokens(folder, "cpu")
    assert recommended_num_speculative_tokens(folder, "cuda") == 7
    assert resolve_num_speculative_tokens(None, folder, config, "cuda") == 7
    assert resolve_num_speculative_tokens(3, folder, config, "cuda") == 3  # explicit K wins
    assert recommended_draft_vocab_size(folder, "cuda") == 0  # not in the entry: the top-level value
    write_recommended_num_speculative_tokens(folder, 1, {"note": "re-measured on a CPU"})
    assert recommended_num_speculative_tokens(folder) == 1 and recommended_num_speculative_tokens(folder, "cuda") == 7
    (folder / SPECULATIVE_FILE).write_text(json.dumps({"num_speculative_tokens": 2, "per_device": {"cuda": 15}}))
    with pytest.raises(ValueError, match=r"speculative.json: per_device must map device types to JSON objects"):
        recommended_num_speculative_tokens(folder, "cuda")
    (folder / SPECULATIVE_FILE).write_text(json.dumps({"per_device": {"cuda": {"num_speculative_tokens": 9}}}))
    with pytest.raises(ValueError, match=r"block_size - 1 = 7.*recorded K for cuda"):
        resolve_num_speculative_tokens(None, folder, config, "cuda")
    assert resolve_num_speculative_tokens(None, folder, config, "cpu") == 7  # no CPU K: block_size - 1


def test_shipped_k_files_are_valid_and_travel_with_the_int8_expansion(tmp_path, monkeypatch):
    for name in (QWEN, SMOL):
        block_size = json.loads((SHIPPED_DIR / name / "config.json").read_text())["dflash_config"]["block_size"]
        for device_type in ("cpu", "cuda"):
            k = recommended_num_speculative_tokens(SHIPPED_DIR / name, device_type)
            assert k is None or 1 <= k <= block_size - 1
    # the Qwen drafter's GPU K is its own measurement (H200, 32 requests in flight: K = 5 fastest), not the CPU's
    assert recommended_num_speculative_tokens(SHIPPED_DIR / QWEN, "cuda") == 5
    # The expanded int8 folder carries the K file, and a new K gives a new expansion (never stale).
    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR / SMOL, shipped / SMOL)
    monkeypatch.setattr("blockdraft.drafters.SHIPPED_DIR", shipped)
    write_recommended_num_speculative_tokens(shipped / SMOL, 2)
    first = shipped_drafter(SMOL, cache_dir=tmp_path / "cache")
    assert recommended_num_speculative_tokens(first) == 2
    write_recommended_num_speculative_tokens(shipped / SMOL, 4)
    second = shipped_drafter(SMOL, cache_dir=tmp_path / "cache")
    assert second != first and recommended_num_speculative_tokens(second) == 4


def test_shipped_draft_vocab_is_valid_and_travels_with_the_int8_expansion(tmp_path, monkeypatch):
    import torch

    from blockdraft.spec.draft_vocab import (
        DRAFT_VOCAB_FILE,
        draft_vocab_capacity,
        load_draft_vocab,
        read_draft_vocab_metadata,
        save_draft_vocab,
    )

    qwen = SHIPPED_DIR / QWEN
    ids = load_draft_vocab(qwen, 32768, vocab_size=151936)
    assert draft_vocab_capacity(qwen) == 32768 and ids[:2].tolist() == [151645, 151643]  # EOS ids first
    meta = read_draft_vocab_metadata(qwen)
    assert meta["num_tokens"] > 10**6 and set(meta["coverage"]) == {"humaneval", "mtbench"}
    # the measured CPU default (bench.spec_k --write-default) uses it, within the file's range
    recorded = json.loads((qwen / SPECULATIVE_FILE).read_text()).get("draft_vocab_size")
    assert recorded is None or 1 <= recorded <= draft_vocab_capacity(qwen)
    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR / SMOL, shipped / SMOL)
    monkeypatch.setattr("blockdraft.drafters.SHIPPED_DIR", shipped)
    save_draft_vocab(shipped / SMOL, torch.tensor([2, 0, 1]), torch.tensor([0, 5, 4]), {"source": "test"})
    expanded = shipped_drafter(SMOL, cache_dir=tmp_path / "cache")
    assert (expanded / DRAFT_VOCAB_FILE).is_file() and load_draft_vocab(expanded, 3).tolist() == [2, 0, 1]


def test_llm_api_takes_auto_and_shipped(tiny):
    model, _ = tiny
    assert LLM(model=str(model)).speculator is None  # the Python API decodes plainly by default
    assert LLM(model=str(model), draft="auto").speculator is None  # a folder model has no shipped drafter
    with pytest.raises(ValueError, match="no drafter ships for model"):
        LLM(model=str(model), draft="shipped")


def test_a_shipped_folder_without_weights_is_named_not_taken_for_no_drafter(tmp_path, monkeypatch):
    """An incomplete install (config.json but no weights file) fails naming the folder, for
    `auto` too, instead of "no drafter ships" or a silent fall back to plain decoding."""
    import blockdraft.drafters as drafters

    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR / QWEN, shipped / QWEN, ignore=shutil.ignore_patterns("model.*"))
    monkeypatch.setattr(drafters, "SHIPPED_DIR", shipped)
    for draft in ("auto", "shipped"):
        with pytest.raises(FileNotFoundError, match=f"shipped drafter for '{QWEN}' in .*neither model.safetensors"):
            resolve_draft(draft, QWEN, cache_dir=tmp_path)
