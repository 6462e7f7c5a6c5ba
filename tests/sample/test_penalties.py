"""Presence / frequency / repetition penalties: the sparse entries equal a dense rewrite of the
formula, drafts count for the rows after them, and bad values are refused by name."""

import pytest
import torch

from blockdraft.engine.request import Request
from blockdraft.engine.scheduler import _logits_context
from blockdraft.sample.penalties import apply_penalties, penalty_entries
from blockdraft.sample.sampler import SamplingTensors
from blockdraft.sampling_params import SamplingParams
from tests.sample.penalty_reference import dense_adjusted


def _history(prompt, output, masked, p):
    """ScheduledRequest.logits_context as the scheduler builds it (scheduler._logits_context)."""
    return torch.unique(torch.tensor(prompt)) if p.repetition_penalty != 1.0 else None, output, masked


@pytest.mark.parametrize("pres, freq, rep", [(0.5, 0.3, 1.5), (0.0, 0.0, 0.7), (-1.0, 2.0, 1.0), (0.0, 0.4, 1.0)])
def test_entries_equal_the_dense_formula_row_by_row_with_drafts(pres, freq, rep):
    """Every row of requests with penalties and / or a logit bias equals the dense formula after
    the output and the drafts before it; a request without either keeps its raw rows."""
    g = torch.Generator().manual_seed(0)
    vocab = 50
    reqs = [  # (prompt, output, drafts, params)
        ([1, 2, 3, 3], [3, 4, 4], [5, 4, 6], SamplingParams(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep)),
        ([7, 8], [], [9, 9], SamplingParams()),  # no penalties: its rows stay raw
        ([10, 11, 12], [], [], SamplingParams(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep)),
        ([1], [20, 21, 20], [20, 21, 22, 20], SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2)),
        ([1, 2], [3], [4, 3], SamplingParams(logit_bias={3: 5.0, 30: -100, 1: 0.5}, presence_penalty=pres,
                                             repetition_penalty=rep)),  # bias on counted, prompt and fresh tokens
        ([5], [], [6], SamplingParams(logit_bias={49: 2.5})),  # bias alone
    ]
    rows = sum(len(d) + 1 for _, _, d, _ in reqs)
    logits = torch.randn(rows, vocab, generator=g) * 3
    histories = [_history(pr, out, (), p) if p.adjusts_logits else None for pr, out, _, p in reqs]
    entries = penalty_entries(histories, [d for _, _, d, _ in reqs], [p for *_, p in reqs])
    got = apply_penalties(logits.to(torch.bfloat16), entries)
    assert got.dtype == torch.float32
    r = 0
    for prompt, output, drafts, p in reqs:
        for j in range(len(drafts) + 1):
            raw = logits[r].to(torch.bfloat16).float()
            want = dense_adjusted(raw, prompt, output + drafts[:j], p) if p.adjusts_logits else raw
            torch.testing.assert_close(got[r], want, rtol=0, atol=1e-6, msg=f"row {r}")
            r += 1
    assert r == rows


def test_no_penalties_no_entries_and_the_input_stays_raw():
    assert penalty_entries([None, None], [[1], []], [SamplingParams(), SamplingParams()]) is None
    logits = torch.randn(2, 10)
    before = logits.clone()
    p = SamplingParams(repetition_penalty=2.0)
    e = penalty_entries([_history([1, 2], [3], (), p)], [[4]], [p])
    out = apply_penalties(logits, e)
    assert torch.equal(logits, before) and not torch.equal(out, before)


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0)  # token 1 was in the prompt: 5 / 2 < 4
    st = SamplingTensors.from_params([p])
    assert st.sample(logits, torch.zeros(1, dtype=torch.long)).item() == 1
    st.penalties = penalty_entries([_history([1], [], (), p)], [[]], [p])
    assert not st.argmax_only
    assert st.sample(logits, torch.zeros(1, dtype=torch.long)).item() == 2
    with pytest.raises(ValueError, match="penalties"):
        st.select(torch.tensor([0]))


@pytest.mark.parametrize("field, value, allowed", [
    ("presence_penalty", 2.5, r"\[-2, 2\]"), ("frequency_penalty", -3, r"\[-2, 2\]"),
    ("frequency_penalty", float("nan"), r"\[-2, 2\]"), ("presence_penalty", "1", r"\[-2, 2\]"),
    ("repetition_penalty", 0.0, "> 0"), ("repetition_penalty", float("inf"), "> 0"), ("repetition_penalty", True, "> 0"),
])  # fmt: skip
def test_bad_penalties_are_refused_by_name(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field} must .*{allowed}.*got {value!r}"[:200]) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value)


def test_numpy_numbers_in_logit_bias_are_taken_as_python_ones():
    np = pytest.importorskip("numpy")
    p = SamplingParams(logit_bias={np.int64(5): np.float32(1.5), 7: 2})
    assert p.logit_bias == {5: 1.5, 7: 2.0} and all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())


@pytest.mark.parametrize("bias, message", [
    ({-1: 1.0}, "logit_bias token id must be an integer >= 0, got -1"),
    ({"3": 1.0}, "logit_bias token id must be an integer >= 0, got '3'"),
    ({3: 101}, r"logit_bias of token 3 must be a number in \[-100, 100\], got 101"),
    ({3: float("nan")}, r"logit_bias of token 3 must be a number in \[-100, 100\], got nan"),
    ([3], r"logit_bias must be a dict \{token id: bias\} or None, got \[3\]"),
])  # fmt: skip
def test_bad_logit_bias_is_refused_by_name(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_has_penalties():
    assert SamplingParams(logit_bias={1: 1.0}).adjusts_logits and not SamplingParams(logit_bias={}).adjusts_logits
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=-0.1).has_penalties and SamplingParams(repetition_penalty=1.01).has_penalties


def test_min_tokens_masks_the_stop_ids_at_rows_below_it_only():
    """Output of 1 token, drafts [4, 0, 7], min_tokens 3: rows 0 and 1 predict positions 1 and 2 and
    get -inf at the stop ids (0 and 9), rows 2 and 3 do not."""
    p = SamplingParams(min_tokens=3, max_tokens=10)
    e = penalty_entries([_history([1, 2], [5], (0, 9), p)], [[4, 0, 7]], [p])
    logits = torch.zeros(4, 12)
    x = apply_penalties(logits, e)
    assert torch.isinf(x[:2, [0, 9]]).all() and (x[:2, [0, 9]] < 0).all()
    assert torch.isfinite(x[2:]).all() and torch.equal(x[:, [1, 2, 3]], logits[:, [1, 2, 3]])
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="min_tokens must be an integer >= 0, got -1"):
        SamplingParams(min_tokens=-1)


def test_the_scheduler_passes_the_prompt_set_once_computed_and_only_for_the_repetition_penalty():
    """The prompt's distinct ids are computed once per request (not every step) and reach the
    penalties only when the repetition penalty reads them."""
    rep = Request("r", [5, 3, 5, 9, 3], SamplingParams(repetition_penalty=1.3))
    ctx = _logits_context(rep)
    assert torch.equal(ctx[0], torch.tensor([3, 5, 9])) and ctx[0] is _logits_context(rep)[0]
    assert ctx[0] is rep.prompt_token_set()
    assert _logits_context(Request("f", [5, 3], SamplingParams(frequency_penalty=0.5)))[0] is None
