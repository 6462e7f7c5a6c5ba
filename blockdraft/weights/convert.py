"""GGUF file -> HF-format folder (config.json, bf16 model.safetensors, tokenizer + chat template).

Tensors are dequantized with the `gguf` package (every quant type it knows: Q4_0..Q8_0, K-quants,
...) rather than through `AutoModelForCausalLM.from_pretrained(gguf_file=...)`: that path needs
`accelerate`, which blockdraft does not depend on, and holds the whole fp32 model in memory. The
result is the same as transformers' GGUF loader (same `gguf` dequantization, same q/k un-permute,
same names); the slow test checks this on SmolLM2. Config and tokenizer come from transformers'
GGUF metadata parsers (`AutoConfig` / `AutoTokenizer` with `gguf_file=`), which need no weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

# GGUF `general.architecture` -> HF class; llama.cpp permutes q/k rows only for "llama".
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_PERMUTED_QK_ARCHS = {"llama"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name for a llama.cpp tensor name ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); None if the name is not a known one."""
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{kind}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its convert script interleaves the two rotary halves
    of each head). `w`: [n_head * head_dim, ...] (a weight or a bias); `n_head`: heads in `w`
    (num_key_value_heads for k)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_architecture(reader) -> str:
    """`general.architecture` of an open `gguf.GGUFReader`.

    Raises:
        ValueError: the architecture is missing or not supported (lists the supported ones).
    """
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHS)}")
    return arch


def build_hf_config(gguf_path: Path, arch: str, tied: bool):
    """The transformers config parsed from the GGUF metadata, made loadable as a plain HF folder:
    `architectures` set, `tie_word_embeddings` from whether the file has an `output.weight`,
    dtype bfloat16, no quantization config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config.architectures = [GGUF_ARCHS[arch]]
    config.tie_word_embeddings = tied
    config.dtype = "bfloat16"
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded config may carry one; the folder is plain bf16
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path  # the GGUF's general.name, not a hub id; keep it out of config.json
    return config


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for `config`, from a model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    return shapes


def read_gguf_tensors(reader, arch: str, config, source: Path, dtype=torch.bfloat16, progress: bool = True) -> dict:
    """Dequantize every tensor of `reader` into HF-named torch tensors of `dtype`.

    Raises:
        ValueError: a tensor name this converter does not know (naming it and the file).
    """
    import gguf
    from tqdm.auto import tqdm

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", file=sys.stderr, disable=not progress):
        name = hf_tensor_name(t.name)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} ({arch}) has no known HF name; cannot convert {source}")
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if arch in _PERMUTED_QK_ARCHS and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, heads)
        elif arch in _PERMUTED_QK_ARCHS and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, kv_heads)
        # F32 tensors come back as read-only views of the memory map; copy only those.
        out[name] = torch.from_numpy(np.require(w, requirements=["C", "W"])).to(dtype)
    return out


def check_tensors(state: dict, shapes: dict, source: Path) -> None:
    """Raise ValueError (naming `source`) unless `state` has exactly the expected names and shapes."""
    missing = sorted(set(shapes) - set(state))
    extra = sorted(set(state) - set(shapes))
    if missing or extra:
        raise ValueError(f"{source}: tensors do not match the model; missing {missing[:5]}, unexpected {extra[:5]}")
    for k, shape in shapes.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"{source}: tensor {k} has shape {tuple(state[k].shape)}, expected {shape}")


def save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Write the GGUF's tokenizer (tokenizer.json, tokenizer_config.json, chat template) to `out_dir`.

    Raises:
        ValueError: the GGUF has no chat template (blockdraft serves chat models only).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template:
        raise ValueError(f"{gguf_path}: the GGUF has no tokenizer.chat_template; blockdraft needs a chat model")
    tok.save_pretrained(str(out_dir))


def convert_gguf_to_folder(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config.json, model.safetensors (bf16) and the tokenizer files for `gguf_path` into
    the existing folder `out_dir`. Not atomic: the caller writes into a temp folder and renames.

    Raises:
        ValueError: unsupported architecture, unknown or missing tensors, no chat template.
    """
    import gguf

    from blockdraft.weights.save import save_safetensors

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = gguf_architecture(reader)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = build_hf_config(gguf_path, arch, tied)
    state = read_gguf_tensors(reader, arch, config, gguf_path, progress=progress)
    del reader  # drops the memory map before the big write
    check_tensors(state, expected_shapes(config), gguf_path)
    save_safetensors(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    config.save_pretrained(str(out_dir))
    save_tokenizer(gguf_path, out_dir)
