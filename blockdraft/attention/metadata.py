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
            so the reference backend does not sync per layer).
        num_block_tokens: 0 for ordinary causal forwards. For a DFlash draft block, the number
            of block rows per request: those rows attend to the cached context (seq_lens tokens)
            and to every row of their own block bidirectionally; their K/V is not cached.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    kv_block_size: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    num_block_tokens: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)
