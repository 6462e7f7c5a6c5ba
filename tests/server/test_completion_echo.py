"""/v1/completions `echo` (as vLLM, what lm-evaluation-harness's loglikelihood requests send): the
text is prompt + completion; with `logprobs` the prompt tokens' entries come first (the first
token's null), their log-probabilities the engine's prompt_logprobs; `max_tokens: 0` returns only
the prompt, scored; text and token-id prompts, streaming, plain and DFlash servers."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME
from tests.server.tiny_model import word

C = "/v1/completions"
CONTEXT = [word(i) for i in (12, 40, 7, 33, 5, 61, 19)]
CONTINUATION = [word(i) for i in (45, 45, 8)]
PROMPT_IDS = [int(w[1:3]) for w in CONTEXT + CONTINUATION]  # word i is token i
PROMPT = " ".join(CONTEXT + CONTINUATION)
# lm-eval's local-completions loglikelihood body (max_tokens 1; some versions send 0)
LM_EVAL = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
           "seed": 1234}


@pytest.fixture(scope="module")
def engine_prompt_logprobs(tiny_model_dirs) -> list:
    """RequestOutput.prompt_logprobs of PROMPT_IDS from an in-process engine on the served model."""
    llm = LLM(model=str(tiny_model_dirs[0]), num_kv_blocks=64, kv_block_size=4)
    return llm.generate([PROMPT_IDS], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs


def _post(server, **over) -> dict:
    r = httpx.post(server.url + C, json={**LM_EVAL, **over}, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _check_prompt_part(lp: dict, engine_entries: list, num_prompt: int, num_top: int = 1) -> None:
    """The first num_prompt entries: the prompt's tokens, null first, then the engine's values
    (`engine_entries` has the top-1; the answer asked for `num_top`)."""
    assert lp["tokens"][:num_prompt] == CONTEXT + CONTINUATION
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:num_prompt] == pytest.approx([e["logprob"] for e in engine_entries[1:]], abs=1e-4)
    for token, value, top, e in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:],
                                    engine_entries[1:]):  # fmt: skip
        assert top[token] == value  # the prompt token is always in its dict, as vLLM's
        best_id, best_lp = e["top"][0]
        assert top[word(best_id)] == pytest.approx(best_lp, abs=1e-4) and len(top) <= num_top + 1
    # offsets index the echoed text: token k > 0 adds " word", so it starts at 5k - 1 (TextOffsets)
    assert lp["text_offset"][:num_prompt] == [0] + [5 * k - 1 for k in range(1, num_prompt)]


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT_IDS], ids=["text", "token-ids"])
def test_lm_eval_loglikelihood_request(plain_server, engine_prompt_logprobs, prompt):
    body = _post(plain_server, prompt=prompt)
    choice, n = body["choices"][0], len(PROMPT_IDS)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 1
    _check_prompt_part(lp, engine_prompt_logprobs, n)
    completion = choice["text"][len(PROMPT):]
    assert choice["text"].startswith(PROMPT) and lp["tokens"][n] == completion  # one generated word
    assert lp["text_offset"][n] == len(PROMPT)  # the completion's offsets follow the prompt text
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}
    # what lm-eval computes: the continuation's summed log-probability and whether it is greedy
    ctxlen = len(CONTEXT)
    total = sum(lp["token_logprobs"][ctxlen:-1])
    assert total == pytest.approx(sum(e["logprob"] for e in engine_prompt_logprobs[ctxlen:]), abs=1e-4)
    greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))
    assert greedy == all(e["top"][0][0] == e["token_id"] for e in engine_prompt_logprobs[ctxlen:])


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT_IDS], ids=["text", "token-ids"])
def test_max_tokens_zero_returns_only_the_prompt_scored(plain_server, engine_prompt_logprobs, prompt):
    body = _post(plain_server, prompt=prompt, max_tokens=0, logprobs=0)
    choice, n = body["choices"][0], len(PROMPT_IDS)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][1:] == pytest.approx([e["logprob"] for e in engine_prompt_logprobs[1:]], abs=1e-4)
    assert [len(t) for t in lp["top_logprobs"][1:]] == [1] * (n - 1)  # logprobs 0: just the prompt token
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}


def test_echo_without_logprobs_and_several_prompts(plain_server):
    plain = _post(plain_server, prompt=[PROMPT_IDS[:4], PROMPT_IDS], logprobs=None, echo=False, max_tokens=5)
    echoed = _post(plain_server, prompt=[PROMPT_IDS[:4], PROMPT_IDS], logprobs=None, max_tokens=5)
    for i, prompt in enumerate((" ".join(CONTEXT[:4]), PROMPT)):
        assert echoed["choices"][i]["text"] == prompt + plain["choices"][i]["text"]
        assert echoed["choices"][i]["logprobs"] is None
    assert echoed["usage"] == plain["usage"]


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_echoed_special_tokens_keep_their_text_and_offsets(plain_server, as_ids):
    """A special token in the prompt (<eos>, id 0) is echoed with its text, a text prompt as given
    and a token-id prompt decoded with it (vLLM: tokenizer.decode's default), and the prompt
    tokens' text_offset slice the echoed text token by token."""
    ids = [12, 0, 40, 7]
    text = f"{word(12)} <eos> {word(40)} {word(7)}"  # the tiny tokenizer's decode of `ids`, specials kept
    body = _post(plain_server, prompt=ids if as_ids else text, max_tokens=2, logprobs=0)
    choice = body["choices"][0]
    echoed = choice["text"][: len(text)]
    assert echoed == text, choice["text"]
    offsets = choice["logprobs"]["text_offset"][: len(ids)]
    pieces = [echoed[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])]
    assert [piece.strip() for piece in pieces] == [word(12), "<eos>", word(40), word(7)], (offsets, pieces)


def _stream(server, **over) -> tuple[list[dict], dict]:
    """(the choice of every chunk, the usage chunk)."""
    body = {**LM_EVAL, **over, "stream": True, "stream_options": {"include_usage": True}}
    choices, usage = [], None
    with httpx.stream("POST", server.url + C, json=body, headers=server.headers(), timeout=120) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                choices += chunk["choices"]
                usage = chunk.get("usage") or usage
    return choices, usage


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_streaming_sends_the_prompt_first_and_equals_the_whole_answer(plain_server, engine_prompt_logprobs, max_tokens):
    whole = _post(plain_server, max_tokens=max_tokens, logprobs=2)["choices"][0]
    choices, usage = _stream(plain_server, max_tokens=max_tokens, logprobs=2)
    first = choices[0]
    assert first["text"].startswith(PROMPT) and first["logprobs"]["tokens"][: len(PROMPT_IDS)] == CONTEXT + CONTINUATION
    _check_prompt_part(first["logprobs"], engine_prompt_logprobs, len(PROMPT_IDS), num_top=2)
    assert "".join(c["text"] for c in choices) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in choices if c["logprobs"] for v in c["logprobs"][key]] == whole["logprobs"][key], key
    assert choices[-1]["finish_reason"] == whole["finish_reason"]
    assert usage["completion_tokens"] == max_tokens
    if max_tokens == 0:
        assert len(choices) == 1 and first["text"] == PROMPT and first["finish_reason"] == "length"


def test_dflash_server_gives_the_plain_servers_answer(plain_server, dflash_server):
    """The drafter changes neither the prompt's log-probabilities nor the greedy completion."""
    plain = _post(plain_server, max_tokens=12, logprobs=3, ignore_eos=True)["choices"][0]
    spec = _post(dflash_server, max_tokens=12, logprobs=3, ignore_eos=True)["choices"][0]
    assert spec["text"] == plain["text"] and spec["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
    assert spec["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert spec["logprobs"]["token_logprobs"][1:] == pytest.approx(plain["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert [None if t is None else sorted(t) for t in spec["logprobs"]["top_logprobs"]] == \
        [None if t is None else sorted(t) for t in plain["logprobs"]["top_logprobs"]]


@pytest.mark.parametrize("path, over, param, words", [
    (C, {"echo": False, "max_tokens": 0}, "max_tokens", "0 only with echo: true"),
    (C, {"max_tokens": -1}, "max_tokens", "max_tokens must be >= 1"),
    (C, {"echo": "yes"}, "echo", "echo"),
    (C, {"logprobs": 21}, "logprobs", "logprobs must be <= 20"),
    (C, {"prompt": [5] * 512, "max_tokens": 0}, "prompt", "prompt tokens"),  # no room for the token generated
    ("/v1/chat/completions", {"echo": True}, "echo", "'echo' is not supported"),
])
def test_bad_combinations_are_refused_naming_the_field(plain_server, path, over, param, words):
    body = {**LM_EVAL, **over}
    if path != C:
        body = {k: v for k, v in body.items() if k not in ("prompt", "logprobs")} | {
            "messages": [{"role": "user", "content": word(5)}]}
    r = httpx.post(plain_server.url + path, json=body, headers=plain_server.headers(), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_logprobs_are_finite_and_the_answer_is_json(plain_server):
    lp = _post(plain_server, logprobs=5)["choices"][0]["logprobs"]
    assert all(math.isfinite(v) for v in lp["token_logprobs"][1:])


def test_min_tokens_with_echo_and_max_tokens_zero_names_the_value_sent():
    """echo with max_tokens 0 runs one hidden token internally; a min_tokens above 0 must be refused
    naming the max_tokens the client sent (0), not the internal 1."""
    from blockdraft.server.config import ModelInfo, ServerConfig
    from blockdraft.server.errors import APIError
    from blockdraft.server.params import build_plan
    from blockdraft.server.protocol import CompletionRequest

    model = ModelInfo(name="t", vocab_size=100, max_model_len=64, kv_capacity_tokens=1024, num_speculative_tokens=0,
                      created=0, max_logprobs=20)
    for min_tokens in (1, 3):
        req = CompletionRequest(prompt=[1, 2], echo=True, max_tokens=0, min_tokens=min_tokens)
        with pytest.raises(APIError, match=rf"min_tokens must be 0 with max_tokens 0 .*got {min_tokens}") as e:
            build_plan(req, [[1, 2]], ServerConfig(), model)
        assert e.value.status == 400 and e.value.param == "min_tokens"
