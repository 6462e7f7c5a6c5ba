"""A prompt with a token id outside the vocabulary is refused before anything is queued, and the
LLM keeps working afterwards."""

from __future__ import annotations

import pytest

from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from tests.server.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(model=str(write_tiny_model(tmp_path_factory.mktemp("badids") / "model")))


@pytest.mark.parametrize("bad", [10**9, -5])
def test_bad_prompt_id_is_refused_and_the_llm_still_works(llm, bad):
    params = SamplingParams(max_tokens=3)
    vocab = llm.target.config.vocab_size
    with pytest.raises(ValueError, match=rf"^prompt 1 has token id {bad}, outside the vocabulary \[0, {vocab}\)"):
        llm.generate([[1, 2, 3], [1, bad]], params)  # the good first prompt is not queued either
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], params)
    assert out[0].num_output_tokens == 3


def test_bad_stop_token_id_is_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids has token id"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, stop_token_ids=[10**9]))
    with pytest.raises(ValueError, match=r"logit_bias has token id 96, outside the vocabulary \[0, 96\)"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, logit_bias={3: 1.0, 96: 2.0}))
