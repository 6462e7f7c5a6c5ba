"""allowed_token_ids and bad_words (vLLM's) stay lossless under speculation: each verify row's
bad-word bans follow the output and the drafts before it, so oracle drafts (whole blocks
accepted), half-right and random drafts and a DFlash drafter give plain decoding's output token
for token, greedy and seeded, K = 3 and 7, in batches mixed with unconstrained requests; and the
masks do what they say (only allowed ids, never a bad word's tokens in the output)."""

from __future__ import annotations

import math

import pytest

from blockdraft import SamplingParams
from tests.conftest import EOS_ID, VOCAB, make_llm, random_prompts, word
from tests.spec.test_lossless_dflash import _dflash_llm, dflash_and_oracle_llms

ALLOWED = [3, 5, 7, 9, 11, 13, 17, 19, 23, 29]


def _text(ids) -> str:
    """The bad word spelling token ids in the word-level test tokenizer (a word per token)."""
    return " ".join(word(t) for t in ids)


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def _bad_words(free: list[int]) -> list[list[int]]:
    """Two- and three-token words the unconstrained answer `free` spells (so the model wants them:
    a ban that ignored the drafts would let them through), and one token it emits (banned always)."""
    return [free[2:4], free[5:8], free[9:11], [free[12]]]


def _params(free_answers: list[list[int]], temperature: float, penalties: bool = True) -> list[SamplingParams]:
    """A batch mixing every kind of mask with unconstrained requests (one per prompt); without
    `penalties` no request has one (each may then continue under async scheduling but for its mask)."""
    out = []
    for i, free in enumerate(free_answers):
        kw = dict(max_tokens=40, ignore_eos=True, temperature=temperature, seed=i)
        words = [_text(w) for w in _bad_words(free)]
        kind = i % 5
        if kind == 0:
            kw.update(bad_words=words)
        elif kind == 1:
            kw.update(allowed_token_ids=ALLOWED)
        elif kind == 2:
            kw.update(bad_words=words, allowed_token_ids=sorted(set(ALLOWED) | set(free)))
        elif kind == 3 and penalties:  # with a penalty and a bias that pushes a banned token: the ban wins
            kw.update(bad_words=words, frequency_penalty=0.4, logit_bias={free[12]: 20.0})
        out.append(SamplingParams(**kw))
    return out


def _free(llm, prompts, temperature) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_tokens=40, ignore_eos=True,
                                                                      temperature=temperature, seed=i)
                                                       for i in range(len(prompts))])]


def _check_masks(free_answers, params, outs):
    """Every output keeps its masks, and the masks changed the answers."""
    for free, p, ids in zip(free_answers, params, outs):
        if p.allowed_token_ids is not None:
            assert set(ids) <= set(p.allowed_token_ids)
        if p.bad_words:
            assert not any(_contains(ids, w) for w in _bad_words(free)), (ids, p.bad_words)
        if p.masks_tokens:
            assert ids != free
        else:
            assert ids == free


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [3, 7])
def test_masked_speculative_output_equals_plain(llama_target, temperature, k):
    prompts = random_prompts(10, seed=80 + k)
    plain_llm = make_llm(llama_target)
    free_answers = _free(plain_llm, prompts, temperature)
    params = _params(free_answers, temperature)
    plain = [o.token_ids for o in plain_llm.generate(prompts, params)]
    _check_masks(free_answers, params, plain)
    answers = {tuple(p): p + o for p, o in zip(prompts, plain)}
    engines = dflash_and_oracle_llms(llama_target, k, answers, VOCAB)
    for name, llm in engines.items():
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain, name
    # whole blocks were accepted, so bans inside blocks were computed from drafts
    assert engines["oracle-1.0"].engine.stats.spec.acceptance_length > 0.8 * (k + 1)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_stops_inside_accepted_blocks_under_masks_equal_plain(llama_target, temperature):
    """A stop token id and a stop string taken from the middle of each masked answer, and EOS
    allowed: with whole blocks accepted (oracle drafts) the stop falls inside a verified block, and
    the output, finish and stop reasons are plain decoding's."""
    import dataclasses

    k = 7
    prompts = random_prompts(10, seed=61)
    plain_llm = make_llm(llama_target)
    params = _params(_free(plain_llm, prompts, temperature), temperature)
    masked = [o.token_ids for o in plain_llm.generate(prompts, params)]
    params = [dataclasses.replace(p, ignore_eos=False, stop_token_ids=[ids[13]], stop=[_text([ids[21]])])
              for p, ids in zip(params, masked)]
    want = [(o.token_ids, o.finish_reason, o.stop_reason) for o in plain_llm.generate(prompts, params)]
    assert sum(reason == "stop" and len(ids) < 40 for ids, reason, _ in want) >= 8  # the stops were reached
    answers = {tuple(p): p + ids for p, (ids, _, _) in zip(prompts, want)}
    engines = dflash_and_oracle_llms(llama_target, k, answers, VOCAB)
    for name, llm in engines.items():
        got = [(o.token_ids, o.finish_reason, o.stop_reason) for o in llm.generate(prompts, params)]
        assert got == want, name
    assert engines["oracle-1.0"].engine.stats.spec.acceptance_length > 0.6 * (k + 1)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_masked_requests_on_the_graph_step_code(llama_target, async_scheduling):
    """The padded uniform-step code the CUDA graphs capture, run eagerly on the CPU (the masks
    applied between the target and tail steps), with async scheduling: bad words of several
    tokens never continue before their tokens are read back; allowed_token_ids and one-token bad
    words (the same mask every step) still do, and the output is plain decoding's."""
    prompts = random_prompts(5, seed=11)
    plain = make_llm(llama_target)
    params = _params(_free(plain, prompts, 0.0), 0.0, penalties=False)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    static_prompts = random_prompts(3, seed=12)
    static = [SamplingParams(max_tokens=24, ignore_eos=True, allowed_token_ids=ALLOWED, bad_words=[word(5)])] * 3
    want_static = [o.token_ids for o in plain.generate(static_prompts, static)]
    assert all(set(ids) <= set(ALLOWED) - {5} for ids in want_static)
    kw = dict(attention_backend="dense", graph_mode="eager", max_num_seqs=8, async_scheduling=async_scheduling)
    llm = _dflash_llm(llama_target, 3, stacked=True, **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    before = llm.engine.stats.num_async_steps
    assert [o.token_ids for o in llm.generate(static_prompts, static)] == want_static
    assert (llm.engine.stats.num_async_steps > before) == async_scheduling


def test_masked_requests_survive_preemption(llama_target):
    prompts = random_prompts(6, seed=5, low=8, high=16)
    free_answers = _free(make_llm(llama_target), prompts, 0.0)
    params = _params(free_answers, 0.0)
    want = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    small = _dflash_llm(llama_target, 3, num_kv_blocks=24)  # far fewer pages than 6 requests need
    seen, preempt = [], small.engine.scheduler._preempt
    small.engine.scheduler._preempt = lambda r: (seen.append(r.sampling_params.masks_tokens), preempt(r))
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert any(seen)


def test_only_output_tokens_count_not_the_prompt(llama_target):
    """vLLM matches bad words against the output only: a word made of the prompt's last token and
    the answer's first does not ban that first token; after the answer's first token it does."""
    prompt = random_prompts(1, seed=31)[0]
    free = _free(make_llm(llama_target), [prompt], 0.0)[0]
    p = SamplingParams(max_tokens=8, ignore_eos=True, bad_words=[_text([prompt[-1], free[0]]), _text(free[:2])])
    got = make_llm(llama_target).generate([prompt], p)[0].token_ids
    assert got[0] == free[0] and got[1] != free[1]


def test_allowed_token_ids_restrict_even_against_a_bias_and_keep_min_tokens(llama_target):
    """Only allowed ids are sampled, whatever logit_bias pushes; EOS (allowed and biased to be the
    argmax) stays masked by min_tokens until the output has that many tokens, then ends it."""
    prompts = random_prompts(4, seed=9)
    params = [SamplingParams(max_tokens=20, allowed_token_ids=[EOS_ID, 4, 8], min_tokens=5, temperature=t, seed=s,
                             logit_bias={EOS_ID: 100.0, 50: 100.0}) for t, s in ((0.0, 0), (1.0, 1))] * 2
    plain = make_llm(llama_target).generate(prompts, params)
    for o in plain:
        assert set(o.token_ids) <= {EOS_ID, 4, 8}
        assert o.token_ids[-1] == EOS_ID and len(o.token_ids) == 6 and o.finish_reason == "stop"
    assert ([o.token_ids for o in _dflash_llm(llama_target, 3).generate(prompts, params)]
            == [o.token_ids for o in plain])


def test_logprobs_are_those_of_the_raw_logits(llama_target):
    """As vLLM's (raw logprobs): masked tokens keep their finite log-probabilities, and the raw
    distribution's top tokens are listed even when they are not allowed."""
    prompt = random_prompts(1, seed=3)
    free = make_llm(llama_target).generate(prompt, SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    out = make_llm(llama_target).generate(prompt, SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True,
                                                                 allowed_token_ids=ALLOWED))[0]
    assert set(out.token_ids) <= set(ALLOWED)
    first_top = dict(out.logprobs[0]["top"])
    assert first_top == dict(free.logprobs[0]["top"])  # the same first row: raw logits
    assert all(math.isfinite(lp) for lp in first_top.values()) and not set(first_top) <= set(ALLOWED)
