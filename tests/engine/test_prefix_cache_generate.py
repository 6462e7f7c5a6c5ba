"""Prefix caching end to end on the tiny random fp32 target (tests.conftest): the same tokens as
without it, with hits; with the DFlash drafter the drafts too are the same (so the drafter's
context KV of the reused pages is right, not only the target's)."""

import torch

from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import make_llm, random_prompts

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _shared(n, prefix_len=26, seed=0, tail=(2, 9)):
    """n prompts: one shared system prefix + a short tail of their own (lengths in [tail))."""
    prefix = random_prompts(1, seed=seed, low=prefix_len, high=prefix_len + 1)[0]
    if n == 1 and tail is None:
        return [prefix]
    return [prefix + t for t in random_prompts(n, seed=seed + 1, low=tail[0], high=tail[1])]


def _ids(outs):
    return [o.token_ids for o in outs]


def _dflash_llm(target, k=5, **kw):
    drafter = random_drafter(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), seed=3, init_std=0.1)
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("kv_block_size", 4)
    spec = DFlashSpeculator(drafter, target.model, k, kw["num_kv_blocks"], kw["kv_block_size"])
    return make_llm(target, speculator=spec, **kw)


def _record_drafts(llm):
    """Wrap the speculator's propose: every step's drafts [R, K] are appended to the list returned."""
    seen, orig = [], llm.speculator.propose
    llm.speculator.propose = lambda *a, **k: (seen.append(orig(*a, **k).clone()), seen[-1])[1]
    return seen


def test_plain_second_request_hits_and_gives_the_same_tokens(llama_target):
    first, second = _shared(2)
    ref = make_llm(llama_target)
    want = [ref.generate([p], GREEDY)[0].token_ids for p in (first, second)]
    llm = make_llm(llama_target, enable_prefix_caching=True)
    assert llm.generate([first], GREEDY)[0].token_ids == want[0]
    assert llm.engine.scheduler.kv.stats.hits == 0
    assert llm.generate([second], GREEDY)[0].token_ids == want[1]
    assert llm.engine.scheduler.kv.stats.hits >= 24  # the 26-token prefix: 6 full pages of 4
    assert ref.engine.scheduler.kv.stats.hits == 0


def test_the_same_prompt_again_reuses_all_but_its_last_page(llama_target):
    prompt = _shared(1, prefix_len=32)[0]
    llm = make_llm(llama_target, enable_prefix_caching=True)
    once = llm.generate([prompt], GREEDY)[0].token_ids
    before = llm.engine.scheduler.kv.stats.hits
    assert llm.generate([prompt], GREEDY)[0].token_ids == once
    assert llm.engine.scheduler.kv.stats.hits - before == (len(prompt) - 1) // 4 * 4


def test_a_next_turn_reuses_the_answer_but_not_its_uncomputed_last_token(llama_target):
    """A chat's next turn = prompt + answer + more. The answer's last token never had its KV
    computed (it would have been the next step's anchor), so its page must not be reused."""
    first = _shared(1, prefix_len=20, tail=None)[0]  # 20 + 24 answer tokens = 11 full pages, the last one ending
    assert (len(first) + GREEDY.max_tokens) % 4 == 0  # on the uncomputed token
    ref = make_llm(llama_target)
    answer = ref.generate([first], GREEDY)[0].token_ids
    second = first + answer + [7, 8, 9]
    want = ref.generate([second], GREEDY)[0].token_ids
    llm = make_llm(llama_target, enable_prefix_caching=True)
    assert llm.generate([first], GREEDY)[0].token_ids == answer
    assert llm.generate([second], GREEDY)[0].token_ids == want
    assert llm.engine.scheduler.kv.stats.hits == (len(first) + len(answer)) // 4 * 4 - 4


def test_wrong_kv_in_a_hit_page_would_change_the_tokens(llama_target):
    """The check above can fail: corrupt the cached pages' target KV and the output changes."""
    first, second = _shared(2)
    want = make_llm(llama_target).generate([second], GREEDY)[0].token_ids
    llm = make_llm(llama_target, enable_prefix_caching=True)
    llm.generate([first], GREEDY)
    for k_cache, v_cache in llm.engine.runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    assert llm.generate([second], GREEDY)[0].token_ids != want


def test_dflash_with_hits_equals_plain_and_drafts_equal_uncached_drafts(llama_target):
    first, second = _shared(2)
    plain = make_llm(llama_target)
    want = [plain.generate([p], GREEDY)[0].token_ids for p in (first, second)]
    uncached = _dflash_llm(llama_target)
    uncached.generate([first], GREEDY)
    uncached_drafts = _record_drafts(uncached)
    assert uncached.generate([second], GREEDY)[0].token_ids == want[1]
    cached = _dflash_llm(llama_target, enable_prefix_caching=True)
    assert cached.generate([first], GREEDY)[0].token_ids == want[0]
    cached_drafts = _record_drafts(cached)
    out = cached.generate([second], GREEDY)[0]
    assert out.token_ids == want[1]
    assert cached.engine.scheduler.kv.stats.hits >= 24 and out.spec.num_drafted_tokens > 0
    # the drafter reads the reused pages' context KV: equal drafts at every step mean it is right
    assert len(cached_drafts) == len(uncached_drafts)
    assert all(torch.equal(a, b) for a, b in zip(cached_drafts, uncached_drafts))


def test_dflash_drafts_would_differ_without_the_drafters_cached_context(llama_target):
    """The draft check above can fail: wipe the drafter's cache after the first request."""
    first, second = _shared(2)
    uncached = _dflash_llm(llama_target)
    uncached.generate([first], GREEDY)
    want = _record_drafts(uncached)
    uncached.generate([second], GREEDY)
    cached = _dflash_llm(llama_target, enable_prefix_caching=True)
    cached.generate([first], GREEDY)
    for k_cache, v_cache in cached.speculator.kv_caches:
        k_cache.zero_()
        v_cache.zero_()
    got = _record_drafts(cached)
    cached.generate([second], GREEDY)
    assert not all(torch.equal(a, b) for a, b in zip(got, want))


def test_dflash_next_turn_drafts_equal_uncached_drafts(llama_target):
    """Pages filled by the answer (accepted drafts and bonus tokens) carry the drafter's context."""
    first = _shared(1, prefix_len=20, tail=None)[0]
    runs = []
    for caching in (False, True):
        llm = _dflash_llm(llama_target, enable_prefix_caching=caching)
        answer = llm.generate([first], GREEDY)[0].token_ids
        drafts = _record_drafts(llm)
        out = llm.generate([first + answer + [7, 8, 9]], GREEDY)[0]
        runs.append((answer, out.token_ids, drafts, llm.engine.scheduler.kv.stats.hits))
    (a0, t0, d0, h0), (a1, t1, d1, h1) = runs
    assert (a1, t1) == (a0, t0) and h0 == 0 and h1 >= 40
    assert len(d1) == len(d0) and all(torch.equal(x, y) for x, y in zip(d1, d0))


def _batch():
    """Three system prompts, four user turns each, in an interleaved order."""
    prompts = []
    for s in range(3):
        prompts += _shared(4, prefix_len=18 + 5 * s, seed=10 * s)
    return prompts[0::3] + prompts[1::3] + prompts[2::3]


def _count_preemptions(llm):
    seen, orig = [], llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda r: (seen.append(r.request_id), orig(r))
    return seen


def test_batch_with_shared_system_prompts_and_preemption_equals_no_caching(llama_target):
    prompts, params = _batch(), SamplingParams(max_tokens=30, ignore_eos=True)
    want = _ids(make_llm(llama_target).generate(prompts, params))
    big = make_llm(llama_target, enable_prefix_caching=True, max_num_seqs=4)
    assert _ids(big.generate(prompts, params)) == want
    assert big.engine.scheduler.kv.stats.hits > 0
    small = make_llm(llama_target, enable_prefix_caching=True, num_kv_blocks=40)  # too few pages: preempts
    preempted = _count_preemptions(small)
    assert _ids(small.generate(prompts, params)) == want
    assert preempted and small.engine.scheduler.kv.stats.hits > 0
    assert small.engine.scheduler.kv.num_free_blocks == 40


def test_dflash_batch_with_shared_system_prompts_and_preemption_equals_plain(llama_target):
    prompts, params = _batch(), SamplingParams(max_tokens=30, ignore_eos=True)
    want = _ids(make_llm(llama_target).generate(prompts, params))
    small = _dflash_llm(llama_target, enable_prefix_caching=True, num_kv_blocks=48)
    preempted = _count_preemptions(small)
    outs = small.generate(prompts, params)
    assert _ids(outs) == want
    assert preempted and small.engine.scheduler.kv.stats.hits > 0
    assert sum(o.spec.num_drafted_tokens for o in outs) > 0


def test_dflash_sampled_with_stops_and_hits_equals_plain_for_several_k(llama_target):
    """T > 0 (seeded) with a stop token inside a drafted block, over two rounds of the same
    system prompts (the second round served from the cache): DFlash with prefix caching gives
    plain decoding's tokens, at K = 1 and K = 5."""
    prompts = _batch()
    sampled = [SamplingParams(max_tokens=20, temperature=0.8, seed=100 + i) for i in range(len(prompts))]
    free_run = _ids(make_llm(llama_target).generate(prompts, sampled))
    # each request stops at the token it would sample 7th: a stop that can land mid-block
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=100 + i, stop_token_ids=[ids[6]])
              for i, ids in enumerate(free_run)]
    plain = make_llm(llama_target)
    want = [plain.generate(prompts, params), plain.generate(prompts, params)]
    assert all(o.finish_reason == "stop" for o in want[0]) and _ids(want[0]) == _ids(want[1])
    for k in (1, 5):
        llm = _dflash_llm(llama_target, k=k, enable_prefix_caching=True)
        for round_, ref in enumerate(want):
            outs = llm.generate(prompts, params)
            assert _ids(outs) == _ids(ref), (k, round_)
            assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
        assert llm.engine.scheduler.kv.stats.hits > 0
        assert sum(o.spec.num_drafted_tokens for o in outs) > 0


def test_reset_prefix_cache_makes_the_next_request_miss_with_the_same_tokens(llama_target):
    """LLM.reset_prefix_cache (vLLM's): the next request computes its prefix again, same tokens."""
    first, second = _shared(2)
    llm = make_llm(llama_target, enable_prefix_caching=True)
    llm.generate([first], GREEDY)
    want = llm.generate([second], GREEDY)[0].token_ids
    hits = llm.engine.scheduler.kv.stats.hits
    assert hits > 0
    assert llm.reset_prefix_cache()
    assert llm.generate([second], GREEDY)[0].token_ids == want
    assert llm.engine.scheduler.kv.stats.hits == hits  # a miss: nothing served from the cache
    llm.engine.add_request("open", second, GREEDY)
    assert not llm.reset_prefix_cache()  # an unfinished request: refused
    llm.engine.abort_request("open")
    assert llm.reset_prefix_cache()
