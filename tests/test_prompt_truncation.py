"""blockdraft.prompt_truncation and SamplingParams.truncate_prompt_tokens (vLLM's): None, -1 or
k >= 1 keep the whole prompt, its last max_model_len tokens or its last k; 0, values below -1,
other types and k above max_model_len are refused with the field and the allowed values named."""

from __future__ import annotations

import numpy as np
import pytest

from blockdraft.prompt_truncation import tokens_kept, truncate_prompt
from blockdraft.sampling_params import SamplingParams

ALLOWED = (r"truncate_prompt_tokens must be None \(no truncation\), -1 \(keep the last max_model_len tokens\) "
           r"or an integer >= 1 \(keep the last k tokens\), got ")


@pytest.mark.parametrize("bad", [0, -2, -100, 1.5, 3.0, "5", True, False, [3]])
def test_values_other_than_none_minus_one_or_positive_are_refused(bad):
    with pytest.raises(ValueError, match="^" + ALLOWED) as e:
        SamplingParams(truncate_prompt_tokens=bad)
    assert e.value.param == "truncate_prompt_tokens"
    assert str(e.value).endswith(f"got {bad!r}")
    with pytest.raises(ValueError, match="^" + ALLOWED):
        tokens_kept(bad, 100)


@pytest.mark.parametrize("good", [None, -1, 1, 7, 10**6])
def test_none_minus_one_and_positive_integers_are_taken(good):
    assert SamplingParams(truncate_prompt_tokens=good).truncate_prompt_tokens == good


def test_a_numpy_integer_is_taken_as_an_int():
    p = SamplingParams(truncate_prompt_tokens=np.int64(5))
    assert p.truncate_prompt_tokens == 5 and type(p.truncate_prompt_tokens) is int


def test_clone_and_completions_keep_it():
    p = SamplingParams(truncate_prompt_tokens=4, n=3, seed=1)
    assert p.clone().truncate_prompt_tokens == 4
    assert [c.truncate_prompt_tokens for c in p.completions()] == [4, 4, 4]


def test_a_value_set_after_construction_is_checked_again():
    p = SamplingParams()
    p.truncate_prompt_tokens = 0
    with pytest.raises(ValueError, match="^" + ALLOWED + "0$"):
        p.verify()


def test_tokens_kept_resolves_minus_one_to_max_model_len_and_refuses_more():
    assert tokens_kept(None, 64) is None
    assert tokens_kept(-1, 64) == 64
    assert tokens_kept(64, 64) == 64  # vLLM allows max_model_len itself
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be -1 or at most 64 \(the engine's "
                                         r"max_model_len\), got 65$") as e:
        tokens_kept(65, 64)
    assert e.value.param == "truncate_prompt_tokens"


def test_truncate_prompt_keeps_the_last_tokens():
    prompt = list(range(10, 20))
    assert truncate_prompt(prompt, 3, 64) == [17, 18, 19]  # left truncation: the tail is kept
    assert truncate_prompt(prompt, 1, 64) == [19]
    assert truncate_prompt(prompt, 10, 64) == prompt and truncate_prompt(prompt, 50, 64) == prompt
    assert truncate_prompt(prompt, None, 64) is prompt
    assert truncate_prompt(prompt, -1, 4) == [16, 17, 18, 19]
    assert truncate_prompt(prompt, -1, 64) == prompt
