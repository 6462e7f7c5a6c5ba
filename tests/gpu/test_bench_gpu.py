"""`blockdraft bench` on CUDA (tiny shape, bf16): every engine runs, forced acceptance is captured
into the tail graphs and accepts, the JSON is valid. Timings are not asserted."""

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.gpu_exclusive  # the bench sizes its pools from the free GPU memory (0.9)
@pytest.mark.parametrize("eager", [False, True])
def test_bench_tiny_shape_on_cuda(tmp_path, eager):
    from blockdraft.bench.report import validate_report
    from blockdraft.cli import main

    args = ["bench", "--shape", "tiny", "--device", "cuda", "--batch-sizes", "1,4", "--max-tokens", "32",
            "--prompt-len", "16", "--repeats", "1", "--no-plot", "--out", str(tmp_path / "r")]
    assert main(args + (["--enforce-eager"] if eager else [])) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    validate_report(doc)
    rows = {(r["engine"], r["mode"], r["batch_size"]): r for r in doc["results"]}
    for key in [("ours", m, b) for m in ("plain", "dflash", "dflash-forced") for b in (1, 4)] + [("hf", "plain", 4)]:
        assert rows[key]["status"] == "ok", (key, rows[key]["reason"])
        assert rows[key]["ms_per_step"] is not None, key
        assert rows[key]["deterministic"] or key[0] != "ours", key
    # random drafter ~1 token per step; forced drafts are accepted until a bf16 near-tie (tiny random
    # logits are flat) makes the batch diverge from the batch-1 reference
    assert rows[("ours", "dflash-forced", 1)]["acceptance_length"] > 1.5
    assert doc["device"]["type"] == "cuda" and doc["dtype"] == "bfloat16"
    assert doc["settings"]["llm_options"] == ({"enforce_eager": True} if eager else {})


@pytest.mark.gpu_exclusive  # as above
def test_bench_num_prompts_keeps_the_window_on_cuda(tmp_path):
    """--num-prompts 6 at batch sizes 1 and 4 with CUDA graphs and async scheduling: every cell runs
    the 6 requests (a request joins as one finishes), and every output is compared with our plain
    decoding's (tiny random bf16 logits are flat: near-ties, not asserted here; the CPU tests pin
    the window's tokens exactly in fp32)."""
    from blockdraft.bench.report import validate_report
    from blockdraft.cli import main

    args = ["bench", "--shape", "tiny", "--device", "cuda", "--batch-sizes", "1,4", "--num-prompts", "6",
            "--max-tokens", "24", "--prompt-len", "16", "--repeats", "1", "--no-plot", "--no-forced",
            "--out", str(tmp_path / "r")]  # fmt: skip
    assert main(args) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    validate_report(doc)
    for r in doc["results"]:
        if r["status"] == "ok":
            assert r["num_requests"] == 6 and r["runs"][0]["num_tokens"] == 6 * 24, r
    assert {(p["candidate"], p["batch_size"]) for p in doc["parity"]} >= {("ours/dflash", 1), ("ours/dflash", 4)}
    assert all(p["num_requests"] == 6 for p in doc["parity"])


def test_attention_kernels_bench_times_graph_replays_and_variants(tmp_path):
    """`python -m blockdraft.bench.attention_kernels --variants` on tiny shapes: every Triton
    column and forced configuration is timed (graph replays) and matches the torch oracle."""
    from blockdraft.bench import attention_kernels

    out = tmp_path / "ak.json"
    assert attention_kernels.main(["--tiny", "--batch", "1", "2", "--ctx", "24", "--scenarios", "verify", "draft",
                                   "--variants", "--out", str(out)]) == 0  # fmt: skip
    records = json.loads(out.read_text())["records"]
    assert len(records) == 4
    for r in records:
        assert all(r[f"{col}_ms"] > 0 for col in attention_kernels.TRITON_PATHS)
        assert r["max_err"] < 2e-2
        variants = r["variants_ms"]
        assert {"1row-s1", "m16-auto", "m128-s4"} <= set(variants) and all(v > 0 for v in variants.values())
