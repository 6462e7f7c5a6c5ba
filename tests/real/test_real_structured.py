"""Structured outputs on the real Qwen model with its shipped drafter: a JSON Schema, a regex, a
choice and any JSON object, greedy and seeded, in one batch: the answers follow their constraints,
end when the grammar does, and speculative decoding gives plain decoding's tokens."""

import json
import re

import pytest

from blockdraft import SamplingParams, StructuredOutputsParams as SO
from blockdraft.llm import LLM, load_target

pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-0.5b-instruct"
PERSON = {"type": "object", "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
EMAIL = r"[a-z]+\.[a-z]+@[a-z]+\.com"
REQUESTS = [
    ("Describe a fictional programmer as JSON with name, age and languages.", SO(json=PERSON)),
    ("Give an example email address for Ada Lovelace.", SO(regex=EMAIL)),
    ("Is Python dynamically typed? Answer yes or no.", SO(choice=["yes", "no"])),
    ("Give the three primary colours as a JSON object.", SO(json_object=True)),
]


@pytest.fixture(scope="module")
def engines():
    target = load_target(NAME, "bfloat16")
    return LLM(target=target, draft="auto", dtype="bfloat16"), LLM(target=target, dtype="bfloat16")


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded-T0.8"])
def test_constrained_answers_follow_their_constraint_and_speculation_changes_nothing(engines, temperature):
    spec, plain = engines
    prompts = [[{"role": "user", "content": text}] for text, _ in REQUESTS]
    params = [SamplingParams(max_tokens=96, temperature=temperature, seed=i, structured_outputs=so)
              for i, (_, so) in enumerate(REQUESTS)]
    want = plain.chat(prompts, params)
    got = spec.chat(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sum(o.spec.num_accepted_tokens for o in got) > 0  # drafts were accepted
    person, email, answer, colours = (o.outputs[0] for o in want)
    assert all(o.finish_reason == "stop" for o in (person, email, answer, colours)), [o.text for o in want]
    value = json.loads(person.text)
    assert set(value) == {"name", "age", "languages"} and isinstance(value["age"], int)
    assert re.fullmatch(EMAIL, email.text) and answer.text in ("yes", "no")
    assert isinstance(json.loads(colours.text), dict)
    # the answer ends with the grammar: no EOS token sampled after the closing brace
    assert person.token_ids[-1] not in spec.engine.eos_token_ids
