"""Our CausalLM against transformers' *ForCausalLM (fp32 oracle) on tiny random configs."""

from __future__ import annotations

import random

import pytest
import torch

from blockdraft.attention.metadata import PADDING_SLOT, build_metadata
from blockdraft.layers.linear import cpu_has_fast_bf16, cpu_packing_supported
from blockdraft.models import allocate_kv_caches, build_model
from tests.models._hf_oracle import PagedRunner, hf_logits, hf_model, ours_from_hf, run_prefill

ATOL = 1e-4

SLIDING = dict(
    use_sliding_window=True,
    sliding_window=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)
LLAMA3_ROPE = dict(
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8,
    )
)
CONFIGS = {
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_untied": ("llama", dict(tie_word_embeddings=False)),
    "llama_attention_bias": ("llama", dict(attention_bias=True)),
    "llama3_rope_scaling": ("llama", LLAMA3_ROPE),
    "llama_linear_rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "qwen2_bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_sliding_max_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3_qk_norm": ("qwen3", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3_sliding": ("qwen3", SLIDING),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    """(hf model, our model, our config) for each tiny config."""
    family, overrides = CONFIGS[request.param]
    hf, config = hf_model(family, **overrides)
    return hf, ours_from_hf(hf, config), config


def test_config_switches_are_exercised():
    """Guard against an oracle config that silently turns a feature off."""
    assert hf_model("qwen3", **SLIDING)[1].layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)[1].sliding_window == 4
    assert hf_model("llama", **LLAMA3_ROPE)[1].rope_scaling["rope_type"] == "llama3"
    assert hf_model("qwen2")[1].attention_bias and hf_model("qwen3")[1].qk_norm


def test_logits_match_hf(pair):
    hf, model, _ = pair
    ids = torch.randint(0, 97, (19,), generator=torch.Generator().manual_seed(1))
    ref, _ = hf_logits(hf, ids)
    logits, aux, _, _ = run_prefill(model, [ids])
    assert aux is None and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_dense_and_packed_weights_match_hf(pair, packed):
    hf, _, config = pair
    if packed and not cpu_packing_supported(torch.float32, "cpu"):
        pytest.skip("oneDNN packing not available in this torch build")
    model = ours_from_hf(hf, config, pack_weights=packed)
    assert model.packed is packed and (model.model.layers[0].mlp.down_proj.weight is None) is packed
    ids = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(run_prefill(model, [ids])[0], hf_logits(hf, ids)[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.embed(ids), hf.model.embed_tokens(ids).detach(), atol=0, rtol=0)


def test_packed_model_refuses_reload_and_grad():
    hf, config = hf_model("llama", tie_word_embeddings=False)
    model = ours_from_hf(hf, config, pack_weights=True)
    with pytest.raises(ValueError, match="packed"):
        model.load_weights(hf.state_dict())
    with pytest.raises(RuntimeError, match="inference-only"):
        model.compute_logits(torch.randn(2, 64, requires_grad=True))


def test_tied_packed_head_falls_back_to_dense_for_grad():
    """A drafter trained on CPU backpropagates through the target's tied LM head."""
    hf, config = hf_model("qwen2", tie_word_embeddings=True)
    model = ours_from_hf(hf, config, pack_weights=True)
    hidden = torch.randn(2, 64, requires_grad=True)
    model.compute_logits(hidden).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_aux_hidden_states_are_layer_outputs(pair):
    hf, model, config = pair
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2))
    _, hidden_states = hf_logits(hf, ids)
    _, aux, _, _ = run_prefill(model, [ids], aux_layer_ids=(1, 0))
    h = config.hidden_size
    assert aux.shape == (9, 2 * h)
    torch.testing.assert_close(aux[:, :h], hidden_states[2], atol=ATOL, rtol=0)
    torch.testing.assert_close(aux[:, h:], hidden_states[1], atol=ATOL, rtol=0)


def test_aux_of_last_layer_is_pre_final_norm(pair):
    """HF's last hidden_states entry is AFTER the final norm; our aux is the raw layer output."""
    hf, model, config = pair
    ids = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(3))
    _, hidden_states = hf_logits(hf, ids)
    last = config.num_hidden_layers - 1
    _, aux, _, _ = run_prefill(model, [ids], aux_layer_ids=(last,))
    torch.testing.assert_close(model.model.norm(aux), hidden_states[-1], atol=ATOL, rtol=0)


def test_ragged_batch_matches_each_alone_and_hf(pair):
    hf, model, _ = pair
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (1, 3, 4, 5, 9, 13)]
    batched, _, _, _ = run_prefill(model, prompts, kv_block_size=4)
    rows = batched.split([len(p) for p in prompts])
    for prompt, row in zip(prompts, rows):
        alone, _, _, _ = run_prefill(model, [prompt], kv_block_size=4)
        torch.testing.assert_close(row, alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(row, hf_logits(hf, prompt)[0], atol=ATOL, rtol=0)


def test_shuffled_page_ids_do_not_change_logits(pair):
    _, model, _ = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (7, 11, 2)]
    base, _, _, _ = run_prefill(model, prompts, kv_block_size=4)
    pages = list(range(40))
    random.Random(0).shuffle(pages)
    tables = [pages[0:2], pages[2:5], pages[5:6]]
    shuffled, _, _, _ = run_prefill(model, prompts, kv_block_size=4, block_tables=tables, num_kv_blocks=40)
    torch.testing.assert_close(shuffled, base, atol=1e-5, rtol=0)


def test_chunked_prefill_and_decode_match_one_shot_and_hf(pair):
    """Two requests interleaved: prompt chunks of varying sizes, decode rows mixed in, shuffled pages."""
    hf, model, _ = pair
    gen = torch.Generator().manual_seed(6)
    tokens = {"a": torch.randint(0, 97, (16,), generator=gen), "b": torch.randint(0, 97, (11,), generator=gen)}
    pages = list(range(10))
    random.Random(1).shuffle(pages)
    runner = PagedRunner(model, tokens, {"a": pages[:4], "b": pages[4:7]}, kv_block_size=4)
    schedule = [
        [("a", 3), ("b", 7)],
        [("a", 1), ("b", 1)],
        [("b", 1), ("a", 5)],
        [("a", 4), ("b", 1)],
        [("a", 1), ("b", 1)],
        [("a", 1)],
        [("a", 1)],
    ]
    got = {"a": [], "b": []}
    for step in schedule:
        for req, logits in runner.step(step).items():
            got[req].append(logits)
    for req, toks in tokens.items():
        chunked = torch.cat(got[req])
        one_shot, _, _, _ = run_prefill(model, [toks[: len(chunked)]], kv_block_size=4)
        torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=0)
        torch.testing.assert_close(chunked, hf_logits(hf, toks[: len(chunked)])[0], atol=ATOL, rtol=0)


def test_padding_rows_write_nothing_and_leave_real_rows_alone():
    hf, config = hf_model("qwen3", **SLIDING)
    model = ours_from_hf(hf, config)
    prompt = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(7))
    ref, _, ref_caches, tables = run_prefill(model, [prompt], kv_block_size=4, num_kv_blocks=8)
    # Same forward plus 3 padding rows (past query_start_loc[-1], slot PADDING_SLOT).
    meta = build_metadata([6], [6], tables, 4)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((3,), PADDING_SLOT)])
    caches = allocate_kv_caches(config, 8, 4)
    ids = torch.cat([prompt, torch.zeros(3, dtype=torch.long)])
    positions = torch.cat([torch.arange(6), torch.zeros(3, dtype=torch.long)])
    with torch.no_grad():
        hidden, _ = model(ids, positions, caches, meta)
    torch.testing.assert_close(model.compute_logits(hidden[:6]), ref, atol=1e-5, rtol=0)
    written = torch.zeros(8 * 4, dtype=torch.bool)
    written[meta.slot_mapping[:6]] = True
    for (k, v), (k_ref, v_ref) in zip(caches, ref_caches):
        for cache, cache_ref in ((k, k_ref), (v, v_ref)):
            flat = cache.reshape(32, -1)
            assert torch.all(flat[~written] == 0)
            torch.testing.assert_close(flat, cache_ref.reshape(32, -1), atol=1e-5, rtol=0)


def test_load_weights_reports_missing_and_unexpected_keys():
    hf, config = hf_model("llama", tie_word_embeddings=False)
    model = build_model(config)
    state = dict(hf.state_dict())
    del state["lm_head.weight"], state["model.layers.1.self_attn.k_proj.weight"]
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"2 missing keys.*lm_head\.weight.*1 unexpected keys.*mlp\.extra"):
        model.load_weights(state)


def test_load_weights_reports_shape_mismatch():
    hf, config = hf_model("qwen2")
    model = build_model(config)
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"q_proj\.bias.*\(3,\)"):
        model.load_weights(state)


def test_tied_model_ignores_lm_head_and_rotary_buffers():
    hf, config = hf_model("llama", tie_word_embeddings=True)
    model = build_model(config)
    state = dict(hf.state_dict())
    state["lm_head.weight"] = torch.randn(97, 64)  # HF ties it to the embedding anyway
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    model.load_weights(state)
    assert model.lm_head is None
    ids = torch.arange(5)
    torch.testing.assert_close(run_prefill(model, [ids])[0], hf_logits(hf, ids)[0], atol=ATOL, rtol=0)


def test_load_weights_casts_dtype():
    hf, config = hf_model("qwen3")
    model = build_model(config, dtype=torch.bfloat16, pack_weights=False)
    model.load_weights({k: v.to(torch.float16) for k, v in hf.state_dict().items()})
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_bf16_model_tracks_fp32():
    hf, config = hf_model("qwen3", **SLIDING)
    model = build_model(config, dtype=torch.bfloat16)
    model.load_weights(hf.state_dict())
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(8))
    caches = allocate_kv_caches(config, 8, 4, torch.bfloat16)
    meta = build_metadata([12], [12], [[0, 1, 2]], 4)
    with torch.no_grad():
        hidden, aux = model(ids, torch.arange(12), caches, meta, (0,))
        logits = model.compute_logits(hidden)
    assert hidden.dtype == aux.dtype == torch.bfloat16 and logits.dtype == torch.float32
    ref = hf_logits(hf, ids)[0]
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


def test_forward_rejects_bad_arguments():
    hf, config = hf_model("llama")
    model = ours_from_hf(hf, config)
    caches = allocate_kv_caches(config, 4, 4)
    meta = build_metadata([2], [2], [[0]], 4)
    ids, pos = torch.tensor([1, 2]), torch.arange(2)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        model(ids, pos, caches, meta, (3,))
    with pytest.raises(ValueError, match="KV caches"):
        model(ids, pos, caches[:2], meta)


def test_embed_and_compute_logits_shapes():
    hf, config = hf_model("llama", tie_word_embeddings=True)
    model = ours_from_hf(hf, config)
    emb = model.embed(torch.tensor([3, 4, 5]))
    assert emb.shape == (3, 64)
    torch.testing.assert_close(emb, hf.model.embed_tokens.weight[3:6].detach())
    assert model.compute_logits(emb[:2]).shape == (2, 97)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_compute_logits_into_a_model_dtype_buffer_writes_in_place(tied, packed):
    """CUDA graphs keep logits in the model dtype: the LM head writes into `out` with no float32
    copy (upcast=False: a new tensor in the model dtype), and the values (so the argmax) are
    exactly those of the float32 path."""
    if packed and not cpu_packing_supported(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN bf16 packing on this CPU")
    hf, config = hf_model("llama", tie_word_embeddings=tied)
    model = build_model(config, dtype=torch.bfloat16, pack_weights=packed)
    model.load_weights(hf.state_dict())
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        want = model.compute_logits(hidden)
        out = torch.full((5, 97), float("nan"), dtype=torch.bfloat16)
        got = model.compute_logits(hidden, out=out)
        into_f32 = model.compute_logits(hidden, out=torch.empty(5, 97))
        no_upcast = model.compute_logits(hidden, upcast=False)
    assert want.dtype == into_f32.dtype == torch.float32
    assert no_upcast.dtype == torch.bfloat16 and torch.equal(no_upcast.float(), want)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    assert torch.equal(got.float(), want) and torch.equal(into_f32, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_init_random_weights_is_deterministic():
    _, config = hf_model("qwen2")
    a, b = build_model(config, pack_weights=False), build_model(config, pack_weights=False)
    a.init_random_weights_(seed=3)
    b.init_random_weights_(seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.all(a.model.norm.weight == 1)


def test_build_model_packs_by_default_only_where_supported():
    _, config = hf_model("llama")
    supported = cpu_packing_supported(torch.float32, "cpu")
    assert build_model(config, torch.float32).pack_weights is supported
    # bf16 only where oneDNN has a bf16 path on this CPU (not on AVX2-only ones)
    assert build_model(config, torch.bfloat16).pack_weights is (supported and cpu_has_fast_bf16())
    assert build_model(config, torch.float16).pack_weights is False


def test_fp32_head_is_a_no_op_for_float32_weights_and_refused_off_cuda_for_bf16():
    """compute_logits(fp32_head=True): float32 weights already give float32 logits (same values);
    bf16 weights need CUDA's torch.mm out_dtype, and the CPU says so instead of rounding silently."""
    from blockdraft.models import build_model
    from tests.conftest import tiny_config

    config = tiny_config("llama")
    hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(0))
    model = build_model(config, dtype=torch.float32, device="cpu")
    model.init_random_weights_(std=0.08, seed=0)
    assert torch.equal(model.compute_logits(hidden, fp32_head=True), model.compute_logits(hidden))
    model_bf16 = build_model(config, dtype=torch.bfloat16, device="cpu")
    model_bf16.init_random_weights_(std=0.08, seed=0)
    with pytest.raises(ValueError, match="fp32_head needs CUDA .*on cpu"):
        model_bf16.compute_logits(hidden.bfloat16(), fp32_head=True)
