"""Turns a SchedulerOutput into the flat tensors of one forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.attention.metadata import AttentionMetadata, row_requests
from blockdraft.engine.outputs import SchedulerOutput
from blockdraft.sample.sampler import SamplingTensors
from blockdraft.sampling_params import SamplingParams


@dataclass
class InputBatch:
    """Flat rows of one step (request i owns rows query_start_loc[i]:query_start_loc[i+1]).

    input_ids/positions/slot_mapping: [T]. meta: attention metadata for the target forward.
    logits_indices: [L] rows whose logits are needed (the last 1 + k rows of sampling requests).
    sample_req: [S] batch index of each sampling request; sample_num_drafts: [S] its k;
    kmax: max k (rows of sampling request s are padded to kmax + 1 in `logits_rows` [S, kmax+1],
    -1 = padding). sampling: per logits row parameters (SamplingTensors, [L] rows).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    logits_rows: torch.Tensor
    sample_req: list[int]
    sample_num_drafts: torch.Tensor
    kmax: int
    sampling: SamplingTensors


def build_input_batch(so: SchedulerOutput, kv_block_size: int, device: torch.device | str) -> InputBatch:
    """Lay out the scheduled tokens as rows and compute slots, block tables and logits rows."""
    ids, pos, qsl, seq_lens, logits_idx, sample_req, num_drafts = [], [], [0], [], [], [], []
    params: list[SamplingParams] = []
    for i, sr in enumerate(so.requests):
        n = len(sr.token_ids)
        ids += sr.token_ids
        pos += range(sr.start_position, sr.start_position + n)
        qsl.append(qsl[-1] + n)
        seq_lens.append(sr.start_position + n)
        if sr.sample:
            first = qsl[-1] - 1 - sr.num_spec_tokens
            logits_idx += range(first, qsl[-1])
            sample_req.append(i)
            num_drafts.append(sr.num_spec_tokens)
            params += [sr.sampling_params] * (1 + sr.num_spec_tokens)
    positions = torch.tensor(pos, dtype=torch.long)
    block_table = _block_table(so, device)
    row_req = row_requests(qsl)
    pages = block_table[row_req.long(), positions // kv_block_size]
    slot_mapping = pages.long() * kv_block_size + positions % kv_block_size
    kmax = max(num_drafts, default=0)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        slot_mapping=slot_mapping.to(device),
        kv_block_size=kv_block_size,
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
        row_req=row_req.to(device),
    )
    return InputBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=positions.to(device),
        slot_mapping=meta.slot_mapping,
        meta=meta,
        logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=device),
        logits_rows=_logits_rows(num_drafts, kmax, device),
        sample_req=sample_req,
        sample_num_drafts=torch.tensor(num_drafts, dtype=torch.long, device=device),
        kmax=kmax,
        sampling=SamplingTensors.from_params(params, device),
    )


def _block_table(so: SchedulerOutput, device) -> torch.Tensor:
    width = max((len(sr.block_ids) for sr in so.requests), default=1)
    table = torch.zeros(len(so.requests), max(width, 1), dtype=torch.int32)
    for i, sr in enumerate(so.requests):
        table[i, : len(sr.block_ids)] = torch.tensor(sr.block_ids, dtype=torch.int32)
    return table.to(device)


def _logits_rows(num_drafts: list[int], kmax: int, device) -> torch.Tensor:
    """[S, kmax + 1]: index into the logits tensor of each sampling request's rows, -1 = padding."""
    rows = torch.full((len(num_drafts), kmax + 1), -1, dtype=torch.long)
    start = 0
    for s, k in enumerate(num_drafts):
        rows[s, : k + 1] = torch.arange(start, start + k + 1)
        start += k + 1
    return rows.to(device)
