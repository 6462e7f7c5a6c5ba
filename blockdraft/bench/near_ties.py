"""Are the bf16 divergences of DFlash from plain decoding near-ties? The gap at the first divergence.

Speculative decoding is lossless in exact arithmetic; in bf16 a verify step (K + 1 rows per
request) and a plain decode step (one row) sum in different orders, so where the target's top two
logits (nearly) tie the two paths can pick different tokens and continue differently. Issue 5
allows such divergences only at near-ties: a top-2 logit gap < 1e-2 at the first divergent token.

For each mismatched request this runs the target once more (plain, eager, the same dtype) on the
prompt + the common prefix and reads the top-2 log-probabilities of the next token (a log-prob gap
equals the logit gap). This is a third evaluation order (a prefill row), so it measures how close
the two candidates were, not either path's exact logits; bf16 logits of magnitude m are spaced
2**(floor(log2 m) - 7) apart, so a gap of 0 or one such step is a tie at bf16 resolution.
"""

from __future__ import annotations

from blockdraft.sampling_params import SamplingParams

NEAR_TIE_GAP = 1e-2  # issue 5: bf16 divergences allowed where the top-2 logit gap is below this


def divergence_gaps(
    llm, prompts: list[list[int]], candidate: list[list[int]], reference: list[list[int]], first_mismatch: list
) -> list[dict]:
    """The top-2 gap at the first divergence of every mismatched request.

    Args:
        llm: a plain blockdraft LLM over the target (no speculator).
        prompts: token-id prompts, one per request.
        candidate / reference: the two engines' output token ids per request.
        first_mismatch: per request, the index of the first differing token or None
            (bench.measure.compare_outputs).
    Returns:
        One dict per mismatched request: {"request", "index", "reference_token", "candidate_token",
        "top2_gap" (float, top-1 minus top-2 log-prob, nats = logit units), "top2_tokens" ([2] ids),
        "both_in_top2" (the two divergent tokens are the top two), "near_tie" (both_in_top2 and
        top2_gap < NEAR_TIE_GAP)}. Requests that only differ in length (no divergent token) are
        skipped.
    """
    rows = []
    for i, d in enumerate(first_mismatch):
        if d is None or d >= len(candidate[i]) or d >= len(reference[i]):
            continue
        rows.append((i, d))
    if not rows:
        return []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2, detokenize=False)
    outs = llm.generate([prompts[i] + reference[i][:d] for i, d in rows], params)
    result = []
    for (i, d), out in zip(rows, outs):
        top = out.logprobs[0]["top"]  # [(token id, logprob)] best first
        (t1, lp1), (t2, lp2) = top[0], top[1]
        pair = {reference[i][d], candidate[i][d]}
        both = pair == {t1, t2}
        gap = float(lp1 - lp2)
        result.append({
            "request": i, "index": d, "reference_token": reference[i][d], "candidate_token": candidate[i][d],
            "top2_gap": gap, "top2_tokens": [t1, t2], "both_in_top2": both,
            "near_tie": both and gap < NEAR_TIE_GAP,
        })  # fmt: skip
    return result
