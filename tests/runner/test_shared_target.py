"""Engines that share one loaded target (LLM(target=...), as the benches build plain and DFlash
side by side) each keep their own attention backend: building a later engine with another backend
must not change what an earlier one runs."""

from __future__ import annotations

import pytest

from blockdraft import SamplingParams
from tests.conftest import make_llm, random_prompts
from tests.spec.test_lossless_dflash import _dflash_llm


def _answers(llm, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=10))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("graph_mode", ["off", "eager"])  # eager: the padded graph-step and prefill code
@pytest.mark.parametrize("speculative", [False, True])
def test_an_engine_keeps_its_backend_after_another_engine_on_the_same_target(llama_target, speculative, graph_mode):
    prompts = random_prompts(3, seed=7)
    build = (lambda **kw: _dflash_llm(llama_target, 3, **kw)) if speculative else (lambda **kw: make_llm(llama_target, **kw))
    first = build(attention_backend="dense", graph_mode=graph_mode)
    before = _answers(first, prompts)
    second = build(attention_backend="torch")  # points the shared target's layers at "torch" (host metadata)
    assert _answers(first, prompts) == before  # "dense" again, not a crash on metadata it does not build
    assert _answers(second, prompts) == before  # and the second runs its own
