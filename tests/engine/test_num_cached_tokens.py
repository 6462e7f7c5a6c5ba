"""RequestOutput.num_cached_tokens (vLLM's): the prompt tokens whose KV came from the prefix cache
at the request's first admission, in whole pages; 0 with caching off or a miss; set once, so a
readmission after preemption keeps it. The scheduler part runs without a model; the rest on the
tiny random fp32 target (tests.conftest), plain and DFlash, whole and streamed."""

from blockdraft.engine.request import Request
from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm, random_prompts
from tests.engine.test_prefix_cache import _run_prefill_and_finish as _prefill_and_finish
from tests.engine.test_prefix_cache import _sched
from tests.engine.test_prefix_cache_generate import _batch, _dflash_llm

BS = 4  # tokens per KV page (make_llm's kv_block_size)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = random_prompts(1, seed=7, low=30, high=31)[0]  # 30 tokens: 7 full pages reusable, the last token not


# -- the scheduler (no model) ----------------------------------------------------------------


def test_the_first_admission_records_the_hit_in_tokens():
    for caching, want in ((True, 8), (False, 0)):
        s = _sched(caching=caching)
        a = Request("a", list(range(1, 11)), SamplingParams())
        assert a.num_cached_tokens is None  # not admitted yet
        _prefill_and_finish(s, a)
        assert a.num_cached_tokens == 0  # a miss
        b = Request("b", list(range(1, 9)) + [60, 61], SamplingParams())
        s.add_request(b)
        s.schedule()
        assert b.num_cached_tokens == want, caching  # 2 pages of 4 with caching


def test_a_request_asking_for_prompt_logprobs_records_0():
    s = _sched()
    _prefill_and_finish(s, Request("a", list(range(1, 11)), SamplingParams()))
    b = Request("b", list(range(1, 11)), SamplingParams(prompt_logprobs=1))
    s.add_request(b)
    assert s.schedule().requests[0].start_position == 0 and b.num_cached_tokens == 0


def test_a_hit_given_back_records_nothing_until_the_request_is_admitted():
    s = _sched(blocks=4)
    _prefill_and_finish(s, Request("a", list(range(1, 10)), SamplingParams()))  # pages 0, 1 cached
    hog = Request("hog", [90] * 7, SamplingParams())
    s.add_request(hog)
    s.schedule()
    b = Request("b", list(range(1, 9)) + list(range(70, 75)), SamplingParams())  # hits 2 pages, needs 2 more
    s.add_request(b)
    assert "b" not in [sr.request_id for sr in s.schedule().requests]
    assert b.num_cached_tokens is None
    s.finish(hog)
    assert [sr.request_id for sr in s.schedule().requests] == ["b"] and b.num_cached_tokens == 8


def test_a_readmission_after_preemption_keeps_the_first_value():
    s = _sched(blocks=5)
    a = Request("a", list(range(1, 10)), SamplingParams())
    s.add_request(a)
    s.schedule()
    assert a.num_cached_tokens == 0
    a.num_computed_tokens, a.output_token_ids = 9, [20]
    s.cache_computed(a)
    s._preempt(a)
    assert s.schedule().requests[0].start_position == 8  # the readmission hits its own 2 pages
    assert a.num_cached_tokens == 0 and s.kv.stats.hits == 8


# -- end to end ------------------------------------------------------------------------------


def test_a_second_identical_prompt_reports_its_cached_pages(llama_target):
    want = (len(PROMPT) - 1) // BS * BS
    llm = make_llm(llama_target, enable_prefix_caching=True)
    first, second = (llm.generate([PROMPT], GREEDY)[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == want > 0 and second.num_cached_tokens % BS == 0
    assert second.token_ids == first.token_ids
    # prompt log-probabilities need every prompt row: recomputed, nothing served from the cache
    asks = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    assert llm.generate([PROMPT], asks)[0].num_cached_tokens == 0


def test_caching_off_reports_0(llama_target):
    llm = make_llm(llama_target)
    assert [llm.generate([PROMPT], GREEDY)[0].num_cached_tokens for _ in range(2)] == [0, 0]


def test_every_streamed_output_carries_it(llama_target):
    llm = make_llm(llama_target, enable_prefix_caching=True)
    assert {o.num_cached_tokens for o in llm.generate_stream(PROMPT, GREEDY)} == {0}
    outs = list(llm.generate_stream(PROMPT, GREEDY))
    assert len(outs) > 1 and {o.num_cached_tokens for o in outs} == {(len(PROMPT) - 1) // BS * BS}


def test_dflash_reports_the_same_value_and_tokens_as_plain_decoding(llama_target):
    runs = []
    for llm in (make_llm(llama_target, enable_prefix_caching=True),
                _dflash_llm(llama_target, enable_prefix_caching=True)):
        outs = [llm.generate([PROMPT], GREEDY)[0] for _ in range(2)]
        runs.append([(o.token_ids, o.num_cached_tokens) for o in outs])
    assert runs[0] == runs[1] and runs[0][1][1] > 0
    assert outs[1].spec.num_drafted_tokens > 0  # the DFlash run did draft


def test_n_choices_report_the_first_requests_value(llama_target):
    """One request at a time (max_num_seqs=1): choice 1 starts after choice 0 finished and hits
    its pages; the RequestOutput reports choice 0's value, as its text and token_ids are."""
    llm = make_llm(llama_target, enable_prefix_caching=True, max_num_seqs=1)
    out = llm.generate([PROMPT], SamplingParams(n=2, max_tokens=12, ignore_eos=True, temperature=0.8, seed=1))[0]
    assert len(out.outputs) == 2 and out.num_cached_tokens == 0
    assert llm.engine.scheduler.kv.stats.hits == (len(PROMPT) - 1) // BS * BS  # choice 1's hit


def test_preempted_and_readmitted_requests_keep_their_first_value(llama_target):
    """A small pool preempts; a readmission hits the request's own pages (a larger hit than its
    first admission's), and its output still reports the first admission's hit."""
    prompts, params = _batch(), SamplingParams(max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    llm = make_llm(llama_target, enable_prefix_caching=True, num_kv_blocks=40)
    sched, kv = llm.engine.scheduler, llm.engine.scheduler.kv
    # each admission's hit, per request: the scheduler looks up a request's prefix, then counts the
    # lookup once the request is admitted (a hit given back for want of pages is not counted)
    looked_up, admitted = [], {}
    take, record = sched._take_prefix_hit, kv.record_lookup
    sched._take_prefix_hit = lambda r: (looked_up.append(r.request_id), take(r))[1]
    kv.record_lookup = lambda q, h: (admitted.setdefault(looked_up[-1], []).append(h), record(q, h))
    preempted, preempt = [], sched._preempt
    sched._preempt = lambda r: (preempted.append(r.request_id), preempt(r))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [admitted[o.request_id][0] for o in outs]
    assert any(o.num_cached_tokens > 0 for o in outs)
    assert all(len(admitted[rid]) > 1 for rid in preempted)  # readmitted
    assert any(max(admitted[rid]) > admitted[rid][0] for rid in preempted)  # a readmission hit more
