"""A model with several end-of-generation ids (Qwen2.5: <|im_end|> and <|endoftext|>; model_loader.
model_eos_ids): a request ends at any of them, the tokenizer's EOS with stop_reason None and the
other ids with their id (vLLM adds generation_config's extra eos ids to the stop token ids);
speculative decoding ends at the same token as plain decoding, also when the id is accepted inside
a verify block, and min_tokens masks every id on both paths."""

import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import EOS_ID, VOCAB, make_llm, random_prompts, word
from tests.spec.doubles import KnownAnswerSpeculator
from tests.spec.test_lossless_dflash import _dflash_llm

K = 7


def _outs(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]


@pytest.fixture(scope="module")
def setup(llama_target):
    """Prompts, their plain continuation (ignore_eos) and a second EOS id: the first token of prompt
    0's answer, from its 4th on, that did not occur before (so the answer ends there, mid-block)."""
    prompts = random_prompts(4, seed=21)
    free = make_llm(llama_target).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    ids = free[0].token_ids
    at = next(i for i in range(3, 12) if ids[i] not in ids[:i] and ids[i] != EOS_ID)
    return prompts, {tuple(p): p + o.token_ids for p, o in zip(prompts, free)}, ids[at], at


def _engines(llama_target, answers, second):
    oracle = KnownAnswerSpeculator(K, answers, VOCAB, p_right=1.0, seed=1)  # whole blocks accepted
    engines = {"plain": make_llm(llama_target), "oracle": make_llm(llama_target, speculator=oracle),
               "dflash": _dflash_llm(llama_target, K)}
    oracle.engine = engines["oracle"].engine
    for llm in engines.values():
        llm.engine.eos_token_ids = (EOS_ID, second)
    return engines


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24),
    SamplingParams(max_tokens=24, include_stop_str_in_output=True),
    SamplingParams(max_tokens=24, min_tokens=8),
    SamplingParams(max_tokens=24, temperature=0.9, seed=4),
    SamplingParams(max_tokens=24, ignore_eos=True),
], ids=["greedy", "with-stop-text", "min-tokens", "seeded", "ignore-eos"])
def test_every_eos_id_ends_the_request_alike_with_and_without_drafts(llama_target, setup, params):
    prompts, answers, second, at = setup
    engines = _engines(llama_target, answers, second)
    plain = _outs(engines["plain"].generate(prompts, params))
    for name in ("oracle", "dflash"):
        assert _outs(engines[name].generate(prompts, params)) == plain, name
    first = plain[0]
    if params.ignore_eos:
        assert len(first[0]) == 24 and first[2] == "length"
    elif params.min_tokens:
        assert second not in first[0][:8] and EOS_ID not in first[0][:8]  # masked below min_tokens
    elif params.temperature == 0:
        assert first[0] == answers[tuple(prompts[0])][len(prompts[0]):][:at + 1]  # ends at the second id
        assert first[2:] == ("stop", second)  # not the tokenizer's EOS: its id, as vLLM's stop_token_ids
        assert first[1].endswith(word(second)) == params.include_stop_str_in_output
    if params.temperature == 0 and not params.min_tokens:  # the oracle drafts these answers: whole blocks
        assert engines["oracle"].engine.stats.spec.acceptance_length > 2  # the stop fell inside one


def test_the_tokenizer_eos_keeps_no_stop_reason(llama_target, setup):
    """An EOS id the tokenizer does not name records its id; the tokenizer's EOS records None."""
    prompts, answers, second, at = setup
    plain = make_llm(llama_target)
    plain.engine.eos_token_ids = (EOS_ID, second)
    out = plain.generate(prompts[:1], SamplingParams(max_tokens=24))[0]
    assert (len(out.token_ids), out.finish_reason, out.stop_reason) == (at + 1, "stop", second)
    plain.engine.eos_token_ids = (EOS_ID,)
    eos_out = plain.generate([prompts[0]], SamplingParams(max_tokens=24, logit_bias={EOS_ID: 100.0}))[0]
    assert (eos_out.token_ids, eos_out.finish_reason, eos_out.stop_reason) == ([EOS_ID], "stop", None)
