"""vLLM's `skip_special_tokens` / `spaces_between_special_tokens` request fields and
`stream_options.continuous_usage_stats`, over raw HTTP on the tiny model (word-level tokenizer:
<eos>, id 0, is a special token; its decoder joins tokens with spaces).

skip_special_tokens false keeps "<eos>" in the text (streamed == not streamed, plain == DFlash);
spaces_between_special_tokens false joins consecutive ones; completions' text_offset follows the
text. continuous_usage_stats puts each choice's usage so far on every chunk that carries it."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.tiny_model import EOS_ID, word

PROMPT = " ".join(word(i) for i in (5, 17, 33, 8, 61))
MESSAGES = [{"role": "user", "content": f"{word(12)} {word(40)}"}]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# <eos> frequent (runs of it too), and generation goes on past it
EOS_HEAVY = {"logit_bias": {str(EOS_ID): 9.0}, "ignore_eos": True, "temperature": 0.8}


def _body(kind: str, **kw) -> dict:
    first = {"prompt": PROMPT} if kind == "completions" else {"messages": MESSAGES}
    return {"model": MODEL_NAME, **first, "max_tokens": 24, **kw}


def _post(server, kind: str, **kw) -> dict:
    r = httpx.post(server.url + PATHS[kind], json=_body(kind, **kw), headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(server, kind: str, **kw) -> list[dict]:
    """Every chunk of a stream, [DONE] left out."""
    out = []
    body = _body(kind, stream=True, **kw)
    with httpx.stream("POST", server.url + PATHS[kind], json=body, headers=server.headers(), timeout=120) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: "):]))
    return out


def _text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _streamed_text(chunks: list[dict], index: int = 0) -> str:
    return "".join(c.get("text", c.get("delta", {}).get("content", "")) or ""
                   for ch in chunks for c in ch["choices"] if c["index"] == index)


def _tokens(body: dict, kind: str) -> list[str]:
    """Each generated token's text, decoded alone (logprobs), e.g. "w05x" or "<eos>"."""
    lp = body["choices"][0]["logprobs"]
    return lp["tokens"] if kind == "completions" else [e["token"] for e in lp["content"]]


def _join(tokens: list[str], skip: bool, spaces: bool = True) -> str:
    """The word tokenizer's text of these tokens (skip: without "<eos>"; not spaces: no space
    between two consecutive "<eos>")."""
    out = ""
    for i, t in enumerate(tokens):
        if skip and t == "<eos>":
            continue
        glued = not spaces and t == "<eos>" and i > 0 and tokens[i - 1] == "<eos>"
        out += t if not out or glued else " " + t
    return out


def _logprobs(kind: str) -> dict:
    return {"logprobs": 0} if kind == "completions" else {"logprobs": True}


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_skip_special_tokens_false_keeps_them_in_the_text(plain_server, dflash_server, kind):
    seen_eos = seen_run = False
    for seed in range(3):
        kw = dict(EOS_HEAVY, seed=seed, **_logprobs(kind))
        default = _post(plain_server, kind, **kw)
        tokens = _tokens(default, kind)
        seen_eos |= "<eos>" in tokens
        assert _text(default["choices"][0]) == _join(tokens, skip=True)
        for spaces in (True, False):
            flags = {"skip_special_tokens": False, "spaces_between_special_tokens": spaces}
            kept = _post(plain_server, kind, **kw, **flags)
            assert _tokens(kept, kind) == tokens  # the flags change only the text (logprobs' tokens too)
            want = _join(tokens, skip=False, spaces=spaces)
            assert _text(kept["choices"][0]) == want
            seen_run |= not spaces and "<eos><eos>" in want
            assert _streamed_text(_chunks(plain_server, kind, **kw, **flags)) == want
            assert _text(_post(dflash_server, kind, **kw, **flags)["choices"][0]) == want  # DFlash == plain
            assert _streamed_text(_chunks(dflash_server, kind, **kw, **flags)) == want
            if kind == "completions":  # text_offset: the length of the text before each token, kept tokens counted
                offsets = kept["choices"][0]["logprobs"]["text_offset"]
                assert offsets == [len(_join(tokens[:k], skip=False, spaces=spaces)) for k in range(len(tokens))]
    assert seen_eos and seen_run  # the cases are exercised
    # flags given at their defaults (as vLLM's clients send them) change nothing
    kw = dict(EOS_HEAVY, seed=0)
    same = _post(plain_server, kind, **kw, skip_special_tokens=True, spaces_between_special_tokens=True)
    assert _text(same["choices"][0]) == _text(_post(plain_server, kind, **kw)["choices"][0])


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_eos_that_ends_a_choice_is_left_out_unless_include_stop_str_in_output(plain_server, kind):
    kw = {"logit_bias": {str(EOS_ID): 100.0}, "skip_special_tokens": False, "temperature": 0.0}  # EOS first
    out = _post(plain_server, kind, **kw)["choices"][0]
    assert (out["finish_reason"], _text(out)) == ("stop", "")
    kept = _post(plain_server, kind, include_stop_str_in_output=True, **kw)["choices"][0]
    assert (kept["finish_reason"], _text(kept)) == ("stop", "<eos>")
    assert _streamed_text(_chunks(plain_server, kind, include_stop_str_in_output=True, **kw)) == "<eos>"


def _usage_by_choice(chunks: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            out.setdefault(c["index"], []).append(ch["usage"])
    return out


@pytest.mark.parametrize("server", ["plain_server", "dflash_server"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_put_each_choices_usage_on_its_chunks(request, server, kind):
    """vLLM: every chunk with a choice carries `usage` with that choice's prompt tokens and its
    completion tokens so far (non-decreasing, ending at its token count); the last chunk carries
    the totals (summed over choices) as without continuous_usage_stats; chat's first chunk of a
    choice (the role) says 0 completion tokens."""
    server = request.getfixturevalue(server)
    prompts = {"prompt": [PROMPT, f"{word(9)} {word(10)}"]} if kind == "completions" else {}
    kw = dict(max_tokens=20, temperature=0.8, seed=3, n=2, ignore_eos=True, **prompts)
    whole = _post(server, kind, **kw)
    chunks = _chunks(server, kind, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
    *body, tail = chunks
    assert tail["choices"] == [] and tail["usage"] == whole["usage"]
    by_choice = _usage_by_choice(body)
    assert sorted(by_choice) == list(range(len(whole["choices"])))
    for i, usages in by_choice.items():
        assert all(u is not None for u in usages), i
        prompt_tokens = {u["prompt_tokens"] for u in usages}
        assert len(prompt_tokens) == 1 and all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
                                               for u in usages)
        done = [u["completion_tokens"] for u in usages]
        assert done == sorted(done) and done[-1] == 20 and len(set(done)) >= 2, done  # grows to max_tokens
        if kind == "chat":
            assert done[0] == 0  # the role chunk
    if kind == "completions":  # each choice counts its own prompt; the total counts each prompt once
        first, second = (by_choice[i][0]["prompt_tokens"] for i in (0, 2))
        assert (first, second) == (5, 2) and whole["usage"]["prompt_tokens"] == first + second
    assert whole["usage"]["completion_tokens"] == sum(u[-1]["completion_tokens"] for u in by_choice.values())
    assert _streamed_text(chunks) == _text(whole["choices"][0])


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_needs_include_usage_as_in_vllm(plain_server, kind):
    """include_usage omitted counts as true with continuous_usage_stats (vLLM's default is true);
    include_usage false turns both off; include_usage alone gives null usage on the chunks."""
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    implied = _chunks(plain_server, kind, stream_options={"continuous_usage_stats": True}, **kw)
    assert implied[-1]["choices"] == [] and implied[-1]["usage"]["completion_tokens"] == 6
    assert all(ch["usage"] is not None for ch in implied)
    off = _chunks(plain_server, kind, stream_options={"include_usage": False, "continuous_usage_stats": True}, **kw)
    assert all("usage" not in ch for ch in off) and all(ch["choices"] for ch in off)
    plain = _chunks(plain_server, kind, stream_options={"include_usage": True}, **kw)
    assert all(ch["usage"] is None for ch in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6
    assert _streamed_text(implied) == _streamed_text(off) == _streamed_text(plain)
