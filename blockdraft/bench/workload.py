"""What a benchmark runs on: the models (HF, ours, drafter), the prompts and the device.

Two sources: a named shape with random weights (bench/shapes.py), or a real model (catalog name,
HF folder or .gguf) with an optional drafter and held-out HumanEval / MT-bench prompts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from blockdraft.config import ModelConfig
from blockdraft.model_loader import LoadedTarget
from blockdraft.spec.dflash.draft_model import DFlashDraftModel

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Workload:
    """Everything the engines share.

    hf_model: transformers model with the target's weights (HF baseline and z-lab's target).
    target: our loaded target. drafter: our DFlash drafter (None: no DFlash rows).
    prompts: token-id prompts, at least as many as the largest batch (batch N uses the first N).
    pad_token_id: left-padding id for HF. source: how it was made (goes into the JSON; its "draft",
        the drafter folder of model_workload, also gives the bench its default K: suite.num_speculative_tokens).
    draft_head: the drafter's draft vocabulary (blockdraft.spec.draft_vocab; None: full vocabulary).
    """

    name: str
    device: torch.device
    dtype: torch.dtype
    hf_model: object
    target: LoadedTarget
    drafter: DFlashDraftModel | None
    prompts: list[list[int]]
    pad_token_id: int = 0
    source: dict = field(default_factory=dict)
    draft_head: object | None = None  # DraftHead

    @property
    def config(self) -> ModelConfig:
        return self.target.config


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """device "auto" | "cuda" | "cpu" (auto: cuda if available); dtype "auto" -> bf16 on CUDA,
    fp32 on the CPU.

    Raises:
        ValueError: unknown device or dtype, or cuda asked for without a CUDA device.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (use --device cpu or auto)")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {list(DTYPES)}, got {dtype!r}")
    return dev, DTYPES[dtype]


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` distinct prompts of `length` uniform random token ids (seeded, CPU generator).

    Raises:
        ValueError: num or length < 1.
    """
    if num < 1 or length < 1:
        raise ValueError(f"need num >= 1 prompts of length >= 1, got num={num}, length={length}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num, length), generator=gen).tolist()


def check_fits_in_memory(shape, dtype: torch.dtype, fraction: float = 0.8) -> None:
    """Refuse to build `shape`'s random weights in host memory when they alone (every layer, the
    LM head and an untied input embedding, in `dtype`) exceed `fraction` of the machine's physical
    memory (e.g. Qwen3-8B in fp32: ~33 GB), instead of swapping or being killed minutes later.

    Raises:
        ValueError: names the shape, the gigabytes it needs and the machine has, and what fits.
    """
    from blockdraft.bench.shapes import model_config, weight_bytes_per_forward

    config = model_config(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    need = weight_bytes_per_forward(config, itemsize)  # counts a tied embedding once, as the head
    if not config.tie_word_embeddings:
        need += config.vocab_size * config.hidden_size * itemsize
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform: do not guess
        return
    if need > fraction * have:
        raise ValueError(
            f"the {shape.name} shape needs ~{need / 1e9:.0f} GB of {str(dtype).replace('torch.', '')} weights in host "
            f"memory, and this machine has {have / 1e9:.0f} GB: on the CPU use a smaller --shape (tiny, "
            "qwen2.5-0.5b), or run it on a GPU"
        )


def random_workload(
    shape_name: str, device: torch.device, dtype: torch.dtype, *, num_prompts: int, prompt_len: int,
    draft_layers: int | None, block_size: int, with_drafter: bool = True, seed: int = 0, draft_vocab_size: int = 0,
) -> Workload:
    """Random weights of a named shape on `device`, shared by HF and ours; a random drafter of
    `draft_layers` (default: the shape's) DFlash layers and block size `block_size`.
    draft_vocab_size N > 0: a draft head over ids 0..N-1 (random weights have no frequencies; this
    measures the cost of an N-column draft head, e.g. with forced acceptance), checked by the caller.

    Raises:
        ValueError: unknown shape, bad drafter sizes, prompts too long for the shape's context, or
            (on the CPU) weights larger than 80 % of the machine's memory.
    """
    from blockdraft.bench.random_weights import random_drafter_on_device, random_target
    from blockdraft.bench.shapes import get_shape

    shape = get_shape(shape_name)
    if torch.device(device).type == "cpu":
        check_fits_in_memory(shape, dtype)
    hf, target = random_target(shape, dtype, device, seed)
    layers = draft_layers or shape.draft_layers
    drafter = None
    if with_drafter:
        drafter = random_drafter_on_device(target.config, layers, block_size, dtype, device, seed + 1)
    prompts = random_prompts(num_prompts, prompt_len, target.config.vocab_size, seed)
    source = {"shape": shape.name, "description": shape.description, "weights": "random", "prompt_len": prompt_len,
              "draft_layers": layers if with_drafter else None}
    head = None
    if drafter is not None and draft_vocab_size:
        from blockdraft.spec.draft_vocab import DraftHead

        head = DraftHead.from_target(target.model, torch.arange(draft_vocab_size, device=device))
        source["draft_vocab_size"] = draft_vocab_size
    return Workload(shape.name, device, dtype, hf, target, drafter, prompts, 0, source, head)


def model_workload(
    model: str, draft: str | None, device: torch.device, dtype: torch.dtype, *, dataset: str, num_prompts: int,
    cache_dir: str | None = None, draft_vocab_size: int = 0, load_hf: bool = True,
) -> Workload:
    """A real model (ours via load_target, HF via from_pretrained on the same folder unless
    load_hf=False: then hf_model is None and only our engines can run), its drafter folder (or
    None), and the first `num_prompts` prompts of `dataset` ("humaneval" | "mtbench") through the
    chat template (cycled when the dataset has fewer).

    Raises:
        ValueError / FileNotFoundError: from model / drafter resolution or an unknown dataset.
    """
    from transformers import AutoModelForCausalLM

    from blockdraft.model_loader import load_target
    from blockdraft.spec.dflash.checkpoint import load_drafter
    from blockdraft.spec.draft_vocab import build_draft_head
    from blockdraft.training.corpora import eval_prompts
    from blockdraft.weights.fetch import resolve_model_path

    name = {v: k for k, v in DTYPES.items()}[dtype]
    texts = eval_prompts(dataset, cache_dir)  # before the weights: an unknown dataset fails at once
    path = resolve_model_path(model, cache_dir=cache_dir)
    target = load_target(str(path), name, str(device), cache_dir)
    hf = None
    if load_hf:  # the HF baseline's and z-lab's target: skipped when neither runs (an 8B copy is minutes)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval().requires_grad_(False)
    drafter = load_drafter(draft, target.config, dtype=dtype, device=device) if draft else None
    head = build_draft_head(target.model, draft, draft_vocab_size) if draft else None
    tok = target.tokenizer
    prompts = [encode_chat(tok, texts[i % len(texts)]) for i in range(num_prompts)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    source = {"model": model, "path": str(path), "draft": draft, "dataset": dataset, "weights": "checkpoint",
              "num_distinct_prompts": min(num_prompts, len(texts)), "draft_vocab_size": draft_vocab_size}
    return Workload(model, device, dtype, hf, target, drafter, prompts, int(pad), source, head)


def encode_chat(tokenizer, user_text: str) -> list[int]:
    """One user turn through the chat template with the assistant cue (as LLM.encode_chat)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
