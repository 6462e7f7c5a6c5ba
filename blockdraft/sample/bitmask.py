"""Token bitmasks of logits rows: a grammar's (blockdraft.structured) and allowed_token_ids /
bad_words' (blockdraft.sample.token_mask), built on the host and applied to logits on the device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool (True = allowed) -> [ceil(V / 32)] int32 in `apply_token_bitmask_`'s layout (the
    bits past V are clear)."""
    v = allowed.shape[0]
    bits = torch.zeros(bitmask_words(v) * 32, dtype=torch.int64)
    bits[:v] = allowed
    words = (bits.view(-1, 32) << torch.arange(32)).sum(1)  # distinct powers of two: exact, in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is int32's sign


def disallow_tokens_(mask: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int]) -> None:
    """Clear bit token_ids[n] of row rows[n] of `mask`, for every n, in place (one vectorised op past 8 tokens).

    Args:
        mask: [R, ceil(V / 32)] int32 bitmask rows on the CPU (any row stride).
        rows: row indices in [0, R). token_ids: as many token ids in [0, V) (repeats allowed).
    """
    if not len(token_ids):
        return
    words = mask.numpy().view(np.uint32)  # unsigned: bit 31 is int32's sign bit
    if len(token_ids) <= 8:  # a few element writes cost less than ufunc.at's set-up (~2.5 us)
        for r, t in zip(rows, token_ids):
            words[r, t >> 5] &= 0xFFFFFFFF ^ (1 << (t & 31))
        return
    t = np.asarray(token_ids, dtype=np.int64)
    # ufunc.at, not words[...] &= ...: two tokens of one word must both clear their bit
    np.bitwise_and.at(words, (np.asarray(rows, dtype=np.int64), t >> 5), ~(np.uint32(1) << (t & 31).astype(np.uint32)))


def apply_token_bitmask_rows_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`apply_token_bitmask_` on some rows of `logits` only, in place; returns `logits`.

    Args:
        logits: [N, V] float. bitmask: [C, ceil(V / 32)] int32, the masks of rows `rows`.
        rows: [C] int64 distinct row indices into `logits` (same device), or None: every row (C = N).
    A batch with one constrained request masks its 1 + K rows, not the whole batch's [N, V].
    """
    if rows is None:
        return apply_token_bitmask_(logits, bitmask)
    sub = logits.index_select(0, rows)
    return logits.index_copy_(0, rows, apply_token_bitmask_(sub, bitmask))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place; returns `logits`.

    Args:
        logits: [N, V] float (any float dtype), on any device.
        bitmask: [N, ceil(V / 32)] int32 on the same device: token t of row r is allowed iff bit
            t % 32 of bitmask[r, t // 32] is set (llguidance's and xgrammar's layout; an all-ones
            row, -1, allows every token).
    Raises:
        ValueError: shapes or dtype that do not match.
    Works word by word with no host sync: each row's bits expand to [ceil(V / 32) * 32] booleans.
    """
    n, v = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape != (n, bitmask_words(v)):
        raise ValueError(f"token bitmask must be int32 [{n}, {bitmask_words(v)}] for logits [{n}, {v}], got "
                         f"{bitmask.dtype} {list(bitmask.shape)}")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :v]
    return logits.masked_fill_(allowed == 0, float("-inf"))
