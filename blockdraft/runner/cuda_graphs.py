"""CUDA graphs for uniform decode / verify steps of the target: forward + LM head per R bucket.

A step is *uniform* when every scheduled request verifies exactly Q = 1 + K rows (K = the
speculator's num_speculative_tokens; Q = 1 for plain decoding) and samples. Such a step is padded
to the smallest bucket R_b >= R (buckets 1, 2, 4, ... up to the largest that max_num_seqs and
max_num_batched_tokens allow; ARCHITECTURE.md "cuda_graph") with inert padding (see
runner.input_batch) and replayed. Single-request prefill steps have their own graphs
(runner.prefill_graphs); other prefill, mixed and non-uniform steps, and R beyond the largest
bucket, run eagerly. Inputs live in persistent max-size buffers; each bucket's graph reads
leading slices of them, and every bucket writes its logits into one shared buffer in the model's
dtype, or float32 with fp32_head (the LM head writes there directly; see CausalLM.compute_logits), and its greedy tokens
(argmax per row) into one int64 buffer that the step's tail graph reads (runner.step_tail): the
argmax is captured here rather than in the tail so that one tail graph serves greedy and sampled
steps (a sampled step overwrites the buffer with the sampler's tokens; the wasted argmax reads the
logits once, a small cost next to the sampler's own passes over them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.attention.metadata import PADDING_SLOT, AttentionMetadata
from blockdraft.engine.outputs import SchedulerOutput
from blockdraft.runner.input_batch import BatchPadding, InputBatch
from blockdraft.runner.static_graph import StaticGraph


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, rows_per_req: int) -> list[int]:
    """Request-count buckets: powers of two below the cap, then the cap itself (ascending).

    cap = min(max_num_seqs, max_num_batched_tokens // rows_per_req): no uniform step can have
    more requests than that, so every uniform step finds a bucket. Empty when cap < 1.
    """
    cap = min(max_num_seqs, max_num_batched_tokens // rows_per_req)
    sizes = []
    size = 1
    while size < cap:
        sizes.append(size)
        size *= 2
    return sizes + [cap] if cap >= 1 else []


@dataclass
class StaticInputs:
    """Persistent device buffers for the largest bucket (R_max requests, R_max * Q rows).

    input_ids / positions / slot_mapping [R_max*Q] int64, row_req [R_max*Q] int32,
    query_start_loc [R_max + 1] int32, seq_lens [R_max] int32, block_table [R_max, M] int32.
    Initialised as all padding, so warm-up and capture write nothing to the KV cache.

    block_table_cols: the leading columns of block_table any step has written; the rest are still
    0. A step writes only max(its widest request, block_table_cols) columns (`table_width`), so the
    table reads as if written whole while the host builds and copies the few dozen columns in use,
    not M (2,048 at Qwen2.5's 32K context: building a [32, 2048] table took 0.46 ms per step under
    cProfile at 32 requests on the H200's host).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    row_req: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_table_cols: int = 0

    @classmethod
    def allocate(cls, max_reqs: int, rows_per_req: int, block_table_width: int, device,
                 num_rows: int | None = None) -> "StaticInputs":
        """Zeroed buffers for the largest bucket: max_reqs x rows_per_req rows (or `num_rows`, for
        ragged prefill buckets), block tables [max_reqs, block_table_width] int32 (smaller buckets
        use leading slices)."""
        rows = max_reqs * rows_per_req if num_rows is None else num_rows
        return cls(
            input_ids=torch.zeros(rows, dtype=torch.long, device=device),
            positions=torch.zeros(rows, dtype=torch.long, device=device),
            slot_mapping=torch.full((rows,), PADDING_SLOT, dtype=torch.long, device=device),
            row_req=torch.full((rows,), -1, dtype=torch.int32, device=device),
            query_start_loc=torch.zeros(max_reqs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_reqs, dtype=torch.int32, device=device),
            block_table=torch.zeros(max_reqs, block_table_width, dtype=torch.int32, device=device),
        )

    def load(self, batch: InputBatch) -> None:
        """Copy a batch padded to a bucket into the leading slices (device-to-device, async)."""
        rows, reqs = batch.input_ids.shape[0], batch.meta.num_reqs
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.slot_mapping[:rows].copy_(batch.slot_mapping)
        self.row_req[:rows].copy_(batch.meta.row_req)
        self.query_start_loc[: reqs + 1].copy_(batch.meta.query_start_loc)
        self.seq_lens[:reqs].copy_(batch.meta.seq_lens)
        self.write_block_table(batch.meta.block_table)

    def table_width(self, requests) -> int:
        """Columns of the block table a step of `requests` (ScheduledRequests) writes: its widest
        request's pages, and every column an earlier step may have written (class docstring)."""
        return max(self.block_table_cols, max((len(sr.block_ids) for sr in requests), default=1))

    def write_block_table(self, table: torch.Tensor) -> None:
        """Copy `table` ([r, w] int32 page ids, on the buffers' device; r <= R_max, w <= M) into the
        leading rows and columns (async, no host sync); columns w.. of those rows that an earlier
        step wrote are zeroed, so every row reads as `table` padded with 0."""
        reqs, width = table.shape
        self.block_table[:reqs, :width].copy_(table)
        if width < self.block_table_cols:  # not on the engine's path (table_width); kept exact anyway
            self.block_table[:reqs, width : self.block_table_cols].zero_()
        self.block_table_cols = max(self.block_table_cols, width)

    def metadata(self, num_reqs: int, rows_per_req: int, kv_block_size: int,
                 num_rows: int | None = None) -> AttentionMetadata:
        """Causal metadata over the first `num_reqs` requests' slices and num_reqs x rows_per_req
        rows (or the first `num_rows`; no host lists)."""
        rows = num_reqs * rows_per_req if num_rows is None else num_rows
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:rows],
            kv_block_size=kv_block_size,
            query_start_loc_host=None,
            seq_lens_host=None,
            row_req=self.row_req[:rows],
        )


class TargetGraphs:
    """Target forward + LM head over static buffers, one StaticGraph per request bucket.

    Args:
        model: CausalLM (its attention backend must read device metadata only).
        kv_caches: the target's paged caches.
        aux_layer_ids: layers whose outputs the drafter needs (may be empty).
        buckets: ascending request counts (capture_sizes).
        rows_per_req: Q.
        block_table_width: M pages per request (ceil(max_model_len / kv_block_size)).
        kv_block_size: tokens per page.
        capture: capture CUDA graphs (else run the same static-shape code eagerly).
        pool: shared graph memory pool (capture mode).
        fp32_head: logits buffer in float32, the LM head's float32 output (CausalLM.compute_logits
            fp32_head); else in the model dtype.
    """

    def __init__(self, model, kv_caches, aux_layer_ids, buckets, rows_per_req, block_table_width, kv_block_size,
                 capture: bool, pool=None, fp32_head: bool = False) -> None:
        self.model, self.kv_caches, self.aux_layer_ids = model, kv_caches, tuple(aux_layer_ids)
        self.buckets, self.rows_per_req = list(buckets), rows_per_req
        self.block_table_width, self.kv_block_size = block_table_width, kv_block_size
        device = kv_caches[0][0].device
        self.inputs = StaticInputs.allocate(self.buckets[-1], rows_per_req, block_table_width, device)
        vocab = model.config.vocab_size
        self.fp32_head = fp32_head
        dtype = torch.float32 if fp32_head else next(model.parameters()).dtype
        self.logits = torch.zeros(self.buckets[-1] * rows_per_req, vocab, dtype=dtype, device=device)
        self.tokens = torch.zeros(self.buckets[-1] * rows_per_req, dtype=torch.long, device=device)
        self.capture, self.pool = capture, pool
        self.graphs: dict[int, StaticGraph] = {}

    def capture_bucket(self, num_reqs: int) -> None:
        """Build (capture, or prepare eagerly) the graph of one bucket."""
        self.graphs[num_reqs] = StaticGraph(lambda: self._forward(num_reqs), capture=self.capture, pool=self.pool)

    def padding_for(self, so: SchedulerOutput) -> BatchPadding | None:
        """The bucket padding for a uniform step, or None (run eagerly)."""
        q = self.rows_per_req
        reqs = so.requests
        uniform = all(
            sr.sample and len(sr.token_ids) == q and sr.num_spec_tokens == q - 1
            and len(sr.block_ids) <= self.block_table_width
            for sr in reqs
        )
        if not reqs or not uniform or len(reqs) > self.buckets[-1]:
            return None
        bucket = next(b for b in self.buckets if b >= len(reqs))
        return BatchPadding(bucket, bucket * q, self.inputs.table_width(reqs))

    def run(self, batch: InputBatch, load: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Load a padded batch and replay its bucket -> (logits [R_b*Q, V] in the model dtype, float32 with
        fp32_head; aux [R_b*Q, n*H] | None).

        load=False: the static inputs already hold the batch (a continuation advanced them in place).

        Also writes the greedy token of every row into `self.tokens[:R_b*Q]` (int64). Rows past
        batch.num_rows are padding. The tensors are the graph's static outputs: read them before
        the next replay of any graph (all share one memory pool).
        """
        if load:
            self.inputs.load(batch)
        return self.graphs[batch.meta.num_reqs]()

    def aux_output(self, num_reqs: int) -> torch.Tensor | None:
        """The captured aux output of a bucket (the tail graph's input), None when eager."""
        outputs = self.graphs[num_reqs].outputs
        return None if outputs is None else outputs[1]

    def _forward(self, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = num_reqs * self.rows_per_req
        meta = self.inputs.metadata(num_reqs, self.rows_per_req, self.kv_block_size)
        ids, positions = self.inputs.input_ids[:rows], self.inputs.positions[:rows]
        hidden, aux = self.model(ids, positions, self.kv_caches, meta, self.aux_layer_ids)
        logits = self.model.compute_logits(hidden, out=self.logits[:rows], fp32_head=self.fp32_head)
        self.model.greedy_tokens(logits, out=self.tokens[:rows])  # = sample() for greedy rows (ties: lowest id)
        return logits, aux
