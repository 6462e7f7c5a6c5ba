"""Position-keyed sampling: greedy, temperature, min-p, top-k, top-p, and log-probabilities.

The token sampled at output position q of a request is a pure function of
(request seed, q, logits row): it does not depend on batch mates, on row order, on how many rows a
step produced (one plain decode row or K+1 speculative verify rows) or on the device. This is what
makes speculative verification exactly lossless and reproducible (DFLASH.md, "One decode step",
step 2): the target's keyed sample at a draft's position is the same token that plain decoding
would have produced there, so "accept d_i iff it equals the target's keyed sample" reproduces the
non-speculative output token for token.

How: the Gumbel-max trick. If g_j are i.i.d. standard Gumbel variables, then
argmax_j (l_j + g_j) is distributed as softmax(l) (E. J. Gumbel, "Statistical Theory of Extreme
Values", 1954; used for sampling by Maddison, Tarlow & Minka, "A* Sampling", NeurIPS 2014, and
Jang, Gu & Poole, "Categorical Reparameterization with Gumbel-Softmax", ICLR 2017). Masked tokens
get -inf, so the sample is from the renormalised kept distribution with no explicit renormalising.
The noise is not drawn from a stateful generator: g = -log(-log(u)) with u a counter-based hash of
(seed, position, token index) (murmur3's fmix32 finaliser, Appleby 2008, applied in a keyed
two-round construction), computed with int64 tensor ops masked to 32 bits. Every 32-bit multiply
uses the negative representative of its constant (|c| < 2**31), so no product ever leaves int64: no
integer overflow anywhere, hence the hash bits and the uniforms are identical on CPU and GPU (and
under torch.compile; checked on an H200). The Gumbel transform uses float32 log, which may differ by
an ulp across devices, so a device can only matter for a near-exact tie between two perturbed logits.
Everything is vectorised over rows, with per-row parameters, no Python loop per request and no host
synchronisation.

Conventions: `positions` is whatever per-request counter the caller uses for "output position q"
(the engine must use the same convention in plain decoding and in speculative verification, e.g.
the 0-based index of the token within the request's output). Seeds are int64; only their 64 bits
matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from blockdraft.host_tensor import host_tensor
from blockdraft.layers.fused_ops import argmax as fused_argmax
from blockdraft.sample.bitmask import apply_token_bitmask_rows_
from blockdraft.sample.penalties import PenaltyEntries, apply_penalties
from blockdraft.sampling_params import SamplingParams

__all__ = [
    "SamplingTensors",
    "compute_logprobs",
    "gumbel_noise",
    "keyed_uniform",
    "sample",
]

_M32 = 0xFFFFFFFF
# murmur3 fmix32 multipliers and a few odd/random-looking domain-separation constants.
_FMIX_C1 = 0x85EBCA6B
_FMIX_C2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9
_K_SEED_LO = 0x243F6A88
_K_SEED_HI = 0x85A308D3
_K_POS_HI = 0x13198A2E
_K_POS_LO = 0x03707344
_K_ROW2 = 0xA4093822
_K_TOKEN = 0x299F31D0
assert all((1 << 31) <= c < (1 << 32) for c in (_FMIX_C1, _FMIX_C2, _GOLDEN))  # see _mul32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) and a constant 2**31 <= c < 2**32, overflow-free.

    Multiplies by the negative representative c - 2**32 (|c - 2**32| < 2**31), so |product| < 2**63
    always fits in int64; masking the two's-complement product to 32 bits gives (x * c) mod 2**32.
    """
    return (x * (c - (1 << 32))) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 finaliser on int64 tensors holding 32-bit values; a bijection of [0, 2**32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX_C2)
    return h ^ (h >> 16)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """In-place _fmix32 for a freshly allocated [N, V] tensor (fewer large temporaries)."""
    h.bitwise_xor_(h >> 16)
    h.mul_(_FMIX_C1 - (1 << 32)).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 13)
    h.mul_(_FMIX_C2 - (1 << 32)).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from (seed, position); [N] int64 each.

    For a fixed seed, k1 is a bijection of the position's low 32 bits (no two positions below 2**32
    of one request share noise); for a fixed position it is a bijection of the seed's low 32 bits.
    """
    s = seeds.to(torch.int64)
    p = positions.to(torch.int64)
    k = _fmix32((s & _M32) ^ _K_SEED_LO)
    k = _fmix32(k ^ ((s >> 32) & _M32) ^ _K_SEED_HI)
    k = _fmix32(k ^ ((p >> 32) & _M32) ^ _K_POS_HI)
    k1 = _fmix32(k ^ (p & _M32) ^ _K_POS_LO)
    k2 = _fmix32(k1 ^ _K_ROW2)
    return k1, k2


def _token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] int64: a bijective 32-bit scramble of each token index."""
    t = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _fmix32(_mul32(t, _GOLDEN) ^ _K_TOKEN)


def _keyed_hash(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] int64 in [0, 2**32): h(seed, position, token) = fmix32(fmix32(k1 ^ T) + k2 mod 2**32).

    The second keyed round removes the "rows are shifted copies of each other" structure that a
    single k ^ T or k + T round would have. The hash of token j does not depend on vocab_size.
    """
    k1, k2 = _row_keys(seeds, positions)
    t = _token_keys(vocab_size, seeds.device)
    h = _fmix32_(k1[:, None] ^ t[None, :])
    return _fmix32_(h.add_(k2[:, None]).bitwise_and_(_M32))


def keyed_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Counter-based uniforms, one per (row, token index), strictly inside (0, 1).

    Args:
        seeds: [N] int64 request seeds (any int64; all 64 bits are used).
        positions: [N] int64 output positions q.
        vocab_size: V, number of token indices per row.
        dtype: torch.float32 (default) uses the top 23 hash bits, u = (h23 + 0.5) / 2**23, every value
            exactly representable, min 2**-24, max 1 - 2**-24. torch.float64 uses all 32 bits,
            u = (h + 0.5) / 2**32.
    Returns:
        [N, V] tensor of `dtype` on seeds.device. Entry [i, j] depends only on (seeds[i], positions[i],
        j): not on N, V, the other rows or the device (bit-identical on CPU and CUDA).
    """
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(f"seeds and positions must be 1-D of equal length, got {tuple(seeds.shape)} and {tuple(positions.shape)}")
    h = _keyed_hash(seeds, positions.to(seeds.device), vocab_size)
    if dtype == torch.float64:
        return (h.to(torch.float64) + 0.5) * (2.0**-32)
    if dtype == torch.float32:
        h >>= 9
        return h.to(torch.float32).add_(0.5).mul_(2.0**-23)
    raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] float32 standard Gumbel noise g = -log(-log(u)), u = keyed_uniform(...); finite, in about [-2.8, 16.6]."""
    u = keyed_uniform(seeds, positions, vocab_size, torch.float32)
    return u.log_().neg_().log_().neg_()


# Rows per eager chunk of the noise computation: bounds the transient int64 [rows, V] buffers to
# about 2**25 elements (256 MiB each) however large the batch is.
_CHUNK_ELEMS = 1 << 25


def _perturbed_argmax(x: torch.Tensor, thr: torch.Tensor | None, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """argmax_j (x[i, j] + g[i, j]) over tokens with x >= thr[i]; [N, V], [N, 1] | None, [N], [N] -> [N] int64."""
    y = gumbel_noise(seeds, positions, x.shape[1]).add_(x)
    if thr is not None:
        y.masked_fill_(x < thr, float("-inf"))
    return y.argmax(dim=-1)


def _perturbed_argmax_chunked(x, thr, seeds, positions):
    n, v = x.shape
    rows = max(1, _CHUNK_ELEMS // max(v, 1))
    if n <= rows:
        return _perturbed_argmax(x, thr, seeds, positions)
    return torch.cat(
        [
            _perturbed_argmax(x[i : i + rows], None if thr is None else thr[i : i + rows], seeds[i : i + rows], positions[i : i + rows])
            for i in range(0, n, rows)
        ]
    )


_compiled_perturbed_argmax = None


def _get_compiled():
    global _compiled_perturbed_argmax
    if _compiled_perturbed_argmax is None:
        _compiled_perturbed_argmax = torch.compile(_perturbed_argmax, dynamic=True, fullgraph=True)
    return _compiled_perturbed_argmax


_warmed_up: set[tuple[str, int]] = set()  # (device, vocab_size) whose compiled sampler is built


def warm_up_compiled_sampler(vocab_size: int, device: torch.device | str) -> None:
    """Build the torch.compile'd sampler now (once per process, device and vocabulary size).

    Compiling takes seconds and runs host syncs; left to the first sampled step it would stall
    that step (and break the one-sync-per-step rule of the GPU path), so engines with compiled
    sampling call this at start-up, as vLLM warms up its sampler. It samples four dummy batches:
    1 and 2 rows (dynamic shapes specialise size 1) x with and without a keep threshold (two
    graphs: the threshold is a tensor or None; top-k, top-p and min-p all make the tensor one).
    It runs under torch.inference_mode, as the runner's steps do: torch.compile guards on the grad
    mode (and on whether its inputs are inference tensors), so graphs built with grad enabled would
    be rebuilt inside the first sampled step. Callers of the compiled sampler must therefore build
    its inputs and call it under inference_mode too.
    """
    key = (str(torch.device(device)), int(vocab_size))
    if key in _warmed_up:
        return
    with torch.inference_mode():
        for top_p in (1.0, 0.9):
            for rows in (1, 2):
                params = [SamplingParams(temperature=1.0, top_p=top_p, seed=0)] * rows
                logits = torch.zeros(rows, vocab_size, device=device)
                positions = torch.zeros(rows, dtype=torch.long, device=device)
                SamplingTensors.from_params(params, device).sample(logits, positions, compiled=True)
    _warmed_up.add(key)


def _keep_threshold(
    x: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    any_top_k: bool | None,
    any_top_p: bool | None,
    max_top_k: int | None,
    min_p: torch.Tensor | None = None,
    any_min_p: bool | None = None,
) -> torch.Tensor | None:
    """Per-row logit threshold [N, 1] float32 (keep tokens with x >= threshold) for min-p, top-k
    then top-p, or None (keep everything).

    Args:
        x: [N, V] float32 tempered logits (logits / T).
        top_k: [N] int64; top_p: [N] float32; min_p: [N] float32 or None (no row uses min-p).
        any_top_k, any_top_p, max_top_k, any_min_p: sample()'s hints (False: skip that filter).

    Semantics (row-wise, independent of which code path runs; vLLM's order):
      min-p: drop tokens whose tempered probability is < min_p * the top token's, i.e. keep
        x >= max(x) + log(min_p) (the same test on logits, no softmax; it can differ from vLLM's
        float32 probability test only by rounding, for a token exactly at the boundary); min_p = 0
        keeps all, min_p = 1 keeps the tokens tied with the top one.
      top-k: k <= 0 or k >= V keeps all; otherwise keep tokens whose scaled logit is >= the k-th
        largest scaled logit (tokens tied with the k-th are kept too, like vLLM). Min-p and top-k
        both keep a highest-logit prefix, so together they keep the shorter one (the larger
        threshold), in either order.
      top-p (after min-p and top-k, on the tempered distribution renormalised over their
        survivors): sort kept tokens by probability descending; keep the smallest prefix whose mass
        >= p (the token that crosses p is kept; the top token is always kept; ties with the last
        kept token are kept too). p >= 1 keeps all.
    """
    use_k = any_top_k is not False
    use_p = any_top_p is not False
    use_m = min_p is not None and any_min_p is not False
    if not (use_k or use_p or use_m):
        return None
    n, v = x.shape
    if not (use_k or use_p):  # min-p alone: the row maximum is all it needs, no sort
        return _min_p_threshold(x.amax(dim=-1, keepdim=True), min_p)
    k_eff = torch.where(top_k > 0, top_k.to(torch.int64).clamp(max=v), v)
    if not use_p and max_top_k is not None and 0 < max_top_k < v:
        # Only top-k (and min-p), and every sampling row has k <= max_top_k: partial top-k, no full sort.
        vals = torch.topk(x, max_top_k, dim=-1, largest=True, sorted=True).values
        thr_k = vals.gather(1, (k_eff.clamp(max=max_top_k) - 1)[:, None])
        return torch.maximum(thr_k, _min_p_threshold(vals[:, :1], min_p)) if use_m else thr_k
    sv = torch.sort(x, dim=-1, descending=True).values
    thr_k = sv.gather(1, (k_eff - 1)[:, None])
    if use_m:
        thr_k = torch.maximum(thr_k, _min_p_threshold(sv[:, :1], min_p))
    if not use_p:
        return thr_k
    sv = sv.masked_fill(sv < thr_k, float("-inf"))
    probs = torch.softmax(sv, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    excl = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # mass strictly before each sorted token; monotone
    p = top_p.to(torch.float32)[:, None]
    n_keep = (excl < p).sum(dim=-1, keepdim=True).clamp(min=1)
    thr_p = sv.gather(1, n_keep - 1)
    thr_p = torch.where(p >= 1.0, float("-inf"), thr_p)
    return torch.maximum(thr_k, thr_p)


def _min_p_threshold(top: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[N, 1] float32 min-p logit threshold max(x) + log(min_p) (-inf where min_p = 0) from the
    rows' largest tempered logits `top` [N, 1] float32 and min_p [N] float."""
    m = min_p.to(torch.float32)[:, None]
    return torch.where(m > 0, top + m.log(), float("-inf"))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    all_greedy: bool | None = None,
    any_top_k: bool | None = None,
    any_top_p: bool | None = None,
    max_top_k: int | None = None,
    min_p: torch.Tensor | None = None,
    any_min_p: bool | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Sample one token per row; row i is a pure function of (seeds[i], positions[i], logits[i], params[i]).

    Args:
        logits: [N, V] float (any float dtype; computed in float32).
        temperature: [N] float. Rows with temperature <= 0 are greedy: argmax of the raw logits (ties
            -> lowest index, like torch.argmax); their top_k/top_p/min_p/seed are ignored.
        top_k: [N] int64; 0 or -1 = all tokens.
        top_p: [N] float in (0, 1]; 1 = all tokens.
        seeds: [N] int64 request seeds.
        positions: [N] int64 output positions q.
        all_greedy, any_top_k, any_top_p, max_top_k: optional host-side hints (from SamplingTensors)
            that only select faster paths; None means "unknown" and takes the general path. They never
            change a row's result, provided they are true: all_greedy=True -> skip the noise;
            any_top_k=False -> no row uses top-k; any_top_p=False -> no row uses top-p; max_top_k=m ->
            every non-greedy row has 0 < top_k <= m (lets top-k use torch.topk instead of a full sort).
        min_p: [N] float in [0, 1], 0 = off (vLLM's min_p), or None: no row uses it.
        any_min_p: hint like any_top_p: False -> no non-greedy row has min_p > 0 (no min-p work at
            all); None -> unknown (min-p computed whenever `min_p` is given).
        compiled: fuse hash + Gumbel + mask + argmax into one kernel with torch.compile (dynamic
            shapes; compiled once per process on first use, so warm it up before CUDA-graph capture).
            Same tokens as eager (integer hash is exact); on an H200 with V = 151936 the whole call
            took 1.7 ms instead of 21 ms for 1024 rows at T = 1 (top-p rows stay dominated by the
            full-vocabulary sort: 17 ms vs 37 ms). Eager noise and the top-k/top-p/min-p thresholds
            run in row chunks of about 2**25 elements to bound temporary memory.
    Returns:
        [N] int64 token ids on logits.device.

    Non-greedy rows: x = logits / T; keep min-p, top-k, then top-p (see _keep_threshold for exact tie
    semantics; vLLM's order and boundary rule); token = argmax(x masked to -inf + Gumbel(keyed)), which
    is an exact sample of softmax over the kept tokens. No host sync, no per-row Python loop.
    """
    greedy_tokens = fused_argmax(logits, fused=False)  # torch.argmax (on the CPU over float32: faster, same ids)
    if all_greedy:
        return greedy_tokens
    n, v = logits.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature, dtype=torch.float32), temperature.to(torch.float32))
    x = logits.to(torch.float32) / t[:, None]
    rows = max(1, _CHUNK_ELEMS // max(v, 1))  # bounds sort/softmax/cumsum temporaries too
    if n <= rows:
        thr = _keep_threshold(x, top_k, top_p, any_top_k, any_top_p, max_top_k, min_p, any_min_p)
    else:
        parts = [
            _keep_threshold(x[i : i + rows], top_k[i : i + rows], top_p[i : i + rows], any_top_k, any_top_p, max_top_k,
                            None if min_p is None else min_p[i : i + rows], any_min_p)
            for i in range(0, n, rows)
        ]
        thr = None if parts[0] is None else torch.cat(parts)
    seeds, positions = seeds.to(x.device), positions.to(x.device)
    fn = _get_compiled() if compiled else _perturbed_argmax_chunked
    return torch.where(greedy, greedy_tokens, fn(x, thr, seeds, positions))


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the raw model distribution (log_softmax of the unscaled logits; vLLM default).

    Args:
        logits: [N, V] float.
        token_ids: [N] int64, the sampled tokens.
        num_top: number of top alternatives per row (0 allowed).
    Returns:
        token_logprob: [N] float32, log p(token_ids[i]).
        top_ids: [N, num_top] int64, most likely tokens, descending by probability; equal
            log-probabilities (bf16 logits tie often) in ascending id order, as greedy argmax breaks
            the tie (torch.topk leaves tie order unspecified), so a greedy token heads its own list
            unless the tie runs past num_top entries (which of the tied ids topk keeps then is
            torch's choice).
        top_logprobs: [N, num_top] float32, their log-probabilities.
    """
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    token_logprob = lp.gather(1, token_ids.to(torch.int64)[:, None]).squeeze(1)
    k = min(int(num_top), lp.shape[-1])
    top_logprobs, top_ids = torch.topk(lp, k, dim=-1, largest=True, sorted=True)
    by_id = top_ids.argsort(dim=-1)  # ids ascending, then a stable sort by log-prob keeps that order in ties
    top_ids, top_logprobs = top_ids.gather(1, by_id), top_logprobs.gather(1, by_id)
    order = top_logprobs.argsort(dim=-1, descending=True, stable=True)
    return token_logprob, top_ids.gather(1, order), top_logprobs.gather(1, order)


def _to_int64(seed: int) -> int:
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= (1 << 63) else s


def _repeat(values: list, repeats: Sequence[int]) -> list:
    """values[i] repeated repeats[i] times, in order."""
    if len(values) != len(repeats):
        raise ValueError(f"got {len(repeats)} repeats for {len(values)} params")
    if repeats.count(1) == len(repeats):  # each value once
        return values
    out = []
    for v, n in zip(values, repeats):
        out += [v] * n
    return out


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors, plus host-side fast-path hints.

    temperature: [N] float32 (0 = greedy). top_k: [N] int64 (0 = all). top_p: [N] float32.
    min_p: [N] float32 (0 = off). seeds: [N] int64 (params.resolved_seed, reduced mod 2**64 to int64).
    all_greedy: every row greedy. any_top_k / any_top_p / any_min_p: some non-greedy row uses
    top-k / top-p / min-p (any_min_p False: sampling does no min-p work at all).
    max_top_k: max top_k over non-greedy rows when all of them use top-k, else None.
    penalties: presence / frequency / repetition penalty entries over these rows
    (blockdraft.sample.penalties; None: no row has penalties), applied before sampling, greedy
    rows included. `from_params` leaves it None: the runner builds it from the requests' histories.
    token_bitmask: [C, ceil(V / 32)] int32 allowed tokens of the rows `token_bitmask_rows` ([C]
    int64: the rows of requests with a structured-output constraint; None: all N rows)
    (blockdraft.sample.bitmask), or None: no row is constrained. Applied to the logits in place
    before the penalties, so log-probabilities read the masked logits, as vLLM's do.
    sampling_mask / sampling_mask_rows: the same layout for the rows of requests with
    allowed_token_ids or bad_words (blockdraft.sample.token_mask), or None; applied to the copy
    that is sampled, after the penalties, so log-probabilities read the raw logits, as vLLM's do.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int | None
    penalties: PenaltyEntries | None = None
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: torch.Tensor | None = None
    sampling_mask: torch.Tensor | None = None
    sampling_mask_rows: torch.Tensor | None = None

    @property
    def argmax_only(self) -> bool:
        """Every row's token is the argmax of its raw logits: all greedy, no penalties, no token mask."""
        return self.all_greedy and self.penalties is None and self.token_bitmask is None and self.sampling_mask is None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device | str | None = None,
        repeats: Sequence[int] | None = None,
    ) -> "SamplingTensors":
        """One row per SamplingParams, in order; with `repeats`, params[i] fills repeats[i] rows
        (e.g. the 1 + k logits rows of a verify step), converted once per params."""
        temps = [float(p.temperature) for p in params]
        ks = [int(p.top_k) if p.top_k > 0 else 0 for p in params]
        ps = [float(p.top_p) for p in params]
        mps = [float(p.min_p) for p in params]
        seeds = [_to_int64(p.resolved_seed) for p in params]
        rand = [i for i, t in enumerate(temps) if t > 0 and (repeats is None or repeats[i] > 0)]
        any_top_k = any(ks[i] > 0 for i in rand)
        any_top_p = any(ps[i] < 1.0 for i in rand)
        any_min_p = any(mps[i] > 0.0 for i in rand)
        max_top_k = max((ks[i] for i in rand), default=0) if rand and all(ks[i] > 0 for i in rand) else None
        if repeats is not None:
            temps, ks, ps, mps, seeds = (_repeat(v, repeats) for v in (temps, ks, ps, mps, seeds))
        # two conversions, of three float rows and two int rows (host_tensor: much faster than torch.tensor on lists)
        floats = host_tensor(temps + ps + mps, torch.float32).view(3, -1).to(device)
        ints = host_tensor(ks + seeds, torch.int64).view(2, -1).to(device)
        return cls(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            seeds=ints[1],
            all_greedy=not rand,
            any_top_k=any_top_k,
            any_top_p=any_top_p,
            any_min_p=any_min_p,
            max_top_k=max_top_k,
        )

    def __len__(self) -> int:
        return self.temperature.shape[0]

    def repeat_interleave(self, repeats: int | torch.Tensor) -> "SamplingTensors":
        """Repeat each row (e.g. K+1 verify rows per request); hints stay valid.

        A tensor `repeats` ([N] int64) makes torch sync once for the output size; pass an int or
        index with `select` to stay sync-free.

        Raises:
            ValueError: with penalties (their entries name rows of the original layout).
        """
        self._check_no_penalties("repeat_interleave")
        return SamplingTensors(
            temperature=self.temperature.repeat_interleave(repeats, dim=0),
            top_k=self.top_k.repeat_interleave(repeats, dim=0),
            top_p=self.top_p.repeat_interleave(repeats, dim=0),
            min_p=self.min_p.repeat_interleave(repeats, dim=0),
            seeds=self.seeds.repeat_interleave(repeats, dim=0),
            all_greedy=self.all_greedy,
            any_top_k=self.any_top_k,
            any_top_p=self.any_top_p,
            any_min_p=self.any_min_p,
            max_top_k=self.max_top_k,
        )

    def select(self, index: torch.Tensor) -> "SamplingTensors":
        """Rows by index ([M] int64, any order, repeats allowed); hints stay valid (conservative).

        Raises:
            ValueError: with penalties (their entries name rows of the original layout).
        """
        self._check_no_penalties("select")
        return SamplingTensors(
            temperature=self.temperature.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            min_p=self.min_p.index_select(0, index),
            seeds=self.seeds.index_select(0, index),
            all_greedy=self.all_greedy,
            any_top_k=self.any_top_k,
            any_top_p=self.any_top_p,
            any_min_p=self.any_min_p,
            max_top_k=self.max_top_k,
        )

    def _check_no_penalties(self, method: str) -> None:
        if self.penalties is not None or self.token_bitmask is not None or self.sampling_mask is not None:
            raise ValueError(f"SamplingTensors.{method} cannot move rows with penalties or a token bitmask: they "
                             f"index the original rows")

    def sample(self, logits: torch.Tensor, positions: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """sample() with these rows' parameters and hints, after their penalties (if any).

        logits [N, V], positions [N] -> [N] int64. With a token bitmask, `logits` itself is masked
        first (disallowed tokens -inf, in place). With penalties the rows are then sampled from a
        penalised float32 copy (blockdraft.sample.penalties.apply_penalties), and with a sampling
        mask from a copy masked after them (`logits` keeps the raw values for log-probabilities).
        """
        if self.token_bitmask is not None:
            apply_token_bitmask_rows_(logits, self.token_bitmask, self.token_bitmask_rows)
        if self.penalties is not None:
            logits = apply_penalties(logits, self.penalties)
        if self.sampling_mask is not None:
            copy = logits if self.penalties is not None else logits.clone()  # apply_penalties copied already
            logits = apply_token_bitmask_rows_(copy, self.sampling_mask, self.sampling_mask_rows)
        return sample(
            logits,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seeds,
            positions,
            all_greedy=self.all_greedy,
            any_top_k=self.any_top_k,
            any_top_p=self.any_top_p,
            max_top_k=self.max_top_k,
            min_p=self.min_p if self.any_min_p else None,
            any_min_p=self.any_min_p,
            compiled=compiled,
        )
