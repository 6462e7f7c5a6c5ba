"""A tiny random target answering random prompts through our engine: data for CPU training tests."""

from __future__ import annotations

from blockdraft.training.dataset import TokenDataset
from blockdraft.training.generate import generate_with_engine, sampling_plan, to_dataset
from tests.conftest import make_llm, random_prompts, tiny_target

MASK_ID = 95  # the tiny vocab's last id (it may also occur in text: harmless, the mask is only an input)


def tiny_data(n: int = 12, max_new_tokens: int = 20, seed: int = 1, sampled_fraction: float = 0.25):
    """(LoadedTarget, TokenDataset, prompts, responses, sampled) from a tiny llama target."""
    target = tiny_target("llama")
    llm = make_llm(target)
    prompts = random_prompts(n, seed=seed)
    sampled = sampling_plan(n, sampled_fraction, seed)
    responses = generate_with_engine(llm, prompts, max_new_tokens, sampled, seed=seed)
    data: TokenDataset = to_dataset(prompts, responses, sampled, {"target": "tiny"})
    return target, data, prompts, responses, sampled
