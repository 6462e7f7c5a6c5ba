"""Random post-verification steps for the drafter's input preparation (shared by CPU, interpreter
and GPU tests), laid out as blockdraft.runner.input_batch builds them."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from blockdraft.attention.metadata import PADDING_SLOT


@dataclass
class StepCase:
    """One step: forward rows of several requests, some sampling with k_s drafts, verified."""

    logits_rows: torch.Tensor  # [S, kmax + 1]
    logits_indices: torch.Tensor  # [L]
    num_accepted: torch.Tensor  # [S]
    target_tokens: torch.Tensor  # [S, kmax + 1]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.logits_rows, self.logits_indices, self.num_accepted, self.target_tokens,
                self.positions, self.slot_mapping)  # fmt: skip

    def to(self, device: str | torch.device) -> "StepCase":
        return StepCase(*(x.to(device) for x in self.args()))


def random_step(seed: int, num_reqs: int = 5, max_drafts: int = 7, pad_rows: int = 2, pad_sample: int = 0) -> StepCase:
    """Requests are prefill chunks (no sampling), decode rows (k = 0) or verify rows (k drafts);
    `pad_rows` padding forward rows and `pad_sample` padding sampling requests go at the end."""
    rng = random.Random(seed)
    positions, slots, logits_idx, num_drafts = [], [], [], []
    for _ in range(num_reqs):
        kind = rng.choice(["prefill", "decode", "verify", "verify"])
        k = 0 if kind != "verify" else rng.randint(1, max_drafts)
        n = rng.randint(2, 9) if kind == "prefill" else 1 + k
        start = rng.randint(0, 50)
        first_row = len(positions)
        positions += range(start, start + n)
        slots += [rng.randrange(10_000) for _ in range(n)]
        if kind != "prefill" or rng.random() < 0.5:  # a last prefill chunk samples its final row
            logits_idx += range(first_row + n - 1 - k, first_row + n)
            num_drafts.append(k)
    positions += [0] * pad_rows
    slots += [PADDING_SLOT] * pad_rows
    kmax = max(num_drafts, default=0)
    num_sample = len(num_drafts) + pad_sample
    rows = torch.full((num_sample, kmax + 1), -1, dtype=torch.long)
    target = torch.full((num_sample, kmax + 1), -1, dtype=torch.long)
    accepted = torch.zeros(num_sample, dtype=torch.long)
    at = 0
    for s, k in enumerate(num_drafts):
        rows[s, : k + 1] = torch.arange(at, at + k + 1)
        target[s, : k + 1] = torch.tensor([rng.randrange(1000) for _ in range(k + 1)])
        accepted[s] = rng.randint(0, k)
        at += k + 1
    return StepCase(
        logits_rows=rows,
        logits_indices=torch.tensor(logits_idx, dtype=torch.long),
        num_accepted=accepted,
        target_tokens=target,
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
    )


def pad_step(case: StepCase, num_sample: int, width: int, num_logits: int, num_rows: int) -> StepCase:
    """`case` padded to fixed (CUDA-graph bucket) shapes: padding sampling requests and columns
    (logits_rows -1), padding logits rows (forward row 0) and padding forward rows (slot -1)."""
    s, w = case.logits_rows.shape
    if s > num_sample or w > width or case.logits_indices.shape[0] > num_logits or case.positions.shape[0] > num_rows:
        raise ValueError("step does not fit the bucket")
    rows = torch.full((num_sample, width), -1, dtype=torch.long)
    target = torch.full((num_sample, width), -1, dtype=torch.long)
    rows[:s, :w], target[:s, :w] = case.logits_rows, case.target_tokens
    accepted = torch.zeros(num_sample, dtype=torch.long)
    accepted[:s] = case.num_accepted

    def grow(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
        return torch.cat([x, torch.full((n - x.shape[0],), fill, dtype=x.dtype)])

    return StepCase(
        logits_rows=rows,
        logits_indices=grow(case.logits_indices, num_logits, 0),
        num_accepted=accepted,
        target_tokens=target,
        positions=grow(case.positions, num_rows, 0),
        slot_mapping=grow(case.slot_mapping, num_rows, PADDING_SLOT),
    )
