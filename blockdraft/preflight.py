"""Every check that needs only the arguments and config.json files, run before any weights load.

Loading a target takes seconds to minutes; a typo in --draft, an out-of-range K or a bad --device
must not wait for it. `preflight` resolves and checks, in order:

1. the argument values alone: device, dtype, KV cache and scheduler sizes, the K type;
2. the drafter folder (`auto` / `shipped` resolved) and its config.json, K against its block size,
   and the draft vocabulary size against its draft_vocab.json;
3. the target's config.json (a catalog model is fetched first if not cached), the drafter
   against it (hidden size, vocab, target layer ids; the draft vocabulary's ids), and max_model_len
   against its max_position_embeddings and a pool of known size.

`LLM` calls it before `load_target`; the CLI commands call it (through `LLM` or directly) before
any other expensive step. Each check itself lives with the thing it checks (CacheConfig,
DFlashConfig, ...); this module only makes sure they all run first.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from blockdraft.config import (CacheConfig, ModelConfig, SchedulerConfig, default_max_num_batched_tokens,
                               resolve_max_model_len)
from blockdraft.errors import param_error

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
DEVICE_CHOICES = ("cpu", "cuda", "auto")
CPU_NUM_KV_BLOCKS = 1024  # the CPU pool when num_kv_blocks is not given (more if max_model_len needs it)


def resolve_device(device: str) -> str:
    """"cpu" | "cuda" | "auto" (CUDA when available) -> "cpu" or "cuda".

    Raises:
        ValueError: another value, or "cuda" without a CUDA device.
    """
    import torch

    if device not in DEVICE_CHOICES:
        raise param_error("device", f"device must be one of {list(DEVICE_CHOICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise param_error("device", "device 'cuda' asked for but torch sees no CUDA device (use 'cpu' or 'auto')")
    return device


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype names for them


def dtype_name(dtype):
    """A torch.dtype of DTYPE_NAMES (torch.float32, ...) as its name ("float32"), and vLLM's
    aliases "half" / "float" as "float16" / "float32", as vLLM takes them; anything else is
    returned unchanged, for check_dtype to judge."""
    import torch

    if isinstance(dtype, torch.dtype):
        return next((n for n in DTYPE_NAMES if getattr(torch, n) == dtype), dtype)
    return DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype


def check_dtype(dtype: str) -> str:
    """Raise ValueError naming `dtype` unless it is one of DTYPE_CHOICES; returns it."""
    if dtype not in DTYPE_CHOICES:
        raise param_error("dtype", f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    return dtype


def read_target_config(model: str, cache_dir: str | None = None) -> tuple[Path, dict, ModelConfig]:
    """(folder, config.json dict, ModelConfig) of a catalog name / HF folder / .gguf; no weights read.

    A catalog model not yet in the cache is fetched (and a .gguf converted) first: its config
    comes with the download.
    Raises:
        ValueError: unknown model, missing or corrupt config.json, unsupported architecture, or a
            DFlash drafter folder given as the model.
    """
    from blockdraft.weights.fetch import resolve_model_path
    from blockdraft.weights.loader import load_hf_config

    path = resolve_model_path(model, cache_dir=cache_dir)
    hf_config = load_hf_config(path)
    if "dflash_config" in hf_config or "DFlashDraftModel" in (hf_config.get("architectures") or []):
        raise ValueError(f"{path} is a DFlash drafter (its config.json has dflash_config), not a target model: "
                         f"give it as the draft, with the target it was trained for as the model")
    try:
        config = ModelConfig.from_hf_dict(hf_config)
    except KeyError as e:
        raise ValueError(f"{path}/config.json has no {e} entry; expected an HF-format model config") from e
    return path, hf_config, config


@dataclass(frozen=True)
class Preflight:
    """What `preflight` resolved: use these values, not the raw arguments.

    target_path: the target's folder; None when a loaded target's config was passed in.
    draft: the drafter folder (None: plain decoding); num_speculative_tokens: K (None without one).
    draft_vocab_size: ranked ids the drafter's LM head scores (0: the full vocabulary; see
        blockdraft.spec.draft_vocab).
    """

    device: str
    cache: CacheConfig
    scheduler: SchedulerConfig
    target_config: ModelConfig
    target_path: Path | None = None
    draft: str | None = None
    drafter_config: object | None = None  # DFlashConfig
    num_speculative_tokens: int | None = None
    draft_vocab_size: int = 0


def preflight(
    model: str | None = None,
    draft: str | None = None,
    num_speculative_tokens: int | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    kv_block_size: int = 16,
    num_kv_blocks: int | None = None,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int = 64,
    cache_dir: str | None = None,
    target_config: ModelConfig | None = None,
    draft_vocab_size: int | None = None,
    enable_prefix_caching: bool = False,
    max_model_len: int | None = None,
    notes: list[str] | None = None,
) -> Preflight:
    """Check the settings of an `LLM` (same argument meanings) without loading any weights.

    `target_config`: the config of an already loaded target (then `model` only names the catalog
    entry whose shipped drafter `draft="auto" | "shipped"` picks); else `model` is resolved and
    its config.json read. `draft`: a folder, "auto", "shipped" or None (plain).
    `draft_vocab_size`: 0 = full vocabulary, N = the drafter folder's N most frequent ids, None =
    the size recorded in its speculative.json, else 0 (resolve_draft_vocab_size).
    `max_model_len`: the context length in tokens (None: the model's, capped by the pool); on the
    CPU without num_kv_blocks the pool has CPU_NUM_KV_BLOCKS pages, or as many as it takes.
    `notes`: where the warning of `draft="auto"` decoding plainly goes instead of the log
    (resolve_draft), for the caller to log after its own checks.
    Raises:
        ValueError / FileNotFoundError: the first bad setting, naming the value and what is allowed.
    """
    from blockdraft.weights.catalog import DEFAULT_MODEL

    model = model or DEFAULT_MODEL
    # 1. The values alone.
    if not isinstance(model, (str, os.PathLike)):
        raise param_error("model", f"model must be a catalog name or a path (str), got {type(model).__name__} {model!r:.40}")
    device = resolve_device(device)
    check_dtype(dtype)
    SchedulerConfig(max_model_len=max_model_len)  # its type, before the pool size uses it
    cpu_default_pool = num_kv_blocks is None and device != "cuda"
    cache = CacheConfig(kv_block_size, CPU_NUM_KV_BLOCKS if cpu_default_pool else num_kv_blocks,
                        gpu_memory_utilization, enable_prefix_caching)
    if cpu_default_pool and max_model_len is not None:
        # an explicit context gets a default pool that holds it (`generate` has no pool size flag)
        pages = max(CPU_NUM_KV_BLOCKS, -(-max_model_len // kv_block_size))
        cache = dataclasses.replace(cache, num_kv_blocks=pages)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_max_num_batched_tokens(device)
    sched = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len)
    if draft is not None and not isinstance(draft, (str, os.PathLike)):
        raise param_error("draft", f"draft must be a drafter folder, 'auto', 'shipped' or None, got {draft!r}",
                          TypeError)
    if draft is not None and not str(draft).strip():
        raise param_error("draft", "draft is empty: give a drafter folder, 'auto', 'shipped' or None (plain decoding)")
    # K's type; its range needs the drafter's block size (step 2)
    n = num_speculative_tokens
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise param_error("num_speculative_tokens", f"num_speculative_tokens must be an integer >= 1, got {n!r}")
    # 2. The drafter's config.json, and K against its block size.
    drafter_config = k = None
    vocab_n = 0
    if draft is not None:
        from blockdraft.drafters import resolve_draft
        from blockdraft.spec.dflash.checkpoint import (
            check_drafter_fits,
            read_drafter_config,
            resolve_draft_vocab_size,
            resolve_num_speculative_tokens,
        )

        draft = resolve_draft(draft, model, cache_dir=cache_dir, num_speculative_tokens=num_speculative_tokens,
                              device_type=device, draft_vocab_size=draft_vocab_size, notes=notes)
    elif num_speculative_tokens is not None:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} needs a drafter: pass draft= a drafter "
                         f"folder, 'shipped' or 'auto' (draft=None decodes plainly)")
    if draft is not None:
        draft = str(draft)
        drafter_config = read_drafter_config(draft)
        # device is "cpu" or "cuda" here; speculative.json may record K per device type
        k = resolve_num_speculative_tokens(num_speculative_tokens, draft, drafter_config, device)
        # the drafter's vocabulary is the target's (check_drafter_fits): the range named starts at its minimum
        vocab_n = resolve_draft_vocab_size(draft_vocab_size, draft, drafter_config.vocab_size, device)
    elif draft_vocab_size not in (None, 0):
        raise param_error("draft_vocab_size", f"draft_vocab_size {draft_vocab_size!r} needs a drafter; give draft "
                          "(a drafter folder, 'shipped' or 'auto'), or leave draft_vocab_size out / 0 for plain decoding")
    # 3. The target's config.json, and the drafter against it.
    path = None
    if target_config is None:
        path, _, target_config = read_target_config(model, cache_dir)
    if drafter_config is not None:
        check_drafter_fits(drafter_config, draft, target_config)
    if max_model_len is not None:  # against a pool sized from GPU memory: build_runner, after profiling
        resolve_max_model_len(max_model_len, target_config.max_position_embeddings, cache.num_kv_blocks,
                              cache.kv_block_size)
    if vocab_n:
        from blockdraft.spec.draft_vocab import load_draft_vocab

        load_draft_vocab(draft, vocab_n, target_config.vocab_size)  # its ids against the target's vocabulary
    return Preflight(device, cache, sched, target_config, path, draft, drafter_config, k, vocab_n)
