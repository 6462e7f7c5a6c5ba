"""Malformed and hostile requests: each gets a 4xx OpenAI-style JSON error with a clear message,
and the server keeps answering correctly afterwards."""

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_PROMPT = "w05x w06x w07x"
MSG = [{"role": "user", "content": "w05x"}]
IMAGE_PART = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}


def _c(**fields):
    return {"model": MODEL_NAME, "prompt": OK_PROMPT, "max_tokens": 4, **fields}


def _chat(**fields):
    return {"model": MODEL_NAME, "messages": MSG, "max_tokens": 4, **fields}


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


def _chunks(total: int):
    for _ in range(total // 65536):
        yield b" " * 65536


# (id, path, body: dict | bytes | generator factory, extra headers, expected status, words the message must contain)
CASES = [
    ("bad-json", C, b'{"prompt": "w05x",', {}, 400, "not valid JSON"),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe w05x"}', {}, 400, "UTF-8"),
    ("empty-body", C, b"", {}, 400, "empty"),
    ("json-array", C, b"[1, 2, 3]", {}, 400, "JSON object"),
    ("json-string", C, b'"hello"', {}, 400, "JSON object"),
    ("json-null", C, b"null", {}, 400, "got a JSON null"),
    ("tool-calls-malformed", CHAT, _chat(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]), {},
     400, "tool_calls[0].function must be"),
    ("nan-temperature", C, b'{"prompt": "w05x", "temperature": NaN}', {}, 400, "NaN"),
    ("lone-surrogate", C, b'{"prompt": "w05x \\ud800"}', {}, 400, "surrogate"),
    ("deep-nesting", C, b"[" * 200_000, {}, 400, "nested too deeply"),
    ("oversized-body", C, json.dumps(_c(prompt="w05x " * 300_000)).encode(), {}, 413, "--max-body-bytes"),
    ("oversized-chunked-body", C, lambda: _chunks(2 << 20), {}, 413, "larger than"),
    ("missing-prompt", C, _without(_c(), "prompt"), {}, 400, "'prompt' is required"),
    ("prompt-wrong-type", C, _c(prompt=42), {}, 400, "prompt"),
    ("prompt-empty-string", C, _c(prompt=""), {}, 400, "empty"),
    ("prompt-empty-list", C, _c(prompt=[]), {}, 400, "empty"),
    ("prompt-mixed-list", C, _c(prompt=["w05x", 5]), {}, 400, "prompt"),
    ("token-id-out-of-vocab", C, _c(prompt=[5, 1000]), {}, 400, "vocabulary"),
    ("token-id-negative", C, _c(prompt=[-1, 5]), {}, 400, "vocabulary"),
    ("prompt-too-long", C, _c(prompt=[5] * 600), {}, 400, "prompt tokens"),
    ("max-tokens-negative", C, _c(max_tokens=-5), {}, 400, "max_tokens"),
    ("max-tokens-zero", C, _c(max_tokens=0), {}, 400, "max_tokens"),
    ("max-tokens-huge", C, _c(max_tokens=10**12), {}, 400, "server limit"),
    ("max-tokens-past-context", C, _c(max_tokens=1000), {}, 400, "context"),
    ("max-tokens-string", C, _c(max_tokens="10"), {}, 400, "max_tokens"),
    ("max-tokens-float", C, _c(max_tokens=4.5), {}, 400, "max_tokens"),
    ("temperature-negative", C, _c(temperature=-0.5), {}, 400, "temperature"),
    ("temperature-bool", C, _c(temperature=True), {}, 400, "temperature"),
    ("top-p-above-1", C, _c(top_p=1.5), {}, 400, "top_p"),
    ("top-p-zero", C, _c(top_p=0), {}, 400, "top_p"),
    ("top-k-string", C, _c(top_k="5"), {}, 400, "top_k"),
    ("min-p-above-1", C, _c(min_p=1.5), {}, 400, "invalid 'min_p'"),
    ("min-p-negative-chat", CHAT, _chat(min_p=-0.1), {}, 400, "invalid 'min_p'"),
    ("min-p-string", C, _c(min_p="0.1"), {}, 400, "invalid 'min_p'"),
    ("temperature-word", C, _c(temperature="hot"), {}, 400, "invalid 'temperature': Input should be a valid number, got \"hot\""),
    ("n-zero", C, _c(n=0), {}, 400, "invalid 'n': Input should be greater than or equal to 1, got 0"),
    ("n-huge", C, _c(n=1000), {}, 400, "n must be <="),
    ("more-choices-than-max-pending", C, _c(prompt=[OK_PROMPT] * 65, n=16), {}, 400, "--max-pending"),
    ("stop-list-too-long", C, _c(stop=["a", "b", "c", "d", "e"]), {}, 400, "stop"),
    ("stop-empty-string", C, _c(stop=["a", ""]), {}, 400, "stop[1] is empty"),
    ("stop-wrong-type", C, _c(stop=7), {}, 400, "stop"),
    ("stop-string-too-long", C, _c(stop="x" * 1000), {}, 400, "stop has 1000 characters; at most 256"),
    ("stop-token-id-out-of-vocab", C, _c(stop_token_ids=[500]), {}, 400, "stop_token_ids"),
    ("seed-negative", C, _c(seed=-1), {}, 400, "seed"),
    ("seed-huge", C, _c(seed=2**70), {}, 400, "seed"),
    ("logprobs-too-many", C, _c(logprobs=100), {}, 400, "logprobs"),
    ("unknown-model", C, _c(model="gpt-4"), {}, 404, "does not exist"),
    ("unknown-field", C, _c(frobnicate=1), {}, 400, "frobnicate"),
    ("presence-penalty-out-of-range", C, _c(presence_penalty=2.5), {}, 400, "presence_penalty"),
    ("frequency-penalty-not-a-number", C, _c(frequency_penalty="1"), {}, 400, "frequency_penalty"),
    ("repetition-penalty-zero", C, _c(repetition_penalty=0), {}, 400, "repetition_penalty"),
    # beyond int64 / float32: these once stopped the engine for every client (a trial's fuzzer)
    ("top-k-int64-overflow", C, _c(top_k=2**63), {}, 400, "top_k"),
    ("top-k-int64-overflow-chat", CHAT, _chat(top_k=2**63), {}, 400, "top_k"),
    ("repetition-penalty-float32-overflow", C, _c(repetition_penalty=3.5e38), {}, 400, "repetition_penalty"),
    ("min-tokens-int64-overflow", C, _c(min_tokens=2**64), {}, 400, "min_tokens"),
    ("logit-bias-key-not-an-id", C, _c(logit_bias={"abc": 1}), {}, 400, "logit_bias keys must be token ids"),
    ("logit-bias-id-out-of-vocab", C, _c(logit_bias={"99999": 1}), {}, 400, "logit_bias keys must be token ids"),
    ("logit-bias-value-out-of-range", C, _c(logit_bias={"5": 200}), {}, 400, "logit_bias of token 5"),
    ("min-tokens-above-max-tokens", C, _c(min_tokens=9, max_tokens=4), {}, 400, "min_tokens must be <= max_tokens (4)"),
    ("min-tokens-negative", C, _c(min_tokens=-1), {}, 400, "min_tokens"),
    ("allowed-token-ids-empty", C, _c(allowed_token_ids=[]), {}, 400, "allowed_token_ids must not be empty"),
    ("allowed-token-ids-out-of-vocab", CHAT, _chat(allowed_token_ids=[5, 1000]), {}, 400,
     "allowed_token_ids has 1000, outside the vocabulary"),
    ("allowed-token-ids-negative", C, _c(allowed_token_ids=[-1]), {}, 400, "allowed_token_ids has -1"),
    ("allowed-token-ids-strings", C, _c(allowed_token_ids=["5"]), {}, 400, "allowed_token_ids"),
    ("bad-words-a-string", C, _c(bad_words="w05x"), {}, 400, "bad_words"),
    ("bad-words-empty-word", CHAT, _chat(bad_words=["w05x", " "]), {}, 400,
     "bad_words entries must be strings with a non-space character"),
    ("echo-not-bool", C, _c(echo="yes"), {}, 400, "echo"),
    ("skip-special-tokens-not-bool", C, _c(skip_special_tokens="no"), {}, 400, "invalid 'skip_special_tokens'"),
    ("spaces-between-special-tokens-int", CHAT, _chat(spaces_between_special_tokens=0), {}, 400,
     "invalid 'spaces_between_special_tokens'"),
    ("continuous-usage-stats-not-bool", C, _c(stream=True, stream_options={"continuous_usage_stats": "yes"}), {}, 400,
     "stream_options.continuous_usage_stats"),
    ("max-tokens-zero-without-echo", C, _c(max_tokens=0, echo=False), {}, 400, "0 only with echo: true"),
    ("chat-echo", CHAT, _chat(echo=True), {}, 400, "'echo' is not supported"),
    ("best-of", C, _c(best_of=3), {}, 400, "'best_of' is not supported by this server (only 1 or null is accepted), got 3"),
    ("stop-number", C, _c(stop=5), {}, 400, "invalid 'stop': stop must be a string or a list of strings, got 5"),
    ("stream-not-bool", C, _c(stream="yes"), {}, 400, "stream"),
    ("stream-options-unknown-key", C, _c(stream=True, stream_options={"foo": 1}), {}, 400, "stream_options.foo"),
    ("stream-options-without-stream", C, _c(stream_options={"include_usage": True}), {}, 400, "stream_options"),
    ("user-not-string", C, _c(user=5), {}, 400, "user"),
    ("chat-empty-messages", CHAT, _chat(messages=[]), {}, 400, "messages"),
    ("chat-messages-not-list", CHAT, _chat(messages="hello"), {}, 400, "messages"),
    ("chat-unknown-role", CHAT, _chat(messages=[{"role": "robot", "content": "w05x"}]), {}, 400, "role 'robot'"),
    ("chat-tool-message-without-id", CHAT, _chat(messages=[{"role": "tool", "content": "w05x"}]), {}, 400,
     "a tool message needs tool_call_id"),
    ("chat-content-int", CHAT, _chat(messages=[{"role": "user", "content": 5}]), {}, 400, "messages[0].content"),
    ("chat-missing-content", CHAT, _chat(messages=[{"role": "user"}]), {}, 400, "messages[0].content"),
    ("chat-image-part", CHAT, _chat(messages=[{"role": "user", "content": [IMAGE_PART]}]), {}, 400, "type 'image_url', which is not supported"),
    ("chat-message-extra-field", CHAT, _chat(messages=[{"role": "user", "content": "w05x", "speaker": "bob"}]), {}, 400, "messages[0].speaker"),
    ("chat-message-name-not-string", CHAT, _chat(messages=[{"role": "user", "content": "w05x", "name": 5}]), {}, 400, "messages[0].name"),
    ("chat-message-name-too-long", CHAT, _chat(messages=[{"role": "user", "content": "w05x", "name": "b" * 300}]), {}, 400, "messages[0].name"),
    ("chat-top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), {}, 400, "top_logprobs"),
    ("chat-both-max-tokens", CHAT, _chat(max_completion_tokens=4), {}, 400, "max_completion_tokens"),
    # tools default to tool_choice "auto", which needs the parser flags (as vLLM)
    ("chat-tools-auto-without-flags", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), {}, 400,
     "needs the server started with --enable-auto-tool-choice and --tool-call-parser"),
    ("chat-response-format-unknown-type", CHAT, _chat(response_format={"type": "xml"}), {}, 400, "response_format.type"),
    # structured outputs with a tokenizer llguidance cannot read (word-level, no decoder): refused by the engine
    ("chat-response-format-json-unreadable-tokenizer", CHAT, _chat(response_format={"type": "json_object"}), {}, 400,
     "response_format cannot use this tokenizer"),
    ("regex-unreadable-tokenizer", C, _c(structured_outputs={"regex": "w05x"}), {}, 400,
     "structured_outputs cannot use this tokenizer"),
    ("guided-json", C, _c(guided_json={"type": "object"}), {}, 400, "structured_outputs.json"),
    ("priority-nonzero", CHAT, _chat(priority=1), {}, 400, "priority scheduling is not supported by this server"),
    ("store-not-bool", CHAT, _chat(store="yes"), {}, 400, "invalid 'store': Input should be a valid boolean"),
    # a JSON body under another media type: refused as vLLM does (it would be parsed as JSON regardless)
    ("content-type-text-plain", C, json.dumps(_c()).encode(), {"Content-Type": "text/plain"}, 415,
     "must be JSON sent with 'Content-Type: application/json'; got Content-Type 'text/plain'"),
    ("content-type-form", CHAT, json.dumps(_chat()).encode(), {"Content-Type": "application/x-www-form-urlencoded"},
     415, "got Content-Type 'application/x-www-form-urlencoded'"),
    ("missing-api-key", C, _c(), {"Authorization": ""}, 401, "API key"),
    ("wrong-api-key", C, _c(), {"Authorization": "Bearer nope"}, 401, "API key"),
    ("get-on-post-route", C, None, {}, 405, "Method Not Allowed"),
    ("unknown-route", "/v1/embeddings", _c(), {}, 404, "Not Found"),
    # without the key a /v1 path says nothing about the routes (vLLM: 401 before 404 / 405)
    ("unknown-route-without-key", "/v1/embeddings", _c(), {"Authorization": ""}, 401, "API key"),
    ("get-on-post-route-without-key", C, None, {"Authorization": "Bearer nope"}, 401, "API key"),
    ("models-without-key", "/v1/models", None, {"Authorization": ""}, 401, "API key"),
]


@pytest.fixture(scope="module")
def http(plain_server):
    with httpx.Client(base_url=plain_server.url, headers=plain_server.headers(), timeout=60) as client:
        yield client


def _reference(http) -> dict:
    r = http.post(C, json=_c(max_tokens=12, temperature=0.8, seed=4))
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def _send(http, path, body, headers):
    if body is None:
        return http.get(path, headers=headers)
    if isinstance(body, dict):
        return http.post(path, json=body, headers=headers)
    content = body() if callable(body) else body
    return http.post(path, content=content, headers={"Content-Type": "application/json", **headers})


def test_at_least_30_hostile_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_every_hostile_request_gets_a_4xx_json_error_and_the_server_keeps_serving(http, plain_server):
    reference = _reference(http)
    errors_before = plain_server.metrics()
    failures = []
    for name, path, body, headers, status, words in CASES:
        r = _send(http, path, body, headers)
        try:
            err = r.json()["error"]
            ok = r.status_code == status and words in err["message"] and err["type"]
        except (ValueError, KeyError, TypeError):
            ok, err = False, r.text[:300]
        if not ok:
            failures.append(f"{name}: {r.status_code} {err}")
    assert not failures, "\n".join(failures)
    assert http.get("/health").json() == {"status": "ok"}
    assert _reference(http) == reference  # still correct, and the same as before the abuse
    after = plain_server.metrics()
    counted = sum(v - errors_before.get(k, 0.0) for k, v in after.items() if k.startswith("blockdraft_http_errors_total"))
    assert counted == len(CASES)
    assert after["blockdraft_kv_cache_free_blocks"] == after["blockdraft_kv_cache_total_blocks"]


def test_errors_name_the_field(http):
    r = http.post(C, json=_c(temperature=-1))
    assert r.json()["error"]["param"] == "temperature"
    for path, body in ((C, _c(min_p=2)), (CHAT, _chat(min_p=-1))):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text
    r = http.post(C, json=_c(stop=[""]))  # refused by SamplingParams: its parameter, no CLI flag
    assert r.json()["error"]["param"] == "stop" and "--" not in r.json()["error"]["message"]
    r = http.post(CHAT, json=_chat(messages=[{"role": "user", "content": "w05x"}, {"role": "bot", "content": "w05x"}]))
    assert r.json()["error"]["param"] == "messages[1].role"


def test_message_name_and_developer_role_are_accepted_as_in_vllm(http):
    """`messages[i].name` is accepted (the tiny template ignores it) and a developer message is
    answered as the same system message: same greedy choice, same prompt tokens."""
    system = [{"role": "system", "content": "w09x"}, {"role": "user", "content": "w05x"}]
    developer = [{"role": "developer", "content": "w09x", "name": "planner"}, {"role": "user", "content": "w05x", "name": "bob"}]
    answers = [http.post(CHAT, json=_chat(messages=m, temperature=0)) for m in (system, developer)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    a, b = (r.json() for r in answers)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


def test_neutral_values_of_unsupported_fields_are_accepted(http):
    r = http.post(C, json=_c(presence_penalty=0, frequency_penalty=0.0, echo=False, logit_bias={}, best_of=None, user="u1"))
    assert r.status_code == 200, r.text
    # vLLM's extra fields at the defaults its clients send
    vllm = dict(skip_special_tokens=True, include_stop_str_in_output=False, use_beam_search=False,
                spaces_between_special_tokens=True, priority=0, truncate_prompt_tokens=None)
    assert http.post(C, json=_c(**vllm)).status_code == 200
    r = http.post(CHAT, json=_chat(**vllm, add_generation_prompt=True, chat_template_kwargs={}, continue_final_message=False))
    assert r.status_code == 200, r.text
    # more of vLLM's at their defaults, OpenAI's fields that change no output, and nulls of any name
    extras = dict(vllm_xargs={}, mm_processor_kwargs={}, documents=[], return_token_ids=False, logits_processors=[],
                  verbosity="medium", prompt_cache_key="k", safety_identifier="s", store=True, metadata={"a": "b"},
                  chat_template=None, kv_transfer_params=None, frobnicate=None)
    for path, body in ((C, _c(**extras)), (CHAT, _chat(**extras, reasoning_effort="low"))):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
    r = http.post(C, json=_c(use_beam_search=True))
    assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]
    r = http.post(C, json=_c(echo=0))  # 0 is not the neutral `false`: types are strict
    assert r.status_code == 400


def test_a_json_body_needs_the_json_content_type(http):
    """vLLM's rule: application/json, parameters allowed; no Content-Type at all is a 415 too."""
    for path, body in ((C, _c()), (CHAT, _chat()), ("/tokenize", {"prompt": "w05x"})):
        raw = json.dumps(body).encode()
        r = http.post(path, content=raw)  # httpx sends no Content-Type for raw bytes
        assert r.status_code == 415, r.text
        assert r.json()["error"]["message"].endswith("got no Content-Type header")
        assert r.json()["error"]["type"] == "invalid_request_error"
        for media in ("application/json; charset=utf-8", "Application/JSON"):
            r = http.post(path, content=raw, headers={"Content-Type": media})
            assert r.status_code == 200, (media, r.text)


def test_request_id_names_the_response_as_in_vllm(http):
    """vLLM's request_id: the response id is cmpl-<request_id> / chatcmpl-<request_id>, streamed too;
    without it a random one; two requests may share one."""
    for path, body, prefix in ((C, _c(), "cmpl"), (CHAT, _chat(), "chatcmpl")):
        for _ in range(2):
            r = http.post(path, json={**body, "request_id": "trace-42"})
            assert r.status_code == 200 and r.json()["id"] == f"{prefix}-trace-42", r.text
        with http.stream("POST", path, json={**body, "request_id": "trace-43", "stream": True}) as s:
            ids = {json.loads(line[6:])["id"] for line in s.iter_lines() if line.startswith("data: {")}
        assert ids == {f"{prefix}-trace-43"}
        other = http.post(path, json=body).json()["id"]
        assert other.startswith(f"{prefix}-") and len(other) == len(prefix) + 1 + 32  # a hex uuid
        # vLLM's X-Request-Id header wins over the body's request_id; an empty one counts as none
        r = http.post(path, json={**body, "request_id": "body-1"}, headers={"X-Request-Id": "hdr-1"})
        assert r.status_code == 200 and r.json()["id"] == f"{prefix}-hdr-1", r.text
        r = http.post(path, json={**body, "request_id": "body-1"}, headers={"X-Request-Id": ""})
        assert r.json()["id"] == f"{prefix}-body-1"
        r = http.post(path, json=body, headers={"X-Request-Id": "x" * 257})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id", r.text


def test_min_p_is_accepted_on_both_endpoints(http):
    """vLLM's min_p extra field: [0, 1], with null, 0, an int 1 and a float accepted."""
    for value in (None, 0, 0.0, 0.25, 1, 1.0):
        assert http.post(C, json=_c(min_p=value, temperature=1.0, seed=1)).status_code == 200, value
        r = http.post(CHAT, json=_chat(min_p=value, temperature=1.0, seed=1))
        assert r.status_code == 200, (value, r.text)


def test_an_assistant_message_echoed_whole_by_a_client_is_accepted(http):
    """Clients send a conversation's earlier assistant turns back as the SDK dumped them:
    `tool_calls`, `refusal`, `function_call`, `audio`, `annotations` null or []. Same answer as without."""
    plain = [{"role": "user", "content": "w05x"}, {"role": "assistant", "content": "w06x"},
             {"role": "user", "content": "w07x"}]
    want = http.post(CHAT, json=_chat(messages=plain, temperature=0)).json()["choices"][0]["message"]["content"]
    for calls in (None, []):
        echoed = {**plain[1], "tool_calls": calls, "refusal": None, "function_call": None, "audio": None,
                  "annotations": []}
        r = http.post(CHAT, json=_chat(messages=[plain[0], echoed, plain[2]], temperature=0))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
    r = http.post(CHAT, json=_chat(messages=[{**plain[1], "refusal": "no"}]))
    assert r.status_code == 400 and "refusal is not supported" in r.text, r.text
