"""vLLM's `truncate_prompt_tokens`: keep only the last k tokens of a prompt (left truncation).

One rule for every caller: SamplingParams checks the value's form, the engine truncates each
prompt it takes (so LLM.generate / chat / generate_stream, prefix caching and prompt_logprobs see
the truncated prompt), and the server truncates before it counts usage and checks the context.
Truncation comes before the context check: an overlong prompt with truncation is accepted.

Values (vLLM's SamplingParams and OpenAI-server field):
    None  no truncation (the default)
    -1    keep the last max_model_len tokens (vLLM: "the truncation size supported by the model")
    k>=1  keep the last k tokens; k above max_model_len is an error (vLLM's _validate_truncation_size)
0 and values below -1 are errors, as in vLLM.
"""

from __future__ import annotations

from blockdraft.errors import param_error

FIELD = "truncate_prompt_tokens"
ALLOWED = "None (no truncation), -1 (keep the last max_model_len tokens) or an integer >= 1 (keep the last k tokens)"


def check_truncate_prompt_tokens(value) -> None:
    """Raise a param_error about `truncate_prompt_tokens` unless `value` is None, -1 or an int >= 1
    (bools refused: True is not a token count)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise param_error(FIELD, f"{FIELD} must be {ALLOWED}, got {value!r}")


def tokens_kept(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many trailing prompt tokens to keep: None (all), `max_model_len` for -1, else the value.

    Raises:
        ValueError (param_error, .param "truncate_prompt_tokens"): a value of another form
            (check_truncate_prompt_tokens), or one above `max_model_len` (names both).
    """
    check_truncate_prompt_tokens(truncate_prompt_tokens)
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens > max_model_len:
        raise param_error(FIELD, f"{FIELD} must be -1 or at most {max_model_len} (the engine's max_model_len), "
                                 f"got {truncate_prompt_tokens}")
    return truncate_prompt_tokens


def truncate_prompt(prompt_token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """`prompt_token_ids` cut to its last `tokens_kept(...)` tokens; the list itself when nothing is cut.

    Args:
        prompt_token_ids: [P] token ids.
        truncate_prompt_tokens: None, -1 or k >= 1 (see the module docstring).
        max_model_len: the context in tokens (what -1 keeps, and the largest k allowed).
    Returns:
        [min(P, kept)] token ids: the prompt's tail (left truncation, as vLLM).
    Raises:
        ValueError: as `tokens_kept`.
    """
    keep = tokens_kept(truncate_prompt_tokens, max_model_len)
    if keep is None or len(prompt_token_ids) <= keep:
        return prompt_token_ids
    return prompt_token_ids[-keep:]
