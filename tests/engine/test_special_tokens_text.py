"""SamplingParams.skip_special_tokens / spaces_between_special_tokens (vLLM's) on the tiny model and
its word-level tokenizer (<eos>, id 0, is a special token; the decoder joins tokens with spaces):
the text keeps special tokens when asked, consecutive added tokens are joined without the space
with spaces_between_special_tokens=False, the EOS / stop token that ends a request adds no text
unless include_stop_str_in_output (vLLM), streamed text grows to the final text, stop strings
match special tokens' text. Plain decoding here; speculative == plain is in tests/spec/test_lossless.py."""

from __future__ import annotations

import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import EOS_ID, make_llm, random_prompts, word

EOS_BIAS = {EOS_ID: 6.0}  # <eos> becomes frequent (runs of it too); ignore_eos keeps going past it


def _params(i: int = 0, **kw) -> SamplingParams:
    kw = {"max_tokens": 30, "ignore_eos": True, "temperature": 0.8, "seed": i, "logit_bias": EOS_BIAS, **kw}
    return SamplingParams(**kw)


def _text(ids: list[int], skip: bool = True, spaces: bool = True) -> str:
    """The word tokenizer's text of `ids` by hand: words (and "<eos>" unless skipped) joined by
    spaces, none between two <eos> when not `spaces`."""
    out = ""
    for i, t in enumerate(ids):
        if t == EOS_ID and skip:
            continue
        piece = "<eos>" if t == EOS_ID else word(t)
        glued = not spaces and t == EOS_ID and i > 0 and ids[i - 1] == EOS_ID
        out += piece if not out or glued else " " + piece
    return out


@pytest.fixture(scope="module")
def llm(llama_target):
    return make_llm(llama_target)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=3)


def test_special_tokens_are_kept_in_the_text_when_asked(llm, prompts):
    skipped = llm.generate(prompts, [_params(i) for i in range(4)])
    kept = llm.generate(prompts, [_params(i, skip_special_tokens=False) for i in range(4)])
    assert [o.token_ids for o in kept] == [o.token_ids for o in skipped]  # the flag changes only the text
    assert sum(o.token_ids.count(EOS_ID) for o in kept) >= 4
    tok = llm.get_tokenizer()
    for s, k in zip(skipped, kept):
        assert s.text == _text(s.token_ids) == tok.decode(s.token_ids, skip_special_tokens=True)
        assert "<eos>" not in s.text
        assert k.text == _text(k.token_ids, skip=False) == tok.decode(k.token_ids, skip_special_tokens=False)
        assert k.text.count("<eos>") == k.token_ids.count(EOS_ID)


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens(llm, prompts):
    """vLLM's fast detokenizer rule: an added token right after another one is written bare."""
    joined = llm.generate(prompts, [_params(i, skip_special_tokens=False, spaces_between_special_tokens=False)
                                    for i in range(4)])
    assert any("<eos><eos>" in o.text for o in joined)  # the case is exercised
    for o in joined:
        assert o.text == _text(o.token_ids, skip=False, spaces=False)
    # with special tokens skipped the flag changes nothing
    default = llm.generate(prompts, [_params(i) for i in range(4)])
    no_spaces = llm.generate(prompts, [_params(i, spaces_between_special_tokens=False) for i in range(4)])
    assert [o.text for o in no_spaces] == [o.text for o in default]


def test_the_token_that_ends_a_request_adds_no_text_unless_include_stop_str_in_output(llm, prompts):
    """vLLM: the EOS or stop_token_ids token that stops a request is not detokenized, unless
    include_stop_str_in_output; its id stays in token_ids."""
    for i in range(4):
        out = llm.generate([prompts[i]], _params(i, ignore_eos=False, skip_special_tokens=False))[0]
        assert out.finish_reason == "stop" and out.stop_reason is None and out.token_ids[-1] == EOS_ID
        assert out.text == _text(out.token_ids[:-1], skip=False) and not out.text.endswith("<eos>")
        kept = llm.generate([prompts[i]], _params(i, ignore_eos=False, skip_special_tokens=False,
                                                 include_stop_str_in_output=True))[0]
        assert kept.token_ids == out.token_ids and kept.text == _text(out.token_ids, skip=False)
        assert kept.text.endswith("<eos>")
    # an ordinary word as a stop token id: its text is left out too (it was in the text before)
    full = llm.generate([prompts[0]], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop_tok = full.token_ids[5]
    by_id = llm.generate([prompts[0]], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert by_id.token_ids[-1] == stop_tok and by_id.stop_reason == stop_tok
    assert by_id.text == _text(by_id.token_ids[:-1])
    keep = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok], include_stop_str_in_output=True)
    by_id_kept = llm.generate([prompts[0]], keep)[0]
    assert by_id_kept.token_ids == by_id.token_ids and by_id_kept.text == _text(by_id.token_ids)


def test_stop_strings_match_special_tokens_kept_in_the_text(llm, prompts):
    kept = llm.generate(prompts, [_params(i, skip_special_tokens=False) for i in range(4)])
    for i, k in enumerate(kept):
        if EOS_ID not in k.token_ids[1:]:
            continue
        j = k.token_ids.index(EOS_ID, 1)  # "<word> <eos>" across two tokens
        stop = f"{_text(k.token_ids[j - 1:j], skip=False)} <eos>" if k.token_ids[j - 1] != EOS_ID else "<eos> <eos>"
        for include in (False, True):
            out = llm.generate([prompts[i]], _params(i, skip_special_tokens=False, stop=[stop],
                                                   include_stop_str_in_output=include))[0]
            assert (out.finish_reason, out.stop_reason) == ("stop", stop)
            assert out.token_ids == k.token_ids[: len(out.token_ids)] and out.token_ids[-1] == EOS_ID
            cut = k.text.index(stop) + (len(stop) if include else 0)
            assert out.text == k.text[:cut]
    # skipped, "<eos>" is not in the text: the same stop string never matches
    out = llm.generate([prompts[0]], _params(0, stop=["<eos>"]))[0]
    assert out.finish_reason == "length"


@pytest.mark.parametrize("kw", [
    dict(skip_special_tokens=False),
    dict(skip_special_tokens=False, spaces_between_special_tokens=False),
    dict(skip_special_tokens=False, ignore_eos=False, logit_bias={EOS_ID: 3.0}),
    dict(skip_special_tokens=False, stop=["<eos> <eos>"]),
], ids=["kept", "joined", "eos-ends", "stop-string"])
def test_the_streamed_text_grows_to_the_final_text(llm, prompts, kw):
    """Each step's text extends the one before (less the last longest-stop-string - 1 characters,
    which generate_stream's docstring says to hold back) and the last is `generate`'s."""
    finishes = set()
    for i in range(4):
        params = _params(i, **kw)
        holdback = max((len(s) for s in params.stop), default=1) - 1
        want = llm.generate([prompts[i]], params)[0]
        outs = list(llm.generate_stream(prompts[i], params))
        assert outs[-1].finished and outs[-1].token_ids == want.token_ids and outs[-1].text == want.text
        shown = [o.text if o.finished else o.text[: max(0, len(o.text) - holdback)] for o in outs]
        for before, after in zip(shown, shown[1:]):
            assert after.startswith(before)
        finishes.add((want.finish_reason, want.stop_reason))
    if "ignore_eos" in kw:
        assert ("stop", None) in finishes  # some end on EOS
    if "stop" in kw:
        assert ("stop", "<eos> <eos>") in finishes
