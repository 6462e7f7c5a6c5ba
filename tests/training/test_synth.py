"""Synthesized training prompts (training/synth.py) on the real SmolLM2 target, CPU."""

import pytest

from blockdraft.training.prompts import normalize
from blockdraft.training.synth import pre_query_ids, synthesize_prompts
from tests.training.test_gpu_run_recipe import NAME, _cached

pytestmark = [] if _cached() else [pytest.mark.slow]


@pytest.fixture(scope="module")
def llm():
    from blockdraft.llm import LLM

    return LLM(NAME, dtype="float32", num_kv_blocks=256, max_num_seqs=8)


def test_pre_query_template_ends_where_the_user_content_begins(llm):
    text = llm.tokenizer.decode(pre_query_ids(llm.tokenizer))
    assert text.endswith("<|im_start|>user\n")
    assert text.startswith("<|im_start|>system\n")  # the template's default system turn is kept


def test_synthesized_prompts_are_finished_filtered_and_keep_eval_prompts_out(llm):
    texts, stats = synthesize_prompts(llm, 12, [], seed=5, max_tokens=48)
    assert stats["sampled"] == 12 and stats["unfinished"] + stats["input"] == 12
    assert stats["out_of_time"] == 0 and stats["too_long"] == stats["unfinished"]  # no deadline: cut by max_tokens
    assert stats["kept"] == len(texts) >= 1
    assert len({normalize(t) for t in texts}) == len(texts)
    assert all(16 <= len(t.strip()) <= 2000 for t in texts)
    # Same seed, with one of the kept requests now an evaluation prompt: it is dropped.
    again, stats2 = synthesize_prompts(llm, 12, [texts[0]], seed=5, max_tokens=48)
    assert stats2["eval_overlap"] >= 1 and texts[0] not in again
    assert sorted(again) == sorted(t for t in texts if t != texts[0])


def test_openers_start_each_request_in_turn(llm, monkeypatch):
    """Sample i's request begins with openers[i % len(openers)], written after the pre-query
    template and kept in the text; "" leaves the sample bare."""
    import blockdraft.training.synth as synth

    seen = []  # (prompts, outputs) of each sampling call
    real = synth.generate_with_engine

    def spy(llm_, prompts, *a, **k):
        outs = real(llm_, prompts, *a, **k)
        seen.append((prompts, outs))
        return outs

    monkeypatch.setattr(synth, "generate_with_engine", spy)
    openers = ("Write", "", "Explain why")
    texts, stats = synthesize_prompts(llm, 6, [], seed=5, max_tokens=48, openers=openers)
    pre, tok = pre_query_ids(llm.tokenizer), llm.tokenizer
    prompts, outs = seen[0]
    firsts = [tok.encode(openers[i % 3], add_special_tokens=False) for i in range(6)]
    assert prompts == [pre + f for f in firsts]
    assert stats["sampled"] == 6 and stats["kept"] == len(texts) >= 1
    # each kept request is one sample's opener followed by what the target wrote after it
    finished = {tok.decode(f + o[:-1]) for f, o in zip(firsts, outs) if o and o[-1] in llm.engine.eos_token_ids}
    assert {t.strip() for t in texts} <= {t.strip() for t in finished}
    assert any(t.startswith(("Write", "Explain why")) for t in texts)


@pytest.mark.parametrize("bad, match", [
    ((), r"openers must be a non-empty list of strings \('' for none\), got tuple '\(\)'"),
    ("Write", r"openers must be a non-empty list of strings .* got str 'Write'"),
    (None, r"openers must be a non-empty list of strings .* got NoneType 'None'"),
    (["Write", 3], r"openers\[1\] must be a str, got int '3'"),
    (["Write "], r"openers\[0\] ends in whitespace: 'Write '; give it without"),
])
def test_openers_must_be_a_list_of_strings(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        synthesize_prompts(llm, 2, [], openers=bad)
    assert not llm.engine.has_unfinished_requests()


def test_a_deadline_in_the_past_answers_nothing(llm):
    texts, stats = synthesize_prompts(llm, 4, [], seed=1, max_tokens=8, deadline=0.0)
    assert texts == [] and stats["unfinished"] == stats["out_of_time"] == 4 and stats["too_long"] == 0
    assert not llm.engine.has_unfinished_requests()


def test_resample_queue_takes_every_answered_prompt_fewest_answers_first():
    """--resample re-answers synthesized prompts too (not only the prep's), fewest answers first,
    ties in the order first answered."""
    import collections

    from blockdraft.training.answering import resample_queue

    answers = collections.Counter([(1, 2), (3,), (1, 2), (9, 9, 9), (3,), (1, 2), (4,)])
    assert resample_queue(answers) == [[9, 9, 9], [4], [3], [1, 2]]
    assert resample_queue(collections.Counter()) == []
