"""Logit bias, min_tokens and presence, frequency and repetition penalties over a step's logits
rows, drafts included.

Semantics (vLLM's min-tokens and logit-bias processors, then its `apply_penalties`; OpenAI's
parameter definitions; repetition penalty from CTRL, Keskar et al. 2019, section 4.1): for the
logits row that predicts output position q of a request, with c(t) the number of times token t
occurs in the output before q and b_t the request's logit_bias of t (0 if none),

    x_t <- -inf      if q < min_tokens and t is an EOS id (ignore_eos or not, as vLLM) or a stop token id
    x_t <- x_t + b_t
    x_t <- x_t / r   if t is in the prompt or c(t) > 0, and x_t > 0
    x_t <- x_t * r   if t is in the prompt or c(t) > 0, and x_t <= 0
    x_t <- x_t - frequency * c(t) - presence * [c(t) > 0]

What makes this lossless under speculative decoding: the verify row that follows drafts
d_1..d_j counts them as output, exactly what plain decoding would have counted had it emitted
them; and a row is only used when every draft before it was accepted (DFLASH.md, "One decode
step", step 2). So each row is penalised as plain decoding penalises the same position.

The work is sparse: only tokens in the prompt (repetition penalty only), in the output or the
drafts, in logit_bias or masked by min_tokens change, so the host lists (row, token, bias, count) entries and the device updates those logits
with one gather and one scatter, no [rows, V] count tensor and no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from blockdraft.sampling_params import SamplingParams

__all__ = ["PENALTY_FIELDS", "PenaltyEntries", "apply_penalties", "penalty_entries"]


@dataclass
class PenaltyEntries:
    """The logits a step's penalties change, one entry per (logits row, token).

    rows: [E] int64 logits row. token_ids: [E] int64, a token in the request's logit_bias, masked by
    min_tokens at that row, in the prompt (listed only when the repetition penalty is on) or in the
    output before that row's position (drafts before it included); (row, token) pairs are unique.
    bias: [E] float32, its logit_bias (0 if none), -inf where min_tokens masks it. counts: [E] float32 occurrences of the token in that output.
    presence, frequency: [E] float32, the row's request's penalties. repetition: [E] float32, its
    repetition penalty where the token is in the prompt or counted, else 1.
    """

    rows: torch.Tensor
    token_ids: torch.Tensor
    bias: torch.Tensor
    counts: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


PENALTY_FIELDS = ("rows", "token_ids", "bias", "counts", "presence", "frequency", "repetition")  # PenaltyEntries' tensors


def penalty_entries(
    histories: Sequence[tuple[Sequence[int], Sequence[int]] | None],
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> PenaltyEntries | None:
    """Host-side entries for the logits rows of one step (sampling requests in row order).

    Args:
        histories: per sampling request, its ScheduledRequest.logits_context (the prompt's
            distinct token ids, a sorted [U] int64 CPU tensor (Request.prompt_token_set), read
            only with a repetition penalty, None without one; committed output token ids; the
            stop ids min_tokens masks while the output is shorter), or None when its params
            adjust no logits (its rows get no entries).
        drafts: per sampling request, the draft tokens its step verifies (k of them: it owns
            k + 1 consecutive logits rows, in the order of `histories`).
        params: per sampling request, its SamplingParams.
    Returns:
        PenaltyEntries on the CPU, or None when no request adjusts its logits.
    Raises:
        ValueError: the three sequences differ in length.
    """
    if not len(histories) == len(drafts) == len(params):
        raise ValueError(f"got {len(histories)} histories, {len(drafts)} draft lists and {len(params)} params")
    parts: list[list[torch.Tensor]] = []
    row0 = 0
    for history, d, p in zip(histories, drafts, params):
        # min_tokens alone adjusts nothing once the output is long enough (no stop ids masked)
        if history is not None and (p.has_penalties or p.logit_bias or history[2]):
            parts.append(_request_entries(*history, d, p, row0))
        row0 += len(d) + 1
    if not parts:
        return None
    return PenaltyEntries(*(torch.cat(column) for column in zip(*parts)))


def _request_entries(prompt, output, masked, drafts, p: SamplingParams, row0: int) -> list[torch.Tensor]:
    """One request's entries for its len(drafts) + 1 rows starting at logits row `row0` (`prompt`:
    as `penalty_entries`' histories; `masked`: the stop ids min_tokens masks at rows whose output
    position is below it).

    Two kinds of token: the dynamic ones (in the output, the drafts, logit_bias or masked; few)
    get per-row counts, bias and masks; a token only in the prompt gets the same entry on every row
    (repetition penalty alone), so a long prompt costs one expansion, not per-row arithmetic."""
    k = len(drafts)
    output_t = torch.tensor(list(output), dtype=torch.long)
    drafts_t = torch.tensor(list(drafts), dtype=torch.long)
    bias_map = p.logit_bias or {}
    bias_t = torch.tensor(list(bias_map), dtype=torch.long)
    masked_t = torch.tensor(list(masked), dtype=torch.long)
    tokens = torch.unique(torch.cat([output_t, drafts_t, bias_t, masked_t]))  # sorted
    u = tokens.shape[0]
    base = torch.bincount(torch.searchsorted(tokens, output_t), minlength=u)
    # counts[j] = output counts + drafts d_1..d_j (row j follows j drafts)
    step = torch.zeros(k + 1, u, dtype=torch.long)
    if k:
        step[torch.arange(1, k + 1), torch.searchsorted(tokens, drafts_t)] = 1
    counts = base[None, :] + step.cumsum(0)
    repeated = counts > 0
    static = torch.empty(0, dtype=torch.long)  # tokens only in the prompt
    if p.repetition_penalty != 1.0:
        repeated |= torch.isin(tokens, prompt)[None, :]
        static = prompt[~torch.isin(prompt, tokens)]
    bias = torch.zeros(u, dtype=torch.float32)
    if bias_map:
        bias[torch.searchsorted(tokens, bias_t)] = torch.tensor(list(bias_map.values()), dtype=torch.float32)
    bias = bias.repeat(k + 1, 1)  # [k + 1, u]
    # row j predicts output position len(output) + j: min_tokens masks the stop ids below it
    short = (len(output) + torch.arange(k + 1)) < p.min_tokens
    is_masked = short[:, None] & torch.isin(tokens, masked_t)[None, :]
    bias[is_masked] = float("-inf")
    # a dynamic token neither biased, masked, in the prompt, nor yet in the output is untouched
    keep = (repeated | torch.isin(tokens, bias_t)[None, :] | is_masked).flatten()
    rows = (row0 + torch.arange(k + 1)).repeat_interleave(u)[keep]
    repetition = torch.where(repeated.flatten()[keep], float(p.repetition_penalty), 1.0).to(torch.float32)
    s = static.shape[0]
    rows = torch.cat([rows, (row0 + torch.arange(k + 1)).repeat_interleave(s)])
    n_dyn, n = int(keep.sum()), rows.shape[0]
    zeros = torch.zeros(n - n_dyn, dtype=torch.float32)
    return [
        rows,
        torch.cat([tokens.repeat(k + 1)[keep], static.repeat(k + 1)]),
        torch.cat([bias.flatten()[keep], zeros]),
        torch.cat([counts.flatten()[keep].to(torch.float32), zeros]),
        torch.full((n,), float(p.presence_penalty), dtype=torch.float32),
        torch.full((n,), float(p.frequency_penalty), dtype=torch.float32),
        torch.cat([repetition, torch.full((n - n_dyn,), float(p.repetition_penalty), dtype=torch.float32)]),
    ]


def apply_penalties(logits: torch.Tensor, entries: PenaltyEntries) -> torch.Tensor:
    """Biased and penalised float32 copy of `logits` (the input is left as is: logprobs read the raw logits).

    Args:
        logits: [L, V] any float dtype, the step's logits rows.
        entries: PenaltyEntries on logits.device whose rows index `logits`.
    Returns:
        [L, V] float32. Entries are (row, token) unique, so the scatter has no write conflicts.
    """
    x = logits.to(torch.float32, copy=True)
    vals = x[entries.rows, entries.token_ids] + entries.bias
    r = entries.repetition
    vals = torch.where(vals > 0, vals / r, vals * r)
    vals = vals - entries.frequency * entries.counts
    vals = vals - entries.presence * (entries.counts > 0).to(torch.float32)
    x[entries.rows, entries.token_ids] = vals
    return x
