"""Owns the tensors: KV caches, the target model, the speculator. One step = prepare -> target
forward -> sample + verify -> propose (DFLASH.md, "One decode step")."""

from __future__ import annotations

import time

import torch

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.engine.outputs import ModelRunnerOutput, SchedulerOutput
from blockdraft.runner.input_batch import InputBatch, build_input_batch
from blockdraft.sample.sampler import compute_logprobs
from blockdraft.spec.verify import verify_drafts


class ModelRunner:
    """Runs one engine step on `device`.

    Args:
        model: a blockdraft CausalLM (forward / compute_logits / embed).
        kv_caches: per target layer (k_cache, v_cache), [num_kv_blocks, kv_block_size, kv_heads, head_dim].
        kv_block_size: tokens per KV page.
        speculator: None for plain decoding, else an object with `aux_layer_ids` and
            `propose(features, positions, slot_mapping, bonus_tokens, bonus_positions, block_table)`.
    """

    def __init__(self, model, kv_caches, kv_block_size: int, device="cpu", speculator=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv_block_size = kv_block_size
        self.device = torch.device(device)
        self.speculator = speculator
        self.aux_layer_ids = tuple(speculator.aux_layer_ids) if speculator is not None else ()

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled rows, sample, verify drafts and propose the next drafts."""
        t0 = time.perf_counter()
        batch = build_input_batch(so, self.kv_block_size, self.device)
        hidden, aux = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.aux_layer_ids)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        # the token sampled from row r sits at position r + 1: that position keys its noise
        tokens = batch.sampling.sample(logits, batch.positions[batch.logits_indices] + 1)
        target, drafts = self._per_request(batch, tokens)
        num_accepted = verify_drafts(target, drafts, batch.sample_num_drafts)
        t1 = time.perf_counter()
        out = self._output(so, batch, target, num_accepted, logits, tokens)
        if self.speculator is not None:
            self._propose(so, batch, aux, target, num_accepted, out)
        out.forward_time_s, out.draft_time_s = t1 - t0, time.perf_counter() - t1
        return out

    def _per_request(self, batch: InputBatch, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target tokens [S, kmax+1] and drafts [S, kmax] (the input tokens of draft rows)."""
        rows = batch.logits_rows
        target = torch.where(rows >= 0, tokens[rows.clamp(min=0)], -1)
        row_ids = batch.logits_indices[rows.clamp(min=0)]
        drafts = torch.where(rows >= 0, batch.input_ids[row_ids], -2)[:, 1:]
        return target, drafts

    def _output(self, so, batch, target, num_accepted, logits, tokens) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        acc = num_accepted.tolist()
        for s, i in enumerate(batch.sample_req):
            rid = so.requests[i].request_id
            emitted = target[s, : acc[s] + 1]
            out.sampled_token_ids[rid] = emitted.tolist()
            out.num_accepted[rid] = acc[s]
            num_top = so.requests[i].sampling_params.logprobs
            if num_top is not None:
                rows = batch.logits_rows[s, : acc[s] + 1]
                out.logprobs[rid] = _logprob_dicts(logits[rows], emitted, num_top)
        return out

    def _propose(self, so, batch: InputBatch, aux, target, num_accepted, out: ModelRunnerOutput) -> None:
        """Write the drafter's context for committed rows, then draft for every sampling request.

        Tensor ops only (no per-request loop): rejected draft rows get PADDING_SLOT so they write
        no draft KV; the bonus sits one past the anchor and the accepted drafts.
        """
        rows = batch.logits_rows  # [S, kmax + 1] logits index of anchor + draft rows, -1 = padding
        slot_in_block = torch.arange(rows.shape[1], device=self.device)
        rejected = (rows >= 0) & (slot_in_block[None, :] > num_accepted[:, None])
        slot_mapping = batch.slot_mapping.clone()
        slot_mapping[batch.logits_indices[rows[rejected]]] = PADDING_SLOT
        bonus = target.gather(1, num_accepted[:, None]).squeeze(1)  # [S]
        anchor_positions = batch.positions[batch.logits_indices[rows[:, 0]]]
        sample_req = torch.tensor(batch.sample_req, dtype=torch.long, device=self.device)
        drafts = self.speculator.propose(
            aux,
            batch.positions,
            slot_mapping,
            bonus,
            anchor_positions + 1 + num_accepted,
            batch.meta.block_table[sample_req],
        )
        for s, draft_row in enumerate(drafts.tolist()):
            out.draft_token_ids[so.requests[batch.sample_req[s]].request_id] = draft_row


def _logprob_dicts(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[dict]:
    """One {"token_id", "logprob", "top": [(id, logprob), ...]} per emitted token."""
    lp, top_ids, top_lp = compute_logprobs(logits, tokens, num_top)
    return [
        {"token_id": int(t), "logprob": float(l), "top": list(zip(ti.tolist(), tl.tolist()))}
        for t, l, ti, tl in zip(tokens, lp, top_ids, top_lp)
    ]
