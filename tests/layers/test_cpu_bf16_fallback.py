"""CPUs without oneDNN's bf16 path (AVX2 only) get fp32 for dtype "auto" and never pack bf16.

On such a CPU `torch.ops.mkldnn._reorder_linear_weight` refuses bf16 weights ("bf16 path needs
the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"): the README's main command
crashed there before the check. The probe is faked both ways so the test runs on any CPU.
"""

from __future__ import annotations

import torch

from blockdraft.layers import linear
from blockdraft.model_loader import resolve_dtype as _resolve_dtype


def test_auto_dtype_and_packing_follow_the_cpus_bf16_support(monkeypatch):
    bf16_checkpoint = {"torch_dtype": "bfloat16"}
    for fast, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda fast=fast: fast, raising=False)
        assert linear.cpu_has_fast_bf16() is fast
        assert _resolve_dtype("auto", bf16_checkpoint, "cpu") == want
        assert _resolve_dtype("auto", {"torch_dtype": "float16"}, "cpu") == (torch.float16 if fast else torch.float32)
        assert linear.cpu_packing_supported(torch.bfloat16, "cpu") == (fast and linear.cpu_packing_supported(
            torch.float32, "cpu"))
        # an explicit dtype is kept; CUDA's auto is bf16 either way
        assert _resolve_dtype("bfloat16", bf16_checkpoint, "cpu") == torch.bfloat16
        assert _resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda") == torch.bfloat16


def test_a_bf16_model_on_a_cpu_without_bf16_runs_unpacked(monkeypatch):
    from blockdraft.models import build_model
    from tests.conftest import tiny_target

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    config = tiny_target("qwen3", seed=1).config
    model = build_model(config, dtype=torch.bfloat16, device="cpu")
    assert not model.pack_weights
