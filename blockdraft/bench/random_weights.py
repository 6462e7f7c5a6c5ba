"""Random-weight models of real shapes, built on the benchmark device, shared by every engine.

The HF model is built and initialised directly on the device in the benchmark dtype (a seeded
generator on that device: an 8B model takes well under a second on a GPU, where the CPU path of
`CausalLM.init_random_weights_` would take minutes); our target loads its state dict with
`load_weights`, and z-lab's drafter loads our drafter's state dict, so all engines run the same
weights.
"""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.bench.shapes import Shape, hf_config, model_config
from blockdraft.config import ModelConfig
from blockdraft.model_loader import LoadedTarget
from blockdraft.spec.dflash.draft_model import DFlashDraftModel


class IdTokenizer:
    """Tokenizer for token-id-only workloads: a token's text is its id (e.g. "17 4 9").

    Random-weight models have no vocabulary; the engine still detokenizes every output token, so
    this keeps that step (cheap here, cheaper than a BPE decode). `encode` is refused: benchmark
    prompts are token ids.
    """

    eos_token_id = None
    pad_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        del skip_special_tokens
        return " ".join(str(int(i)) for i in ids)

    def encode(self, text, **kwargs):
        raise ValueError("random-weight models have no vocabulary: give prompts as token ids")


@torch.no_grad()
def init_random_(module: nn.Module, seed: int, std: float = 0.02, norm_std: float = 0.0) -> nn.Module:
    """Fill every parameter in place on its own device and dtype: matrices and biases ~ N(0, std),
    norm weights ~ N(1, norm_std) (exactly 1 when norm_std is 0). One generator on the parameters'
    device, seeded with `seed`, visits the parameters in `named_parameters` order, so the result is
    deterministic per device type (CPU and CUDA fills differ). Returns `module`.

    Raises:
        ValueError: no parameters (e.g. weights packed for oneDNN), or parameters on more than one device.
    """
    devices = {p.device for p in module.parameters()}
    if len(devices) != 1:
        raise ValueError(f"expected parameters on exactly one device, found {sorted(map(str, devices))}")
    gen = torch.Generator(device=devices.pop()).manual_seed(seed)
    for name, p in module.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.normal_(1.0, norm_std, generator=gen) if norm_std else p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    return module


def fill_random_(module: nn.Module, std: float = 0.02, seed: int = 0) -> nn.Module:
    """`init_random_` with norm weights ~ N(1, 0.1), so that kernel tests exercise the norm weights."""
    return init_random_(module, seed, std, norm_std=0.1)


def random_hf_model(shape: Shape, dtype: torch.dtype, device, seed: int = 0):
    """transformers *ForCausalLM of `shape`, allocated on `device` in `dtype`, randomly initialised
    there (init_random_), in eval mode with gradients off."""
    from transformers import AutoModelForCausalLM

    config = hf_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    init_random_(model, seed)
    return model.eval().requires_grad_(False)


def our_target_from_hf(hf_model, config: ModelConfig, tokenizer, path: str = "<random>") -> LoadedTarget:
    """Our CausalLM on the HF model's device and dtype, holding a copy of its weights."""
    from blockdraft.models import build_model

    param = next(hf_model.parameters())
    model = build_model(config, dtype=param.dtype, device=param.device)
    model.load_weights(hf_model.state_dict())
    return LoadedTarget(config, model.eval(), tokenizer, path)


def random_target(shape: Shape, dtype: torch.dtype, device, seed: int = 0) -> tuple[object, LoadedTarget]:
    """(HF model, our LoadedTarget) of `shape` with identical random weights on `device`."""
    hf = random_hf_model(shape, dtype, device, seed)
    return hf, our_target_from_hf(hf, model_config(shape), IdTokenizer(), f"<random {shape.name}>")


def random_drafter_on_device(
    target_config: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype, device, seed: int = 1
) -> DFlashDraftModel:
    """A DFlash drafter of the released shape for `target_config` (layers copy the target's
    width, default target_layer_ids, mask token = vocab - 1), initialised on `device` in `dtype`.

    Raises:
        ValueError: num_layers < 1, block_size < 2, or a target too shallow for the layer ids.
    """
    from blockdraft.spec.dflash.checkpoint import empty_drafter

    drafter = empty_drafter(random_drafter_shape(target_config, num_layers, block_size), dtype, device)
    init_random_(drafter, seed)
    return drafter


def random_drafter_shape(target_config: ModelConfig, num_layers: int, block_size: int):
    """The DFlashConfig `random_drafter_on_device` builds (no weights: `blockdraft bench` checks
    its flags with it before building the random target).

    Raises:
        ValueError: num_layers < 1, block_size < 2, or a target too shallow for the layer ids.
    """
    from blockdraft.spec.dflash.checkpoint import random_drafter_config

    if num_layers < 1:
        raise ValueError(f"draft layers must be >= 1, got {num_layers}")
    if block_size < 2:
        raise ValueError(f"block size must be >= 2 (1 anchor + drafts), got {block_size}")
    return random_drafter_config(target_config, num_layers, block_size)


def zlab_drafter_from(drafter: DFlashDraftModel):
    """z-lab's `dflash.model.DFlashDraftModel` built from our drafter's exported config and
    holding its weights, on the same device and dtype (the reference for the same drafter).

    Raises:
        ImportError: the z-lab package (`dflash==0.1.0`) is not installed.
    """
    from dflash.model import DFlashDraftModel as ZLabDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config.from_dict(drafter.config.to_hf_dict())
    # _from_config builds under the dtype (as from_pretrained does), so the RoPE buffers stay fp32.
    with torch.device(drafter.device):
        zl = ZLabDraftModel._from_config(config, dtype=drafter.dtype)
    zl.load_state_dict(drafter.state_dict(), strict=True)
    return zl.eval().requires_grad_(False)
