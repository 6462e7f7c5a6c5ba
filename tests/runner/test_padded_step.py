"""The padded, bucketed static-shape step (the code CUDA graphs capture), run eagerly on CPU with
the dense sync-free backend, emits exactly the tokens of the normal path: padding is inert."""

import pytest
import torch

from blockdraft.runner.cuda_graphs import TargetGraphs
from blockdraft.sampling_params import SamplingParams
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.runner.step_tail import StepTailGraphs
from blockdraft.spec.dflash.speculator import DFlashSpeculator
from tests.conftest import make_llm, random_prompts, tiny_target


@pytest.fixture(scope="module")
def target():
    # Own target: engines set the attention backend on the model they run.
    return tiny_target("qwen3", seed=3)


def _record_buckets(monkeypatch):
    """Patch the graph runners to record (real, padded) request counts of every padded target step
    and the bucket of every tail that drafted."""
    target_steps, draft_steps = [], []
    run_target, run_draft = TargetGraphs.run, StepTailGraphs.run

    def target_run(self, batch, load=True):
        target_steps.append((batch.num_reqs, batch.meta.num_reqs))
        return run_target(self, batch, load)

    def draft_run(self, num_reqs, features, sampled=None):
        out = run_draft(self, num_reqs, features, sampled)
        if self.draft_step is not None:
            draft_steps.append(out.shape[0])
        return out

    monkeypatch.setattr(TargetGraphs, "run", target_run)
    monkeypatch.setattr(StepTailGraphs, "run", draft_run)
    return target_steps, draft_steps


def _spec_llm(target, k, draft_head=None, **kw):
    drafter = random_drafter(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 2), seed=k, init_std=0.1)
    spec = DFlashSpeculator(drafter, target.model, k, None, 4, draft_head)
    return make_llm(target, speculator=spec, **kw)


def _generate(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("num_prompts", [1, 3, 5])
def test_plain_decode_padded_to_buckets_equals_the_normal_path(target, monkeypatch, num_prompts):
    prompts = random_prompts(num_prompts, seed=num_prompts)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(num_prompts)]
    want = _generate(make_llm(target), prompts, params)
    steps, _ = _record_buckets(monkeypatch)
    padded = make_llm(target, attention_backend="dense", graph_mode="eager", max_num_seqs=8)
    assert padded.engine.runner.graphs.target.buckets == [1, 2, 4, 8]
    assert _generate(padded, prompts, params) == want
    assert (num_prompts, {1: 1, 3: 4, 5: 8}[num_prompts]) in steps  # 3 -> bucket 4, 5 -> bucket 8


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_padded_steps_equal_plain_and_eager_speculative(target, monkeypatch, k):
    prompts = random_prompts(5, seed=20 + k)
    params = [SamplingParams(max_tokens=[12, 17, 23, 30, 30][i], ignore_eos=True, temperature=0.7 * (i % 2), seed=i)
              for i in range(5)]  # fmt: skip
    plain = _generate(make_llm(target), prompts, params)
    eager_llm = _spec_llm(target, k)
    eager = _generate(eager_llm, prompts, params)
    target_steps, draft_steps = _record_buckets(monkeypatch)
    padded_llm = _spec_llm(target, k, attention_backend="dense", graph_mode="eager", max_num_seqs=8)
    assert _generate(padded_llm, prompts, params) == plain == eager
    assert (5, 8) in target_steps and 8 in draft_steps  # 5 requests verified and drafted in bucket 8
    assert [padded for _, padded in target_steps] == draft_steps
    # Same drafts as the unpadded speculator: the padded drafter step is inert as well.
    assert padded_llm.engine.stats.spec.num_accepted_tokens == eager_llm.engine.stats.spec.num_accepted_tokens
    assert padded_llm.engine.stats.spec.num_drafted_tokens == eager_llm.engine.stats.spec.num_drafted_tokens


def test_speculative_padded_steps_with_a_draft_vocabulary(target, monkeypatch):
    """The draft head's gather back to target ids runs inside the padded drafter step (the code a
    CUDA graph captures): same tokens as plain, same drafts as the unpadded speculator."""
    from blockdraft.spec.draft_vocab import DraftHead

    ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(2))[:40]
    prompts = random_prompts(5, seed=31)
    params = [SamplingParams(max_tokens=[12, 17, 23, 30, 30][i], ignore_eos=True) for i in range(5)]
    plain = _generate(make_llm(target), prompts, params)
    eager_llm = _spec_llm(target, 3, DraftHead.from_target(target.model, ids))
    eager = _generate(eager_llm, prompts, params)
    _, draft_steps = _record_buckets(monkeypatch)
    padded_llm = _spec_llm(target, 3, DraftHead.from_target(target.model, ids), attention_backend="dense",
                           graph_mode="eager", max_num_seqs=8)
    assert _generate(padded_llm, prompts, params) == plain == eager
    assert 8 in draft_steps
    assert padded_llm.engine.stats.spec.num_drafted_tokens == eager_llm.engine.stats.spec.num_drafted_tokens
    assert padded_llm.engine.stats.spec.num_accepted_tokens == eager_llm.engine.stats.spec.num_accepted_tokens


def test_dense_backend_without_graphs_equals_the_reference(target):
    prompts = random_prompts(4, seed=9, low=10, high=30)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = _generate(make_llm(target), prompts, params)
    got = _generate(_spec_llm(target, 3, attention_backend="dense", max_num_batched_tokens=16), prompts, params)
    assert got == want


def test_host_tensor_matches_torch_tensor():
    import torch

    from blockdraft.host_tensor import host_tensor

    for dtype, values in [(torch.int64, [3, -1, 2**40]), (torch.int32, [0, 7, -5]), (torch.float32, [0.1, 1e-8, 2.5])]:
        got = host_tensor(values, dtype)
        assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))
        assert host_tensor([], dtype).shape == (0,) and host_tensor([], dtype).dtype == dtype
