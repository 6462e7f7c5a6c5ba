"""Logprobs' `bytes` (chat completions and `generate --logprobs N`): each token's raw UTF-8 bytes,
so that the bytes of consecutive tokens concatenate to the exact UTF-8 of their text, also where
a token holds only part of a character (not the bytes of U+FFFD, which decoding it alone gives)."""

from __future__ import annotations

import json

import pytest

from blockdraft.server.responses import TokenText, chat_logprobs, token_bytes_decoder
from blockdraft.weights.fetch import cache_root, is_complete

REPLACEMENT = list("\ufffd".encode())
# Byte-level BPE splits some of these characters across tokens in both real tokenizers (SmolLM2:
# the emoji and the CJK characters; Qwen2.5: 🦜 and 🫠), and keeps others whole.
SPLIT_TEXT = "🙂 日本語 🦜🫠 naïve"
ASCII_TEXT = "Hello world, this is plain text: x = 1 + 2."


def _real(name: str):
    """Parametrize entry for a catalog model's tokenizer: slow (fetched first) unless cached."""
    cached = is_complete(cache_root() / "models" / name)
    return pytest.param(name, marks=[] if cached else [pytest.mark.slow])


@pytest.fixture(scope="module", params=[_real("smollm2-135m-instruct"), _real("qwen2.5-coder-0.5b-instruct")])
def real_tokenizer(request):
    from blockdraft.weights.fetch import resolve_model_path
    from blockdraft.weights.loader import load_tokenizer

    return load_tokenizer(resolve_model_path(request.param))


def _concat(token_text: TokenText, ids: list[int]) -> bytes:
    return b"".join(bytes(token_text.bytes(i)) for i in ids)


def test_real_tokenizer_split_characters_concatenate_to_the_exact_utf8(real_tokenizer):
    tok = real_tokenizer
    ids = tok.encode(SPLIT_TEXT, add_special_tokens=False)
    text = TokenText(tok)
    partial = [i for i in ids if "\ufffd" in text(i)]
    assert partial, "no character is split across tokens here: pick another SPLIT_TEXT"
    assert tok.decode(ids) == SPLIT_TEXT
    assert _concat(text, ids) == SPLIT_TEXT.encode("utf-8")
    for i in partial:
        b = text.bytes(i)
        assert b and all(0 <= x <= 255 for x in b) and b != REPLACEMENT
        assert bytes(REPLACEMENT) not in bytes(b)


def test_real_tokenizer_ascii_and_special_tokens_are_the_utf8_of_their_text(real_tokenizer):
    tok = real_tokenizer
    text = TokenText(tok)
    ids = tok.encode(ASCII_TEXT, add_special_tokens=False)
    assert len(ids) > 5
    for i in ids:
        assert text.bytes(i) == list(text(i).encode("utf-8"))
    assert _concat(text, ids) == ASCII_TEXT.encode()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert text.bytes(im_end) == list(b"<|im_end|>") == list(text(im_end).encode())


def test_real_tokenizer_chat_logprobs_items_and_alternatives(real_tokenizer):
    """Through chat_logprobs (the server's and generate's path): the sampled tokens and their
    top_logprobs alternatives (here the split text's tokens in reverse) carry their own bytes."""
    tok = real_tokenizer
    ids = tok.encode(SPLIT_TEXT + ASCII_TEXT, add_special_tokens=False)
    alts = ids[::-1][:20]
    entries = [{"token_id": i, "logprob": -0.5, "top": [(a, -1.0 - k) for k, a in enumerate(alts)]} for i in ids]
    text = TokenText(tok)
    content = chat_logprobs(entries, text, token_ids=True)["content"]
    assert bytes(b for e in content for b in e["bytes"]) == (SPLIT_TEXT + ASCII_TEXT).encode()
    want = {i: bytes(text.bytes(i)) for i in ids}
    for e in content:
        assert [t["token_id"] for t in e["top_logprobs"]] == alts
        for t in [e, *e["top_logprobs"]]:
            assert t["token"] == text(t["token_id"])  # the text is as before
            assert bytes(t["bytes"]) == want[t["token_id"]]
            assert ("\ufffd" in t["token"]) == (t["bytes"] != list(t["token"].encode()))
    assert any(t["bytes"] != REPLACEMENT and "\ufffd" in t["token"] for t in content[0]["top_logprobs"])


# --- tiny tokenizers built here: no download, every scheme --------------------------------------

SPLIT_CHARS = "🙂日本語é"
# Token i (1..95) of the tiny byte-level tokenizer is the single byte BYTES[i - 1]; 0 is "<eos>".
BYTES = sorted(set(SPLIT_CHARS.encode())) + list(range(0x20, 0x20 + 95 - len(set(SPLIT_CHARS.encode()))))


def byte_level_tokenizer():
    """A GPT-2-style byte-level BPE tokenizer of 96 one-byte tokens (the tiny model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char_of = bytes_to_unicode()
    tok = Tokenizer(models.BPE({"<eos>": 0, **{char_of[b]: i for i, b in enumerate(BYTES, 1)}}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def sentencepiece_tokenizer():
    """A Llama-style SentencePiece tokenizer: "▁" for spaces, <0xNN> byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), *((f"<0x{b:02X}>", -100.0) for b in range(256)),
              ("▁Hello", -1.0), ("▁world", -1.0), ("▁", -2.0), ("é", -2.0)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_tiny_byte_level_tokens_are_their_bytes():
    tok = byte_level_tokenizer()
    text = TokenText(tok)
    ids = tok.encode("ab 🙂 日本語é", add_special_tokens=False)
    assert len(ids) == len("ab 🙂 日本語é".encode())  # one token per byte: every character is split
    assert [text.bytes(i) for i in ids] == [[BYTES[i - 1]] for i in ids]
    assert _concat(text, ids) == "ab 🙂 日本語é".encode()
    assert text.bytes(0) == list(b"<eos>")


def test_sentencepiece_byte_fallback_and_spaces():
    tok = sentencepiece_tokenizer()
    text = TokenText(tok)
    ids = tok.encode("Hello world 🙂é", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁Hello", "▁world", "▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "é"]
    assert [bytes(text.bytes(i)) for i in ids] == [b" Hello", b" world", b" ", b"\xf0", b"\x9f", b"\x99", b"\x82",
                                                   "é".encode()]
    # SentencePiece drops the text's leading space when decoding; the bytes keep every token's own
    assert _concat(text, ids) == b" " + tok.decode(ids).encode()
    assert text.bytes(tok.convert_tokens_to_ids("</s>")) == list(b"</s>")


def test_word_level_tokens_keep_the_utf8_of_their_text():
    from tests.server.tiny_model import make_tokenizer, word

    text = TokenText(make_tokenizer())
    assert [text.bytes(i) for i in range(96)] == [list(text(i).encode()) for i in range(96)]
    assert text.bytes(7) == list(word(7).encode())


def test_without_token_strings_the_bytes_are_the_utf8_of_the_decoded_text():
    class DecodeOnly:
        def decode(self, ids):
            return "".join(f"é{i}" for i in ids)

    assert token_bytes_decoder(DecodeOnly())(3) == "é3".encode()


def test_generate_logprobs_bytes_of_split_characters(tmp_path, capsys):
    """`blockdraft generate --json --logprobs 20` on the tiny model with the one-byte tokenizer:
    every output token and alternative gives its one byte (most are parts of characters)."""
    from blockdraft.cli import main
    from tests.server.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    byte_level_tokenizer().save_pretrained(str(model))
    code = main(["generate", "ab 🙂", "--raw", "--model", str(model), "--no-draft", "--max-tokens", "16",
                 "--logprobs", "20", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    items = result["logprobs"]
    assert [e["token_id"] for e in items] == result["token_ids"] and items

    def want(token_id: int) -> list[int]:
        return list(b"<eos>") if token_id == 0 else [BYTES[token_id - 1]]

    alternatives = [t for e in items for t in e["top_logprobs"]]
    assert len(alternatives) == 20 * len(items)
    assert any(t["token_id"] <= len(set(SPLIT_CHARS.encode())) for t in alternatives)  # parts of characters
    for t in items + alternatives:
        assert t["bytes"] == want(t["token_id"]), t
    ids = [i for i in result["token_ids"] if i != 0]  # the text leaves out <eos>
    assert bytes(b for e in items if e["token_id"] != 0 for b in e["bytes"]).decode("utf-8", "replace") == \
        byte_level_tokenizer().decode(ids) == result["text"]
