"""LLM(max_model_len=N), vLLM's context length: N when the model and the KV pool hold it, else an
error naming the limit and the knob, before any weights load; None keeps the model's length
capped by the pool."""

import pytest

from blockdraft.config import resolve_max_model_len
from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=5)  # max_position_embeddings 512


@pytest.mark.parametrize("opts", [{}, dict(attention_backend="dense", graph_mode="eager")])
def test_an_explicit_context_is_used_and_refused_beyond(target, opts):
    """Eager steps, and the CUDA-graph code run eagerly (its block table is max_model_len wide)."""
    llm = make_llm(target, max_model_len=100, **opts)  # the pool holds 256 x 4 tokens
    assert llm.engine.max_model_len == 100
    out = llm.generate([[1] * 90], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    with pytest.raises(ValueError, match="100 tokens but the engine's context is 100 tokens .*at most 99 prompt "
                                         "tokens .*shorten the prompt or raise max_model_len .*--max-model-len"):
        llm.generate([[1] * 100])


def test_the_default_is_the_models_length_capped_by_the_pool(target):
    assert make_llm(target).engine.max_model_len == 512
    assert make_llm(target, num_kv_blocks=16).engine.max_model_len == 64


def test_a_context_the_model_or_the_pool_cannot_hold_is_refused_before_the_weights_load(target, monkeypatch):
    import blockdraft.model_loader

    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match=r"^max_model_len 600 is above the model's context of 512 tokens "
                                         r"\(max_position_embeddings in its config.json\): give at most 512") as e:
        make_llm(target, max_model_len=600)
    assert e.value.param == "max_model_len"
    with pytest.raises(ValueError, match=r"^max_model_len 100 does not fit the KV pool of 16 pages x 4 tokens = 64 "
                                         r"tokens, and one request must fit it: raise num_kv_blocks \(--num-kv-blocks\) "
                                         r"to at least 25, or lower max_model_len$"):
        make_llm(target, num_kv_blocks=16, max_model_len=100)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match=f"max_model_len must be None or an integer >= 1 \\(tokens\\), got {bad!r}"):
            make_llm(target, max_model_len=bad)


def test_the_cpu_default_pool_grows_to_hold_an_explicit_context():
    """`generate` has no pool flag: on the CPU, without num_kv_blocks, the 1024-page default grows."""
    from blockdraft.llm import LLM

    long = tiny_target("llama", seed=5, max_position_embeddings=8192)
    assert LLM(target=long, kv_block_size=4).engine.max_model_len == 4096  # 1024 x 4: capped by the pool
    llm = LLM(target=long, kv_block_size=4, max_model_len=6000)
    assert llm.engine.max_model_len == 6000 and llm.engine.scheduler.kv.num_blocks == 1500


def test_a_pool_sized_from_gpu_memory_names_gpu_memory_utilization():
    with pytest.raises(ValueError, match=r"raise gpu_memory_utilization \(--gpu-memory-utilization\), which sized it"):
        resolve_max_model_len(4096, 32768, 100, 16, pool_from_memory=True)
    assert resolve_max_model_len(None, 32768, 1024, 16) == 16384
    assert resolve_max_model_len(None, 32768, None, 16) == 32768  # not sized yet: the model's


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("bad", ["0", "-3"])
def test_cli_refuses_a_bad_context_in_cli_words(capsys, command, bad):
    """The flag's message does not offer None (Python wording); refused before the model loads."""
    from blockdraft.cli import main

    argv = [command, *(["hi"] if command == "generate" else []), "--model", "/nonexistent-model", "--max-model-len", bad]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: max_model_len (--max-model-len) must be an integer >= 1 (tokens), got {bad}\n" in err, err
    assert "None" not in err and "nonexistent" not in err, err


def test_a_prompt_over_a_context_the_pool_caps_names_the_pool(llama_target):
    """A pool smaller than the model's positions caps max_model_len: raising max_model_len cannot
    help, so the error names the pool's knobs instead."""
    llm = make_llm(llama_target, num_kv_blocks=2, kv_block_size=16)  # 32 tokens
    with pytest.raises(ValueError, match=r"context is 32 tokens .*enlarge the KV pool, whose 2 pages x 16 tokens "
                                         r"cap the context \(num_kv_blocks"):
        llm.generate([list(range(1, 41))], SamplingParams(max_tokens=4))


def test_max_tokens_none_runs_to_the_end_of_the_context(target):
    """SamplingParams(max_tokens=None), vLLM's None: no cap of the request's own; the context
    (max_model_len) ends it with finish_reason "length"; min_tokens has no max_tokens to exceed."""
    llm = make_llm(target, max_model_len=100)
    outs = llm.generate([[1] * 90, [2] * 97], SamplingParams(max_tokens=None, ignore_eos=True, min_tokens=5))
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", 10), ("length", 3)]
    assert SamplingParams(max_tokens=None).max_output_tokens == 2**63 - 1
    assert SamplingParams(max_tokens=7).max_output_tokens == 7
    with pytest.raises(ValueError, match=r"^max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_a_prompt_over_the_models_whole_context_is_not_told_to_raise_max_model_len(target):
    """At the model's own length, raising max_model_len is refused: the error says to shorten the
    prompt or truncate it (a trial was told to raise it, which `generate` then refused)."""
    llm = make_llm(target)  # 512: the model's max_position_embeddings, within the pool
    with pytest.raises(ValueError, match=r"prompt has 600 tokens but the engine's context is 512 tokens .*: shorten "
                                         r"the prompt: this is the model's whole context \(max_position_embeddings in "
                                         r"its config.json\); truncate_prompt_tokens=N") as e:
        llm.generate([[1] * 600])
    assert "raise max_model_len" not in str(e.value)
