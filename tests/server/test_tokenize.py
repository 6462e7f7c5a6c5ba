"""vLLM's POST /tokenize, POST /detokenize and GET /version: the counts are the ones the
completions and chat endpoints report, and text round-trips."""

import httpx

from tests.server.conftest import MODEL_NAME, openai_client
from tests.server.tiny_model import word

TEXT = " ".join(word(i) for i in (5, 17, 60))
MESSAGES = [{"role": "system", "content": word(3)}, {"role": "user", "content": TEXT}]


def test_tokenize_counts_what_completions_and_chat_count_and_detokenize_returns_the_text(plain_server):
    client = openai_client(plain_server)
    r = httpx.post(plain_server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": TEXT}).json()
    done = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=1)
    assert r["count"] == len(r["tokens"]) == done.usage.prompt_tokens and r["max_model_len"] > r["count"]
    back = httpx.post(plain_server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": TEXT}
    chat = httpx.post(plain_server.url + "/tokenize", json={"messages": MESSAGES}).json()
    answered = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == answered.usage.prompt_tokens
    bare = httpx.post(plain_server.url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]
    assert httpx.get(plain_server.url + "/version").json()["version"]
    assert httpx.get(plain_server.url + "/ping").json() == {"status": "ok"}
    assert httpx.post(plain_server.url + "/ping").json() == {"status": "ok"}  # vLLM takes POST too
    strs = httpx.post(plain_server.url + "/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert strs["token_strs"] == TEXT.split() and strs["tokens"] == r["tokens"]


def test_tokenize_takes_the_chat_template_controls(plain_server):
    """continue_final_message and chat_template_kwargs as chat completions takes them: the same count."""
    client = openai_client(plain_server)
    conv = [*MESSAGES, {"role": "assistant", "content": word(9)}]
    controls = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    r = httpx.post(plain_server.url + "/tokenize", json={"messages": conv, **controls})
    assert r.status_code == 200, r.text
    answered = client.chat.completions.create(model=MODEL_NAME, messages=conv, max_tokens=1, extra_body=controls)
    assert r.json()["count"] == answered.usage.prompt_tokens
    bad = httpx.post(plain_server.url + "/tokenize", json={"messages": MESSAGES, "continue_final_message": True})
    assert bad.status_code == 400 and "continue_final_message" in bad.text


def test_bad_tokenize_requests_name_the_problem(plain_server):
    url = plain_server.url
    for path, body, status, words in [
        ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, 400, "exactly one of 'prompt'"),
        ("/tokenize", {}, 400, "exactly one of 'prompt'"),
        ("/tokenize", {"prompt": TEXT, "model": "gpt-4"}, 404, "gpt-4"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens has token id 1000000, outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], (path, body, r.text)
