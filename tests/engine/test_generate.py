"""End-to-end engine behaviour on a tiny random target (fp32, CPU)."""

import dataclasses

import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import EOS_ID, make_llm, random_prompts, word


def _ids(outs):
    return [o.token_ids for o in outs]


def _alone(llm, prompts, params):
    return [llm.generate([p], params)[0].token_ids for p in prompts]


def test_greedy_batch_of_8_equals_each_prompt_alone(llama_target):
    llm = make_llm(llama_target)
    prompts = random_prompts(8, seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert _ids(llm.generate(prompts, params)) == _alone(llm, prompts, params)


@pytest.mark.parametrize(
    "kw",
    [
        dict(kv_block_size=1),
        dict(kv_block_size=16),
        dict(kv_block_size=3, max_num_batched_tokens=5),  # chunked prefill across page boundaries
        dict(kv_block_size=4, max_num_batched_tokens=7, max_num_seqs=3),
    ],
)
def test_paging_and_chunked_prefill_do_not_change_tokens(llama_target, kw):
    prompts = random_prompts(6, seed=2)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = _ids(make_llm(llama_target, kv_block_size=8).generate(prompts, params))
    assert _ids(make_llm(llama_target, **kw).generate(prompts, params)) == ref


def test_preemption_and_recompute_keep_tokens_identical(llama_target):
    prompts = random_prompts(6, seed=3, low=8, high=16)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = _ids(make_llm(llama_target, kv_block_size=4).generate(prompts, params))
    small = make_llm(llama_target, kv_block_size=4, num_kv_blocks=24)  # far fewer pages than 6 requests need
    outs = small.generate(prompts, params)
    assert _ids(outs) == ref
    assert small.engine.scheduler.kv.num_free_blocks == 24
    assert small.engine.stats.num_steps > 0


def test_preemption_really_happens_with_a_small_pool(llama_target):
    llm = make_llm(llama_target, kv_block_size=4, num_kv_blocks=24)
    seen = []
    orig = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda r: (seen.append(r.request_id), orig(r))
    llm.generate(random_prompts(6, seed=3, low=8, high=16), SamplingParams(max_tokens=30, ignore_eos=True))
    assert seen
    assert llm.engine.scheduler.num_preemptions == len(seen)  # vLLM's num_preemptions: every one counted

    from blockdraft.server.metrics import Metrics

    m = Metrics()
    m.on_step(llm.engine, [])
    m.on_step(llm.engine, [])  # only what happened since the last step is added
    assert m.registry.get_sample_value("blockdraft_num_preemptions_total") == len(seen)


def test_seeded_sampling_is_reproducible_alone_or_batched(llama_target):
    llm = make_llm(llama_target)
    prompts = random_prompts(4, seed=4)
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=40, seed=100 + i, ignore_eos=True) for i in range(4)]
    batched = _ids(llm.generate(prompts, params))
    alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert batched == alone
    again = _ids(make_llm(llama_target).generate(prompts, params))
    assert again == batched


def test_different_seeds_give_different_tokens(llama_target):
    llm = make_llm(llama_target)
    p = random_prompts(1, seed=5)
    a = llm.generate(p, SamplingParams(max_tokens=32, temperature=1.0, seed=1, ignore_eos=True))[0].token_ids
    b = llm.generate(p, SamplingParams(max_tokens=32, temperature=1.0, seed=2, ignore_eos=True))[0].token_ids
    assert a != b


def test_stop_conditions(llama_target):
    llm = make_llm(llama_target)
    p = random_prompts(1, seed=6)
    full = llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    stop_tok = full.token_ids[5]
    first = full.token_ids.index(stop_tok)
    by_id = llm.generate(p, SamplingParams(max_tokens=24, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert by_id.token_ids == full.token_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_tok
    stop_str = word(full.token_ids[7])
    by_str = llm.generate(p, SamplingParams(max_tokens=24, stop=[stop_str], ignore_eos=True))[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop_str
    assert stop_str not in by_str.text.split()
    assert full.text.startswith(by_str.text)


def test_without_detokenize_the_tokens_are_the_same_and_the_text_is_empty(llama_target):
    llm = make_llm(llama_target)
    prompts = random_prompts(6, seed=8)
    params = [SamplingParams(max_tokens=20, temperature=0.7 * (i % 2), seed=i, stop_token_ids=[5]) for i in range(6)]
    with_text = llm.generate(prompts, params)
    no_text = llm.generate(prompts, [dataclasses.replace(p, detokenize=False) for p in params])
    assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in no_text] == [
        (o.token_ids, o.finish_reason, o.stop_reason) for o in with_text
    ]
    assert all(o.text for o in with_text) and all(o.text == "" for o in no_text)


def test_eos_stops_unless_ignored(llama_target):
    llm = make_llm(llama_target)
    llm.engine.eos_token_ids = (EOS_ID,)
    p = random_prompts(1, seed=6)
    full = llm.generate(p, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    llm.engine.eos_token_ids = (full.token_ids[3],)
    out = llm.generate(p, SamplingParams(max_tokens=24))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == full.token_ids[3]
    assert len(out.token_ids) == full.token_ids.index(full.token_ids[3]) + 1


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_tokens=0), r"^max_tokens must be an integer >= 1, got 0"),
        (dict(temperature=-0.1), r"^temperature must be a finite number >= 0 and <= 3.40282e\+38 \(float32's largest\), got -0.1"),
        (dict(temperature=float("inf")), r"^temperature must be a finite number >= 0 and <= 3.40282e\+38 \(float32's largest\), got inf"),
        (dict(top_p=0.0), r"^top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"^top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-2), r"^top_k must be an integer: 0 or -1 \(off\) or in \[1, 2\*\*63 - 1\], got -2"),
        (dict(min_p=-0.1), r"^min_p must be a number in \[0, 1\] \(0 = off\), got -0.1$"),
        (dict(min_p=1.5), r"^min_p must be a number in \[0, 1\] \(0 = off\), got 1.5$"),
        (dict(min_p=float("nan")), r"^min_p must be a number in \[0, 1\] \(0 = off\), got nan$"),
        (dict(min_p="0.1"), r"^min_p must be a number in \[0, 1\] \(0 = off\), got '0.1'$"),
        (dict(min_p=True), r"^min_p must be a number in \[0, 1\] \(0 = off\), got True$"),
        (dict(min_p=None), r"^min_p must be a number in \[0, 1\] \(0 = off\), got None$"),
        (dict(seed=-1), r"^seed must be an integer >= 0, got -1"),
        (dict(detokenize=0), r"detokenize must be True or False, got 0"),
        (dict(ignore_eos="yes"), r"ignore_eos must be True or False, got 'yes'"),
        (dict(skip_special_tokens=0), r"skip_special_tokens must be True or False, got 0"),
        (dict(spaces_between_special_tokens="no"), r"spaces_between_special_tokens must be True or False, got 'no'"),
        (dict(stop=["w01x"], detokenize=False), r"stop strings \['w01x'\] need the output text"),
        (dict(stop=5), r"^stop must be a string, a list of strings or None, got 5"),  # a str is allowed
        (dict(stop_token_ids=7), r"^stop_token_ids must be a list of token ids \(integers >= 0\) or None, got 7"),
    ],
)
def test_bad_sampling_params_name_the_value_and_the_parameter(kw, match):
    # The Python API names the parameter only; the CLI adds the flag (test_fail_fast).
    with pytest.raises(ValueError, match=match) as info:
        SamplingParams(**kw)
    assert "--" not in str(info.value)


def test_empty_and_too_long_prompts_are_refused(llama_target):
    llm = make_llm(llama_target)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="600 tokens but the engine's context is 512"):
        llm.generate([[1] * 600], SamplingParams())


def test_an_empty_prompt_list_gives_an_empty_list_without_stepping(llama_target, monkeypatch):
    """vLLM's LLM.generate([]) returns []; so does ours, without running the engine (a request
    queued on the engine by other code is left as it was). Wrong types are still refused."""
    llm = make_llm(llama_target)
    llm.engine.add_request("other", [1, 2, 3], SamplingParams(max_tokens=4))
    monkeypatch.setattr(llm.engine, "step", lambda *a, **k: pytest.fail("the engine was stepped"))
    assert llm.generate([]) == []
    assert llm.generate((), SamplingParams(max_tokens=3)) == []
    assert llm.generate([], []) == []
    assert llm.engine.has_unfinished_requests()  # "other" is untouched
    with pytest.raises(ValueError, match=r"prompts must be a str, .* got NoneType None"):
        llm.generate(None)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams .* got dict"):
        llm.generate([], {"max_tokens": 3})
    with pytest.raises(ValueError, match="got 1 SamplingParams for 0 prompts"):
        llm.generate([], [SamplingParams()])


def test_one_unseeded_sampling_params_samples_every_request_independently(llama_target):
    """vLLM: seed=None means independent samples, also when one SamplingParams serves several
    prompts or several calls (it drew one seed at construction for all of them)."""
    llm = make_llm(llama_target)
    prompt = random_prompts(1, seed=8)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    batch = _ids(llm.generate([prompt] * 3, params))
    again = _ids(llm.generate([prompt], params))
    assert len({tuple(t) for t in batch + again}) == 4
    assert params.seed is None  # the caller's object is left as it was
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    assert len({tuple(t) for t in _ids(llm.generate([prompt] * 3, seeded))}) == 1


def test_n_completions_per_prompt_as_vllm_outputs(llama_target):
    """SamplingParams(n=3): one RequestOutput per prompt whose `outputs` are the 3 completions;
    seeded, completion j is the seed + j run; unseeded they differ; n = 1 gives outputs[0] == itself."""
    llm = make_llm(llama_target)
    prompts = random_prompts(2, seed=12)
    kw = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    outs = llm.generate(prompts, SamplingParams(n=3, seed=40, **kw))
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    for prompt, o in zip(prompts, outs):
        alone = [llm.generate([prompt], SamplingParams(seed=40 + j, **kw))[0].token_ids for j in range(3)]
        assert [c.token_ids for c in o.outputs] == alone and [c.index for c in o.outputs] == [0, 1, 2]
        assert o.token_ids == o.outputs[0].token_ids and o.text == o.outputs[0].text
    unseeded = llm.generate(prompts[:1], SamplingParams(n=3, **kw))[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) == 3
    single = llm.generate(prompts[:1], SamplingParams(**kw))[0]
    assert [c.token_ids for c in single.outputs] == [single.token_ids] and single.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="n must be an integer >= 1, got 0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be 1 for an LLMEngine request"):
        llm.engine.add_request("x", prompts[0], SamplingParams(n=2))
    with pytest.raises(ValueError, match="generate_stream streams one completion: n must be 1, got 2"):
        llm.generate_stream(prompts[0], SamplingParams(n=2))


def test_llm_seed_makes_unseeded_runs_reproducible(llama_target):
    """LLM(seed=...) as vLLM's: unseeded requests draw their seeds from one seeded stream, so two
    engines built with the same seed give the same samples (and each request still its own)."""
    prompts = random_prompts(3, seed=13)
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, logprobs=0)
    a = make_llm(llama_target, seed=7).generate(prompts, params)
    b = make_llm(llama_target, seed=7).generate(prompts, params)
    assert _ids(a) == _ids(b) and len({tuple(t) for t in _ids(a)}) == 3
    assert _ids(make_llm(llama_target, seed=8).generate(prompts, params)) != _ids(a)
    c = a[0].outputs[0]
    assert c.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in a[0].logprobs)) and c.cumulative_logprob < 0
    assert c.finished() and c.finish_reason == "length"  # vLLM's CompletionOutput.finished()
    with pytest.raises(ValueError, match="seed must be None or an integer >= 0, got -1"):
        make_llm(llama_target, seed=-1)
    # the default is 0, as vLLM V1's: a script's unseeded sampling repeats from run to run
    assert _ids(make_llm(llama_target).generate(prompts, params)) == _ids(make_llm(llama_target, seed=0).generate(
        prompts, params))


def test_fp32_lm_head_is_refused_off_cuda_and_for_a_non_bool(llama_target):
    """LLM(enable_fp32_lm_head=...) as vLLM's flag, CUDA only here (torch.mm out_dtype): a clear error
    naming the parameter on the CPU, and for a value that is not a bool (e.g. the string "false")."""
    with pytest.raises(ValueError, match=r"enable_fp32_lm_head runs on CUDA only, the device is 'cpu'") as e:
        make_llm(llama_target, enable_fp32_lm_head=True)
    assert e.value.param == "enable_fp32_lm_head"
    with pytest.raises(ValueError, match="enable_fp32_lm_head must be True or False, got 'false'"):
        make_llm(llama_target, enable_fp32_lm_head="false")
    with pytest.raises(ValueError, match="enforce_eager must be True or False, got 'yes'"):  # was taken as on
        make_llm(llama_target, enforce_eager="yes")
    assert make_llm(llama_target, enable_fp32_lm_head=False).generate([[5, 6]], SamplingParams(max_tokens=2))


def test_batch_invariant_is_cuda_only_and_refused_for_a_non_bool_or_a_non_triton_backend(llama_target):
    """LLM(batch_invariant=True) as vLLM's VLLM_BATCH_INVARIANT, CUDA only here: on the CPU a
    prompt's prefill attention depends on its chunking (a trial: 5 of 33 SmolLM2 bf16 answers moved
    with --max-num-batched-tokens 64), which the mode does not change, so it is refused by name
    before any weights load; on CUDA it needs the Triton kernels."""
    from blockdraft.runner.setup import check_batch_invariant

    with pytest.raises(ValueError, match=r"batch_invariant runs on CUDA only, the device is 'cpu'") as e:
        make_llm(llama_target, batch_invariant=True)
    assert e.value.param == "batch_invariant"
    with pytest.raises(ValueError, match="batch_invariant must be True or False, got 1"):
        make_llm(llama_target, batch_invariant=1)
    refusal = "batch_invariant on CUDA needs the 'triton' attention backend .*got 'dense'"
    with pytest.raises(ValueError, match=refusal) as e:
        check_batch_invariant(True, "cuda", "dense")
    assert e.value.param == "batch_invariant"
    check_batch_invariant(False, "cuda", "dense")
    assert make_llm(llama_target, batch_invariant=False).generate([[5, 6]], SamplingParams(max_tokens=2))


def test_an_interrupted_generate_aborts_its_requests(llama_target, monkeypatch):
    """Ctrl-C inside generate (a notebook): the call's requests are aborted and their pages freed, so
    the next call does not first decode what this one abandoned."""
    llm = make_llm(llama_target)
    step, calls = llm.engine.step, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*a, **kw)

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(3, seed=9), SamplingParams(max_tokens=200, ignore_eos=True))
    monkeypatch.setattr(llm.engine, "step", step)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.num_free_blocks == 256
    out = llm.generate(random_prompts(1, seed=10), SamplingParams(max_tokens=5, ignore_eos=True))
    assert out[0].num_output_tokens == 5 and llm.engine.stats.num_steps < 12


def test_kv_pool_is_fully_free_after_generation_and_abort(llama_target):
    llm = make_llm(llama_target)
    llm.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.step()
    llm.engine.abort_request("x")
    outs = llm.engine.step()
    assert outs and outs[0].finish_reason == "abort"
    assert llm.engine.scheduler.kv.num_free_blocks == 256


def test_cli_refuses_speculative_flags_that_would_be_ignored(capsys):
    from blockdraft.cli import main

    assert main(["generate", "hi", "--no-draft", "--num-speculative-tokens", "3"]) == 2
    assert "--num-speculative-tokens needs a drafter" in capsys.readouterr().err
    assert main(["generate", "hi", "--draft", "shipped", "--no-draft"]) == 2
    assert "contradict" in capsys.readouterr().err


def test_a_request_longer_than_the_kv_pool_finishes_by_length_instead_of_hanging(llama_target):
    llm = make_llm(llama_target, num_kv_blocks=4, kv_block_size=4)  # 16 tokens of KV in all
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16 - 5
    with pytest.raises(ValueError, match="20 tokens but the engine's context is 16"):
        llm.generate([[1] * 20], SamplingParams())
