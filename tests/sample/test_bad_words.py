"""vLLM's bad words: which token sequences a word bans (both spellings only when the spaced one is
another word token of the same length), and which last tokens they ban after a given output."""

from __future__ import annotations

import pytest

from blockdraft.sample.bad_words import bad_words_token_ids, banned_tokens
from tests.conftest import make_ascii_tokenizer, make_tokenizer


class _TableTokenizer:
    """encode() from a hand-written table, so each spelling rule is exercised on purpose."""

    TABLE = {
        "foo": [10], " foo": [11],                # a word-start marker: two spellings, both banned
        "foo bar": [10, 20], " foo bar": [11, 20],
        "x": [30], " x": [1, 30],                 # the space is a token of its own: only "x"
        "same": [40], " same": [40],              # the same first token: one sequence
        "ab": [50, 51], " ab": [52],              # the spaced spelling is shorter: only "ab"
    }

    def __init__(self):
        self.calls = []

    def encode(self, text, add_special_tokens=True):
        self.calls.append((text, add_special_tokens))
        return list(self.TABLE[text])


def test_each_word_gives_its_spellings_by_vllms_rule():
    tok = _TableTokenizer()
    got = bad_words_token_ids(["foo", "  foo bar", "x", "same", "ab"], tok)
    assert got == [[10], [11], [10, 20], [11, 20], [30], [40], [50, 51]]
    assert all(special is False for _, special in tok.calls)  # no BOS in a word
    assert ("  foo bar", False) not in tok.calls  # leading whitespace stripped first


def test_real_tokenizers():
    word_level = make_tokenizer()  # "w05x" and " w05x" are the same token: one sequence
    assert bad_words_token_ids(["w05x w07x", "w09x"], word_level) == [[5, 7], [9]]
    ascii_ = make_ascii_tokenizer()  # token i = chr(31 + i): the space is its own token
    assert bad_words_token_ids(["ab"], ascii_) == [[ord("a") - 31, ord("b") - 31]]


@pytest.mark.parametrize("past, want", [
    ([], [7]),                 # a one-token word is always banned; longer ones need output before them
    ([1], [7, 2]),
    ([9, 1, 2], [7, 3]),       # [1, 2] does not match the end, [1, 2, 3] does
    ([1, 2, 9], [7]),
    ([4, 5], [7, 6]),
    ([5], [7]),                # half a prefix
    ([8, 4, 5], [7, 6]),
    ([1, 1], [7, 2]),
])
def test_banned_tokens_of_a_hand_written_example(past, want):
    sequences = [[7], [1, 2], [1, 2, 3], [4, 5, 6]]
    assert banned_tokens(sequences, past) == want


def test_a_word_ending_where_another_starts():
    assert banned_tokens([[3, 3, 3]], [3, 3]) == [3] and banned_tokens([[3, 3, 3]], [3]) == []
