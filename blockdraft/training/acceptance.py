"""Acceptance length of a drafter on target-generated sequences, without running the engine.

For one request the engine's committed tokens do not depend on the drafter (verification is
lossless; at T > 0 the target sample at each position is keyed by (seed, position)), so the
committed sequence is simply the target's own output. The drafts proposed at anchor P depend only
on the committed tokens <= P (features strictly before P, the anchor token itself). So: draft at
EVERY response position in one dense forward (training/dense.py), then replay the engine's walk:
from anchor P, accept the longest prefix of drafts equal to the sequence, commit it + the bonus,
continue at P + n + 1. This is the engine's acceptance up to floating-point differences (the
engine's eval-drafter path measures it directly: training/evaluate.py).
"""

from __future__ import annotations

import torch

from blockdraft.spec.dflash.draft_model import DFlashDraftModel
from blockdraft.training.dense import dense_block_forward


@torch.no_grad()
def draft_every_anchor(
    drafter: DFlashDraftModel, target, seqs: list[torch.Tensor], starts: list[int], chunk: int = 128,
    draft_vocab: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Greedy drafts at every anchor start_i..L_i-2 of each sequence.

    Args:
        seqs: token id tensors [L_i] (prompt + response); starts: first anchor (= prompt length).
        chunk: anchors per dense forward (bounds the mask / logits memory).
        draft_vocab: [N] int64 target ids the drafter may propose (the engine's DraftHead: argmax
            over those LM-head rows), or None for the full vocabulary.
    Returns:
        per sequence a [L_i, B-1] int64 tensor; row P holds the drafts for positions P+1..P+B-1
        (rows outside start..L-2 are -1).
    """
    dev, cfg = drafter.device, drafter.config
    bs = cfg.block_size
    b, t = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(b, t, dtype=torch.long, device=dev)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s.to(dev)
    lengths = torch.tensor([len(s) for s in seqs], device=dev)
    feats = target.features(ids, lengths, cfg.target_layer_ids)
    out = [torch.full((len(s), bs - 1), -1, dtype=torch.long) for s in seqs]
    span = max(len(s) - 1 - st for s, st in zip(seqs, starts))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    lm_head, ids_of = target.lm_head, None
    if draft_vocab is not None:
        ids_of = draft_vocab.to(dev).long()
        rows_w = target.lm_head_rows(ids_of).to(dev)
        lm_head = lambda h: torch.nn.functional.linear(h.to(rows_w.dtype), rows_w)  # noqa: E731
    for lo in range(0, max(span, 0), chunk):
        offs = torch.arange(lo, min(lo + chunk, span), device=dev)
        anchors = torch.stack([st + offs for st in starts]).clamp(max=t - 1)  # [b, A]
        valid = anchors < (lengths[:, None] - 1)
        anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
        a = anchors.shape[1]
        block = torch.full((b, a, bs), cfg.mask_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = ids.gather(1, anchors)
        embeds = target.embed(block.view(b, a * bs)) * cfg.input_embedding_scale
        with autocast:
            hidden = dense_block_forward(drafter, feats, embeds, anchors, valid)
            rows = hidden.view(b, a, bs, -1)[:, :, 1:][valid]
            best = drafter.compute_logits(rows, lm_head).argmax(dim=-1)
            drafts = (best if ids_of is None else ids_of[best]).view(-1, bs - 1).cpu()
        pos, which = anchors[valid].cpu(), valid.nonzero()[:, 0].cpu()
        for row in range(drafts.shape[0]):
            out[int(which[row])][int(pos[row])] = drafts[row]
    return out


def walk(
    seq: torch.Tensor, drafts: torch.Tensor, start: int, num_speculative_tokens: int, hit_max_tokens: bool,
) -> list[tuple[int, int]]:
    """Replay greedy-verification steps; returns (drafts, accepted drafts) of each step.

    From anchor P = start: n = longest prefix of drafts[P, :K] equal to seq[P+1..], commit n + 1
    tokens, next anchor P + n + 1; stop when the anchor is the last token. As the engine does, a
    sequence that ended at max_tokens gets only min(K, remaining - 1) drafts per step (drafts that
    could never be emitted are dropped) and a step with no drafts is not counted; a sequence that
    ended with EOS is drafted in full (matches past its end are impossible).
    """
    seq = seq.tolist()
    end, steps, p = len(seq), [], start
    while p < end - 1:
        k = min(num_speculative_tokens, end - 1 - p - 1) if hit_max_tokens else num_speculative_tokens
        row, n = drafts[p].tolist(), 0
        while n < k and p + n + 1 < end and row[n] == seq[p + n + 1]:
            n += 1
        if k > 0:
            steps.append((k, n))
        p += n + 1
    return steps


def summarize(steps: list[tuple[int, int]], num_speculative_tokens: int) -> dict:
    """Mean acceptance length (accepted + 1 per step) and per-position acceptance rates of
    `steps` ((drafts, accepted) pairs, as `walk` returns them), as the engine's SpecStats counts.

    per_position[i-1] = steps with >= i accepted / steps with >= i drafted (drafted_per_position):
    a step cut short by max_tokens did not propose its later positions, so it does not count
    against them. None (JSON null) for a position no step drafted, and acceptance_length None
    without any step (JSON has no NaN; the engine's SpecStats says None too).
    """
    n = len(steps)
    positions = range(1, num_speculative_tokens + 1)
    if n == 0:
        return {"acceptance_length": None, "num_steps": 0, "per_position": [None for _ in positions],
                "drafted_per_position": [0 for _ in positions]}
    drafted = [sum(d >= i for d, _ in steps) for i in positions]
    accepted = [sum(a >= i for _, a in steps) for i in positions]
    per_pos = [a / d if d else None for a, d in zip(accepted, drafted)]
    return {"acceptance_length": (sum(a for _, a in steps) + n) / n, "num_steps": n, "per_position": per_pos,
            "drafted_per_position": drafted}


def offline_acceptance(
    drafter: DFlashDraftModel, target, seqs: list[torch.Tensor], starts: list[int], eos_ids: tuple[int, ...],
    batch_size: int = 8, num_speculative_tokens: int | None = None, draft_vocab: torch.Tensor | None = None,
) -> dict:
    """Acceptance over many sequences (pooled over steps, as the engine's aggregate stats are),
    plus the per-sequence means under "per_sequence" (None for a sequence without a step). A sequence whose last token is not in
    `eos_ids` is taken to have stopped at max_tokens (see `walk`). draft_vocab: as in
    `draft_every_anchor`."""
    k = num_speculative_tokens or drafter.config.block_size - 1
    all_steps, per_seq = [], []
    for lo in range(0, len(seqs), batch_size):
        chunk, st = seqs[lo : lo + batch_size], starts[lo : lo + batch_size]
        for s, d, a in zip(chunk, draft_every_anchor(drafter, target, chunk, st, draft_vocab=draft_vocab), st):
            steps = walk(s, d, a, k, hit_max_tokens=int(s[-1]) not in eos_ids)
            all_steps += steps
            per_seq.append(summarize(steps, k)["acceptance_length"])
    result = summarize(all_steps, k)
    result["per_sequence"] = per_seq
    return result
