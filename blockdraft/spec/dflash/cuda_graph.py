"""The DFlash drafter step of a uniform decode step as one CUDA graph per request bucket.

One graph = write the draft context K/V of the step's committed rows (rejected and padding rows
carry PADDING_SLOT) + the fixed [bonus, MASK x K] block forward + the LM head on the K draft rows
+ argmax (DFLASH.md "One decode step", steps 4-5). It reads the target graphs' static buffers
(positions, block table, and the block layout, which for a uniform step is the target's: Q rows
per request, padding requests empty) and the aux features the target graph of the same bucket
wrote, plus three buffers of its own: context slots, bonus tokens and bonus positions.
"""

from __future__ import annotations

import torch

from blockdraft.attention.metadata import PADDING_SLOT
from blockdraft.runner.cuda_graphs import TargetGraphs
from blockdraft.runner.static_graph import StaticGraph
from blockdraft.spec.dflash.speculator import DFlashSpeculator


class DraftGraphs:
    """Drafter steps over static buffers, one StaticGraph per bucket of `target_graphs`.

    Args:
        speculator: the DFlash speculator (its backend must read device metadata only).
        target_graphs: the uniform-step target graphs whose buffers and aux outputs it reads;
            their rows_per_req must be the speculator's Q = K + 1.
        capture / pool: as TargetGraphs.
    Raises:
        ValueError: rows_per_req != K + 1.
    """

    def __init__(self, speculator: DFlashSpeculator, target_graphs: TargetGraphs, capture: bool, pool=None) -> None:
        if target_graphs.rows_per_req != speculator.num_query_tokens:
            raise ValueError(
                f"target graphs verify {target_graphs.rows_per_req} rows per request, the drafter needs "
                f"K + 1 = {speculator.num_query_tokens}"
            )
        self.speculator, self.target_graphs = speculator, target_graphs
        self.capture, self.pool = capture, pool
        max_reqs, device = target_graphs.buckets[-1], target_graphs.logits.device
        self.context_slots = torch.full(
            (max_reqs * speculator.num_query_tokens,), PADDING_SLOT, dtype=torch.long, device=device
        )
        self.bonus_tokens = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.bonus_positions = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.graphs: dict[int, StaticGraph] = {}

    def capture_bucket(self, num_reqs: int) -> None:
        """Build the graph of one bucket; capture after the target graph of the same bucket."""
        features = self.target_graphs.aux_output(num_reqs)
        inputs = (features,) if self.capture else ()
        self.graphs[num_reqs] = StaticGraph(
            lambda f: self._draft(num_reqs, f), inputs=inputs, capture=self.capture, pool=self.pool
        )

    def run(
        self,
        features: torch.Tensor,
        context_slots: torch.Tensor,
        bonus_tokens: torch.Tensor,
        bonus_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Draft for a padded uniform step -> [R_b, K] int64 (rows past the real requests are junk).

        Args:
            features: [R_b*Q, n*H] the target graph's aux output for this bucket.
            context_slots: [R_b*Q] int64 slots of the committed rows, PADDING_SLOT elsewhere.
            bonus_tokens / bonus_positions: [R] int64 for the R real requests (R <= R_b).
        """
        num_reqs = features.shape[0] // self.speculator.num_query_tokens
        real = bonus_tokens.shape[0]
        self.context_slots[: context_slots.shape[0]].copy_(context_slots)
        self.bonus_tokens[:real].copy_(bonus_tokens)
        self.bonus_positions[:real].copy_(bonus_positions)
        self.bonus_positions[real:num_reqs].zero_()  # padding requests: seq_len 0
        return self.graphs[num_reqs](features)

    def _draft(self, num_reqs: int, features: torch.Tensor) -> torch.Tensor:
        tg, q = self.target_graphs.inputs, self.speculator.num_query_tokens
        rows = num_reqs * q
        return self.speculator.propose(
            features,
            tg.positions[:rows],
            self.context_slots[:rows],
            self.bonus_tokens[:num_reqs],
            self.bonus_positions[:num_reqs],
            tg.block_table[:num_reqs],
            block_layout=(tg.query_start_loc[: num_reqs + 1], tg.row_req[:rows]),
        )
