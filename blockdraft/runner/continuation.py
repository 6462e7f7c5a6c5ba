"""The input batch of the next uniform step, built on the device from this step's output.

Async scheduling (vLLM's `--async-scheduling`) launches step N+1 before step N's tokens reach the
host. For a uniform decode / verify step (every request verifies Q = K + 1 rows; runner.cuda_graphs)
whose requests all continue, everything step N+1 needs is on the device already:

  bonus[s]   = target[s, accepted[s]]            (the token the target emitted after the last accepted draft)
  start[s]   = positions[s*Q] + accepted[s] + 1  (the bonus token's position)
  input_ids  = [bonus[s], drafts[s, 0..K-1]]      at positions start[s] + 0..K
  slots      = block_table[s, p // page] * page + p % page
  seq_lens   = start[s] + Q

The host only supplies the block table (it allocated pages for the longest outcome). Padding rows
and requests keep the inert values of the padded batch (runner.input_batch).
"""

from __future__ import annotations

import dataclasses

import torch

from blockdraft.runner.input_batch import InputBatch


def advance_uniform_batch(
    batch: InputBatch, packed: torch.Tensor, block_table: torch.Tensor, kv_block_size: int
) -> InputBatch:
    """Step N+1's batch from step N's padded uniform batch and its packed output (no host sync).

    Args:
        batch: step N's batch: S sampling requests (all of them) with Q = batch.kmax + 1 rows each,
            padded to a graph bucket.
        packed: [S, Q + 1 + K] int64 (runner.step_output.pack_step): target tokens [S, Q], accepted
            counts [S], next drafts [S, K] with K = Q - 1 (K = 0 for plain decoding).
        block_table: [R_b, M] int32 page ids for step N+1 (pages for up to 2Q more tokens per request).
        kv_block_size: tokens per page.
    Returns:
        An InputBatch with new input_ids / positions / slot_mapping / seq_lens / block_table and
        everything else (layout, sampling parameters, logits rows) shared with `batch`.
    Raises:
        ValueError: `batch` is not uniform over all its requests or `packed` has another width.
    """
    num_sample, q = len(batch.sample_req), batch.kmax + 1
    if num_sample != batch.num_reqs or batch.num_rows != num_sample * q:
        raise ValueError(f"advance_uniform_batch needs a uniform batch ({batch.num_reqs} requests, "
                         f"{batch.num_rows} rows, {num_sample} sampling, Q = {q})")
    if packed.shape != (num_sample, 2 * q):
        raise ValueError(f"packed output has shape {tuple(packed.shape)}, expected {(num_sample, 2 * q)}")
    rows = num_sample * q
    accepted = packed[:, q : q + 1]
    ids = torch.cat([packed[:, :q].gather(1, accepted), packed[:, q + 1 :]], dim=1)
    start = batch.positions[:rows].view(num_sample, q)[:, :1] + accepted + 1
    pos = start + torch.arange(q, device=packed.device)
    pages = block_table[:num_sample].gather(1, torch.div(pos, kv_block_size, rounding_mode="floor"))
    slots = pages.to(torch.long) * kv_block_size + pos % kv_block_size

    # real rows / requests first, then the padded batch's inert tail (one copy each)
    input_ids = torch.cat([ids.view(-1), batch.input_ids[rows:]])
    positions = torch.cat([pos.view(-1), batch.positions[rows:]])
    slot_mapping = torch.cat([slots.view(-1), batch.slot_mapping[rows:]])
    seq_lens = batch.meta.seq_lens
    seq_lens = torch.cat([(start[:, 0] + q).to(seq_lens.dtype), seq_lens[num_sample:]])
    meta = dataclasses.replace(batch.meta, seq_lens=seq_lens, block_table=block_table, slot_mapping=slot_mapping)
    return dataclasses.replace(batch, input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, meta=meta)
