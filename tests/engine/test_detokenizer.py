"""Incremental detokenization on the real catalog tokenizers (byte-level BPE: SmolLM2, Qwen2.5):
the streamed pieces add up to the full decode, multi-byte characters split across tokens
included, at one decode call per token (plus one per window restart)."""

from __future__ import annotations

import pytest

from blockdraft.engine.detokenizer import IncrementalDetokenizer, token_decoder
from blockdraft.weights.catalog import DEFAULT_MODEL
from blockdraft.weights.fetch import cache_root, is_complete

MODELS = ["smollm2-135m-instruct", DEFAULT_MODEL]
TEXT = (
    "def greet(name):\n    return f\"Hello, {name}! 👋\"\n\n"
    "Emoji: 🎉🚀 👨‍👩‍👧‍👦 🇯🇵 🏳️‍🌈 ✅. CJK: 日本語の文章を書きます。中文分词测试，한국어 문장입니다. "
    "Accents: café naïve Ωμέγα, Привет мир, مرحبا بالعالم; math ∑∫√∞ ≠ ≤.\n"
    "Repeated emoji across tokens: 🤖🤖🤖🧠🧠🧠 done."
)


class CountingTokenizer:
    """Wraps a tokenizer and counts `decode` calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module", params=MODELS)
def tokenizer(request):
    from blockdraft.weights.loader import load_tokenizer

    folder = cache_root() / "models" / request.param
    if not is_complete(folder):
        pytest.skip(f"{request.param} is not in the cache (this test never downloads)")
    return load_tokenizer(folder)


def _stream(tokenizer, ids: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    """The text each token added (empty while a character is incomplete), then the flushed rest."""
    detok, pieces = IncrementalDetokenizer(tokenizer, []), []
    for t in ids:
        before = detok.text
        assert detok.append(t) is None
        pieces.append(detok.text[len(before):])
    before = detok.text
    detok.flush()
    pieces.append(detok.text[len(before):])
    return pieces, detok


def test_pieces_add_up_to_the_full_text_with_multibyte_characters_split_across_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # the test is only meaningful if characters really are split across tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    ids = ids + [tokenizer.eos_token_id]  # a special token, skipped in the text
    pieces, detok = _stream(tokenizer, ids)
    assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in p for p in pieces)  # held back until complete, never emitted half


def test_every_prefix_of_the_stream_is_a_prefix_of_the_text(tokenizer):
    """Streaming clients see text that only grows: every cut of the token stream."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids:
        detok.append(t)
        assert TEXT.startswith(detok.text)


def test_num_complete_chars_counts_what_is_held_before_an_incomplete_character(tokenizer):
    """After each token: the length of the decoded text less its trailing U+FFFD (characters held
    back with an incomplete one count, e.g. the space of a token " " + the first byte of 日);
    also after a step of several tokens (lazy decode)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, lazy, held = IncrementalDetokenizer(tokenizer, []), IncrementalDetokenizer(tokenizer, []), 0
    for i, t in enumerate(ids):
        detok.append(t)
        want = len(tokenizer.decode(ids[: i + 1]).rstrip("\ufffd"))
        assert detok.num_complete_chars == want >= len(detok.text), i
        held += detok.num_complete_chars > len(detok.text)
        if i % 3 == 2:
            lazy.extend(ids[i - 2 : i + 1])
            assert lazy.num_complete_chars == want, i
    assert held  # some complete text was held back with a split character


def test_one_decode_call_per_token(tokenizer):
    ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    pieces, detok = _stream(counting, ids)
    assert detok.text == TEXT * 3
    n = len(ids)
    # one per token, one per window restart (every WINDOW tokens, less the few of a split
    # character), one for the flush; was two per token
    assert counting.calls <= n + n // (IncrementalDetokenizer.WINDOW // 2) + 1, (counting.calls, n)


def test_a_step_of_several_tokens_is_one_decode_and_gives_the_same_text(tokenizer):
    """DFlash commits up to K + 1 tokens per request per step: `extend` decodes them together
    (no stop strings), the text only grows, and ends as the per-token stream's."""
    import random

    ids = tokenizer.encode(TEXT * 2, add_special_tokens=False)
    rng = random.Random(0)
    counting = CountingTokenizer(tokenizer)
    detok, steps, i = IncrementalDetokenizer(counting, []), 0, 0
    while i < len(ids):
        n = rng.randint(1, 16)
        assert detok.extend(ids[i : i + n]) is None
        assert (TEXT * 2).startswith(detok.text)
        i, steps = i + n, steps + 1
    detok.flush()
    assert detok.text == TEXT * 2 == _stream(tokenizer, ids)[1].text
    assert counting.calls <= 2 * steps + 1, (counting.calls, steps, len(ids))


def test_without_stop_strings_nothing_is_decoded_until_the_text_is_read(tokenizer):
    """`LLM.generate` reads a request's text once, when it finishes: the steps before cost no
    decode, and the one read gives the streamed text exactly."""
    ids = tokenizer.encode(TEXT * 2, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [])
    for i in range(0, len(ids), 3):
        assert detok.extend(ids[i : i + 3]) is None
    assert counting.calls == 0
    detok.flush()
    assert detok.text == TEXT * 2 == _stream(tokenizer, ids)[1].text
    assert counting.calls <= 2, counting.calls


def test_stop_string_split_across_multibyte_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ["中文"])
    hit = detok.extend(ids)
    assert hit is not None and hit[1] == "中文"
    assert detok.text == TEXT[: TEXT.index("中文")]


def test_the_backend_decoder_gives_the_tokenizers_text_without_calling_its_decode(tokenizer, monkeypatch):
    import random

    rng = random.Random(0)
    ids = tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    cuts = [(i, n) for i in range(len(ids)) for n in (1, 2, 5, IncrementalDetokenizer.WINDOW + 1)]
    want = [tokenizer.decode(ids[i : i + n], skip_special_tokens=True) for i, n in cuts]
    windows = [rng.sample(range(tokenizer.vocab_size), 6) + [tokenizer.eos_token_id] for _ in range(200)]
    want_random = [tokenizer.decode(w, skip_special_tokens=True) for w in windows]

    def no_decode(*args, **kwargs):
        raise AssertionError("the stock fast tokenizer should decode through its backend")

    monkeypatch.setattr(tokenizer, "decode", no_decode)  # the instance only: the class check still passes
    decode = token_decoder(tokenizer)
    assert [decode(ids[i : i + n]) for i, n in cuts] == want
    assert [decode(w) for w in windows] == want_random


def test_token_decoder_on_the_test_tokenizer_and_its_fallback(monkeypatch):
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    ids = list(range(96)) + [0, 5, 0]  # 0 is <eos>, a special token
    assert token_decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=True)
    # with space clean-up transformers' decode does more than the backend: it is called instead
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tok, "decode", lambda ids, skip_special_tokens: f"decoded {ids}")
    assert token_decoder(tok)([1, 2]) == "decoded [1, 2]"


def test_special_tokens_kept_when_asked(tokenizer):
    """skip_special_tokens=False: the special tokens' text (e.g. <|im_end|>) is in the text, which
    is the tokenizer's decode with skip_special_tokens=False, token by token or a step at a time,
    through the backend decoder too. Byte-level BPE puts no separator between tokens, so
    spaces_between_special_tokens=False gives the same text (as in vLLM); stop strings match it."""
    import random

    body = tokenizer.encode(TEXT, add_special_tokens=False)
    specials = sorted(set(tokenizer.all_special_ids))
    eos = tokenizer.eos_token_id
    ids = body[:20] + specials + body[20:40] + [eos, eos] + body[40:] + [eos]
    want = tokenizer.decode(ids, skip_special_tokens=False)
    assert tokenizer.decode([eos]) in want and want != tokenizer.decode(ids, skip_special_tokens=True)
    assert token_decoder(tokenizer, skip_special_tokens=False)(ids) == want
    rng = random.Random(0)
    for spaces in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=spaces)
        lazy = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=spaces)
        i = 0
        while i < len(ids):
            n = rng.randint(1, 9)
            for t in ids[i : i + n]:
                detok.append(t)
                assert want.startswith(detok.text)
            lazy.extend(ids[i : i + n])
            assert want.startswith(lazy.text)
            i += n
        detok.flush()
        lazy.flush()
        assert detok.text == lazy.text == want, spaces
    eos_text = tokenizer.decode([eos])
    stop = IncrementalDetokenizer(tokenizer, [eos_text], skip_special_tokens=False)
    hit = stop.extend(ids)
    assert hit == (ids.index(eos), eos_text) and stop.text == want[: want.index(eos_text)]
    skipped = IncrementalDetokenizer(tokenizer, [eos_text])  # the default leaves it out of the text: no match
    assert skipped.extend(ids) is None


def test_spaces_between_special_tokens_on_a_decoder_that_joins_tokens_with_spaces():
    """The word-level test tokenizer (no decoder: tokens joined by spaces; <eos> special, id 0):
    False writes an added token right after another one bare ("<eos><eos>"), as vLLM's fast
    detokenizer; other separators stay. With skip_special_tokens (default) the flag does nothing."""
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    ids = [0, 0, 5, 0, 0, 0, 6, 7, 0]
    for flags, want in [
        ({}, "w05x w06x w07x"),
        ({"spaces_between_special_tokens": False}, "w05x w06x w07x"),
        ({"skip_special_tokens": False}, "<eos> <eos> w05x <eos> <eos> <eos> w06x w07x <eos>"),
        ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, "<eos><eos> w05x <eos><eos><eos> w06x w07x <eos>"),
    ]:
        one = IncrementalDetokenizer(tok, [], **flags)
        for t in ids:
            one.append(t)
        step = IncrementalDetokenizer(tok, [], **flags)
        step.extend(ids[:4])
        step.extend(ids[4:])
        assert one.text == step.text == want, flags
    assert make_tokenizer().decode(ids, skip_special_tokens=False) == "<eos> <eos> w05x <eos> <eos> <eos> w06x w07x <eos>"
