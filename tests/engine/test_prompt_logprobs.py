"""SamplingParams.prompt_logprobs (vLLM's): the log-probability of each prompt token given the
tokens before it and its N most likely alternatives, on the tiny random fp32 target (tests.conftest).

The oracle is one plain forward of the whole prompt through the model (no engine, no chunks, no
cache): log_softmax of its logits. The engine must give that across chunked prefill, with a cached
prefix (recomputed, not reused), after preemption, in the padded graph code with async scheduling,
and with a DFlash drafter, whose drafts and the output tokens must not change."""

from __future__ import annotations

import pytest
import torch

from blockdraft.attention.metadata import build_metadata
from blockdraft.models import allocate_kv_caches
from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import make_llm, random_prompts

BLOCK = 4  # make_llm's kv_block_size


def full_forward_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[P, V] float32 log_softmax of one causal forward of the whole prompt from an empty cache."""
    n, pages = len(prompt), (len(prompt) + BLOCK - 1) // BLOCK
    caches = allocate_kv_caches(model.config, pages, BLOCK)
    meta = build_metadata([n], [n], [list(range(pages))], BLOCK)
    with torch.no_grad():
        hidden, _ = model(torch.tensor(prompt), torch.arange(n), caches, meta, ())
        return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def assert_prompt_logprobs(entries, model, prompt: list[int], num_top: int, atol: float = 1e-4) -> None:
    """`entries` (RequestOutput.prompt_logprobs) against the full forward: None first, then each
    prompt token's log-probability, its rank and the `num_top` most likely tokens with theirs."""
    ref = full_forward_logprobs(model, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p, e in enumerate(entries[1:]):
        assert e["token_id"] == prompt[p + 1]
        assert e["logprob"] == pytest.approx(ref[p, prompt[p + 1]].item(), abs=atol)
        # vLLM's rank: the tokens at least as likely (itself included); those within atol either side
        lp = ref[p, prompt[p + 1]]
        assert 1 + int((ref[p] > lp + atol).sum()) <= e["rank"] <= int((ref[p] >= lp - atol).sum()), p
        top_lp, top_ids = ref[p].topk(num_top)
        assert [t for t, _ in e["top"]] == top_ids.tolist(), p
        assert [lp for _, lp in e["top"]] == pytest.approx(top_lp.tolist(), abs=atol)


def _dflash_llm(target, k=3, **kw):
    drafter = random_drafter(target.config, num_layers=1, block_size=k + 1, target_layer_ids=(0, 2), seed=3,
                             init_std=0.1)  # fmt: skip
    kw.setdefault("num_kv_blocks", 256)
    spec = DFlashSpeculator(drafter, target.model, k, kw["num_kv_blocks"], BLOCK)
    return make_llm(target, speculator=spec, **kw)


def _record_drafts(llm):
    """Every drafter call's output [R, K], appended to the list returned."""
    seen, orig = [], llm.speculator.propose
    llm.speculator.propose = lambda *a, **k: (seen.append(orig(*a, **k).clone()), seen[-1])[1]
    return seen


def test_a_prompt_longer_than_the_chunk_is_scored_chunk_by_chunk(llama_target):
    """40 prompt tokens through steps of 16: three chunks, each scoring its rows and the first token
    of the next chunk; the output tokens are those of a request without prompt_logprobs."""
    prompt = random_prompts(1, seed=3, low=40, high=41)[0]
    llm = make_llm(llama_target, max_num_batched_tokens=16)
    scored = []
    runner_launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda so: (scored.append([len(sr.prompt_logprob_token_ids) for sr in so.requests]),
                                           runner_launch(so))[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, prompt_logprobs=3))[0]
    assert scored[:3] == [[16], [16], [7]] and all(s == [0] for s in scored[3:])  # 16 + 16 + 7 = 39 tokens
    assert_prompt_logprobs(out.prompt_logprobs, llama_target.model, prompt, 3)
    plain = llm.generate([prompt], SamplingParams(max_tokens=5))[0]
    assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None and out.logprobs is None


def test_zero_alternatives_a_one_token_prompt_and_a_batch(llama_target):
    prompts = random_prompts(4, seed=8, low=2, high=30) + [[17]]
    llm = make_llm(llama_target, max_num_batched_tokens=24)
    params = [SamplingParams(max_tokens=4, prompt_logprobs=n) for n in (0, 5, None, 2, 1)]
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs(out.prompt_logprobs, llama_target.model, prompt, p.prompt_logprobs)
    assert outs[-1].prompt_logprobs == [None]  # the first prompt token has no log-probability
    alone = [make_llm(llama_target).generate([q], SamplingParams(max_tokens=4))[0].token_ids for q in prompts]
    assert [o.token_ids for o in outs] == alone


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(llama_target):
    """With prefix caching on and the prompt's prefix cached, a request asking for prompt logprobs
    takes no hit (its prompt rows need logits) and is scored in full; one that does not ask still
    hits, and both give the uncached tokens."""
    prefix = random_prompts(1, seed=21, low=26, high=27)[0]
    first, second = prefix + [5, 6, 7], prefix + [9, 10]
    llm = make_llm(llama_target, enable_prefix_caching=True, max_num_batched_tokens=16)
    llm.generate([first], SamplingParams(max_tokens=4))
    kv = llm.engine.scheduler.kv
    hits = kv.stats.hits
    out = llm.generate([second], SamplingParams(max_tokens=6, prompt_logprobs=2))[0]
    assert kv.stats.hits == hits  # no hit taken
    assert_prompt_logprobs(out.prompt_logprobs, llama_target.model, second, 2)
    again = llm.generate([second], SamplingParams(max_tokens=6))[0]
    assert kv.stats.hits - hits >= 24  # 6 full pages of the 26-token prefix
    assert out.token_ids == again.token_ids == make_llm(llama_target).generate(
        [second], SamplingParams(max_tokens=6))[0].token_ids


def test_preempted_requests_keep_their_prompt_logprobs(llama_target):
    """Too few pages for the batch: requests are preempted (some mid-prompt) and recomputed; each
    prompt's entries are still one per token, equal to the full forward's."""
    prompts = random_prompts(8, seed=30, low=20, high=40)
    params = SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    small = make_llm(llama_target, num_kv_blocks=30, max_num_batched_tokens=16, enable_prefix_caching=True)
    preempted, orig = [], small.engine.scheduler._preempt
    small.engine.scheduler._preempt = lambda r: (preempted.append(r.request_id), orig(r))
    outs = small.generate(prompts, params)
    assert preempted
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs(out.prompt_logprobs, llama_target.model, prompt, 1)
    want = make_llm(llama_target).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_dflash_gives_plain_decodings_tokens_and_prompt_logprobs_and_the_same_drafts(llama_target):
    """The drafter sees the same inputs with and without prompt_logprobs (its drafts, step by step,
    are equal) and the output ids and prompt log-probabilities equal plain decoding's."""
    prompts = random_prompts(3, seed=40, low=18, high=36)
    asked = SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=4)
    quiet = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = make_llm(llama_target, max_num_batched_tokens=16).generate(prompts, asked)
    runs = {}
    for name, params in (("asked", asked), ("quiet", quiet)):
        llm = _dflash_llm(llama_target, max_num_batched_tokens=16)
        drafts = _record_drafts(llm)
        runs[name] = (llm.generate(prompts, params), drafts)
    spec, drafts = runs["asked"]
    assert len(drafts) == len(runs["quiet"][1]) and all(torch.equal(a, b) for a, b in zip(drafts, runs["quiet"][1]))
    assert sum(o.spec.num_drafted_tokens for o in spec) > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain] == [o.token_ids for o in runs["quiet"][0]]
    for prompt, s, p in zip(prompts, spec, plain):
        assert [e and e["token_id"] for e in s.prompt_logprobs] == [e and e["token_id"] for e in p.prompt_logprobs]
        assert [e and e["logprob"] for e in s.prompt_logprobs[1:]] == pytest.approx(
            [e["logprob"] for e in p.prompt_logprobs[1:]], abs=1e-5)
        assert [[t for t, _ in e["top"]] for e in s.prompt_logprobs[1:]] == \
            [[t for t, _ in e["top"]] for e in p.prompt_logprobs[1:]]
        assert_prompt_logprobs(s.prompt_logprobs, llama_target.model, prompt, 4)


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "k3"])
def test_graph_code_with_async_scheduling_runs_such_steps_eagerly(llama_target, k):
    """The padded graph code (run eagerly on the CPU, graph_mode="eager") with async scheduling and
    prefill apart from decode, as on the GPU: a step that scores prompt rows runs eagerly (never
    the prefill graph) and newcomers still join the running requests; same tokens as without
    prompt_logprobs, prompt logprobs equal to the full forward."""
    opts = dict(attention_backend="dense", graph_mode="eager", max_num_seqs=3, mixed_prefill=False,
                async_scheduling=True)  # fmt: skip
    prompts = random_prompts(7, seed=60, low=5, high=30)
    params = [SamplingParams(max_tokens=[3, 9, 14][i % 3], ignore_eos=True,
                             prompt_logprobs=None if i % 2 else 2) for i in range(7)]  # fmt: skip

    def build():
        return make_llm(llama_target, **opts) if k is None else _dflash_llm(llama_target, k=k, **opts)

    ref = build()
    want = ref.generate(prompts, [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True) for p in params])
    llm = build()
    prefill_graph_steps = []
    orig = llm.engine.runner._enqueue_prefill
    llm.engine.runner._enqueue_prefill = lambda so, *a: (prefill_graph_steps.append(so), orig(so, *a))[1]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert not any(sr.sampling_params.prompt_logprobs is not None for so in prefill_graph_steps for sr in so.requests)
    assert prefill_graph_steps  # the others still replay the prefill graph code
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs(out.prompt_logprobs, llama_target.model, prompt, 2)


def test_streamed_outputs_carry_the_whole_prompts_logprobs(llama_target):
    prompt = random_prompts(1, seed=70, low=30, high=31)[0]
    llm = make_llm(llama_target, max_num_batched_tokens=16)
    outs = list(llm.generate_stream(prompt, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0)))
    assert len(outs) == 4
    for o in outs:
        assert_prompt_logprobs(o.prompt_logprobs, llama_target.model, prompt, 0)


@pytest.mark.parametrize("value, match", [
    (-1, r"^prompt_logprobs must be an integer >= 0, got -1"),
    (1.5, r"^prompt_logprobs must be an integer >= 0, got 1.5"),
    (True, r"^prompt_logprobs must be an integer >= 0, got True"),
])
def test_bad_values_are_refused_naming_the_field(value, match):
    with pytest.raises(ValueError, match=match) as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.param == "prompt_logprobs"


def test_more_than_max_logprobs_is_refused_when_the_request_is_added(llama_target):
    llm = make_llm(llama_target, max_logprobs=3)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, prompt_logprobs=3))
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be <= 3 \(the engine's max_logprobs; .*got 4$"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, prompt_logprobs=4))
    with pytest.raises(ValueError, match=rf"^prompt_logprobs must be <= {DEFAULT_MAX_LOGPROBS} "):
        make_llm(llama_target).generate([[1, 2]], SamplingParams(prompt_logprobs=DEFAULT_MAX_LOGPROBS + 1))
    assert not llm.engine.has_unfinished_requests()
