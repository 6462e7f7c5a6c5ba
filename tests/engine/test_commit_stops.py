"""Committing a step's tokens (1 + accepted drafts at once) stops exactly where committing them
one by one would: stop string, then EOS, then stop token id, then max_tokens / max_model_len."""

import random

from blockdraft.engine.detokenizer import IncrementalDetokenizer
from blockdraft.engine.kv_cache_manager import KVCacheManager
from blockdraft.engine.llm_engine import LLMEngine
from blockdraft.engine.request import Request
from blockdraft.engine.scheduler import Scheduler
from blockdraft.config import SchedulerConfig
from blockdraft.sampling_params import SamplingParams


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i % 26), so stop strings can match across tokens."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def _reference(tokenizer, params, eos, prompt_len, max_model_len, steps):
    """The per-token commit loop (the engine's behaviour before tokens were committed as a slice).
    As in vLLM, an EOS / stop token id that ends the request is not detokenized (no text, no stop
    string completed) unless include_stop_str_in_output."""
    detok, out = IncrementalDetokenizer(tokenizer, params.stop, include_stop=params.include_stop_str_in_output), []
    for tokens in steps:
        for tok in tokens:
            out.append(tok)
            ends = (not params.ignore_eos and tok in eos) or tok in params.stop_token_ids
            stop_str = detok.append(tok) if params.include_stop_str_in_output or not ends else None
            if stop_str is not None:
                return out, "stop", stop_str, detok.text
            if not params.ignore_eos and tok in eos:
                return out, "stop", None, detok.text  # EOS records no stop_reason (vLLM)
            if tok in params.stop_token_ids:
                return out, "stop", tok, detok.text
            if len(out) >= params.max_tokens or prompt_len + len(out) >= max_model_len:
                return out, "length", None, detok.text
    return out, None, None, detok.text


def test_slice_commit_matches_per_token_commit():
    rng = random.Random(0)
    tok = CharTokenizer()
    for trial in range(400):
        eos = (rng.randrange(8),)
        params = SamplingParams(
            max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3,
            stop=rng.choice([None, ["cd"], ["b", "fgh"]]), stop_token_ids=rng.choice([[], [rng.randrange(8)]]),
            include_stop_str_in_output=rng.random() < 0.3,
        )
        prompt_len, max_model_len = rng.randint(1, 5), rng.randint(6, 20)
        steps = [[rng.randrange(8) for _ in range(rng.randint(1, 5))] for _ in range(8)]
        engine = LLMEngine(Scheduler(SchedulerConfig(), KVCacheManager(64, 4)), None, tok, eos, max_model_len)
        engine.add_request("r", list(range(prompt_len)), params)
        req: Request = engine._requests["r"]
        for tokens in steps:
            engine._append_tokens(req, list(tokens), None)
            if req.is_finished:
                break
        want = _reference(tok, params, eos, prompt_len, max_model_len, steps)
        got = (req.output_token_ids, req.finish_reason, req.stop_reason, engine._detok["r"].text)
        assert got == want, (trial, params, steps)


def _token_at(req: Request, index: int) -> int:
    """Token at sequence index `index` of `req`, counting drafts after the committed tokens (oracle)."""
    n_prompt = len(req.prompt_token_ids)
    if index < n_prompt:
        return req.prompt_token_ids[index]
    index -= n_prompt
    if index < len(req.output_token_ids):
        return req.output_token_ids[index]
    return req.spec_token_ids[index - len(req.output_token_ids)]


def test_token_slice_equals_token_at():
    rng = random.Random(1)
    for _ in range(500):
        req = Request("x", [rng.randrange(9) for _ in range(rng.randint(1, 6))], SamplingParams())
        req.output_token_ids = [rng.randrange(9) for _ in range(rng.randint(0, 5))]
        req.spec_token_ids = [rng.randrange(9) for _ in range(rng.randint(0, 5))]
        n = req.num_tokens + len(req.spec_token_ids)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        assert req.token_slice(a, b) == [_token_at(req, i) for i in range(a, b)]
