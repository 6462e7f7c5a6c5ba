"""The official `openai` client against the real server: completions and chat, streamed and not."""

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, openai_client
from tests.server.tiny_model import word

PROMPT = " ".join(word(i) for i in (5, 17, 33, 8, 61))
MESSAGES = [{"role": "system", "content": word(9)}, {"role": "user", "content": f"{word(12)} {word(40)}"}]


def _stream_completion(client, **kw):
    """(texts per choice, finish reasons, logprob tokens sent per choice, usage) of a streamed completion."""
    n = kw.get("n", 1)
    texts, finish, sent = [""] * n, [None] * n, [0] * n
    usage = None
    for chunk in client.completions.create(model=MODEL_NAME, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
            sent[c.index] += len(c.logprobs.tokens) if c.logprobs else 0
    return texts, finish, sent, usage


def _stream_chat(client, **kw):
    n = kw.get("n", 1)
    texts, finish, sent = [""] * n, [None] * n, [0] * n
    usage = None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
            sent[c.index] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
    return texts, finish, sent, usage


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=7)])
def test_completion_stream_equals_non_stream_and_usage_counts_tokens_sent(plain_server, sampling):
    client = openai_client(plain_server)
    kw = dict(prompt=PROMPT, max_tokens=20, n=2, logprobs=2, **sampling)
    full = client.completions.create(model=MODEL_NAME, **kw)
    texts, finish, sent, usage = _stream_completion(client, **kw)
    assert texts == [c.text for c in full.choices]
    assert finish == [c.finish_reason for c in full.choices]
    assert all(c.text for c in full.choices)
    assert usage.completion_tokens == full.usage.completion_tokens == sum(sent)
    assert usage.completion_tokens == sum(len(c.logprobs.tokens) for c in full.choices)
    assert usage.prompt_tokens == full.usage.prompt_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    for c in full.choices:
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        for token, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
            # the top 2, plus the sampled token when it is not among them (vLLM's format)
            assert top[token] == lp and len(top) in (2, 3)
        assert c.finish_reason == "stop" or len(c.logprobs.tokens) == 20


def test_chat_stream_equals_non_stream_seeded_and_usage(plain_server):
    client = openai_client(plain_server)
    kw = dict(messages=MESSAGES, max_tokens=24, temperature=1.0, seed=3, logprobs=True, top_logprobs=1)
    full = client.chat.completions.create(model=MODEL_NAME, **kw)
    texts, finish, sent, usage = _stream_chat(client, **kw)
    assert full.choices[0].message.role == "assistant"
    assert texts == [full.choices[0].message.content]
    assert finish == [full.choices[0].finish_reason]
    assert usage.prompt_tokens == full.usage.prompt_tokens == 6  # w01x w09x w02x w12x w40x w03x
    assert usage.completion_tokens == full.usage.completion_tokens == sent[0] == len(full.choices[0].logprobs.content)
    assert full.choices[0].logprobs.content[0].top_logprobs[0].logprob >= full.choices[0].logprobs.content[0].logprob


def test_same_seed_same_text_and_n_choices_differ(plain_server):
    client = openai_client(plain_server)
    kw = dict(messages=MESSAGES, max_tokens=16, temperature=1.0, seed=11, n=3, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(model=MODEL_NAME, **kw)
    b = client.chat.completions.create(model=MODEL_NAME, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    assert a.usage.completion_tokens == 48


def test_stop_string_across_tokens_is_cut_identically_when_streamed(plain_server):
    client = openai_client(plain_server)
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    words = base.choices[0].text.split()
    stop = f"{words[3]} {words[4]}"  # spans two tokens; the stream must not have sent the first one
    kw = dict(prompt=PROMPT, max_tokens=12, temperature=0.0, stop=[stop], extra_body={"ignore_eos": True})
    full = client.completions.create(model=MODEL_NAME, **kw)
    texts, finish, _, usage = _stream_completion(client, **kw)
    cut = base.choices[0].text.find(stop)
    assert full.choices[0].text == base.choices[0].text[:cut] == texts[0]
    assert full.choices[0].finish_reason == finish[0] == "stop"
    assert usage.completion_tokens == full.usage.completion_tokens


def test_stop_token_ids_and_token_id_prompts(plain_server):
    client = openai_client(plain_server)
    base = client.completions.create(model=MODEL_NAME, prompt=[5, 17, 33], max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    words = base.choices[0].text.split()
    k = next(k for k in range(1, len(words)) if words[k] not in words[:k])  # its first occurrence
    stop_id = int(words[k][1:3])
    out = client.completions.create(
        model=MODEL_NAME, prompt=[5, 17, 33], max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}
    )
    assert out.choices[0].finish_reason == "stop" and words[k] == word(stop_id)
    # vLLM: the stop token's text is left out (kept with include_stop_str_in_output); usage counts it
    assert out.choices[0].text.split() == words[:k] and out.usage.completion_tokens == k + 1
    same_as_ids = " ".join(word(i) for i in (5, 17, 33))
    multi = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, same_as_ids], max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert multi.choices[1].text == base.choices[0].text
    assert multi.usage.prompt_tokens == 5 + 3


def test_models_health_metrics_and_api_key(plain_server):
    client = openai_client(plain_server)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    wrong = openai.OpenAI(base_url=plain_server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert httpx.get(plain_server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(plain_server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "blockdraft_time_to_first_token_seconds_bucket" in r.text


def test_no_api_key_needed_when_none_is_set(dflash_server):
    client = openai_client(dflash_server)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0.0)
    assert out.usage.completion_tokens <= 3 and out.choices[0].finish_reason in ("stop", "length")
