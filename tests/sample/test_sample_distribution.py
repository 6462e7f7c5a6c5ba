"""Goodness of fit of sample() against the exact intended distribution, with negative controls.

Samples come from many (seed, position) keys of one logits row; the intended distribution is computed
independently here in float64 numpy. Everything is deterministic (fixed seeds), so the thresholds
never flake: a correct sampler gives p > 1e-3, a deliberately wrong one p < 1e-10.
"""

import numpy as np
import pytest
import torch
from scipy import stats

from blockdraft.sample import SamplingTensors, gumbel_noise, keyed_uniform, sample
from blockdraft.sampling_params import SamplingParams

# Distinct logits (no ties), spread so that every kept token has a few hundred expected counts.
LOGITS = np.array([2.1, 1.73, 1.41, 1.02, 0.77, 0.31, 0.05, -0.38, -0.91, -1.6, -2.2, -2.9])
V = LOGITS.size
N = 100_000
PASS_P = 1e-3
FAIL_P = 1e-10


def intended(logits: np.ndarray, t: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """Exact target distribution: softmax(logits / T), drop tokens below min_p x the top probability,
    keep top-k, renormalise, keep the smallest highest-probability prefix with mass >= top_p (the
    crossing token included), renormalise (vLLM's order)."""
    x = logits.astype(np.float64) / t
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), dtype=bool)
    keep[order[: top_k if top_k > 0 else len(p)]] = True
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if top_p < 1.0:
        cum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(cum, top_p, side="left")) + 1  # first index with cum >= top_p
        keep2 = np.zeros(len(p), dtype=bool)
        keep2[order[:n_keep]] = True
        p = np.where(keep2, p, 0.0)
        p /= p.sum()
    return p


def keys(n: int = N, salt: int = 0):
    g = torch.Generator().manual_seed(1000 + salt)
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    positions = torch.randint(0, 100_000, (n,), generator=g)
    return seeds, positions


def gof_pvalue(tokens: torch.Tensor, probs: np.ndarray) -> float:
    """Chi-square p-value of token counts against probs; 0.0 if any token outside the support appears."""
    counts = np.bincount(tokens.numpy(), minlength=len(probs)).astype(np.float64)
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    return float(stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue)


def run_sampler(t: float, top_k: int, top_p: float, salt: int = 0, hints: bool = True, min_p: float = 0.0) -> torch.Tensor:
    seeds, positions = keys(salt=salt)
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(N, V).contiguous()
    params = [SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)]
    st = SamplingTensors.from_params(params).repeat_interleave(N)
    st.seeds = seeds
    if hints:
        return st.sample(logits, positions)
    return sample(logits, st.temperature, st.top_k, st.top_p, seeds, positions, min_p=st.min_p)


CASES = [
    # (T, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.6, -1, 1.0),
    (1.0, 4, 1.0),
    (0.7, 6, 1.0),
    (1.0, 0, 0.8),
    (0.6, 0, 0.9),
    (1.0, 7, 0.85),
    (0.9, 3, 0.7),
]


@pytest.mark.parametrize("t,top_k,top_p", CASES)
@pytest.mark.parametrize("hints", [True, False])
def test_goodness_of_fit(t, top_k, top_p, hints):
    probs = intended(LOGITS, t, top_k, top_p)
    tokens = run_sampler(t, top_k, top_p, salt=10 + CASES.index((t, top_k, top_p)), hints=hints)
    counts = np.bincount(tokens.numpy(), minlength=V)
    assert counts[probs == 0].sum() == 0, "a token outside top-k/top-p was sampled"
    assert (probs[probs > 0] * N).min() > 20  # the test itself has power everywhere
    assert gof_pvalue(tokens, probs) > PASS_P


MIN_P_CASES = [
    # (T, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.1),
    (0.7, 0, 1.0, 0.05),
    (1.6, 0, 1.0, 0.2),
    (1.0, 5, 1.0, 0.3),
    (1.0, 0, 0.8, 0.1),  # top-p on min-p's 7 survivors renormalised keeps 4 (5 without min-p)
    (1.2, 6, 0.95, 0.3),
]


@pytest.mark.parametrize("t,top_k,top_p,min_p", MIN_P_CASES)
@pytest.mark.parametrize("hints", [True, False])
def test_goodness_of_fit_with_min_p(t, top_k, top_p, min_p, hints):
    probs = intended(LOGITS, t, top_k, top_p, min_p)
    assert 1 < (probs > 0).sum() < (intended(LOGITS, t, top_k, top_p) > 0).sum()  # min_p removes tokens here
    tokens = run_sampler(t, top_k, top_p, salt=40 + MIN_P_CASES.index((t, top_k, top_p, min_p)), hints=hints, min_p=min_p)
    counts = np.bincount(tokens.numpy(), minlength=V)
    assert counts[probs == 0].sum() == 0, "a token below min_p x the top probability was sampled"
    assert (probs[probs > 0] * N).min() > 20
    assert gof_pvalue(tokens, probs) > PASS_P


def test_negative_control_min_p_before_temperature():
    t, min_p = 0.6, 0.1
    probs = intended(LOGITS, t, 0, 1.0, min_p)
    keep = intended(LOGITS, 1.0, 0, 1.0, min_p) > 0  # the bug: min_p applied to the untempered probabilities
    assert keep.sum() != (probs > 0).sum()
    assert gof_pvalue(_wrong_gumbel(t, keep, salt=7), probs) < FAIL_P
    assert gof_pvalue(run_sampler(t, 0, 1.0, salt=7, min_p=min_p), probs) > PASS_P


def test_cases_really_truncate():
    # the top-k / top-p cases above do remove tokens (else the support check proves nothing)
    assert (intended(LOGITS, 1.0, 4, 1.0) > 0).sum() == 4
    assert (intended(LOGITS, 1.0, 0, 0.8) > 0).sum() < V
    assert (intended(LOGITS, 1.0, 7, 0.85) > 0).sum() < (intended(LOGITS, 1.0, 7, 1.0) > 0).sum()


# ---------------------------------------------------------------- negative controls
# Each wrong sampler reuses the same keyed noise; only the bug differs. Each must fail the same test.


def _wrong_gumbel(t: float, keep: np.ndarray, salt: int) -> torch.Tensor:
    seeds, positions = keys(salt=salt)
    x = torch.tensor(LOGITS, dtype=torch.float32).expand(N, V) / t
    y = x + gumbel_noise(seeds, positions, V)
    y = y.masked_fill(~torch.tensor(keep)[None, :], float("-inf"))
    return y.argmax(-1)


def test_negative_control_forgotten_temperature():
    probs = intended(LOGITS, 0.7, 0, 1.0)
    wrong = run_sampler(1.0, 0, 1.0, salt=1)  # the bug: T = 0.7 requested, sampled at T = 1
    assert gof_pvalue(wrong, probs) < FAIL_P
    assert gof_pvalue(run_sampler(0.7, 0, 1.0, salt=1), probs) > PASS_P


def test_negative_control_top_p_excludes_boundary_token():
    t, top_p = 1.0, 0.8
    probs = intended(LOGITS, t, 0, top_p)
    full = intended(LOGITS, t, 0, 1.0)
    order = np.argsort(-full)
    cum = np.cumsum(full[order])
    keep = np.zeros(V, dtype=bool)
    keep[order[cum <= top_p]] = True  # the bug: stops before the token that crosses top_p
    assert keep.sum() == (probs > 0).sum() - 1
    assert gof_pvalue(_wrong_gumbel(t, keep, salt=2), probs) < FAIL_P
    assert gof_pvalue(_wrong_gumbel(t, probs > 0, salt=2), probs) > PASS_P  # the fixed version passes


def test_negative_control_top_p_on_untempered_distribution():
    t, top_p = 0.6, 0.9
    probs = intended(LOGITS, t, 0, top_p)
    keep = intended(LOGITS, 1.0, 0, top_p) > 0  # the bug: nucleus chosen before applying temperature
    assert keep.sum() != (probs > 0).sum()
    assert gof_pvalue(_wrong_gumbel(t, keep, salt=3), probs) < FAIL_P


def _inverse_cdf(weights: np.ndarray, salt: int, renormalise: bool) -> torch.Tensor:
    seeds, positions = keys(salt=salt)
    u = keyed_uniform(seeds, positions, 1, dtype=torch.float64)[:, 0]
    w = torch.tensor(weights, dtype=torch.float64)
    if renormalise:
        w = w / w.sum()
    cum = torch.cumsum(w, 0)
    idx = torch.searchsorted(cum, u)
    # u beyond the (unrenormalised) kept mass falls back to the most likely token
    return torch.where(idx >= V, int(np.argmax(weights)), idx).clamp(max=V - 1)


def test_negative_control_not_renormalising_after_top_p():
    t, top_p = 1.0, 0.8
    probs = intended(LOGITS, t, 0, top_p)
    kept_unnormalised = np.where(probs > 0, intended(LOGITS, t, 0, 1.0), 0.0)
    wrong = _inverse_cdf(kept_unnormalised, salt=4, renormalise=False)
    assert gof_pvalue(wrong, probs) < FAIL_P
    right = _inverse_cdf(kept_unnormalised, salt=4, renormalise=True)  # same harness, bug fixed
    assert gof_pvalue(right, probs) > PASS_P


def test_top_k_one_and_tiny_top_p_are_argmax():
    am = int(np.argmax(LOGITS))
    assert set(run_sampler(1.0, 1, 1.0, salt=5).tolist()) == {am}
    assert set(run_sampler(2.0, 0, 1e-6, salt=6).tolist()) == {am}
