"""Prefix caching on the real Qwen2.5-Coder-0.5B target with its shipped DFlash drafter, in fp32:
chats sharing a system prompt, asked one after another and then as one batch in a small KV pool
(preemption): the same tokens as plain decoding without the cache, with hits; and the same
acceptance as the drafter without the cache (the reused pages carry the drafter's context too)."""

import pytest

from blockdraft.llm import LLM, load_target
from blockdraft.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-0.5b-instruct"
SYSTEM = ("You are a careful senior Python reviewer. Answer in short sentences, show code when it helps, "
          "prefer the standard library, and always mention edge cases such as empty inputs and very large numbers.")
QUESTIONS = ("Write a function that reverses a string.", "Write a function that checks for a palindrome.",
             "Write a function that sums a list of numbers.")
CHATS = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
PARAMS = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def target():
    return load_target(NAME, "float32")


def _one_by_one(llm):
    return [llm.generate([c], PARAMS)[0] for c in CHATS]


def test_real_drafter_with_prefix_hits_equals_plain(target):
    plain = [o.token_ids for o in _one_by_one(LLM(target=target, dtype="float32"))]
    uncached = _one_by_one(LLM(target=target, draft="auto", dtype="float32"))
    llm = LLM(target=target, draft="auto", dtype="float32", enable_prefix_caching=True)
    cached = _one_by_one(llm)
    assert [o.token_ids for o in cached] == plain == [o.token_ids for o in uncached]
    assert llm.engine.scheduler.kv.stats.hits >= 2 * 32  # the system prompt's full pages, twice
    accepted = [o.spec.num_accepted_tokens for o in cached]
    assert sum(accepted) > 0 and accepted == [o.spec.num_accepted_tokens for o in uncached]


def test_real_batch_with_preemption_and_prefix_caching_equals_plain(target):
    plain = [o.token_ids for o in LLM(target=target, dtype="float32").generate(CHATS, PARAMS)]
    # 6 pages of 16 tokens hold one chat (prompt + 12 answer tokens + drafts) but not three: preemption is certain
    # (9 stopped preempting when the session-9 drafter accepted more per step)
    llm = LLM(target=target, draft="auto", dtype="float32", enable_prefix_caching=True, num_kv_blocks=6)
    preempted, orig = [], llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda r: (preempted.append(r.request_id), orig(r))
    llm.generate(CHATS[:1], PARAMS)  # caches the system prompt
    assert [o.token_ids for o in llm.generate(CHATS, PARAMS)] == plain
    assert preempted and llm.engine.scheduler.kv.stats.hits > 0
