"""Single-request prefill steps as CUDA graphs: the time to first token of a request that arrives alone.

Such a step (one request, its whole prompt or last chunk, sampling its last row) otherwise runs
eagerly: on the H200 a 150-token Qwen2.5-0.5B prompt took 17.8 ms for ~1.1 ms of GPU work (~360
kernel launches from Python), 35.7 ms with the DFlash drafter's context write and first block
(docs/benchmarks/gpu.md "Session 12"). The step is padded to a bucket of T_b = 16, 32, ... rows
(padding rows: token 0, position 0, PADDING_SLOT, row_req -1, as runner.input_batch pads) and
replayed as two graphs per bucket:

  target: forward over the T_b rows + the LM head of the sampled row + its greedy argmax;
  tail:   (DFlash) the drafter's context write of the prompt rows and its first block after the
          sampled token; the packed output (runner.step_output.pack_step, no drafts verified).

A step with sampled rows runs the sampler between the two (its token overwrites the greedy one).
The attention kernels choose their launch configuration from shapes only, so one graph serves
every prompt length and prefix-cache hit that pads to its bucket.
"""

from __future__ import annotations

import torch

from blockdraft.engine.outputs import SchedulerOutput
from blockdraft.runner.cuda_graphs import StaticInputs
from blockdraft.runner.input_batch import BatchPadding, InputBatch
from blockdraft.runner.static_graph import StaticGraph
from blockdraft.runner.step_output import pack_step

PREFILL_CAPTURE_MAX = 512  # rows of the largest bucket (vLLM captures its graphs up to 512 tokens too)


def prefill_sizes(max_num_batched_tokens: int, largest: int = PREFILL_CAPTURE_MAX) -> list[int]:
    """Row buckets 16, 32, ... up to min(largest, max_num_batched_tokens) (ascending; empty below 16)."""
    cap = min(largest, max_num_batched_tokens)
    sizes, size = [], 16
    while size <= cap:
        sizes.append(size)
        size *= 2
    return sizes


class PrefillGraphs:
    """Target + tail graphs of single-request prefill steps, one pair per row bucket.

    Args:
        model: CausalLM (its attention backend must read device metadata only).
        kv_caches: the target's paged caches.
        aux_layer_ids: layers whose outputs the drafter needs (empty for plain decoding).
        draft: None (plain decoding) or a function (features [T_b, n*H], positions [T_b],
            slot_mapping [T_b], block_table [1, M], logits_index [1], target [1, 1], num_accepted
            [1] zeros) -> [1, K] drafts (spec.dflash.cuda_graph.draft_after_prefill with its speculator bound).
        buckets: ascending row counts (prefill_sizes).
        block_table_width: M pages per request. kv_block_size: tokens per page.
        capture / pool: capture CUDA graphs now (else run the same code eagerly) / the shared pool.
    """

    def __init__(self, model, kv_caches, aux_layer_ids, draft, buckets, block_table_width, kv_block_size,
                 capture: bool, pool=None) -> None:
        self.model, self.kv_caches, self.aux_layer_ids = model, kv_caches, tuple(aux_layer_ids)
        self.draft, self.buckets = draft, list(buckets)
        self.block_table_width, self.kv_block_size = block_table_width, kv_block_size
        self.capture, self.pool = capture, pool
        device = kv_caches[0][0].device
        self.inputs = StaticInputs.allocate(1, self.buckets[-1], block_table_width, device)
        self.logits_index = torch.zeros(1, dtype=torch.long, device=device)
        dtype = next(model.parameters()).dtype
        self.logits = torch.zeros(1, model.config.vocab_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.targets: dict[int, StaticGraph] = {}
        self.tails: dict[int, StaticGraph] = {}

    def capture_bucket(self, num_rows: int) -> None:
        """Build (capture, or prepare eagerly) the target and tail graphs of one bucket."""
        self.targets[num_rows] = StaticGraph(lambda: self._forward(num_rows), capture=self.capture, pool=self.pool)
        aux = self.targets[num_rows].outputs[1] if self.capture else None
        inputs = (aux,) if aux is not None else ()
        self.tails[num_rows] = StaticGraph(
            lambda *f: self._tail(num_rows, f[0] if f else None), inputs=inputs, capture=self.capture, pool=self.pool
        )

    def padding_for(self, so: SchedulerOutput) -> BatchPadding | None:
        """The bucket padding for a single-request step that prefills and samples its last row
        (no drafts), or None (the step runs otherwise)."""
        if len(so.requests) != 1:
            return None
        sr = so.requests[0]
        rows = len(sr.token_ids)
        if not sr.sample or sr.num_spec_tokens or rows > self.buckets[-1] or len(sr.block_ids) > self.block_table_width:
            return None
        return BatchPadding(1, next(b for b in self.buckets if b >= rows), self.block_table_width)

    def run(self, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Load a padded batch and replay the target graph of its bucket -> (logits [1, V] of the
        sampled row, aux [T_b, n*H] | None); the greedy token is in `self.tokens`. Static outputs:
        read them before the next replay."""
        self.inputs.load(batch)
        self.logits_index.copy_(batch.logits_indices)
        return self.targets[batch.input_ids.shape[0]]()

    def run_tail(self, num_rows: int, features: torch.Tensor | None, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """The packed output [1, 2 + K] of the bucket whose target graph just ran.

        sampled: [1] int64 the sampler's token when the row samples, else None (greedy).
        """
        if sampled is not None:
            self.tokens.copy_(sampled)
        return self.tails[num_rows](*(() if features is None else (features,)))

    def _forward(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        meta = self.inputs.metadata(1, num_rows, self.kv_block_size)
        ids, positions = self.inputs.input_ids[:num_rows], self.inputs.positions[:num_rows]
        hidden, aux = self.model(ids, positions, self.kv_caches, meta, self.aux_layer_ids)
        logits = self.model.compute_logits(hidden.index_select(0, self.logits_index), out=self.logits)
        torch.argmax(logits, dim=-1, out=self.tokens)
        return logits, aux

    def _tail(self, num_rows: int, features: torch.Tensor | None) -> torch.Tensor:
        target = self.tokens.view(1, 1)
        accepted = torch.zeros(1, dtype=torch.long, device=target.device)
        drafts = None
        if self.draft is not None:
            drafts = self.draft(
                features, self.inputs.positions[:num_rows], self.inputs.slot_mapping[:num_rows],
                self.inputs.block_table[:1], self.logits_index, target, accepted,
            )  # fmt: skip
        return pack_step(target, accepted, drafts)
