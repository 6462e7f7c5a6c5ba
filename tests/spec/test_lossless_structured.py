"""Structured outputs stay lossless under speculation: every verify row is masked with the grammar
state after the drafts before it, so oracle drafts (whole blocks accepted), half-right drafts,
random drafts and a DFlash drafter give plain decoding's constrained output token for token,
greedy and seeded, in batches mixed with unconstrained requests, under KV-pool preemption; the
outputs follow their constraints and end when the grammar completes."""

import dataclasses
import json
import math
import re

import pytest

from blockdraft import SamplingParams, StructuredOutputsParams as SO
from tests.conftest import EOS_ID, VOCAB, make_ascii_tokenizer, make_llm, random_prompts
from tests.spec.doubles import KnownAnswerSpeculator
from tests.spec.test_lossless_dflash import _dflash_llm, dflash_and_oracle_llms

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 5}},
          "required": ["n", "s"]}
CONSTRAINTS = [
    SO(regex="[a-e]{3,12}"),
    SO(choice=["alpha", "beta", "gamma delta"]),
    SO(json=SCHEMA, disable_any_whitespace=True),
    SO(grammar='start: item ("," item)*\nitem: /[0-9]{1,3}/'),
    None,  # an unconstrained batch mate
    SO(regex="(ab|cd)+!"),
]


@pytest.fixture(scope="module")
def target(llama_target):
    """The tiny llama with a tokenizer llguidance reads (token i = chr(31 + i))."""
    return dataclasses.replace(llama_target, tokenizer=make_ascii_tokenizer())


def _params(temperature: float, max_tokens: int = 40) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured_outputs=so,
                           ignore_eos=so is None) for i, so in enumerate(CONSTRAINTS)]


def _outs(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]


def _follows(so: SO | None, text: str, finish_reason: str) -> bool:
    """Whether a finished output satisfies its constraint (a "length" one only has to be cut short)."""
    if so is None or finish_reason == "length":
        return True
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    if so.choice is not None:
        return text in so.choice
    if so.json is not None:
        value = json.loads(text)
        return set(value) == {"n", "s"} and isinstance(value["n"], int) and len(value["s"]) <= 5
    return re.fullmatch(r"[0-9]{1,3}(,[0-9]{1,3})*", text) is not None


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [3, 7])
def test_constrained_speculative_output_equals_plain(target, temperature, k):
    prompts, params = random_prompts(len(CONSTRAINTS), seed=70 + k), _params(temperature)
    plain = make_llm(target).generate(prompts, params)
    want = _outs(plain)
    for so, o in zip(CONSTRAINTS, plain):
        assert _follows(so, o.text, o.finish_reason), (so, o.text)
    # the choice ends when the grammar does: finish "stop", no EOS token sampled after it
    assert want[1][2] == "stop" and EOS_ID not in want[1][0] and want[1][1] in CONSTRAINTS[1].choice
    answers = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain)}
    engines = dflash_and_oracle_llms(target, k, answers, VOCAB)
    for name, llm in engines.items():
        assert _outs(llm.generate(prompts, params)) == want, name
    # whole blocks were accepted under the masks, completing grammars mid-block included
    assert engines["oracle-1.0"].engine.stats.spec.acceptance_length > 2.5


def test_constrained_requests_survive_preemption(target):
    """A pool far smaller than the batch needs: requests are preempted and recomputed; their grammar
    state (over committed tokens) is kept, so outputs equal the roomy engine's."""
    prompts, params = random_prompts(len(CONSTRAINTS), seed=5), _params(0.0, max_tokens=48)
    want = _outs(make_llm(target).generate(prompts, params))
    small = _dflash_llm(target, 3, num_kv_blocks=24)
    seen, preempt = [], small.engine.scheduler._preempt
    small.engine.scheduler._preempt = lambda r: (seen.append(r.sampling_params.structured_outputs), preempt(r))
    assert _outs(small.generate(prompts, params)) == want
    assert any(so is not None for so in seen)


def test_logprobs_are_those_of_the_masked_logits(target):
    """As vLLM's: a constrained row's distribution covers only the allowed tokens (the others get
    -inf, also among the top alternatives when fewer tokens are allowed)."""
    out = make_llm(target).generate(random_prompts(1, seed=3), SamplingParams(
        max_tokens=6, logprobs=3, structured_outputs=SO(regex="[ab]+")))[0]
    allowed = {ord("a") - 31, ord("b") - 31, EOS_ID}
    assert len(out.logprobs) == len(out.token_ids)
    for entry in out.logprobs:
        top = dict(entry["top"])
        assert entry["token_id"] in allowed and math.isfinite(entry["logprob"])
        assert all(math.isinf(lp) for t, lp in top.items() if t not in allowed)
        assert math.isclose(sum(math.exp(lp) for t, lp in top.items() if t in allowed), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_requests_on_the_graph_step_code(target, async_scheduling):
    """The padded uniform-step code the CUDA graphs capture, run eagerly on the CPU (bitmask applied
    between the target and tail steps), with async scheduling on: constrained requests never
    continue before their tokens are read back, the unconstrained ones still may, and the output is
    plain decoding's."""
    prompts, params = random_prompts(len(CONSTRAINTS), seed=11), _params(0.9)
    want = _outs(make_llm(target).generate(prompts, params))
    kw = dict(attention_backend="dense", graph_mode="eager", max_num_seqs=8, async_scheduling=async_scheduling)
    llm = _dflash_llm(target, 3, stacked=True, **kw)
    assert _outs(llm.generate(prompts, params)) == want
    unconstrained = [SamplingParams(max_tokens=24, ignore_eos=True)] * 3
    llm.generate(random_prompts(3, seed=12), unconstrained)
    assert (llm.engine.stats.num_async_steps > 0) == async_scheduling


def test_tokens_the_grammar_forces_are_drafted_and_accepted(target):
    """Random drafts (never the answer) under a grammar that forces most tokens: the forced tokens
    replace the drafts, so whole blocks are accepted; the output is still plain decoding's."""
    prompts = random_prompts(3, seed=13)
    params = SamplingParams(max_tokens=40, structured_outputs=SO(regex="(the quick brown fox;){2}"))
    plain = make_llm(target).generate(prompts, params)
    assert all(o.text == "the quick brown fox;" * 2 and o.finish_reason == "stop" for o in plain)
    oracle = KnownAnswerSpeculator(7, {}, VOCAB, p_right=0.0, seed=3)  # no answers: random drafts
    llm = make_llm(target, speculator=oracle)
    oracle.engine = llm.engine
    assert _outs(llm.generate(prompts, params)) == _outs(plain)
    assert llm.engine.stats.spec.acceptance_length > 7


def test_ignore_eos_runs_the_grammar_to_its_end(target):
    """With ignore_eos the EOS ids are masked until the grammar is complete: "[a-e]{3,12}" gives
    12 letters (the tiny model would take EOS after 3), speculation or not."""
    prompts = random_prompts(3, seed=14)
    params = SamplingParams(max_tokens=30, ignore_eos=True, logit_bias={EOS_ID: 50.0},
                            structured_outputs=SO(regex="[a-e]{3,12}"))
    plain = make_llm(target).generate(prompts, params)
    assert all(len(o.text) == 12 and o.finish_reason == "stop" for o in plain)
    unblocked = make_llm(target).generate(prompts, dataclasses.replace(params, ignore_eos=False))
    assert all(len(o.text) == 3 for o in unblocked)  # EOS as soon as the grammar allows it
    assert _outs(_dflash_llm(target, 3).generate(prompts, params)) == _outs(plain)


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_a_stop_string_inside_an_accepted_block_under_a_grammar(target, include_stop, temperature):
    """A forced grammar (whole blocks accepted through the forced drafts) with a stop string that
    falls inside a block: the stop cuts the output where plain decoding cuts it, text and
    stop_reason included, with random drafts (K = 7) and a DFlash drafter (K = 3)."""
    prompts = random_prompts(3, seed=15)
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=3, stop=["brown"],
                            include_stop_str_in_output=include_stop,
                            structured_outputs=SO(regex="(the quick brown fox;){2}"))
    plain = _outs(make_llm(target).generate(prompts, params))
    assert all(o[1] == "the quick " + "brown" * include_stop and o[2:] == ("stop", "brown") for o in plain)
    oracle = KnownAnswerSpeculator(7, {}, VOCAB, p_right=0.0, seed=4)
    llm = make_llm(target, speculator=oracle)
    oracle.engine = llm.engine
    assert _outs(llm.generate(prompts, params)) == plain
    assert llm.engine.stats.spec.acceptance_length > 4  # the stop fell inside an accepted block
    assert _outs(_dflash_llm(target, 3).generate(prompts, params)) == plain


@pytest.mark.parametrize("kw", [{}, dict(attention_backend="dense", graph_mode="eager")], ids=["eager", "graph-code"])
def test_grammar_masks_are_computed_after_the_target_forward_is_enqueued(target, monkeypatch, kw):
    """The masks only matter to the sampler, so each step computes them after enqueueing the target
    forward (on CUDA the grammar's host work overlaps the GPU's): in every constrained step the
    forward comes first, and the output is still plain decoding's."""
    from blockdraft.runner import input_batch, model_runner

    prompts, params = random_prompts(len(CONSTRAINTS), seed=13), _params(0.0, max_tokens=24)
    want = _outs(make_llm(target).generate(prompts, params))
    llm = _dflash_llm(target, 3, **kw)
    events = []
    fill = input_batch.fill_bitmasks
    monkeypatch.setattr(input_batch, "fill_bitmasks", lambda *a: (events.append("masks"), fill(*a))[1])
    runner = llm.engine.runner
    for name in ("launch", "_forward", "_replay"):
        inner = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _f=inner, _e=name.strip("_"), **k: (events.append(_e), _f(*a, **k))[1])
    graph_run = None
    if runner.graphs is not None:  # the graph-step code: uniform and prefill steps' target steps
        for graph in (runner.graphs.target, runner.graphs.prefill):
            graph_run = graph.run
            monkeypatch.setattr(graph, "run", lambda *a, _f=graph_run, **k: (events.append("target"), _f(*a, **k))[1])
    assert _outs(llm.generate(prompts, params)) == want
    assert events.count("masks") > 3
    for i, e in enumerate(events):
        if e == "masks":  # within its engine step (since the last launch) the target ran first
            step = events[len(events[:i]) - events[:i][::-1].index("launch") - 1:i]
            assert {"forward", "target"} & set(step), step


def test_a_grammar_that_completes_before_a_fully_masked_row_ends_with_stop_and_no_warning(target, caplog):
    """allowed_token_ids without the EOS and a grammar that completes: the row after the completing
    token allows nothing (the grammar only the EOS, the allowed ids not it), so it samples some
    token. With whole blocks accepted that token lands in the verified block after the completion;
    the request still ends with "stop" at the grammar's end, as in plain decoding, and logs no
    abort warning (found by a trial: the warning was logged for a request that finished well)."""
    from tests.spec.test_lossless_dflash import dflash_and_oracle_llms

    prompts = random_prompts(3, seed=21)
    letters = [ord(c) - 31 for c in "abcde"]  # make_ascii_tokenizer: token i is chr(31 + i)
    params = SamplingParams(max_tokens=20, allowed_token_ids=letters, structured_outputs=SO(regex="abc|dd"))
    plain = make_llm(target).generate(prompts, params)
    assert all(o.finish_reason == "stop" and o.text in ("abc", "dd") for o in plain)
    answers = {tuple(p): list(p) + list(o.token_ids) for p, o in zip(prompts, plain)}
    for name, llm in dflash_and_oracle_llms(target, 3, answers, VOCAB).items():
        caplog.clear()
        with caplog.at_level("WARNING", logger="blockdraft.engine.llm_engine"):
            assert _outs(llm.generate(prompts, params)) == _outs(plain), name
        assert not [r for r in caplog.records if "masked" in r.getMessage()], (name, caplog.text)
