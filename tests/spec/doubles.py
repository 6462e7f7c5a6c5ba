"""Speculator test doubles that follow the Speculator protocol but draft from a known answer.

They find the request behind each row through its first KV page (unique among live requests).
"""

from __future__ import annotations

import torch


class KnownAnswerSpeculator:
    """Drafts the plain-decoding continuation (oracle), right with probability `p_right`.

    answers: maps a prompt (tuple of ids) to prompt + its plain output (what the target emits).
    p_right = 1: the oracle (acceptance length K + 1 except at the end); 0: random drafts.
    """

    aux_layer_ids = ()

    def __init__(self, num_speculative_tokens: int, answers: dict, vocab: int, p_right: float = 1.0, seed: int = 0):
        self.num_speculative_tokens = num_speculative_tokens
        self.answers = answers
        self.vocab = vocab
        self.p_right = p_right
        self.gen = torch.Generator().manual_seed(seed)
        self.engine = None  # set after the LLM is built

    def propose(self, features, positions, slot_mapping, bonus_tokens, bonus_positions, block_table):
        by_page = {r.block_ids[0]: r for r in self.engine.scheduler.running if r.block_ids}
        rows = []
        for r in range(len(bonus_tokens)):
            req = by_page[int(block_table[r, 0])]
            seq = self.answers.get(tuple(req.prompt_token_ids), [])
            rows.append(self._drafts(seq, int(bonus_positions[r])))
        return torch.tensor(rows, dtype=torch.long).reshape(len(bonus_tokens), self.num_speculative_tokens)

    def _drafts(self, seq: list[int], bonus_pos: int) -> list[int]:
        out = []
        for i in range(1, self.num_speculative_tokens + 1):
            right = bonus_pos + i < len(seq) and torch.rand((), generator=self.gen).item() < self.p_right
            out.append(seq[bonus_pos + i] if right else int(torch.randint(1, self.vocab, (), generator=self.gen)))
        return out
