"""Turns a SchedulerOutput into the flat tensors of one forward.

Everything is laid out on the host (Python lists -> CPU tensors) and reaches the device in one
asynchronous copy per dtype (runner.staging), so building a batch never synchronises the GPU.
A batch may be padded to a CUDA-graph bucket: padding requests have seq_len 0, an empty query
range and an all-zero block table row; padding rows have token 0, position 0, slot PADDING_SLOT
and row_req -1 (AttentionMetadata's padding contract), so they write nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from blockdraft.attention.metadata import PADDING_SLOT, AttentionMetadata
from blockdraft.engine.outputs import SchedulerOutput
from blockdraft.host_tensor import host_tensor
from blockdraft.runner.staging import stage_to_device
from blockdraft.sample.bitmask import bitmask_words
from blockdraft.sample.penalties import PENALTY_FIELDS, PenaltyEntries, penalty_entries
from blockdraft.sample.sampler import SamplingTensors
from blockdraft.structured.grammar import fill_bitmasks
from blockdraft.sampling_params import SamplingParams

# SamplingTensors' per-row tensors, staged with the batch (in the float32 / int64 copies)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds")


@dataclass(frozen=True)
class BatchPadding:
    """Static shape of a padded batch: `num_reqs` requests, `num_rows` rows, block tables
    `block_table_width` pages wide (the columns the step writes into the graphs' static table:
    StaticInputs.table_width). Each must be >= what the scheduled step needs."""

    num_reqs: int
    num_rows: int
    block_table_width: int


@dataclass
class InputBatch:
    """Flat rows of one step (request i owns rows query_start_loc[i]:query_start_loc[i+1]).

    input_ids/positions/slot_mapping: [T] (T includes padding rows when padded). meta: attention
    metadata for the target forward. logits_indices: [L] rows whose logits are needed (the last
    1 + k rows of sampling requests). sample_req: [S] batch index of each sampling request (host
    list) and sample_req_index the same on the device; sample_num_drafts: [S] its k; kmax: max k
    (rows of sampling request s are padded to kmax + 1 in `logits_rows` [S, kmax+1], -1 =
    padding). sampling: per logits row parameters (SamplingTensors, [L] rows). num_reqs /
    num_rows: the real (unpadded) request and row counts. grammar_masks: the constrained rows'
    masks, written into sampling.token_bitmask by `GrammarMasks.fill` once the target forward
    is enqueued (None: no constrained request).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    logits_rows: torch.Tensor
    sample_req: list[int]
    sample_req_index: torch.Tensor
    sample_num_drafts: torch.Tensor
    kmax: int
    sampling: SamplingTensors
    num_reqs: int
    num_rows: int
    grammar_masks: GrammarMasks | None = None


class GrammarMasks:
    """A step's structured-output masks, computed while the GPU runs the target forward.

    Only the sampler reads the masks, so the runner fills them after enqueueing the target
    forward (`fill`, called by its sampling step): on CUDA the host's grammar work (0.1-0.8 ms
    per DFlash step at K = 15 on the H200's host, docs/benchmarks/gpu.md session 41) then
    overlaps the forward instead of preceding it, as vLLM overlaps its grammar bitmask with the
    model's forward.

    Args:
        items: (grammar, first row, drafts) per constrained request (structured.grammar.fill_bitmasks).
        host: [C, ceil(V / 32)] int32 on the CPU, every bit set (pinned on CUDA).
        device: where the sampler reads the masks. On CUDA `tensor` is a device buffer that the
            filled host masks reach by one asynchronous copy (stream-ordered before the sampler);
            elsewhere it is `host` itself.
    """

    def __init__(self, items: list, host: torch.Tensor, device: torch.device) -> None:
        self.items = items
        self.host = host
        self.tensor = host if device.type != "cuda" else torch.empty(host.shape, dtype=host.dtype, device=device)
        self.filled = False

    def fill(self) -> None:
        """Compute the masks (once) and start their copy to the device; no host synchronisation."""
        if self.filled:
            return
        fill_bitmasks(self.items, self.host)
        if self.tensor is not self.host:
            self.tensor.copy_(self.host, non_blocking=True)  # pinned source: the caching host allocator keeps it alive
        self.filled = True


def build_input_batch(
    so: SchedulerOutput,
    kv_block_size: int,
    device: torch.device | str,
    host_metadata: bool = True,
    padding: BatchPadding | None = None,
) -> InputBatch:
    """Lay out the scheduled tokens as rows and compute slots, block tables and logits rows.

    Args:
        so: the scheduler's step (requests in batch order; their token ids, start positions, pages).
        kv_block_size: tokens per KV page (slot = page * kv_block_size + position % kv_block_size).
        device: where the batch's tensors go (one staged host-to-device copy).
        host_metadata: also keep query_start_loc / seq_lens as host lists in the metadata (the
            torch reference backend needs them; the GPU backends do not).
        padding: pad to this static shape (CUDA-graph buckets); None = exact shapes.
    Raises:
        ValueError: the step does not fit `padding`.
    """
    device = torch.device(device)
    ids, pos, qsl, seq_lens, sample_req, num_drafts = [], [], [0], [], [], []
    params: list[SamplingParams] = []  # one per sampling request (its 1 + k logits rows share it)
    histories = []  # per sampling request: its logits_context (penalties, logit bias, min_tokens) or None
    end = 0
    for i, sr in enumerate(so.requests):
        n, start = len(sr.token_ids), sr.start_position
        ids += sr.token_ids
        pos += range(start, start + n)
        end += n
        qsl.append(end)
        seq_lens.append(start + n)
        if sr.sample:
            sample_req.append(i)
            num_drafts.append(sr.num_spec_tokens)
            params.append(sr.sampling_params)
            histories.append(sr.logits_context)
    num_reqs, num_rows = len(so.requests), end
    width = max((len(sr.block_ids) for sr in so.requests), default=1)
    if padding is not None:
        _check_fits(padding, num_reqs, num_rows, width)
        ids += [0] * (padding.num_rows - num_rows)
        pos += [0] * (padding.num_rows - num_rows)
        qsl += [num_rows] * (padding.num_reqs - num_reqs)
        seq_lens += [0] * (padding.num_reqs - num_reqs)
        width = padding.block_table_width
    ids_pos = host_tensor(ids + pos, torch.long).view(2, -1)  # one conversion, two rows
    block_table = _block_table(so, max(width, 1), len(seq_lens))
    layout = _layout(tuple(qsl), len(pos), tuple(sample_req), tuple(num_drafts))
    slot_mapping = _slot_mapping(block_table, layout.row_req, ids_pos[1], kv_block_size)
    kmax = max(num_drafts, default=0)
    sampling = SamplingTensors.from_params(params, "cpu", repeats=[k + 1 for k in num_drafts])
    penalties = _penalties(so, sample_req, histories, params)
    grammar_masks, bitmask_rows = _grammar_masks(so, sample_req, device)
    mask, mask_rows = _sampling_mask(so, sample_req)
    host = {
        "input_ids": ids_pos[0],
        "positions": ids_pos[1],
        "slot_mapping": slot_mapping,
        "query_start_loc": layout.query_start_loc,
        "seq_lens": host_tensor(seq_lens, torch.int32),
        "block_table": block_table,
        "row_req": layout.row_req,
        "logits_indices": layout.logits_indices,
        "logits_rows": layout.logits_rows,
        "sample_req_index": layout.sample_req_index,
        "sample_num_drafts": layout.sample_num_drafts,
        **{f"sampling.{f}": getattr(sampling, f) for f in SAMPLING_FIELDS},
        **({f"penalties.{f}": getattr(penalties, f) for f in PENALTY_FIELDS} if penalties is not None else {}),
        **({"token_bitmask_rows": bitmask_rows} if grammar_masks is not None else {}),
        **({"sampling_mask": mask, "sampling_mask_rows": mask_rows} if mask is not None else {}),
    }
    dev = stage_to_device(host, device)
    meta = AttentionMetadata(
        query_start_loc=dev["query_start_loc"],
        seq_lens=dev["seq_lens"],
        block_table=dev["block_table"],
        slot_mapping=dev["slot_mapping"],
        kv_block_size=kv_block_size,
        query_start_loc_host=qsl if host_metadata else None,
        seq_lens_host=seq_lens if host_metadata else None,
        row_req=dev["row_req"],
    )
    return InputBatch(
        input_ids=dev["input_ids"],
        positions=dev["positions"],
        slot_mapping=meta.slot_mapping,
        meta=meta,
        logits_indices=dev["logits_indices"],
        logits_rows=dev["logits_rows"],
        sample_req=sample_req,
        sample_req_index=dev["sample_req_index"],
        sample_num_drafts=dev["sample_num_drafts"],
        kmax=kmax,
        sampling=dataclasses.replace(
            sampling, **{f: dev[f"sampling.{f}"] for f in SAMPLING_FIELDS},
            penalties=None if penalties is None else PenaltyEntries(**{f: dev[f"penalties.{f}"] for f in PENALTY_FIELDS}),
            token_bitmask=None if grammar_masks is None else grammar_masks.tensor,  # GrammarMasks.fill writes it
            token_bitmask_rows=dev.get("token_bitmask_rows"),
            sampling_mask=dev.get("sampling_mask"), sampling_mask_rows=dev.get("sampling_mask_rows"),
        ),
        num_reqs=num_reqs,
        num_rows=num_rows,
        grammar_masks=grammar_masks,
    )


def _penalties(so: SchedulerOutput, sample_req: list[int], histories: list, params: list[SamplingParams]):
    """PenaltyEntries (host) of the step's sampling requests, or None when none has penalties.

    A request's drafts are the last num_spec_tokens of its token_ids (what its verify rows follow).
    """
    if all(h is None for h in histories):
        return None
    return penalty_entries(histories, [_drafts(so.requests[i]) for i in sample_req], params)


def _grammar_masks(so: SchedulerOutput, sample_req: list[int],
                   device: torch.device) -> tuple[GrammarMasks | None, torch.Tensor | None]:
    """The constrained requests' logits rows and their masks, still to compute
    (SamplingTensors.token_bitmask): (GrammarMasks over [C, ceil(V / 32)] int32, each such
    request's 1 + k rows from its grammar state and drafts once filled; [C] int64 their logits
    rows), or (None, None) when no request is constrained."""
    grammars = [so.requests[i].grammar for i in sample_req]
    if all(g is None for g in grammars):
        return None, None
    firsts, rows = _masked_rows(so, sample_req, grammars)
    host = torch.full((len(rows), bitmask_words(next(g for g in grammars if g is not None).vocab_size)), -1,
                      dtype=torch.int32, pin_memory=device.type == "cuda")
    items = [(g, first, _drafts(so.requests[i])) for i, g, first in zip(sample_req, grammars, firsts) if g is not None]
    return GrammarMasks(items, host, device), host_tensor(rows, torch.long)


def _sampling_mask(so: SchedulerOutput, sample_req: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The allowed_token_ids / bad_words masks of the step's logits rows (SamplingTensors.sampling_mask):
    ([C, ceil(V / 32)] int32, each such request's 1 + k rows from its output tokens and drafts,
    sample.token_mask.RequestTokenMask.fill; [C] int64 their logits rows), or (None, None) when
    no request has them."""
    masks = [so.requests[i].token_mask for i in sample_req]
    if all(m is None for m in masks):
        return None, None
    firsts, rows = _masked_rows(so, sample_req, masks)
    out = torch.empty((len(rows), bitmask_words(next(m for m in masks if m is not None).vocab_size)), dtype=torch.int32)
    for i, m, first in zip(sample_req, masks, firsts):
        if m is not None:
            sr = so.requests[i]
            m.fill(out[first:first + sr.num_spec_tokens + 1], sr.output_token_ids, _drafts(sr))
    return out, host_tensor(rows, torch.long)


def _masked_rows(so: SchedulerOutput, sample_req: list[int], masks: list) -> tuple[list[int | None], list[int]]:
    """For the sampling requests whose entry of `masks` is not None (the others get None): the
    first row of their block in a [C, W] mask tensor, and their logits rows ([C], in order)."""
    firsts: list[int | None] = []
    rows: list[int] = []
    row0 = 0  # a request's first logits row: its 1 + k rows follow the earlier requests'
    for i, m in zip(sample_req, masks):
        n = so.requests[i].num_spec_tokens + 1
        firsts.append(len(rows) if m is not None else None)
        if m is not None:
            rows += range(row0, row0 + n)
        row0 += n
    return firsts, rows


def _drafts(sr) -> list[int]:
    """The drafts a sampling request's step verifies: the last num_spec_tokens of its token_ids."""
    return sr.token_ids[len(sr.token_ids) - sr.num_spec_tokens:] if sr.num_spec_tokens else []


class _Layout(NamedTuple):
    """Host tensors fixed by the row layout of a step (see InputBatch for shapes)."""

    query_start_loc: torch.Tensor
    row_req: torch.Tensor
    logits_indices: torch.Tensor
    logits_rows: torch.Tensor
    sample_req_index: torch.Tensor
    sample_num_drafts: torch.Tensor


@functools.lru_cache(maxsize=256)
def _layout(qsl: tuple[int, ...], num_rows: int, sample_req: tuple[int, ...], num_drafts: tuple[int, ...]) -> _Layout:
    """The layout tensors of a step; cached because decode steps repeat a few layouts (one per
    batch size), and each costs a dozen small tensor ops. Shared: callers never write to them."""
    logits_idx: list[int] = []
    for i, k in zip(sample_req, num_drafts):
        logits_idx += range(qsl[i + 1] - 1 - k, qsl[i + 1])
    return _Layout(
        query_start_loc=host_tensor(qsl, torch.int32),
        row_req=_row_requests(list(qsl), num_rows),
        logits_indices=host_tensor(logits_idx, torch.long),
        logits_rows=_logits_rows(list(num_drafts), max(num_drafts, default=0)),
        sample_req_index=host_tensor(sample_req, torch.long),
        sample_num_drafts=host_tensor(num_drafts, torch.long),
    )


def stage_block_table(so: SchedulerOutput, padding: BatchPadding, device: torch.device | str) -> torch.Tensor:
    """[padding.num_reqs, padding.block_table_width] int32 page ids of `so` on `device` (async copy).

    Raises:
        ValueError: the step does not fit `padding`.
    """
    width = max((len(sr.block_ids) for sr in so.requests), default=1)
    _check_fits(padding, len(so.requests), so.total_num_tokens, width)
    host = _block_table(so, padding.block_table_width, padding.num_reqs)
    return stage_to_device({"block_table": host}, torch.device(device))["block_table"]


def _check_fits(padding: BatchPadding, num_reqs: int, num_rows: int, width: int) -> None:
    if num_reqs > padding.num_reqs or num_rows > padding.num_rows or width > padding.block_table_width:
        raise ValueError(
            f"step of {num_reqs} requests, {num_rows} rows and {width} pages per request does not fit "
            f"the padding {padding}"
        )


def _block_table(so: SchedulerOutput, width: int, num_reqs: int) -> torch.Tensor:
    """[num_reqs, width] int32 page ids; padding requests and unused entries are 0."""
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    lens = [len(sr.block_ids) for sr in so.requests]
    if not lens:
        return table
    pages = host_tensor(list(itertools.chain.from_iterable(sr.block_ids for sr in so.requests)), torch.int32)
    if len(lens) == 1:
        table[0, : lens[0]] = pages
        return table
    # one masked fill for all requests instead of one small tensor per request
    lens += [0] * (num_reqs - len(lens))
    table[torch.arange(width)[None, :] < host_tensor(lens, torch.long)[:, None]] = pages
    return table


def _row_requests(qsl: list[int], num_rows: int) -> torch.Tensor:
    """[num_rows] int32 request of each row; rows past qsl[-1] (padding) get -1."""
    counts = host_tensor([b - a for a, b in zip(qsl, qsl[1:])], torch.long)
    real = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)
    return torch.cat([real, torch.full((num_rows - real.shape[0],), -1, dtype=torch.int32)])


def _slot_mapping(
    block_table: torch.Tensor, row_req: torch.Tensor, positions: torch.Tensor, kv_block_size: int
) -> torch.Tensor:
    """[T] int64 cache slot of each row: page block_table[r, p // kv_block_size] of its request r,
    offset p % kv_block_size (p: the row's position). Rows of no request (row_req -1: padding) get
    PADDING_SLOT. One vectorised gather per step instead of a Python loop per request."""
    req = row_req.clamp(min=0).long()
    pages = block_table[req, torch.div(positions, kv_block_size, rounding_mode="floor")].long()
    return torch.where(row_req >= 0, pages * kv_block_size + positions % kv_block_size, PADDING_SLOT)


def _logits_rows(num_drafts: list[int], kmax: int) -> torch.Tensor:
    """[S, kmax + 1]: index into the logits tensor of each sampling request's rows, -1 = padding."""
    width = kmax + 1
    if all(k == kmax for k in num_drafts):  # uniform steps: every request has kmax + 1 rows
        return torch.arange(len(num_drafts) * width, dtype=torch.long).view(-1, width)
    counts = torch.tensor(num_drafts, dtype=torch.long) + 1
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(width, dtype=torch.long)[None, :]
    return torch.where(column < counts[:, None], starts[:, None] + column, -1)
