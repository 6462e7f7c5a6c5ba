"""speculative_disable_by_batch_size (vLLM's disable_by_batch_size): eager steps of N or more
requests decode without drafts, the drafter still reads their context, and the output stays plain
decoding's."""

import pytest
import torch

from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import make_llm, random_prompts


def _speculator(target, k=3):
    drafter = random_drafter(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), seed=k, init_std=0.1)
    return DFlashSpeculator(drafter, target.model, k, 256, 4)


def _mix(n=6):
    """Different lengths (4..40), greedy and seeded sampled requests."""
    return [SamplingParams(max_tokens=4 + 36 * i // (n - 1), ignore_eos=True, temperature=0.8 if i % 2 else 0.0,
                           seed=i) for i in range(n)]


def _record_calls(spec):
    """Wrap propose / write_context: propose's request counts, and the row counts of
    write_context calls made outside propose (the steps without drafts)."""
    calls = {"propose": [], "context_only": []}
    propose, write = spec.propose, spec.write_context
    inside = []

    def recording_propose(features, positions, slot_mapping, bonus_tokens, *args, **kw):
        calls["propose"].append(bonus_tokens.shape[0])
        inside.append(True)
        try:
            return propose(features, positions, slot_mapping, bonus_tokens, *args, **kw)
        finally:
            inside.pop()

    def recording_write(features, positions, slot_mapping):
        if not inside:
            calls["context_only"].append((positions.shape[0], int((slot_mapping >= 0).sum())))
        return write(features, positions, slot_mapping)

    spec.propose, spec.write_context = recording_propose, recording_write
    return calls


def test_lossless_and_no_drafts_at_or_above_n(llama_target):
    prompts, params = random_prompts(6, seed=80), _mix()
    plain = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    always = make_llm(llama_target, speculator=_speculator(llama_target))
    assert [o.token_ids for o in always.generate(prompts, params)] == plain
    spec = _speculator(llama_target)
    calls = _record_calls(spec)
    llm = make_llm(llama_target, speculator=spec, speculative_disable_by_batch_size=3)
    assert llm.engine.runner.disable_by_batch_size == 3
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    # the rule: drafts only for steps of fewer than 3 requests; the last requests ran below 3
    assert calls["propose"] and max(calls["propose"]) < 3, calls["propose"]
    assert calls["context_only"], "steps of 3 or more requests wrote the drafter's context"
    assert all(written > 0 for _, written in calls["context_only"])
    drafted = llm.engine.stats.spec.num_drafted_tokens
    assert 0 < drafted < always.engine.stats.spec.num_drafted_tokens


def _draft_context(llm, prompt, max_tokens, disabled_steps):
    """Decode one request, without drafts for its first `disabled_steps` steps (N = 1), then with
    them -> (its tokens, the draft cache's K/V rows of its positions 0..num_tokens - 2)."""
    engine, spec, bs = llm.engine, llm.speculator, 4
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    req, block_ids, steps, out = engine._requests["r"], [], 0, None
    while engine.has_unfinished_requests():
        engine.runner.disable_by_batch_size = 1 if steps < disabled_steps else None
        for o in engine.step(stream=False):
            out = o
        steps += 1
        block_ids = list(req.block_ids) or block_ids
    n = min(len(prompt) + max_tokens - 1, len(block_ids) * bs)
    slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(n)])
    rows = [c.flatten(0, 1)[slots].clone() for layer in spec.kv_caches for c in layer]
    return out.token_ids, rows, n


def test_drafter_context_is_complete_after_steps_without_drafts(llama_target):
    """A request decoded first without drafts, then with them, leaves the same draft-cache rows
    as one that always drafted: the steps without drafts wrote their context."""
    prompt = random_prompts(1, seed=81)[0]
    ref = make_llm(llama_target, speculator=_speculator(llama_target))
    tokens, rows, n = _draft_context(ref, prompt, 24, 0)
    llm = make_llm(llama_target, speculator=_speculator(llama_target), speculative_disable_by_batch_size=1)
    calls = _record_calls(llm.speculator)
    got_tokens, got_rows, got_n = _draft_context(llm, prompt, 24, 6)
    assert got_tokens == tokens and got_n == n and n > len(prompt) + 5
    assert len(calls["context_only"]) == 6 and calls["propose"]  # 6 steps without drafts, then drafting
    for a, b in zip(got_rows, rows):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert 0 < llm.engine.stats.spec.num_drafted_tokens < ref.engine.stats.spec.num_drafted_tokens


@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_bad_values_are_refused_naming_them(llama_target, value):
    with pytest.raises(ValueError, match=rf"speculative_disable_by_batch_size must be None or an integer >= 1 "
                                         rf"\(requests per step\), got {value!r}$"):
        make_llm(llama_target, speculator=_speculator(llama_target), speculative_disable_by_batch_size=value)


def test_needs_a_drafter(llama_target):
    with pytest.raises(ValueError, match=r"speculative_disable_by_batch_size needs a drafter \(got 3\)"):
        make_llm(llama_target, speculative_disable_by_batch_size=3)


def test_refused_where_decode_steps_run_graph_code(llama_target):
    with pytest.raises(ValueError, match=r"speculative_disable_by_batch_size works on eager steps only \(got 2\).*graph mode 'eager'.*"
                                         r"enforce_eager=True \(--enforce-eager\)"):
        make_llm(llama_target, speculator=_speculator(llama_target), speculative_disable_by_batch_size=2,
                 attention_backend="dense", graph_mode="eager")


def test_cli_flag_checks(capsys):
    from blockdraft.cli import _parser, main
    from blockdraft.drafters import check_draft_flags

    for command in ("generate", "serve"):
        args = _parser().parse_args([command, *(["p"] if command == "generate" else []),
                                     "--speculative-disable-by-batch-size", "4"])
        assert args.speculative_disable_by_batch_size == 4
    with pytest.raises(ValueError, match="--speculative-disable-by-batch-size 4 needs a drafter; drop --no-draft"):
        check_draft_flags(None, True, None, None, 4)
    with pytest.raises(ValueError, match="integer >= 1.*got 0"):
        check_draft_flags(None, False, None, None, 0)
    # refused before the model loads, naming the flag
    for argv in (["generate", "hi"], ["serve"]):
        assert main([*argv, "--model", "/nonexistent-model", "--speculative-disable-by-batch-size", "0"]) == 2
        err = capsys.readouterr().err
        assert "speculative_disable_by_batch_size (--speculative-disable-by-batch-size) must be an integer " \
               ">= 1 (requests per step), got 0" in err and "nonexistent" not in err, err


def test_cli_generate_with_the_flag(tmp_path, capsys):
    """`blockdraft generate --draft PATH --speculative-disable-by-batch-size N` reaches the runner:
    N = 1 decodes its one request without drafts, N = 2 drafts; the same tokens either way. A
    folder model with --draft auto decodes plainly: nothing to disable, no error."""
    import json

    from blockdraft.cli import main
    from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    drafter = write_tiny_drafter(tmp_path / "drafter", model)
    base = ["generate", "w05x w06x", "--model", str(model), "--max-tokens", "8", "--json", "--raw"]
    runs = {}
    for n in ("1", "2"):
        assert main([*base, "--draft", str(drafter), "--speculative-disable-by-batch-size", n]) == 0
        runs[n] = json.loads(capsys.readouterr().out)
    assert runs["1"]["num_drafted_tokens"] == 0 and runs["2"]["num_drafted_tokens"] > 0
    assert runs["1"]["token_ids"] == runs["2"]["token_ids"]
    assert main([*base, "--speculative-disable-by-batch-size", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == runs["1"]["token_ids"]
