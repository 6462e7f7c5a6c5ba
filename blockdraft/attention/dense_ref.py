"""Sync-free paged attention in vectorised torch: the twin of the Triton kernel.

Same signature and semantics as the reference `blockdraft.attention.torch_ref.paged_attention`
(an AttentionBackend), but computed for all rows at once from the DEVICE tensors of the metadata
only (query_start_loc, seq_lens, block_table, slot_mapping, row_req, num_block_tokens). It never
reads the `*_host` lists, never copies a value to the host, and every intermediate shape depends
only on the input shapes, so it can run inside a CUDA graph. It is the oracle for padded,
graph-shaped batches and the torch twin of `blockdraft.attention.triton_attention`.

Semantics (as torch_ref):
  causal (num_block_tokens == 0): row t of request r sits at position
      p = seq_lens[r] - (query_start_loc[r+1] - t) and attends to cached positions
      max(0, p - window + 1) .. p (the window includes the row itself). K/V of the rows are
      written to the cache first (slot_mapping, PADDING_SLOT writes nothing).
  draft block (num_block_tokens = B > 0): keys are the seq_lens[r] cached tokens followed by the
      block's own B k/v rows (taken from `k`/`v`, never cached); row t sits at position
      seq_lens[r] + (t - query_start_loc[r]); bidirectional inside the block, or causal (+ window)
      when `causal` is set or the layer has a sliding window.
  padding rows (row_req == -1) produce zeros.
Math is float32 (like torch_ref's explicit path); the output has q's dtype.
"""

from __future__ import annotations

import torch

from blockdraft.attention.metadata import AttentionMetadata


def row_requests_device(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] int32 request of each row from device cumulative row counts, -1 past the last.

    Sync-free stand-in for a missing `meta.row_req`: empty (padding) requests own no rows.
    """
    rows = torch.arange(num_rows, device=query_start_loc.device, dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc, rows, right=True) - 1
    num_reqs = query_start_loc.shape[0] - 1
    return torch.where(req >= num_reqs, -1, req).to(torch.int32)


def write_kv_dense(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter rows into the paged cache without a host sync; slots < 0 (PADDING_SLOT) write nothing.

    Args:
        k_cache, v_cache: [num_blocks, kv_block_size, num_kv_heads, head_dim] (written in place).
        k, v: [num_rows, num_kv_heads, head_dim]; cast to the cache dtype.
        slot_mapping: [num_rows] int64 flat slot (page * kv_block_size + offset) or negative.

    Padding rows cannot be dropped without boolean indexing (a sync), so they are redirected to
    the slot of the first real row and carry that row's own values: duplicate indices then all
    write the same bytes, whichever wins. With no real row at all they rewrite slot 0 with the
    value it already holds.
    """
    if slot_mapping.numel() == 0:
        return
    valid = slot_mapping >= 0
    # index_select with a 1-element index, not x[first]: a 0-d tensor index would sync.
    first = torch.argmax(valid.to(torch.int8)).view(1)  # first real row (0 when there is none)
    any_valid = valid.any()
    slots = torch.where(valid, slot_mapping, torch.where(any_valid, slot_mapping.index_select(0, first), 0)).long()
    for cache, x in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[2:])
        x = x.to(cache.dtype)
        filler = torch.where(any_valid, x.index_select(0, first), flat[:1])
        flat.index_copy_(0, slots, torch.where(valid[:, None, None], x, filler))


def paged_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    causal: bool = True,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write this forward's K/V (causal forwards only), then attend; see the module docstring.

    Args:
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (num_heads % num_kv_heads == 0).
        k_cache, v_cache: [num_blocks, kv_block_size, num_kv_heads, head_dim].
        meta: batch layout (AttentionMetadata); only its device tensors are read. `row_req` is
            derived from query_start_loc when None.
        scale: softmax scale.
        sliding_window: window size incl. self, or None.
        causal: draft-block mode only (False = bidirectional inside the block).
        kv_written: True when the caller already wrote this forward's K/V into the cache (the
            q/k RoPE kernel's `kv_write`); nothing is written then.
    Returns:
        [T, num_heads, head_dim] in q's dtype; padding rows are zero.
    Memory: gathers every row's full page list, O(T * max_blocks_per_req * kv_block_size *
    num_kv_heads * head_dim) floats -- a test oracle, not a fast path.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    block_tokens = meta.num_block_tokens
    if not kv_written and not block_tokens:
        write_kv_dense(k_cache, v_cache, k, v, meta.slot_mapping)
    device = q.device
    row_req = meta.row_req if meta.row_req is not None else row_requests_device(meta.query_start_loc, num_rows)
    is_row = row_req >= 0  # [T]
    req = row_req.long().clamp(min=0)
    qsl = meta.query_start_loc.long()
    seq_len = meta.seq_lens.long()[req]  # [T]
    row_ids = torch.arange(num_rows, device=device)
    if block_tokens:
        q_pos = seq_len + (row_ids - qsl[req])
    else:
        q_pos = seq_len - (qsl[req + 1] - row_ids)

    # Cached keys: every page of the row's request -> [T, M * bs, kvh, D] at positions 0..M*bs-1.
    pages = meta.block_table.long()[req]  # [T, M]
    keys = k_cache[pages].flatten(1, 2)
    vals = v_cache[pages].flatten(1, 2)
    k_pos = torch.arange(keys.shape[1], device=device)[None, :]
    key_ok = k_pos < seq_len[:, None]
    if block_tokens:
        # The block's own rows follow the context: positions seq_len .. seq_len + B - 1.
        offs = torch.arange(block_tokens, device=device)
        src = (qsl[req][:, None] + offs[None, :]).clamp(max=num_rows - 1)  # [T, B]
        keys = torch.cat([keys, k.to(k_cache.dtype)[src]], dim=1)
        vals = torch.cat([vals, v.to(v_cache.dtype)[src]], dim=1)
        block_len = (qsl[req + 1] - qsl[req])[:, None]
        k_pos = torch.cat([k_pos.expand(num_rows, -1), seq_len[:, None] + offs[None, :]], dim=1)
        key_ok = torch.cat([key_ok, offs[None, :] < block_len], dim=1)
        causal = causal or sliding_window is not None
    else:
        causal = True  # `causal` only switches draft blocks; ordinary forwards are causal
    allowed = key_ok & is_row[:, None]
    if causal:
        allowed = allowed & (k_pos <= q_pos[:, None])
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos[:, None] - sliding_window)

    group = num_heads // num_kv_heads
    qg = q.float().view(num_rows, num_kv_heads, group, head_dim)
    scores = torch.einsum("tkgd,tnkd->tkgn", qg, keys.float()) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    # Padding rows have no allowed key: give them a finite row so softmax stays NaN-free.
    scores = torch.where(is_row[:, None, None, None], scores, 0.0)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("tkgn,tnkd->tkgd", probs, vals.float())
    out = torch.where(is_row[:, None, None, None], out, 0.0)
    return out.reshape(num_rows, num_heads, head_dim).to(q.dtype)


paged_attention_dense.accepts_kv_written = True  # see AttentionBackend
