"""Speculation is invisible: speculative output == plain output, token for token (DFLASH.md step 2)."""

import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import VOCAB, make_llm, random_prompts, word
from tests.spec.doubles import KnownAnswerSpeculator

BATCH_SIZES = (1, 2, 3, 5, 8)


def _max_tokens(k):
    return [1, k, k + 1, k + 2, 64]


def _params(n, k, **kw):
    mts = _max_tokens(k)
    return [SamplingParams(max_tokens=mts[i % len(mts)], ignore_eos=True, **kw) for i in range(n)]


def _plain(target, prompts, params):
    return [o.token_ids for o in make_llm(target).generate(prompts, params)]


def _spec_llm(target, k, answers, p_right, **kw):
    spec = KnownAnswerSpeculator(k, answers, VOCAB, p_right=p_right, seed=k)
    llm = make_llm(target, speculator=spec, **kw)
    spec.engine = llm.engine
    return llm


@pytest.mark.parametrize("k", [1, 3, 7, 15])
@pytest.mark.parametrize("p_right", [0.0, 0.5, 1.0], ids=["random", "half", "oracle"])
def test_greedy_parity_across_batch_sizes_k_and_max_tokens(llama_target, k, p_right):
    prompts = random_prompts(8, seed=10 + k)
    params = _params(8, k)
    plain = _plain(llama_target, prompts, params)
    answers = {tuple(p): p + o for p, o in zip(prompts, _plain(llama_target, prompts, _params(8, 64)))}
    llm = _spec_llm(llama_target, k, answers, p_right)
    for bs in BATCH_SIZES:
        outs = llm.generate(prompts[:bs], params[:bs])
        assert [o.token_ids for o in outs] == plain[:bs], f"batch {bs}"
    if p_right == 1.0:
        stats = llm.engine.stats.spec
        # every step accepts everything except the last steps of a request cut short by max_tokens
        assert stats.acceptance_length > 0.8 * (k + 1) or k >= 7
        full = [o for o in outs if o.num_output_tokens == 64]
        assert all(o.spec.num_accepted_tokens == o.spec.num_drafted_tokens for o in full)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("k", [3, 7])
def test_seeded_sampling_parity(llama_target, temperature, k):
    prompts = random_prompts(5, seed=20)
    kw = dict(temperature=temperature, top_k=30, top_p=0.9)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, seed=7 + i, **kw) for i in range(5)]
    plain = _plain(llama_target, prompts, params)
    answers = {tuple(p): p + o for p, o in zip(prompts, plain)}
    for p_right in (0.5, 1.0):
        outs = _spec_llm(llama_target, k, answers, p_right).generate(prompts, params)
        assert [o.token_ids for o in outs] == plain


def test_mixed_batch_equals_each_request_alone_and_engine_reuse(llama_target):
    prompts = random_prompts(6, seed=30)
    params = [
        SamplingParams(max_tokens=17, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=1.0, top_k=10, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=40, ignore_eos=True, stop=[word(5)]),
        SamplingParams(max_tokens=40, temperature=1.0, top_p=0.8, seed=5, ignore_eos=True, stop_token_ids=[7]),
    ]
    plain_alone = [_plain(llama_target, [p], [q])[0] for p, q in zip(prompts, params)]
    answers = {tuple(p): p + o for p, o in zip(prompts, plain_alone)}
    llm = _spec_llm(llama_target, 5, answers, 0.5)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain_alone
    # B after A in the same engine == B in a fresh engine
    assert llm.generate([prompts[3]], params[3])[0].token_ids == plain_alone[3]


@pytest.mark.parametrize("offset", range(8))
def test_stop_at_every_offset_of_a_block_is_trimmed_exactly(llama_target, offset):
    k = 7
    prompt = random_prompts(1, seed=40)[0]
    full = make_llm(llama_target).generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    # with the oracle, step 1 emits tokens 1..k+1 of the output (token 0 comes from the prefill)
    target_index = 1 + offset
    stop_tok = full.token_ids[target_index]
    cut = full.token_ids.index(stop_tok)
    answers = {tuple(prompt): prompt + full.token_ids}
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok])
    out = _spec_llm(llama_target, k, answers, 1.0).generate([prompt], params)[0]
    assert out.token_ids == full.token_ids[: cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    stop_str = word(stop_tok)
    out_s = _spec_llm(llama_target, k, answers, 1.0).generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop_str]))[0]
    assert out_s.token_ids == full.token_ids[: cut + 1]
    before = " ".join(word(t) for t in full.token_ids[:cut])
    assert out_s.text == (before + " " if before else "")
    # include_stop_str_in_output: the same tokens; the text keeps the stop string (vLLM's flag)
    keep = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop_str], include_stop_str_in_output=True)
    out_i = _spec_llm(llama_target, k, answers, 1.0).generate([prompt], keep)[0]
    assert out_i.token_ids == out_s.token_ids and out_i.text == out_s.text + stop_str
    assert (out_i.finish_reason, out_i.stop_reason) == ("stop", stop_str)
    # max_tokens inside a block
    out_m = _spec_llm(llama_target, k, answers, 1.0).generate([prompt], SamplingParams(max_tokens=target_index + 1, ignore_eos=True))[0]
    assert out_m.token_ids == full.token_ids[: target_index + 1] and out_m.finish_reason == "length"


@pytest.mark.parametrize("k", [3, 7])
def test_drafts_are_kept_near_max_tokens_and_output_stops_exactly(llama_target, k):
    """Every decode step verifies all K drafts (uniform steps replay CUDA graphs), even when fewer
    tokens remain before max_tokens; the output still stops at max_tokens exactly (vLLM behaviour)."""
    prompts = random_prompts(3, seed=11)
    params = SamplingParams(max_tokens=2 * k + 1, ignore_eos=True)
    plain = _plain(llama_target, prompts, params)
    answers = {tuple(p): p + out for p, out in zip(prompts, plain)}
    llm = _spec_llm(llama_target, k, answers, p_right=1.0)
    seen = []
    launch = llm.engine.runner.launch

    def spy(so):
        seen.extend(sr.num_spec_tokens for sr in so.requests if sr.sample and sr.start_position > 0)
        return launch(so)

    llm.engine.runner.launch = spy
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert all(len(o.token_ids) == 2 * k + 1 for o in outs)
    assert seen and all(n == k for n in seen)


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_include_stop_str_in_output_speculative_equals_plain(llama_target, k, temperature):
    """Stop strings taken from each answer (so they land inside accepted blocks or across them),
    kept in the text: speculative == plain in tokens, text, finish and stop reason, greedy and
    seeded, batch of 5 with drafts half right."""
    prompts = random_prompts(5, seed=77 + k)
    free = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=temperature, seed=i) for i in range(5)]
    full = make_llm(llama_target).generate(prompts, free)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=temperature, seed=i,
                             stop=[" ".join(word(t) for t in o.token_ids[3 + i : 5 + i])], include_stop_str_in_output=True)
              for i, o in enumerate(full)]
    plain = make_llm(llama_target).generate(prompts, params)
    answers = {tuple(p): p + o.token_ids for p, o in zip(prompts, full)}
    spec = _spec_llm(llama_target, k, answers, 0.5).generate(prompts, params)
    summary = [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in plain]
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in spec] == summary
    assert all(o.finish_reason == "stop" and o.text.endswith(q.stop[0]) for o, q in zip(plain, params))


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_skip_special_tokens_false_speculative_equals_plain(llama_target, k, temperature):
    """skip_special_tokens=False (vLLM's): <eos> (id 0, special; made frequent by a logit bias)
    kept in the text; runs of it joined (spaces_between_special_tokens=False); stop strings that
    span it; requests ended by it, with and without include_stop_str_in_output (the text keeps it
    only with). Each variant on each of 5 prompts, one batch: speculative == plain in tokens,
    text, finish and stop reason, greedy and seeded, drafts half right."""
    prompts = random_prompts(5, seed=55 + k)
    base = dict(max_tokens=40, temperature=temperature, logit_bias={0: 6.0}, skip_special_tokens=False)
    variants = [
        dict(ignore_eos=True),
        dict(ignore_eos=True, spaces_between_special_tokens=False),
        dict(ignore_eos=True, stop=["<eos> w", "<eos><eos>"], spaces_between_special_tokens=False),
        dict(),  # ends at its first <eos>: no text for it
        dict(include_stop_str_in_output=True),  # ... which the text then keeps
    ]
    params = [SamplingParams(seed=i, **base, **v) for i in range(5) for v in variants]
    batch = [p for p in prompts for _ in variants]
    full = make_llm(llama_target).generate(prompts, [SamplingParams(seed=i, ignore_eos=True, **base) for i in range(5)])
    plain = make_llm(llama_target).generate(batch, params)
    answers = {tuple(p): p + o.token_ids for p, o in zip(prompts, full)}
    spec = _spec_llm(llama_target, k, answers, 0.5).generate(batch, params)
    summary = [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in plain]
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in spec] == summary
    by_variant = [plain[v :: len(variants)] for v in range(len(variants))]
    assert any("<eos>" in o.text for o in by_variant[0])
    assert any("<eos><eos>" in o.text for o in by_variant[1])
    assert any(o.stop_reason in ("<eos> w", "<eos><eos>") for o in by_variant[2])
    for v, keeps in ((3, False), (4, True)):
        ended = [o for o in by_variant[v] if o.finish_reason == "stop" and len(o.token_ids) > 1]
        assert ended and all(o.token_ids[-1] == 0 and o.text.endswith("<eos>") == keeps for o in ended)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k", [3, 15])
def test_max_tokens_none_speculative_equals_plain_up_to_the_context_end(llama_target, k, temperature):
    """max_tokens=None: a verify block that crosses max_model_len is cut at the context's end exactly,
    as plain decoding stops there (prompts end 1..21 tokens before it; greedy and seeded sampling)."""
    prompts = [p[:1] * (100 - 1 - i * 4) for i, p in enumerate(random_prompts(6, seed=31))]
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=temperature, seed=5)
    plain = [o.token_ids for o in make_llm(llama_target, max_model_len=100).generate(prompts, params)]
    assert [len(t) for t in plain] == [1, 5, 9, 13, 17, 21]
    answers = {tuple(p): p + o for p, o in zip(prompts, plain)}
    for p_right in (0.5, 1.0):
        outs = _spec_llm(llama_target, k, answers, p_right, max_model_len=100).generate(prompts, params)
        assert [o.token_ids for o in outs] == plain
        assert all(o.finish_reason == "length" for o in outs)
