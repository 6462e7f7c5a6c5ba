"""min_p in the engine: plain decoding equals a step-by-step reference that masks the tempered
probabilities below min_p x the top one (float64, vLLM's formula) and samples what is left with
the keyed sampler; speculative decoding equals plain decoding token for token (seeded sampling,
K = 3 and 7, batches of mixed parameters, drafts accepted and rejected, the real DFlash drafter
on eager steps and on the CUDA-graph step code run eagerly)."""

import dataclasses

import pytest
import torch

from blockdraft.sample.sampler import SamplingTensors
from blockdraft.sampling_params import SamplingParams
from tests.conftest import VOCAB, make_llm, random_prompts
from tests.models._hf_oracle import run_prefill
from tests.spec.doubles import KnownAnswerSpeculator
from tests.spec.test_lossless_dflash import _dflash_llm


def _mixed(n: int = 6, max_tokens: int = 40) -> list[SamplingParams]:
    """Seeded min_p rows (alone, with top-k, with top-p, min_p 1), a greedy row with min_p and a
    sampled row without it."""
    kinds = [
        dict(temperature=1.0, min_p=0.3),
        dict(temperature=1.3, min_p=0.1, top_k=20),
        dict(temperature=0.0, min_p=0.5),
        dict(temperature=0.9, min_p=0.2, top_p=0.8),
        dict(temperature=1.0),
        dict(temperature=1.5, min_p=1.0),
    ]
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **kinds[i % len(kinds)]) for i in range(n)]


def _without_min_p(params: list[SamplingParams]) -> list[SamplingParams]:
    return [dataclasses.replace(p, min_p=0.0) for p in params]


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def _reference(target, prompt, p: SamplingParams) -> list[int]:
    """Decode without the engine: one full forward per token; min_p applied here (float64
    probabilities of logits / T, masked to -inf below min_p x the top one), then the keyed sampler
    with min_p off at the token's sequence position."""
    out: list[int] = []
    plain = SamplingTensors.from_params([SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)])
    for _ in range(p.max_tokens):
        logits = run_prefill(target.model, [torch.tensor(prompt + out)], num_kv_blocks=32)[0][-1].double()
        if p.temperature > 0 and p.min_p > 0:
            probs = torch.softmax(logits / p.temperature, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        out.append(int(plain.sample(logits.float()[None], torch.tensor([len(prompt) + len(out)]))[0]))
    return out


def test_plain_decoding_with_min_p_equals_a_step_by_step_reference_and_min_p_changes_the_answer(llama_target):
    prompts = random_prompts(6, seed=5)
    params = _mixed(6, max_tokens=16)
    got = _tokens(make_llm(llama_target, max_num_batched_tokens=7), prompts, params)
    assert got == [_reference(llama_target, pr, p) for pr, p in zip(prompts, params)]
    bare = _tokens(make_llm(llama_target), prompts, _without_min_p(params))
    # min_p really filters: the sampled rows with min_p differ from the same seeds without it
    changed = [i for i, p in enumerate(params) if p.min_p > 0 and not p.greedy and got[i] != bare[i]]
    assert len(changed) >= 3, changed
    assert got[2] == bare[2]  # the greedy row ignores min_p


def _known_answer_llm(target, k: int, answers: dict, p_right: float):
    """An LLM whose speculator drafts the known plain answers, each draft right with p_right."""
    spec = KnownAnswerSpeculator(k, answers, VOCAB, p_right=p_right, seed=k)
    llm = make_llm(target, speculator=spec)
    spec.engine = llm.engine
    return llm


@pytest.mark.parametrize("k", [3, 7])
def test_speculative_equals_plain_with_min_p_seeded_and_mixed(llama_target, k):
    prompts = random_prompts(6, seed=40 + k)
    params = _mixed(6)
    plain = _tokens(make_llm(llama_target), prompts, params)
    answers = {tuple(p): p + o for p, o in zip(prompts, plain)}
    for p_right in (1.0, 0.5):
        llm = _known_answer_llm(llama_target, k, answers, p_right)
        assert _tokens(llm, prompts, params) == plain, p_right
        stats = llm.engine.stats.spec
        for idx in ([0], [1, 3, 5], [3]):  # other batch mates (other hints, other rows): the same tokens
            assert _tokens(llm, [prompts[i] for i in idx], [params[i] for i in idx]) == [plain[i] for i in idx], (p_right, idx)
        if p_right == 1.0:  # whole blocks accepted: every verify row was sampled with its min_p
            assert stats.acceptance_length > 0.8 * (k + 1)
        else:
            assert 0 < stats.num_accepted_tokens < stats.num_drafted_tokens


@pytest.mark.parametrize("k", [3, 7])
def test_speculative_equals_plain_with_min_p_only_on_sampled_rows(llama_target, k):
    """Every request samples with min_p (K + 1 verify rows each, one min_p per request, repeated)."""
    prompts = random_prompts(5, seed=20)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=t, min_p=m, seed=7 + i)
              for i, (t, m) in enumerate([(0.7, 0.05), (1.0, 0.2), (1.2, 0.4), (1.0, 0.1), (2.0, 0.3)])]  # fmt: skip
    plain = _tokens(make_llm(llama_target), prompts, params)
    answers = {tuple(p): p + o for p, o in zip(prompts, plain)}
    for p_right in (0.5, 1.0):
        assert _tokens(_known_answer_llm(llama_target, k, answers, p_right), prompts, params) == plain, p_right


@pytest.mark.parametrize("graphs", [False, True])
def test_dflash_with_min_p_equals_plain(llama_target, graphs):
    """The real DFlash speculator (random weights): eager steps, and the CUDA-graph step code run
    eagerly (padded buckets: the sampler runs between the target and the tail for min_p rows)."""
    prompts = random_prompts(6, seed=90)
    params = _mixed(6, max_tokens=30)
    plain = _tokens(make_llm(llama_target), prompts, params)
    kw = dict(attention_backend="dense", graph_mode="eager", max_num_seqs=8) if graphs else {}
    llm = _dflash_llm(llama_target, 3, stacked=graphs, **kw)
    assert _tokens(llm, prompts, params) == plain
    assert llm.engine.stats.spec.num_drafted_tokens > 0


def test_generate_cli_min_p_with_and_without_the_drafter(tmp_path, capsys):
    """`blockdraft generate --min-p`: the drafter's answer is the plain one, min_p changes a hot
    sampled answer, and --min-p 1 keeps only the most likely token (the greedy answer)."""
    import json

    from blockdraft.cli import main
    from tests.server.tiny_model import word, write_tiny_model_and_drafter

    model, drafter = write_tiny_model_and_drafter(tmp_path)
    hot = ["--temperature", "1.5", "--seed", "3"]
    runs = {"greedy": ["--no-draft"], "bare": ["--no-draft", *hot], "plain": ["--no-draft", *hot, "--min-p", "0.2"],
            "draft": ["--draft", str(drafter), *hot, "--min-p", "0.2"], "one": ["--no-draft", *hot, "--min-p", "1"]}
    outs = {}
    for name, flags in runs.items():
        code = main(["generate", word(17), "--raw", "--model", str(model), "--max-tokens", "24", "--json", *flags])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs[name] = json.loads(out)["token_ids"]
    assert outs["draft"] == outs["plain"] != outs["bare"]
    assert outs["one"] == outs["greedy"] != outs["bare"]
