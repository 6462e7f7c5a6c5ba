"""/v1/completions logprobs' `text_offset`: each token's start, in characters, in the returned text
(the completion's `text`; with echo see test_completion_echo), also where byte-level BPE splits a
character across tokens (decoded alone such a token reads U+FFFD, one character that is not in the
text)."""

from __future__ import annotations

import json

import httpx
import pytest

from blockdraft.server.responses import TokenText, completion_logprobs
from tests.server.test_logprobs_bytes import (  # noqa: F401 (real_tokenizer is a fixture)
    ASCII_TEXT, SPLIT_TEXT, byte_level_tokenizer, real_tokenizer, sentencepiece_tokenizer,
)


def _entries(ids: list[int]) -> list[dict]:
    return [{"token_id": i, "logprob": -0.5, "top": [(i, -0.5)]} for i in ids]


def _check_offsets(offsets: list[int], text: str, num_tokens: int) -> None:
    """Offsets index the text: start at 0, never decrease, and consecutive slices rebuild it."""
    assert len(offsets) == num_tokens
    assert offsets[0] == 0
    assert all(a <= b for a, b in zip(offsets, offsets[1:])), offsets
    assert offsets[-1] <= len(text)
    ends = offsets[1:] + [len(text)]
    assert "".join(text[a:b] for a, b in zip(offsets, ends)) == text


def _check_prefixes(tok, ids: list[int], offsets: list[int], text: str) -> None:
    """The definition, by brute force (O(n^2) decodes): token i starts after the complete
    characters of the tokens before it, decoded as the completion text is."""
    for i, offset in enumerate(offsets):
        assert text[:offset] == tok.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd"), i


def test_byte_level_split_characters():
    tok = byte_level_tokenizer()
    text = "ab 🙂 日本語é"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one token per byte
    lp = completion_logprobs(_entries(ids), TokenText(tok), text_len=len(text))
    # a token adds the character it completes; the other bytes of that character add nothing
    want, chars = [], 0
    for ch in text:
        n = len(ch.encode())
        want += [chars] * n
        chars += 1
    assert lp["text_offset"] == want
    _check_offsets(lp["text_offset"], text, len(ids))
    _check_prefixes(tok, ids, lp["text_offset"], text)
    assert lp["tokens"][3] == "\ufffd"  # the token text is unchanged: the first byte of 🙂 alone


TINY_ASCII = "Hello, a 1 + 2 = 3 (ok) [done]!"  # bytes the tiny tokenizer has (up to "r")


def test_ascii_offsets_are_the_summed_token_lengths():
    tok = byte_level_tokenizer()
    ids = tok.encode(TINY_ASCII, add_special_tokens=False)
    lp = completion_logprobs(_entries(ids), TokenText(tok))
    assert lp["text_offset"] == list(range(len(TINY_ASCII)))
    assert "".join(lp["tokens"]) == TINY_ASCII
    _check_offsets(lp["text_offset"], TINY_ASCII, len(ids))


def test_real_tokenizer_ascii_offsets_are_the_summed_token_lengths(real_tokenizer):
    ids = real_tokenizer.encode(ASCII_TEXT, add_special_tokens=False)
    lp = completion_logprobs(_entries(ids), TokenText(real_tokenizer))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    _check_offsets(lp["text_offset"], ASCII_TEXT, len(ids))


def test_streamed_chunks_continue_the_offsets():
    from blockdraft.server.responses import TextOffsets

    tok = byte_level_tokenizer()
    ids = tok.encode("x🙂日本語é y", add_special_tokens=False)
    token_text = TokenText(tok)
    whole = completion_logprobs(_entries(ids), token_text)["text_offset"]
    offsets, streamed = TextOffsets(tok), []
    for start in range(0, len(ids), 3):  # chunks that end inside characters
        streamed += completion_logprobs(_entries(ids[start:start + 3]), token_text, offsets)["text_offset"]
    assert streamed == whole


def test_offsets_are_capped_at_the_text_length():
    """A stop string cuts the text but not the tokens: later tokens start at the text's end."""
    tok = byte_level_tokenizer()
    ids = tok.encode("ab🙂cd", add_special_tokens=False)
    lp = completion_logprobs(_entries(ids), TokenText(tok), text_len=2)
    assert lp["text_offset"] == [0, 1] + [2] * (len(ids) - 2)


def test_sentencepiece_leading_space():
    """SentencePiece drops the text's leading space; each token decoded alone drops its own."""
    tok = sentencepiece_tokenizer()
    ids = tok.encode("Hello world 🙂é", add_special_tokens=False)
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "Hello world 🙂é"
    lp = completion_logprobs(_entries(ids), TokenText(tok))
    assert lp["text_offset"] == [0, 5, 11, 12, 12, 12, 12, 13]
    _check_offsets(lp["text_offset"], text, len(ids))
    _check_prefixes(tok, ids, lp["text_offset"], text)


def test_real_tokenizer_split_characters_and_special_token(real_tokenizer):
    tok = real_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode(ASCII_TEXT + SPLIT_TEXT + " end", add_special_tokens=False) + [im_end]
    token_text = TokenText(tok)
    assert any("\ufffd" in token_text(i) for i in ids)
    text = tok.decode(ids, skip_special_tokens=True)  # as the engine decodes the completion
    assert text == ASCII_TEXT + SPLIT_TEXT + " end"
    lp = completion_logprobs(_entries(ids), token_text, text_len=len(text))
    _check_offsets(lp["text_offset"], text, len(ids))
    _check_prefixes(tok, ids, lp["text_offset"], text)
    assert lp["text_offset"][-1] == len(text)  # <|im_end|> adds no text
    for i, (a, b) in enumerate(zip(lp["text_offset"], lp["text_offset"][1:] + [len(text)])):
        if "\ufffd" not in lp["tokens"][i] and ids[i] != im_end:
            assert text[a:b] == lp["tokens"][i]  # whole-character tokens: their own text


@pytest.fixture(scope="module")
def byte_level_server(tmp_path_factory):
    """An in-process server over the tiny model with the one-byte tokenizer: sampled bytes split
    characters (and form invalid sequences) all the time."""
    from blockdraft.llm import LLM
    from blockdraft.server.api import build_app
    from blockdraft.server.config import ServerConfig
    from tests.server.server_process import free_port
    from tests.server.test_engine_failure import _serving
    from tests.server.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("offset_model") / "model")
    byte_level_tokenizer().save_pretrained(str(model))
    llm = LLM(model=str(model))
    port = free_port()
    app = build_app(llm, ServerConfig(port=port, served_model_name="t", log_requests=False))
    with _serving(app, port) as url:
        yield url


BODY = {"model": "t", "prompt": "ab 🙂", "max_tokens": 40, "temperature": 1.0, "ignore_eos": True, "logprobs": 2}


def test_server_completion_offsets_index_the_text(byte_level_server):
    for seed in range(3):
        r = httpx.post(byte_level_server + "/v1/completions", json={**BODY, "seed": seed}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert "\ufffd" in "".join(choice["logprobs"]["tokens"])  # some token is part of a character
        _check_offsets(choice["logprobs"]["text_offset"], choice["text"], len(choice["logprobs"]["tokens"]))


def test_server_streamed_offsets_index_the_text(byte_level_server):
    body = {**BODY, "seed": 1, "stream": True}
    with httpx.stream("POST", byte_level_server + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text, offsets, tokens = "", [], 0
    for e in events:
        for c in e["choices"]:
            text += c["text"]
            if c["logprobs"]:
                offsets += c["logprobs"]["text_offset"]
                tokens += len(c["logprobs"]["tokens"])
    _check_offsets(offsets, text, tokens)
    full = httpx.post(byte_level_server + "/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert full["choices"][0]["text"] == text and full["choices"][0]["logprobs"]["text_offset"] == offsets


# --- streaming with stop strings: offsets never point past the text returned so far -------------


def _sse_choices(frames: list[bytes]) -> list[dict]:
    return [json.loads(f[6:])["choices"][0] for f in frames if f is not None]


def _check_stream(choices: list[dict], text: str, whole: list[int], num_tokens: int) -> None:
    """Every chunk's offsets index the text returned up to and including that chunk; together the
    chunks return `text` and the non-streamed offsets `whole`, one per token."""
    sent, offsets = "", []
    for c in choices:
        sent += c["text"]
        if c["logprobs"] is not None:
            assert all(o <= len(sent) for o in c["logprobs"]["text_offset"]), (sent, c["logprobs"]["text_offset"])
            assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["text_offset"])
            offsets += c["logprobs"]["text_offset"]
    assert sent == text and offsets == whole and len(offsets) == num_tokens
    _check_offsets(offsets, text, num_tokens)


@pytest.mark.parametrize("stop", ["+ 2 =", "(ok)", "3", ", a 1 + 2 = 3 ("])
def test_streamed_offsets_before_a_stop_string_stay_in_the_text(stop):
    """The stream path (Serving._chunk) fed one token per engine update, as the engine reports
    them (text cut before the first stop string, which finishes the choice). The tokens of a
    multi-character stop string but its last arrive before the engine sees the stop string: their
    offsets lie past the final text (the stop string is cut), and used to be sent uncapped."""
    from types import SimpleNamespace

    from blockdraft.engine.outputs import RequestOutput
    from blockdraft.engine.request import SpecStats
    from blockdraft.server.serving import CompletionFormat, Serving, _Cursor

    tok = byte_level_tokenizer()
    ids = tok.encode(TINY_ASCII, add_special_tokens=False)  # one token per character
    token_text = TokenText(tok)
    serving = Serving(SimpleNamespace(token_text=token_text), CompletionFormat())
    cursor, frames = _Cursor(len(stop) - 1), []
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        cut = text.find(stop)
        finished = cut >= 0 or k == len(ids)
        out = RequestOutput("r", [1], ids[:k], text[:cut] if cut >= 0 else text, finished,
                            "stop" if finished else None, stop if cut >= 0 else None, SpecStats(),
                            logprobs=_entries(ids[:k]))
        frames.append(serving._chunk({}, 0, cursor, out))
        if finished:
            break
    final = TINY_ASCII[: TINY_ASCII.find(stop)]
    whole = completion_logprobs(_entries(ids[:k]), token_text, text_len=len(final))["text_offset"]
    assert whole[-len(stop):] == [len(final)] * len(stop)  # the stop string's tokens start at the end
    _check_stream(_sse_choices(frames), final, whole, k)


def test_server_streamed_offsets_with_a_stop_string(byte_level_server):
    """End to end: a stop string taken from the seeded completion (its first occurrence) cuts the
    streamed text; every chunk's offsets stay within the text sent so far and equal the
    non-streamed response's."""
    body = {**BODY, "seed": 2, "prompt": "ab", "max_tokens": 60}
    first = httpx.post(byte_level_server + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    start = next(i for i in range(4, len(first) - 4) if first[i:i + 4].isascii() and "\ufffd" not in first[i:i + 4]
                 and first.find(first[i:i + 4]) == i)
    stop = first[start:start + 4]
    body = {**body, "stop": [stop]}
    full = httpx.post(byte_level_server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert full["finish_reason"] == "stop" and full["text"] == first[:start]
    with httpx.stream("POST", byte_level_server + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        choices = [c for line in r.iter_lines() if line.startswith("data: {") for c in json.loads(line[6:])["choices"]]
    lp = full["logprobs"]
    _check_stream(choices, full["text"], lp["text_offset"], len(lp["tokens"]))
