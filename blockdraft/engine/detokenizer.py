"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Keeps a request's output text current as tokens arrive one at a time.

    Decodes only a short window of recent tokens per step (prefix/read offsets as in vLLM's
    detokenizer), so the cost per token is constant. A trailing U+FFFD (an incomplete UTF-8
    sequence from byte-level BPE) is held back until the next token completes it.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._stopped = False

    def append(self, token_id: int) -> str | None:
        """Add one token; return the stop string it completed (text is then cut before it), else None."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        new_text = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new_text
        return self._check_stop(start)

    def extend(self, token_ids: list[int]) -> tuple[int, str] | None:
        """`append` each token in turn; stop at the first stop string.

        Returns (index in token_ids of the token that completed it, the stop string), or None
        (all tokens appended).
        """
        for i, tok in enumerate(token_ids):
            stop_str = self.append(tok)
            if stop_str is not None:
                return i, stop_str
        return None

    def flush(self) -> None:
        """At the end of a request: emit text held back waiting for more UTF-8 bytes."""
        if self._stopped:
            return
        full = self._decode(self._ids[self._prefix_offset :])
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
            self._read_offset = len(self._ids)

    def _check_stop(self, start: int) -> str | None:
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self._stopped = True
        return best[1]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
