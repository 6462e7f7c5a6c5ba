"""Explicit attention metadata for one forward over a batch of ragged requests.

Rows of a forward are the concatenation of each request's query tokens (request i owns rows
`query_start_loc[i]:query_start_loc[i+1]`). The KV cache is paged: a page (KV block) holds
`kv_block_size` tokens, a request's `block_table` row lists its pages in order, and a token at
position t lives at slot `block_table[t // kv_block_size] * kv_block_size + t % kv_block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PADDING_SLOT = -1  # slot_mapping value that writes nothing (padding rows, rejected drafts)


@dataclass
class AttentionMetadata:
    """Everything an attention layer needs to know about the batch (no hidden globals).

    Attributes:
        query_start_loc: [num_reqs + 1] int32, cumulative query rows per request.
        seq_lens: [num_reqs] int32, tokens in context for each request AFTER this forward's
            rows are written (cached tokens + this step's query tokens). For a non-causal draft
            block that is not cached, the tokens of the block are NOT counted (see
            `num_block_tokens`).
        block_table: [num_reqs, max_blocks_per_req] int32 page ids (unused entries are 0).
        slot_mapping: [num_rows] int64 cache slot where each row's K/V is written;
            PADDING_SLOT writes nothing.
        kv_block_size: tokens per page.
        query_start_loc_host / seq_lens_host: the same as Python lists (CPU path convenience,
            so the reference backend does not sync per layer); None on the GPU path, where
            nothing may be read back to the host inside a step.
        num_block_tokens: 0 for ordinary causal forwards. For a DFlash draft block, the number
            of block rows per request: those rows attend to the cached context (seq_lens tokens)
            and to every row of their own block bidirectionally; their K/V is not cached.
        row_req: [num_rows] int32 request index of each row, -1 for padding rows (rows past
            `query_start_loc[-1]`, e.g. in a CUDA-graph bucket). GPU kernels launch one
            program per row and use it to find their request without a host sync.

    Padding (CUDA-graph buckets): a forward may carry more rows and requests than are real.
    Padding requests have seq_len 0 and an empty query range; padding rows have row_req -1 and
    slot PADDING_SLOT, write nothing and produce zeros.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    kv_block_size: int
    query_start_loc_host: list[int] | None
    seq_lens_host: list[int] | None
    num_block_tokens: int = 0
    row_req: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        """Requests in the batch, padding requests included."""
        return int(self.seq_lens.shape[0])


def build_metadata(
    seq_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    kv_block_size: int,
    num_block_tokens: int = 0,
    device: str | torch.device = "cpu",
) -> AttentionMetadata:
    """Metadata for one forward from host lists (tests, CPU paths; the GPU runner builds its own).

    Args:
        seq_lens: per request, context tokens after this forward (causal), or the cached
            context the draft block attends to (draft-block mode, block rows not counted).
        query_lens: per request, rows in this forward (causal: its newest `query_len` tokens).
        block_tables: per request, its page ids in order; must cover the written positions.
        kv_block_size: tokens per page.
        num_block_tokens: 0 for causal forwards; B for draft blocks (every query_len must be B;
            rows get PADDING_SLOT, nothing is written).
    Raises:
        ValueError: mismatched lengths, query_len > seq_len, or a block table too short.
    """
    if not len(seq_lens) == len(query_lens) == len(block_tables):
        raise ValueError("seq_lens, query_lens and block_tables must have one entry per request")
    if num_block_tokens and any(n != num_block_tokens for n in query_lens):
        raise ValueError(f"draft-block mode needs query_len == num_block_tokens ({num_block_tokens}) for every request")
    slots: list[int] = []
    for seq_len, q_len, pages in zip(seq_lens, query_lens, block_tables):
        slots += _request_slots(seq_len, q_len, pages, kv_block_size, num_block_tokens)
    width = max([len(p) for p in block_tables] + [1])
    table = [list(p) + [0] * (width - len(p)) for p in block_tables]
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    row_req = [i for i, q_len in enumerate(query_lens) for _ in range(q_len)]
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        kv_block_size=kv_block_size,
        query_start_loc_host=qsl,
        seq_lens_host=list(seq_lens),
        num_block_tokens=num_block_tokens,
        row_req=torch.tensor(row_req, dtype=torch.int32, device=device),
    )


def _request_slots(seq_len: int, q_len: int, pages: list[int], kv_block_size: int, num_block_tokens: int) -> list[int]:
    """Cache slots of one request's rows (PADDING_SLOT for draft-block rows)."""
    if len(pages) * kv_block_size < seq_len:
        raise ValueError(f"block table of {len(pages)} pages x {kv_block_size} cannot hold {seq_len} tokens")
    if num_block_tokens:
        return [PADDING_SLOT] * q_len
    if q_len > seq_len:
        raise ValueError(f"query_len {q_len} exceeds seq_len {seq_len}")
    return [pages[t // kv_block_size] * kv_block_size + t % kv_block_size for t in range(seq_len - q_len, seq_len)]
