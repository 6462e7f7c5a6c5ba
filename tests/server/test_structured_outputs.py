"""Structured outputs over HTTP, as vLLM's server takes them: `response_format` (json_object,
json_schema) and vLLM's `structured_outputs` on /v1/completions and /v1/chat/completions; the
removed `guided_*` fields, both fields at once, or a constraint that does not compile get a 400
naming the field; streams, n > 1, logprobs and DFlash speculation work under a constraint.

In-process servers over the tiny model with the one-byte byte-level tokenizer (test_logprobs_bytes:
token i is one byte, ASCII " " to "p" among them, no braces), which llguidance reads: regexes,
choices and JSON strings or numbers can be generated, JSON objects only by the real model (SmolLM2,
marked slow). The word-level tokenizer of tests/conftest.py with a ByteLevel decoder does not do:
its unknown-word token is EOS, so llguidance's tokenization of the bytes a grammar forces ("w0")
gives EOS, and the request ends at once.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT = "hello abc"
# only characters of the one-byte tokenizer (" " to "p", uppercase included)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT: {% endif %}")
REGEX = "[a-e]{3,12}"
CHOICES = ["cab", "bad", "dead", "faced"]
ENUM_SCHEMA = {"type": "string", "enum": ["abc", "bad", "dead"]}
# the tiny drafter always proposes ">" (DRAFT_MASK_TOKEN's constant draft in this tokenizer), so
# constraints that allow it get drafts accepted and others rejected by the grammar at any position
SPEC_REGEXES = ["[0-9>]{10,30}", "[a-e>]{10,30}", "(>>|ab|c)+d"]


def _write_model(root) -> tuple:
    """The tiny model with the one-byte tokenizer (and CHAT_TEMPLATE) in root/model, its drafter in
    root/drafter."""
    from tests.server.test_logprobs_bytes import byte_level_tokenizer

    model = write_tiny_model(root / "model")
    tok = byte_level_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(model))
    return model, write_tiny_drafter(root / "drafter", model)


def _serve(llm):
    from blockdraft.server.api import build_app
    from blockdraft.server.config import ServerConfig
    from tests.server.server_process import free_port
    from tests.server.test_engine_failure import _serving

    port = free_port()
    return _serving(build_app(llm, ServerConfig(port=port, served_model_name="t", log_requests=False)), port)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"plain": url, "dflash": url}: the same model, without and with the DFlash drafter."""
    from blockdraft.llm import LLM

    model, drafter = _write_model(tmp_path_factory.mktemp("structured"))
    plain = LLM(model=str(model), kv_block_size=4, num_kv_blocks=96)
    spec = LLM(model=str(model), draft=str(drafter), kv_block_size=4, num_kv_blocks=96)
    with _serve(plain) as plain_url, _serve(spec) as spec_url:
        yield {"plain": plain_url, "dflash": spec_url}


@pytest.fixture(scope="module")
def url(servers) -> str:
    return servers["plain"]


def _body(kind: str, **kw) -> dict:
    first = {"prompt": PROMPT} if kind == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    return {"model": "t", **first, "max_tokens": 40, **kw}


def _post(url: str, kind: str, **kw) -> httpx.Response:
    return httpx.post(url + PATHS[kind], json=_body(kind, **kw), timeout=120)


def _ok(url: str, kind: str, **kw) -> dict:
    r = _post(url, kind, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def _texts(body: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"] for c in body["choices"]]


def _streamed(url: str, kind: str, **kw) -> tuple[list[str], list[str | None]]:
    """(text, finish_reason) of each choice of a streamed request."""
    n = kw.get("n", 1)
    texts, finish = [""] * n, [None] * n
    with httpx.stream("POST", url + PATHS[kind], json=_body(kind, stream=True, **kw), timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["text"] if kind == "completions" else c["delta"].get("content", "")
                finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
    return texts, finish


# ---------------------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("constraint, pattern", [
    ({"regex": REGEX}, REGEX),
    ({"choice": CHOICES}, "|".join(CHOICES)),
])
def test_every_choice_follows_the_constraint_and_stops(url, kind, constraint, pattern):
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3, "n": 3}):
        body = _ok(url, kind, structured_outputs=constraint, **kw)
        assert len(body["choices"]) == kw.get("n", 1)
        for c, text in zip(body["choices"], _texts(body)):
            assert re.fullmatch(pattern, text), text
            assert c["finish_reason"] == "stop" and c["stop_reason"] is None
    unconstrained = _texts(_ok(url, kind, temperature=0.0, ignore_eos=True))[0]
    assert not re.fullmatch(pattern, unconstrained)  # the constraint is what made them match


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_response_format_json_schema_gives_json_valid_under_the_schema(url, kind):
    fmt = {"type": "json_schema", "json_schema": {"name": "word", "schema": ENUM_SCHEMA, "strict": True}}
    body = _ok(url, kind, response_format=fmt, temperature=1.0, seed=5, n=4)
    for c, text in zip(body["choices"], _texts(body)):
        assert json.loads(text) in ENUM_SCHEMA["enum"] and c["finish_reason"] == "stop"
    number = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "maximum": 9999}}}
    text = _texts(_ok(url, kind, response_format=number, temperature=0.0))[0]
    assert isinstance(json.loads(text), int) and json.loads(text) <= 9999


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_stream_under_a_constraint_equals_the_whole_answer(url, kind):
    kw = dict(structured_outputs={"regex": REGEX}, temperature=1.0, seed=7, n=2)
    texts, finish = _streamed(url, kind, **kw)
    assert texts == _texts(_ok(url, kind, **kw))
    assert all(re.fullmatch(REGEX, t) for t in texts) and finish == ["stop", "stop"]
    texts, finish = _streamed(url, kind, structured_outputs={"choice": CHOICES}, temperature=0.0)
    assert texts[0] in CHOICES and finish == ["stop"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_logprobs_of_tokens_the_grammar_masks_are_finite(url, kind):
    """A masked token's log-probability is -inf, which JSON cannot carry: answers give -9999.0, as
    vLLM (without the floor the whole answer failed with a 500)."""
    lp = {"logprobs": 5} if kind == "completions" else {"logprobs": True, "top_logprobs": 5}
    body = _ok(url, kind, structured_outputs={"choice": ["bad"]}, temperature=0.0, **lp)
    assert _texts(body) == ["bad"]
    logprobs = body["choices"][0]["logprobs"]
    if kind == "completions":
        values = [v for top in logprobs["top_logprobs"] for v in top.values()] + logprobs["token_logprobs"]
    else:
        values = [t["logprob"] for e in logprobs["content"] for t in [e, *e["top_logprobs"]]]
    assert -9999.0 in values and all(-9999.0 <= v <= 0.0 for v in values)
    streamed = httpx.post(url + PATHS[kind], json=_body(kind, structured_outputs={"choice": ["bad"]}, stream=True, **lp),
                          timeout=120).text
    assert "Infinity" not in streamed and "-9999.0" in streamed


def test_dflash_outputs_under_a_constraint_equal_plain_decoding(servers):
    """Grammar masks on the verify rows keep speculation lossless: the drafter's ">" drafts are
    accepted where the grammar and the target allow them, rejected elsewhere."""
    requests = [("completions", dict(structured_outputs={"regex": SPEC_REGEXES[0]}, temperature=0.0)),
                ("completions", dict(structured_outputs={"regex": SPEC_REGEXES[1]}, temperature=1.0, seed=1, n=2)),
                ("chat", dict(structured_outputs={"regex": SPEC_REGEXES[2]}, temperature=1.0, seed=1)),
                ("chat", dict(structured_outputs={"choice": CHOICES}, temperature=1.0, seed=2, n=3)),
                ("completions", dict(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": ENUM_SCHEMA}},
                                     temperature=0.8, seed=4))]
    accepted = drafted = 0
    for kind, kw in requests:
        ref, out = _ok(servers["plain"], kind, **kw), _ok(servers["dflash"], kind, **kw)
        assert _texts(out) == _texts(ref), (kind, kw)
        assert [c["finish_reason"] for c in out["choices"]] == [c["finish_reason"] for c in ref["choices"]]
        assert ref["spec_decode_stats"]["num_drafts"] == 0
        accepted += out["spec_decode_stats"]["num_accepted_tokens"]
        drafted += out["spec_decode_stats"]["num_draft_tokens"]
    assert 0 < accepted < drafted
    texts, _ = _streamed(servers["dflash"], "completions", structured_outputs={"regex": SPEC_REGEXES[0]}, temperature=0.0)
    assert texts == _texts(_ok(servers["plain"], "completions", structured_outputs={"regex": SPEC_REGEXES[0]},
                               temperature=0.0))


# ----------------------------------------------------------------------------- the OpenAI client


def test_openai_client_response_format_and_extra_body(url):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": PROMPT}]
    fmt = {"type": "json_schema", "json_schema": {"name": "word", "schema": ENUM_SCHEMA, "strict": True}}
    resp = client.chat.completions.create(model="t", messages=messages, response_format=fmt, max_tokens=20)
    assert json.loads(resp.choices[0].message.content) in ENUM_SCHEMA["enum"]
    resp = client.chat.completions.create(model="t", messages=messages, max_tokens=20, n=2, seed=1,
                                          extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.message.content in CHOICES and c.finish_reason == "stop" for c in resp.choices)
    resp = client.completions.create(model="t", prompt=PROMPT, max_tokens=20,
                                     extra_body={"structured_outputs": {"choice": CHOICES}})
    assert resp.choices[0].text in CHOICES
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="t", messages=messages, max_tokens=20,
                                       extra_body={"structured_outputs": {"regex": "(ab"}})
    assert e.value.body["param"] == "structured_outputs.regex"


# ------------------------------------------------------------------------------------ refusals

SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}

# (id, extra request fields, param, words the message must contain)
BAD = [
    ("bad-regex", dict(structured_outputs={"regex": "(ab"}), "structured_outputs.regex",
     ["structured_outputs.regex is invalid", "unclosed group"]),
    ("bad-json-schema", dict(structured_outputs={"json": {"type": "foo"}}), "structured_outputs.json",
     ["structured_outputs.json is invalid", "foo"]),
    ("bad-grammar", dict(structured_outputs={"grammar": "root ::= missing"}), "structured_outputs.grammar",
     ["structured_outputs.grammar", "missing"]),
    ("json-text-not-json", dict(structured_outputs={"json": "{oops"}), "structured_outputs.json", ["not valid JSON"]),
    ("empty-choice", dict(structured_outputs={"choice": []}), "structured_outputs.choice", ["non-empty list"]),
    ("no-constraint", dict(structured_outputs={}), "structured_outputs", ["exactly one of", "got none"]),
    ("two-constraints", dict(structured_outputs={"regex": "a+", "choice": ["b"]}), "structured_outputs",
     ["exactly one of", "'regex', 'choice'"]),
    ("structured-outputs-unknown-key", dict(structured_outputs={"regexp": "a+"}), "structured_outputs.regexp",
     ["unknown"]),
    ("structured-outputs-not-object", dict(structured_outputs="a+"), "structured_outputs", ['{"regex": "[0-9]+"}']),
    ("bad-response-format-schema", dict(response_format={**SCHEMA_FORMAT, "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format", ["response_format.json_schema.schema is invalid", "foo"]),
    ("response-format-type", dict(response_format={"type": "xml"}), "response_format.type",
     ["'text', 'json_object' or 'json_schema'"]),
    ("response-format-not-object", dict(response_format="json"), "response_format", ['{"type": "json_object"}']),
    ("json-schema-missing", dict(response_format={"type": "json_schema"}), "response_format",
     ['needs a "json_schema" object']),
    ("json-schema-with-json-object", dict(response_format={"type": "json_object", "json_schema": SCHEMA_FORMAT["json_schema"]}),
     "response_format", ['goes only with type "json_schema"']),
    ("schema-missing", dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", ["required"]),
    ("schema-not-object", dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
     "response_format.json_schema.schema", ["must be a JSON Schema", "an array"]),
    ("both-fields", dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a+"}),
     "structured_outputs", ["not both", "drop response_format"]),
    ("guided-json", dict(guided_json={"type": "object"}), "guided_json", ["removed in vLLM 0.12", "structured_outputs.json"]),
    ("guided-regex", dict(guided_regex="a+"), "guided_regex", ["structured_outputs.regex"]),
    ("guided-choice", dict(guided_choice=["a"]), "guided_choice", ["structured_outputs.choice"]),
    ("guided-grammar", dict(guided_grammar="start: /a/"), "guided_grammar", ["structured_outputs.grammar"]),
    ("guided-backend", dict(guided_decoding_backend="xgrammar"), "guided_decoding_backend", ["drop the field"]),
]


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_bad_constraint_gets_a_400_naming_its_field(url, kind, case):
    _, extra, param, words = case
    r = _post(url, kind, **extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for w in words:
        assert w in error["message"], (w, error["message"])


def test_the_server_keeps_serving_after_refused_constraints(url):
    for extra in ({"structured_outputs": {"regex": "(ab"}}, {"guided_json": {}}, {"response_format": {"type": "x"}}):
        assert _post(url, "chat", **extra).status_code == 400
    assert re.fullmatch(REGEX, _texts(_ok(url, "chat", structured_outputs={"regex": REGEX}))[0])
    assert _texts(_ok(url, "completions", max_tokens=4, temperature=0.0, ignore_eos=True))[0]  # unconstrained too
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_constraints_compile_off_the_engine_thread(url, monkeypatch):
    """The server compiles a new constraint in a worker thread before queueing the request, so
    the engine thread, which steps every other request, only copies the compiled state."""
    import threading

    from blockdraft.structured.grammar import GrammarCompiler

    threads, compile_source = [], GrammarCompiler._checked_source
    monkeypatch.setattr(GrammarCompiler, "_checked_source",
                        lambda self, p: threads.append(threading.current_thread().name) or compile_source(self, p))
    body = _ok(url, "completions", structured_outputs={"regex": "[a-c]{2}d{1,3}"})
    assert re.fullmatch("[a-c]{2}d{1,3}", _texts(body)[0])
    assert threads and "blockdraft-engine" not in threads


def test_text_format_and_null_fields_are_unconstrained(url):
    kw = dict(temperature=0.0, ignore_eos=True, max_tokens=12)
    ref = _texts(_ok(url, "completions", **kw))
    for extra in ({"response_format": {"type": "text"}}, {"response_format": None, "structured_outputs": None},
                  {"guided_json": None, "guided_decoding_backend": None}):
        assert _texts(_ok(url, "completions", **kw, **extra)) == ref, extra
    # a text response_format goes with structured_outputs (it asks for no constraint)
    out = _texts(_ok(url, "chat", response_format={"type": "text"}, structured_outputs={"regex": REGEX}))
    assert re.fullmatch(REGEX, out[0])


# ------------------------------------------------------------------- request -> StructuredOutputsParams


def _constraint(fields: dict, kind: str = "chat"):
    from blockdraft.server.params import structured_outputs
    from blockdraft.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request

    cls, first = ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}) if kind == "chat"
                  else (CompletionRequest, {"prompt": "x"}))
    return structured_outputs(parse_request(cls, {**first, **fields}))


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_request_fields_become_structured_outputs_params(kind):
    from blockdraft import StructuredOutputsParams as S

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    assert _constraint({"response_format": {"type": "json_object"}}, kind) == (S(json_object=True), "response_format")
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True, "description": "d"}}
    assert _constraint({"response_format": fmt}, kind) == (S(json=schema), "response_format")
    assert _constraint({"response_format": {"type": "text"}}, kind) == (None, None)
    assert _constraint({}, kind) == (None, None)
    so = {"json": json.dumps(schema), "disable_any_whitespace": True, "disable_additional_properties": True,
          "whitespace_pattern": " ?"}
    assert _constraint({"structured_outputs": so}, kind) == (
        S(json=json.dumps(schema), disable_any_whitespace=True, disable_additional_properties=True, whitespace_pattern=" ?"),
        "structured_outputs")
    for field, value in (("regex", "a+"), ("choice", ["a", "b"]), ("grammar", "start: /a+/"), ("json_object", True),
                         ("structural_tag", {"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]})):
        assert _constraint({"structured_outputs": {field: value, "disable_any_whitespace": None}}, kind) == (
            S(**{field: value}), "structured_outputs")
    assert _constraint({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "text"}}, kind)[0] == S(regex="a+")
    assert _constraint({"structured_outputs": {"regex": "a+", "disable_fallback": True}}, kind)[0] == S(
        regex="a+", disable_fallback=True)  # vLLM's field, taken (one backend: nothing falls back)


def test_each_choice_gets_the_constraint():
    from blockdraft import StructuredOutputsParams as S
    from blockdraft.server.config import ModelInfo, ServerConfig
    from blockdraft.server.params import build_plan
    from blockdraft.server.protocol import CompletionRequest, parse_request

    req = parse_request(CompletionRequest, {"prompt": ["a", "b"], "n": 3, "structured_outputs": {"choice": ["x", "y"]}})
    model = ModelInfo(name="t", vocab_size=96, max_model_len=512, kv_capacity_tokens=512, num_speculative_tokens=0,
                      created=0, max_logprobs=20)
    plan = build_plan(req, [[5], [6]], ServerConfig(), model)
    assert len(plan.params) == 6 and all(p.structured_outputs == S(choice=["x", "y"]) for p in plan.params)
    assert plan.constraint_field == "structured_outputs"


def test_an_engine_refusal_names_the_field_the_request_used():
    from blockdraft.errors import param_error
    from blockdraft.server.params import Plan, engine_refusal

    plan = Plan([], [], 0, constraint_field="response_format")
    e = engine_refusal(param_error("json", "structured_outputs.json is invalid: Invalid type: foo"), plan)
    assert (e.status, e.param, e.message) == (400, "response_format",
                                             "response_format.json_schema.schema is invalid: Invalid type: foo")
    tokenizer = param_error("structured_outputs", "structured_outputs cannot use this tokenizer (T): no decoder")
    assert engine_refusal(tokenizer, plan).message == "response_format cannot use this tokenizer (T): no decoder"
    plan.constraint_field = "structured_outputs"
    assert engine_refusal(tokenizer, plan).param == "structured_outputs"
    missing = engine_refusal(ImportError("structured outputs need the llguidance package: pip install llguidance"), plan)
    assert (missing.status, missing.param) == (400, "structured_outputs")
    assert engine_refusal(param_error("n", "n must be 1"), plan).param == "n"  # not a constraint error


# ------------------------------------------------------------------------------- a real model


@pytest.mark.slow
def test_smollm2_json_schema_answer_is_valid_json_under_the_schema():
    """SmolLM2-135M (catalog, fp32 on the CPU) through the OpenAI client's `parse`, which sends a
    pydantic model as response_format json_schema (strict, additionalProperties false) and
    validates the answer; plus a plain request with the schema."""
    import openai
    from pydantic import BaseModel

    from blockdraft.llm import LLM

    class Answer(BaseModel):
        answer: int

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "How many legs does a spider have? Answer in JSON."}]
    with _serve(LLM(model="smollm2-135m-instruct", num_kv_blocks=64)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for temperature in (0.0, 1.0):
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
            resp = client.chat.completions.create(model="t", messages=messages, max_tokens=40, temperature=temperature,
                                                  seed=0, response_format=fmt)
            assert resp.choices[0].finish_reason == "stop"
            value = json.loads(resp.choices[0].message.content)
            assert set(value) == {"answer"} and isinstance(value["answer"], int)
        parsed = client.chat.completions.parse(model="t", messages=messages, max_tokens=40, temperature=0.0,
                                               response_format=Answer)
        assert isinstance(parsed.choices[0].message.parsed, Answer)
        body = httpx.post(url + "/v1/completions", json={"model": "t", "prompt": "A JSON object: ", "max_tokens": 40,
                                                         "temperature": 0.0, "response_format": {"type": "json_object"}},
                          timeout=300).json()
        assert body["choices"][0]["finish_reason"] == "stop", body
        assert isinstance(json.loads(body["choices"][0]["text"]), dict)


def _slow_compile_engine(monkeypatch, max_pending: int):
    """An AsyncEngine over the tiny ASCII model whose constraints take 0.3 s to compile."""
    import dataclasses
    import time

    from blockdraft.server.async_engine import AsyncEngine
    from tests.conftest import make_ascii_tokenizer, make_llm, tiny_target

    llm = make_llm(dataclasses.replace(tiny_target("llama"), tokenizer=make_ascii_tokenizer()))
    compile_ = llm.engine.prepare_structured_outputs
    monkeypatch.setattr(llm.engine, "prepare_structured_outputs", lambda p: (time.sleep(0.3), compile_(p)))
    return AsyncEngine(llm.engine, max_pending=max_pending)


def test_max_pending_holds_for_requests_that_compile_a_constraint(monkeypatch):
    """The checks come after the compile (nothing awaits between them and queueing), so three
    constrained requests submitted at once to a server admitting two: two in, one ServerBusyError."""
    import asyncio
    import time

    from blockdraft.sampling_params import SamplingParams, StructuredOutputsParams
    from blockdraft.server.async_engine import ServerBusyError

    engine = _slow_compile_engine(monkeypatch, max_pending=2)
    params = [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-c]+"))]

    async def run():
        engine.start()
        try:
            results = await asyncio.gather(*(engine.submit([[5, 6]], params, time.time()) for _ in range(3)),
                                           return_exceptions=True)
            for r in results:
                if not isinstance(r, BaseException):
                    await r.results()
            return results
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    assert sum(isinstance(r, ServerBusyError) for r in results) == 1 and len(results) == 3


def test_a_shutdown_during_the_compile_refuses_the_request(monkeypatch):
    import asyncio
    import time

    from blockdraft.sampling_params import SamplingParams, StructuredOutputsParams
    from blockdraft.server.async_engine import EngineDeadError

    engine = _slow_compile_engine(monkeypatch, max_pending=8)
    params = [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-c]+"))]

    async def run():
        engine.start()
        try:
            pending = asyncio.ensure_future(engine.submit([[5, 6]], params, time.time()))
            await asyncio.sleep(0.1)
            engine.fail_open("the server is shutting down")
            with pytest.raises(EngineDeadError, match="shutting down"):
                await asyncio.wait_for(pending, 10)
        finally:
            await engine.shutdown()

    asyncio.run(run())
