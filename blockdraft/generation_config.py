"""The model's sampling defaults from its generation_config.json, as vLLM applies them
(`--generation-config auto`, vLLM's default; ModelConfig.get_diff_sampling_param).

A Hugging Face release may recommend sampling settings in generation_config.json (Qwen2.5:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). vLLM takes six keys from it and uses
them wherever a request leaves the field out: temperature, top_p, top_k, min_p, repetition_penalty,
and max_new_tokens as the default max_tokens. Other keys (do_sample, eos_token_id, ...) are not
sampling defaults and are ignored here (eos_token_id: model_loader.model_eos_ids). A folder
converted from a GGUF (every catalog model) has no such file: no defaults.

    generation_config="auto"   the model folder's generation_config.json (vLLM's default)
    generation_config="vllm"   no model defaults: the engine's own (vLLM's "vllm")
    generation_config=FOLDER   FOLDER/generation_config.json instead of the model's
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from blockdraft.errors import param_error

GENERATION_CONFIG_FILE = "generation_config.json"
MODES = ("auto", "vllm")  # or a folder path

# vLLM's keys, in its order (the start-up line lists them so); max_new_tokens becomes max_tokens
_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
_FLOAT32_MAX = 3.4028234663852886e38  # as SamplingParams: the values become float32 tensors


def check_generation_config(value) -> None:
    """Refuse a `generation_config` that is not "auto", "vllm" or a folder holding a
    generation_config.json (vLLM silently uses no defaults for a folder without one: here a typo
    in the path is said, before any weights load).

    Raises:
        ValueError: naming the value and what is allowed (param "generation_config").
    """
    allowed = f'"auto" (the model folder\'s {GENERATION_CONFIG_FILE}), "vllm" (none) or a folder holding a ' \
              f'{GENERATION_CONFIG_FILE}'
    if not isinstance(value, str) or not value:
        raise param_error("generation_config", f"generation_config must be {allowed}, got {value!r}")
    if value in MODES:
        return
    folder = Path(value)
    if not folder.is_dir():
        raise param_error("generation_config", f"generation_config must be {allowed}, got {value!r}, which is not "
                                               f"a folder")
    if not (folder / GENERATION_CONFIG_FILE).is_file():
        raise param_error("generation_config", f"generation_config must be {allowed}, got the folder {value!r}, "
                                               f"which has no {GENERATION_CONFIG_FILE}")


def source_file(model_path, generation_config: str = "auto") -> Path | None:
    """The generation_config.json whose sampling defaults apply, or None: mode "vllm", or "auto"
    with a model path that is not a folder (a model built in memory) or has no such file.

    Raises:
        ValueError: as check_generation_config.
    """
    check_generation_config(generation_config)
    if generation_config == "vllm":
        return None
    folder = Path(model_path) if generation_config == "auto" else Path(generation_config)
    file = folder / GENERATION_CONFIG_FILE
    return file if folder.is_dir() and file.is_file() else None


def read_file(file: Path) -> dict:
    """A generation_config.json as a dict (this module's sampling keys; model_loader's eos_token_id).

    Raises:
        ValueError: the file is not valid JSON / UTF-8, or holds no JSON object (names the file).
    """
    try:
        config = json.loads(Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not a JSON object: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object: got {type(config).__name__}")
    return config


def default_sampling_params(model_path, generation_config: str = "auto") -> dict:
    """The model's sampling defaults as SamplingParams fields ({} when none apply: `source_file`),
    e.g. Qwen2.5-Instruct's {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20,
    "top_p": 0.8}; a key absent or null in the file is left out, max_new_tokens is returned as
    max_tokens (output tokens). Read once, when a model loads.

    Raises:
        ValueError: generation_config refused (check_generation_config); a file that is not a
            JSON object; a value out of SamplingParams' range, naming the file, the key, the value
            and the range (temperature >= 0, top_p in (0, 1], top_k an integer >= -1 (0 / -1:
            off), min_p in [0, 1], repetition_penalty > 0, max_new_tokens an integer >= 1).
    """
    file = source_file(model_path, generation_config)
    if file is None:
        return {}
    config = read_file(file)
    out = {}
    for key in _KEYS:
        value = config.get(key)
        if value is None:  # vLLM skips null values too
            continue
        _check(file, key, value)
        out["max_tokens" if key == "max_new_tokens" else key] = float(value) if key in _FLOATS else int(value)
    return out


_FLOATS = ("repetition_penalty", "temperature", "top_p", "min_p")
_RANGES = {
    "temperature": ("a number >= 0 (0: greedy)", lambda v: 0 <= v <= _FLOAT32_MAX),
    "top_p": ("a number in (0, 1]", lambda v: 0 < v <= 1),
    "min_p": ("a number in [0, 1] (0: off)", lambda v: 0 <= v <= 1),
    "repetition_penalty": ("a number > 0 (1: off)", lambda v: 0 < v <= _FLOAT32_MAX),
    "top_k": ("an integer >= -1 (0 or -1: off)", lambda v: v >= -1),
    "max_new_tokens": ("an integer >= 1 (output tokens)", lambda v: v >= 1),
}


def _check(file: Path, key: str, value) -> None:
    """ValueError naming the file, key, value and the allowed range when `value` is outside it."""
    allowed, ok = _RANGES[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in _FLOATS:
        good = number and math.isfinite(value) and ok(value)
    else:  # a count: 20.0 is refused as transformers' GenerationConfig types it int
        good = isinstance(value, int) and not isinstance(value, bool) and ok(value)
    if not good:
        raise param_error("generation_config", f"{file}: {key} must be {allowed}, got {json.dumps(value)[:80]} (the "
                                               f"model's sampling default; fix the file, or give generation_config "
                                               f"\"vllm\" to ignore its sampling defaults)")


def overridden_message(defaults: dict, file, remedy: str) -> str:
    """The one line said when a model's defaults apply (vLLM's start-up warning, with the values
    and the file); `remedy` says how to turn them off (the flag or the keyword)."""
    return (f"Default sampling parameters have been overridden by the generation config {file}: {defaults}. If this "
            f"is not intended, {remedy}")
