"""Prefix caching in the KV-cache manager and the scheduler (pure Python, no model)."""

import pytest

from blockdraft.config import CacheConfig, SchedulerConfig
from blockdraft.engine.kv_cache_manager import KVCacheManager
from blockdraft.engine.request import Request
from blockdraft.engine.scheduler import Scheduler
from blockdraft.sampling_params import SamplingParams

BS = 4  # tokens per page


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def _computed(kv, rid, tokens):
    """A request whose every token is computed and offered to the cache (pages allocated)."""
    r = _req(rid, tokens)
    assert kv.allocate_slots(r, len(tokens))
    kv.cache_full_pages(r, len(tokens))
    return r


def _kv(blocks=16):
    return KVCacheManager(blocks, BS, enable_prefix_caching=True)


def test_hash_chain_names_the_whole_prefix_not_just_the_page():
    kv = _kv()
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = _req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])  # same second page, other first page
    ha, hb = kv.page_hashes(a, 2), kv.page_hashes(b, 2)
    assert ha[0] != hb[0] and ha[1] != hb[1]
    assert kv.page_hashes(_req("c", [1, 2, 3, 4, 5, 6, 7, 8, 0]), 2) == ha  # the partial third page is not hashed
    with pytest.raises(ValueError, match="fewer than 3 full pages"):
        kv.page_hashes(a, 3)


def test_hit_returns_the_cached_pages_and_bumps_their_ref_counts():
    kv = _kv()
    a = _computed(kv, "a", range(1, 11))  # 2 full pages + 2 tokens
    b = _req("b", list(range(1, 9)) + [50, 51, 52])
    pages = kv.find_cached_prefix(b)
    assert pages == a.block_ids[:2]
    kv.take_cached(b, pages)
    assert b.block_ids == a.block_ids[:2] and kv._ref_counts[pages[0]] == 2
    kv.free(a)
    assert kv._ref_counts[pages[0]] == 1 and pages[0] not in kv._free  # still used by b
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_partial_pages_are_never_cached():
    kv = _kv()
    a = _req("a", range(1, 11))
    kv.allocate_slots(a, 10)
    kv.cache_full_pages(a, 7)  # 7 computed tokens: only the first page is full
    assert kv.find_cached_prefix(_req("b", range(1, 12))) == a.block_ids[:1]


def test_the_last_token_is_always_left_to_compute():
    kv = _kv()
    a = _computed(kv, "a", range(1, 13))  # 3 full pages
    # the same 12 tokens: a hit of all 3 pages would leave nothing to compute (no logits)
    assert kv.find_cached_prefix(_req("b", range(1, 13))) == a.block_ids[:2]
    assert kv.find_cached_prefix(_req("c", range(1, 14))) == a.block_ids[:3]
    assert kv.find_cached_prefix(_req("d", range(1, 5))) == []  # one page, all of it the prompt


def test_tokens_past_the_known_ones_are_not_cached():
    """Drafts (rejected or not yet committed) never enter a cached page."""
    kv = _kv()
    a = _req("a", range(1, 7))
    a.spec_token_ids = [40, 41, 42]
    kv.allocate_slots(a, 9)
    kv.cache_full_pages(a, 9)  # more computed than known tokens: capped at the 6 known
    assert len(kv._cached) == 1


def test_freed_pages_stay_cached_until_evicted_least_recently_freed_first():
    kv = _kv(blocks=6)
    a = _computed(kv, "a", range(1, 13))  # pages 0, 1, 2, all full and cached
    kv.free(a)  # tail first: the free list is now 3, 4, 5, 2, 1, 0
    assert kv.num_free_blocks == 6
    probe = _req("p", range(1, 14))
    assert kv.find_cached_prefix(probe) == [0, 1, 2]
    filler = _req("f", [77] * 16)
    assert kv.allocate_slots(filler, 16)  # takes 3, 4, 5 and then evicts page 2 (a's tail)
    assert kv.find_cached_prefix(probe) == [0, 1]
    kv.free(filler)
    # a hit takes its pages out of the free list, so they cannot be evicted under the request
    b = _req("b", range(1, 14))
    kv.take_cached(b, kv.find_cached_prefix(b))
    assert 0 not in kv._free and 1 not in kv._free
    assert kv.allocate_slots(b, 13) and b.block_ids[:2] == [0, 1]
    assert kv.num_free_blocks == 6 - 4


def test_a_hash_collision_is_a_miss():
    kv = _kv()
    a = _computed(kv, "a", range(1, 10))
    page = a.block_ids[0]
    kv._page_key[page] = (0, (9, 9, 9, 9))  # as if other tokens had the same hash
    assert kv.find_cached_prefix(_req("b", range(1, 10))) == []


def test_a_parent_hash_collision_is_a_miss():
    """Page 2's parent must be the very registration matched at page 1, not any page of equal hash."""
    kv = _kv()
    a = _computed(kv, "a", range(1, 10))  # pages p0 (1-4), p1 (5-8) cached
    hashes = list(a.page_hashes[:2])
    kv.free(a)
    kv._evict(0)  # p0 evicted, p1 still cached
    kv._free.move_to_end(0, last=False)
    q = _req("q", [11, 12, 13, 14, 5, 6, 7, 8, 9])
    q.page_hashes = list(hashes)  # forge: q's first page hashes like a's (a collision)
    kv.allocate_slots(q, 9)
    kv.cache_full_pages(q, 4)  # q's page 0 is now cached under a's old hash
    r = _req("r", [11, 12, 13, 14, 5, 6, 7, 8, 9, 10])
    r.page_hashes = list(hashes)
    assert kv.find_cached_prefix(r) == q.block_ids[:1]  # not a's p1: its prefix was 1-4, not 11-14


def test_disabled_caching_never_hits():
    kv = KVCacheManager(16, BS)
    _computed(kv, "a", range(1, 10))
    assert kv.find_cached_prefix(_req("b", range(1, 10))) == [] and not kv._cached
    assert CacheConfig().enable_prefix_caching is False
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(enable_prefix_caching="yes")


def _sched(blocks=16, caching=True, budget=64):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4), KVCacheManager(blocks, BS, caching))


def _run_prefill_and_finish(s, req):
    """Admit, compute the whole prompt as the engine would commit it, then finish -> its pages."""
    s.add_request(req)
    sr = s.schedule().requests[0]
    req.num_computed_tokens += len(sr.token_ids)
    req.output_token_ids.append(5)
    s.cache_computed(req)
    pages = list(req.block_ids)
    s.finish(req)
    return pages


def test_admission_starts_a_request_at_its_cached_prefix():
    s = _sched()
    a_pages = _run_prefill_and_finish(s, _req("a", range(1, 11)))
    b = _req("b", list(range(1, 9)) + [60, 61])
    s.add_request(b)
    sr = s.schedule().requests[0]
    assert sr.start_position == 8 and sr.token_ids == [60, 61] and sr.sample
    assert sr.block_ids[:2] == a_pages[:2] and a_pages[2] not in sr.block_ids[:2]
    assert b.num_computed_tokens == 8 and len(b.block_ids) == 3
    assert (s.kv.stats.queries, s.kv.stats.hits) == (20, 8)


def test_admission_without_caching_starts_at_zero():
    s = _sched(caching=False)
    _run_prefill_and_finish(s, _req("a", range(1, 11)))
    b = _req("b", range(1, 11))
    s.add_request(b)
    assert s.schedule().requests[0].start_position == 0


def test_a_hit_whose_rest_does_not_fit_is_given_back():
    s = _sched(blocks=4)
    _run_prefill_and_finish(s, _req("a", range(1, 10)))  # pages 0, 1 cached (a's output token too)
    hog = _req("hog", [90] * 7)  # 2 pages: the free list is 2, 3 then a's freed pages
    s.add_request(hog)
    s.schedule()
    b = _req("b", list(range(1, 9)) + list(range(70, 75)))  # hits 2 pages, needs 2 more: none left
    s.add_request(b)
    assert "b" not in [sr.request_id for sr in s.schedule().requests]
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert s.kv.find_cached_prefix(b) == [0, 1] and s.kv.num_free_blocks == 2  # given back, still cached
    assert (s.kv.stats.queries, s.kv.stats.hits) == (9 + 7, 0)  # a and hog admitted; b's lookup not counted


def test_a_preempted_request_hits_its_own_pages_on_readmission():
    s = _sched(blocks=5)
    a = _req("a", range(1, 10))
    s.add_request(a)
    s.schedule()
    a.num_computed_tokens = 9
    a.output_token_ids = [20]
    s.cache_computed(a)
    pages = list(a.block_ids[:2])
    s._preempt(a)
    assert a.block_ids == [] and a.num_computed_tokens == 0
    sr = s.schedule().requests[0]
    assert sr.start_position == 8 and sr.token_ids == [9, 20] and sr.block_ids[:2] == pages


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_cli_flag_is_opt_in(command):
    from blockdraft.cli import _parser

    p = _parser()
    assert p.parse_args(command).enable_prefix_caching is False
    assert p.parse_args(command + ["--enable-prefix-caching"]).enable_prefix_caching is True
    sub = p._subparsers._group_actions[0].choices[command[0]]
    assert "vLLM turns it on by default" in " ".join(sub.format_help().split())


def test_reset_forgets_every_cached_prefix_only_when_no_page_is_held():
    kv = _kv()
    a = _computed(kv, "a", range(1, 11))
    b = _req("b", list(range(1, 9)) + [7])
    pages = a.block_ids[:2]
    assert not kv.reset_prefix_cache()  # a holds pages: nothing changes
    assert kv.find_cached_prefix(b) == pages
    kv.free(a)
    assert kv.find_cached_prefix(b) == pages  # freed pages stay cached ...
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(b) == []  # ... until the reset
    assert kv.num_free_blocks == 16 and not kv._cached and not kv._page_key
