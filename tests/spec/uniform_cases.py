"""Random padded uniform steps (runner.cuda_graphs' layout: Q rows per request, padding requests
at the end with row_req -1, slot PADDING_SLOT and empty query ranges), shared by the CPU,
interpreter and GPU tests of spec.dflash.draft_block."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from blockdraft.attention.metadata import PADDING_SLOT


@dataclass
class UniformCase:
    target: torch.Tensor  # [R, Q] int64
    input_ids: torch.Tensor  # [R*Q] int64
    row_req: torch.Tensor  # [R*Q] int32
    positions: torch.Tensor  # [R*Q] int64
    slot_mapping: torch.Tensor  # [R*Q] int64
    query_start_loc: torch.Tensor  # [R + 1] int32

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.target, self.input_ids, self.row_req, self.positions, self.slot_mapping, self.query_start_loc)

    def to(self, device: str | torch.device) -> "UniformCase":
        return UniformCase(*(x.to(device) for x in self.args()))


def random_uniform_step(seed: int, num_real: int, num_padding: int, q: int) -> UniformCase:
    """`num_real` requests whose K = q - 1 drafts match the target's tokens for a random prefix
    (sometimes all of them), then `num_padding` padding requests holding junk tokens."""
    rng = random.Random(seed)
    target, ids, row_req, positions, slots, qsl = [], [], [], [], [], [0]
    for r in range(num_real + num_padding):
        real = r < num_real
        tokens = [rng.randrange(1000) for _ in range(q)]
        agree = rng.randint(0, q - 1)
        drafts = [tokens[c] if c < agree else rng.randrange(1000) for c in range(q - 1)]
        target.append(tokens)
        ids += [rng.randrange(1000)] + drafts
        row_req += [r if real else -1] * q
        start = rng.randint(0, 300) if real else 0
        positions += range(start, start + q) if real else [0] * q
        slots += [rng.randrange(10_000) for _ in range(q)] if real else [PADDING_SLOT] * q
        qsl.append(qsl[-1] + (q if real else 0))
    return UniformCase(
        target=torch.tensor(target, dtype=torch.long).view(-1, q),
        input_ids=torch.tensor(ids, dtype=torch.long),
        row_req=torch.tensor(row_req, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
    )


def block_fields(block) -> dict[str, torch.Tensor]:
    """A DraftBlock's tensors by name, on the CPU."""
    return {name: value.cpu() for name, value in vars(block).items() if isinstance(value, torch.Tensor)}
