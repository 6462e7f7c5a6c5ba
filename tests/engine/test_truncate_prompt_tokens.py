"""SamplingParams.truncate_prompt_tokens in the engine (vLLM's): a request runs on its prompt's last
k tokens, exactly as a request whose prompt is that tail, in plain and speculative decoding, greedy
and seeded; the cut comes before the context check (an overlong prompt runs); RequestOutput's
prompt_token_ids and prompt_logprobs are the tail's, its `prompt` the text given (vLLM's); prefix
caching and the drafter see the tail."""

from __future__ import annotations

import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import VOCAB, make_llm, random_prompts
from tests.spec.doubles import KnownAnswerSpeculator
from tests.spec.test_lossless_dflash import _dflash_llm

KEEP = [5, 12, 1, 40]  # per prompt; 40 is more than any prompt has: nothing cut


def _params(keep=None, n=4, **kw) -> list[SamplingParams]:
    """Greedy and seeded rows alternately; truncate_prompt_tokens keep[i] (None: no truncation)."""
    return [SamplingParams(max_tokens=12, ignore_eos=True, temperature=(0.0, 0.9)[i % 2], seed=i,
                           truncate_prompt_tokens=None if keep is None else keep[i], **kw) for i in range(n)]


def _tails(prompts, keep):
    return [p[-k:] for p, k in zip(prompts, keep)]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=21, low=14, high=30)


@pytest.fixture(scope="module")
def plain(llama_target, prompts):
    """Plain decoding of the tails, the oracle of every test here."""
    return [o.token_ids for o in make_llm(llama_target).generate(_tails(prompts, KEEP), _params())]


@pytest.mark.parametrize("decoding", ["plain", "dflash"])
def test_truncated_prompts_decode_as_their_tails(llama_target, prompts, plain, decoding):
    llm = make_llm(llama_target) if decoding == "plain" else _dflash_llm(llama_target, 3)
    outs = llm.generate(prompts, _params(KEEP))
    assert [o.token_ids for o in outs] == plain
    assert [o.prompt_token_ids for o in outs] == _tails(prompts, KEEP)
    # untruncated prompts decode otherwise: the cut changed what the model saw
    assert [o.token_ids for o in make_llm(llama_target).generate(prompts[:2], _params(n=2))] != plain[:2]
    if decoding == "dflash":
        assert llm.engine.stats.spec.num_drafted_tokens > 0


def test_the_drafter_sees_the_truncated_prompt(llama_target, prompts, plain):
    """The oracle drafter knows each tail's answer only by the tail (Request.prompt_token_ids): whole
    blocks are accepted only when the request's prompt is the tail."""
    answers = {tuple(t): t + o for t, o in zip(_tails(prompts, KEEP), plain)}
    spec = KnownAnswerSpeculator(3, answers, VOCAB, p_right=1.0)
    llm = make_llm(llama_target, speculator=spec)
    spec.engine = llm.engine
    assert [o.token_ids for o in llm.generate(prompts, _params(KEEP))] == plain
    assert llm.engine.stats.spec.acceptance_length > 0.8 * 4


def test_generate_stream_truncates_too(llama_target, prompts, plain):
    llm = make_llm(llama_target)
    *_, last = llm.generate_stream(prompts[0], _params(KEEP)[0])
    assert last.token_ids == plain[0] and last.prompt_token_ids == prompts[0][-KEEP[0]:]


def test_an_overlong_prompt_is_refused_without_truncation_and_runs_with_it(llama_target):
    llm = make_llm(llama_target, max_model_len=64)
    long = random_prompts(1, seed=8, low=100, high=101)[0]
    with pytest.raises(ValueError, match="prompt has 100 tokens but the engine's context is 64 tokens"):
        llm.generate([long], SamplingParams(max_tokens=4))
    kw = dict(max_tokens=6, ignore_eos=True)
    out = llm.generate([long], SamplingParams(truncate_prompt_tokens=30, **kw))[0]
    assert out.token_ids == llm.generate([long[-30:]], SamplingParams(**kw))[0].token_ids
    assert len(out.token_ids) == 6 and out.prompt_token_ids == long[-30:]
    # -1 keeps max_model_len tokens (vLLM's value), which leave no room for an output token here
    with pytest.raises(ValueError, match=r"prompt has 64 tokens but the engine's context is 64 tokens .* \(after "
                                         r"truncate_prompt_tokens=-1; truncate_prompt_tokens=58 leaves room for max_tokens=6\)$"):
        llm.generate([long], SamplingParams(truncate_prompt_tokens=-1, **kw))
    hinted = llm.generate([long], SamplingParams(truncate_prompt_tokens=58, **kw))[0]
    assert hinted.prompt_token_ids == long[-58:] and len(hinted.token_ids) == 6  # the hint's value runs in full
    out = llm.generate([long], SamplingParams(truncate_prompt_tokens=63, **kw))[0]
    assert out.prompt_token_ids == long[-63:] and len(out.token_ids) == 1  # the context's last token
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be -1 or at most 64 \(the engine's "
                                         r"max_model_len\), got 65$") as e:
        llm.generate([long[:10], long], SamplingParams(truncate_prompt_tokens=65, **kw))
    assert e.value.param == "truncate_prompt_tokens"
    assert not llm.engine.has_unfinished_requests()  # nothing of the refused batch was queued


def test_minus_one_keeps_a_prompt_that_fits(llama_target, prompts, plain):
    out = make_llm(llama_target).generate([prompts[0][-5:]], _params([-1], n=1))[0]
    assert out.token_ids == plain[0] and out.prompt_token_ids == prompts[0][-5:]


def test_a_text_prompt_keeps_its_text_and_runs_on_its_last_tokens(llama_target):
    llm = make_llm(llama_target)
    text = " ".join(f"w{i:02d}x" for i in (7, 31, 64, 2, 90, 15, 44, 8))
    kw = dict(max_tokens=8, ignore_eos=True)
    out = llm.generate(text, SamplingParams(truncate_prompt_tokens=3, **kw))[0]
    assert out.prompt == text  # vLLM's RequestOutput.prompt: the text given
    assert out.prompt_token_ids == [2, 90, 15, 44, 8][-3:]
    assert out.token_ids == llm.generate([[15, 44, 8]], SamplingParams(**kw))[0].token_ids


def test_prompt_logprobs_score_the_truncated_prompt(llama_target, prompts):
    llm = make_llm(llama_target)
    kw = dict(max_tokens=3, prompt_logprobs=2)
    cut = llm.generate([prompts[1]], SamplingParams(truncate_prompt_tokens=6, **kw))[0]
    tail = llm.generate([prompts[1][-6:]], SamplingParams(**kw))[0]
    assert len(cut.prompt_logprobs) == 6 and cut.prompt_logprobs[0] is None  # the tail's first token: no context
    assert cut.prompt_logprobs == tail.prompt_logprobs and cut.token_ids == tail.token_ids


def test_prefix_caching_sees_the_truncated_prompt(llama_target):
    """A truncated request hits the pages its tail left in the cache, and leaves its tail's pages
    (not its whole prompt's) for the next request."""
    llm = make_llm(llama_target, enable_prefix_caching=True)
    long = random_prompts(1, seed=33, low=40, high=41)[0]
    kw = dict(max_tokens=4, ignore_eos=True)
    first = llm.generate([long[-17:]], SamplingParams(**kw))[0]
    cut = llm.generate([long], SamplingParams(truncate_prompt_tokens=17, **kw))[0]
    assert cut.num_cached_tokens == 16 and cut.token_ids == first.token_ids  # 4 full pages of 4 tokens
    assert llm.generate([long], SamplingParams(**kw))[0].num_cached_tokens == 0  # the head was never cached
