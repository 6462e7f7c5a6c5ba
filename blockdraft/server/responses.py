"""Build OpenAI response bodies and stream chunks from engine outputs (plain dicts, JSON-ready).

Extension: `spec_decode_stats` = {num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_position, drafted_per_position, acceptance_length} (acceptance_length = mean tokens
per verify step, accepted + 1; null without drafts; entry i of the per-position lists: steps that
accepted / drafted draft i+1, so the rate at i+1 is their ratio, not accepted / num_drafts, since a
step near max_tokens drafts fewer than K). Non-streaming responses carry it summed over the choices; in a
stream, the chunk that finishes a choice carries that choice's stats and the usage chunk (when
asked for) carries the sum.

Every log-probability in an answer is at least MIN_LOGPROB (-9999.0, as vLLM writes them): the
tokens a structured-output grammar masks have -inf, which JSON cannot carry.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from blockdraft.engine.detokenizer import IncrementalDetokenizer, added_token_texts
from blockdraft.engine.request import SpecStats


# The lowest log-probability an answer carries (vLLM's): a token that a structured-output grammar
# masks has -inf, which JSON cannot carry (the JSON response would fail, a stream would send -Infinity).
MIN_LOGPROB = -9999.0


def finite_logprob(logprob: float) -> float:
    """`logprob` (a float <= 0) floored at MIN_LOGPROB: -inf (a masked token) and NaN give MIN_LOGPROB."""
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


def sse(obj: dict) -> bytes:
    """One server-sent event frame."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    """OpenAI's `usage` object: prompt, completion and total token counts, and with
    `num_cached_tokens` (not None) `prompt_tokens_details: {"cached_tokens": N}`, the prompt tokens
    served from the prefix cache (ServerConfig.enable_prompt_tokens_details)."""
    out = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if num_cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return out


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
        "drafted_per_position": list(total.drafted_per_position),
        "acceptance_length": total.acceptance_length,
    }


class TokenText:
    """Text and raw bytes of single token ids (for logprobs), cached: the vocabulary is finite."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes_of: Callable[[int], bytes] | None = None  # built on first use (logprobs only)
        self._bytes_cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's raw UTF-8 bytes (ints 0..255), OpenAI's `bytes`: see `token_bytes_decoder`."""
        raw = self._bytes_cache.get(token_id)
        if raw is None:
            if self._bytes_of is None:
                self._bytes_of = token_bytes_decoder(self.tokenizer, self)
            raw = self._bytes_cache[token_id] = self._bytes_of(token_id)
        return list(raw)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback: one raw byte


def token_bytes_decoder(tokenizer, text_of: Callable[[int], str] | None = None) -> Callable[[int], bytes]:
    """`token_id -> the raw bytes that token adds to the output text`, for logprobs' `bytes`.

    Concatenating the bytes of consecutive tokens gives the exact UTF-8 of their text, also where a
    token holds only part of a character (byte-level BPE splits an emoji or CJK character across
    tokens; decoding such a token alone gives U+FFFD, whose bytes are not the token's).
    - Added / special tokens (e.g. <|im_end|>): the UTF-8 of their text.
    - Byte-level BPE (GPT-2 style: the backend's decoder is ByteLevel, or a slow tokenizer with a
      `byte_decoder`): each char of the token string is one byte, through the inverse of GPT-2's
      `bytes_to_unicode` table (from transformers).
    - Otherwise a token string `<0xNN>` (SentencePiece byte fallback) is that one byte, and any
      other the UTF-8 of its piece with SentencePiece's "\u2581" read as a space.
    - An id the tokenizer has no token string for (None), or a byte-level string with a char outside
      the table: the UTF-8 of `text_of(token_id)` (default: the tokenizer's decode of that id alone).

    Input: a tokenizer (transformers-style: `convert_ids_to_tokens`, `added_tokens_decoder`; any
    object with `decode` works through the fallback). The scheme is worked out once, here; the
    returned function does no caching of its own (TokenText caches per id).
    Raises: nothing of its own; the tokenizer's errors (e.g. for a negative id) propagate.
    """
    if text_of is None:
        text_of = lambda token_id: tokenizer.decode([token_id])  # noqa: E731
    to_token = getattr(tokenizer, "convert_ids_to_tokens", None)
    if to_token is None:
        return lambda token_id: text_of(token_id).encode("utf-8")
    added = added_token_texts(tokenizer)
    byte_of = _byte_level_inverse(tokenizer)

    def bytes_of(token_id: int) -> bytes:
        if token_id in added:
            return added[token_id].encode("utf-8")
        piece = to_token(token_id)
        if piece is None:
            return text_of(token_id).encode("utf-8")
        if byte_of is not None:
            try:
                return bytes(byte_of[c] for c in piece)
            except KeyError:
                return text_of(token_id).encode("utf-8")
        m = _BYTE_TOKEN.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    return bytes_of


def _byte_level_inverse(tokenizer) -> dict[str, int] | None:
    """char -> byte of a byte-level BPE tokenizer's token strings; None if it is not byte-level."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        if not _has_byte_level(json.loads(decoder.__getstate__())):
            return None
        try:
            from transformers.convert_slow_tokenizer import bytes_to_unicode
        except ImportError:  # older transformers keep it with GPT-2's tokenizer
            from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
        return {c: b for b, c in bytes_to_unicode().items()}
    byte_decoder = getattr(tokenizer, "byte_decoder", None)  # slow GPT-2-style tokenizers carry the table
    return dict(byte_decoder) if isinstance(byte_decoder, dict) else None


def _has_byte_level(state) -> bool:
    """Whether a tokenizers component's JSON state is, or holds (a Sequence), a ByteLevel one."""
    if isinstance(state, dict):
        return state.get("type") == "ByteLevel" or any(_has_byte_level(v) for v in state.values())
    if isinstance(state, list):
        return any(_has_byte_level(v) for v in state)
    return False


class TextOffsets:
    """Character offsets of one completion's tokens in its text (the /v1/completions `text_offset`).

    Token i's offset is the length in characters (str indices) of the text of the tokens before
    it, decoded as the engine decodes the completion text (the same IncrementalDetokenizer and
    `token_decoder`, with the request's skip_special_tokens / spaces_between_special_tokens: by
    default a special token adds no characters), counting
    only complete characters: a trailing incomplete UTF-8 character (byte-level BPE splits emoji /
    CJK characters across tokens) is left out until a later token completes it
    (IncrementalDetokenizer.num_complete_chars). So offsets are non-decreasing, a token that is
    only part of a character adds nothing, the token completing it adds the whole character, and
    text[offset[i]:offset[i + 1]] is what token i added to the text.
    Cost: one decode of a short window (at most IncrementalDetokenizer.WINDOW + 1 tokens, plus a
    restart decode every WINDOW tokens) per token, not a decode of every prefix.
    Stateful: feed one choice's tokens in order, over as many calls as there are stream chunks.
    Use it on the thread that owns `tokenizer` (HF fast tokenizers are not thread-safe).
    Raises: only the tokenizer's errors (e.g. for an id outside the vocabulary).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        """The flags: the choice's SamplingParams ones (its text is decoded with them)."""
        self._detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens,
                                             spaces_between_special_tokens=spaces_between_special_tokens)

    def __call__(self, token_ids: list[int]) -> list[int]:
        """The offsets (characters) of these tokens, which follow the tokens of earlier calls."""
        offsets = []
        for token_id in token_ids:
            offsets.append(self._detok.num_complete_chars)  # no decode here: append decoded already
            self._detok.append(token_id)
        return offsets


def completion_logprobs(entries: list[dict], token_text: TokenText, offsets: TextOffsets | list[int] | None = None,
                        text_len: int | None = None) -> dict:
    """The /v1/completions `logprobs` object for these tokens.

    `tokens` and the keys of `top_logprobs` are each token's text decoded alone (OpenAI's format): a
    token that is only part of a UTF-8 character reads "\ufffd" there, so several such alternatives
    of one position collide on the key "\ufffd" and only the last one's logprob is kept (inherent
    to a dict keyed by text; chat completions' `bytes` tell them apart).
    `text_offset`: each token's start in the completion text, in characters (see TextOffsets; not
    the summed lengths of the `tokens`, which drift after a split character or a special token).
    offsets: a TextOffsets that has seen this choice's earlier tokens (streaming); None starts a
    fresh one (entries are the whole completion). text_len: the returned text's length in
    characters, when known; offsets are capped at it (a stop string cuts the text, not the tokens).
    offsets may also be the tokens' precomputed starts (a list; streaming holds entries back, see
    serving.CompletionFormat).
    Offsets count from the completion's start; with `echo`, `echo_logprobs` puts the prompt's
    entries first and shifts these by the prompt text's length.
    `top_logprobs`: see `_completion_top`: the N alternatives plus the sampled token, as in vLLM.
    """
    if offsets is None:
        offsets = TextOffsets(token_text.tokenizer)
    starts = offsets if isinstance(offsets, list) else offsets([e["token_id"] for e in entries])
    if text_len is not None:
        starts = [min(o, text_len) for o in starts]
    return {
        "tokens": [token_text(e["token_id"]) for e in entries],
        "token_logprobs": [finite_logprob(e["logprob"]) for e in entries],
        "top_logprobs": [_completion_top(e, token_text) for e in entries],
        "text_offset": starts,
    }


def echo_logprobs(prompt_token_ids: list[int], prompt_entries: list[dict | None], prompt_text: str,
                  completion: dict | None, token_text: TokenText) -> dict:
    """The /v1/completions `logprobs` object of an `echo` choice: the prompt's tokens, then the
    completion's (`completion`, completion_logprobs' object, or None for none), as vLLM returns it.

    prompt_entries: RequestOutput.prompt_logprobs (None first, then one dict per prompt token), so
    the first prompt token's `token_logprobs` and `top_logprobs` entries are null. `text_offset`
    counts characters from the start of the echoed text: the prompt tokens' offsets (TextOffsets
    over the prompt ids with special tokens kept, as the echoed prompt holds them: echo_texts;
    capped at len(prompt_text)), then the completion's shifted by len(prompt_text).

    Raises:
        ValueError: prompt_entries and prompt_token_ids differ in length (the engine scored another
            prompt); otherwise only the tokenizer's errors.
    """
    if len(prompt_entries) != len(prompt_token_ids):
        raise ValueError(f"{len(prompt_entries)} prompt logprob entries for {len(prompt_token_ids)} prompt tokens")
    base = len(prompt_text)
    starts = [min(o, base) for o in TextOffsets(token_text.tokenizer, skip_special_tokens=False)(prompt_token_ids)]
    out = {
        "tokens": [token_text(t) for t in prompt_token_ids],
        "token_logprobs": [None if e is None else finite_logprob(e["logprob"]) for e in prompt_entries],
        "top_logprobs": [None if e is None else _completion_top(e, token_text) for e in prompt_entries],
        "text_offset": starts,
    }
    if completion is not None:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += completion[key]
        out["text_offset"] += [base + o for o in completion["text_offset"]]
    return out


def prompt_logprobs(entries: list[dict | None], num_top: int, token_text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs` answer field from RequestOutput.prompt_logprobs: None for the first
    prompt token, then per token {token id as a string: {"logprob", "rank", "decoded_token"}} with
    the prompt token first, then the `num_top` most likely tokens (rank 1, 2, ...) not already
    listed, so an entry holds num_top or num_top + 1 tokens (vLLM's form)."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        item = {str(e["token_id"]): {"logprob": finite_logprob(e["logprob"]), "rank": e["rank"],
                                     "decoded_token": token_text(e["token_id"])}}
        for rank, (t, lp) in enumerate(e["top"][:num_top], start=1):
            item.setdefault(str(t), {"logprob": finite_logprob(lp), "rank": rank, "decoded_token": token_text(t)})
        out.append(item)
    return out


def top_sliced(entries: list[dict | None], num_top: int) -> list[dict | None]:
    """RequestOutput.prompt_logprobs with at most `num_top` alternatives per token (the engine scored
    the prompt with the larger of echo's and prompt_logprobs' counts)."""
    return [None if e is None else {**e, "top": e["top"][:num_top]} for e in entries]


def _completion_top(entry: dict, token_text: TokenText) -> dict[str, float]:
    """One position's /v1/completions `top_logprobs` dict: the N most likely tokens (most likely
    first), then the sampled token if it is not among them, as vLLM does: its completions dict
    always holds the sampled token, so logprobs=0 gives {sampled: logprob} (not {}) and logprobs=N
    up to N + 1 entries. The sampled token is written last, so where its text is also an
    alternative's key (two tokens that decode alone to U+FFFD) its own logprob is the one kept.
    Chat completions differ (OpenAI's top_logprobs 0 is an empty list): chat_logprobs adds nothing."""
    top = {token_text(t): finite_logprob(lp) for t, lp in entry["top"]}
    top[token_text(entry["token_id"])] = finite_logprob(entry["logprob"])  # an existing key keeps its place
    return top


def chat_logprobs(entries: list[dict], token_text: TokenText, token_ids: bool = False) -> dict:
    """The /v1/chat/completions `logprobs` object ({"content": [...]}) for these tokens.

    token_ids: also give each token's id first, as "token_id" (not OpenAI's: `blockdraft generate
    --json --logprobs N` prints these items, where the text alone may not name the token).
    """

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {**({"token_id": token_id} if token_ids else {}), "token": text, "logprob": finite_logprob(logprob),
                "bytes": token_text.bytes(token_id)}

    content = [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]
    return {"content": content}
