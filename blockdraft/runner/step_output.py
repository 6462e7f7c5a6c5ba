"""Output assembly: everything a step hands back to the engine crosses to the host in ONE copy.

The target tokens, the accepted-draft counts and the next drafts are packed into one int64
tensor [S, (kmax + 1) + 1 + K] on the device, copied to the host as the step is launched and read
with a single wait (runner.staging), and split into the per-request lists of ModelRunnerOutput on the host. Log-probabilities are the one
exception: when a request asks for them they are computed after the fetch and read back with a
second synchronisation (they are optional, and off by default).
"""

from __future__ import annotations

import torch

from blockdraft.engine.outputs import ModelRunnerOutput, SchedulerOutput
from blockdraft.runner.input_batch import InputBatch
from blockdraft.runner.staging import PendingFetch
from blockdraft.sample.sampler import compute_logprobs


def pack_step(target: torch.Tensor, num_accepted: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
    """[S, kmax+1] target tokens, [S] accepted counts, [S, K] next drafts (or None) -> [S, kmax+2+K] int64."""
    parts = [target, num_accepted[:, None]] + ([drafts] if drafts is not None else [])
    return torch.cat([p.to(torch.int64) for p in parts], dim=1)


def fetch_step_output(so: SchedulerOutput, batch: InputBatch, packed: PendingFetch) -> ModelRunnerOutput:
    """Wait for `pack_step`'s tensor (`start_fetch`ed at launch; the step's one wait), split it per request.

    sampled_token_ids[rid] = target[s, : accepted + 1]; num_accepted[rid] = accepted;
    draft_token_ids[rid] = the K next drafts (only when drafts were packed).
    """
    rows = packed.wait().tolist()
    width = batch.kmax + 1
    out = ModelRunnerOutput()
    for s, i in enumerate(batch.sample_req):
        rid, row = so.requests[i].request_id, rows[s]
        acc = row[width]
        out.sampled_token_ids[rid] = row[: acc + 1]
        out.num_accepted[rid] = acc
        if len(row) > width + 1:
            out.draft_token_ids[rid] = row[width + 1 :]
    return out


def add_logprobs(so: SchedulerOutput, batch: InputBatch, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
    """Fill out.logprobs for requests whose SamplingParams ask for them (reads back to the host).

    logits: [L] rows of this step's logits, in `batch.logits_indices` order.
    """
    for s, i in enumerate(batch.sample_req):
        num_top = so.requests[i].sampling_params.logprobs
        if num_top is None:
            continue
        rid = so.requests[i].request_id
        emitted = out.sampled_token_ids[rid]
        rows = batch.logits_rows[s, : len(emitted)]
        tokens = torch.tensor(emitted, dtype=torch.long, device=logits.device)
        out.logprobs[rid] = _logprob_dicts(logits[rows], tokens, num_top)


def _logprob_dicts(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[dict]:
    """One {"token_id", "logprob", "top": [(id, logprob), ...]} per emitted token."""
    lp, top_ids, top_lp = (t.cpu() for t in compute_logprobs(logits, tokens, num_top))
    return [
        {"token_id": int(t), "logprob": float(l), "top": list(zip(ti.tolist(), tl.tolist()))}
        for t, l, ti, tl in zip(tokens.tolist(), lp, top_ids, top_lp)
    ]
