"""DFlash on == plain decoding over HTTP, and /metrics spec counters == per-response stats summed."""

import concurrent.futures

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, openai_client
from tests.server.tiny_model import word

PROMPTS = [" ".join(word(i) for i in range(s, s + 6)) for s in (3, 20, 41, 70)]
CHAT = [{"role": "user", "content": f"{word(30)} {word(31)} {word(2)}"}]

REQUESTS = [
    ("completions", dict(prompt=PROMPTS[0], max_tokens=48, temperature=0.0, extra_body={"ignore_eos": True})),
    ("completions", dict(prompt=PROMPTS[1:], max_tokens=40, temperature=0.8, top_k=20, seed=5, n=2)),
    ("completions", dict(prompt=PROMPTS[3], max_tokens=40, temperature=0.6, top_p=0.9, seed=9, logprobs=1)),
    ("chat", dict(messages=CHAT, max_tokens=48, temperature=0.0)),
    ("chat", dict(messages=CHAT, max_tokens=40, temperature=1.0, seed=2, n=3, extra_body={"ignore_eos": True})),
    ("completions", dict(prompt=PROMPTS[2], max_tokens=40, temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5,
                         extra_body={"ignore_eos": True, "repetition_penalty": 1.3})),
    ("chat", dict(messages=CHAT, max_tokens=40, temperature=0.7, seed=4, frequency_penalty=1.5)),
    ("completions", dict(prompt=PROMPTS[0], max_tokens=24, temperature=0.0, logit_bias={"45": -100, "9": 3.0},
                         extra_body={"ignore_eos": True})),
    ("chat", dict(messages=CHAT, max_tokens=30, temperature=0.0, extra_body={"min_tokens": 6, "stop_token_ids": [89]})),
    ("completions", dict(prompt=PROMPTS[1], max_tokens=40, temperature=1.3, seed=6,
                         extra_body={"ignore_eos": True, "min_p": 0.2})),
    ("chat", dict(messages=CHAT, max_tokens=40, temperature=1.0, top_p=0.9, seed=8, n=2,
                  extra_body={"ignore_eos": True, "min_p": 0.1, "top_k": 30})),
]
MIN_P_REQUEST = 9  # REQUESTS[9]: the completions request with min_p
SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _create(client, kind, kw, stream=False):
    kw = dict(kw)
    if "top_k" in kw:
        kw.setdefault("extra_body", {})["top_k"] = kw.pop("top_k")
    api = client.completions if kind == "completions" else client.chat.completions
    return api.create(model=MODEL_NAME, stream=stream, **kw)


def _texts(resp) -> list[str]:
    return [c.text if hasattr(c, "text") else c.message.content for c in resp.choices]


def _streamed(client, kind, kw):
    """(texts, spec stats of each finishing chunk, the usage chunk's stats and usage)."""
    n = len(kw["prompt"]) * kw.get("n", 1) if isinstance(kw.get("prompt"), list) else kw.get("n", 1)
    texts, per_choice, tail = [""] * n, [], None
    for chunk in _create(client, kind, dict(kw, stream_options={"include_usage": True}), stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text if kind == "completions" else (c.delta.content or "")
            if c.finish_reason:
                per_choice.append(chunk.model_extra["spec_decode_stats"])
        if chunk.usage is not None:
            tail = (chunk.model_extra["spec_decode_stats"], chunk.usage)
    return texts, per_choice, tail


def _add(total: dict, stats: dict) -> None:
    for k in SPEC_KEYS:
        total[k] += stats[k]
    for i, c in enumerate(stats["accepted_per_position"]):
        total["pos"][i] = total["pos"].get(i, 0) + c
    for i, c in enumerate(stats["drafted_per_position"]):
        total["drafted_pos"][i] = total["drafted_pos"].get(i, 0) + c


def test_dflash_outputs_equal_plain_and_metrics_equal_summed_response_stats(plain_server, dflash_server):
    plain, spec = openai_client(plain_server), openai_client(dflash_server)
    before = dflash_server.metrics()
    total = {k: 0 for k in SPEC_KEYS} | {"pos": {}, "drafted_pos": {}}
    for kind, kw in REQUESTS:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both servers work at once
            ref, out = pool.map(lambda c: _create(c, kind, kw), (plain, spec))
        assert _texts(out) == _texts(ref), (kind, kw)
        assert [c.finish_reason for c in out.choices] == [c.finish_reason for c in ref.choices]
        assert out.usage == ref.usage
        assert ref.model_extra["spec_decode_stats"]["num_drafts"] == 0
        _add(total, out.model_extra["spec_decode_stats"])

        texts, per_choice, (tail_stats, usage) = _streamed(spec, kind, kw)
        assert texts == _texts(ref) and usage == ref.usage
        summed = {k: 0 for k in SPEC_KEYS} | {"pos": {}, "drafted_pos": {}}
        for s in per_choice:
            _add(summed, s)
        assert all(summed[k] == tail_stats[k] for k in SPEC_KEYS)
        assert [summed["drafted_pos"].get(i, 0) for i in range(len(tail_stats["drafted_per_position"]))] == \
            tail_stats["drafted_per_position"]
        _add(total, tail_stats)

    after = dflash_server.metrics()

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("blockdraft_spec_decode_num_drafts_total") == total["num_drafts"]
    assert delta("blockdraft_spec_decode_num_draft_tokens_total") == total["num_draft_tokens"]
    assert delta("blockdraft_spec_decode_num_accepted_tokens_total") == total["num_accepted_tokens"]
    for i, count in total["pos"].items():
        assert delta(f'blockdraft_spec_decode_num_accepted_tokens_per_pos_total{{position="{i + 1}"}}') == count
    for i, count in total["drafted_pos"].items():  # the denominators of the per-position rates
        assert delta(f'blockdraft_spec_decode_num_drafts_per_pos_total{{position="{i + 1}"}}') == count
    assert sum(total["drafted_pos"].values()) == total["num_draft_tokens"]
    assert total["drafted_pos"][0] == total["num_drafts"]  # every verify step drafts position 1
    assert total["num_draft_tokens"] > 0
    assert total["num_accepted_tokens"] > 0, "the tiny drafter no longer gets drafts accepted (see DRAFT_MASK_TOKEN)"
    assert sum(1 for c in total["pos"].values() if c) >= 2  # accepted at more than one position


def test_penalties_change_the_answer(plain_server):
    """The penalised requests above are not the unpenalised ones in disguise."""
    client = openai_client(plain_server)
    kw = dict(prompt=PROMPTS[2], max_tokens=40, temperature=0.0, extra_body={"ignore_eos": True})
    bare = _texts(_create(client, "completions", kw))
    penalised = _texts(_create(client, "completions", REQUESTS[5][1]))
    assert bare != penalised and penalised[0]


def test_min_p_changes_the_answer_and_min_p_1_is_greedy(plain_server):
    """The min_p requests above are not the unfiltered ones in disguise; min_p 1 keeps only the
    most likely token, so a hot temperature then answers as greedy decoding does."""
    client = openai_client(plain_server)
    kind, kw = REQUESTS[MIN_P_REQUEST]
    assert kw["extra_body"]["min_p"] == 0.2
    filtered = _texts(_create(client, kind, kw))
    bare = _texts(_create(client, kind, dict(kw, extra_body={"ignore_eos": True})))
    assert filtered != bare and filtered[0]
    greedy = _texts(_create(client, kind, dict(kw, temperature=0.0, extra_body={"ignore_eos": True})))
    assert _texts(_create(client, kind, dict(kw, temperature=2.0, extra_body={"ignore_eos": True, "min_p": 1.0}))) == greedy
    assert greedy != _texts(_create(client, kind, dict(kw, temperature=2.0, extra_body={"ignore_eos": True})))


def test_min_tokens_holds_back_a_stop_token_id(plain_server):
    """The tiny model answers CHAT with token 89 second: as a stop id it ends the answer at 2
    tokens; with min_tokens 6 it is masked until the 7th token."""
    client = openai_client(plain_server)
    kw = dict(messages=CHAT, max_tokens=30, temperature=0.0)
    short = _create(client, "chat", dict(kw, extra_body={"stop_token_ids": [89]}))
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "stop"
    held = _create(client, "chat", REQUESTS[-1][1])
    assert held.usage.completion_tokens >= 6


def test_logit_bias_100_makes_every_token_the_biased_one(dflash_server):
    out = openai_client(dflash_server).completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0.0, logprobs=0, logit_bias={"9": 100},
        extra_body={"ignore_eos": True})
    assert out.choices[0].logprobs.tokens == [word(9)] * 12


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_a_request_may_use_the_whole_context_v1_models_reports(plain_server, dflash_server, sampling):
    """/v1/models' max_model_len is what prompt + max_tokens may reach with a drafter too (requests
    were refused past max_model_len - (K + 1) when the KV pool capped the context); the engine
    drops the drafts that would pass its end, and the output up to the last token is plain decoding's
    (the plain server's larger pool runs the same request uncut)."""
    assert httpx.get(dflash_server.v1 + "/models").json()["data"][0]["max_model_len"] == 384  # 96 x 4: the pool's
    assert httpx.get(plain_server.v1 + "/models", headers={"Authorization": f"Bearer {plain_server.api_key}"}
                     ).json()["data"][0]["max_model_len"] > 384
    client = openai_client(dflash_server)
    kw = dict(model=MODEL_NAME, prompt=[5] * 10, extra_body={"ignore_eos": True}, **sampling)
    out = client.completions.create(max_tokens=374, **kw)
    assert out.choices[0].finish_reason == "length" and out.usage.total_tokens == 384
    assert out.model_extra["spec_decode_stats"]["num_drafts"] > 0
    plain = openai_client(plain_server).completions.create(max_tokens=374, **kw)
    assert out.choices[0].text == plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match=r"prompt 0 has 10 tokens and max_tokens is 375: 385 tokens, more "
                                                     r"than this model's context of 384 tokens \(max_model_len in "
                                                     r"/v1/models\); lower max_tokens to at most 374"):
        client.completions.create(max_tokens=375, **kw)


def test_choice_j_of_a_seeded_request_is_the_request_with_seed_plus_j(plain_server):
    """The server's n runs SamplingParams.completions: choice j uses seed + j (mod 2**63, so the
    largest seed wraps to 0), the same rule as LLM.generate's n."""
    client = openai_client(plain_server)
    kw = dict(prompt=PROMPTS[0], max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    for seed, seeds in ((5, (5, 6)), (2**63 - 1, (2**63 - 1, 0))):
        both = _texts(_create(client, "completions", dict(kw, n=2, seed=seed)))
        alone = [_texts(_create(client, "completions", dict(kw, seed=s)))[0] for s in seeds]
        assert both == alone and both[0] != both[1]
