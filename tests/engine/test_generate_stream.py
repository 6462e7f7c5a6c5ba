"""`LLM.generate_stream` and `blockdraft generate --stream`: the answer step by step, the same
tokens as `generate` (plain and DFlash, greedy and seeded sampling); closing early aborts the
request; bad input refused before anything is queued."""

from __future__ import annotations

import pytest

import blockdraft.llm
from blockdraft.cli import main
from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from tests.server.tiny_model import word, write_tiny_model_and_drafter

# Greedy from this raw prompt the tiny model emits a run the tiny drafter proposes: drafts accepted.
PROMPT = word(17)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model_and_drafter(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("with_draft", [False, True])
def test_the_stream_grows_step_by_step_to_what_generate_gives(tiny, with_draft, temperature):
    model, drafter = tiny
    llm = LLM(model=str(model), draft=str(drafter) if with_draft else None)
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True)
    want = llm.generate(PROMPT, params)[0]
    outs = list(llm.generate_stream(PROMPT, params))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].token_ids == want.token_ids and outs[-1].text == want.text
    assert len(outs) > 1 and not llm.engine.has_unfinished_requests()
    for before, after in zip(outs, outs[1:]):  # cumulative: each output extends the one before
        assert after.token_ids[: len(before.token_ids)] == before.token_ids and after.text.startswith(before.text)
        assert len(after.token_ids) > len(before.token_ids)
    if with_draft and temperature == 0.0:  # several tokens in one step: the verify step's accepted drafts
        assert outs[-1].spec.num_accepted_tokens > 0 and len(outs) < len(want.token_ids)


def test_closing_the_stream_early_aborts_the_request(tiny):
    llm = LLM(model=str(tiny[0]))
    stream = llm.generate_stream(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    first = next(stream)
    stream.close()
    assert not first.finished and not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPT, SamplingParams(max_tokens=4))[0].finished  # the engine goes on


def test_a_stream_never_iterated_queues_nothing(tiny):
    """A generate_stream result dropped unread (never next()) left its request queued: the next
    generate ran it too. Now the request is added at the first next()."""
    llm = LLM(model=str(tiny[0]))
    stream = llm.generate_stream(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()
    del stream
    assert not llm.engine.has_unfinished_requests()


def test_bad_stream_input_is_refused_before_anything_is_queued(tiny):
    llm = LLM(model=str(tiny[0]))
    with pytest.raises(ValueError, match=r"generate_stream takes one prompt .* got 2; use generate for a batch"):
        llm.generate_stream([PROMPT, PROMPT])
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, got dict"):
        llm.generate_stream(PROMPT, {"max_tokens": 3})
    with pytest.raises(ValueError, match="empty"):
        llm.generate_stream("")
    assert not llm.engine.has_unfinished_requests()


def test_cli_stream_prints_the_same_answer(tiny, capsys, monkeypatch):
    model, drafter = tiny
    base = ["generate", PROMPT, "--raw", "--model", str(model), "--draft", str(drafter), "--max-tokens", "16"]
    assert main([*base, "--no-stream"]) == 0
    whole = capsys.readouterr().out
    monkeypatch.setattr(blockdraft.llm.LLM, "generate", lambda *a, **k: pytest.fail("--stream called generate"))
    assert main([*base, "--stream"]) == 0
    assert capsys.readouterr().out == whole and whole.strip()
    assert main([*base, "--stream", "--json"]) == 2
    assert "--stream prints the answer as it grows, --json one object at the end" in capsys.readouterr().err


@pytest.mark.parametrize("with_draft", [False, True])
def test_the_stream_under_async_scheduling(tiny, with_draft):
    """The CUDA path's step pipelining (run here eagerly on the CPU): a step launched ahead while
    the last is read back changes neither the tokens nor the abort on an early close."""
    model, drafter = tiny
    llm = LLM(model=str(model), draft=str(drafter) if with_draft else None, attention_backend="dense",
              graph_mode="eager", max_num_seqs=8, async_scheduling=True)
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
    want = llm.generate(PROMPT, params)[0]
    outs = list(llm.generate_stream(PROMPT, params))
    assert outs[-1].finished and outs[-1].token_ids == want.token_ids and len(outs) > 1
    assert llm.engine.stats.num_async_steps > 0  # steps were pipelined
    stream = llm.generate_stream(PROMPT, params)
    next(stream), next(stream)
    stream.close()  # a step may be in flight: aborted with the request
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPT, params)[0].token_ids == want.token_ids
