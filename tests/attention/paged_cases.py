"""Random ragged paged-attention batches shared by the CPU, interpreter and GPU kernel tests.

A case mixes decode rows (1 query), verify rows (1 + k queries), prefill chunks (many queries
after a cached prefix) or draft blocks (B uncached rows over a cached context), padding requests
(seq_len 0, no rows) anywhere in the batch and padding rows (row_req -1, slot -1) at the end, as a
CUDA-graph bucket lays them out. Pages are shuffled, the cache is filled with random garbage (so
unmasked reads show up) and unused block-table entries point at real pages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from blockdraft.attention.metadata import PADDING_SLOT, AttentionMetadata


@dataclass
class PagedCase:
    """Inputs of one paged-attention call (see AttentionBackend)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    sliding_window: int | None
    causal: bool

    def run(self, backend, caches: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Call `backend` on this case (on `caches` instead of the case's own when given)."""
        k_cache, v_cache = caches if caches is not None else (self.k_cache, self.v_cache)
        return backend(
            self.q, self.k, self.v, k_cache, v_cache, self.meta, self.scale,
            sliding_window=self.sliding_window, causal=self.causal,
        )  # fmt: skip

    def to(self, device: str | torch.device) -> "PagedCase":
        """The same case on `device` (host lists kept)."""
        m = self.meta
        meta = AttentionMetadata(
            query_start_loc=m.query_start_loc.to(device),
            seq_lens=m.seq_lens.to(device),
            block_table=m.block_table.to(device),
            slot_mapping=m.slot_mapping.to(device),
            kv_block_size=m.kv_block_size,
            query_start_loc_host=m.query_start_loc_host,
            seq_lens_host=m.seq_lens_host,
            num_block_tokens=m.num_block_tokens,
            row_req=m.row_req.to(device),
        )
        t = [x.to(device) for x in (self.q, self.k, self.v, self.k_cache, self.v_cache)]
        return PagedCase(*t, meta, self.scale, self.sliding_window, self.causal)


def random_case(
    seed: int,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    kv_block_size: int = 8,
    num_reqs: int = 4,
    max_ctx: int = 40,
    block_tokens: int = 0,
    kinds: tuple[str, ...] = ("decode", "verify", "prefill"),
    sliding_window: int | None = None,
    causal: bool = True,
    num_pad_reqs: int = 1,
    num_pad_rows: int = 2,
    max_chunk: int = 24,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PagedCase:
    """One random batch; block_tokens > 0 makes a draft-block batch (B rows per real request).

    kinds: request kinds drawn for causal batches (decode = 1 row, verify = 2..8 rows,
    prefill = a chunk of 1..max_chunk rows after a random cached prefix).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [], []
    for _ in range(num_reqs):
        ctx = rng.randint(0, max_ctx)
        if block_tokens:
            q_len, seq_len = block_tokens, ctx  # block rows are not counted in seq_lens
        else:
            kind = rng.choice(kinds)
            q_len = {"decode": 1, "verify": rng.randint(2, 8), "prefill": rng.randint(1, max_chunk)}[kind]
            seq_len = ctx + q_len
        seq_lens.append(seq_len)
        q_lens.append(q_len)
    for _ in range(num_pad_reqs):  # padding requests: anywhere, seq_len 0, no rows
        at = rng.randint(0, len(seq_lens))
        seq_lens.insert(at, 0)
        q_lens.insert(at, 0)

    need = [-(-n // kv_block_size) for n in seq_lens]
    num_pages = sum(need) + 3
    pages = list(range(num_pages))
    rng.shuffle(pages)
    width = max(need + [1]) + rng.randint(0, 2)
    table, at = [], 0
    for n in need:
        # Unused entries point at real (garbage-filled) pages: reading them unmasked would show.
        table.append(pages[at : at + n] + [rng.randrange(num_pages) for _ in range(width - n)])
        at += n

    slots, qsl, row_req = [], [0], []
    for r, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        qsl.append(qsl[-1] + q_len)
        row_req += [r] * q_len
        if block_tokens:
            slots += [rng.randrange(num_pages * kv_block_size) for _ in range(q_len)]  # must be ignored
        else:
            slots += [table[r][t // kv_block_size] * kv_block_size + t % kv_block_size for t in range(seq_len - q_len, seq_len)]
    slots += [PADDING_SLOT] * num_pad_rows
    row_req += [-1] * num_pad_rows
    rows = qsl[-1] + num_pad_rows

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        kv_block_size=kv_block_size,
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
        num_block_tokens=block_tokens,
        row_req=torch.tensor(row_req, dtype=torch.int32),
    )
    case = PagedCase(
        q=randn(rows, num_heads, head_dim),
        k=randn(rows, num_kv_heads, head_dim),
        v=randn(rows, num_kv_heads, head_dim),
        k_cache=randn(num_pages, kv_block_size, num_kv_heads, head_dim),
        v_cache=randn(num_pages, kv_block_size, num_kv_heads, head_dim),
        meta=meta,
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
        causal=causal,
    )
    return case.to(device)


def pad_to(case: PagedCase, num_rows: int, num_reqs: int, width: int, num_pages: int, seed: int = 0) -> PagedCase:
    """`case` padded to fixed (CUDA-graph bucket) shapes: padding rows (row_req -1, slot -1) and
    padding requests (seq_len 0, no rows) appended, the block table widened with zeros, extra
    garbage pages appended to the caches. Host lists are kept (for torch_ref)."""
    m = case.meta
    rows, reqs = case.q.shape[0], m.seq_lens.shape[0]
    if rows > num_rows or reqs > num_reqs or m.block_table.shape[1] > width or case.k_cache.shape[0] > num_pages:
        raise ValueError(f"case ({rows} rows, {reqs} reqs, {tuple(m.block_table.shape)} table, "
                         f"{case.k_cache.shape[0]} pages) does not fit the bucket")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    dev = case.q.device

    def grow(x: torch.Tensor, n: int, fill: float | None = None) -> torch.Tensor:
        extra_shape = (n - x.shape[0], *x.shape[1:])
        if fill is None:
            extra = torch.randn(extra_shape, generator=gen).to(x.dtype).to(dev)
        else:
            extra = torch.full(extra_shape, fill, dtype=x.dtype, device=dev)
        return torch.cat([x, extra])

    qsl = m.query_start_loc_host + [m.query_start_loc_host[-1]] * (num_reqs - reqs)
    table = torch.zeros(num_reqs, width, dtype=torch.int32, device=dev)
    table[:reqs, : m.block_table.shape[1]] = m.block_table
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=grow(m.seq_lens, num_reqs, 0),
        block_table=table,
        slot_mapping=grow(m.slot_mapping, num_rows, PADDING_SLOT),
        kv_block_size=m.kv_block_size,
        query_start_loc_host=qsl,
        seq_lens_host=m.seq_lens_host + [0] * (num_reqs - reqs),
        num_block_tokens=m.num_block_tokens,
        row_req=grow(m.row_req, num_rows, -1),
    )
    return PagedCase(
        grow(case.q, num_rows), grow(case.k, num_rows), grow(case.v, num_rows),
        grow(case.k_cache, num_pages), grow(case.v_cache, num_pages),
        meta, case.scale, case.sliding_window, case.causal,
    )  # fmt: skip
