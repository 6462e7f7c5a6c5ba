"""side_by_side: interleaving, rotation of who runs first, warm-up, repeats and medians."""

import pytest

from blockdraft.side_by_side import compare_engines
from blockdraft.sampling_params import SamplingParams


class FakeOutput:
    def __init__(self, token_ids):
        self.token_ids = token_ids
        self.num_output_tokens = len(token_ids)


class FakeEngine:
    """Records (name, prompt, max_tokens) per call; answers the prompt's tokens (or a flip on call 3)."""

    def __init__(self, name, log, flip_on_call=None):
        self.name, self.log, self.calls, self.flip_on_call = name, log, 0, flip_on_call

    def generate(self, prompts, params):
        assert len(prompts) == 1
        self.calls += 1
        self.log.append((self.name, prompts[0], params.max_tokens))
        ids = list(prompts[0]) + [self.calls] * (self.calls == self.flip_on_call)
        return [FakeOutput(ids)]


def test_runs_are_interleaved_rotated_warmed_up_and_checked_for_determinism():
    log = []
    engines = {"a": FakeEngine("a", log), "b": FakeEngine("b", log, flip_on_call=5)}
    prompts = [[1], [2, 3]]
    seen = []

    def on_prompt(i, r, prompt_runs):  # after every engine ran prompt i in repeat r
        seen.append((i, r, sorted(prompt_runs), [len(run.seconds) for run in prompt_runs.values()], len(log)))

    runs = compare_engines(engines, prompts, SamplingParams(max_tokens=9), repeats=2, warmup_tokens=2,
                           on_prompt=on_prompt)
    warm, timed = log[:4], log[4:]
    assert warm == [("a", [1], 2), ("a", [2, 3], 2), ("b", [1], 2), ("b", [2, 3], 2)]
    # repeat 0: prompt 0 a first, prompt 1 b first; repeat 1: prompt 0 b first, prompt 1 a first
    assert [(n, p) for n, p, _ in timed] == [("a", [1]), ("b", [1]), ("b", [2, 3]), ("a", [2, 3]),
                                            ("b", [1]), ("a", [1]), ("a", [2, 3]), ("b", [2, 3])]
    assert all(m == 9 for _, _, m in timed)
    assert [len(r.seconds) for r in runs["a"] + runs["b"]] == [2, 2, 2, 2]
    assert [len(r.cpu_seconds) for r in runs["a"]] == [2, 2]
    assert runs["a"][0].output.token_ids == [1] and runs["a"][0].tokens_per_s > 0
    # b's 5th call (warm-ups are calls 1-2) is its second repeat of prompt 0: reported as nondeterministic
    assert [r.deterministic for r in runs["a"]] == [True, True]
    assert [r.deterministic for r in runs["b"]] == [False, True]
    # 4 warm-up calls, then 2 timed calls per (prompt, repeat)
    assert seen == [(0, 0, ["a", "b"], [1, 1], 6), (1, 0, ["a", "b"], [1, 1], 8),
                    (0, 1, ["a", "b"], [2, 2], 10), (1, 1, ["a", "b"], [2, 2], 12)]


def test_bad_arguments_are_refused():
    engine = {"a": FakeEngine("a", [])}
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        compare_engines(engine, [[1]], SamplingParams(), repeats=0)
    with pytest.raises(ValueError, match="at least one prompt"):
        compare_engines(engine, [], SamplingParams())
    with pytest.raises(ValueError, match="at least one engine"):
        compare_engines({}, [[1]], SamplingParams())
