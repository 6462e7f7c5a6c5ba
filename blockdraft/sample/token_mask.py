"""One request's allowed_token_ids and bad_words as the token bitmasks of a step's logits rows.

Lossless under speculative decoding for the same reason as the grammar's masks
(blockdraft.structured.grammar): row i of a verify step predicts the token after the first i
drafts, so its bad-word bans are computed from the output followed by drafts[:i], exactly what
plain decoding sees at that position whenever those drafts are accepted (and a row after a
rejected draft is never emitted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockdraft.sample.bitmask import disallow_tokens_, pack_bitmask


class RequestTokenMask:
    """The tokens one request may sample at each of its logits rows.

    Args:
        vocab_size: V, the logits width.
        allowed_token_ids: SamplingParams.allowed_token_ids (ids in [0, V)), or None: every token.
        bad_words: the request's bad-word token sequences (sample.bad_words.bad_words_token_ids),
            each non-empty, ids in [0, V).
    Allowed ids and one-token bad words give the same mask at every row (`static_row`); longer
    bad words depend on the output tokens (`reads_output`), so a request with them cannot be
    stepped before its previous step's tokens are read back (async scheduling).
    """

    def __init__(self, vocab_size: int, allowed_token_ids: Sequence[int] | None,
                 bad_words: Sequence[Sequence[int]] = ()) -> None:
        self.vocab_size = vocab_size
        if allowed_token_ids is None:
            allowed = torch.ones(vocab_size, dtype=torch.bool)
        else:
            allowed = torch.zeros(vocab_size, dtype=torch.bool)
            allowed[list(allowed_token_ids)] = True
        allowed[[s[0] for s in bad_words if len(s) == 1]] = False  # banned everywhere
        self.static_row = pack_bitmask(allowed)  # [ceil(V / 32)] int32
        self._static_allowed = bytearray(allowed.numpy().tobytes())  # host lookups: one byte per token
        self.sequences = [list(s) for s in bad_words if len(s) > 1]
        # output tokens a row's bans can depend on: the longest sequence's prefix
        self.history = max((len(s) for s in self.sequences), default=1) - 1
        self._prefixes: dict[int, list[list[int]]] = {}  # a sequence's last token -> the prefixes that ban it
        for seq in self.sequences:
            self._prefixes.setdefault(seq[-1], []).append(seq[:-1])
        # fill's index: the last token of a sequence's prefix -> (the tokens two-token sequences
        # ban after it, [(the earlier prefix tokens, the banned token)] of longer ones); a row
        # only checks the sequences filed under the token before it, none of the others can match
        self._after: dict[int, tuple[list[int], list[tuple[list[int], int]]]] = {}
        for seq in self.sequences:
            short, long = self._after.setdefault(seq[-2], ([], []))
            if len(seq) == 2:
                short.append(seq[-1])
            else:
                long.append((seq[:-2], seq[-1]))

    @property
    def reads_output(self) -> bool:
        """Whether the masks depend on the output tokens (a bad word of several tokens)."""
        return bool(self.sequences)

    def fill(self, out: torch.Tensor, output_token_ids: Sequence[int], drafts: Sequence[int]) -> None:
        """Write the masks of one sampling request's logits rows (every bit of `out` is overwritten).

        Args:
            out: [len(drafts) + 1, ceil(V / 32)] int32 on the CPU: row i gets the tokens allowed
                after the output and drafts[:i] (bit t % 32 of word t // 32 set = token t allowed).
            output_token_ids: the request's committed output tokens (only the last `history` are
                read; unused without `reads_output`).
            drafts: the K drafts this step verifies ([] for a plain decode row).
        Row i bans banned_tokens(sequences, output + drafts[:i]) (sample.bad_words), found by one
        lookup of the token before the row: the host cost (~6 us at K = 15, V = 151,936,
        python -m blockdraft.bench.token_mask) grows with the words whose prefix ends with that
        token and with the bans, not with the number of bad words.
        """
        out[:] = self.static_row
        if not self.sequences:
            return
        n_out = len(output_token_ids)
        tail = list(output_token_ids[max(0, n_out - self.history):]) + list(drafts)
        base = len(tail) - len(drafts)
        rows: list[int] = []
        tokens: list[int] = []
        after = self._after
        # row i follows tail[:base + i]: the token before it is tail[base + i - 1] (-1: none)
        for i, prev in enumerate(tail[base - 1:] if base else [-1, *tail]):
            hit = after.get(prev)
            if hit is None:
                continue
            j = base + i
            short, long = hit
            if short:
                rows += [i] * len(short)
                tokens += short
            for earlier, token in long:
                n = len(earlier)
                if n < j and tail[j - 1 - n:j - 1] == earlier:  # n < j: a word never starts before the output
                    rows.append(i)
                    tokens.append(token)
        disallow_tokens_(out, rows, tokens)

    def first_disallowed(self, output_token_ids: Sequence[int], tokens: Sequence[int]) -> int | None:
        """The index of the first of `tokens` (sampled after `output_token_ids`, in order) that
        its masks forbid, or None. A row whose every token is masked (allowed ids that are all
        banned words, or only an EOS that min_tokens masks, or a grammar's tokens that a bad word
        bans) still samples a token (every logit -inf); the engine ends the request before it.
        Host cost: one lookup per token, plus the bad words that end with it."""
        past = list(output_token_ids[max(0, len(output_token_ids) - self.history):]) if self.history else []
        for i, t in enumerate(tokens):
            if not (0 <= t < self.vocab_size) or not self._static_allowed[t]:
                return i
            for prefix in self._prefixes.get(t, ()):
                if len(prefix) <= len(past) and past[len(past) - len(prefix):] == prefix:
                    return i
            if self.history:
                past.append(t)
        return None
