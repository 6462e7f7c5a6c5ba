"""Per-request sampling and stopping parameters (vLLM-compatible names)."""

from __future__ import annotations

import copy
import dataclasses
import numbers
import random
from dataclasses import dataclass, field

from blockdraft.errors import check_unicode_text, param_error
from blockdraft.prompt_truncation import check_truncate_prompt_tokens
from blockdraft.structured.params import StructuredOutputsParams  # noqa: F401  (vLLM's import path)
from blockdraft.vllm_only_args import SAMPLING_VLLM_ONLY, check_vllm_only

# Largest `logprobs` an engine accepts unless built with another max_logprobs (vLLM's default and
# the server's ServerConfig.max_logprobs): each alternative costs a top-k over the vocabulary.
DEFAULT_MAX_LOGPROBS = 20


# Sampling at T -> 0 tends to argmax, and dividing float32 logits by T < 1e-5 overflows: such
# requests decode greedily (older vLLM's _SAMPLING_EPS rule; newer vLLM raises T < 0.01 to 0.01).
GREEDY_BELOW_TEMPERATURE = 1e-5
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: per-request floats become float32 tensors
INT64_MAX = 2**63 - 1  # per-request integers become int64 tensors


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 means greedy (argmax), and so does any temperature below 1e-5 (dividing logits
    by it would overflow float32; older vLLM's rule too), which `verify` sets to 0; at most
    float32's largest value. top_k: 0 or -1 disables it (at most 2**63 - 1; above the vocabulary
    size it keeps every token). top_p in (0, 1]. min_p in [0, 1] (0 disables it; vLLM's min_p):
    after temperature, tokens whose probability is below min_p times that of the most likely token
    are dropped, before top-k and top-p (vLLM's order); greedy rows ignore it.
    seed: makes sampling reproducible; the sample at output position q is a pure function of
    (seed, q, logits), so it does not depend on batch mates or on speculative decoding. None: each
    request the engine takes gets its own random seed (`for_request`), so one SamplingParams used
    for several prompts, or for several calls, samples each independently, as in vLLM.
    max_tokens: output tokens at most (>= 1); None: no cap of the request's own, it runs until EOS, a
    stop, or the end of the context (max_model_len), as vLLM's None. stop: strings that end the
    output (not included in text unless include_stop_str_in_output, vLLM's flag). stop_token_ids:
    extra token ids that end the output (included in token ids, like EOS).
    ignore_eos: keep going past EOS. logprobs: number of top log-probabilities to return per output
    token (None: none; 0: only the sampled token's), at most the engine's `max_logprobs` (default
    20, `LLM(max_logprobs=...)`; checked when the engine takes the request). prompt_logprobs: the
    same for the prompt (vLLM's prompt_logprobs): None, or N >= 0 for the log-probability of each
    prompt token given the tokens before it plus its N most likely alternatives (the first prompt
    token has None), within the same `max_logprobs`; such a request recomputes its whole prompt
    (no prefix-cache hit). detokenize: build the output text (default); False leaves `text` empty
    and skips decoding each new token (token ids only, e.g. training data; vLLM's `detokenize`), so
    it cannot be combined with stop strings.
    skip_special_tokens: leave special tokens (e.g. `<|im_end|>`, an EOS kept by ignore_eos) out of
    the text (default, vLLM's); False writes them in it (stop strings then match them too). As in
    vLLM, the EOS or stop_token_ids token that ends a request adds no text unless
    include_stop_str_in_output; logprobs are unaffected (token ids). spaces_between_special_tokens:
    with skip_special_tokens False, False writes an added token that follows another one without
    the separator the tokenizer's decoder puts between them (vLLM's fast detokenizer rule; e.g.
    "<eos> <eos>" becomes "<eos><eos>" with a decoder that joins tokens with spaces); no effect
    with skip_special_tokens True.
    presence_penalty / frequency_penalty: in [-2, 2] (OpenAI's range), subtracted from the logit of
    every token already in the output: presence once, frequency once per occurrence (0 = off).
    repetition_penalty: > 0 (1 = off), at most float32's largest value; the logit of every token
    in the prompt or the output is divided by it when positive and multiplied by it otherwise
    (CTRL, Keskar et al. 2019, section 4.1, as vLLM and transformers apply it). logit_bias:
    {token id: bias} added to those tokens' logits (OpenAI's logit_bias; biases finite, in [-100, 100]; ids checked against the vocabulary
    when the engine takes the request), before the penalties. Bias and penalties act on the logits
    before temperature, min_p, top-k and top-p, greedy rows included; logprobs stay those of the
    raw model (vLLM's default). min_tokens: 0 <= min_tokens <= max_tokens (vLLM's extension): until the output
    has this many tokens, EOS (also with ignore_eos, as vLLM) and stop_token_ids are masked out of the logits
    and stop strings are not looked for. n: completions per prompt in `LLM.generate` (vLLM's n;
    RequestOutput.outputs holds them): completion j of a seeded request uses seed + j, unseeded
    ones sample independently; an LLMEngine request is always one completion (n = 1).
    structured_outputs: a StructuredOutputsParams (vLLM's): the output follows a JSON Schema, a
    regex, a choice of strings or a grammar (blockdraft.structured: llguidance masks the logits of
    every row, draft rows included, so speculative output stays equal to plain output); the
    request ends when the constraint is complete. None: unconstrained.
    truncate_prompt_tokens: None (default: the whole prompt), -1 or k >= 1 (vLLM's): the engine
    keeps only the last k prompt tokens (left truncation; -1: the last max_model_len), before it
    checks the prompt against the context, so an overlong prompt is accepted; the output's
    prompt_token_ids, prompt_logprobs, prefix caching and the repetition penalty see the kept
    tokens (RequestOutput.prompt keeps the text given, as vLLM). k above the engine's
    max_model_len is refused when the engine takes the request (blockdraft.prompt_truncation).
    allowed_token_ids: vLLM's: only these token ids may be sampled (every other logit -inf); a
    non-empty list of ids in the vocabulary (checked when the engine takes the request), or None.
    bad_words: vLLM's: strings the output must not contain as tokens. Each word, its leading
    whitespace stripped, is tokenized alone and, when that gives as many tokens with another first
    one, also after a space (blockdraft.sample.bad_words); at each position the last token of such a
    sequence is banned when the output's tokens before it end with the rest of it (a one-token word
    is always banned). Only output tokens count, not the prompt's. Both act on the sampled
    distribution only, after logit_bias, min_tokens and the penalties (no bias lifts a masked
    token; a grammar's mask applies too): as in vLLM, logprobs stay those of the raw logits, and
    with speculation each verify row counts the drafts before it as output, so the output stays
    plain decoding's. Where the masks (with min_tokens or a grammar) leave no token at a position,
    the request ends before it (finish_reason "abort"); the engine refuses the cases it can see
    up front (every allowed id banned, or only EOS / stop ids under min_tokens).
    best_of, use_beam_search, guided_decoding, logits_processors, output_kind, extra_args: vLLM's,
    taken (and not kept) only at values that change nothing (blockdraft.vllm_only_args
    .SAMPLING_VLLM_ONLY: None, False, [] or {}; best_of also 1 or n), so that a ported script runs.

    Raises:
        ValueError: naming the offending field and the allowed range (at construction, and again
            when the engine takes the request: fields changed since are checked too, `verify`).
        TypeError: an argument it does not take (a vLLM field says what to use instead, e.g.
            guided_decoding -> structured_outputs; a typo names the nearest field), or one of the
            vLLM fields above at a value that would change something.
    """

    max_tokens: int | None = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's fields that mean nothing here, taken at their values that change nothing (a ported
    # script's best_of=None runs) and refused otherwise, saying what to use (vllm_only_args)
    best_of: dataclasses.InitVar[int | None] = None
    use_beam_search: dataclasses.InitVar[bool | None] = None
    guided_decoding: dataclasses.InitVar[object] = None
    logits_processors: dataclasses.InitVar[list | None] = None
    output_kind: dataclasses.InitVar[object] = None
    extra_args: dataclasses.InitVar[dict | None] = None
    _resolved_seed: int = field(default=0, init=False, repr=False)

    def __new__(cls, *args, **kwargs):
        # before the dataclass __init__'s bare "unexpected keyword argument": a typo names the
        # nearest field
        unknown = {k: v for k, v in kwargs.items() if k not in _INIT_FIELDS}
        check_vllm_only(unknown, _INIT_FIELDS, {}, owner="SamplingParams")
        return super().__new__(cls)

    def __post_init__(self, best_of, use_beam_search, guided_decoding, logits_processors, output_kind,
                      extra_args) -> None:
        vllm_only = dict(best_of=None if best_of == self.n else best_of,  # best_of == n: n completions, as n
                         use_beam_search=use_beam_search, guided_decoding=guided_decoding,
                         logits_processors=logits_processors, output_kind=output_kind, extra_args=extra_args)
        check_vllm_only(vllm_only, _INIT_FIELDS, SAMPLING_VLLM_ONLY, owner="SamplingParams")
        self.verify()
        self._resolved_seed = self.seed if self.seed is not None else random.SystemRandom().randrange(2**31)

    def verify(self) -> None:
        """Normalise `stop` / `stop_token_ids` to lists and numpy / other non-builtin numbers to int /
        float, then check every field (raises ValueError)."""
        self._builtin_numbers()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise param_error("stop", f"stop must be a string, a list of strings or None, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise param_error("stop_token_ids", f"stop_token_ids must be a list of token ids (integers >= 0) or None, "
                                                f"got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = [_builtin_int(t) for t in self.stop_token_ids or []]
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1, high=INT64_MAX)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise param_error("temperature", f"temperature must be a number >= 0, got {self.temperature!r}")
        if not 0 <= self.temperature <= FLOAT32_MAX:
            raise param_error("temperature", f"temperature must be a finite number >= 0 and <= {FLOAT32_MAX:.6g} "
                                             f"(float32's largest), got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            self.temperature = 0.0
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise param_error("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k <= INT64_MAX:
            raise param_error("top_k", f"top_k must be an integer: 0 or -1 (off) or in [1, 2**63 - 1], got {self.top_k!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise param_error("min_p", f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise param_error("stop", f"stop strings must be non-empty strings, got {s!r}")
            check_unicode_text(s, f"stop string {s!r}", param="stop")  # could never match the detokenized text
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0, what="stop_token_ids entry")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0)
        for flag in ("ignore_eos", "detokenize", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise param_error(flag, f"{flag} must be True or False, got {getattr(self, flag)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise param_error(name, f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0.0 < rp <= FLOAT32_MAX:
            raise param_error("repetition_penalty", f"repetition_penalty must be a number > 0 and <= {FLOAT32_MAX:.6g} "
                                                    f"(float32's largest; 1 = off), got {rp!r}")
        _check_int("n", self.n, low=1)
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        _check_int("min_tokens", self.min_tokens, low=0, high=INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise param_error("min_tokens", f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise param_error("logit_bias", f"logit_bias must be a dict {{token id: bias}} or None, got "
                                                f"{self.logit_bias!r}"[:300])
            bias = {}
            for t, b in self.logit_bias.items():
                if isinstance(t, numbers.Integral) and not isinstance(t, bool):
                    t = int(t)  # numpy / torch integers too, as prompt token ids
                _check_int("logit_bias", t, low=0, what="logit_bias token id")
                if isinstance(b, bool) or not isinstance(b, numbers.Real) or not -100.0 <= b <= 100.0:
                    raise param_error("logit_bias", f"logit_bias of token {t} must be a number in [-100, 100], got {b!r}")
                bias[t] = float(b)
            self.logit_bias = bias
        self._check_token_masks()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise param_error("structured_outputs", f"structured_outputs must be a StructuredOutputsParams "
                                                        f"(blockdraft.StructuredOutputsParams) or None, got "
                                                        f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.verify()
        if self.stop and not self.detokenize:
            raise param_error("stop", f"stop strings {self.stop!r} need the output text: drop them or keep "
                                      f"detokenize=True")

    def _check_token_masks(self) -> None:
        """Check and normalise allowed_token_ids (a non-empty list of ints >= 0, numpy ints taken as
        ints) and bad_words (a list of strings with a non-space character); both stay None when None."""
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)):
                raise param_error("allowed_token_ids", f"allowed_token_ids must be a list of token ids (integers >= 0) "
                                                       f"or None, got {allowed!r}"[:300])
            if not allowed:  # vLLM refuses it too: every logit would be -inf
                raise param_error("allowed_token_ids", "allowed_token_ids must not be empty: give at least one token "
                                                       "id, or None for no restriction")
            self.allowed_token_ids = [_builtin_int(t) for t in allowed]
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, low=0, what="allowed_token_ids entry")
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)):  # a bare string would ban each of its characters
                raise param_error("bad_words", f"bad_words must be a list of strings or None, got {words!r}"[:300])
            for w in words:
                # vLLM strips leading whitespace; an empty word has no token to ban
                if not isinstance(w, str) or not w.strip():
                    raise param_error("bad_words", f"bad_words entries must be strings with a non-space character, "
                                                   f"got {w!r}"[:300])
                check_unicode_text(w, f"bad_words entry {w!r}", param="bad_words")  # the tokenizer refuses it
            self.bad_words = list(words)

    def _builtin_numbers(self) -> None:
        """numpy (or any numbers.Integral / numbers.Real) values of the numeric fields as int / float,
        so that e.g. np.float32(0.9) for top_p is taken as vLLM takes it; bools are left to the
        checks, which refuse them."""
        for name in _INT_FIELDS:
            setattr(self, name, _builtin_int(getattr(self, name)))
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value) not in (int, float):
                setattr(self, name, float(value))

    @property
    def greedy(self) -> bool:
        """True when the request decodes with argmax (temperature == 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """True when penalties, a logit bias or min_tokens change the logits (blockdraft.sample.penalties)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def masks_tokens(self) -> bool:
        """True when allowed_token_ids or bad_words remove tokens from the sampled distribution."""
        return self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def max_output_tokens(self) -> int:
        """Output tokens the request may take by its own cap: max_tokens, or 2**63 - 1 for None (the
        engine stops every request at the end of the context, max_model_len, anyway)."""
        return INT64_MAX if self.max_tokens is None else self.max_tokens

    @property
    def resolved_seed(self) -> int:
        """The seed actually used: `seed`, or (None) the random one drawn for this object (at
        construction, or by `for_request` for the copy one request runs with)."""
        return self.seed if self.seed is not None else self._resolved_seed

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's `clone`): changing its stop lists or logit_bias leaves this one as is.
        Its random seed (an unseeded one's) is this one's; a request still draws its own
        (`for_request`)."""
        return copy.deepcopy(self)

    def completions(self) -> list["SamplingParams"]:
        """One SamplingParams (n = 1) per completion of `n`: completion j of a seeded request uses
        (seed + j) mod 2**63 (the choices differ, each stays reproducible, seeds stay in the
        server's JSON range); unseeded ones each draw their own seed. The server's `n` uses it too."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + j) % 2**63)
                for j in range(self.n)]

    def for_request(self, rng: random.Random | None = None) -> "SamplingParams":
        """The params one request runs with: itself when seeded; else a shallow copy with a fresh
        random seed, so requests sharing an unseeded SamplingParams do not share their noise.
        `rng`: where that seed comes from (an engine's seeded stream, `LLM(seed=...)`, makes
        unseeded runs reproducible); None: the operating system's randomness."""
        if self.seed is not None:
            return self
        clone = copy.copy(self)
        clone._resolved_seed = (rng or random.SystemRandom()).randrange(2**31)
        return clone


_INT_FIELDS = ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "min_tokens", "n", "truncate_prompt_tokens")
_REAL_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# the keyword arguments SamplingParams takes: its fields, and vLLM's init-only ones
_INIT_FIELDS = (*(f.name for f in dataclasses.fields(SamplingParams) if f.init), *SAMPLING_VLLM_ONLY)


def _builtin_int(value):
    """`value` as an int when it is a non-builtin integer (numpy, ...), else unchanged."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value) is not int:
        return int(value)
    return value


def check_max_logprobs(max_logprobs) -> None:
    """Raise a param_error about `max_logprobs` (an engine setting) unless it is an int >= 0."""
    _check_int("max_logprobs", max_logprobs, low=0)


def check_logprobs_limit(
    params: SamplingParams,
    max_logprobs: int,
    remedy: str = "build it with a larger LLM(max_logprobs=...) to allow more",
) -> None:
    """Raise a param_error about `logprobs` (or `prompt_logprobs`) when `params` asks for more than
    `max_logprobs` alternatives.

    An engine-level limit, not a SamplingParams one: the same params may suit another engine.
    `remedy`: how the caller's user can raise the limit (or why they cannot), in the message.
    """
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise param_error(name, f"{name} must be <= {max_logprobs} (the engine's max_logprobs; {remedy}), "
                                    f"got {value}")


def _check_int(name: str, value, low: int, what: str | None = None, high: int | None = None) -> None:
    """Raise a param_error about `name` (worded as `what`, default `name`) unless `value` is an int
    >= low (and <= high when given: values the engine puts in int64 tensors)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise param_error(name, f"{what or name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise param_error(name, f"{what or name} must be an integer in [{low}, {'2**63 - 1' if high == INT64_MAX else high}], "
                                f"got {value!r}")
