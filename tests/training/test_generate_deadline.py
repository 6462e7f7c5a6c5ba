"""generate_with_engine with a deadline: the answers it gives are the ones a full run gives, the
rest are None, and the engine is left empty and usable."""

import time

from blockdraft.training.generate import generate_with_engine, sampling_plan
from tests.conftest import make_llm, random_prompts, tiny_target


def test_deadline_cuts_the_run_and_keeps_finished_answers_exact(monkeypatch):
    llm = make_llm(tiny_target("llama"), max_num_seqs=2)
    prompts = random_prompts(10, seed=4)
    sampled = sampling_plan(10, 0.5, 4)
    full = generate_with_engine(llm, prompts, 12, sampled, seed=9)
    assert all(full)

    clock = iter(range(10**6))
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))  # one "second" per look at the clock
    cut = generate_with_engine(llm, prompts, 12, sampled, seed=9, deadline=30.0)
    monkeypatch.undo()
    answered = [i for i, r in enumerate(cut) if r is not None]
    assert 0 < len(answered) < 10
    assert all(cut[i] == full[i] for i in answered)
    assert not llm.engine.has_unfinished_requests()
    assert generate_with_engine(llm, prompts[:3], 12, sampled[:3], seed=9) == full[:3]  # still usable
