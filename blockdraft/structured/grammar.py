"""Grammar-constrained decoding with llguidance: compile a request's constraint once, then give the
token masks of each step's logits rows and advance over the tokens it commits.

Speculative decoding stays lossless under a constraint: row i of a verify step (the target's
token after the first i drafts) is masked with the grammar state after those i drafts, which is
the state plain decoding has there whenever the drafts are accepted; rows past the first draft the
grammar refuses, or past the one that completes it, can never be emitted (that draft is rejected;
the request ends at that token), so their masks do not matter and allow everything. vLLM does the
same (v1 structured_output, `validate_tokens` + rollback).

A request ends as soon as its grammar is complete (llguidance's `is_stopped`: no token but EOS
could follow), with finish_reason "stop": vLLM samples the forced EOS in one more step, so its
token ids end with that EOS and ours do not; the text is the same.

llguidance is imported only when a request asks for a constraint.
"""

from __future__ import annotations

import copy
import json
import re
import threading

import torch

from blockdraft.errors import param_error
from blockdraft.structured.params import StructuredOutputsParams

COMPILE_CACHE_SIZE = 128  # distinct constraints whose compiled grammar an engine keeps


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of the package; a bare checkout may lack it
        raise ImportError("structured outputs need the llguidance package: pip install llguidance") from e
    return llguidance


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of a constraint (vLLM's guidance backend's mapping).

    Raises:
        ValueError: a GBNF grammar that cannot be converted, or a structural tag without
            `structures` / whose begin string no trigger starts (names the field).
    """
    llg = _llguidance()
    kind = params.kind
    if kind in ("json", "json_object"):
        return _json_grammar(params, {"type": "object"} if kind == "json_object" else params.json)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":  # a regex: a Lark rule of N alternatives stops working at llguidance's 2,000 items
        return llg.LLMatcher.grammar_from_regex("|".join(_regex_literal(c) for c in params.choice))
    if kind == "grammar":
        try:
            return llg.grammar_from("grammar", params.grammar)
        except ValueError as e:
            raise param_error("grammar", f"structured_outputs.grammar: {e}") from None
    return _structural_tag_grammar(params)


# the characters that mean something in a (Rust `regex`) pattern; every other one stands for itself
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _json_grammar(params: StructuredOutputsParams, schema) -> str:
    llg = _llguidance()
    if isinstance(schema, str):
        schema = json.loads(schema)
    if params.closes_objects and isinstance(schema, dict):
        schema = copy.deepcopy(schema)
        _close_objects(schema)
    options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.whitespace_pattern is not None:
        options["whitespace_pattern"] = params.whitespace_pattern
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)


# JSON Schema keywords (draft-07 and 2020-12) whose value is one subschema, a map of subschemas, or a
# list of them; every other keyword's value is data (const, enum, default, examples, ...), left as is
_ONE_SCHEMA = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
               "else", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def _close_objects(schema: dict) -> None:
    """additionalProperties: false, in place, on every subschema that lists properties without
    saying, as xgrammar's strict mode (vLLM's default backend) treats them; only schema positions
    are visited (a const or enum value is data, and a property named "properties" a property).
    A schema with allOf, its branches and the $defs a branch $refs stay open: additionalProperties
    sees only its own schema's properties, so closing a branch would refuse the other branches'
    properties (an allOf that splits the properties would become unsatisfiable); the objects nested
    in their properties are closed."""
    _close(schema, _all_of_refs(schema), keep_open=False)


def _close(schema, open_refs: set[str], keep_open: bool) -> None:
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in _ONE_SCHEMA and isinstance(value, dict):
            _close(value, open_refs, keep_open=False)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _close(sub, open_refs, keep_open=f"#/{key}/{name}" in open_refs)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for sub in value:
                _close(sub, open_refs, keep_open=key == "allOf")
    if (not keep_open and "allOf" not in schema and isinstance(schema.get("properties"), dict)
            and "additionalProperties" not in schema):
        schema["additionalProperties"] = False


def _all_of_refs(schema) -> set[str]:
    """The "$ref" values of allOf branches anywhere in `schema` (their $defs stay open)."""
    refs: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            branches = node.get("allOf")
            if isinstance(branches, list):
                refs.update(b["$ref"] for b in branches if isinstance(b, dict) and isinstance(b.get("$ref"), str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return refs


def _structural_tag_grammar(params: StructuredOutputsParams) -> str:
    llg = _llguidance()
    tag = params.structural_tag
    tag = json.loads(tag) if isinstance(tag, str) else tag
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if not isinstance(triggers, list) or not isinstance(structures, list) or not structures:
        raise param_error("structural_tag", "structured_outputs.structural_tag needs a list of `triggers` and a "
                                            "non-empty list of `structures` ({begin, schema, end})")
    if not all(isinstance(t, str) and t for t in triggers):
        raise param_error("structural_tag", f"structural_tag triggers must be non-empty strings, got {triggers!r:.80}")
    tags = []
    for s in structures:
        if (not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys() or not isinstance(s["schema"], dict)
                or not all(isinstance(s[k], str) and s[k] for k in ("begin", "end"))):
            raise param_error("structural_tag", f"each structural_tag structure needs begin and end (non-empty "
                                                f"strings) and schema (an object), got {s!r:.80}")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise param_error("structural_tag", f"structural_tag: no trigger starts the begin string "
                                                f"{s['begin']!r} (triggers {triggers!r:.80})")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=_json_grammar(params, s["schema"]),
                                  end=s["end"]))
    return llg.StructTag.to_grammar(tags)


class GrammarCompiler:
    """Compiles constraints against one model's tokenizer and vocabulary.

    Args:
        tokenizer: the engine's tokenizer: a transformers tokenizer backed by the `tokenizers`
            library (its `backend_tokenizer`), whose decoder llguidance reads (byte-level BPE:
            Qwen, Llama 3, SmolLM2, GPT-2).
        vocab_size: the model's logits width V (>= the tokenizer's; ids past it are never allowed).
        eos_token_ids: the model's end-of-generation ids: allowed wherever the grammar may end.
    Raises:
        ValueError: a tokenizer llguidance cannot read (names why; `.param` "structured_outputs").
    Building the llguidance tokenizer takes ~0.7 s for Qwen's 152K vocabulary: once per engine,
    at the first constrained request.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        llg = _llguidance()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not eos_token_ids:
            raise param_error("structured_outputs", f"structured_outputs need a tokenizer backed by the tokenizers "
                                                    f"library and an EOS id; {type(tokenizer).__name__} has "
                                                    f"{'no backend_tokenizer' if backend is None else 'no EOS id'}")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        try:
            self.ll_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        except ValueError as e:
            raise param_error("structured_outputs", f"structured_outputs cannot use this tokenizer "
                                                    f"({type(tokenizer).__name__}): {e}") from None
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        # StructuredOutputsParams.key() -> a matcher at the start (most recent last); requests get copies
        self._templates: dict[str, object] = {}
        self._lock = threading.Lock()  # a server compiles in a worker thread while the engine thread copies
        self._executor = llg.LLExecutor()  # a step's masks, computed in parallel (fill_bitmasks)

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile (cached; thread-safe) and raise if the constraint is invalid.

        Raises:
            ValueError: naming the constraint's field and llguidance's message (a bad regex,
                schema or grammar).
        """
        self._template(params)

    def matcher(self, params: StructuredOutputsParams, block_eos: bool = False) -> "RequestGrammar":
        """A fresh grammar state for one request: a copy of the compiled one (raises as `check`).
        block_eos: mask the EOS ids while the grammar can go on (SamplingParams.ignore_eos)."""
        return RequestGrammar(self._template(params).deep_copy(), self.vocab_size,
                              self.eos_token_ids if block_eos else (), self._executor)

    def _template(self, params: StructuredOutputsParams):
        """The compiled matcher of `params`, from a cache of the last COMPILE_CACHE_SIZE constraints."""
        key = params.key()
        with self._lock:
            template = self._templates.pop(key, None)
        if template is None:  # compiled outside the lock: a copy for a cached constraint never waits on it
            template = _llguidance().LLMatcher(self.ll_tokenizer, self._checked_source(params), log_level=0)
        with self._lock:
            self._templates[key] = template
            if len(self._templates) > COMPILE_CACHE_SIZE:
                del self._templates[next(iter(self._templates))]
        return template

    def _checked_source(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of `params`, checked against the tokenizer (`checked_source`)."""
        return checked_source(params, self.ll_tokenizer)


def checked_source(params: StructuredOutputsParams, ll_tokenizer=None) -> str:
    """The llguidance grammar (its JSON text) of `params`, checked; an error names the field it
    comes from (whitespace_pattern and structural tags' schemas are checked alone).

    ll_tokenizer: the llguidance.LLTokenizer to check against (GrammarCompiler's); None checks the
    constraint alone (a regex, schema or grammar that does not parse), which needs no model: the
    CLI refuses such a constraint before the model loads, and the engine checks it again.
    Raises:
        ValueError: naming the constraint's field and llguidance's message.
    """
    kind = params.kind
    if params.whitespace_pattern is not None:
        _validate("whitespace_pattern", _llguidance().LLMatcher.grammar_from_regex(params.whitespace_pattern),
                  ll_tokenizer)
    try:
        source = grammar_source(params)
    except RecursionError:  # a schema nested past Python's limit (deepcopy, _close_objects)
        raise param_error(kind, f"structured_outputs.{kind} is nested too deeply") from None
    except (ValueError, TypeError) as e:
        if getattr(e, "param", None):
            raise
        raise param_error(kind, f"structured_outputs.{kind} is invalid: {e}") from None
    if kind == "structural_tag":  # nested grammars are compiled lazily: check each schema now
        tag = params.structural_tag
        for s in (json.loads(tag) if isinstance(tag, str) else tag)["structures"]:
            _validate(kind, _json_grammar(params, s["schema"]), ll_tokenizer, f" (the schema of {s['begin']!r})")
    _validate(kind, source, ll_tokenizer)
    return source


def _validate(field: str, source: str, ll_tokenizer, where: str = "") -> None:
    """Raise a param_error about `field` when llguidance refuses `source` (warnings pass)."""
    error = _llguidance().LLMatcher.validate_grammar(source, ll_tokenizer)
    if error and not error.startswith("WARNING"):
        raise param_error(field, f"structured_outputs.{field}{where} is invalid: {_concise(error)}")


# llguidance's regex errors (a regex, a whitespace_pattern, a JSON schema's "pattern"): the regex
# parser's multi-line report (the pattern, a caret line, "error: ..."), for a regex also an excerpt of
# the Lark source it was wrapped in (`start: /.../`), whose line and column are not the user's.
_REGEX_ERROR = re.compile(r"regex parse error:[ \t]*\n[ \t]*(.*?)\n.*?^error: (.*?)$", re.S | re.M)


def _concise(error: str) -> str:
    """llguidance's message about a refused grammar, as one line where it is a regex's: 'invalid
    regex "[a-": unclosed character class'; other messages as given, trailing whitespace cut."""
    m = _REGEX_ERROR.search(error)
    return f'invalid regex "{m.group(1)}": {m.group(2).strip()}' if m else error.rstrip()


class RequestGrammar:
    """One request's grammar state (an llguidance matcher) over its committed output tokens.

    Args:
        matcher: llguidance.LLMatcher at the start of the output.
        vocab_size: V, the logits width its masks cover.
        blocked_eos: EOS ids masked while the grammar is not complete (a request with ignore_eos:
            it then runs until its grammar allows nothing but EOS, instead of sampling an EOS the
            grammar would end on); () for none.
        executor: the llguidance.LLExecutor that `fill_bitmasks` computes a step's masks on, or
            None (one by one).
    """

    def __init__(self, matcher, vocab_size: int, blocked_eos: tuple[int, ...] = (), executor=None) -> None:
        self.matcher, self.vocab_size, self.blocked_eos = matcher, vocab_size, blocked_eos
        self.executor = executor  # llguidance.LLExecutor shared by the engine's requests, or None

    def fill_bitmask(self, out: torch.Tensor, drafts: list[int]) -> None:
        """Write the masks of one sampling request's logits rows.

        Args:
            out: [len(drafts) + 1, ceil(V / 32)] int32, contiguous, on the CPU: row i gets the
                tokens allowed after the committed output and drafts[:i] (bit t % 32 of word
                t // 32 set = token t allowed; llguidance's layout); rows after the first draft the
                grammar refuses, or after the one that completes it, get all bits set (never
                emitted: the request ends at that token), as llguidance's executor leaves them.
            drafts: the K drafts this step verifies (0 for a plain decode row).
        The matcher ends where it started (the drafts are rolled back).
        """
        m = self.matcher
        valid = m.validate_tokens(drafts) if drafts else 0
        self._fill_row(out, 0)
        consumed = 0
        for i in range(valid):
            if m.is_stopped():  # the request ends at the token that completed it: no later row is emitted
                break
            m.consume_token(drafts[i])
            consumed += 1
            self._fill_row(out, i + 1)
        if consumed:
            m.rollback(consumed)
        out[consumed + 1:] = -1

    def _fill_row(self, out: torch.Tensor, row: int) -> None:
        view = out[row]
        self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        if self.blocked_eos and not self.matcher.is_stopped():
            for t in self.blocked_eos:  # clear bit t % 32 of word t // 32 (as an int32: bit 31 is the sign)
                bit = t % 32
                view[t // 32] &= ~(1 << bit) if bit < 31 else 2**31 - 1

    def steer_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts with each one the grammar forces put in its place (SGLang's jump-forward
        tokens, as drafts): along the drafts the grammar accepts, a position where it forces text
        gets llguidance's canonical token for it (compute_ff_tokens). The output is unchanged
        whatever the drafts (verification decides); acceptance usually grows (the bench's tasks:
        2.89 -> 3.11, docs/benchmarks/structured-cpu.md), though the mask may also allow another
        tokenization of the forced text, which the replaced draft may have been. Stops at the
        first draft the grammar refuses or at the grammar's end; the matcher ends where it started.

        drafts: the K proposed drafts (token ids) -> K token ids.
        """
        m, out, consumed = self.matcher, list(drafts), 0
        for i, draft in enumerate(out):
            if m.is_stopped():
                break
            forced = m.compute_ff_tokens()
            token = forced[0] if forced else draft
            if m.validate_tokens([token]) != 1:
                break
            m.consume_token(token)
            consumed += 1
            out[i] = token
        if consumed:
            m.rollback(consumed)
        return out

    def advance(self, tokens: list[int]) -> tuple[int, bool]:
        """Commit output tokens, up to the one that completes the grammar.

        Returns:
            (n, complete): tokens[:n] were committed; complete: the grammar then allows nothing
            but EOS (the request ends after tokens[n - 1]). n < len(tokens) and not complete:
            tokens[n] broke the grammar (a step that sampled from a row with no token allowed,
            e.g. every allowed token masked by min_tokens); the request should end.
        """
        m = self.matcher
        for n, token in enumerate(tokens):
            if not m.consume_token(token):
                return n, False
            if m.is_stopped():
                return n + 1, True
        return len(tokens), False

    @property
    def error(self) -> str:
        """llguidance's error message once the grammar is broken, else ""."""
        return self.matcher.get_error()


def fill_bitmasks(items: list[tuple[RequestGrammar, int, list[int]]], bitmask: torch.Tensor) -> None:
    """Write the masks of a step's constrained requests: RequestGrammar.fill_bitmask for each, the
    masks of requests without blocked EOS ids computed in parallel threads (llguidance's
    executor, the same masks; a batch of 32 requests at K = 5 took ~2 ms one by one on the CPU,
    where a GPU step may take ~3 ms).

    Args:
        items: (grammar, first row, drafts) per request: its rows are first .. first + len(drafts).
        bitmask: [R, ceil(V / 32)] int32, contiguous, on the CPU, every row -1 on entry (rows after
            a draft the grammar refuses are left so).
    """
    parallel = [item for item in items if not item[0].blocked_eos and item[0].executor is not None]
    for g, first, drafts in items:
        if g.blocked_eos or g.executor is None:
            g.fill_bitmask(bitmask[first:first + len(drafts) + 1], drafts)
    if not parallel:
        return
    executor, row_bytes = parallel[0][0].executor, bitmask.shape[1] * bitmask.element_size()
    drafting = [(g.matcher, first, drafts) for g, first, drafts in parallel if drafts]
    decoding = [(g.matcher, first) for g, first, drafts in parallel if not drafts]  # the executor wants drafts there
    if drafting:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafting, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
    if decoding:
        executor.unsafe_compute_mask_ptr(decoding, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
