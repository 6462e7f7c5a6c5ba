"""Per-position acceptance rates count, at each position, only the verify steps that drafted it:
a step near max_tokens drafts fewer than K, and its undrafted positions are not rejections."""

import json
import math

from blockdraft.engine.request import SpecStats
from blockdraft.server.metrics import Metrics
from blockdraft.server.responses import spec_stats


def _recorded(*steps: tuple[int, int]) -> SpecStats:
    s = SpecStats()
    for num_drafts, num_accepted in steps:
        s.record(num_drafts, num_accepted)
    return s


def test_rates_divide_by_the_steps_that_drafted_each_position():
    s = _recorded((3, 3), (1, 1), (3, 0), (0, 0))  # the step with no drafts is not a verify step
    assert (s.num_steps, s.num_drafted_tokens, s.num_accepted_tokens) == (3, 7, 4)
    assert s.accepted_per_position == [2, 1, 1]
    assert s.drafted_per_position == [3, 2, 2]  # the (1, 1) step never proposed positions 2 and 3
    assert s.acceptance_rate_per_position() == [2 / 3, 1 / 2, 1 / 2]  # not [2/3, 1/3, 1/3] (/ num_steps)
    assert s.acceptance_length == (4 + 3) / 3  # unchanged: accepted + 1 per verify step


def test_merge_sums_both_per_position_counters():
    a, b = _recorded((3, 3), (1, 1)), _recorded((3, 0), (4, 2))
    a.merge(b)
    whole = _recorded((3, 3), (1, 1), (3, 0), (4, 2))
    assert a == whole
    assert a.drafted_per_position == [4, 3, 3, 1] and a.accepted_per_position == [3, 2, 1, 0]
    short = _recorded((1, 0))
    short.merge(_recorded((2, 2)))  # the shorter list is the one merged into
    assert short.drafted_per_position == [2, 1] and short.acceptance_rate_per_position() == [0.5, 1.0]


def test_a_position_without_drafts_has_no_rate():
    assert SpecStats().acceptance_rate_per_position() == []
    hand = SpecStats(2, 4, 1, [1, 0])  # built without drafted_per_position: no denominator, no rate
    assert hand.acceptance_rate_per_position() == [None, None]


def test_the_response_extension_carries_the_denominators():
    out = spec_stats([_recorded((3, 3), (1, 1)), _recorded((3, 0))])
    assert out["accepted_per_position"] == [2, 1, 1] and out["drafted_per_position"] == [3, 2, 2]
    assert out["num_drafts"] == 3 and out["acceptance_length"] == 7 / 3


def test_metrics_count_drafts_per_position():
    m = Metrics(num_speculative_tokens=4)

    def value(name, pos):
        return m.registry.get_sample_value(f"blockdraft_{name}_total", {"position": str(pos)})

    spec = _recorded((3, 3), (1, 1))
    m._observe_spec(spec)
    spec.record(3, 0)
    spec.record(4, 1)
    m._observe_spec(spec)  # only the increments since the last step are added
    assert [value("spec_decode_num_drafts_per_pos", i) for i in (1, 2, 3, 4)] == [4, 3, 3, 1]
    assert [value("spec_decode_num_accepted_tokens_per_pos", i) for i in (1, 2, 3)] == [3, 1, 1]
    assert value("spec_decode_num_accepted_tokens_per_pos", 4) == 0  # never accepted: a series at 0 from the start
    assert value("spec_decode_num_drafts_per_pos", 5) is None  # beyond K: no series
    fresh = Metrics(num_speculative_tokens=2)
    assert [fresh.registry.get_sample_value(f"blockdraft_spec_decode_num_{n}_total", {"position": p})
            for n in ("drafts_per_pos", "accepted_tokens_per_pos") for p in ("1", "2")] == [0, 0, 0, 0]
    assert Metrics().registry.get_sample_value("blockdraft_spec_decode_num_drafts_per_pos_total", {"position": "1"}) is None
    assert m.registry.get_sample_value("blockdraft_spec_decode_num_drafts_total") == 4


def test_eval_result_rates_are_json_safe_and_plot(tmp_path):
    from blockdraft.training.evaluate import EvalResult, plot_per_position

    r = EvalResult("humaneval", 0.0, 2, 3, num_steps=3, num_accepted=4, num_output_tokens=6, seconds=1.0,
                   accepted_per_position=[2, 1, 1, 0], drafted_per_position=[3, 2, 2, 0], num_speculative_tokens=4)
    assert r.per_position == [2 / 3, 0.5, 0.5, None]  # position 4 was never drafted: no rate, not 0
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert d["per_position"][-1] is None and d["drafted_per_position"] == [3, 2, 2, 0]
    assert math.isclose(d["acceptance_length"], 7 / 3)
    plot_per_position({"run": r.per_position}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
