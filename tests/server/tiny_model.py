"""Write a tiny random Llama model folder (HF format) that `blockdraft serve --model DIR` loads.

Shared by the server tests and scripts/load_server.py. The tokenizer is the word-level test
tokenizer (token i is "w{i:02d}x", 0 is "<eos>"), so any text made of such words round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 96
EOS_ID = 0

# Roles become words of the vocabulary so that templated prompts are in-vocabulary tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}w01x{% elif m['role'] == 'user' %}w02x{% else %}w03x{% endif %} "
    "{{ m['content'] }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}w03x{% endif %}"
)

_SHAPE = dict(hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16)


def word(i: int) -> str:
    """Text of token i."""
    return f"w{i:02d}x"


def hf_config() -> dict:
    """config.json of the tiny model (HF Llama format)."""
    s = _SHAPE
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": s["hidden"], "intermediate_size": s["intermediate"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "attention_bias": False, "eos_token_id": EOS_ID, "torch_dtype": "float32",
    }


def random_state_dict(seed: int = 0, std: float = 0.08, logit_scale: float = 4.0) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights ~ N(0, std), norms 1; the LM head is scaled so outputs are not flat."""
    s, g = _SHAPE, torch.Generator().manual_seed(seed)
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

    def rnd(*shape):
        return torch.randn(shape, generator=g) * std

    sd = {"model.embed_tokens.weight": rnd(VOCAB, h), "model.norm.weight": torch.ones(h)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(s["intermediate"], h), p + "mlp.up_proj.weight": rnd(s["intermediate"], h),
            p + "mlp.down_proj.weight": rnd(h, s["intermediate"]),
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
        }
    sd["lm_head.weight"] = rnd(VOCAB, h) * logit_scale
    return sd


def make_tokenizer():
    """The word-level fast tokenizer, with the chat template set."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS_ID, **{word(i): i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_model(folder: str | Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer into `folder`; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(), indent=2))
    save_file({k: v.contiguous() for k, v in random_state_dict(seed).items()}, str(folder / "model.safetensors"))
    make_tokenizer().save_pretrained(str(folder))
    return folder


# With zero layer weights the drafter proposes one constant token (a function of the mask token);
# for mask token 51 that token starts runs in the tiny model's output, so some drafts get accepted
# (at several positions) and the spec counters are not all zero.
DRAFT_MASK_TOKEN = 51


def write_tiny_drafter(folder: str | Path, model_folder: str | Path, block_size: int = 8, seed: int = 0) -> Path:
    """A 1-layer DFlash drafter checkpoint for the tiny model (reads layers 0 and 2 of the target)."""
    from blockdraft.config import ModelConfig
    from blockdraft.spec.dflash.checkpoint import export_drafter, random_drafter

    cfg = ModelConfig.from_hf_dict(json.loads((Path(model_folder) / "config.json").read_text()))
    drafter = random_drafter(
        cfg, num_layers=1, block_size=block_size, target_layer_ids=(0, 2), seed=seed, init_std=0.0, mask_token_id=DRAFT_MASK_TOKEN
    )
    export_drafter(drafter, folder)
    return Path(folder)


def write_tiny_model_and_drafter(root: str | Path) -> tuple[Path, Path]:
    """The tiny model in `root`/model and its 1-layer drafter in `root`/drafter (write_tiny_drafter)."""
    model = write_tiny_model(Path(root) / "model")
    return model, write_tiny_drafter(Path(root) / "drafter", model)
