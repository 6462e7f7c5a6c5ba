"""Model shapes for random-weight benchmarks, and the memory-traffic floor of a decode step.

A shape is the architecture part of a real checkpoint's config.json (no weights): with random
weights of that shape, step costs at 8B scale can be measured without shipping 16 GB of weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockdraft.config import ModelConfig

# Sustained HBM read bandwidth of an H200 used for the floor (B/s): the figure; a plain
# device-to-device copy on the lent H200 measured ~4.3e12.
H200_HBM_BYTES_PER_S = 4.25e12


@dataclass(frozen=True)
class Shape:
    """A named architecture: the transformers `model_type`, its config fields, drafter defaults.

    hf_fields are passed to `transformers.AutoConfig.for_model(model_type, **hf_fields)`.
    draft_layers: default depth of the random DFlash drafter for this shape.
    """

    name: str
    model_type: str
    hf_fields: dict = field(default_factory=dict)
    draft_layers: int = 5
    description: str = ""


_QWEN_VOCAB = dict(vocab_size=151936, bos_token_id=151643, eos_token_id=151645)

SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            "qwen3-8b",
            "qwen3",
            dict(
                hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=12288, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False, **_QWEN_VOCAB,
            ),
            draft_layers=5,
            description="Qwen3-8B: hidden 4096, 36 layers, 32/8 heads x 128, FFN 12288, qk-norm, untied",
        ),
        Shape(
            "qwen2.5-0.5b",
            "qwen2",
            dict(
                hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                tie_word_embeddings=True, use_sliding_window=False, **_QWEN_VOCAB,
            ),
            draft_layers=5,
            description="Qwen2.5-0.5B: hidden 896, 24 layers, 14/2 heads x 64, FFN 4864, q/k/v bias, tied",
        ),
        Shape(
            "tiny",
            "qwen3",
            dict(
                hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=2048,
                tie_word_embeddings=False, attention_bias=False, vocab_size=512,
            ),
            draft_layers=2,
            description="tiny Qwen3 for CPU smoke tests: hidden 64, 6 layers, 4/2 heads x 16, vocab 512",
        ),
    )
}


def get_shape(name: str) -> Shape:
    """The shape called `name`.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


def hf_config(shape: Shape):
    """The transformers config object of `shape` (a PretrainedConfig subclass)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(shape.model_type, **shape.hf_fields)


def model_config(shape: Shape) -> ModelConfig:
    """Our normalised config of `shape` (through the same path as a checkpoint's config.json)."""
    return ModelConfig.from_hf_dict(hf_config(shape).to_dict())


def weight_bytes_per_forward(config: ModelConfig, bytes_per_param: int) -> int:
    """Bytes of weights a decode forward must read from memory: every decoder layer, the final norm
    and the LM head; the input embedding only for a tied head (a lookup reads a few rows otherwise).

    Counts parameters analytically (q/k/v/o, optional biases and q/k norms, gated MLP, two norms per
    layer). Multiply by the dtype size given in `bytes_per_param` (2 for bf16).
    """
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    attn = h * q + 2 * h * kv + q * h
    if config.attention_bias:
        attn += q + 2 * kv + (h if config.arch != "qwen2" else 0)
    if config.qk_norm:
        attn += 2 * d
    layer = attn + 3 * h * config.intermediate_size + 2 * h
    head = config.vocab_size * h  # the LM head, or the tied embedding used as the head
    return (config.num_hidden_layers * layer + h + head) * bytes_per_param


def dflash_extra_bytes(drafter_params: int, config: ModelConfig, bytes_per_param: int) -> int:
    """Weight bytes a DFlash step reads beyond the target forward: all the drafter's parameters
    (fc, hidden_norm, layers, norm) plus the target's LM head a second time (drafts are scored
    with it). `drafter_params` is the drafter's parameter count."""
    return (drafter_params + config.vocab_size * config.hidden_size) * bytes_per_param


def hbm_floor_ms(num_bytes: int, bytes_per_s: float = H200_HBM_BYTES_PER_S) -> float:
    """Milliseconds to stream `num_bytes` at `bytes_per_s` (the memory-bound floor of a step)."""
    if bytes_per_s <= 0:
        raise ValueError(f"HBM bandwidth must be > 0 B/s, got {bytes_per_s}")
    return num_bytes / bytes_per_s * 1e3
