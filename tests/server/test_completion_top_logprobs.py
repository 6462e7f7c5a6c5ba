"""/v1/completions `top_logprobs` as in vLLM: each position's dict holds the N most likely tokens
and always the sampled token (logprobs=0: just the sampled one, not {}; logprobs=N: N + 1 entries
when the sampled token is not among the top N). Chat completions keep OpenAI's format:
top_logprobs 0 gives an empty list."""

from __future__ import annotations

import json

import httpx

from blockdraft.server.responses import TokenText, chat_logprobs, completion_logprobs
from tests.server.test_completion_text_offset import byte_level_server  # noqa: F401 (a fixture)
from tests.server.test_logprobs_bytes import byte_level_tokenizer


def test_top_logprobs_always_hold_the_sampled_token():
    tok = byte_level_tokenizer()
    token_text = TokenText(tok)
    a, b, c = tok.encode("abc", add_special_tokens=False)
    entries = [
        {"token_id": a, "logprob": -0.1, "top": []},  # logprobs=0
        {"token_id": b, "logprob": -3.0, "top": [(a, -0.2), (c, -1.0)]},  # sampled outside the top 2
        {"token_id": c, "logprob": -0.3, "top": [(c, -0.3), (a, -2.0)]},  # sampled among them
    ]
    top = completion_logprobs(entries, token_text)["top_logprobs"]
    assert top == [{"a": -0.1}, {"a": -0.2, "c": -1.0, "b": -3.0}, {"c": -0.3, "a": -2.0}]
    assert [list(d) for d in top[1:]] == [["a", "c", "b"], ["c", "a"]]  # the top N first, most likely first
    # chat completions: OpenAI's top_logprobs 0 is an empty list, and no extra entry for N > 0
    content = chat_logprobs(entries, token_text)["content"]
    assert [[t["token"] for t in e["top_logprobs"]] for e in content] == [[], ["a", "c"], ["c", "a"]]


BODY = {"model": "t", "prompt": "ab", "max_tokens": 24, "temperature": 1.0, "seed": 5, "ignore_eos": True}


def _check(logprobs: dict, n: int) -> int:
    """Checks each position's dict; returns how many hold n + 1 entries (sampled outside the top n)."""
    extra = 0
    for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert token in top and top[token] == lp, (token, lp, top)  # a shared "\ufffd" key keeps the sampled one's
        assert 1 <= len(top) <= n + 1
        extra += len(top) == n + 1
    return extra


def test_server_logprobs_zero_and_n_hold_the_sampled_token(byte_level_server):
    for n in (0, 2):
        r = httpx.post(byte_level_server + "/v1/completions", json={**BODY, "logprobs": n}, timeout=60)
        assert r.status_code == 200, r.text
        extra = _check(r.json()["choices"][0]["logprobs"], n)
        assert extra == 24 if n == 0 else extra > 0  # temperature 1: some sampled tokens are outside the top 2
        body = {**BODY, "logprobs": n, "stream": True}
        with httpx.stream("POST", byte_level_server + "/v1/completions", json=body, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c["logprobs"]:
                            _check(c["logprobs"], n)
