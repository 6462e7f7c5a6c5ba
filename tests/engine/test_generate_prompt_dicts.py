"""vLLM's prompt dicts in LLM.generate: {"prompt": text} (TextPrompt) and {"prompt_token_ids": ids}
(TokensPrompt), alone or in a list, mixed with strings, token-id lists and conversations; a dict
is read by its keys ("role": a chat message, "prompt" / "prompt_token_ids": a prompt)."""

from __future__ import annotations

import pytest

from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from tests.server.tiny_model import write_tiny_model

TEXT = "w05x w17x w30x"
CONV = [{"role": "user", "content": "w05x w17x"}]
PARAMS = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(model=str(write_tiny_model(tmp_path_factory.mktemp("prompt_dicts") / "model")))


def _ids(outs):
    return [(o.prompt_token_ids, o.token_ids) for o in outs]


def test_text_and_tokens_prompts_give_what_their_plain_forms_give(llm):
    ids = llm.tokenizer.encode(TEXT)
    ref = llm.generate([TEXT, ids, CONV], PARAMS)
    mixed = llm.generate([{"prompt": TEXT}, {"prompt_token_ids": ids}, CONV], PARAMS)
    assert _ids(mixed) == _ids(ref)
    assert [o.prompt_token_ids for o in ref] == [ids, ids, llm.encode_chat(CONV)]
    # any order, plain forms among them
    assert _ids(llm.generate([CONV, {"prompt": TEXT}, TEXT], PARAMS)) == _ids([ref[2], ref[0], ref[0]])


def test_one_prompt_dict_alone_or_in_a_list(llm):
    ids = llm.tokenizer.encode(TEXT)
    ref = _ids(llm.generate(TEXT, PARAMS))
    for prompts in ({"prompt": TEXT}, [{"prompt": TEXT}], {"prompt_token_ids": ids}, ({"prompt_token_ids": tuple(ids)},)):
        assert _ids(llm.generate(prompts, PARAMS)) == ref, prompts
    streamed = list(llm.generate_stream({"prompt": TEXT}, PARAMS))
    assert (streamed[-1].prompt_token_ids, streamed[-1].token_ids) == ref[0]


def test_the_trial_prompt_runs(llm):
    """The fresh-user trial's call, which read the list as one conversation ("no 'content'")."""
    out = llm.generate([{"prompt": "w05x"}], PARAMS)
    assert len(out) == 1 and out[0].num_output_tokens == 4


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([{"prompt": TEXT, "multi_modal_data": {}}],
         r"prompt 0 is a dict with keys \['prompt', 'multi_modal_data'\]: \['multi_modal_data'\] not supported "
         r"\(text-only prompts\); a prompt dict has exactly one of \['prompt', 'prompt_token_ids'\]; a chat message has "
         r"\['role', 'content', 'name', 'tool_calls', 'tool_call_id'\]"),
        ([{"prompt": TEXT, "role": "user"}],
         r"prompt 0 is a dict with keys \['prompt', 'role'\], both prompt and chat-message keys: a prompt dict"),
        ([{"text": TEXT}], r"prompt 0 is a dict with keys \['text'\], neither a prompt nor a chat message: a prompt dict"),
        ([TEXT, {}], r"prompt 1 is a dict with keys \[\], neither a prompt nor a chat message"),
        ({"multi_modal_data": {}}, r"prompts is a dict with keys \['multi_modal_data'\], neither"),
        ([{"prompt": TEXT, "prompt_token_ids": [5]}], r"give 'prompt' \(text\) or 'prompt_token_ids', not both"),
        ([{"prompt": [5, 6]}], r"prompt 0: 'prompt' must be a str, got list \[5, 6\]; token ids go in 'prompt_token_ids'"),
        ([{"prompt": ""}], r"prompt 0 is empty: give a non-empty string"),
        ([TEXT, {"prompt_token_ids": []}], r"prompt 1 is empty: give at least one token id"),
        ([{"prompt_token_ids": [5, 2.0]}], r"prompt 0: token 1 must be an integer token id, got float 2.0"),
        ([{"prompt_token_ids": "w05x"}], r"prompt 0: 'prompt_token_ids' must be a list of token ids, got str 'w05x'"),
        # a chat message among prompts: a conversation is a list of messages
        ([{"prompt": TEXT}, CONV[0]], r"prompt 1 is a single chat message .*: a conversation is a list of messages"),
        (CONV[0], r"prompts is a single chat message .*: a conversation is a list of messages, so give \[message"),
        # a prompt dict inside a conversation is a bad message
        ([CONV[0], {"prompt": TEXT}], r"chat message 1 has keys \['prompt'\] that are not supported; a message's "
                                      r"keys are 'role', 'content', 'name'"),
    ],
)
def test_bad_dicts_are_refused_naming_their_keys(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, PARAMS)
    assert not llm.engine.has_unfinished_requests()


def test_output_prompt_is_the_text_given_as_vllm(llm):
    """vLLM scripts print `output.prompt`: the text given, a conversation's template text, None for ids."""
    ids = llm.tokenizer.encode(TEXT)
    outs = llm.generate([TEXT, {"prompt": TEXT}, ids, {"prompt_token_ids": ids}, CONV], PARAMS)
    assert [o.prompt for o in outs[:4]] == [TEXT, TEXT, None, None]
    assert outs[4].prompt == llm.tokenizer.decode(llm.encode_chat(CONV)) and "w05x w17x" in outs[4].prompt
    assert llm.chat(CONV, PARAMS)[0].prompt == outs[4].prompt


def test_engine_checks_in_a_batch_name_the_prompt(llm):
    """The checks the engine runs on a whole batch (vocabulary, context) say which prompt failed."""
    ids = llm.tokenizer.encode(TEXT)
    vocab, context = llm.engine.vocab_size, llm.engine.max_model_len
    with pytest.raises(ValueError, match=rf"^prompt 2 has token id -3, outside the vocabulary \[0, {vocab}\)"):
        llm.generate([TEXT, ids, [5, -3]], PARAMS)
    with pytest.raises(ValueError, match=rf"^prompt 1 has {context} tokens but the engine's context"):
        llm.generate([TEXT, [5] * context], PARAMS)
    with pytest.raises(ValueError, match=r"^prompt has token id -3"):  # one prompt: nothing to name
        llm.generate([[5, -3]], PARAMS)
    with pytest.raises(ValueError, match=r"^prompt 1: logit_bias has token id") as e:
        llm.generate([TEXT, TEXT], [PARAMS, SamplingParams(max_tokens=4, logit_bias={vocab: 1.0})])
    assert e.value.param == "logit_bias"  # the field too, for a server's 400
    limit = llm.engine.max_logprobs  # a field's error names the field and its value, not the prompt
    with pytest.raises(ValueError, match=rf"^logprobs must be <= {limit}") as e:
        llm.generate([TEXT, TEXT], [PARAMS, SamplingParams(max_tokens=4, logprobs=limit + 1)])
    assert e.value.param == "logprobs"
    assert not llm.engine.has_unfinished_requests()
