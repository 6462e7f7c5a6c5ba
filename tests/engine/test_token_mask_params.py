"""allowed_token_ids and bad_words are checked as vLLM checks them, with errors that name the field:
at construction (shape, empty list, negative ids, empty words), and when the engine takes the
request (ids, and the tokens a word gives, inside the model's vocabulary); nothing is queued then."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm, make_tokenizer

PROMPT = [1, 2, 3]


@pytest.mark.parametrize("fields, message", [
    (dict(allowed_token_ids=[]), r"^allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[3, -1]), r"^allowed_token_ids entry must be an integer >= 0, got -1"),
    (dict(allowed_token_ids=[3, "4"]), r"^allowed_token_ids entry must be an integer >= 0, got '4'"),
    (dict(allowed_token_ids=5), r"^allowed_token_ids must be a list of token ids \(integers >= 0\) or None, got 5"),
    (dict(bad_words="w05x"), r"^bad_words must be a list of strings or None, got 'w05x'"),
    (dict(bad_words=["w05x", ""]), r"^bad_words entries must be strings with a non-space character, got ''"),
    (dict(bad_words=["  "]), r"^bad_words entries must be strings with a non-space character, got '  '"),
    (dict(bad_words=[5]), r"^bad_words entries must be strings with a non-space character, got 5"),
])
def test_bad_values_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message) as e:
        SamplingParams(**fields)
    assert e.value.param == next(iter(fields))


def test_values_are_normalised():
    p = SamplingParams(allowed_token_ids=(np.int64(4), 7), bad_words=("w05x",))
    assert p.allowed_token_ids == [4, 7] and all(type(t) is int for t in p.allowed_token_ids)
    assert p.bad_words == ["w05x"] and p.masks_tokens
    assert not SamplingParams(bad_words=[]).masks_tokens and not SamplingParams().masks_tokens
    assert SamplingParams(allowed_token_ids=[0]).masks_tokens


@pytest.fixture(scope="module")
def llm(llama_target):
    return make_llm(llama_target)


def test_ids_outside_the_vocabulary_are_refused_when_the_request_is_added(llm):
    with pytest.raises(ValueError, match=r"^prompt 1: allowed_token_ids has token id 96, outside the vocabulary \[0, 96\)") as e:
        llm.generate([PROMPT] * 2, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, allowed_token_ids=[5, 96])])
    assert e.value.param == "allowed_token_ids"
    assert not llm.engine.has_unfinished_requests()  # the good first one was not queued either
    p = SamplingParams(max_tokens=2)
    p.allowed_token_ids = []  # changed after construction: checked again by the engine
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        llm.engine.add_request("late", PROMPT, p)
    assert not llm.engine.has_unfinished_requests()


def test_a_word_tokenized_outside_the_vocabulary_is_refused(llama_target):
    """A tokenizer larger than the model's logits (200 words, 96 logits)."""
    big = make_llm(dataclasses.replace(llama_target, tokenizer=make_tokenizer(200)))
    with pytest.raises(ValueError, match=r"^bad_words has token id 150, outside the vocabulary \[0, 96\)") as e:
        big.generate([PROMPT], SamplingParams(max_tokens=2, bad_words=["w05x", "w07x w150x"]))
    assert e.value.param == "bad_words" and not big.engine.has_unfinished_requests()
    assert big.generate([PROMPT], SamplingParams(max_tokens=2, bad_words=["w05x w07x"]))[0].num_output_tokens == 2


@pytest.mark.parametrize("fields, message", [
    (dict(allowed_token_ids=[5, 7], bad_words=["w05x", "w07x"]),
     r"^bad_words ban every id of allowed_token_ids \[5, 7\]: no token could be sampled"),
    (dict(allowed_token_ids=[0], min_tokens=2), r"^allowed_token_ids \[0\] are all EOS or stop token ids, which "
                                                r"min_tokens=2 masks"),
    (dict(allowed_token_ids=[0, 9], stop_token_ids=[9], min_tokens=1), r"^allowed_token_ids \[0, 9\] are all EOS"),
])
def test_masks_that_leave_no_token_are_refused_up_front(llm, fields, message):
    with pytest.raises(ValueError, match=message) as e:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, **fields))
    assert e.value.param == "allowed_token_ids" and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("speculative", [False, True])
def test_a_row_with_every_token_masked_ends_the_request_before_it(llama_target, speculative):
    """allowed_token_ids [5] with the bad word "w05x w05x": after one 5 nothing is allowed. The row
    still samples a token (every logit -inf); the engine ends the request ("abort") without it."""
    from tests.spec.test_lossless_dflash import _dflash_llm

    engine = _dflash_llm(llama_target, 3) if speculative else make_llm(llama_target)
    for temperature in (0.0, 1.0):
        out = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=temperature, seed=3,
                                                       allowed_token_ids=[5], bad_words=["w05x w05x"]))[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == ([5], "abort")


def test_a_fully_masked_row_never_ends_the_request_before_min_tokens(llama_target):
    """allowed [0 (EOS), 5] with the bad word "w05x w05x" and min_tokens 5: after one 5 only the
    EOS is allowed, which min_tokens masks; the all -inf row may sample the EOS (id 0), which must
    not end the request with "stop" before min_tokens."""
    llm = make_llm(llama_target)
    for temperature in (0.0, 1.0):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, min_tokens=5, temperature=temperature, seed=1,
                                                    allowed_token_ids=[0, 5], bad_words=["w05x w05x"]))[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == ([5], "abort")
