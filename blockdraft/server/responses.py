"""Build OpenAI response bodies and stream chunks from engine outputs (plain dicts, JSON-ready).

Extension: `spec_decode_stats` = {num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_position, acceptance_length} (acceptance_length = mean tokens per verify step,
accepted + 1; null without drafts). Non-streaming responses carry it summed over the choices; in a
stream, the chunk that finishes a choice carries that choice's stats and the usage chunk (when
asked for) carries the sum.
"""

from __future__ import annotations

import json

from blockdraft.engine.request import SpecStats


def sse(obj: dict) -> bytes:
    """One server-sent event frame."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def spec_stats(stats: list[SpecStats]) -> dict:
    """The spec_decode_stats extension, summed over `stats`."""
    total = SpecStats()
    for s in stats:
        total.merge(s)
    return {
        "num_drafts": total.num_steps,
        "num_draft_tokens": total.num_drafted_tokens,
        "num_accepted_tokens": total.num_accepted_tokens,
        "accepted_per_position": list(total.accepted_per_position),
        "acceptance_length": total.acceptance_length,
    }


class TokenText:
    """Text of single token ids (for logprobs), cached: the vocabulary is finite."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def completion_logprobs(entries: list[dict], token_text: TokenText, text_offset: int) -> dict:
    """The /v1/completions `logprobs` object for these tokens.

    text_offset counts characters of the completion text from `text_offset`, adding each token's
    own decoded text (exact for tokenizers whose tokens carry their spaces, as byte-level BPE does).
    """
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        tokens.append(token_text(e["token_id"]))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in e["top"]} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[dict], token_text: TokenText, token_ids: bool = False) -> dict:
    """The /v1/chat/completions `logprobs` object ({"content": [...]}) for these tokens.

    token_ids: also give each token's id first, as "token_id" (not OpenAI's: `blockdraft generate
    --json --logprobs N` prints these items, where the text alone may not name the token).
    """

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {**({"token_id": token_id} if token_ids else {}), "token": text, "logprob": logprob,
                "bytes": list(text.encode("utf-8"))}

    content = [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]
    return {"content": content}
