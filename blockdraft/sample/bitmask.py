"""Token masks of grammar-constrained rows (blockdraft.structured), applied to logits in place."""

from __future__ import annotations

import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: ceil(V / 32)."""
    return (vocab_size + 31) // 32


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
