"""`blockdraft bench` end to end on the CPU: tiny random shape, and a tiny model folder + drafter."""

import importlib.util
import json

import pytest
import torch

from blockdraft.bench.report import validate_report
from blockdraft.cli import main

ZLAB = importlib.util.find_spec("dflash") is not None  # z-lab dflash==0.1.0; its rows are skipped without it


def _run(tmp_path, *args):
    rc = main(["bench", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path / "r"), *args])
    doc = json.loads((tmp_path / "r.json").read_text())
    validate_report(doc)
    rows = {(r["engine"], r["mode"], r["batch_size"]): r for r in doc["results"]}
    parity = {(p["candidate"], p["batch_size"]): p for p in doc["parity"]}
    return rc, doc, rows, parity


def test_tiny_shape_runs_every_engine_and_spec_equals_plain(tmp_path, capsys):
    rc, doc, rows, parity = _run(tmp_path, "--shape", "tiny", "--batch-sizes", "1,3", "--max-tokens", "8",
                                 "--prompt-len", "12")
    assert rc == 0
    out = capsys.readouterr().out
    # GPU criteria are not printed as PASS/FAIL for a CPU run, but stay in the JSON
    assert "step criteria: n/a on the CPU" in out and "FAIL" not in out and "PASS" not in out
    assert doc["criteria"]["plain_step_over_floor"] is not None
    zlab = [("zlab", "plain", 1), ("zlab", "dflash", 1)] if ZLAB else []
    for key in [("ours", "plain", 1), ("ours", "dflash", 1), ("ours", "dflash-forced", 1), ("hf", "plain", 1),
                ("ours", "plain", 3), ("ours", "dflash", 3), ("ours", "dflash-forced", 3), ("hf", "plain", 3), *zlab]:
        assert rows[key]["status"] == "ok", key
        assert rows[key]["tokens_per_s"] > 0 and len(rows[key]["runs"]) == 1
    # fp32 on the CPU: speculation is lossless token for token, and every engine agrees with ours
    pairs = [("ours/dflash", 1), ("ours/dflash", 3), ("hf/plain", 1), ("hf/plain", 3), ("ours/dflash-forced", 1),
             ("ours/dflash-forced", 3)]
    for cand, batch in pairs + ([("zlab/plain", 1), ("zlab/dflash", 1)] if ZLAB else []):
        assert parity[(cand, batch)]["mismatched_requests"] == 0, (cand, batch)
    if ZLAB:
        assert rows[("zlab", "dflash", 3)]["status"] == "n/a"
        assert "one request at a time" in rows[("zlab", "dflash", 3)]["reason"]
        assert rows[("zlab", "dflash", 1)]["acceptance_length"] >= 1.0
    else:
        assert "dflash==0.1.0" in doc["skipped"]["zlab"]
    assert parity[("ours/dflash", 3)]["num_requests"] == 3
    # random drafter: ~1 token per step; forced acceptance: all 7 decode tokens in one step
    assert 1.0 <= rows[("ours", "dflash", 1)]["acceptance_length"] < 2.0
    assert rows[("ours", "dflash-forced", 1)]["acceptance_length"] == 7.0
    assert rows[("ours", "dflash-forced", 1)]["runs"][0]["num_steps"] == 2
    assert rows[("ours", "plain", 3)]["speedup_vs_ours_plain"] == 1.0
    s = doc["settings"]
    assert (s["batch_sizes"], s["block_size"], s["draft_layers"], s["num_speculative_tokens"]) == ([1, 3], 16, 2, 15)
    assert doc["floor"]["plain_step_floor_ms"] > 0 and doc["criteria"]["plain_step_over_floor"] > 0
    assert doc["device"]["type"] == "cpu" and doc["dtype"] == "float32"
    pytest.importorskip("matplotlib")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_num_prompts_sends_more_requests_than_the_batch_size(tmp_path, capsys):
    """--num-prompts 5 at batch sizes 1 and 2: every cell runs all 5 requests (z-lab one at a time,
    HF in batches), outputs still agree with our plain decoding, the JSON and the table say so."""
    rc, doc, rows, parity = _run(tmp_path, "--shape", "tiny", "--batch-sizes", "1,2", "--num-prompts", "5",
                                 "--max-tokens", "6", "--prompt-len", "10", "--warmup", "0")
    assert rc == 0 and doc["settings"]["num_prompts"] == 5
    assert "5 requests per cell, up to 'batch' in flight" in capsys.readouterr().out
    for key, row in rows.items():
        if row["status"] == "ok":
            assert row["num_requests"] == 5 and row["runs"][0]["num_tokens"] == 30, key
    for key, p in parity.items():
        assert (p["num_requests"], p["mismatched_requests"]) == (5, 0), key
    if ZLAB:
        assert rows[("zlab", "plain", 1)]["status"] == "ok" and rows[("zlab", "plain", 2)]["status"] == "n/a"


def test_engine_subset_and_no_draft(tmp_path):
    rc, doc, rows, parity = _run(tmp_path, "--shape", "tiny", "--batch-sizes", "2", "--max-tokens", "4",
                                 "--prompt-len", "8", "--engines", "ours", "--no-draft", "--no-plot", "--warmup", "0")
    assert rc == 0 and list(rows) == [("ours", "plain", 2)]
    assert doc["skipped"] == {"ours/dflash": "no drafter"} and parity == {}
    assert doc["criteria"]["dflash_step_over_plain_step"] is None
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("flag, plain, spec", [(None, 0.0, 0.25), ("0.5", 0.5, 0.5)])
def test_json_records_the_admission_ratio_each_engine_ran_with(tmp_path, flag, plain, spec):
    """Without --admission-batch-ratio each engine takes its own default (0.25 with a drafter, 0
    without): the JSON records those, per engine as load_profile does, beside the flag as given."""
    rc, doc, rows, _ = _run(tmp_path, "--shape", "tiny", "--batch-sizes", "1", "--max-tokens", "3", "--prompt-len",
                            "6", "--engines", "ours", "--no-plot", "--warmup", "0",
                            *(["--admission-batch-ratio", flag] if flag else []))
    assert rc == 0
    s = doc["settings"]
    assert s["admission_batch_ratio_flag"] == (None if flag is None else float(flag))
    assert s["admission_batch_ratio"] == {"plain": plain, "dflash": spec, "dflash-forced": spec}
    assert rows[("ours", "plain", 1)]["admission_batch_ratio"] == plain
    assert rows[("ours", "dflash", 1)]["admission_batch_ratio"] == spec
    assert set(s["mixed_prefill"]) == {"plain", "dflash", "dflash-forced"}
    assert all(isinstance(v, bool) for v in s["mixed_prefill"].values())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shape", "tiny", "--draft", "x"], "--draft is for --model"),
        (["--shape", "tiny", "--batch-sizes", "1,a"], "--batch-sizes takes positive integers"),
        (["--shape", "tiny", "--max-tokens", "1"], "max_tokens (--max-tokens) must be >= 2"),
        (["--shape", "tiny", "--engines", "hf"], "engines must include 'ours'"),
        (["--model", "x", "--no-draft"], "are for --shape"),
        (["--model", "x", "--num-speculative-tokens", "3"], "--num-speculative-tokens needs a drafter"),
        (["--shape", "tiny", "--prompt-len", "0"], "--prompt-len must be >= 1"),
        (["--shape", "tiny", "--prompt-len", "2000", "--engines", "ours"], "exceeds the model's context of 2048"),
        (["--shape", "tiny", "--batch-sizes", "1,8", "--num-prompts", "4"], "num_prompts (--num-prompts) must be >= every batch size, got 4 with batch sizes up to 8"),
        (["--shape", "tiny", "--batch-sizes", "1,8,1"], "--batch-sizes lists 1 twice"),
        (["--shape", "tiny", "--repeats", "0"], "--repeats must be >= 1"),
        (["--shape", "tiny", "--warmup", "-1"], "--warmup must be >= 0"),
        (["--shape", "tiny", "--block-size", "1"], "--block-size must be >= 2"),
    ],
)
def test_bad_flags_exit_2_with_a_named_error(tmp_path, capsys, args, message):
    assert main(["bench", "--device", "cpu", "--out", str(tmp_path / "r"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_out_that_is_a_folder_is_refused_before_the_run(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--shape", "tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {str(tmp_path)!r} is a folder" in err and "[bench" not in err  # nothing built
    assert not (tmp_path.parent / (tmp_path.name + ".json")).exists()


def test_out_prefix_problems_are_named_before_the_run(tmp_path, capsys):
    (tmp_path / "r.json").mkdir()
    assert main(["bench", "--device", "cpu", "--shape", "tiny", "--out", str(tmp_path / "r")]) == 2
    assert f"{str(tmp_path / 'r.json')!r}, where the report would go, is a folder" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["bench", "--device", "cpu", "--shape", "tiny", "--out", str(tmp_path / "file" / "sub" / "r")]) == 2
    assert f"{str(tmp_path / 'file')!r} is a file, not a folder" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--shape", "tiny", "--out", " "]) == 2
    assert "--out is empty" in capsys.readouterr().err


def _tiny_model_folder(path):
    """A tiny Qwen3 checkpoint folder with a word-level tokenizer and a chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import make_tokenizer

    cfg = AutoConfig.for_model("qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=0,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg)
    hf.save_pretrained(path)
    tok = make_tokenizer(96)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w01x"
    tok.save_pretrained(path)
    return hf


def test_model_folder_with_drafter_on_eval_prompts(tmp_path, monkeypatch):
    from blockdraft.config import ModelConfig
    from blockdraft.spec.dflash.checkpoint import export_drafter, random_drafter
    from blockdraft.training import corpora

    model_dir, draft_dir = tmp_path / "model", tmp_path / "drafter"
    hf = _tiny_model_folder(model_dir)
    export_drafter(random_drafter(ModelConfig.from_hf_dict(hf.config.to_dict()), 2, 8, seed=2, init_std=0.2),
                   draft_dir)
    texts = ["w05x w07x w09x", "w10x w11x", "w12x w13x w14x w15x w16x"]
    monkeypatch.setattr(corpora, "eval_prompts", lambda dataset, cache_dir=None: texts)
    rc, doc, rows, parity = _run(tmp_path, "--model", str(model_dir), "--draft", str(draft_dir),
                                 "--batch-sizes", "1,3", "--max-tokens", "6", "--dtype", "float32", "--no-plot")
    assert rc == 0
    assert doc["workload"]["dataset"] == "humaneval" and doc["workload"]["draft"] == str(draft_dir)
    assert doc["settings"]["forced"] is False and ("ours", "dflash-forced", 1) not in rows
    assert doc["settings"]["num_speculative_tokens"] == 7
    assert rows[("ours", "dflash", 3)]["status"] == "ok" and rows[("hf", "plain", 3)]["status"] == "ok"
    # prompts of different lengths: HF left-pads; everything still agrees token for token in fp32
    for cand in ("ours/dflash", "hf/plain"):
        assert parity[(cand, 3)]["mismatched_requests"] == 0
    if ZLAB:
        assert parity[("zlab/dflash", 1)]["mismatched_requests"] == 0


def recorded_ks(monkeypatch) -> list[int]:
    """The K of every DFlash speculator the bench engines build (bench.engines.ours.dflash_speculator),
    in build order: the K a run actually used."""
    from blockdraft.bench.engines import ours

    ks, build = [], ours.dflash_speculator

    def recording(*args, **kwargs):
        spec = build(*args, **kwargs)
        ks.append(spec.num_speculative_tokens)
        return spec

    monkeypatch.setattr(ours, "dflash_speculator", recording)
    return ks


def test_default_k_is_the_drafters_recorded_k_on_this_device_and_the_flag_wins(tmp_path, monkeypatch):
    """Without --num-speculative-tokens, --model runs the K `generate` uses on this device type: the
    speculative.json `per_device.cpu` entry (3) over its top level (2), not B - 1 = 7; the flag wins."""
    from blockdraft.config import ModelConfig
    from blockdraft.spec.dflash.checkpoint import SPECULATIVE_FILE, export_drafter, random_drafter
    from blockdraft.training import corpora

    model_dir, draft_dir = tmp_path / "model", tmp_path / "drafter"
    hf = _tiny_model_folder(model_dir)
    export_drafter(random_drafter(ModelConfig.from_hf_dict(hf.config.to_dict()), 1, 8, seed=2), draft_dir)
    (draft_dir / SPECULATIVE_FILE).write_text(json.dumps({"num_speculative_tokens": 2, "per_device": {
        "cpu": {"num_speculative_tokens": 3}, "cuda": {"num_speculative_tokens": 5}}}))
    monkeypatch.setattr(corpora, "eval_prompts", lambda dataset, cache_dir=None: ["w05x w07x", "w10x"])
    ks = recorded_ks(monkeypatch)
    flags = ("--model", str(model_dir), "--draft", str(draft_dir), "--engines", "ours", "--batch-sizes", "1",
             "--max-tokens", "3", "--warmup", "0", "--dtype", "float32", "--no-plot")
    rc, doc, rows, _ = _run(tmp_path, *flags)
    assert rc == 0 and rows[("ours", "dflash", 1)]["status"] == "ok"
    assert doc["settings"]["num_speculative_tokens"] == 3 and ks == [3]
    rc, doc, _, _ = _run(tmp_path, *flags, "--num-speculative-tokens", "1")
    assert rc == 0 and doc["settings"]["num_speculative_tokens"] == 1 and ks == [3, 1]


def test_suite_k_per_device_type_explicit_and_without_a_recorded_k(tmp_path):
    """suite.num_speculative_tokens, on a workload's drafter folder: the `per_device` entry of the
    workload's device type (cuda here without a GPU: only the device type is read), the setting
    over it, B - 1 without speculative.json or without a folder (a --shape run's random drafter)."""
    from types import SimpleNamespace

    from blockdraft.bench.suite import Settings, num_speculative_tokens
    from blockdraft.spec.dflash.checkpoint import SPECULATIVE_FILE, export_drafter, random_drafter
    from tests.conftest import tiny_config

    drafter = random_drafter(tiny_config("qwen3"), num_layers=1, block_size=8, target_layer_ids=(0, 2), seed=1)
    folder = tmp_path / "drafter"
    export_drafter(drafter, folder)

    def k(device: str, setting: int | None = None, source: dict | None = None) -> int | None:
        wl = SimpleNamespace(drafter=drafter, device=torch.device(device),
                             source={"draft": str(folder)} if source is None else source)
        return num_speculative_tokens(wl, Settings((1,), 8, num_speculative_tokens=setting))

    assert k("cuda") == k("cpu") == 7  # no speculative.json: B - 1
    (folder / SPECULATIVE_FILE).write_text(json.dumps({"num_speculative_tokens": 2, "per_device": {
        "cuda": {"num_speculative_tokens": 5}}}))
    assert (k("cuda"), k("cpu"), k("cuda", 4), k("cpu", 4)) == (5, 2, 4, 4)
    assert (k("cuda", source={}), k("cpu", 4, source={})) == (7, 4)  # no folder: the setting, else B - 1
    (folder / SPECULATIVE_FILE).write_text(json.dumps({"per_device": {"cuda": {"num_speculative_tokens": 9}}}))
    with pytest.raises(ValueError, match=r"block_size - 1 = 7.*recorded K for cuda"):
        k("cuda")


def test_help_says_where_files_go_and_gives_a_quick_cpu_command(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "bench-<shape or model name> in the current folder" in text
    quick = next(line.split() for line in text.splitlines() if "--shape tiny --device cpu" in line)
    assert quick[:2] == ["blockdraft", "bench"] and quick[quick.index("--out") + 1] == "/tmp/bench-tiny"
    assert quick[quick.index("--repeats") + 1] == "1" and quick[quick.index("--warmup") + 1] == "0"


def test_our_engines_alone_do_not_load_a_transformers_copy(tmp_path, monkeypatch):
    import transformers

    from blockdraft.training import corpora

    model_dir = tmp_path / "model"
    _tiny_model_folder(model_dir)
    monkeypatch.setattr(corpora, "eval_prompts", lambda dataset, cache_dir=None: ["w05x w07x", "w10x"])

    def refuse(*a, **k):
        raise AssertionError("the HF model was loaded although no HF-based engine runs")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    rc, doc, rows, _ = _run(tmp_path, "--model", str(model_dir), "--engines", "OURS", "--batch-sizes", "1",
                            "--max-tokens", "4", "--dtype", "float32", "--no-plot")
    assert rc == 0 and rows[("ours", "plain", 1)]["status"] == "ok" and doc["settings"]["engines"] == ["ours"]


def test_out_prefix_drops_a_trailing_json():
    from blockdraft.bench.command import out_prefix

    assert out_prefix("runs/r.json") == "runs/r" and out_prefix("runs/r.JSON") == "runs/r"
    assert out_prefix("runs/r") == "runs/r" and out_prefix("r.png") == "r.png" and out_prefix(".json") == ".json"
