"""vLLM's bad words: a word's token sequences, and the tokens they ban after a given output.

Semantics (vLLM's SamplingParams.update_from_tokenizer and its v1 sampler's bad-words op):

- A word, its leading whitespace stripped, is tokenized alone (no special tokens). It is
  tokenized again after one space; that spelling is banned too when it has as many tokens as the
  first with another first token (a tokenizer that marks word starts, e.g. byte-level BPE's "Ġ",
  spells a word in mid-text differently from the start of a text).
- A sequence s = (s_1 .. s_n) bans s_n at an output position when the output tokens before it end
  with s_1 .. s_{n-1}; a one-token sequence is banned everywhere. Only output tokens count: a word
  whose start lies in the prompt is not banned (the prompt is not part of "past tokens" there).

So the whole sequence can never appear in the output, though the word's text may still be
spelled with other tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def bad_words_token_ids(words: Sequence[str], tokenizer) -> list[list[int]]:
    """The token sequences `words` ban, in order (one or two per word).

    Args:
        words: SamplingParams.bad_words (strings with a non-space character).
        tokenizer: has `encode(text, add_special_tokens=False) -> list[int]` (a transformers tokenizer).
    Returns:
        Non-empty token-id lists (a word the tokenizer maps to no token bans nothing).
    """
    sequences: list[list[int]] = []
    for word in words:
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if alone:
            sequences.append(alone)
        # vLLM's rule: the spaced spelling only when it is another word token of the same length
        # (not when the space becomes a token of its own, which would ban the word's tail anywhere)
        if alone and spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences


def banned_tokens(sequences: Sequence[Sequence[int]], past: Sequence[int]) -> list[int]:
    """The last tokens of the `sequences` whose other tokens end `past` (with repeats, in order).

    Args:
        sequences: bad-word token sequences (bad_words_token_ids), each non-empty.
        past: the output tokens before the position being sampled (the drafts before a verify row
            included), or at least the last max(len(s)) - 1 of them when the output is longer.
    """
    banned = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix > len(past):
            continue  # the word would start before the output
        if prefix == 0 or list(past[len(past) - prefix:]) == list(seq[:prefix]):
            banned.append(seq[-1])
    return banned
