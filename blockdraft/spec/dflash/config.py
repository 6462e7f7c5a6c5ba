"""DFlash drafter configuration, parsed from (and exported to) the z-lab checkpoint `config.json`.

Format: DFLASH.md "Checkpoint format". Semantics follow the z-lab reference (`dflash/model.py`
v0.1.0), which reads every DFlash knob from `dflash_config` first and the top level second, and
builds its layers from an HF `Qwen3Config` (so HF Qwen3 defaults apply: head_dim 128, rope_theta
1e4, and `sliding_window` is ignored unless `use_sliding_window` is true).
"""

from __future__ import annotations

from dataclasses import dataclass

from blockdraft.config import ModelConfig
from blockdraft.errors import param_error
from blockdraft.layers.rotary import rope_inv_freq

ARCHITECTURE = "DFlashDraftModel"

# dflash_config keys we understand. Anything else is refused: an unknown key may change the math.
_KNOWN_DFLASH_KEYS = frozenset(
    {
        "mask_token_id",
        "target_layer_ids",
        "block_size",
        "causal",
        "use_swa",
        "swa_window_size",
        "sliding_window",
        "output_multiplier",
        "final_logit_softcapping",
        "input_embedding_scale",
        "sample_from_anchor",
        "projector_type",
        "shift_label",
        "pure_draft_prefix_len",
        "attention_sink_bias",
    }
)
# DFlash 2 (z-lab DFlash2DraftModel): grouped dynamic convolutions + a pairwise candidate selector.
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Keys we accept only at the value that leaves plain DFlash math unchanged.
_NEUTRAL_VALUES = {
    "sample_from_anchor": (False, "DSpark-style drafters (slot 0 predicts a token) are not supported"),
    "use_swa": (False, "non-causal sliding-window block attention (DSpark-style) is not supported"),
    "shift_label": (False, "shifted-label (DSpark-style) drafters are not supported"),
    "pure_draft_prefix_len": (0, "draft-only prefixes are not supported"),
    "attention_sink_bias": (False, "attention-sink biases are not supported"),
}
_PLAIN_PROJECTORS = (None, "dflash")
# Keys only a DFlash drafter's config.json holds at its top level: older files carry the DFlash values
# there, without a dflash_config block (from_hf_dict reads both). Other DFlash knobs (sliding_window,
# final_logit_softcapping, ...) are common target-model keys as well, so they mark nothing.
_TOP_LEVEL_DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "block_size", "num_target_layers")
DEFAULT_BLOCK_SIZE = 16  # z-lab `DFlashDraftModel.block_size` when the checkpoint has none


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Default target layer ids when a checkpoint lists none (z-lab `build_target_layer_ids`).

    n = `num_draft_layers` ids (one per DRAFT layer) evenly spaced from 1 to L-3:
    `round(1 + j*(L-4)/(n-1))`; a single-layer drafter taps layer L//2. Python `round` (half to even)
    as in the reference.

    Raises:
        ValueError: L < 4 with n > 1, or non-positive counts.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"num_target_layers ({num_target_layers}) and num_hidden_layers ({num_draft_layers}) must be >= 1"
        )
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"default target_layer_ids need num_target_layers >= 4, got {num_target_layers}")
    span = end - start
    return tuple(round(start + j * span / (num_draft_layers - 1)) for j in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter: N Qwen3 decoder layers + fc/hidden_norm context projection (DFLASH.md).

    Attributes beyond the Qwen3 fields:
        num_target_layers: depth L of the target the drafter was trained on (None if not recorded).
        mask_token_id: the mask ("parallel drafting") token, embedded with the target's embedding.
        target_layer_ids: target decoder layers whose OUTPUTS (HF `hidden_states[i + 1]`) are
            concatenated, in this order, into the [T, n*H] features.
        block_size: B = 1 anchor + (B-1) mask slots; the drafter proposes K <= B-1 tokens.
        layer_types: per draft layer "full_attention" | "sliding_attention".
        sliding_window: window of the sliding layers (tokens, incl. self), or None = unwindowed.
        causal_override: None = causal only for sliding layers; True/False forces every layer.
        output_multiplier, final_logit_softcapping, input_embedding_scale: logit/embedding scaling
            (z-lab `compute_logits` / `_raw_input_embeddings`); softcapping None = off.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    num_target_layers: int | None = None
    rope_scaling: dict | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    causal_override: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        self._check_sizes()
        self._check_layers()
        self._check_dflash()

    def _check_sizes(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)  # refuses unknown rope types

    def _check_layers(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected {self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"layer_types contains {bad}; allowed: full_attention, sliding_attention")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        for i, (causal, window) in enumerate(zip(self.layer_causal, self.layer_windows)):
            # The block attention (attention/torch_ref.py) windows only causally; the symmetric
            # window z-lab would build for a non-causal sliding layer has no backend here.
            if window is not None and not causal:
                raise ValueError(
                    f"layer {i} is a non-causal sliding_attention layer (is_causal / dflash_config.causal = "
                    "false with a sliding_window): non-causal windowed block attention is not supported"
                )

    def _check_dflash(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"dflash_config.block_size must be >= 2 (1 anchor + >= 1 mask), got {self.block_size}")
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("dflash_config.target_layer_ids must not be empty")
        if min(ids) < 0 or len(set(ids)) != len(ids):
            raise ValueError(f"dflash_config.target_layer_ids must be distinct and >= 0, got {list(ids)}")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            raise ValueError(
                f"dflash_config.target_layer_ids {list(ids)} has ids >= num_target_layers ({self.num_target_layers})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"dflash_config.mask_token_id {self.mask_token_id} is outside [0, vocab_size={self.vocab_size})"
            )
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ValueError(f"final_logit_softcapping must be > 0 or None, got {self.final_logit_softcapping}")

    # ---- derived -------------------------------------------------------------------------------

    @property
    def layer_causal(self) -> tuple[bool, ...]:
        """Per layer: causal inside the draft block? (override, else only sliding layers)."""
        if self.causal_override is not None:
            return (self.causal_override,) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: sliding window (tokens incl. self) or None."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def num_aux_layers(self) -> int:
        """n = number of target layers concatenated into the features ([T, n*H])."""
        return len(self.target_layer_ids)

    # ---- HF dict io ----------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "DFlashConfig":
        """Parse a DFlash checkpoint config.json dict (z-lab / vLLM / SGLang format).

        DFlash knobs are read from `dflash_config` first, then the top level (older files carry
        `block_size` at the top level), as z-lab's `_draft_value` does.

        Raises:
            ValueError: naming the key, for a non-DFlashDraftModel architecture (incl. DFlash 2), a
                non-qwen3 backbone, attention biases, a non-silu MLP, DFlash 2 / DSpark extras,
                unknown `dflash_config` keys or projector types, `sample_from_anchor=true`,
                `use_swa=true`, a missing mask_token_id, bad layer ids or layer types.
        """
        dcfg = cfg.get("dflash_config")
        if dcfg is None:
            dcfg = {}
        if not isinstance(dcfg, dict):
            raise ValueError(f"dflash_config must be a dict, got {type(dcfg).__name__}")
        _check_architecture(cfg)
        _check_dflash_keys(cfg, dcfg)
        num_layers = cfg.get("num_hidden_layers")
        if not isinstance(num_layers, int):
            raise ValueError(f"num_hidden_layers must be an integer, got {num_layers!r}")
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope(cfg)
        window, layer_types = _sliding(cfg, dcfg, num_layers)
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or 128,  # HF Qwen3Config default, which z-lab inherits
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            vocab_size=cfg["vocab_size"],
            num_target_layers=cfg.get("num_target_layers"),
            mask_token_id=_mask_token_id(cfg, dcfg),
            target_layer_ids=_target_layer_ids(cfg, dcfg, num_layers),
            block_size=int(_value(cfg, dcfg, "block_size", DEFAULT_BLOCK_SIZE)),
            layer_types=layer_types,
            sliding_window=window,
            causal_override=_causal_override(cfg, dcfg),
            output_multiplier=float(_value(cfg, dcfg, "output_multiplier", 1.0)),
            final_logit_softcapping=_softcap(_value(cfg, dcfg, "final_logit_softcapping", None)),
            input_embedding_scale=float(_value(cfg, dcfg, "input_embedding_scale", 1.0)),
        )

    def to_hf_dict(self) -> dict:
        """The z-lab config.json for this drafter (loads in z-lab's `DFlashDraftModel`, vLLM, SGLang).

        `block_size` is written both in `dflash_config` and at the top level (older readers), the
        causal override both as `is_causal` (z-lab) and `dflash_config.causal` (vLLM-style readers),
        and the window as `sliding_window` + `use_sliding_window` (HF Qwen3Config drops the window
        without the flag).
        """
        dflash: dict = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
        }
        if self.causal_override is not None:
            dflash["causal"] = self.causal_override
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        out = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "dtype": "bfloat16",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "max_window_layers": self.num_hidden_layers,
            "block_size": self.block_size,
            "dflash_config": dflash,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.causal_override is not None:
            out["is_causal"] = self.causal_override
        return out

    def check_num_speculative_tokens(self, k) -> int:
        """K, checked against this drafter: an integer in [1, block_size - 1]; returns it.

        Raises:
            ValueError: K out of range or not an integer (names K and the range).
        """
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.block_size - 1:
            raise param_error(
                "num_speculative_tokens",
                f"num_speculative_tokens must be in [1, block_size - 1 = {self.block_size - 1}] for this drafter, "
                f"got {k!r}"
            )
        return k

    def validate_against_target(self, target: ModelConfig) -> None:
        """Check that this drafter fits `target` (DFLASH.md: mismatches are clear errors).

        Raises:
            ValueError: hidden size or vocab size differ, a target layer id >= the target's depth,
                num_target_layers differs from the target's depth, or mask_token_id >= target vocab.
        """
        if self.hidden_size != target.hidden_size:
            raise ValueError(f"drafter hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.mask_token_id >= target.vocab_size:
            raise ValueError(f"drafter mask_token_id {self.mask_token_id} >= target vocab_size {target.vocab_size}")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        depth = target.num_hidden_layers
        bad = [i for i in self.target_layer_ids if i >= depth]
        if bad:
            raise ValueError(
                f"drafter dflash_config.target_layer_ids {list(self.target_layer_ids)} has ids {bad} >= the "
                f"target's num_hidden_layers ({depth})"
            )
        if self.num_target_layers is not None and self.num_target_layers != depth:
            raise ValueError(
                f"drafter was trained for num_target_layers={self.num_target_layers}, target has {depth} layers"
            )


# ---- parsing helpers ---------------------------------------------------------------------------


def _value(cfg: dict, dcfg: dict, name: str, default=None):
    """z-lab `_draft_value`: dflash_config[name], else top-level cfg[name], else default."""
    if name in dcfg:
        return dcfg[name]
    return cfg.get(name, default)


def is_dflash_config(cfg: dict) -> bool:
    """Whether the config.json dict `cfg` is a DFlash drafter's (one from_hf_dict loads, or refuses
    for a value): a dflash_config block, a DFlash architecture (DFlash 2 included) or DFlash keys at
    its top level (an older file). A target model's config is none of these."""
    archs = cfg.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    return ("dflash_config" in cfg or any(a in (ARCHITECTURE, "DFlash2DraftModel") for a in archs if isinstance(a, str))
            or any(key in cfg for key in _TOP_LEVEL_DFLASH_KEYS))


def _check_architecture(cfg: dict) -> None:
    archs = cfg.get("architectures") or []
    if "DFlash2DraftModel" in archs:
        raise ValueError(
            "architectures ['DFlash2DraftModel'] (DFlash 2) is not supported; expected ['DFlashDraftModel']"
        )
    if ARCHITECTURE not in archs:
        raise ValueError(f"architectures {archs!r} is not a DFlash drafter; expected ['{ARCHITECTURE}']")
    if cfg.get("model_type", "qwen3") != "qwen3":
        raise ValueError(f"model_type {cfg['model_type']!r} is not supported for DFlash drafters; expected 'qwen3'")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported: DFlash draft projections have no bias")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; expected 'silu'")


def _check_dflash_keys(cfg: dict, dcfg: dict) -> None:
    for key in _DFLASH2_KEYS:
        if _value(cfg, dcfg, key) is not None:
            raise ValueError(f"dflash_config.{key} is a DFlash 2 extra; DFlash 2 drafters are not supported")
    unknown = sorted(set(dcfg) - _KNOWN_DFLASH_KEYS)
    if unknown:
        raise ValueError(f"dflash_config has unknown keys {unknown}; known: {sorted(_KNOWN_DFLASH_KEYS)}")
    projector = _value(cfg, dcfg, "projector_type")
    if projector not in _PLAIN_PROJECTORS:
        raise ValueError(f"dflash_config.projector_type {projector!r} is not supported; supported: {_PLAIN_PROJECTORS}")
    for key, (neutral, why) in _NEUTRAL_VALUES.items():
        value = _value(cfg, dcfg, key)
        if value is not None and value != neutral:
            raise ValueError(f"dflash_config.{key}={value!r}: {why}")


def _mask_token_id(cfg: dict, dcfg: dict) -> int:
    mask = _value(cfg, dcfg, "mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise ValueError(f"dflash_config.mask_token_id must be an integer, got {mask!r}")
    return mask


def _target_layer_ids(cfg: dict, dcfg: dict, num_layers: int) -> tuple[int, ...]:
    ids = _value(cfg, dcfg, "target_layer_ids")
    if ids is None:
        depth = cfg.get("num_target_layers")
        if not isinstance(depth, int):
            raise ValueError("dflash_config.target_layer_ids is absent and num_target_layers is not set")
        return build_target_layer_ids(depth, num_layers)
    if not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"dflash_config.target_layer_ids must be a list of integers, got {ids!r}")
    return tuple(ids)


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from legacy rope_theta/rope_scaling or HF 5 rope_parameters (like ModelConfig)."""
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    return float(theta), scaling


def _window(value) -> int | None:
    """Normalise the no-window spellings (None, 0, -1)."""
    if value in (None, 0, -1):
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sliding window must be an integer, got {value!r}")
    return value


def _sliding(cfg: dict, dcfg: dict, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer_types). HF Qwen3Config keeps `sliding_window` only with use_sliding_window;
    dflash_config.swa_window_size (alias dflash_config.sliding_window) sets it explicitly."""
    hf_window = _window(cfg.get("sliding_window")) if cfg.get("use_sliding_window") else None
    explicit = _window(dcfg.get("swa_window_size", dcfg.get("sliding_window")))
    if explicit is not None and hf_window is not None and explicit != hf_window:
        raise ValueError(
            f"dflash_config.swa_window_size ({explicit}) differs from sliding_window ({hf_window})"
        )
    window = explicit if explicit is not None else hf_window
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # HF Qwen3Config's rule
        first = cfg.get("max_window_layers", 28)
        layer_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
        ]
    if "sliding_attention" not in layer_types:
        window = None
    return window, tuple(layer_types)


def _causal_override(cfg: dict, dcfg: dict) -> bool | None:
    """config.is_causal > dflash_config.causal > None (DFLASH.md "Query block")."""
    for where, value in (("is_causal", cfg.get("is_causal")), ("dflash_config.causal", dcfg.get("causal"))):
        if value is not None:
            if not isinstance(value, bool):
                raise ValueError(f"{where} must be a boolean, got {value!r}")
            return value
    return None


def _softcap(value) -> float | None:
    """z-lab applies softcapping only when the value is set and > 0."""
    if value is None or float(value) <= 0:
        return None
    return float(value)
