"""keyed_uniform: bit-exact counter-based hash, strictly in (0, 1), uniform, independent."""

import numpy as np
import pytest
import torch
from scipy import stats

from blockdraft.sample import gumbel_noise, keyed_uniform

M32 = 0xFFFFFFFF


# ---- pure-Python reference of the documented hash (arbitrary-precision ints, no overflow at all) ----
def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _ref_hash(seed: int, pos: int, tok: int) -> int:
    s = seed & 0xFFFFFFFFFFFFFFFF
    p = pos & 0xFFFFFFFFFFFFFFFF
    k = _fmix32((s & M32) ^ 0x243F6A88)
    k = _fmix32(k ^ (s >> 32) ^ 0x85A308D3)
    k = _fmix32(k ^ (p >> 32) ^ 0x13198A2E)
    k1 = _fmix32(k ^ (p & M32) ^ 0x03707344)
    k2 = _fmix32(k1 ^ 0xA4093822)
    t = _fmix32(((tok * 0x9E3779B9) & M32) ^ 0x299F31D0)
    return _fmix32((_fmix32(k1 ^ t) + k2) & M32)


def test_bit_exact_against_python_reference():
    seeds = [0, 1, 7, 2**31 - 1, 2**32, 2**32 + 5, 2**62 + 12345, 2**63 - 1, -1, -(2**63)]
    positions = [0, 1, 2, 1000, 2**31, 2**32 + 1, 2**40, 3, 2**63 - 1, 17]
    v = 70
    u64 = keyed_uniform(torch.tensor(seeds), torch.tensor(positions), v, dtype=torch.float64)
    u32 = keyed_uniform(torch.tensor(seeds), torch.tensor(positions), v)
    assert u64.dtype == torch.float64 and u32.dtype == torch.float32
    for i, (s, p) in enumerate(zip(seeds, positions)):
        for j in range(v):
            h = _ref_hash(s, p, j)
            assert u64[i, j].item() == (h + 0.5) / 2**32
            assert u32[i, j].item() == ((h >> 9) + 0.5) / 2**23


def test_strictly_inside_unit_interval():
    n, v = 400, 5000
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    pos = torch.randint(0, 10**6, (n,), generator=g)
    for dtype in (torch.float32, torch.float64):
        u = keyed_uniform(seeds, pos, v, dtype=dtype)
        assert u.shape == (n, v)
        assert bool((u > 0).all()) and bool((u < 1).all())
    noise = gumbel_noise(seeds, pos, v)
    assert noise.dtype == torch.float32 and bool(torch.isfinite(noise).all())
    # float32 extremes stay finite through -log(-log(u))
    ext = torch.tensor([2.0**-24, 1 - 2.0**-24], dtype=torch.float32)
    assert bool(torch.isfinite(-torch.log(-torch.log(ext))).all())


def test_row_depends_only_on_its_own_key_and_not_on_vocab_size():
    seeds = torch.tensor([3, 9, 3, 11])
    pos = torch.tensor([5, 5, 6, 0])
    full = keyed_uniform(seeds, pos, 3000)
    assert torch.equal(full[:, :100], keyed_uniform(seeds, pos, 100))
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(keyed_uniform(seeds[perm], pos[perm], 3000), full[perm])
    for i in range(4):
        assert torch.equal(keyed_uniform(seeds[i : i + 1], pos[i : i + 1], 3000)[0], full[i])
    # float32 values are the float64 ones truncated to 23 bits
    u64 = keyed_uniform(seeds, pos, 3000, dtype=torch.float64)
    assert torch.equal(torch.floor(u64 * 2**23), torch.floor(full.double() * 2**23))


def test_ks_uniform():
    g = torch.Generator().manual_seed(1)
    seeds = torch.randint(0, 2**31, (100,), generator=g)
    pos = torch.arange(100)
    u = keyed_uniform(seeds, pos, 3000, dtype=torch.float64).flatten().numpy()
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    # consecutive seeds at one position and consecutive positions of one seed: also uniform
    col = keyed_uniform(torch.arange(200_000), torch.zeros(200_000, dtype=torch.long), 1, dtype=torch.float64)
    assert stats.kstest(col.flatten().numpy(), "uniform").pvalue > 1e-3
    row = keyed_uniform(torch.full((200_000,), 42), torch.arange(200_000), 1, dtype=torch.float64)
    assert stats.kstest(row.flatten().numpy(), "uniform").pvalue > 1e-3


def _pair_chi2_pvalue(a: np.ndarray, b: np.ndarray, bins: int = 10) -> float:
    h, _, _ = np.histogram2d(a, b, bins=bins, range=[[0, 1], [0, 1]])
    return stats.chisquare(h.flatten()).pvalue


@pytest.mark.parametrize("axis", ["token", "position", "seed"])
def test_independence_across_tokens_positions_seeds(axis):
    n = 200_000
    if axis == "token":  # adjacent token indices of one row
        u = keyed_uniform(torch.arange(n // 100), torch.zeros(n // 100, dtype=torch.long), 101, dtype=torch.float64)
        a, b = u[:, :-1].flatten().numpy(), u[:, 1:].flatten().numpy()
    elif axis == "position":  # same seed, positions q and q + 1, same token
        q = torch.arange(n + 1)
        u = keyed_uniform(torch.full((n + 1,), 1234), q, 1, dtype=torch.float64)[:, 0].numpy()
        a, b = u[:-1], u[1:]
    else:  # seeds s and s + 1, same position and token
        s = torch.arange(n + 1)
        u = keyed_uniform(s, torch.full((n + 1,), 77), 1, dtype=torch.float64)[:, 0].numpy()
        a, b = u[:-1], u[1:]
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01  # ~3 sigma at n = 2e5 is 0.0067
    assert _pair_chi2_pvalue(a, b) > 1e-3
    # also the low bits (would catch a weak, structured mixer)
    a23 = np.floor(a * 2**32) % 256
    b23 = np.floor(b * 2**32) % 256
    assert abs(np.corrcoef(a23, b23)[0, 1]) < 0.01


def test_positions_and_seeds_never_collide_within_a_request():
    # k1 is a bijection of the position for a fixed seed: distinct positions -> distinct rows.
    q = torch.arange(50_000)
    u = keyed_uniform(torch.full_like(q, 5), q, 2, dtype=torch.float64)
    assert torch.unique(u[:, 0]).numel() > 49_990  # 32-bit values: only birthday collisions of single entries
    assert torch.unique(u, dim=0).shape[0] == 50_000
