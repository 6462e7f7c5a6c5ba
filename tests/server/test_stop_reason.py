"""vLLM's `stop_reason` on completions and chat choices: the stop string or stop token id that
ended the choice, null for EOS and length; in a stream, on the chunk that finishes the choice
(null on the others). Raw JSON over httpx, so null is checked as JSON null."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.tiny_model import EOS_ID, word

PROMPT = " ".join(word(i) for i in (5, 17, 33, 8, 61))
MESSAGES = [{"role": "user", "content": f"{word(12)} {word(40)}"}]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _body(kind: str, **kw) -> dict:
    first = {"prompt": PROMPT} if kind == "completions" else {"messages": MESSAGES}
    return {"model": MODEL_NAME, **first, "max_tokens": 12, "temperature": 0.0, **kw}


def _post(server, kind: str, **kw) -> dict:
    r = httpx.post(server.url + PATHS[kind], json=_body(kind, **kw), headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(server, kind: str, **kw) -> tuple[list[dict], str]:
    """(every choice of every chunk, the streamed text)."""
    choices = []
    body = _body(kind, stream=True, **kw)
    with httpx.stream("POST", server.url + PATHS[kind], json=body, headers=server.headers(), timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[len("data: "):])["choices"]
    text = "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices)
    return choices, text


def _words(server, kind: str) -> list[str]:
    choice = _post(server, kind, ignore_eos=True)
    return (choice["text"] if kind == "completions" else choice["message"]["content"]).split()


def _expect(server, kind: str, finish: str, stop_reason, **kw) -> None:
    choice = _post(server, kind, **kw)
    assert "stop_reason" in choice and (choice["finish_reason"], choice["stop_reason"]) == (finish, stop_reason), choice
    chunks, _ = _stream(server, kind, **kw)
    finishing = [c for c in chunks if c["finish_reason"] is not None]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finishing] == [(finish, stop_reason)], finishing
    assert all("stop_reason" in c and c["stop_reason"] is None for c in chunks if c["finish_reason"] is None)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stop_string_is_the_stop_reason(plain_server, kind):
    words = _words(plain_server, kind)
    stop = f"{words[2]} {words[3]}"  # spans two tokens
    _expect(plain_server, kind, "stop", stop, stop=["w95x", stop], ignore_eos=True)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stop_token_id_is_the_stop_reason(plain_server, kind):
    words = _words(plain_server, kind)
    k = next(k for k in range(1, len(words)) if words[k] not in words[:k])
    stop_id = int(words[k][1:3])
    _expect(plain_server, kind, "stop", stop_id, stop_token_ids=[stop_id], ignore_eos=True)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_length_and_eos_give_a_null_stop_reason(plain_server, kind):
    _expect(plain_server, kind, "length", None, max_tokens=3, ignore_eos=True)
    eos = {"logit_bias": {str(EOS_ID): 100.0}}  # the model's EOS comes first
    _expect(plain_server, kind, "stop", None, **eos)
    _expect(plain_server, kind, "stop", None, stop_token_ids=[EOS_ID], **eos)  # EOS is checked first, as vLLM


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("server", ["plain_server", "dflash_server"])
def test_include_stop_str_in_output_keeps_the_stop_string(request, server, kind):
    """vLLM's include_stop_str_in_output: the text ends after the stop string instead of before it,
    streamed and not; same stop reason, same tokens; DFlash (stops inside accepted blocks) alike."""
    server = request.getfixturevalue(server)
    words = _words(server, kind)
    stop = f"{words[2]} {words[3]}"  # spans two tokens
    kw = dict(stop=[stop], ignore_eos=True)
    cut, kept = _post(server, kind, **kw), _post(server, kind, include_stop_str_in_output=True, **kw)
    text = (lambda c: c["text"] if kind == "completions" else c["message"]["content"])
    assert text(kept) == text(cut) + stop and " ".join(words).startswith(text(kept).strip())
    assert (kept["finish_reason"], kept["stop_reason"]) == ("stop", stop)
    _, streamed = _stream(server, kind, include_stop_str_in_output=True, **kw)
    assert streamed == text(kept)
