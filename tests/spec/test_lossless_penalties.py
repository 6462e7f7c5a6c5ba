"""Presence / frequency / repetition penalties in the engine: plain decoding equals a step-by-step
reference (full forward, dense formula), and speculative decoding equals plain decoding token for
token, greedy and seeded, with drafts accepted (each verify row counts the drafts before it)."""

import pytest
import torch

from blockdraft.sample.sampler import SamplingTensors
from blockdraft.sampling_params import SamplingParams
from tests.sample.penalty_reference import dense_adjusted
from tests.conftest import EOS_ID, VOCAB, make_llm, random_prompts
from tests.models._hf_oracle import run_prefill
from tests.spec.doubles import KnownAnswerSpeculator
from tests.spec.test_lossless_dflash import _dflash_llm

PENALTIES = [
    dict(repetition_penalty=1.6),
    dict(presence_penalty=1.5, frequency_penalty=0.5),
    dict(presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=0.8),
    dict(logit_bias={5: 3.0, 7: -100.0, 11: 2.0}, frequency_penalty=0.3),
]


def _reference(target, prompt, p: SamplingParams) -> list[int]:
    """Decode without the engine: one full forward over prompt + output per token, the dense formula,
    then the keyed sampler at the token's sequence position (what the engine keys its noise with)."""
    out: list[int] = []
    for _ in range(p.max_tokens):
        logits = run_prefill(target.model, [torch.tensor(prompt + out)], num_kv_blocks=32)[0][-1]
        x = dense_adjusted(logits.float(), prompt, out, p)[None]
        st = SamplingTensors.from_params([p])
        out.append(int(st.sample(x, torch.tensor([len(prompt) + len(out)]))[0]))
    return out


@pytest.mark.parametrize("pen", PENALTIES)
def test_plain_decoding_with_penalties_equals_a_step_by_step_reference(llama_target, pen):
    prompts = random_prompts(3, seed=5)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **pen),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3, **pen),
              SamplingParams(max_tokens=24, ignore_eos=True)]  # fmt: skip
    got = [o.token_ids for o in make_llm(llama_target, max_num_batched_tokens=7).generate(prompts, params)]
    want = [_reference(llama_target, pr, p) for pr, p in zip(prompts, params)]
    assert got == want
    # the penalty changed something: the greedy answers differ from unpenalised decoding
    bare = make_llm(llama_target).generate(prompts[:1], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    assert bare != got[0]


def _params(pen, n=6):
    return [SamplingParams(max_tokens=40, ignore_eos=True, temperature=(0.0, 0.8)[i % 2], seed=i,
                           **(pen if i % 3 != 2 else {})) for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("pen", PENALTIES)
def test_speculative_equals_plain_with_penalties_and_accepted_drafts(llama_target, k, pen):
    prompts = random_prompts(6, seed=40 + k)
    params = _params(pen)
    plain = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    answers = {tuple(p): p + o for p, o in zip(prompts, plain)}
    for p_right in (1.0, 0.5):
        spec = KnownAnswerSpeculator(k, answers, VOCAB, p_right=p_right, seed=k)
        llm = make_llm(llama_target, speculator=spec)
        spec.engine = llm.engine
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain, p_right
        stats = llm.engine.stats.spec
        for bs in (1, 3):  # fewer batch mates: other rows, the same tokens
            assert [o.token_ids for o in llm.generate(prompts[:bs], params[:bs])] == plain[:bs], (p_right, bs)
        if p_right == 1.0:  # whole blocks accepted: later rows saw the drafts before them as output
            assert stats.acceptance_length > 0.8 * (k + 1)


@pytest.mark.parametrize("graphs", [False, True])
def test_dflash_with_penalties_equals_plain(llama_target, graphs):
    """The real DFlash speculator (random weights): eager steps, and the CUDA-graph step code run
    eagerly (padded buckets: the sampler runs between the target and the tail for penalised rows)."""
    prompts = random_prompts(6, seed=90)
    params = _params(PENALTIES[2])
    plain = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    kw = dict(attention_backend="dense", graph_mode="eager", max_num_seqs=8) if graphs else {}
    llm = _dflash_llm(llama_target, 3, stacked=graphs, **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats.spec.num_drafted_tokens > 0


def test_penalties_with_prefix_cache_and_chunked_prefill(llama_target):
    """A prompt whose prefix is cached, chunked prefill and a penalised request beside plain ones."""
    base = random_prompts(1, seed=7, low=18, high=19)[0]
    prompts = [base, base + [5, 6], base[:9] + [1, 2, 3]]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.4)] * 3
    want = [_reference(llama_target, pr, p) for pr, p in zip(prompts, params)]
    llm = make_llm(llama_target, enable_prefix_caching=True, max_num_batched_tokens=6)
    for _ in range(2):  # the second round starts from cached prefixes
        assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_preemption_and_recompute_with_penalties(llama_target):
    prompts = random_prompts(6, seed=3, low=8, high=16)
    params = SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=0.7, repetition_penalty=1.3)
    ref = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    small = make_llm(llama_target, num_kv_blocks=24)  # far fewer pages than 6 requests need: preempts
    assert [o.token_ids for o in small.generate(prompts, params)] == ref


def test_generate_cli_penalties_with_and_without_the_drafter(tmp_path, capsys):
    """`blockdraft generate --repetition-penalty`: the tiny model's greedy answer is a run of one
    token; the penalty breaks the run, and the drafter's answer is the plain one."""
    import json

    from blockdraft.cli import main
    from tests.server.tiny_model import word, write_tiny_model_and_drafter

    model, drafter = write_tiny_model_and_drafter(tmp_path)
    outs = {}
    for name, flags in {"bare": ["--no-draft"], "plain": ["--no-draft", "--repetition-penalty", "1.5",
                        "--frequency-penalty", "0.5"], "draft": ["--draft", str(drafter), "--repetition-penalty",
                        "1.5", "--frequency-penalty", "0.5"]}.items():  # fmt: skip
        code = main(["generate", word(17), "--raw", "--model", str(model), "--max-tokens", "24", "--json", *flags])
        out, err = capsys.readouterr()
        assert code == 0, err
        result = json.loads(out)
        assert result["stop_reason"] is None  # vLLM's field: no stop string / id asked for (EOS and length: null)
        outs[name] = result["token_ids"]
    assert outs["draft"] == outs["plain"] != outs["bare"]
    assert len(set(outs["plain"])) > len(set(outs["bare"]))


def test_min_tokens_defers_stop_ids_and_strings_and_speculation_keeps_plain_output(llama_target):
    """A stop id the greedy answer emits at position 2: plain decoding stops there; with min_tokens 12
    it is masked until position 12 (the answer then runs on), and a stop string found only in the
    first 12 tokens' text is not looked for; speculation (oracle drafts) gives the same tokens."""
    prompts = random_prompts(4, seed=21)
    greedy = [o.token_ids for o in make_llm(llama_target).generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))]
    params = [SamplingParams(max_tokens=30, stop_token_ids=[g[2]], min_tokens=12, temperature=(0.0, 0.9)[i % 2], seed=i)
              for i, g in enumerate(greedy)]  # fmt: skip
    plain = make_llm(llama_target).generate(prompts, params)
    for o, p in zip(plain, params):
        assert o.num_output_tokens >= 12 and p.stop_token_ids[0] not in o.token_ids[:12]
    stopped = make_llm(llama_target).generate(prompts[:1], SamplingParams(max_tokens=30, stop_token_ids=[greedy[0][2]]))
    assert stopped[0].num_output_tokens <= 3
    answers = {tuple(pr): pr + o.token_ids for pr, o in zip(prompts, plain)}
    spec = KnownAnswerSpeculator(7, answers, VOCAB, p_right=1.0, seed=1)
    llm = make_llm(llama_target, speculator=spec)
    spec.engine = llm.engine
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.engine.stats.spec.num_accepted_tokens > 0


def test_min_tokens_masks_eos_also_with_ignore_eos_as_vllm(llama_target):
    """vLLM's min-tokens processor masks every stop id, EOS included, whatever ignore_eos says: with
    EOS biased to be the argmax, the first min_tokens tokens are others, then EOS follows (and,
    ignored, repeats); speculation (a DFlash drafter) gives the same tokens."""
    prompts = random_prompts(3, seed=22)
    params = SamplingParams(max_tokens=16, min_tokens=6, ignore_eos=True, logit_bias={EOS_ID: 100.0})
    plain = [o.token_ids for o in make_llm(llama_target).generate(prompts, params)]
    for ids in plain:
        assert EOS_ID not in ids[:6] and ids[6:] == [EOS_ID] * 10
    assert [o.token_ids for o in _dflash_llm(llama_target, 3).generate(prompts, params)] == plain


def test_min_tokens_defers_stop_strings():
    from blockdraft.engine.detokenizer import IncrementalDetokenizer
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    ids = tok.encode("w05x w06x w05x w07x", add_special_tokens=False)
    stop = tok.decode(ids[:1])
    early = IncrementalDetokenizer(tok, [stop])
    assert early.extend(ids) == (0, stop)
    late = IncrementalDetokenizer(tok, [stop], min_tokens=1)
    assert late.extend(ids) == (2, stop)  # the first occurrence is inside the first min_tokens tokens
