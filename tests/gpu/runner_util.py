"""Helpers for the GPU runner tests: tiny random targets and drafters built directly on CUDA,
cached real models, replay counting and a host-sync counter."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from blockdraft.llm import LLM, LoadedTarget, load_target
from blockdraft.models import build_model
from blockdraft.runner.cuda_graphs import TargetGraphs
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.runner.step_tail import StepTailGraphs
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import make_tokenizer, tiny_config

KV_BLOCK_SIZE = 16
NUM_KV_BLOCKS = 512


def cuda_tiny_target(dtype: torch.dtype, arch: str = "qwen3", seed: int = 0) -> LoadedTarget:
    """A random tiny target allocated on the GPU (weights N(0, 0.08), LM head x4 for peaked logits)."""
    config = tiny_config(arch)
    model = build_model(config, dtype=dtype, device="cuda")
    model.init_random_weights_(std=0.08, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return LoadedTarget(config, model, make_tokenizer(config.vocab_size), "<tiny-cuda>")


def cuda_llm(target: LoadedTarget, k: int | None = None, **kw) -> LLM:
    """An engine on CUDA over `target`; k drafts from a random DFlash drafter (None: plain)."""
    kw.setdefault("num_kv_blocks", NUM_KV_BLOCKS)
    kw.setdefault("kv_block_size", KV_BLOCK_SIZE)
    speculator = None
    if k is not None:
        dtype = next(target.model.parameters()).dtype
        drafter = random_drafter(
            target.config, num_layers=2, block_size=16, target_layer_ids=(0, 2), seed=k, init_std=0.1,
            dtype=dtype, device="cuda",
        )  # fmt: skip
        speculator = DFlashSpeculator(drafter, target.model, k, kw["num_kv_blocks"], kw["kv_block_size"])
    return LLM(target=target, device="cuda", speculator=speculator, **kw)


def cached_real_target(name: str, dtype: str) -> LoadedTarget:
    """A catalog model from the cache ($BLOCKDRAFT_CACHE) on CUDA; skips when it is not cached
    (the GPU machine has no network)."""
    from blockdraft.weights.fetch import cache_root, is_complete

    if not is_complete(cache_root() / "models" / name):
        pytest.skip(f"{name} is not in the model cache {cache_root()} (set BLOCKDRAFT_CACHE)")
    return load_target(name, dtype=dtype, device="cuda")


@contextlib.contextmanager
def graph_runs():
    """Record (real, padded) request counts of every target graph run in the block, and the bucket
    of every tail graph run that drafted."""
    target_runs, draft_runs = [], []
    run_target, run_draft = TargetGraphs.run, StepTailGraphs.run

    def target_run(self, batch, load=True):
        target_runs.append((batch.num_reqs, batch.meta.num_reqs))
        return run_target(self, batch, load)

    def draft_run(self, num_reqs, features, sampled=None):
        if self.draft_step is not None:
            draft_runs.append(num_reqs)
        return run_draft(self, num_reqs, features, sampled)

    TargetGraphs.run, StepTailGraphs.run = target_run, draft_run
    try:
        yield target_runs, draft_runs
    finally:
        TargetGraphs.run, StepTailGraphs.run = run_target, run_draft


def host_sync_sites(fn) -> list[str]:
    """"file:line" of each synchronising CUDA operation torch's sync debug mode reports while
    `fn()` runs (the Python line that called it), in order; len() is the count."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def count_host_syncs(fn) -> int:
    """Number of synchronising CUDA operations torch's sync debug mode reports while `fn()` runs."""
    return len(host_sync_sites(fn))


def first_divergences(want: list[list[int]], got: list[list[int]]) -> list[tuple[int, int]]:
    """(request, first differing token index) of each request whose tokens differ, for assertion
    messages (a length difference counts at the shorter length)."""
    out = []
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            out.append((i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))))
    return out
