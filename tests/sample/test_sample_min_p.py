"""min_p (vLLM's): after temperature, tokens less likely than min_p x the top token are dropped,
before top-k and top-p (top-p then sees the distribution renormalised over the survivors).

Hand-computed examples: LOGITS below, probability ratio to the top token p_j / p_0 = exp((l_j - 3) / T).
"""

import math

import pytest
import torch

import blockdraft.sample.sampler as sampler_mod
from blockdraft.sample import SamplingTensors, sample
from blockdraft.sampling_params import SamplingParams

#          id:   0    1    2    3    4     5    6     7
LOGITS = [3.0, 2.5, 1.6, 1.0, 0.0, -1.0, 2.9, -5.0]
V = len(LOGITS)
DRAWS = 3000  # keyed samples per case: every kept token but 7 (probability >= 0.006 here) is drawn


def _kept_by_threshold(params: SamplingParams, **hints) -> set[int]:
    """Tokens that pass _keep_threshold for one row (with SamplingTensors' hints unless overridden)."""
    st = SamplingTensors.from_params([params])
    x = torch.tensor([LOGITS]) / params.temperature
    kw = dict(any_top_k=st.any_top_k, any_top_p=st.any_top_p, max_top_k=st.max_top_k, any_min_p=st.any_min_p)
    kw.update(hints)
    thr = sampler_mod._keep_threshold(x, st.top_k, st.top_p, kw["any_top_k"], kw["any_top_p"], kw["max_top_k"],
                                      st.min_p, kw["any_min_p"])
    return set(range(V)) if thr is None else set(torch.nonzero(x[0] >= thr[0]).flatten().tolist())


def _sampled_support(params: SamplingParams) -> set[int]:
    """Tokens the sampler draws over DRAWS positions of one request."""
    st = SamplingTensors.from_params([params]).repeat_interleave(DRAWS)
    logits = torch.tensor([LOGITS]).expand(DRAWS, V).contiguous()
    return set(st.sample(logits, torch.arange(DRAWS)).tolist())


# (params, tokens kept), worked out by hand in the comments
CASES = [
    # T = 1: keep l >= 3 + ln 0.2 = 1.391 -> 3.0, 2.5, 1.6, 2.9 (1.0: ratio e^-2 = 0.135 < 0.2)
    (dict(temperature=1.0, min_p=0.2), {0, 1, 2, 6}),
    # T = 0.5 (applied first): keep l >= 3 + 0.5 ln 0.2 = 2.195 -> token 2 (1.6, ratio e^-2.8 = 0.06) goes
    (dict(temperature=0.5, min_p=0.2), {0, 1, 6}),
    # T = 2: keep l >= 3 + 2 ln 0.2 = -0.219 -> 0.0 stays (ratio e^-1.5 = 0.22), -1.0 goes (0.135)
    (dict(temperature=2.0, min_p=0.2), {0, 1, 2, 3, 4, 6}),
    # min_p 0: off; min_p 1: the top token only; a tiny min_p keeps all but the -5 logit (ratio e^-8 = 3.4e-4)
    (dict(temperature=1.0, min_p=0.0), set(range(V))),
    (dict(temperature=1.0, min_p=1.0), {0}),
    (dict(temperature=1.0, min_p=1e-3), set(range(V)) - {7}),
    # with top-k the stricter wins: top-2 = {0, 6} inside min-p's {0, 1, 2, 6}; top-6 is the looser one
    (dict(temperature=1.0, min_p=0.2, top_k=2), {0, 6}),
    (dict(temperature=1.0, min_p=0.2, top_k=6), {0, 1, 2, 6}),
    (dict(temperature=1.0, min_p=0.1, top_k=3), {0, 1, 6}),
    # top-p on min-p's survivors renormalised: e^(3, 2.9, 2.5, 1.6) / 55.39 = .363 .328 .220 .089; mass before
    # token 2 is .911 >= .9 -> dropped. (Top-p on the full distribution would keep 2: mass before it .848.)
    (dict(temperature=1.0, min_p=0.2, top_p=0.9), {0, 1, 6}),
    # min-p looser than top-p: top-p alone keeps {0, 6} (mass before token 1 is .643 >= .6) either way
    (dict(temperature=1.0, min_p=0.01, top_p=0.6), {0, 6}),
    # all three: min-p {0, 1, 2, 6}, top-3 {0, 6, 1}, renormalised e^(3, 2.9, 2.5) / 50.44 = .398 .360 .241:
    # mass before token 1 is .759 < .8 -> kept
    (dict(temperature=1.0, min_p=0.2, top_k=3, top_p=0.8), {0, 1, 6}),
    (dict(temperature=1.0, min_p=0.2, top_k=3, top_p=0.7), {0, 6}),
]


@pytest.mark.parametrize("kw, kept", CASES, ids=[str(sorted(c[0].items())) for c in CASES])
def test_hand_computed_survivors(kw, kept):
    params = SamplingParams(seed=11, **kw)
    assert _kept_by_threshold(params) == kept
    # every code path of the threshold (no hints: full sort with everything on) agrees
    assert _kept_by_threshold(params, any_top_k=None, any_top_p=None, max_top_k=None, any_min_p=None) == kept
    drawn = _sampled_support(params)
    assert drawn <= kept and kept - drawn <= {7}  # token 7 (probability 1e-4 when kept) may go undrawn


def test_the_hand_computed_cases_are_right():
    """A check of this file's fixtures, not of the sampler: the hand-computed numbers above,
    recomputed in float64 from probabilities as vLLM does (CASES pins the sampler to them)."""
    def probs(t):
        e = [math.exp(v / t) for v in LOGITS]
        return [x / sum(e) for x in e]

    p = probs(1.0)
    assert {j for j in range(V) if p[j] >= 0.2 * max(p)} == {0, 1, 2, 6}
    q = probs(0.5)
    assert {j for j in range(V) if q[j] >= 0.2 * max(q)} == {0, 1, 6}
    kept = sorted((p[j] for j in (0, 1, 2, 6)), reverse=True)
    assert sum(kept[:3]) / sum(kept) > 0.9  # renormalised: token 2 is past 0.9
    assert sum(sorted(p, reverse=True)[:3]) < 0.9  # not renormalised: token 2 would be kept


def test_min_p_with_top_k_fast_path_and_ties():
    """Only top-k (every row has one) and min-p: the torch.topk path; a tie at the top survives min_p 1."""
    logits = torch.tensor([LOGITS, [3.0, 3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=3, min_p=0.2, seed=1),
              SamplingParams(temperature=1.0, top_k=4, min_p=1.0, seed=2)]
    st = SamplingTensors.from_params(params)
    assert st.max_top_k == 4 and st.any_min_p and not st.any_top_p
    thr = sampler_mod._keep_threshold(logits, st.top_k, st.top_p, True, False, 4, st.min_p, True)
    full = sampler_mod._keep_threshold(logits, st.top_k, st.top_p, None, None, None, st.min_p, None)
    assert torch.equal(thr, full)
    assert torch.nonzero(logits[0] >= thr[0]).flatten().tolist() == [0, 1, 6]
    assert torch.nonzero(logits[1] >= thr[1]).flatten().tolist() == [0, 1]


def test_greedy_rows_ignore_min_p_and_rows_stay_independent():
    gen = torch.Generator().manual_seed(2)
    n, v = 24, 500
    logits = torch.randn(n, v, generator=gen) * 3
    params = [SamplingParams(temperature=(0.0, 1.0, 0.7, 1.3)[i % 4], min_p=(0.5, 0.1, 0.0, 0.3)[i % 3],
                             top_k=(0, 40)[i % 2], top_p=(1.0, 0.9)[i % 5 == 0], seed=i) for i in range(n)]  # fmt: skip
    st = SamplingTensors.from_params(params)
    pos = torch.arange(n) + 50
    out = st.sample(logits, pos)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert greedy and torch.equal(out[greedy], logits[greedy].argmax(-1))
    for i in range(n):  # each row alone (other hints, other paths) gives the same token
        assert SamplingTensors.from_params([params[i]]).sample(logits[i : i + 1], pos[i : i + 1]).item() == out[i].item()
    # no hints at all: the general path
    plain = sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, pos, min_p=st.min_p)
    assert torch.equal(plain, out)
    # a min_p row only ever gives tokens with p >= min_p * p_max
    x = logits / torch.tensor([max(p.temperature, 1e-9) for p in params])[:, None]
    for i, p in enumerate(params):
        if not p.greedy and p.min_p > 0:
            assert x[i, out[i]] >= x[i].max() + math.log(p.min_p) - 1e-5


def test_no_min_p_row_means_no_min_p_work(monkeypatch):
    """The hot path: without a sampling row that uses min_p, sampling computes nothing for it (a greedy
    row's min_p does not count), and gives the same tokens as before min_p existed."""
    def boom(*a, **k):
        raise AssertionError("min-p threshold computed though no sampling row uses min_p")

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=gen)
    params = [SamplingParams(temperature=0.0, min_p=0.9), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2), SamplingParams(temperature=0.8, top_k=5, seed=3),
              SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0.0)]  # fmt: skip
    st = SamplingTensors.from_params(params)
    assert not st.any_min_p
    want = st.sample(logits, torch.arange(6))
    monkeypatch.setattr(sampler_mod, "_min_p_threshold", boom)
    assert torch.equal(st.sample(logits, torch.arange(6)), want)
    assert torch.equal(st.select(torch.tensor([1, 4])).sample(logits[[1, 4]], torch.tensor([1, 4])), want[[1, 4]])
    # min-p alone (no top-k / top-p anywhere) needs no sort: the row maximum only
    monkeypatch.undo()
    monkeypatch.setattr(torch, "sort", boom)
    monkeypatch.setattr(torch, "topk", boom)
    only = SamplingTensors.from_params([SamplingParams(temperature=1.0, min_p=0.3, seed=i) for i in range(3)])
    assert only.any_min_p and not (only.any_top_k or only.any_top_p)
    only.sample(logits[:3], torch.arange(3))


def test_sampling_tensors_carry_min_p():
    ps = [SamplingParams(temperature=0.0, min_p=0.5), SamplingParams(temperature=0.9, min_p=0.25, seed=1),
          SamplingParams(temperature=0.9, seed=2)]  # fmt: skip
    st = SamplingTensors.from_params(ps)
    assert st.min_p.dtype == torch.float32 and st.min_p.tolist() == [0.5, 0.25, 0.0] and st.any_min_p
    assert SamplingTensors.from_params(ps, repeats=[1, 3, 0]).min_p.tolist() == [0.5, 0.25, 0.25, 0.25]
    assert not SamplingTensors.from_params(ps, repeats=[2, 0, 1]).any_min_p  # only a greedy row has it
    assert not SamplingTensors.from_params([ps[0], ps[2]]).any_min_p
    rep = st.repeat_interleave(2)
    assert rep.min_p.tolist() == [0.5, 0.5, 0.25, 0.25, 0.0, 0.0] and rep.any_min_p
    sel = st.select(torch.tensor([1, 1, 2]))
    assert sel.min_p.tolist() == [0.25, 0.25, 0.0] and sel.any_min_p


def test_every_tensor_of_sampling_tensors_is_staged_with_the_batch():
    """runner.input_batch moves SamplingTensors' per-row tensors to the device by name: a column left
    out of SAMPLING_FIELDS would stay on the host."""
    import dataclasses

    from blockdraft.runner.input_batch import SAMPLING_FIELDS

    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, min_p=0.1, seed=0)])
    tensors = {f.name for f in dataclasses.fields(st) if isinstance(getattr(st, f.name), torch.Tensor)}
    assert set(SAMPLING_FIELDS) == tensors
