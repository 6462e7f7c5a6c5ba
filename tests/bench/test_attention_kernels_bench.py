"""Smoke test of the attention micro-benchmark on CPU (tiny shapes, no Triton column)."""

from __future__ import annotations

import json

import torch

from blockdraft.bench import attention_kernels


def test_cpu_tiny_run_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert attention_kernels.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--reps", "1",
                                   "--batch", "1", "2", "--ctx", "20", "--out", str(out)]) == 0  # fmt: skip
    records = json.loads(out.read_text())["records"]
    assert [(r["scenario"], r["batch"]) for r in records] == [
        (s, b) for s in ("decode", "verify", "draft") for b in (1, 2)
    ]
    for r in records:
        assert r["rows"] == r["batch"] * attention_kernels.SCENARIO_ROWS[r["scenario"]]
        assert r["torch_ref_ms"] > 0 and r["dense_ms"] > 0 and r["triton_ms"] is None
    assert "draft" in capsys.readouterr().out


def test_draft_batch_layout():
    (q, k, v, k_cache, v_cache), meta = attention_kernels.make_batch("draft", 3, 40, (4, 2, 16), torch.float32, "cpu")
    assert meta.num_block_tokens == 16 and meta.seq_lens.tolist() == [40] * 3
    assert q.shape == (48, 4, 16) and k_cache.shape[0] * k_cache.shape[1] >= 3 * 56


def test_bad_flags_are_refused_with_one_line(capsys):
    import pytest

    for flags, expected in ((["--reps", "0"], "--reps must be >= 1, got 0"), (["--batch", "0"], "--batch must be >= 1"),
                            (["--ctx", "0"], "--ctx must be >= 1"), (["--device", "foo"], "--device must be cpu"),
                            (["--dense-max-gib", "-1"], "--dense-max-gib must be >= 0"),
                            (["--variants"], "--variants times Triton kernel configurations: it needs --device cuda")):
        with pytest.raises(SystemExit) as e:
            attention_kernels.main(["--device", "cpu", "--tiny", *flags] if "--device" not in flags else ["--tiny", *flags])
        assert e.value.code == 2 and expected in capsys.readouterr().err, flags
