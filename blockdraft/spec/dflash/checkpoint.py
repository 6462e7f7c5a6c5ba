"""Load / export DFlash drafter checkpoints in the z-lab format (config.json + *.safetensors).

Only safetensors are read (never pickles, never remote code). Format: DFLASH.md "Checkpoint format".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from blockdraft.config import ModelConfig
from blockdraft.errors import param_error
from blockdraft.spec.dflash.config import DFlashConfig, build_target_layer_ids, is_dflash_config
from blockdraft.spec.dflash.draft_model import DFlashDraftModel
from blockdraft.weights.save import save_safetensors

WEIGHTS_FILE = "model.safetensors"
# blockdraft's serving defaults for a drafter, kept next to (not inside) the z-lab config.json:
# z-lab, vLLM and SGLang ignore the file, and our DFlashConfig refuses unknown dflash_config keys.
SPECULATIVE_FILE = "speculative.json"


def load_drafter(
    path: str | Path, target_config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device="cpu"
) -> DFlashDraftModel:
    """Build a drafter from a checkpoint folder and check it against the target.

    Args:
        path: folder with config.json and one or more *.safetensors files.
        target_config: the target model's config (hidden size, vocab, depth are cross-checked).
        dtype, device: where the weights live.
    Raises:
        FileNotFoundError: no config.json or no *.safetensors in `path`.
        ValueError: config refused (DFlashConfig.from_hf_dict), target mismatch
            (validate_against_target), or weights that do not match the config (names the weight
            files and config.json, the missing, unexpected and misshapen tensors).
    """
    path = Path(path)
    config = read_drafter_config(path, target_config)
    model = empty_drafter(config, dtype, device)
    weights = _read_safetensors(path)
    try:
        model.load_weights(weights)
    except ValueError as e:  # name the files: the message alone does not say which drafter
        raise ValueError(f"{_weights_files(path)}: {e} ({path / 'config.json'})") from e
    return model


def _weights_files(path: Path) -> str:
    """The weight files _read_safetensors reads in drafter folder `path`, for messages: its
    *.safetensors, else its 8-bit pack."""
    from blockdraft.drafters.pack import PACK_FILE

    files = sorted(path.glob("*.safetensors")) or [path / PACK_FILE]
    return ", ".join(str(f) for f in files)


def read_drafter_config(path: str | Path, target_config: ModelConfig | None = None) -> DFlashConfig:
    """The drafter's config from `<path>/config.json`, checked against the target when given.

    Reads no weights: callers run it before loading anything (blockdraft.preflight).
    Raises:
        FileNotFoundError: `path` is not a folder, or has no config.json.
        ValueError: config.json is not valid JSON, is refused (DFlashConfig.from_hf_dict; one
            that is no DFlash drafter's at all, config.is_dflash_config, is named as such), or does
            not fit the target (validate_against_target); the message names the drafter folder or
            its config.json.
    """
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        # "none" / "off" read as "no drafter": say how to ask for that (the CLI's --no-draft, draft=None)
        off = "; to decode without a drafter: --no-draft (Python: draft=None)" if str(path).lower() in (
            "none", "off", "no", "false") else ""
        raise param_error("draft", f"drafter folder {str(path)!r} {what}; draft takes a DFlash checkpoint folder "
                                   f"(config.json + *.safetensors or model.int8), 'shipped' or 'auto'{off}",
                          FileNotFoundError)
    config_file = path / "config.json"
    if not config_file.is_file():
        nested = path / "drafter"  # train-drafter's --out holds data/, checkpoint/, drafter/
        hint = f" (did you mean {nested}?)" if (nested / "config.json").is_file() else ""
        raise param_error("draft", f"no config.json in drafter folder {str(path)!r}{hint}; draft takes a DFlash "
                                   "checkpoint folder (config.json + *.safetensors or model.int8), 'shipped' or "
                                   "'auto'", FileNotFoundError)
    try:
        raw = _read_json_object(config_file)
    except ValueError as e:
        raise param_error("draft", f"{e}; draft takes a DFlash checkpoint folder with a valid config.json") from e
    try:
        config = DFlashConfig.from_hf_dict(raw)
    except (ValueError, KeyError) as e:
        detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        if not is_dflash_config(raw):  # say what is missing, not a value of the absent block
            why = "" if detail.startswith("dflash_config") else f": {detail}"
            raise ValueError(f"{config_file} has no dflash_config (not a DFlash drafter checkpoint?){why}") from e
        if "dflash_config" not in raw and detail.startswith("dflash_config."):  # an older file: the keys on top
            detail += (f" ({config_file} has no dflash_config block: its DFlash values are read from the top level, "
                       f"as in older drafter configs)")
        raise ValueError(f"drafter {path}: {detail}") from e
    if target_config is not None:
        check_drafter_fits(config, path, target_config)
    return config


def check_drafter_fits(config: DFlashConfig, path: str | Path, target_config: ModelConfig) -> None:
    """DFlashConfig.validate_against_target, its message prefixed with the drafter folder.

    Raises:
        ValueError: hidden size, vocabulary or target layer ids that do not fit the target.
    """
    try:
        config.validate_against_target(target_config)
    except ValueError as e:
        raise param_error("draft", f"draft {str(path)!r} does not fit this target model: {e}; a DFlash drafter "
                                   "works only with the target it was trained for: give that target, this "
                                   "target's own drafter, or none") from e


def resolve_num_speculative_tokens(
    k: int | None, path: str | Path, config: DFlashConfig, device_type: str = "cpu"
) -> int:
    """K for the drafter in `path` on `device_type` ("cpu", "cuda"): `k` when given, else the
    folder's recorded K for that device (recommended_num_speculative_tokens), else block_size - 1;
    checked against the block size.

    Raises:
        ValueError: K outside [1, block_size - 1] (naming where it came from), bad speculative.json.
    """
    if k is not None:
        return config.check_num_speculative_tokens(k)
    recorded = recommended_num_speculative_tokens(path, device_type)
    if recorded is None:
        return config.block_size - 1
    try:
        return config.check_num_speculative_tokens(recorded)
    except ValueError as e:
        raise param_error("num_speculative_tokens", f"{Path(path) / SPECULATIVE_FILE}: {e} (recorded K for "
                                                    f"{device_type}; num_speculative_tokens overrides it)") from e


def empty_drafter(config: DFlashConfig, dtype: torch.dtype, device) -> DFlashDraftModel:
    """Allocate (not initialise) a drafter directly on `device` in `dtype`, in eval mode.

    Built on the meta device first: nn.Linear's default init of a ~1B-parameter drafter on the
    CPU would take seconds and a full fp32 copy. Weights are garbage until `load_weights`.
    """
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    model = model.to(dtype=dtype).to_empty(device=device)  # _apply also recomputes RoPE inv_freq
    return model.requires_grad_(False).eval()


def recommended_num_speculative_tokens(path: str | Path, device_type: str = "cpu") -> int | None:
    """K recorded in `<path>/speculative.json` for `device_type`, or None.

    The file records the drafts-per-step that measured fastest for this drafter: the top-level
    `num_speculative_tokens` (measured on a CPU by `python -m blockdraft.bench.spec_k`), and
    optionally `per_device: {"cuda": {"num_speculative_tokens": K, ...}}` for another device type,
    which wins there (a GPU verifies K + 1 rows for about the cost of one, a 2-core CPU does not).
    An explicit `num_speculative_tokens` always wins over both. Whether K fits the drafter's
    block size: resolve_num_speculative_tokens.
    Raises:
        ValueError: the file is not a JSON object, `per_device` or its entry is not an object, or
            the value is not an integer >= 1.
    """
    file = Path(path) / SPECULATIVE_FILE
    k = _recorded(path, "num_speculative_tokens", device_type)
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{file}: num_speculative_tokens must be an integer >= 1, got {k!r}")
    return k


def recommended_draft_vocab_size(path: str | Path, device_type: str = "cpu") -> int | None:
    """The draft vocabulary size recorded in `<path>/speculative.json` ("draft_vocab_size", its
    `per_device` entry for `device_type` first, as recommended_num_speculative_tokens), or None.

    Whether it fits the folder's draft_vocab.json: resolve_draft_vocab_size.
    Raises:
        ValueError: the file is not a JSON object, or `per_device` or its entry is not an object.
    """
    return _recorded(path, "draft_vocab_size", device_type)


def draft_auto_off_reason(path: str | Path, device_type: str = "cpu") -> str | None:
    """Why `--draft auto` should decode plainly with the drafter in `path` on `device_type`, or None.

    `<path>/speculative.json` may record `"draft_auto": false`: the fastest K measured slower than
    plain decoding on that device type, so the default should not speculate there (an explicit
    `--draft shipped`, a drafter path or K still does). Unlike K, the top level speaks for the CPU
    only (where `python -m blockdraft.bench.spec_k --write-default` measures); another device type
    needs its own `per_device` entry, since a GPU verifies K + 1 rows for about the cost of one;
    for the CPU a `per_device.cpu` entry's own `draft_auto` wins over the top level. The reason
    names the fastest measured K and its speedup when the deciding entry has a table.
    Raises:
        ValueError: `draft_auto` (at the top level or in any `per_device` entry) is not true /
            false, or the file is malformed (as _recorded).
    """
    file = Path(path) / SPECULATIVE_FILE
    data, per_device = _speculative_entries(path)
    for where, value in [("", data.get("draft_auto"))] + [
        (f"per_device.{d}.", e.get("draft_auto")) for d, e in per_device.items()
    ]:  # a bad value is an error whichever device reads the file
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{file}: {where}draft_auto must be true or false, got {value!r}")
    entry = per_device.get(device_type, {})
    if "draft_auto" not in entry and device_type == "cpu":
        entry = data  # the top level is the CPU's measurement
    if entry.get("draft_auto", True):
        return None
    rows = entry.get("table")
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("speedup"), (int, float))] \
        if isinstance(rows, list) else []
    best = max(rows, key=lambda r: r["speedup"], default=None)
    measured = f" (fastest: K = {best.get('k')} at {best['speedup']:.2f}x)" if best else ""
    return (f"{file} records that this drafter measured slower than plain decoding on {device_type}{measured}, "
            "so draft 'auto' decodes plainly; give --draft shipped / draft='shipped' (or a K, or a draft "
            "vocabulary size) to speculate anyway")


def _recorded(path: str | Path, key: str, device_type: str):
    """`key` from the speculative.json `per_device` entry of `device_type`, else the top level, else None."""
    data, per_device = _speculative_entries(path)
    entry = per_device.get(device_type, {})
    return entry[key] if key in entry else data.get(key)


def _speculative_entries(path: str | Path) -> tuple[dict, dict]:
    """(`<path>/speculative.json` as a dict, its `per_device` map); ({}, {}) without the file.

    Raises:
        ValueError: the file is not a JSON object, or `per_device` does not map device types to objects.
    """
    data = _read_speculative_json(path)
    per_device = data.get("per_device", {})
    if not isinstance(per_device, dict) or not all(isinstance(v, dict) for v in per_device.values()):
        raise ValueError(f"{Path(path) / SPECULATIVE_FILE}: per_device must map device types to JSON objects, "
                         f"e.g. {{\"cuda\": {{\"num_speculative_tokens\": 15}}}}, got {per_device!r:.80}")
    return data, per_device


def resolve_draft_vocab_size(
    size: int | None, path: str | Path, vocab_size: int | None = None, device_type: str = "cpu"
) -> int:
    """The draft vocabulary size for the drafter in `path`: `size` when given, else the folder's
    recorded one for `device_type` (recommended_draft_vocab_size), else 0 (the full vocabulary); checked against the
    folder's draft_vocab.json (blockdraft.spec.draft_vocab.check_draft_vocab_size) and, when
    `vocab_size` (the drafter's = the target's vocabulary) is given, its minimum size.

    Raises:
        ValueError / FileNotFoundError: a size that is not 0 or within [1, ids in the file], or
            nonzero without the file (naming where the size came from).
    """
    from blockdraft.spec.draft_vocab import check_draft_vocab_size

    if size is not None:
        return check_draft_vocab_size(size, path, vocab_size)
    recorded = recommended_draft_vocab_size(path, device_type)
    if recorded is None:
        return 0
    try:
        return check_draft_vocab_size(recorded, path, vocab_size)
    except (ValueError, FileNotFoundError) as e:
        raise param_error("draft_vocab_size", f"draft vocabulary size {recorded!r} recorded in "
                          f"{Path(path) / SPECULATIVE_FILE} cannot be used: {e} (draft_vocab_size 0 scores drafts "
                          f"over the full vocabulary)", type(e)) from e


def _read_speculative_json(path: str | Path) -> dict:
    """`<path>/speculative.json` as a dict ({} when the folder has none).

    Raises:
        ValueError: the file is not valid JSON or not a JSON object.
    """
    file = Path(path) / SPECULATIVE_FILE
    return _read_json_object(file) if file.is_file() else {}


def _read_json_object(file: Path) -> dict:
    """The JSON object in `file`. Raises ValueError naming the file: not valid JSON, or not an object."""
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def write_recommended_num_speculative_tokens(path: str | Path, k: int, evidence: dict | None = None) -> Path:
    """Write `<path>/speculative.json` with the (CPU) K and the measurements that chose it, keeping
    the file's `per_device` entries; returns the file.

    Raises:
        ValueError: k is not an integer >= 1.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise param_error("num_speculative_tokens", f"num_speculative_tokens must be an integer >= 1, got {k!r}")
    file = Path(path) / SPECULATIVE_FILE
    record = {"num_speculative_tokens": k, **(evidence or {})}
    per_device = _read_speculative_json(path).get("per_device") if file.is_file() else None
    if per_device is not None and "per_device" not in record:  # other devices' measurements stay
        record["per_device"] = per_device
    file.write_text(json.dumps(record, indent=1) + "\n")
    return file


def read_drafter_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of drafter folder `path` (z-lab names, CPU): its *.safetensors, or its 8-bit pack
    expanded to bf16.

    Raises:
        FileNotFoundError / ValueError: as load_drafter (no weights, a damaged file).
    """
    return _read_safetensors(Path(path))


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every weight tensor of the folder's *.safetensors (as vLLM / SGLang read a folder); a folder
    holding only an 8-bit pack (`model.int8`, as the shipped drafters do) is expanded to bf16."""
    from blockdraft.drafters.pack import PACK_FILE, unpack

    files = sorted(path.glob("*.safetensors"))
    if not files and (path / PACK_FILE).is_file():  # safetensors inside: no pickle
        return unpack(read_weights_file(path / PACK_FILE))
    if not files:
        raise FileNotFoundError(f"no *.safetensors (or {PACK_FILE}) in drafter folder {path} "
                                "(pickled .bin/.pt weights are not read)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in read_weights_file(file).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears in more than one file of {path}")
            tensors[name] = tensor
    return tensors


def read_weights_file(file: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file (CPU).

    Raises:
        ValueError: the file is truncated or not a safetensors file (names the file and what to do).
    """
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"drafter weights file {str(file)!r} is damaged or not a safetensors file ({e}); copy the "
            "drafter folder again (a shipped drafter's copy under <cache>/drafters/ is rebuilt when its "
            "folder is deleted)"
        ) from e


def export_drafter(model: DFlashDraftModel, path: str | Path) -> None:
    """Write `model` as a z-lab checkpoint: config.json + model.safetensors (bf16).

    The result loads in `load_drafter` and in z-lab's `DFlashDraftModel.from_pretrained`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_safetensors(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")


def random_drafter_config(
    target_config: ModelConfig,
    num_layers: int,
    block_size: int,
    target_layer_ids: tuple[int, ...] | list[int] | None = None,
    mask_token_id: int | None = None,
    **overrides,
) -> DFlashConfig:
    """The config of a drafter shaped for `target_config`, as released DFlash drafters are: layer
    shapes copy the target's (hidden, heads, kv heads, head_dim, FFN, eps, RoPE); target_layer_ids
    default to `build_target_layer_ids`; `mask_token_id` defaults to vocab_size - 1; `overrides`
    go to DFlashConfig (e.g. layer_types, sliding_window, causal_override).

    Raises:
        ValueError: refused by DFlashConfig or by `validate_against_target`.
    """
    t = target_config
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(t.num_hidden_layers, num_layers)
    fields = dict(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings,
        vocab_size=t.vocab_size,
        num_target_layers=t.num_hidden_layers,
        mask_token_id=t.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=tuple(target_layer_ids),
        block_size=block_size,
    )
    fields.update(overrides)
    config = DFlashConfig(**fields)
    config.validate_against_target(t)
    return config


def random_drafter(
    target_config: ModelConfig,
    num_layers: int,
    block_size: int,
    target_layer_ids: tuple[int, ...] | list[int] | None = None,
    seed: int = 0,
    *,
    init_std: float = 0.02,
    mask_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    **overrides,
) -> DFlashDraftModel:
    """A randomly initialised drafter shaped for `target_config` (tests and benchmarks).

    Config: `random_drafter_config`. Linear weights ~ N(0, init_std) (HF's 0.02 by default; tests
    use larger values so the context visibly moves the drafts), norm weights ~ 1 + N(0, 0.1) so the
    norms are exercised. Deterministic for a given seed. The noise is drawn on the CPU in float32
    (large drafters on a GPU: see blockdraft.bench.random_weights).
    """
    config = random_drafter_config(target_config, num_layers, block_size, target_layer_ids, mask_token_id, **overrides)
    model = empty_drafter(config, dtype, device)
    _init_random(model, seed, init_std)
    return model


@torch.no_grad()
def _init_random(model: DFlashDraftModel, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        else:
            p.copy_(std * noise)
