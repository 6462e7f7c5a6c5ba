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


def default_layer_ids(num_target_layers: int, num_layers: int, num_feature_layers: int | None = None) -> tuple[int, ...]:
    """The target layer ids a new drafter reads when none are given: `num_feature_layers` of them
    (default: one per draft layer, `num_layers`, z-lab's rule), as feature_layer_ids spreads them.

    Raises:
        ValueError: as feature_layer_ids (more than the target's layers below the last).
    """
    return feature_layer_ids(num_target_layers, num_feature_layers or num_layers)


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
    ids = target_layer_ids or default_layer_ids(target.num_hidden_layers, num_layers, num_feature_layers)
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
def init_from(drafter: DFlashDraftModel, state: dict[str, torch.Tensor],
              state_layer_ids: tuple[int, ...] | None = None) -> list[int]:
    """Start `drafter` from an earlier drafter's weights `state` (z-lab names), possibly shallower,
    with a narrower MLP or fusing fewer target layers.

    Every tensor of `state` is copied into the same-named parameter. Draft layers that `state`
    lacks (growing an N-layer drafter into a deeper one) keep their random weights except their
    output projections (`self_attn.o_proj`, `mlp.down_proj`), which are zeroed: such a layer adds
    nothing to the residual stream, so the grown drafter computes exactly what `state`'s drafter
    did and training starts from there (zero-initialised residual branches, as in ReZero /
    Fixup). Likewise a wider MLP (intermediate size I' > I): `gate_proj` / `up_proj` [I, H] fill
    the first I rows of the new [I', H] (the rest keep their random init), `down_proj` [H, I] the
    first I columns of [H, I'] and its new columns are zeroed, so the new hidden units contribute
    nothing until trained (function-preserving widening, as in Net2Net's zero-output variant).

    More feature layers (the drafter's `fc.weight` is [H, n'*H], `state`'s [H, n*H] with n < n'):
    `state`'s fc reads the target layers `state_layer_ids` (one H-column block each, in that
    order), which must all be among the drafter's `target_layer_ids`. Each old block goes to the
    position of its id in the drafter's order and the blocks of the new ids are zeroed, so
    fc(features) -- and everything after it -- is what `state`'s drafter computed from its own
    features, whatever the new layers' features are; the new columns get gradient and are learned
    from there (e.g. 3 -> 5 feature layers of a 24-layer target: [1, 11, 21] -> [1, 6, 11, 16, 21],
    the old blocks at positions 0, 2, 4, those of 6 and 16 zero).
    `state_layer_ids` None: the drafter's own ids when the fc widths are equal (a plain copy, as
    before); otherwise `feature_layer_ids(num_target_layers, n)`, num_target_layers being the
    drafter config's (the target's depth; config.json's "num_target_layers"), the rule new_drafter
    picks n feature layers by. Pass the ids of an init whose ids were chosen otherwise (its
    config.json's dflash_config.target_layer_ids).
    Returns the indices of the new draft layers (`new_feature_layers` lists the new target ids).

    Raises:
        ValueError: a tensor of `state` the drafter does not have, or one of another shape (other
            than a narrower MLP or fewer feature layers; an MLP wider than the drafter's is refused
            too); `state` fusing more target layers than the drafter (features can be added, not
            removed), ids of `state` that are not all among the drafter's (both lists named), or
            `state_layer_ids` of another count than `state`'s fc blocks.
    """
    own = drafter.state_dict()
    for name, t in state.items():
        if name not in own:
            raise ValueError(f"init weights: {name!r} is not a parameter of this drafter "
                             f"({drafter.config.num_hidden_layers} layers)")
        if name == _FC and _fc_blocks(own[name], t) is not None:
            _copy_feature_blocks(drafter, own[name], t, state_layer_ids)
            continue
        dst = _widened_slice(name, own[name], t)
        if dst is None:
            raise ValueError(f"init weights: {name!r} has shape {tuple(t.shape)}, the drafter's is "
                             f"{tuple(own[name].shape)} (same hidden size needed; feature layers may only be "
                             f"added; the MLP may only grow)")
        dst.copy_(t)
        if dst.shape != own[name].shape and name.endswith(_MLP_COLS):
            own[name][:, t.shape[1]:].zero_()  # new hidden units add nothing until trained
    new = [i for i in range(drafter.config.num_hidden_layers) if not any(k.startswith(f"layers.{i}.") for k in state)]
    for i in new:
        own[f"layers.{i}.self_attn.o_proj.weight"].zero_()
        own[f"layers.{i}.mlp.down_proj.weight"].zero_()
    return new


_FC = "fc.weight"  # [H, n*H]: one H-column block per target layer id, in the order of target_layer_ids


def init_layer_ids(drafter: DFlashDraftModel, state: dict[str, torch.Tensor],
                   state_layer_ids: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The target layer ids `state`'s `fc.weight` reads, in its column-block order: `state_layer_ids`
    when given; else the drafter's own when the fc widths are equal; else, for an fc of n blocks,
    `feature_layer_ids(L, n)` with L the drafter config's `num_target_layers` (the rule new_drafter
    and train-drafter pick n feature layers by), which holds for drafters trained here from
    scratch but not for one whose ids were chosen otherwise: pass its ids then.

    Raises:
        ValueError: `state` has no fc of whole H-column blocks; `state_layer_ids` of another count
            than its blocks; no ids given and no num_target_layers in the drafter's config.
    """
    own = drafter.fc.weight
    n = _fc_blocks(own, state[_FC]) if _FC in state else None
    if n is None:
        raise ValueError(f"init weights: no {_FC!r} of shape [H, n*H] (H = {own.shape[0]}) to read feature ids from")
    return _init_ids(tuple(drafter.config.target_layer_ids), n, drafter.config.num_target_layers, state_layer_ids)


def _init_ids(ids: tuple[int, ...], n: int, depth: int | None, state_layer_ids) -> tuple[int, ...]:
    """init_layer_ids for a drafter reading `ids` of a `depth`-layer target and an init fc of n blocks."""
    if state_layer_ids is not None:
        old = tuple(int(i) for i in state_layer_ids)
        if len(old) != n:
            raise ValueError(f"init weights: the init's target layer ids {list(old)} are {len(old)}, its "
                             f"{_FC!r} fuses {n} target layers")
        return old
    if n == len(ids):
        return ids
    if depth is None:
        raise ValueError(f"init weights: {_FC!r} fuses {n} target layers, the drafter {len(ids)} {list(ids)}, and "
                         f"the drafter config records no num_target_layers to derive the init's ids from: give them")
    return feature_layer_ids(depth, n)


def feature_block_positions(ids: tuple[int, ...], n: int, depth: int | None,
                            state_layer_ids: tuple[int, ...] | None = None) -> list[int]:
    """Where init_from puts each of an init fc's n column blocks among a drafter's target layer
    `ids` (on a `depth`-layer target; the init's ids as init_layer_ids takes them): the position of
    its id. Needs no weights, so a run can check a growth before any work.

    Raises:
        ValueError: n > len(ids) (feature layers can be added, not removed), or an init id not
            among `ids` (or repeated), naming both id lists; as init_layer_ids.
    """
    ids = tuple(ids)
    if n > len(ids):
        given = "" if state_layer_ids is None else f" {list(state_layer_ids)}"
        raise ValueError(f"init weights: the init fuses {n} target layers{given}, the drafter only "
                         f"{len(ids)} {list(ids)}: feature layers can be added, not removed")
    old = _init_ids(ids, n, depth, state_layer_ids)
    missing = [i for i in old if i not in ids]
    if missing or len(set(old)) != len(old):
        raise ValueError(f"init weights: the init's target layer ids {list(old)} are not all (once each) among "
                         f"the drafter's {list(ids)} (missing {missing}): feature layers can be added, not removed "
                         f"or replaced")
    return [ids.index(i) for i in old]


def new_feature_layers(drafter: DFlashDraftModel, state: dict[str, torch.Tensor],
                       state_layer_ids: tuple[int, ...] | None = None) -> list[int]:
    """The drafter's target layer ids that `state` does not read (init_from zeroes their fc
    columns); [] when `state` has no fc."""
    if _FC not in state:
        return []
    old = set(init_layer_ids(drafter, state, state_layer_ids))
    return [i for i in drafter.config.target_layer_ids if i not in old]


def _fc_blocks(dst: torch.Tensor, src: torch.Tensor) -> int | None:
    """How many H-column blocks `src` (an init's fc.weight) has when it fits `dst` [H, n*H] as whole
    blocks (same H rows, a multiple of H columns), else None."""
    h = dst.shape[0]
    if src.dim() != 2 or dst.dim() != 2 or src.shape[0] != h or src.shape[1] == 0 or src.shape[1] % h:
        return None
    return src.shape[1] // h


def _copy_feature_blocks(drafter: DFlashDraftModel, dst: torch.Tensor, src: torch.Tensor,
                         state_layer_ids: tuple[int, ...] | None) -> None:
    """init_from's fc: `src`'s blocks to the positions of their ids in the drafter's order
    (feature_block_positions), the other blocks zeroed."""
    h = dst.shape[0]
    positions = feature_block_positions(drafter.config.target_layer_ids, src.shape[1] // h,
                                        drafter.config.num_target_layers, state_layer_ids)
    if positions == list(range(dst.shape[1] // h)):  # the same ids in the same order
        dst.copy_(src)
        return
    dst.zero_()  # the new ids' blocks: their features add nothing until trained
    for j, p in enumerate(positions):
        dst[:, p * h:(p + 1) * h] = src[:, j * h:(j + 1) * h]


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
