"""The DFlash drafter step of a graphed step, over the target graphs' static buffers.

`DraftStep` serves the uniform decode / verify steps; `draft_after_prefill` the prefill steps of
a few requests (runner.prefill_graphs).

It runs inside the step's tail graph (runner.step_tail): verify the drafts and prepare the
drafter's inputs from the verified tokens (context slots with rejected and padding rows set to
PADDING_SLOT, the [bonus, MASK x (B - 1)] block at the bonus positions; one launch on the Triton
backend, spec.dflash.draft_block), write the draft context K/V of the committed rows, then the
block forward + the LM head on the K draft rows + argmax (DFLASH.md "One decode step", steps
2-5). It reads the target graphs' static buffers (input_ids, positions, slots, row_req, block
table, and the query layout, which for a uniform step is Q rows per request with padding requests
empty, widened to B rows per request when K + 1 < B), the target's tokens and the aux features
the target graph of the same bucket wrote.
"""

from __future__ import annotations

import torch

from blockdraft.runner.cuda_graphs import TargetGraphs
from blockdraft.spec.dflash.draft_block import uniform_step_preparer
from blockdraft.spec.dflash.speculator import DFlashSpeculator


class DraftStep:
    """Verification and the drafter part of a padded uniform step (no graph of its own; the tail
    graph captures it).

    Args:
        speculator: the DFlash speculator (its backend must read device metadata only).
        target_graphs: the uniform-step target graphs whose buffers and aux outputs it reads;
            their rows_per_req must be the speculator's Q = K + 1.
    Raises:
        ValueError: rows_per_req != K + 1.
    """

    def __init__(self, speculator: DFlashSpeculator, target_graphs: TargetGraphs) -> None:
        if target_graphs.rows_per_req != speculator.num_query_tokens:
            raise ValueError(
                f"target graphs verify {target_graphs.rows_per_req} rows per request, the drafter needs "
                f"K + 1 = {speculator.num_query_tokens}"
            )
        self.speculator, self.target_graphs = speculator, target_graphs
        self.prepare = uniform_step_preparer(speculator.drafter.attention_backend.name)

    def __call__(self, num_reqs: int, features: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify this step's drafts and draft the next block of every request of bucket `num_reqs`.

        Args:
            num_reqs: the bucket R_b (padding requests included).
            features: [R_b*Q, n*H] the target graph's aux output for this bucket.
            target: [R_b, Q] int64 the target's tokens at each verified row.
        Returns:
            (num_accepted [R_b] int64, next drafts [R_b, K] int64). Padding requests (row_req ==
            -1) are inert: bonus MASK at position 0, no context written (their slots are
            PADDING_SLOT already), empty query range; their counts and drafts are junk.
        """
        tg, q, b = self.target_graphs.inputs, self.speculator.num_query_tokens, self.speculator.num_block_tokens
        rows = num_reqs * q
        num_accepted, context_slots, block = self.prepare(
            target, tg.input_ids[:rows], tg.row_req[:rows], tg.positions[:rows], tg.slot_mapping[:rows],
            tg.query_start_loc[: num_reqs + 1], b, self.speculator.mask_token_id,
        )  # fmt: skip
        drafts = self.speculator.propose_block(
            features, tg.positions[:rows], context_slots, block, tg.block_table[:num_reqs]
        )
        return num_accepted, drafts


def draft_after_prefill(
    speculator: DFlashSpeculator,
    prepare,
    features: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    logits_index: torch.Tensor,
    target: torch.Tensor,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    """The drafter part of a padded prefill step whose requests each sample their last row -> [R_b, K] int64.

    Writes the draft context of this step's rows (the prompts' uncached rows, or their last
    chunks; padding rows carry PADDING_SLOT), then drafts the block after each sampled token
    (nothing to verify: a prefill row carries no drafts). Padding requests (an empty query range)
    run a whole draft block from MASK at position 0 over no context (DraftStep gives them an
    empty block instead): nothing is written to any cache, their drafts are junk and not read.

    Args:
        prepare: `draft_input_preparer(...)` of the drafter's backend.
        features: [T_b, n*H] the target's aux features of the padded rows.
        positions / slot_mapping: [T_b] int64 of the padded rows.
        block_table: [R_b, M] int32.
        query_start_loc: [R_b + 1] int32 of the target forward (padding requests empty).
        logits_index: [R_b] int64, the row each request sampled (its prompt's last row; 0 for padding).
        target: [R_b, 1] int64, the token sampled there.
        num_accepted: [R_b] int64 zeros (a prefill row verifies no drafts).
    """
    num_reqs = target.shape[0]
    real = query_start_loc[1:] > query_start_loc[:-1]
    request = torch.arange(num_reqs, dtype=torch.long, device=target.device)
    logits_rows = torch.where(real, request, -1).view(num_reqs, 1)  # one logits row per request
    prepared = prepare(logits_rows, logits_index, num_accepted, target, positions, slot_mapping,
                       speculator.mask_token_id)
    return speculator.propose(features, positions, prepared.context_slot_mapping, prepared.bonus_tokens,
                              prepared.bonus_positions, block_table)
