"""Prefill steps of up to PREFILL_MAX_REQUESTS requests as CUDA graphs: the time to first token
of requests that arrive alone or a few at a time (a server under load: requests finish and new
ones start at different steps).

Such a step (every request prefills its whole prompt or last chunk and samples its last row)
otherwise runs eagerly: on the H200 a 150-token Qwen2.5-0.5B prompt took 17.8 ms for ~1.1 ms of GPU
work (~360 kernel launches from Python), 35.7 ms with the DFlash drafter's context write and
first block (docs/benchmarks/gpu.md "Session 12"); with 32 requests in flight, the steps that
prefilled the few requests admitted together took 22 ms each, half of the run (gpu.md "Session
17"). The step is padded to a bucket of R_b = 1, 2, 4, 8 requests and T_b = 16, 32, ..., 1024 rows
(up to the step's token budget; 4 HumanEval prompts with the chat template, mean 168 tokens, fit
1,024 rows, 3 fitted 512). Padding requests have an empty query range and seq_len 0; padding rows
token 0, position 0, PADDING_SLOT, row_req -1, as runner.input_batch pads. Each bucket replays
two graphs:

  target: forward over the T_b rows + the LM head of each request's sampled row + greedy argmax;
  tail:   (DFlash) the drafter's context write of the prompt rows and each request's first block
          after its sampled token; the packed output (runner.step_output.pack_step, no drafts
          verified). Padding requests draft junk from MASK at position 0 (never read).

A step with sampled rows runs the sampler between the two (its tokens overwrite the greedy ones).
The attention kernels choose their launch configuration from shapes only, so one graph serves
every mix of prompt lengths and prefix-cache hits that pads to its bucket.
"""

from __future__ import annotations

import torch

from blockdraft.engine.outputs import SchedulerOutput
from blockdraft.runner.cuda_graphs import StaticInputs, capture_sizes
from blockdraft.runner.input_batch import BatchPadding, InputBatch
from blockdraft.runner.static_graph import StaticGraph
from blockdraft.runner.step_output import pack_step

PREFILL_CAPTURE_MAX = 1024  # rows of the largest bucket: 4 HumanEval prompts (mean 168 tokens) fit
PREFILL_MAX_REQUESTS = 8  # requests of the largest bucket; an eager prefill step costs 20-40 ms on the H200


def prefill_sizes(max_num_batched_tokens: int, largest: int = PREFILL_CAPTURE_MAX) -> list[int]:
    """Row buckets 16, 32, ... up to min(largest, max_num_batched_tokens) (ascending; empty below 16)."""
    cap = min(largest, max_num_batched_tokens)
    sizes, size = [], 16
    while size <= cap:
        sizes.append(size)
        size *= 2
    return sizes


def prefill_request_sizes(max_num_seqs: int, largest: int = PREFILL_MAX_REQUESTS) -> list[int]:
    """Request buckets: powers of two below min(largest, max_num_seqs), then that cap (ascending)."""
    return capture_sizes(min(largest, max_num_seqs), min(largest, max_num_seqs), 1)


class PrefillGraphs:
    """Target + tail graphs of prefill steps, one pair per (request bucket, row bucket).

    Args:
        model: CausalLM (its attention backend must read device metadata only).
        kv_caches: the target's paged caches.
        aux_layer_ids: layers whose outputs the drafter needs (empty for plain decoding).
        draft: None (plain decoding) or a function (features [T_b, n*H], positions [T_b],
            slot_mapping [T_b], block_table [R_b, M], query_start_loc [R_b + 1], logits_index
            [R_b], target [R_b, 1], num_accepted [R_b] zeros) -> [R_b, K] drafts
            (spec.dflash.cuda_graph.draft_after_prefill with its speculator bound).
        buckets: ascending row counts (prefill_sizes).
        block_table_width: M pages per request. kv_block_size: tokens per page.
        capture / pool: capture CUDA graphs now (else run the same code eagerly) / the shared pool.
        request_buckets: ascending request counts (prefill_request_sizes); (1,) = single requests.
        fp32_head: float32 logits from the LM head (as TargetGraphs).
    """

    def __init__(self, model, kv_caches, aux_layer_ids, draft, buckets, block_table_width, kv_block_size,
                 capture: bool, pool=None, request_buckets=(1,), fp32_head: bool = False) -> None:
        self.model, self.kv_caches, self.aux_layer_ids = model, kv_caches, tuple(aux_layer_ids)
        self.draft, self.buckets, self.request_buckets = draft, list(buckets), list(request_buckets)
        self.block_table_width, self.kv_block_size = block_table_width, kv_block_size
        self.capture, self.pool = capture, pool
        device = kv_caches[0][0].device
        max_reqs = self.request_buckets[-1]
        self.inputs = StaticInputs.allocate(max_reqs, 1, block_table_width, device, num_rows=self.buckets[-1])
        self.logits_index = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.fp32_head = fp32_head
        dtype = torch.float32 if fp32_head else next(model.parameters()).dtype
        self.logits = torch.zeros(max_reqs, model.config.vocab_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.targets: dict[tuple[int, int], StaticGraph] = {}
        self.tails: dict[tuple[int, int], StaticGraph] = {}

    def capture_bucket(self, num_reqs: int, num_rows: int) -> None:
        """Build (capture, or prepare eagerly) the target and tail graphs of one bucket."""
        key = (num_reqs, num_rows)
        self.targets[key] = StaticGraph(lambda: self._forward(*key), capture=self.capture, pool=self.pool)
        aux = self.targets[key].outputs[1] if self.capture else None
        inputs = (aux,) if aux is not None else ()
        self.tails[key] = StaticGraph(
            lambda *f: self._tail(*key, f[0] if f else None), inputs=inputs, capture=self.capture, pool=self.pool
        )

    def padding_for(self, so: SchedulerOutput) -> BatchPadding | None:
        """The bucket padding for a step whose requests (at most the largest request bucket) each
        prefill and sample their last row (no drafts), or None (the step runs otherwise)."""
        reqs = so.requests
        if not reqs or len(reqs) > self.request_buckets[-1]:
            return None
        if not all(sr.sample and not sr.num_spec_tokens and len(sr.block_ids) <= self.block_table_width for sr in reqs):
            return None
        rows = so.total_num_tokens
        if rows > self.buckets[-1]:
            return None
        num_reqs = next(b for b in self.request_buckets if b >= len(reqs))
        return BatchPadding(num_reqs, next(b for b in self.buckets if b >= rows), self.inputs.table_width(reqs))

    def run(self, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Load a padded batch and replay the target graph of its bucket -> (logits [R_b, V] of the
        sampled rows, real requests first; aux [T_b, n*H] | None); the greedy tokens are in
        `self.tokens`. Static outputs: read them before the next replay."""
        self.inputs.load(batch)
        num_sampled = batch.logits_indices.shape[0]
        self.logits_index[num_sampled:].zero_()  # padding requests read row 0 (a stale index may be past T_b)
        self.logits_index[:num_sampled].copy_(batch.logits_indices)
        return self.targets[(batch.meta.num_reqs, batch.input_ids.shape[0])]()

    def run_tail(self, num_reqs: int, num_rows: int, features: torch.Tensor | None,
                 sampled: torch.Tensor | None = None) -> torch.Tensor:
        """The packed output [R_b, 2 + K] of the bucket whose target graph just ran (rows past the
        real requests are junk).

        sampled: [S] int64 the sampler's tokens of the real requests when they sample, else None (greedy).
        """
        if sampled is not None:
            self.tokens[: sampled.shape[0]].copy_(sampled)
        return self.tails[(num_reqs, num_rows)](*(() if features is None else (features,)))

    def _forward(self, num_reqs: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        meta = self.inputs.metadata(num_reqs, 1, self.kv_block_size, num_rows=num_rows)
        ids, positions = self.inputs.input_ids[:num_rows], self.inputs.positions[:num_rows]
        hidden, aux = self.model(ids, positions, self.kv_caches, meta, self.aux_layer_ids)
        index = self.logits_index[:num_reqs]
        logits = self.model.compute_logits(hidden.index_select(0, index), out=self.logits[:num_reqs],
                                            fp32_head=self.fp32_head)
        self.model.greedy_tokens(logits, out=self.tokens[:num_reqs])
        return logits, aux

    def _tail(self, num_reqs: int, num_rows: int, features: torch.Tensor | None) -> torch.Tensor:
        target = self.tokens[:num_reqs].view(num_reqs, 1)
        accepted = torch.zeros(num_reqs, dtype=torch.long, device=target.device)
        drafts = None
        if self.draft is not None:
            drafts = self.draft(
                features, self.inputs.positions[:num_rows], self.inputs.slot_mapping[:num_rows],
                self.inputs.block_table[:num_reqs], self.inputs.query_start_loc[: num_reqs + 1],
                self.logits_index[:num_reqs], target, accepted,
            )  # fmt: skip
        return pack_step(target, accepted, drafts)
