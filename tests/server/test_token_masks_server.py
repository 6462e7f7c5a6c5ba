"""vLLM's extra request fields allowed_token_ids and bad_words on /v1/completions and
/v1/chat/completions: they restrict the answer, and the DFlash server's answers equal the plain
server's (bad values get 400s naming the field: test_bad_requests)."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL_NAME, openai_client
from tests.server.tiny_model import word

PROMPT = " ".join(word(i) for i in range(3, 9))
CHAT = [{"role": "user", "content": f"{word(30)} {word(31)} {word(2)}"}]
ALLOWED = [5, 9, 17, 33, 60]


def _create(client, kind, **kw):
    first = {"prompt": PROMPT} if kind == "completions" else {"messages": CHAT}
    api = client.completions if kind == "completions" else client.chat.completions
    return api.create(model=MODEL_NAME, max_tokens=24, **first, **kw)


def _words(resp) -> list[list[str]]:
    """Each choice's answer as the words (one per token) of the tiny model's tokenizer."""
    return [(c.text if hasattr(c, "text") else c.message.content).split() for c in resp.choices]


def _contains(words: list[str], seq: list[str]) -> bool:
    return any(words[i:i + len(seq)] == seq for i in range(len(words) - len(seq) + 1))


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_allowed_token_ids_restrict_the_answer(plain_server, kind):
    client = openai_client(plain_server)
    free = _words(_create(client, kind, temperature=0.0, extra_body={"ignore_eos": True}))[0]
    assert not set(free) <= {word(t) for t in ALLOWED}
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=3, n=2)):
        out = _create(client, kind, extra_body={"ignore_eos": True, "allowed_token_ids": ALLOWED}, **kw)
        for words in _words(out):
            assert len(words) == 24 and set(words) <= {word(t) for t in ALLOWED}


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_bad_words_never_appear_in_the_answer(plain_server, kind):
    client = openai_client(plain_server)
    free = _words(_create(client, kind, temperature=0.0, extra_body={"ignore_eos": True}))[0]
    bad = [free[1:3], free[4:5]]  # a two-token word the model wants, and a token it emits
    out = _words(_create(client, kind, temperature=0.0,
                         extra_body={"ignore_eos": True, "bad_words": [" ".join(w) for w in bad]}))[0]
    assert out != free and not any(_contains(out, w) for w in bad)


def test_dflash_answers_equal_plain_ones(plain_server, dflash_server):
    plain, spec = openai_client(plain_server), openai_client(dflash_server)
    free = _words(_create(plain, "completions", temperature=0.0, extra_body={"ignore_eos": True}))[0]
    bad = [" ".join(free[1:3]), " ".join(free[5:8]), free[10]]
    requests = [
        ("completions", dict(temperature=0.0, extra_body={"ignore_eos": True, "bad_words": bad})),
        ("completions", dict(temperature=0.9, seed=4, n=2, extra_body={"ignore_eos": True, "bad_words": bad,
                                                                     "allowed_token_ids": ALLOWED + [int(free[1][1:3])]})),
        ("chat", dict(temperature=0.0, extra_body={"ignore_eos": True, "allowed_token_ids": ALLOWED})),
        ("chat", dict(temperature=1.0, seed=7, extra_body={"bad_words": bad})),
    ]
    drafted = 0
    for kind, kw in requests:
        ref, out = _create(plain, kind, **kw), _create(spec, kind, **kw)
        assert _words(out) == _words(ref), (kind, kw)
        drafted += out.model_extra["spec_decode_stats"]["num_draft_tokens"]
    assert drafted > 0


@pytest.mark.parametrize("kind, field, value", [
    ("completions", "allowed_token_ids", []),
    ("chat", "allowed_token_ids", [5, 10**6]),
    ("completions", "bad_words", ["w05x", ""]),
    ("chat", "bad_words", "w05x"),
])
def test_bad_values_are_400s_naming_the_field(plain_server, kind, field, value):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _create(openai_client(plain_server), kind, extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]
