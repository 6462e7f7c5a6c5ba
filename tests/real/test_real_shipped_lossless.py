"""Each shipped drafter (Qwen2.5-Coder-0.5B's, SmolLM2-135M's) at its shipped defaults (K and
draft vocabulary from its speculative.json, taken by draft="auto") on the real model: speculative
== plain token for token, for a batch of 4, greedy and seeded sampling, and with stops inside the
answers. Unlike a random drafter, a shipped one is accepted often (acceptance length ~1.5-1.9 over
these short answers), so multi-token acceptance runs on real weights."""

import json

import pytest

from blockdraft.drafters import SHIPPED_DIR
from blockdraft.llm import LLM, load_target
from blockdraft.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-0.5b-instruct"
SMOL = "smollm2-135m-instruct"  # draft="auto" takes its drafter on the CPU since session 44 (1.16x there)
PROMPTS = [[{"role": "user", "content": text}] for text in (
    "Write a Python function that reverses a string.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a Python list comprehension is, in two sentences.",
    "Write a haiku about the sea.",
)]
GREEDY = SamplingParams(max_tokens=32)


@pytest.fixture(scope="module", params=[NAME, SMOL])
def engines(request):
    name = request.param
    target = load_target(name, "bfloat16")
    spec = LLM(target=target, draft="auto", dtype="bfloat16")
    plain = LLM(target=target, dtype="bfloat16")
    assert spec.speculator is not None, f"draft='auto' decoded {name} plainly"
    recorded = json.loads((SHIPPED_DIR / name / "speculative.json").read_text())
    assert spec.speculator.num_speculative_tokens == recorded["num_speculative_tokens"]
    assert spec.speculator.draft_head.size == recorded["draft_vocab_size"]
    return spec, plain


@pytest.fixture(scope="module")
def plain_greedy(engines):
    """Plain greedy decoding of PROMPTS, run once: the greedy check and the stops test both need it."""
    return engines[1].generate(PROMPTS, GREEDY)


def _same(spec, plain, params, p=None):
    """Speculative == plain for `params`; `p`: plain's outputs for them when already at hand."""
    s, p = spec.generate(PROMPTS, params), p if p is not None else plain.generate(PROMPTS, params)
    assert [o.token_ids for o in s] == [o.token_ids for o in p]
    assert [(o.text, o.finish_reason) for o in s] == [(o.text, o.finish_reason) for o in p]
    assert sum(o.spec.num_accepted_tokens for o in s) > 0  # drafts were accepted: not a plain path in disguise
    return p


@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7),
], ids=["greedy", "seeded-T0.8"])
def test_shipped_defaults_equal_plain_decoding(engines, params, request):
    _same(*engines, params, request.getfixturevalue("plain_greedy") if params is GREEDY else None)


def test_stops_inside_the_answers_equal_plain_decoding(engines, plain_greedy):
    spec, plain = engines
    full = plain_greedy
    stop_id = full[0].token_ids[12]  # a token in the middle of answer 0
    stop_text = full[1].text[40:46]  # a piece of text in the middle of answer 1
    out = _same(spec, plain, SamplingParams(max_tokens=32, stop_token_ids=[stop_id], stop=[stop_text]))
    assert out[0].finish_reason == "stop" and out[1].finish_reason == "stop"  # the stops really fired
    assert len(out[0].token_ids) <= 13 and stop_text not in out[1].text


@pytest.mark.parametrize("engines", [NAME], indirect=True)  # Qwen2.5's <|endoftext|>: the Qwen target only
def test_endoftext_ends_a_raw_completion_as_in_vllm(engines):
    """<|endoftext|> (151643) is in Qwen2.5's generation_config.json eos ids, which vLLM adds to the
    stop token ids and a GGUF does not carry: decoding stops there, with no text and the id as
    stop_reason, with the drafter as without it."""
    spec, plain = engines
    assert spec.engine.eos_token_ids == plain.engine.eos_token_ids == (151643, 151645)
    # a finished chat turn: the model's next token is <|endoftext|> (checked under ignore_eos)
    prompt = "<|im_start|>user\nCapital of France? One word.<|im_end|>\n<|im_start|>assistant\nParis<|im_end|>\n"
    on = plain.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert on.token_ids[0] == 151643 and len(on.token_ids) == 8
    for llm in (spec, plain):
        out = llm.generate([prompt], SamplingParams(max_tokens=8))[0]
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([151643], "", "stop", 151643)
