"""StructuredOutputsParams: the constraint one request's output must follow (vLLM's names).

Plain data checked at construction; blockdraft.structured.grammar compiles it (llguidance) when an
engine takes the request, and that is where a bad regex, schema or grammar is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from blockdraft.errors import check_unicode_texts, param_error

# the fields that name a constraint; exactly one is set (json_object counts when True)
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's StructuredOutputsParams; its `guidance` backend's semantics).

    Exactly one of:
        json: a JSON Schema (a dict, or its JSON text): the output is one JSON value valid under it.
        regex: the output matches this regular expression as a whole (Rust `regex` syntax).
        choice: the output is exactly one of these strings (non-empty list).
        grammar: a context-free grammar: llguidance's Lark syntax, or GBNF / EBNF as llama.cpp and
            vLLM's examples write it (`root ::= ...`).
        json_object: True: the output is any JSON object (OpenAI's response_format json_object).
        structural_tag: vLLM's structural tag (a dict or its JSON text): {"triggers": [str, ...],
            "structures": [{"begin": str, "schema": JSON Schema, "end": str}, ...]}: free text, in
            which each structure that a trigger starts follows its schema up to its end string.
    Options (JSON only): disable_any_whitespace: no whitespace between JSON tokens (default: any
    JSON whitespace). disable_additional_properties: None (default) or True: objects whose schema
    lists `properties` take no others unless the schema says so (`additionalProperties`), as vLLM's
    default backend (xgrammar, strict mode) generates them; False: JSON Schema's own default, other
    properties allowed (vLLM's guidance backend; small models then tend to add keys until
    max_tokens). whitespace_pattern: a regex for the whitespace allowed between JSON tokens instead. disable_fallback: accepted as in
    vLLM; there is one backend (llguidance), so nothing ever falls back.

    Raises:
        ValueError: none or several constraints, or a field of the wrong type (names the field).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check the fields (raises ValueError naming the field); JSON text is parsed here."""
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise param_error("structured_outputs", f"structured_outputs must set exactly one of "
                                                    f"{', '.join(CONSTRAINT_FIELDS)}; got {given or 'none'}")
        for name in ("json", "structural_tag", "regex", "grammar", "whitespace_pattern", "choice"):
            # llguidance's own error for a lone surrogate is codec text (or a parse error)
            check_unicode_texts(getattr(self, name), f"structured_outputs.{name}", param=name)
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise param_error(name, f"structured_outputs.{name} is not valid JSON ({e}): {value[:80]!r}") from None
                except RecursionError:
                    raise param_error(name, f"structured_outputs.{name} is nested too deeply") from None
                if not isinstance(parsed, dict):
                    raise param_error(name, f"structured_outputs.{name} must be a JSON object, got {value[:80]!r}")
                check_unicode_texts(parsed, f"structured_outputs.{name}", param=name)  # a "\\ud800" escape
            elif value is not None and not isinstance(value, dict):
                raise param_error(name, f"structured_outputs.{name} must be a dict or its JSON text, got "
                                        f"{type(value).__name__} {value!r:.80}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise param_error(name, f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise param_error("choice", f"structured_outputs.choice must be a non-empty list of non-empty "
                                            f"strings, got {self.choice!r:.80}")
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise param_error(name, f"structured_outputs.{name} must be a boolean (true or false), got {value!r}")

    @property
    def closes_objects(self) -> bool:
        """Whether JSON objects that list properties take no others (disable_additional_properties
        None or True)."""
        return self.disable_additional_properties is not False

    @property
    def kind(self) -> str:
        """The constraint's field name ("json", "regex", "choice", "grammar", "json_object" or
        "structural_tag")."""
        return next(f for f in CONSTRAINT_FIELDS if getattr(self, f) not in (None, False))

    def key(self) -> str:
        """A string equal for equal constraints (the compile cache's key).

        Raises:
            ValueError: a JSON value nested too deeply to serialise (Python's recursion limit).
        """
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        try:
            return json.dumps(fields, sort_keys=True, default=str)
        except RecursionError:
            raise param_error(self.kind, f"structured_outputs.{self.kind} is nested too deeply") from None


def structured_outputs_from_json(text: str) -> StructuredOutputsParams:
    """StructuredOutputsParams from a JSON object with its field names (the CLI's --structured-outputs,
    the server's `structured_outputs`), e.g. '{"choice": ["yes", "no"]}'.

    Raises:
        ValueError: not JSON, not an object, an unknown field (names it and the fields allowed),
            or as StructuredOutputsParams.
    """
    try:
        fields = json.loads(text)
    except RecursionError:
        raise param_error("structured_outputs", "structured_outputs is nested too deeply") from None
    except ValueError as e:
        raise param_error("structured_outputs", f"structured_outputs is not valid JSON ({e}): {text[:80]!r}") from None
    if not isinstance(fields, dict):
        raise param_error("structured_outputs", f"structured_outputs must be a JSON object such as "
                                                f"'{{\"choice\": [\"yes\", \"no\"]}}', got {text[:80]!r}")
    unknown = sorted(set(fields) - set(StructuredOutputsParams.__dataclass_fields__))
    if unknown:
        raise param_error("structured_outputs", f"structured_outputs has unknown field(s) {unknown}; allowed: "
                                                f"{', '.join(StructuredOutputsParams.__dataclass_fields__)}")
    return StructuredOutputsParams(**fields)
