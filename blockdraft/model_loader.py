"""Load a target model: resolve its name, dtype and folder, build our model, load its weights and
tokenizer (`load_target`), and the facts about it the engine needs (`eos_token_ids`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from blockdraft import generation_config
from blockdraft.config import ModelConfig
from blockdraft.layers.linear import cpu_has_fast_bf16
from blockdraft.preflight import check_dtype, read_target_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedTarget:
    """A target model ready to run: its config, module, tokenizer and folder."""

    config: ModelConfig
    model: torch.nn.Module
    tokenizer: object
    path: str

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the target's weights (and so its KV cache and the drafter) run in."""
        return next(self.model.parameters()).dtype


def load_target(model: str, dtype: str = "auto", device: str = "cpu", cache_dir: str | None = None,
                pack_weights: bool | None = None) -> LoadedTarget:
    """Resolve a catalog name / folder / .gguf, then build our model and load its weights.

    dtype: "auto" takes the checkpoint's dtype (bf16 for the catalog models; like vLLM's "auto"),
    except that float32 checkpoints run in bfloat16 on CUDA, and bf16 / fp16 ones in float32 on a
    CPU without native bf16 (AVX2 only: `cpu_has_fast_bf16`); or one of float32 / bfloat16 / float16.
    pack_weights: as `blockdraft.models.build_model` (None: packed for CPU inference where
    supported); False when gradients must flow through the target (drafter training: the frozen
    LM head).
    Raises:
        ValueError: unknown model name or dtype, unsupported architecture, corrupt weights.
    """
    from blockdraft.models import build_model
    from blockdraft.weights.loader import LazyStateDict, load_tokenizer

    check_dtype(dtype)
    path, hf_config, config = read_target_config(model, cache_dir)
    module = build_model(config, dtype=resolve_dtype(dtype, hf_config, device), device=device,
                         pack_weights=pack_weights)
    # Tensors are read one at a time and packing starts after the last copy: peak memory is the
    # weights plus one tensor, then plus the packed copies as the dense ones are dropped.
    module.load_weights(LazyStateDict(path), pack=False)
    module.pack_loaded_weights()
    module.eval()
    return LoadedTarget(config, module, load_tokenizer(path), str(path))


def catalog_name(path: str) -> str:
    """The catalog name of a target loaded from the folder `fetch` made for it
    (weights.fetch.catalog_name_of), else `path` itself (which names no shipped drafter, so
    draft="auto" decodes plainly and "shipped" explains why)."""
    from blockdraft.weights.fetch import catalog_name_of

    return catalog_name_of(str(path))


def resolve_dtype(dtype: str, hf_config: dict, device: str = "cpu") -> torch.dtype:
    """The torch dtype `load_target` builds the model in (its docstring gives the "auto" rule).

    hf_config: the checkpoint's config.json (its "dtype" / "torch_dtype", float32 when absent).
    Raises:
        ValueError: `dtype` is not "auto" or one of DTYPE_CHOICES' names (names the value).
    """
    check_dtype(dtype)
    if dtype != "auto":
        return _DTYPES[dtype]
    stored = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    resolved = _DTYPES.get(str(stored).replace("torch.", ""), torch.float32)
    # On the GPU, fp32 weights would halve the speed for no accuracy users ask for (vLLM's "auto"
    # downcasts too); bf16 rather than fp16: same range as fp32, no overflow.
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if resolved == torch.float32 else resolved
    # A CPU without native bf16 (AVX2 only) would convert bf16 weights on every matmul and cannot
    # pack them for oneDNN: fp32 there (as vLLM's CPU backend falls back from bf16).
    if resolved in (torch.bfloat16, torch.float16) and not cpu_has_fast_bf16():
        return torch.float32
    return resolved


# The end-of-text / end-of-turn markers llama.cpp also ends generation on for a GGUF model (a
# subset of llama-vocab.cpp's end-of-generation token texts; it also reads the GGUF's eot / eom ids,
# which the converted folder does not keep). An HF release lists them in its generation_config.json
# instead (Qwen2.5: eos_token_id [151645 <|im_end|>, 151643 <|endoftext|>]), which vLLM adds to the
# stop ids; a GGUF carries no generation_config.json.
GGUF_END_OF_GENERATION = ("<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                          "<end_of_turn>", "<end_of_utterance>", "<|return|>", "<|call|>", "<EOT>", "_<EOT>")


def eos_token_ids(target: LoadedTarget) -> tuple[int, ...]:
    """The target's stop ids, sorted (`model_eos_ids` of its folder, config and tokenizer).

    Raises:
        ValueError: as `model_eos_ids`.
    """
    return model_eos_ids(target.path, target.config.eos_token_ids, target.tokenizer)


def model_eos_ids(path, config_eos: Sequence[int], tokenizer) -> tuple[int, ...]:
    """A model's stop ids, sorted: config.json's eos_token_id(s) (`config_eos`), the tokenizer's
    EOS, and the end-of-generation ids a user of the model expects to stop on: generation_config.json's
    eos_token_id(s) when the folder `path` has one (as vLLM), else, for a folder converted from a
    GGUF, the tokenizer's special tokens named in GGUF_END_OF_GENERATION (as llama.cpp). For the
    catalog Qwen2.5 models: (151643 <|endoftext|>, 151645 <|im_end|>); SmolLM2: (0, 2), the same pair.

    Raises:
        ValueError: a generation_config.json that is not a JSON object or whose eos_token_id is not
            an int or a list of ints (names the file and the value).
    """
    ids = {int(i) for i in config_eos}
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(int(tok_eos))
    folder = Path(path)
    if not folder.is_dir():  # a model built in memory (tests, random-weight shapes)
        return tuple(sorted(ids))
    gen_file = folder / generation_config.GENERATION_CONFIG_FILE
    if gen_file.is_file():
        ids.update(_generation_config_eos(gen_file))
    elif _converted_from_gguf(folder):
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids.update(int(i) for i, tok in added.items()
                   if getattr(tok, "special", False) and getattr(tok, "content", None) in GGUF_END_OF_GENERATION)
    return tuple(sorted(ids))


def _generation_config_eos(file: Path) -> set[int]:
    """generation_config.json's eos_token_id(s) (an int, a list of ints, or absent / null)."""
    value = generation_config.read_file(file).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{file}: eos_token_id must be a token id >= 0 or a list of them, got {value!r}")
    return set(values)


def _converted_from_gguf(folder: Path) -> bool:
    """True for a folder `blockdraft fetch` / a .gguf path converted (its marker names the GGUF)."""
    from blockdraft.weights.fetch import MARKER

    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and "gguf" in marker
