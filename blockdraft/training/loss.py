"""The DFlash training objective: decay-weighted cross-entropy over block slots 1..B-1.

Slot k of the block anchored at a predicts the token at a + k (k = 1..B-1; slot 0, the anchor,
predicts nothing). Weight w_k = exp(-(k - 1) / gamma): early slots matter most because a draft is
only useful up to its first rejection (DFLASH.md "Training"; paper arXiv 2602.06036 Sec. 4.2;
SpecForge `core/dflash.py` `loss_decay_gamma`). Only response tokens are labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# gamma per block size from the paper; other sizes use about 0.45 * B.
_PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Loss decay gamma for block size B: 7 (B=16), 5 (B=10), 4 (B=8), else max(1, 0.45 * B)."""
    return _PAPER_GAMMA.get(block_size, max(1.0, 0.45 * block_size))


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B-1] float32 weights w_k = exp(-(k-1)/gamma) for slots k = 1..B-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
    valid: torch.Tensor, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and label mask of every block slot 1..B-1.

    Args:
        input_ids, loss_mask: [b, T]; lengths: [b]; anchors, valid: [b, A] (masks.sample_anchors).
    Returns:
        labels [b, A, B-1] int64 (the token at anchor + k; 0 where masked) and keep [b, A, B-1]
        bool: valid block, anchor + k < length, and a response token there.
    """
    t = input_ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)  # [b, A, B-1]
    inside = pos < lengths.to(anchors.device)[:, None, None]
    safe = pos.clamp(max=t - 1)
    flat = safe.reshape(safe.shape[0], -1)
    labels = input_ids.gather(1, flat).view_as(pos)
    keep = inside & valid[:, :, None] & loss_mask.bool().gather(1, flat).view_as(pos)
    return torch.where(keep, labels, torch.zeros_like(labels)), keep


def weighted_block_loss(
    logits: torch.Tensor, labels: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    """Decay-weighted mean cross-entropy over the kept slot rows, plus per-slot top-1 accuracy.

    Args:
        logits: [N, V] (any float dtype; CE in float32). labels: [N] int64.
        slots: [N] int64 slot index k - 1 in [0, B-1) of each row. weights: [B-1] (slot_weights).
    Returns:
        loss: sum_i w_{slot_i} * CE_i / sum_i w_{slot_i} (0 with grad when N == 0), and stats:
        {"correct": [B-1] float, "count": [B-1] float} (detached) for per-slot accuracy.
    """
    n_slots = weights.shape[0]
    if logits.shape[0] == 0:
        zeros = torch.zeros(n_slots, device=logits.device)
        return logits.sum() * 0.0, {"correct": zeros, "count": zeros.clone()}
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    w = weights.to(logits.device)[slots]
    loss = (ce * w).sum() / w.sum()
    with torch.no_grad():
        hit = (logits.argmax(dim=-1) == labels).float()
        correct = torch.zeros(n_slots, device=logits.device).index_add_(0, slots, hit)
        count = torch.zeros(n_slots, device=logits.device).index_add_(0, slots, torch.ones_like(hit))
    return loss, {"correct": correct, "count": count}


def expected_acceptance(slot_accuracy: list[float | None]) -> float:
    """A rough acceptance length from per-slot accuracies: 1 + sum_k prod_{j<=k} acc_j (treats
    slots as independent; a progress signal, not a measurement). Stops at the first slot without
    labels (None, or NaN as older logs hold)."""
    total, run = 1.0, 1.0
    for acc in slot_accuracy:
        if acc is None or math.isnan(acc):
            break
        run *= acc
        total += run
    return total


@dataclass
class StepStats:
    """Running sums over logged steps (or validation batches): loss, and per-slot correct / counted
    top-1 predictions ([B-1] float32 on the CPU, summed from `weighted_block_loss`'s stats)."""

    loss_sum: float = 0.0
    steps: int = 0
    correct: torch.Tensor | None = None
    count: torch.Tensor | None = None

    def add(self, loss: float, stats: dict) -> None:
        """Add one step's loss and its `weighted_block_loss` stats ({"correct", "count"}: [B-1])."""
        self.loss_sum += loss
        self.steps += 1
        c, n = stats["correct"].float().cpu(), stats["count"].float().cpu()
        self.correct = c if self.correct is None else self.correct + c
        self.count = n if self.count is None else self.count + n

    def summary(self) -> dict:
        """{"loss", "acc": per-slot top-1 accuracy list (slot 1 first), "acc_mean", "tau_proxy"}; None
        for a slot no label reached (and for acc_mean without any), so the logs are strict JSON."""
        acc = (self.correct / self.count.clamp(min=1)).tolist() if self.count is not None else []
        acc = [a if n > 0 else None for a, n in zip(acc, self.count.tolist())] if acc else []
        total = float(self.count.sum()) if self.count is not None else 0.0
        mean = float(self.correct.sum()) / total if total else None
        return {"loss": self.loss_sum / max(1, self.steps), "acc": acc, "acc_mean": mean,
                "tau_proxy": expected_acceptance(acc)}
