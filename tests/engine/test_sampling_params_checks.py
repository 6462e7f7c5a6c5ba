"""SamplingParams fields changed after construction are checked again when the engine takes the
request, and sampling_params of another type (a dict) is refused with a TypeError that says how."""

from __future__ import annotations

import pytest

from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm

PROMPT = [[1, 2, 3]]


@pytest.fixture(scope="module")
def llm(llama_target):
    return make_llm(llama_target)


def _set(**fields):
    def change(p):
        for name, value in fields.items():
            setattr(p, name, value)
    return change


@pytest.mark.parametrize("change, match", [
    (_set(detokenize=False, stop=["x"]), r"stop strings \['x'\] need the output text"),
    (_set(max_tokens=0), r"^max_tokens must be an integer >= 1, got 0"),
    (_set(temperature=-1), r"^temperature must be a finite number >= 0 and <= 3.40282e\+38 \(float32's largest\), got -1"),
    (_set(top_p=2.0), r"^top_p must be in \(0, 1\], got 2.0"),
    (_set(min_p=2.0), r"^min_p must be a number in \[0, 1\] \(0 = off\), got 2.0"),
    (_set(stop_token_ids=[-3]), r"stop_token_ids entry must be an integer >= 0, got -3"),
    (_set(stop=5), r"^stop must be a string, a list of strings or None, got 5"),
    (_set(skip_special_tokens=None), r"^skip_special_tokens must be True or False, got None"),
    (_set(spaces_between_special_tokens=1), r"^spaces_between_special_tokens must be True or False, got 1"),
])
def test_fields_changed_after_construction_are_checked_when_the_request_is_added(llm, change, match):
    p = SamplingParams(max_tokens=4)
    change(p)
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPT * 2, [SamplingParams(max_tokens=4), p])  # the good first one is not queued either
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request("mutated", PROMPT[0], p)
    assert not llm.engine.has_unfinished_requests()


def test_a_seed_set_after_construction_is_the_one_used(llm):
    late = SamplingParams(max_tokens=8, temperature=1.0)
    late.seed = 7
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    assert llm.generate(PROMPT, late)[0].token_ids == llm.generate(PROMPT, seeded)[0].token_ids
    late.stop = "w01x"  # a string set later is one stop string, as at construction
    llm.generate(PROMPT, late)
    assert late.stop == ["w01x"]


@pytest.mark.parametrize("given, match", [
    ({"max_tokens": 3}, r"got dict \{'max_tokens': 3\}: build one with SamplingParams\(\*\*params\)"),
    ({}, r"got dict \{\}: build one with SamplingParams\(\*\*params\)"),
    ([SamplingParams(), {"max_tokens": 3}], r"got dict \{'max_tokens': 3\} \(item 1 of the list\)"),
    (3, r"got int 3$"),
])
def test_sampling_params_of_another_type_is_a_type_error(llm, given, match):
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams or a list of them \(one per "
                                        r"prompt\), " + match):
        llm.generate(PROMPT * 2, given)
    with pytest.raises(TypeError, match=r"sampling params must be a SamplingParams, got dict"):
        llm.engine.add_request("dict", PROMPT[0], {"max_tokens": 3})
    assert not llm.engine.has_unfinished_requests()


def test_logprobs_above_the_engine_limit_is_refused_at_submission(llama_target):
    # SamplingParams itself takes any logprobs >= 0: the limit belongs to the engine (vLLM's max_logprobs)
    assert SamplingParams(logprobs=21).logprobs == 21
    llm = make_llm(llama_target)  # default max_logprobs=20
    assert llm.engine.max_logprobs == 20
    with pytest.raises(ValueError, match=r"^logprobs must be <= 20 \(the engine's max_logprobs; .*got 21$") as e:
        llm.generate(PROMPT * 2, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logprobs=21)])
    assert e.value.param == "logprobs"  # the CLI names its flag through param_error
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=20))[0].logprobs[0]["top"]) == 20
    small = make_llm(llama_target, max_logprobs=2)
    with pytest.raises(ValueError, match=r"^logprobs must be <= 2 .*got 3$"):
        small.engine.add_request("too-many", PROMPT[0], SamplingParams(max_tokens=2, logprobs=3))
    assert not small.engine.has_unfinished_requests()


@pytest.mark.parametrize("bad", [-1, 2.5, True, None])
def test_max_logprobs_is_checked_before_any_weights_load(bad, monkeypatch):
    import blockdraft.llm
    import blockdraft.model_loader

    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ValueError, match=rf"^max_logprobs must be an integer >= 0, got {bad!r}$"):
        blockdraft.llm.LLM("smollm2-135m-instruct", max_logprobs=bad)


@pytest.mark.parametrize("field, value, match", [
    ("top_k", 2**63, r"^top_k must be an integer: 0 or -1 \(off\) or in \[1, 2\*\*63 - 1\], got 9223372036854775808$"),
    ("min_tokens", 2**64, r"^min_tokens must be an integer in \[0, 2\*\*63 - 1\], got 18446744073709551616$"),
    ("max_tokens", 10**30, r"^max_tokens must be an integer in \[1, 2\*\*63 - 1\], got 10{30}$"),
    ("temperature", 1e39, r"^temperature must be a finite number >= 0 and <= 3.40282e\+38 \(float32's largest\), "
                          r"got 1e\+39$"),
    ("repetition_penalty", 3.5e38, r"^repetition_penalty must be a number > 0 and <= 3.40282e\+38 \(float32's largest; "
                                   r"1 = off\), got 3.5e\+38$"),
])
def test_values_the_engine_cannot_hold_in_its_tensors_are_refused_by_name(field, value, match):
    """A server trial's request with top_k 2**63 or repetition_penalty 3.5e38 stopped the engine for
    every client (int64 / float32 overflow while building the step's tensors): refused up front."""
    with pytest.raises(ValueError, match=match) as e:
        SamplingParams(**{"max_tokens": 4, field: value})
    assert e.value.param == field


def test_the_largest_accepted_values_run_and_tiny_temperatures_decode_greedily(llm):
    """The bounds' own values run (top_k 2**63 - 1 keeps every token); a temperature below 1e-5
    decodes greedily, as vLLM (dividing by 1e-38 overflowed float32 and sampled garbage)."""
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    for t in (1e-38, 1e-45, 9e-6):
        p = SamplingParams(max_tokens=6, temperature=t, seed=3, ignore_eos=True)
        assert p.temperature == 0.0 and p.greedy
        assert llm.generate(PROMPT, p)[0].token_ids == greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # at the threshold: sampled
    edge = SamplingParams(max_tokens=6, top_k=2**63 - 1, repetition_penalty=3.4028234663852886e38, min_tokens=2,
                          temperature=0.7, seed=1)
    assert len(llm.generate(PROMPT, edge)[0].token_ids) >= 2
    assert not llm.engine.has_unfinished_requests()


def test_min_p_takes_0_to_1_and_its_errors_name_it():
    """vLLM's min_p: a number in [0, 1], 0 (the default) = off; an int 0 or 1 is a number too."""
    assert SamplingParams().min_p == 0.0
    for ok in (0, 0.0, 1e-9, 0.05, 0.5, 1, 1.0):
        assert SamplingParams(temperature=1.0, min_p=ok).min_p == ok
    for bad in (-1e-9, 1.0000001, float("inf"), float("-inf"), float("nan"), "0.1", True, None, [0.1]):
        with pytest.raises(ValueError, match=r"^min_p must be a number in \[0, 1\] \(0 = off\), got ") as e:
            SamplingParams(min_p=bad)
        assert e.value.param == "min_p" and repr(bad) in str(e.value)


def test_numpy_numbers_are_taken_as_python_ones(llm):
    """A vLLM script may pass numpy scalars (np.float32 top_p, np.int64 max_tokens): taken as the
    int / float they hold (before, refused as if out of range); the same tokens as Python numbers."""
    np = pytest.importorskip("numpy")
    given = SamplingParams(max_tokens=np.int64(6), temperature=np.float32(0.5), top_p=np.float32(0.75),
                           top_k=np.int16(20), min_p=np.float64(0.05), seed=np.int32(3), n=np.int8(1),
                           stop_token_ids=[np.int64(7)], presence_penalty=np.float16(0.5), min_tokens=np.uint8(1),
                           ignore_eos=True)
    for name in ("max_tokens", "top_k", "seed", "n", "min_tokens"):
        assert type(getattr(given, name)) is int, name
    for name in ("temperature", "top_p", "min_p", "presence_penalty"):
        assert type(getattr(given, name)) is float, name
    assert given.stop_token_ids == [7] and type(given.stop_token_ids[0]) is int
    plain = SamplingParams(max_tokens=6, temperature=float(np.float32(0.5)), top_p=float(np.float32(0.75)), top_k=20,
                           min_p=0.05, seed=3, stop_token_ids=[7], presence_penalty=0.5, min_tokens=1, ignore_eos=True)
    assert llm.generate(PROMPT, given)[0].token_ids == llm.generate(PROMPT, plain)[0].token_ids


@pytest.mark.parametrize("field, value, match", [
    ("top_p", True, r"^top_p must be in \(0, 1\], got True$"),  # a bool is not a number here (as for temperature)
    ("max_tokens", 3.0, r"^max_tokens must be an integer >= 1, got 3.0$"),
    ("temperature", "0.5", r"^temperature must be a number >= 0, got '0.5'$"),
])
def test_non_numbers_stay_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_clone_is_a_deep_copy(llm):
    """vLLM's SamplingParams.clone(): the copy's lists and logit_bias are its own; it samples alike."""
    p = SamplingParams(max_tokens=6, temperature=0.9, seed=5, stop=["x"], stop_token_ids=[7], logit_bias={3: 1.0},
                       ignore_eos=True)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y"), q.stop_token_ids.append(8), q.logit_bias.update({4: 2.0})
    assert (p.stop, p.stop_token_ids, p.logit_bias) == (["x"], [7], {3: 1.0})
    assert llm.generate(PROMPT, p.clone())[0].token_ids == llm.generate(PROMPT, p)[0].token_ids


@pytest.mark.parametrize("kw, words", [
    (dict(guided_decoding={"json": {}}), "takes vLLM's guided_decoding only as None (it changes nothing here), "
                                         "got {'json': {}}: use structured_outputs="),
    (dict(best_of=2), "takes vLLM's best_of only as None or 1 (it changes nothing here), got 2: not supported: "
                      "n=N returns N completions"),
    (dict(logits_processors=[print]), "custom logits processors are not supported"),
    (dict(use_beam_search=True), "takes vLLM's use_beam_search only as None or False (it changes nothing here), got "
                                 "True: beam search is not supported"),
    (dict(max_token=4), "unexpected keyword argument 'max_token'; did you mean max_tokens"),
    (dict(zzz=1), "unexpected keyword argument 'zzz'"),
])
def test_unknown_fields_say_what_to_use_instead(kw, words):
    """A bare dataclass TypeError said nothing of vLLM's names (a trial ported guided_decoding)."""
    with pytest.raises(TypeError, match="^SamplingParams\\(\\) ") as e:
        SamplingParams(**kw)
    assert words in str(e.value)


def test_vllm_fields_at_values_that_change_nothing_are_taken():
    """A ported vLLM script's best_of=None / guided_decoding=None runs (a trial found them refused)."""
    plain = SamplingParams(max_tokens=5, n=2, seed=1)
    ported = SamplingParams(max_tokens=5, n=2, seed=1, best_of=2, guided_decoding=None, logits_processors=[],
                            output_kind=None, extra_args={}, use_beam_search=False)
    assert ported == plain and SamplingParams(seed=3, best_of=None) == SamplingParams(seed=3, best_of=1) == SamplingParams(seed=3)


def test_copies_keep_working_with_the_field_check():
    import copy
    import dataclasses
    import pickle

    p = SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop=["x"])
    assert copy.deepcopy(p) == p == pickle.loads(pickle.dumps(p)) == p.clone()
    assert dataclasses.replace(p, top_k=3).top_k == 3 and SamplingParams(7).max_tokens == 7
