"""DFlashDraftModel.stack_projections: q/k/v and gate/up weights in one tensor each (the CUDA
inference layout), with the parameters as row slices: same names, values and outputs."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from blockdraft.attention.metadata import build_metadata
from blockdraft.layers import fused_ops
from blockdraft.spec.dflash import random_drafter
from tests.spec._dflash_util import tiny_target_config


def _run(drafter):
    """Context K/V of 7 rows, then two draft blocks of 4 -> (hidden [8, H], caches)."""
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(7, drafter.config.num_aux_layers * 64, generator=gen)
    block = torch.randn(8, 64, generator=gen)
    caches = drafter.allocate_kv_caches(4, 4)
    drafter.write_context(feats, torch.arange(7), caches, torch.arange(7))
    meta = build_metadata([4, 3], [4, 4], [[0], [1]], 4, num_block_tokens=4)
    return drafter(block, torch.tensor([4, 5, 6, 7, 3, 4, 5, 6]), caches, meta), caches


def _drafter():
    return random_drafter(tiny_target_config(), num_layers=2, block_size=4, init_std=0.1)


def test_stacking_keeps_names_values_and_outputs():
    plain, stacked = _drafter(), _drafter()
    before = {k: v.clone() for k, v in stacked.state_dict().items()}
    assert not stacked.stacked and stacked.stack_projections() and stacked.stacked
    assert not stacked.stack_projections()  # already stacked: nothing to do
    after = stacked.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    attn, mlp = stacked.layers[0].self_attn, stacked.layers[0].mlp
    # the parameters are row slices of the stacked tensors: one storage, no copy
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
    assert torch.equal(attn.qkv_weight, torch.cat([before[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]))
    (out_plain, caches_plain), (out_stacked, caches_stacked) = _run(plain), _run(stacked)
    torch.testing.assert_close(out_stacked, out_plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches_plain, caches_stacked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_weights_loaded_after_stacking_land_in_the_stacked_tensors():
    source, drafter = random_drafter(tiny_target_config(), 2, 4, seed=5, init_std=0.1), _drafter()
    drafter.stack_projections()
    drafter.load_weights(source.state_dict())
    attn = drafter.layers[1].self_attn
    expected = torch.cat([source.state_dict()[f"layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_weight, expected)
    gate_up = torch.cat([source.state_dict()[f"layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert torch.equal(drafter.layers[1].mlp.gate_up_weight, gate_up)
    # the all-layer context k/v copy follows the load (write_context's one matmul)
    kv = torch.cat([source.state_dict()[f"layers.{i}.self_attn.{n}_proj.weight"] for i in (0, 1) for n in "kv"])
    assert torch.equal(drafter.context_kv_weight, kv)
    (out, caches), (want, want_caches) = _run(drafter), _run(source)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches, want_caches):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_context_rows_of_every_layer_take_one_matmul_when_stacked(monkeypatch):
    weights = []
    real = fused_ops.linear
    monkeypatch.setattr("blockdraft.spec.dflash.draft_model.linear",
                        lambda x, w, b, fused=True: weights.append(w) or real(x, w, b, fused))  # fmt: skip
    drafter = _drafter()
    drafter.stack_projections()
    _run(drafter)
    assert sum(w is drafter.context_kv_weight for w in weights) == 1  # both layers' k/v rows, once
    per_layer_kv = {layer.self_attn.k_proj.weight.data_ptr() for layer in drafter.layers}
    assert not any(w.data_ptr() in per_layer_kv for w in weights)  # no per-layer context matmul


def test_a_cast_or_packing_undoes_the_stacking():
    drafter = _drafter()
    drafter.stack_projections()
    drafter.to(torch.float64)  # new parameter tensors: the stacked ones would be stale
    assert not drafter.stacked and drafter.layers[0].mlp.gate_up_weight is None and drafter.context_kv_weight is None
    drafter.to(torch.float32).stack_projections()
    if drafter.pack_for_cpu_inference():
        assert not drafter.stacked and drafter.packed
        assert not drafter.stack_projections()  # packed weights stay packed


@pytest.mark.parametrize("rows", [1, 5])
def test_stacked_mlp_takes_the_swiglu_path_on_the_kernel_branch(monkeypatch, rows):
    """On the kernel branch a stacked drafter MLP runs `swiglu_mlp` over the stacked weight
    (2-16 rows: gate/up and activation in one launch), as the target's GatedMLP does."""
    calls = []
    real = fused_ops.swiglu_mlp
    monkeypatch.setattr("blockdraft.spec.dflash.draft_model.swiglu_mlp",
                        lambda x, w, d, fused=True: calls.append(w.shape) or real(x, w, d, fused))  # fmt: skip
    drafter = _drafter()
    mlp = drafter.layers[0].mlp
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    unstacked = mlp(x)
    assert not calls
    drafter.stack_projections()
    torch.testing.assert_close(mlp(x), unstacked, rtol=1e-5, atol=1e-5)
    assert calls == [torch.Size([2 * drafter.config.intermediate_size, 64])]
    expected = F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_stacked_weights_are_used_only_while_they_are_the_parameters_and_without_gradients():
    """A deepcopy (its parameters no longer slices of its stacked copy) and training (gradients
    wanted) take the per-projection path: same outputs, gradients reach every projection."""
    import copy

    drafter = _drafter()
    drafter.stack_projections()
    mlp, attn = drafter.layers[0].mlp, drafter.layers[0].self_attn
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    twin = copy.deepcopy(drafter)
    with torch.no_grad():
        twin.layers[0].mlp.up_proj.weight.mul_(2)  # the copy's parameter, not its stale stacked tensor
        expected = F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, 2 * mlp.up_proj.weight),
                            mlp.down_proj.weight)  # fmt: skip
        torch.testing.assert_close(twin.layers[0].mlp(x), expected, rtol=1e-5, atol=1e-5)
    drafter.requires_grad_(True)
    mlp(x).sum().backward()
    _, k, v = attn._project(x, with_q=False)
    (k.sum() + v.sum()).backward()
    grads = [mlp.gate_proj.weight.grad, mlp.up_proj.weight.grad, attn.k_proj.weight.grad, attn.v_proj.weight.grad]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_the_all_layer_context_copy_is_not_used_once_a_k_or_v_weight_changes_in_place():
    """A copy into a k/v parameter after stacking that bypasses load_weights (load_state_dict, an
    optimizer step) makes the copy stale: write_context falls back to the per-layer matmuls."""
    source, drafter = random_drafter(tiny_target_config(), 2, 4, seed=5, init_std=0.1), _drafter()
    drafter.stack_projections()
    drafter.load_state_dict(source.state_dict())  # in place, not through load_weights
    assert drafter._usable_context_kv_weight() is None
    (out, caches), (want, want_caches) = _run(drafter), _run(source)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches, want_caches):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    address = drafter.context_kv_weight.data_ptr()
    drafter.load_weights(source.state_dict())  # refreshed in place (captured graphs keep reading it)
    assert drafter._usable_context_kv_weight() is not None and drafter.context_kv_weight.data_ptr() == address
