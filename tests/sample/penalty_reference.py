"""The logit adjustments written densely, one row over the whole vocabulary: the tests' reference
for blockdraft.sample.penalties (vLLM's logit-bias processor, then its apply_penalties)."""

import torch

from blockdraft.sampling_params import SamplingParams


def dense_adjusted(logits_row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """[V] float logits of the row after `output` (min_tokens not included) -> [V] adjusted."""
    v = logits_row.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=v).float()
    seen = (counts > 0) | (torch.bincount(torch.tensor(prompt, dtype=torch.long), minlength=v) > 0)
    r = torch.where(seen, torch.tensor(p.repetition_penalty), torch.tensor(1.0))
    x = logits_row.clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    x = torch.where(x > 0, x / r, x * r)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
