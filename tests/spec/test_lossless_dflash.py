"""The real DFlash speculator (random weights) inside the engine: lossless for every shape, and a
distribution test at T=1 that a broken verifier fails."""

import pytest
import torch
from scipy.stats import chisquare

import blockdraft.runner.model_runner as model_runner
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import make_llm, random_prompts, tiny_target


def _dflash_llm(target, k, block_size=16, mask_token_id=None, full_block=True, stacked=False, **kw):
    drafter = random_drafter(
        target.config, num_layers=2, block_size=block_size, target_layer_ids=(0, 2), seed=k, init_std=0.1, mask_token_id=mask_token_id
    )
    if stacked:  # the layout DFlashSpeculator gives a drafter on CUDA
        assert drafter.stack_projections()
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("kv_block_size", 4)
    spec = DFlashSpeculator(drafter, target.model, k, kw["num_kv_blocks"], kw["kv_block_size"], full_block=full_block)
    return make_llm(target, speculator=spec, **kw)


def dflash_and_oracle_llms(target, k: int, answers: dict[tuple[int, ...], list[int]], vocab_size: int) -> dict:
    """{name: LLM}: a random DFlash drafter and known-answer drafters that draft `answers`
    (prompt -> prompt + plain output) right with probability 1, 0.5 and 0: whole blocks accepted,
    half of them, none."""
    from tests.spec.doubles import KnownAnswerSpeculator

    engines = {"dflash": _dflash_llm(target, k)}
    for p_right in (1.0, 0.5, 0.0):
        oracle = KnownAnswerSpeculator(k, answers, vocab_size, p_right=p_right, seed=k)
        engines[f"oracle-{p_right}"] = make_llm(target, speculator=oracle)
        oracle.engine = engines[f"oracle-{p_right}"].engine
    return engines


@pytest.mark.parametrize("k, full_block", [(1, True), (3, True), (7, True), (15, True), (3, False)])
def test_dflash_greedy_parity_batch_sizes_and_max_tokens(llama_target, k, full_block):
    """Whole 16-row draft blocks (the default) for every K, and blocks cut to K + 1 rows (full_block=False)."""
    prompts = random_prompts(8, seed=50 + k)
    mts = [1, k, k + 1, k + 2, 64]
    params = [SamplingParams(max_tokens=mts[i % 5], ignore_eos=True) for i in range(8)]
    plain = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    llm = _dflash_llm(llama_target, k, full_block=full_block)
    assert llm.speculator.num_block_tokens == (16 if full_block else k + 1)
    for bs in (1, 2, 3, 5, 8):
        assert [o.token_ids for o in llm.generate(prompts[:bs], params[:bs])] == plain[:bs]
    assert llm.engine.stats.spec.num_drafted_tokens > 0


@pytest.mark.parametrize("k, graphs", [(3, False), (15, False), (3, True), (7, True)])
def test_stacked_drafter_is_lossless_greedy_seeded_and_with_stops(llama_target, k, graphs):
    """A drafter with stacked q/k/v and gate/up weights (stack_projections, as on CUDA; its context
    K/V of every layer in one matmul) in the engine: greedy at batch sizes 1-8, seeded T = 0.9 and
    stop ids met inside a draft block all give plain decoding's tokens, while the drafter proposes
    and gets drafts accepted. graphs: the CUDA-graph step code run eagerly (DraftStep: verification,
    input preparation and the 16-row draft block in `uniform_step_inputs`, padded buckets)."""
    prompts = random_prompts(8, seed=70 + k)
    greedy = [SamplingParams(max_tokens=[1, k, k + 2, 40][i % 4], ignore_eos=True) for i in range(8)]
    sampled = [SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True) for i in range(8)]
    plain_llm = make_llm(llama_target)
    plain_greedy = [o.token_ids for o in plain_llm.generate(prompts, greedy)]
    plain_sampled = [o.token_ids for o in plain_llm.generate(prompts, sampled)]
    # stop on a token each greedy answer emits at its 4th position or later (inside a verify block)
    stops = [SamplingParams(max_tokens=40, stop_token_ids=[t[min(len(t) - 1, 5)]]) for t in plain_greedy]
    plain_stops = [(o.token_ids, o.finish_reason) for o in plain_llm.generate(prompts, stops)]
    graph_kw = dict(attention_backend="dense", graph_mode="eager", max_num_seqs=8) if graphs else {}
    llm = _dflash_llm(llama_target, k, stacked=True, **graph_kw)
    assert llm.speculator.drafter.stacked and llm.speculator.drafter.context_kv_weight is not None
    assert (llm.engine.runner.graphs is not None and llm.engine.runner.graphs.draft is not None) == graphs
    for bs in (1, 3, 8):
        assert [o.token_ids for o in llm.generate(prompts[:bs], greedy[:bs])] == plain_greedy[:bs]
    assert [o.token_ids for o in llm.generate(prompts, sampled)] == plain_sampled
    assert [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, stops)] == plain_stops
    spec = llm.engine.stats.spec
    assert spec.num_drafted_tokens > 0 and spec.num_accepted_tokens > 0


def test_dflash_seeded_sampling_and_chunked_prefill_parity(llama_target):
    prompts = random_prompts(4, seed=60, low=10, high=30)
    params = [SamplingParams(max_tokens=30, temperature=0.9, top_k=20, top_p=0.95, seed=i, ignore_eos=True) for i in range(4)]
    plain = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    llm = _dflash_llm(llama_target, 5, max_num_batched_tokens=9)  # prefills in chunks, drafts trimmed to the budget
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain


@pytest.mark.parametrize("k", [1, 3, 15])
def test_unseeded_sampling_under_the_engine_seed_is_lossless(llama_target, k):
    """LLM(seed=0) is the default (vLLM V1's engine seed): unseeded sampled requests draw their seeds
    from one stream in the order they are queued, so DFlash gives plain decoding's tokens for them
    too, at batch sizes 1-6 and with stop ids met inside a draft block; a plain engine with another
    engine seed samples otherwise (the negative control: the seeds, not chance, make them equal)."""
    prompts = random_prompts(6, seed=70 + k, low=6, high=20)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, ignore_eos=True)  # no seed of its own
    plain = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    stops = [SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=[t[min(len(t) - 1, k + 1)]])
             for t in plain]
    plain_stops = [o.token_ids for o in make_llm(llama_target).generate(prompts, stops)]
    for bs in (1, 2, 6):
        assert [o.token_ids for o in _dflash_llm(llama_target, k).generate(prompts[:bs], params)] == plain[:bs]
    llm = _dflash_llm(llama_target, k)
    assert [o.token_ids for o in llm.generate(prompts, stops)] == plain_stops
    assert llm.engine.stats.spec.num_drafted_tokens > 0
    assert [o.token_ids for o in make_llm(llama_target, seed=1).generate(prompts, params)] != plain


def _streamed_texts(engine, prompts, params) -> list[str]:
    """Each request's text as a streaming server reads it: after every engine step (only growing)."""
    texts = {f"s{i}": "" for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", prompt, p)
    while engine.has_unfinished_requests():
        for o in engine.step(stream=True):
            assert o.text.startswith(texts[o.request_id]), (o.request_id, texts[o.request_id], o.text)
            texts[o.request_id] = o.text
    return list(texts.values())


def test_text_read_once_equals_text_read_every_step_and_dflash_equals_plain(llama_target):
    """Without stop strings a request's text is decoded when read: `LLM.generate` reads it once at
    the end, a streaming engine every step (DFlash commits up to K + 1 tokens per step). Both give
    the same text, and DFlash gives plain decoding's, greedy and seeded T > 0."""
    prompts = random_prompts(6, seed=31)
    params = [SamplingParams(max_tokens=(5, 17, 30)[i % 3], ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
              for i in range(6)]
    texts = {}
    for name, llm in (("plain", make_llm(llama_target)), ("dflash", _dflash_llm(llama_target, 3))):
        once = [o.text for o in llm.generate(prompts, params)]
        assert _streamed_texts(llm.engine, prompts, params) == once, name
        texts[name] = once
    assert texts["dflash"] == texts["plain"] and all(texts["plain"])


def test_mask_token_equal_to_an_emitted_token_and_a_stop_id_changes_nothing(llama_target):
    prompt = random_prompts(1, seed=70)[0]
    full = make_llm(llama_target).generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    mask = full[4]
    for params in (
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[mask]),
    ):
        plain = make_llm(llama_target).generate([prompt], params)[0]
        spec = _dflash_llm(llama_target, 7, mask_token_id=mask).generate([prompt], params)[0]
        assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason


def _exact_third_token_distribution(target, prompt, temperature):
    """P(output[2] = v), marginalised over output[0] and output[1], from the target's logits (float64)."""
    vocab = target.config.vocab_size
    # logprobs over the whole (tiny) vocabulary: above the default limit of 20 (vLLM's max_logprobs)
    llm = make_llm(target, max_num_seqs=256, max_num_batched_tokens=4096, max_logprobs=vocab)
    with torch.inference_mode():
        p0 = _next_probs(llm, [prompt], temperature)[0]  # [V]
        p1 = _next_probs(llm, [prompt + [a] for a in range(vocab)], temperature)  # [V, V]
        p2 = _next_probs(llm, [prompt + [a, b] for a in range(vocab) for b in range(vocab)], temperature)
    joint01 = p0[:, None] * p1  # [V, V]
    return (joint01.reshape(-1, 1) * p2).sum(0)


def _next_probs(llm, seqs, temperature):
    vocab = llm.target.config.vocab_size
    outs = llm.generate(seqs, SamplingParams(max_tokens=1, logprobs=vocab))
    logp = torch.empty(len(seqs), vocab, dtype=torch.float64)
    for i, o in enumerate(outs):
        ids, lps = zip(*o.logprobs[0]["top"])
        logp[i, list(ids)] = torch.tensor(lps, dtype=torch.float64)
    return torch.softmax(logp / temperature, dim=-1)  # logprobs are log-softmax of the raw logits


def _spec_third_tokens(target, prompt, n, temperature):
    # max_tokens=4: after the prefill token, one verify step with 2 drafts decides output[1:3]
    llm = _dflash_llm(target, 3, max_num_seqs=256)
    params = [SamplingParams(max_tokens=4, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
    return [o.token_ids[2] for o in llm.generate([prompt] * n, params)]


def _chi2_pvalue(samples, probs):
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs * len(samples)
    big = expected >= 5  # pool rare tokens into one bin so the chi-square approximation holds
    obs, exp = counts[big], expected[big]
    if (~big).any():
        obs = torch.cat([obs, counts[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    return chisquare(obs.numpy(), exp.numpy()).pvalue


def test_distribution_of_verified_tokens_matches_the_target_and_a_broken_verifier_fails(monkeypatch):
    small = tiny_target("qwen3", seed=1, vocab_size=32, logit_scale=2.0)  # small vocab: exact marginal is cheap
    prompt = [t % 32 for t in random_prompts(1, seed=80)[0]]
    t = 1.0
    probs = _exact_third_token_distribution(small, prompt, t)
    samples = _spec_third_tokens(small, prompt, 2000, t)
    assert _chi2_pvalue(samples, probs) > 1e-3
    # negative control: a verifier that accepts every draft conditions output[2] on an unverified draft
    monkeypatch.setattr(model_runner, "verify_drafts", lambda target, drafts, num_drafts: num_drafts.clone())
    broken = _spec_third_tokens(small, prompt, 2000, t)
    assert _chi2_pvalue(broken, probs) < 1e-6
