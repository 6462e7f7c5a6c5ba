"""A fresh, trainable drafter shaped for a target, and the mask token choice.

Shape knobs that matter for the shipped size (bf16 bytes ~ 2 x params): draft depth N, MLP width,
and the number n of target layers fused by `fc` (n*H*H parameters). Layers copy the target's
hidden size, heads, head_dim, eps and RoPE (as released DFlash drafters do).
"""

from __future__ import annotations

import torch

from blockdraft.config import ModelConfig
from blockdraft.spec.dflash.checkpoint import random_drafter
from blockdraft.spec.dflash.config import build_target_layer_ids
from blockdraft.spec.dflash.draft_model import DFlashDraftModel

# Mask ("parallel drafting") token per catalog target: an id that never occurs in chat data and
# has a non-zero embedding. Qwen2.5: 151669, an unused embedding row (z-lab's Qwen3 drafters use
# the same id); SmolLM2: <empty_output> (16), an unused special token.
KNOWN_MASK_TOKENS = {"qwen2": 151669, "llama:49152": 16}


def default_mask_token_id(target: ModelConfig) -> int:
    """The mask token for `target`: KNOWN_MASK_TOKENS by arch (Qwen2 vocab) or arch:vocab, else the
    last vocabulary row (usually an unused padding row)."""
    for key in (f"{target.arch}:{target.vocab_size}", target.arch):
        if key in KNOWN_MASK_TOKENS and KNOWN_MASK_TOKENS[key] < target.vocab_size:
            return KNOWN_MASK_TOKENS[key]
    return target.vocab_size - 1


def feature_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layer ids evenly spread over 1..L-3 (z-lab's default rule; see
    build_target_layer_ids), so `count` may differ from the draft depth. Shallow targets where
    that rule repeats ids get `count` distinct ids spread over 0..L-2 instead.

    Raises:
        ValueError: count > L - 1 (not enough layers for distinct ids below the last).
    """
    if count > max(1, num_target_layers - 1):
        raise ValueError(f"cannot pick {count} distinct feature layers below the last of {num_target_layers}")
    ids = build_target_layer_ids(num_target_layers, count) if num_target_layers >= 4 else ()
    if len(set(ids)) < count:
        top = num_target_layers - 2
        ids = tuple(round(j * top / max(1, count - 1)) for j in range(count)) if count > 1 else (top // 2,)
    return tuple(ids)


def new_drafter(
    target: ModelConfig,
    num_layers: int,
    block_size: int = 16,
    intermediate_size: int | None = None,
    num_feature_layers: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    init_std: float = 0.02,
    device="cpu",
) -> DFlashDraftModel:
    """A float32 drafter with N(0, init_std) linear weights and unit norms, ready to train.

    Args:
        num_feature_layers: n target layers to fuse when `target_layer_ids` is None
            (default: num_layers, z-lab's rule).
        intermediate_size: MLP width (default: the target's).
    """
    ids = target_layer_ids or feature_layer_ids(target.num_hidden_layers, num_feature_layers or num_layers)
    overrides = {"intermediate_size": intermediate_size} if intermediate_size else {}
    mask = default_mask_token_id(target) if mask_token_id is None else mask_token_id
    model = random_drafter(target, num_layers, block_size, ids, seed=seed, init_std=init_std,
                           mask_token_id=mask, dtype=torch.float32, device=device, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    return model.requires_grad_(True).train()


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# MLP weights that may be wider in the drafter than in `state` (widening: rows / columns appended).
_MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")  # [intermediate, hidden]
_MLP_COLS = ("mlp.down_proj.weight",)  # [hidden, intermediate]


@torch.no_grad()
def init_from(drafter: DFlashDraftModel, state: dict[str, torch.Tensor]) -> list[int]:
    """Start `drafter` from an earlier drafter's weights `state` (z-lab names), possibly shallower
    or with a narrower MLP.

    Every tensor of `state` is copied into the same-named parameter. Draft layers that `state`
    lacks (growing an N-layer drafter into a deeper one) keep their random weights except their
    output projections (`self_attn.o_proj`, `mlp.down_proj`), which are zeroed: such a layer adds
    nothing to the residual stream, so the grown drafter computes exactly what `state`'s drafter
    did and training starts from there (zero-initialised residual branches, as in ReZero /
    Fixup). Likewise a wider MLP (intermediate size I' > I): `gate_proj` / `up_proj` [I, H] fill
    the first I rows of the new [I', H] (the rest keep their random init), `down_proj` [H, I] the
    first I columns of [H, I'] and its new columns are zeroed, so the new hidden units contribute
    nothing until trained (function-preserving widening, as in Net2Net's zero-output variant).
    Returns the indices of the new layers.

    Raises:
        ValueError: a tensor of `state` the drafter does not have, or one of another shape (other
            than a narrower MLP; an MLP wider than the drafter's is refused too).
    """
    own = drafter.state_dict()
    for name, t in state.items():
        if name not in own:
            raise ValueError(f"init weights: {name!r} is not a parameter of this drafter "
                             f"({drafter.config.num_hidden_layers} layers)")
        dst = _widened_slice(name, own[name], t)
        if dst is None:
            raise ValueError(f"init weights: {name!r} has shape {tuple(t.shape)}, the drafter's is "
                             f"{tuple(own[name].shape)} (same hidden size and feature layers needed; the MLP "
                             f"may only grow)")
        dst.copy_(t)
        if dst.shape != own[name].shape and name.endswith(_MLP_COLS):
            own[name][:, t.shape[1]:].zero_()  # new hidden units add nothing until trained
    new = [i for i in range(drafter.config.num_hidden_layers) if not any(k.startswith(f"layers.{i}.") for k in state)]
    for i in new:
        own[f"layers.{i}.self_attn.o_proj.weight"].zero_()
        own[f"layers.{i}.mlp.down_proj.weight"].zero_()
    return new


def _widened_slice(name: str, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor | None:
    """The part of parameter `dst` that `src` fills: all of it for equal shapes, the leading rows
    (gate / up) or columns (down) for a narrower MLP; None when `src` does not fit."""
    if tuple(src.shape) == tuple(dst.shape):
        return dst
    if src.dim() != 2 or dst.dim() != 2:
        return None
    if name.endswith(_MLP_ROWS) and src.shape[1] == dst.shape[1] and src.shape[0] < dst.shape[0]:
        return dst[: src.shape[0]]
    if name.endswith(_MLP_COLS) and src.shape[0] == dst.shape[0] and src.shape[1] < dst.shape[1]:
        return dst[:, : src.shape[1]]
    return None
