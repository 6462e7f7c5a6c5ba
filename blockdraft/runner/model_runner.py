"""Owns the tensors: KV caches, the target model, the speculator. One step = prepare -> target
forward -> sample + verify -> propose -> one read-back (DFLASH.md, "One decode step").

GPU path (a backend without host metadata): nothing in a step reads device values back to the
host except the final `fetch_step_output` (and log-probabilities, when asked for). Uniform decode /
verify steps replay CUDA graphs (runner.step_graphs); everything else runs eagerly.
"""

from __future__ import annotations

import torch

from blockdraft.attention.backends import AttentionBackendSpec, select_attention_backend
from blockdraft.engine.outputs import ModelRunnerOutput, SchedulerOutput
from blockdraft.runner.input_batch import InputBatch, build_input_batch
from blockdraft.runner.step_graphs import StepGraphs
from blockdraft.runner.step_output import add_logprobs, fetch_step_output, pack_step
from blockdraft.runner.step_timer import StepTimer
from blockdraft.spec.verify import verify_drafts


class ModelRunner:
    """Runs one engine step on `device`.

    Args:
        model: a blockdraft CausalLM (forward / compute_logits / embed).
        kv_caches: per target layer (k_cache, v_cache), [num_kv_blocks, kv_block_size, kv_heads, head_dim].
        kv_block_size: tokens per KV page.
        speculator: None for plain decoding, else a Speculator (blockdraft.spec.base):
            `num_speculative_tokens`, `aux_layer_ids` and `propose(features, positions,
            slot_mapping, bonus_tokens, bonus_positions, block_table)`; `mask_token_id` if it has one.
        attention_backend: the backend the models run with (decides whether the metadata carries
            host lists); default: the device's (blockdraft.attention.backends).
        graphs: uniform-step graphs (runner.step_graphs.build_step_graphs), or None (all eager).
    """

    def __init__(
        self,
        model,
        kv_caches,
        kv_block_size: int,
        device="cpu",
        speculator=None,
        attention_backend: AttentionBackendSpec | None = None,
        graphs: StepGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv_block_size = kv_block_size
        self.device = torch.device(device)
        self.speculator = speculator
        self.aux_layer_ids = tuple(speculator.aux_layer_ids) if speculator is not None else ()
        self.attention_backend = attention_backend or select_attention_backend(self.device)
        self.graphs = graphs
        self._prepare_draft_inputs = _draft_input_preparer(self.attention_backend)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled rows, sample, verify drafts and propose the next drafts."""
        timer = StepTimer(self.device)
        padding = self.graphs.target.padding_for(so) if self.graphs is not None else None
        host_metadata = self.attention_backend.host_metadata
        batch = build_input_batch(so, self.kv_block_size, self.device, host_metadata, padding)
        logits, aux = self._forward(batch, graphed=padding is not None)
        tokens = _sample(batch, logits)
        target, drafts = _per_request(batch, tokens, uniform=padding is not None)
        num_accepted = verify_drafts(target, drafts, batch.sample_num_drafts)
        timer.mark()
        next_drafts = None
        if self.speculator is not None:
            next_drafts = self._propose(batch, aux, target, num_accepted, graphed=padding is not None)
        timer.mark()
        out = fetch_step_output(so, batch, pack_step(target, num_accepted, next_drafts))
        add_logprobs(so, batch, logits, out)
        out.forward_time_s, out.draft_time_s = timer.seconds()
        return out

    def _forward(self, batch: InputBatch, graphed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward + LM head -> (logits [L, V] in logits_indices order, aux features).

        Graphed steps return the padded aux [R_b*Q, n*H] (the drafter graph reads it whole).
        """
        if graphed:
            logits, aux = self.graphs.target.run(batch)
            return logits[: batch.num_rows], aux  # uniform: logits_indices = every real row, in order
        hidden, aux = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.aux_layer_ids)
        return self.model.compute_logits(hidden[batch.logits_indices]), aux

    def _propose(self, batch: InputBatch, aux, target, num_accepted, graphed: bool) -> torch.Tensor:
        """Write the drafter's context for committed rows, then draft for every sampling request -> [S, K]."""
        spec = self.speculator
        prepared = self._prepare_draft_inputs(
            batch.logits_rows, batch.logits_indices, num_accepted, target, batch.positions, batch.slot_mapping,
            getattr(spec, "mask_token_id", 0), spec.num_speculative_tokens + 1,
        )  # fmt: skip
        slots, bonus, bonus_positions = prepared.context_slot_mapping, prepared.bonus_tokens, prepared.bonus_positions
        if graphed and self.graphs.draft is not None:
            return self.graphs.draft.run(aux, slots, bonus, bonus_positions)[: len(batch.sample_req)]
        block_table = batch.meta.block_table.index_select(0, batch.sample_req_index)
        return spec.propose(aux, batch.positions, slots, bonus, bonus_positions, block_table)


def _sample(batch: InputBatch, logits: torch.Tensor) -> torch.Tensor:
    """[L] int64 token per logits row."""
    if batch.sampling.all_greedy:  # what sample() returns for all-greedy rows, without the key positions
        return logits.argmax(dim=-1)
    # the token sampled from row r sits at position r + 1: that position keys its noise
    return batch.sampling.sample(logits, batch.positions[batch.logits_indices] + 1)


def _per_request(batch: InputBatch, tokens: torch.Tensor, uniform: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Target tokens [S, kmax+1] and drafts [S, kmax] (the input tokens of draft rows).

    uniform: every request has kmax + 1 logits rows, the step's rows in order (padded graph
    steps), so both are plain views instead of gathers.
    """
    if uniform:
        num_sample, q = len(batch.sample_req), batch.kmax + 1
        return tokens.view(num_sample, q), batch.input_ids[: num_sample * q].view(num_sample, q)[:, 1:]
    rows = batch.logits_rows
    target = torch.where(rows >= 0, tokens[rows.clamp(min=0)], -1)
    row_ids = batch.logits_indices[rows.clamp(min=0)]
    drafts = torch.where(rows >= 0, batch.input_ids[row_ids], -2)[:, 1:]
    return target, drafts


def _draft_input_preparer(backend: AttentionBackendSpec):
    """The one-launch Triton kernel next to the Triton attention backend, else its torch twin."""
    if backend.name == "triton":
        from blockdraft.spec.dflash.prepare_inputs_triton import prepare_draft_inputs_triton

        return prepare_draft_inputs_triton
    from blockdraft.spec.dflash.prepare_inputs import prepare_draft_inputs

    return prepare_draft_inputs
