"""Lossless verification of draft tokens against the target's own samples.

The target's token at every verified position is sampled first (argmax for greedy rows, keyed
Gumbel-max for T > 0; see blockdraft.sample). A draft is accepted iff it equals the target's token
at its position and every earlier draft was accepted; the first mismatch emits the target's token
(the bonus). Because the target's token at a position depends only on (seed, position, logits),
the emitted sequence equals plain decoding token for token (DFLASH.md, "One decode step", step 2;
for one-hot draft proposals this coincides with the rejection sampling of Leviathan et al. 2023).
"""

from __future__ import annotations

import torch


def verify_drafts(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Count accepted drafts per request, on-device and without host sync.

    Args:
        target_tokens: [R, K + 1] int64, the target's token at each draft position and one past it.
        draft_tokens: [R, K] int64 (entries past num_drafts[r] are ignored).
        num_drafts: [R] int64, drafts actually proposed per request (0..K).
    Returns:
        [R] int64 number of accepted drafts; emitted tokens are target_tokens[r, : accepted + 1].
    """
    k = draft_tokens.shape[1]
    valid = torch.arange(k, device=draft_tokens.device)[None, :] < num_drafts[:, None]
    match = (draft_tokens == target_tokens[:, :k]) & valid
    return match.long().cumprod(dim=1).sum(dim=1)
