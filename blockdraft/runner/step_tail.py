"""The tail of a uniform step as one CUDA graph per bucket: verify, draft, pack.

After the target graph of a bucket (runner.cuda_graphs) has written logits, greedy tokens and aux
features, the rest of a uniform step is: verification of the drafts against the target's tokens
(spec.verify), the drafter step (spec.dflash.cuda_graph.DraftStep; none for plain decoding) and
`pack_step`, the one tensor the host reads back. Run eagerly these are ~15 small launches between
the two graphs (~12 us each on the H200 host, ~1.1 us per kernel in a replay; the batch-1 DFlash
step took 1.73 ms of wall time for 1.38 ms of GPU work, gpu.md "Session 11"), so they are captured
with the drafter: a greedy step is two replays and a copy to the host.

The tail reads the target's tokens from the target graphs' `tokens` buffer: the greedy argmax the
target graph wrote, or, for a step with sampled rows, the sampler's tokens copied over it first.
"""

from __future__ import annotations

from typing import Callable

import torch

from blockdraft.runner.cuda_graphs import TargetGraphs
from blockdraft.runner.static_graph import StaticGraph
from blockdraft.runner.step_output import pack_step
from blockdraft.spec.verify import verify_drafts

# (num_reqs, features [R_b*Q, n*H], target [R_b, Q]) -> (num_accepted [R_b], next drafts [R_b, K])
DraftStepFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class StepTailGraphs:
    """Verify + draft + pack over the target graphs' static buffers, one StaticGraph per bucket.

    Args:
        target_graphs: the uniform-step target graphs (Q = rows_per_req rows per request; every
            request carries Q - 1 drafts).
        draft_step: the drafter step (DFlash: it verifies too), or None for plain decoding (Q = 1).
        capture / pool: as TargetGraphs (capture after the target graph of the same bucket).
    """

    def __init__(self, target_graphs: TargetGraphs, draft_step: DraftStepFn | None, capture: bool, pool=None) -> None:
        self.target_graphs, self.draft_step = target_graphs, draft_step
        self.capture, self.pool = capture, pool
        q, max_reqs = target_graphs.rows_per_req, target_graphs.buckets[-1]
        device = target_graphs.logits.device
        self.num_drafts = torch.full((max_reqs,), q - 1, dtype=torch.long, device=device)  # plain decoding
        self.graphs: dict[int, StaticGraph] = {}

    def capture_bucket(self, num_reqs: int) -> None:
        """Build (capture, or prepare eagerly) the tail of one bucket."""
        features = self.target_graphs.aux_output(num_reqs)
        inputs = (features,) if self.capture and features is not None else ()
        self.graphs[num_reqs] = StaticGraph(
            lambda *f: self._tail(num_reqs, f[0] if f else None), inputs=inputs, capture=self.capture, pool=self.pool
        )

    def run(self, num_reqs: int, features: torch.Tensor | None, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """The packed output of a padded uniform step -> [R_b, Q + 1 + K] int64 (runner.step_output.pack_step).

        Args:
            num_reqs: the bucket R_b the target graph just ran.
            features: that target graph's aux output (None for plain decoding).
            sampled: [N] int64 tokens of the first N rows when the step samples (N = its real
                rows), else None: the target graph's greedy tokens are the target's tokens.
        Rows past the real requests are junk. A captured tail returns its static output: read it
        (or start its copy to the host) before the next replay.
        """
        if sampled is not None:
            self.target_graphs.tokens[: sampled.shape[0]].copy_(sampled)
        inputs = () if features is None else (features,)
        return self.graphs[num_reqs](*inputs)

    def _tail(self, num_reqs: int, features: torch.Tensor | None) -> torch.Tensor:
        tg, q = self.target_graphs, self.target_graphs.rows_per_req
        rows = num_reqs * q
        target = tg.tokens[:rows].view(num_reqs, q)
        if self.draft_step is not None:  # verifies and drafts (one preparation launch on the GPU)
            num_accepted, next_drafts = self.draft_step(num_reqs, features, target)
            return pack_step(target, num_accepted, next_drafts)
        drafts = tg.inputs.input_ids[:rows].view(num_reqs, q)[:, 1:]
        return pack_step(target, verify_drafts(target, drafts, self.num_drafts[:num_reqs]), None)
