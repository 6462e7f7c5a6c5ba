"""Prompt log-probabilities (SamplingParams.prompt_logprobs, as vLLM's): the log-probability of each
prompt token given the tokens before it, and the N most likely tokens at its position.

The scheduler marks, per request and step, the prompt rows whose logits score a prompt token
(ScheduledRequest.prompt_logprob_token_ids / prompt_logprob_offset). The runner runs such a step
eagerly (not through the prefill or uniform-step CUDA graphs, which compute the LM head of the
sampled rows only), and `PromptLogprobs.compute` takes those rows of the step's final hidden states
through the LM head in slices of at most SLICE_ROWS rows, keeping only [rows, 1 + 2N] numbers: a
long prompt is scored chunk by chunk (one chunk per step) and never holds more than
[SLICE_ROWS, V] logits. The sampled rows' logits (logits_indices) and everything the drafter reads
are untouched, so tokens and drafts are the same with and without prompt log-probabilities. The
results stay on the device until `read` (in ModelRunner.finish, a second host synchronisation, as
for output logprobs); they are tensors of their own, not graph outputs, so a join step's replay
(async scheduling) cannot overwrite them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.engine.outputs import SchedulerOutput
from blockdraft.host_tensor import host_tensor
from blockdraft.runner.staging import stage_to_device
from blockdraft.sample.sampler import compute_logprobs

SLICE_ROWS = 256  # rows through the LM head at once: [256, 152K] float32 is ~150 MB


@dataclass
class PromptLogprobs:
    """The prompt rows one step scores, and (after `compute`) their log-probabilities.

    request_ids / counts / num_top: per request that scores prompt tokens this step, in batch
    order: its id, how many tokens it scores, its SamplingParams.prompt_logprobs (N).
    rows: [R] int64 (device) rows of the step's hidden states; tokens: [R] int64 (device) the
    prompt token each row scores (R = sum(counts)); token_ids: the same on the host. After `compute`: token_logprob [R] float32,
    token_rank [R] int64 (the number of tokens at least as likely, itself included: vLLM's rank), top_ids
    [R, max(num_top)] int64, top_logprobs [R, max(num_top)] float32 (device).
    """

    request_ids: list[str]
    counts: list[int]
    num_top: list[int]
    rows: torch.Tensor
    tokens: torch.Tensor
    token_ids: list[int]
    token_logprob: torch.Tensor | None = None
    token_rank: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def compute(self, model, hidden: torch.Tensor, fp32_head: bool = False) -> None:
        """Score the rows: `hidden` [T, H] the step's final hidden states (after the final norm, as
        `model.compute_logits` takes them, with its `fp32_head`). log_softmax of the raw logits,
        float32 (compute_logprobs)."""
        k = max(self.num_top)
        parts = []
        for a in range(0, self.rows.shape[0], SLICE_ROWS):
            logits = model.compute_logits(hidden[self.rows[a : a + SLICE_ROWS]], upcast=False, fp32_head=fp32_head)
            tokens = self.tokens[a : a + SLICE_ROWS]
            # vLLM's rank: the tokens at least as likely, itself included (a tie ranks it last);
            # raw logits, whose order log_softmax keeps
            rank = (logits >= logits.gather(1, tokens[:, None])).sum(-1)
            parts.append((*compute_logprobs(logits, tokens, k), rank))
        self.token_logprob, self.top_ids, self.top_logprobs, self.token_rank = (torch.cat(p) for p in zip(*parts))

    def read(self) -> dict[str, list[dict]]:
        """Copy to the host (waits for the device) -> {request id: one {"token_id", "logprob",
        "rank", "top": [(token_id, logprob), ...] (N, most likely first)} per scored token, in order}.

        Raises:
            RuntimeError: `compute` has not run.
        """
        if self.token_logprob is None:
            raise RuntimeError("PromptLogprobs.read before compute: the step's forward did not score the prompt rows")
        tokens, lps, ranks = self.token_ids, self.token_logprob.tolist(), self.token_rank.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        out, start = {}, 0
        for rid, n, k in zip(self.request_ids, self.counts, self.num_top):
            out[rid] = [{"token_id": tokens[r], "logprob": lps[r], "rank": ranks[r],
                         "top": list(zip(top_ids[r][:k], top_lps[r][:k]))}
                        for r in range(start, start + n)]
            start += n
        return out


def plan_prompt_logprobs(so: SchedulerOutput, device: torch.device) -> PromptLogprobs | None:
    """The prompt rows `so` scores (staged to `device`, asynchronously), or None when no request of
    `so` scores any (the common case: one pass over the requests, nothing else)."""
    if not any(sr.prompt_logprob_token_ids for sr in so.requests):
        return None
    ids, counts, num_top, rows, tokens = [], [], [], [], []
    start = 0
    for sr in so.requests:
        scored = sr.prompt_logprob_token_ids
        if scored:
            first = start + sr.prompt_logprob_offset
            ids.append(sr.request_id)
            counts.append(len(scored))
            num_top.append(sr.sampling_params.prompt_logprobs)
            rows += range(first, first + len(scored))
            tokens += scored
        start += len(sr.token_ids)
    dev = stage_to_device({"rows": host_tensor(rows, torch.long), "tokens": host_tensor(tokens, torch.long)}, device)
    return PromptLogprobs(ids, counts, num_top, dev["rows"], dev["tokens"], tokens)
