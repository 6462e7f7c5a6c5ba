"""allowed_token_ids and bad_words on the real SmolLM2 model with its shipped drafter: a BPE
tokenizer gives a word's two spellings (alone and after a space, "Ġ"), a banned word leaves the
answer, allowed ids hold it to digits, and speculative decoding gives plain decoding's tokens,
greedy and seeded."""

import pytest

from blockdraft import SamplingParams
from blockdraft.llm import LLM, load_target
from blockdraft.sample.bad_words import bad_words_token_ids

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
COUNT = [{"role": "user", "content": "Count from 1 to 20, separated by spaces."}]


@pytest.fixture(scope="module")
def engines():
    target = load_target(NAME, "float32")
    return LLM(target=target, draft="shipped"), LLM(target=target)  # the drafter, and plain decoding


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_a_bpe_word_is_banned_in_both_spellings(engines):
    tok = engines[1].get_tokenizer()
    paris, new_york = bad_words_token_ids(["Paris"], tok), bad_words_token_ids([" New York"], tok)
    assert [tok.convert_ids_to_tokens(s) for s in paris] == [["Paris"], ["ĠParis"]]
    assert [tok.convert_ids_to_tokens(s) for s in new_york] == [["New", "ĠYork"], ["ĠNew", "ĠYork"]]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded-T0.8"])
def test_masked_answers_keep_their_masks_and_speculation_changes_nothing(engines, temperature):
    spec, plain = engines
    tok = plain.get_tokenizer()
    digits = sorted({t for d in "0123456789" for t in tok.encode(" " + d, add_special_tokens=False)}
                    | set(plain.engine.eos_token_ids))
    prompts = [CAPITAL, COUNT, CAPITAL]
    params = [SamplingParams(max_tokens=32, temperature=temperature, seed=1, bad_words=["Paris"]),
              SamplingParams(max_tokens=32, temperature=temperature, seed=2, allowed_token_ids=digits),
              SamplingParams(max_tokens=32, temperature=temperature, seed=3)]
    want = plain.chat(prompts, params)
    got = spec.chat(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sum(o.spec.num_accepted_tokens for o in got) > 0  # drafts were accepted
    banned, counted, free = (o.outputs[0] for o in want)
    assert not any(_contains(banned.token_ids, s) for s in bad_words_token_ids(["Paris"], tok))
    if temperature == 0.0:
        assert "Paris" in free.text and "Paris" not in banned.text
    assert set(counted.token_ids) <= set(digits) and counted.token_ids
