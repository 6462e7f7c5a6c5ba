"""--enable-fp32-lm-head on the GPU: the LM head's float32 accumulation of bf16 operands, in eager
steps, graphs and log-probs. `python -m pytest -q tests/gpu`."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from blockdraft.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.gpu.runner_util import cuda_llm, cuda_tiny_target, graph_runs  # noqa: E402

pytestmark = [pytest.mark.gpu]


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_fp32_head_returns_the_unrounded_accumulation_of_the_bf16_operands():
    target = cuda_tiny_target(torch.bfloat16)
    model = target.model
    hidden = torch.randn(5, target.config.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    hidden = hidden.bfloat16()
    logits = model.compute_logits(hidden, fp32_head=True)
    assert logits.dtype == torch.float32 and logits.shape == (5, target.config.vocab_size)
    weight = model.lm_head.weight
    exact = hidden.double() @ weight.double().t()  # the products of the bf16 values, summed exactly
    assert torch.allclose(logits.double(), exact, rtol=0, atol=1e-4)
    rounded = model.compute_logits(hidden, upcast=False)
    assert rounded.dtype == torch.bfloat16
    # bf16 logits are the same sums rounded: at most half a bf16 step away (2^-8 relative), and
    # the float32 ones resolve ties that rounding makes
    assert ((rounded.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    assert (logits.double() - exact).abs().max() < (rounded.double() - exact).abs().max()
    out = torch.full_like(logits, float("nan"))
    assert model.compute_logits(hidden, out=out, fp32_head=True) is out and torch.equal(out, logits)


@pytest.mark.parametrize("k", [None, 15], ids=["plain", "k15"])
def test_graphs_with_fp32_head_equal_the_same_padded_step_run_eagerly(k):
    target = cuda_tiny_target(torch.bfloat16, seed=3)
    prompts = random_prompts(7, seed=4)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
              for i in range(7)]
    want = _tokens(cuda_llm(target, k, graph_mode="eager", enable_fp32_lm_head=True), prompts, params)
    graphed = cuda_llm(target, k, enable_fp32_lm_head=True)
    graphs = graphed.engine.runner.graphs
    assert graphs.target.logits.dtype == torch.float32 and graphs.prefill.logits.dtype == torch.float32
    with graph_runs() as (target_runs, _):
        assert _tokens(graphed, prompts, params) == want
    assert target_runs


@pytest.mark.parametrize("eager", [True, False], ids=["enforce-eager", "graphs"])
def test_every_target_lm_head_call_takes_the_fp32_head(eager, monkeypatch):
    """Each place the engine computes the target's logits (eager steps, graphs, prompt log-probs)
    asks for the float32 head and gets float32 logits. The drafter's proposals through the
    target's head (no draft head here) are drafts, not the target's choices: left out, as in vLLM."""
    from blockdraft.spec.dflash.speculator import DFlashSpeculator

    target = cuda_tiny_target(torch.bfloat16, seed=7)
    calls, compute, block_logits = [], type(target.model).compute_logits, DFlashSpeculator.block_logits
    drafting = [False]

    def spy(self, hidden, *args, **kwargs):
        logits = compute(self, hidden, *args, **kwargs)
        if self is target.model and not drafting[0]:
            calls.append((kwargs.get("fp32_head", False), logits.dtype))
        return logits

    def drafts(self, *args, **kwargs):  # the drafter's proposals through the target's head
        drafting[0] = True
        try:
            return block_logits(self, *args, **kwargs)
        finally:
            drafting[0] = False

    monkeypatch.setattr(type(target.model), "compute_logits", spy)
    monkeypatch.setattr(DFlashSpeculator, "block_logits", drafts)
    llm = cuda_llm(target, 3, enable_fp32_lm_head=True, enforce_eager=eager)
    calls.clear()  # capture and warm-up calls too were checked by the graphs' buffer dtype
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    llm.generate(random_prompts(3, seed=8), params)
    llm.generate(random_prompts(2, seed=9), SamplingParams(max_tokens=12, ignore_eos=True))
    assert calls and all(flag and dtype == torch.float32 for flag, dtype in calls), calls


def test_fp32_head_logprobs_and_prompt_logprobs_are_float32_log_softmax():
    """Eager steps (prompt log-probs run eagerly) take the float32 head too: the reported
    log-probs are log_softmax of the float32 logits, not of bf16-rounded ones."""
    target = cuda_tiny_target(torch.bfloat16, seed=5)
    prompt = random_prompts(1, seed=6)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = cuda_llm(target, enable_fp32_lm_head=True).generate([prompt], params)[0]
    plain = cuda_llm(target, enable_fp32_lm_head=True).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == plain.token_ids
    ids = torch.tensor(prompt + out.token_ids[:-1], device="cuda")
    with torch.inference_mode():
        hidden = _final_hidden(target, ids)
        want = torch.log_softmax(target.model.compute_logits(hidden, fp32_head=True), -1)
    n = len(prompt)
    # the prompt's rows come from one prefill, as here: the same hidden states
    for i in range(1, n):
        assert out.prompt_logprobs[i]["logprob"] == pytest.approx(float(want[i - 1, prompt[i]]), abs=1e-3)
    # decode rows came from 1-row steps, whose bf16 hidden states differ from a prefill's in the last bits
    for i, entry in enumerate(out.logprobs):
        assert entry["logprob"] == pytest.approx(float(want[n - 1 + i, out.token_ids[i]]), abs=3e-2)


def _final_hidden(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states of one sequence `ids` [T] (a fresh paged cache)."""
    from blockdraft.attention.metadata import build_metadata
    from blockdraft.models import allocate_kv_caches

    t, block = ids.numel(), 16
    pages = -(-t // block)
    caches = allocate_kv_caches(target.config, pages, block, torch.bfloat16, "cuda")
    meta = build_metadata([t], [t], [list(range(pages))], block, device="cuda")
    hidden, _ = target.model(ids, torch.arange(t, device="cuda"), caches, meta, ())
    return hidden
