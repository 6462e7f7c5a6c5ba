"""Random-weight models shared by the engines, the forced-acceptance speculator, the engines."""

import pytest
import torch

from blockdraft.bench.engines.hf import left_pad
from blockdraft.bench.engines.ours import PoolPlan, check_llm_options
from blockdraft.bench.forced import ForcedAcceptanceSpeculator
from blockdraft.bench.random_weights import (
    IdTokenizer,
    init_random_,
    random_drafter_on_device,
    random_target,
    zlab_drafter_from,
)
from blockdraft.bench.shapes import get_shape
from blockdraft.spec.dflash.checkpoint import random_drafter_config


def test_random_target_shares_weights_between_hf_and_ours():
    from blockdraft.attention import build_metadata
    from blockdraft.models import allocate_kv_caches

    hf, ours = random_target(get_shape("tiny"), torch.float32, "cpu", seed=3)
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        caches = allocate_kv_caches(ours.config, 4, 4)
        hidden, _ = ours.model(ids, torch.arange(9), caches, build_metadata([9], [9], [[0, 1, 2]], 4))
        got = ours.model.compute_logits(hidden)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert isinstance(ours.tokenizer, IdTokenizer)


def test_init_random_is_seeded_and_keeps_norms_at_one():
    a, _ = random_target(get_shape("tiny"), torch.float32, "cpu", seed=1)
    b, _ = random_target(get_shape("tiny"), torch.float32, "cpu", seed=1)
    c, _ = random_target(get_shape("tiny"), torch.float32, "cpu", seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    assert torch.all(sa["model.layers.0.input_layernorm.weight"] == 1)
    w = sa["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < w.std().item() < 0.025


def test_init_random_refuses_a_model_split_across_devices():
    m = torch.nn.Linear(2, 2).to("meta")
    m.bias = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="one device"):
        init_random_(m, 0)


def test_random_drafter_has_the_released_shape_and_zlab_gets_its_weights():
    _, target = random_target(get_shape("tiny"), torch.float32, "cpu")
    drafter = random_drafter_on_device(target.config, 2, 16, torch.float32, "cpu")
    assert drafter.config == random_drafter_config(target.config, 2, 16)
    assert drafter.config.target_layer_ids == (1, 3) and drafter.config.mask_token_id == 511
    pytest.importorskip("dflash.model", reason="z-lab dflash==0.1.0 not installed")
    zl = zlab_drafter_from(drafter)
    ours, theirs = drafter.state_dict(), zl.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert zl.block_size == 16 and zl.rotary_emb.inv_freq.dtype == torch.float32
    with pytest.raises(ValueError, match="draft layers must be >= 1"):
        random_drafter_on_device(target.config, 0, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="block size must be >= 2"):
        random_drafter_on_device(target.config, 2, 1, torch.float32, "cpu")


def test_forced_speculator_runs_the_real_drafter_and_returns_the_known_continuation():
    _, target = random_target(get_shape("tiny"), torch.float32, "cpu")
    drafter = random_drafter_on_device(target.config, 2, 4, torch.float32, "cpu")  # K = 3
    spec = ForcedAcceptanceSpeculator(drafter, target.model, None, 4, 4, torch.arange(100, 106))
    features = torch.randn(3, 2 * target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    drafts = spec.propose(features, torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), torch.tensor([7, 9]),
                          torch.tensor([2, 4]), table)
    assert drafts.tolist() == [[103, 104, 105], [105, 105, 105]]  # past the end: the last token
    k_cache = spec.kv_caches[0][0]
    assert k_cache[0, :3].abs().sum() > 0 and k_cache[0, 3:].abs().sum() == 0  # the real context write ran
    with pytest.raises(ValueError, match="non-empty 1-D"):
        ForcedAcceptanceSpeculator(drafter, target.model, None, 4, 4, torch.tensor([[1, 2]]))


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], 0, "cpu")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="no empty prompt"):
        left_pad([[1], []], 0, "cpu")


def test_pool_plan_fits_the_largest_batch_and_prefills_in_one_step():
    plan = PoolPlan(max_batch=8, max_prompt_len=100, max_tokens=60, lookahead=16, kv_block_size=16)
    assert plan.num_kv_blocks == 8 * (-(-176 // 16) + 1)
    assert plan.max_num_batched_tokens == 800


def test_llm_options_unknown_to_this_build_are_refused_by_name():
    assert check_llm_options({"kv_block_size": 16, "enforce_eager": None}) == {"kv_block_size": 16}
    with pytest.raises(ValueError, match=r"does not take \['no_such_option'\]"):
        check_llm_options({"no_such_option": True})


def test_id_tokenizer():
    tok = IdTokenizer()
    assert tok.decode([3, 17]) == "3 17"
    with pytest.raises(ValueError, match="token ids"):
        tok.encode("hi")


def test_forced_speculator_goes_through_the_static_graph_step_path(monkeypatch):
    """The tail graphs call the speculator's propose_block: the oracle lookup must live there too.
    Runs the CUDA-graph code path without capturing (graph mode "eager", dense attention, CPU)."""
    import blockdraft.runner.setup as setup
    from blockdraft.bench.engines.ours import OurEngine, PoolPlan, forced_speculator
    from blockdraft.bench.workload import random_prompts

    _, target = random_target(get_shape("tiny"), torch.float32, "cpu")
    drafter = random_drafter_on_device(target.config, 2, 8, torch.float32, "cpu")  # K = 7
    plan = PoolPlan(max_batch=3, max_prompt_len=10, max_tokens=12, lookahead=8)
    prompt = random_prompts(1, 10, target.config.vocab_size, 0)[0]
    reference = OurEngine(target, "cpu", plan).generate([prompt], 12).token_ids[0]
    monkeypatch.setattr(setup, "_graph_mode", lambda mode, device, enforce_eager, backend: "eager")
    spec = forced_speculator(drafter, target, plan, None, prompt + reference, "cpu")
    engine = OurEngine(target, "cpu", plan, spec, "dflash-forced", {"attention_backend": "dense"})
    assert engine.llm.engine.runner.graphs.draft is not None
    gen = engine.generate([prompt] * 3, 12)
    assert gen.token_ids == [reference] * 3
    assert gen.num_steps == 3 and gen.acceptance_length == 5.5  # 1 + 8 + 3 tokens: every draft accepted


def test_our_engine_keeps_at_most_concurrency_requests_in_flight():
    """7 prompts at concurrency 3: the engine never holds more than 3 requests (running + waiting)
    and does hold 3; a new one enters as one finishes, so later steps mix a prefill with decodes;
    the outputs are the closed batch's, in prompt order (greedy, fp32), plain and DFlash."""
    from blockdraft.bench.engines.ours import OurEngine, dflash_speculator
    from blockdraft.bench.workload import random_prompts

    _, target = random_target(get_shape("tiny"), torch.float32, "cpu")
    drafter = random_drafter_on_device(target.config, 2, 8, torch.float32, "cpu")
    plan = PoolPlan(max_batch=7, max_prompt_len=14, max_tokens=9, lookahead=8)
    prompts = random_prompts(7, 14, target.config.vocab_size, 3)
    prompts = [p[: 6 + i] for i, p in enumerate(prompts)]  # different lengths: requests finish apart
    for spec in (None, dflash_speculator(drafter, target, plan, None)):
        engine = OurEngine(target, "cpu", plan, spec, "plain" if spec is None else "dflash")
        closed = engine.generate(prompts, 9)
        sched, in_flight = engine.llm.engine.scheduler, []
        step = engine.llm.engine.step

        def counting_step(*args, **kwargs):
            in_flight.append(len(sched.running) + len(sched.waiting))
            return step(*args, **kwargs)

        engine.llm.engine.step = counting_step
        windowed = engine.generate(prompts, 9, concurrency=3)
        assert windowed.token_ids == closed.token_ids
        assert max(in_flight) == 3 and in_flight.count(3) > 1
        assert engine.generate(prompts, 9, concurrency=7).token_ids == closed.token_ids  # all at once


def test_a_failing_window_leaves_the_engine_empty():
    """A bad prompt is refused before any request is queued; an error mid-run aborts the call's
    requests, so the next cell on the same engine starts from an empty engine."""
    from blockdraft.bench.engines.ours import OurEngine
    from blockdraft.bench.workload import random_prompts

    _, target = random_target(get_shape("tiny"), torch.float32, "cpu")
    plan = PoolPlan(max_batch=4, max_prompt_len=10, max_tokens=8)
    engine = OurEngine(target, "cpu", plan)
    prompts = random_prompts(5, 10, target.config.vocab_size, 4)
    with pytest.raises(ValueError):
        engine.generate(prompts[:4] + [[target.config.vocab_size + 5]], 8, concurrency=2)
    assert not engine.llm.engine.has_unfinished_requests()
    step, calls = engine.llm.engine.step, []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return step(*args, **kwargs)

    engine.llm.engine.step = failing_step
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(prompts, 8, concurrency=2)
    assert not engine.llm.engine.has_unfinished_requests()
    engine.llm.engine.step = step
    assert engine.generate(prompts, 8, concurrency=2).token_ids == engine.generate(prompts, 8).token_ids
