"""Bad flags of the `python -m blockdraft.bench.*` scripts are one-line errors before any model
work, not tracebacks (or, for an output path, a traceback after the whole measurement)."""

from __future__ import annotations

import json
import os

import pytest


import blockdraft.model_loader
from blockdraft.bench import (answer_throughput, attention_kernels, cpu_vs_hf, host_overhead, prefix_cache, spec_k,
                              train_throughput)
from blockdraft.errors import check_writable_file
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model


class _ModelWork(Exception):
    """Raised where a benchmark would start its (minutes of) model work."""


def _model_work(*args, **kwargs):
    raise _ModelWork


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-flags")
    model = write_tiny_model(root / "model")
    return str(model), str(write_tiny_drafter(root / "drafter", model))


# ---- the shared output path check ----------------------------------------------------------------


def test_check_writable_file_refuses_a_missing_folder_a_folder_a_file_as_folder_and_unwritable(tmp_path, monkeypatch):
    check_writable_file(str(tmp_path / "ok.json"), "--json")  # a new file in an existing folder
    cases = {
        str(tmp_path / "missing" / "x.json"): "does not exist",
        str(tmp_path): "is a folder",
        str(tmp_path / "new-folder") + "/": "is a folder",
    }
    (tmp_path / "file").write_text("")
    cases[str(tmp_path / "file" / "x.json")] = "is a file, not a folder"
    for path, words in cases.items():
        with pytest.raises(ValueError, match=words) as e:
            check_writable_file(path, "--out")
        assert str(e.value).startswith(f"--out {path!r}")
    assert not (tmp_path / "ok.json").exists()  # the probe leaves no file behind
    with pytest.raises(ValueError, match=r"--out '/proc/blockdraft-probe.json': not writable \('/proc' refuses new files"):
        check_writable_file("/proc/blockdraft-probe.json", "--out")  # os.access says yes to root there
    monkeypatch.setattr(os, "access", lambda *a: False)  # as root every path is writable: fake it
    with pytest.raises(ValueError, match="not writable"):
        check_writable_file(str(tmp_path / "ok.json"), "--json")


# ---- spec_k and prefix_cache ----------------------------------------------------------------------


@pytest.mark.parametrize("main", [spec_k.main, prefix_cache.main])
@pytest.mark.parametrize("where, words", [("/nonexistent/x.json", "does not exist"), (None, "is a folder")])
def test_unwritable_json_is_a_usage_error_before_the_model_loads(main, where, words, tiny, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.setattr(blockdraft.model_loader, "load_target", _model_work)
    path = where or str(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--model", tiny[0], "--draft", tiny[1], "--json", path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --json {path!r}" in err and words in err


@pytest.mark.parametrize("flags, message", [
    (["--ks", "abc"], "--ks: 'abc' in 'abc' is not an integer"),
    (["--ks", "2,,3"], "--ks: '' in '2,,3' is not an integer"),
    (["--ks", "0"], "--ks: 0 in '0' must be >= 1"),
    (["--ks", "99"], "--ks: num_speculative_tokens must be in [1, block_size - 1 = 7] for this drafter, got 99"),
    (["--draft-vocab-sizes", "-1"], "--draft-vocab-sizes: -1 in '-1' must be >= 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--prompts"], "argument --prompts: expected at least one argument"),
    (["--temperature", "-1"], "--temperature must be a number >= 0, got -1"),
    (["--temperature", "nan"], "--temperature must be a number >= 0, got nan"),
    (["--seed", "-3", "--temperature", "1"], "--seed must be >= 0, got -3"),
    (["--temperature", "1", "--write-default"], "--write-default records the greedy measurement: drop --temperature 1"),
])
def test_spec_k_bad_flags_are_usage_errors_before_the_model_loads(flags, message, tiny, monkeypatch, capsys):
    monkeypatch.setattr(blockdraft.model_loader, "load_target", _model_work)
    with pytest.raises(SystemExit) as e:
        spec_k.main(["--model", tiny[0], "--draft", tiny[1], *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_spec_k_write_default_into_an_unwritable_drafter_folder_fails_before_the_model_loads(
        tiny, tmp_path, monkeypatch, capsys):
    import shutil

    monkeypatch.setattr(blockdraft.model_loader, "load_target", _model_work)
    draft = tmp_path / "drafter"
    shutil.copytree(tiny[1], draft)
    (draft / "speculative.json").mkdir()  # a folder where the file would go
    with pytest.raises(SystemExit) as e:
        spec_k.main(["--model", tiny[0], "--draft", str(draft), "--write-default"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --write-default {str(draft / 'speculative.json')!r} is a folder" in err


@pytest.mark.parametrize("flags, message", [
    (["--draft", "/nonexistent"], "error: drafter folder '/nonexistent' does not exist"),
    (["--draft-vocab-sizes", "10"], "error: draft_vocab_size 10 needs the drafter's ranked vocabulary"),
])
def test_spec_k_library_errors_are_one_error_line(flags, message, tiny, monkeypatch, capsys):
    monkeypatch.setattr(blockdraft.model_loader, "load_target", _model_work)
    args = ["--model", tiny[0], "--draft", tiny[1], *flags] if flags[0] != "--draft" else ["--model", tiny[0], *flags]
    assert spec_k.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1


def test_spec_k_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        spec_k.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default qwen2.5-coder-0.5b-instruct)", "(default 1,2,3,4,7,15)", "(default 64)",
                    "medians (default 2)", "(default auto:"):
        assert default in text


def test_prefix_cache_bad_dtype_and_library_errors(tiny, capsys):
    with pytest.raises(SystemExit) as e:
        prefix_cache.main(["--model", tiny[0], "--dtype", "fp8"])
    assert e.value.code == 2 and "argument --dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    assert prefix_cache.main(["--model", tiny[0], "--draft", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: drafter folder '/nonexistent' does not exist") and len(err.strip().splitlines()) == 1


# ---- bench and load_profile: the drafter's K on the device type they run on ----------------------


@pytest.mark.parametrize("command", ["bench", "load_profile"])
def test_a_k_recorded_for_cuda_is_checked_on_cuda_before_any_weights_load(command, tiny, tmp_path, monkeypatch,
                                                                          capsys):
    """Both commands resolve the drafter's K for the device type they run on, as `generate` does:
    on CUDA (faked; nothing is loaded) a `per_device.cuda` K that does not fit the block is refused
    by name before any model work, although the top-level (CPU) K fits."""
    import json
    import shutil

    import torch

    from blockdraft.bench import load_profile, workload
    from blockdraft.cli import main

    draft = tmp_path / "drafter"
    shutil.copytree(tiny[1], draft)
    (draft / "speculative.json").write_text(json.dumps({"num_speculative_tokens": 2, "per_device": {
        "cuda": {"num_speculative_tokens": 9}}}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(workload, "model_workload", _model_work)
    flags = ["--device", "cuda", "--model", tiny[0], "--draft", str(draft)]
    if command == "bench":
        assert main(["bench", *flags, "--out", str(tmp_path / "r")]) == 2
    else:
        with pytest.raises(SystemExit) as e:
            load_profile.main(flags)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "block_size - 1 = 7" in err and "got 9 (recorded K for cuda" in err and "Traceback" not in err


# ---- the other CPU benchmarks with an output file flag ------------------------------------------


@pytest.mark.parametrize("module, work, flag", [
    (answer_throughput, "run", "--out"),
    (train_throughput, "measure", "--out"),
    (host_overhead, "run", "--out"),
    (attention_kernels, "run", "--out"),
    (cpu_vs_hf, "_run_child", "--json-out"),
])
def test_other_benchmarks_refuse_an_unwritable_output_before_running(module, work, flag, tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(module, work, _model_work)
    extra = ["--device", "cpu", "--tiny"] if module is attention_kernels else []
    for path in ("/nonexistent/x.json", str(tmp_path)):
        with pytest.raises(SystemExit) as e:
            module.main([*extra, flag, path])
        assert e.value.code == 2
        assert f"error: {flag} {path!r}" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--admission-batch-ratio", "1.5"], "admission_batch_ratio (--admission-batch-ratio) must be a number in [0, 1], got 1.5"),
    (["--admission-max-wait-steps", "-1"],
     "admission_max_wait_steps (--admission-max-wait-steps) must be an integer >= 0, got -1"),
])
@pytest.mark.parametrize("command", ["bench", "load_profile"])
def test_bad_admission_settings_are_refused_before_any_model_loads(command, flags, message, tiny, monkeypatch, capsys):
    from blockdraft.bench import command as bench_command
    from blockdraft.bench import load_profile
    from blockdraft.cli import main as cli_main

    monkeypatch.setattr(bench_command, "build_workload", _model_work)
    monkeypatch.setattr(load_profile, "model_workload", _model_work, raising=False)
    monkeypatch.setattr(blockdraft.model_loader, "load_target", _model_work)
    if command == "bench":
        code = cli_main(["bench", "--model", tiny[0], "--draft", tiny[1], "--device", "cpu", "--no-plot", *flags])
    else:
        with pytest.raises(SystemExit) as e:
            load_profile.main(["--model", tiny[0], "--draft", tiny[1], "--device", "cpu", *flags])
        code = e.value.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_spec_k_sampled_runs_seeded_and_records_its_temperature(tiny, tmp_path, capsys):
    """--temperature > 0 seeds every request, so the speculative answers equal plain decoding's
    (exit 0 only when every row is identical) and the JSON says how they were sampled."""
    out = tmp_path / "t1.json"
    code = spec_k.main(["--model", tiny[0], "--draft", tiny[1], "--ks", "2", "--max-tokens", "6", "--repeats", "1",
                        "--temperature", "1", "--seed", "7", "--prompts", "w05x w06x", "--json", str(out),
                        "--dtype", "float32"])
    assert code == 0, capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["temperature"] == 1.0 and data["seed"] == 7
    assert all(row["identical"] for row in data["table"])
    assert "T = 1, seed 7" in capsys.readouterr().out
